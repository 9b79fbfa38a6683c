"""tvm-evt: training compiler for PyTorch models on TVM Relax with CUTLASS EVT epilogue fusion."""

__version__ = "0.1.0"

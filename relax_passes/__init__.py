"""Training-graph generation and EVT graph passes (tvm_evt.relax_passes)."""

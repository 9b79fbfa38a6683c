"""The partitioner (before it, optionally, ``RecomputeActivationsInBackward`` marks activations the
backward computes again): on the CUDA route ``PadUnalignedMatmuls`` first pads the matmuls whose strides
TMA cannot take; ``PartitionEVT`` chooses GEMM + epilogue groups by integer linear programming
(python-mip) under the cost model of ``evt_cost``, asking ``codegen.legality`` what an epilogue can
express; then ``AbsorbPartitionInputCasts``, ``DeduplicateEVTPartitions``, and on the CPU route
``InlineEVTPartitions``."""

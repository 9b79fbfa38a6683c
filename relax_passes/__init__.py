"""The Relax passes of tvm-evt, one subpackage per stage of the pipeline, in its order.

``training/``   the training graph from an imported forward: dropout as Philox masks, the custom ops
                introduced before ``Gradient`` (attention, batch norm, implicit-GEMM convolutions),
                mixed precision and loss scaling, the gradient rules TVM lacks, the optimizer step
``ops/``        the custom Relax ops (``tvm_evt.attention``, ``tvm_evt.batch_norm``,
                ``tvm_evt.conv2d*``), each with its legalisation and its gradient
``graph/``      the EVT paper's graph passes, which expose epilogue fusion on the joint
                forward + backward graph (``evt_graph_passes``)
``partition/``  the python-mip ILP partitioner into GEMM + epilogue groups, its cost model,
                deduplication, and the CPU reference that inlines the partitions back
``lower/``      the CUDA route: offloads to the flash-attention and convolution codegens, the row
                and column kernels, and the TIR schedules of the kernels TVM builds

``python/tvm_evt/pipeline.py`` lists the phases in the order they run (``PHASES``); the shared
rewriting helpers are in ``_rewrite.py``.
"""

"""The CUDA route after partitioning: attention and convolution calls offloaded to their codegens
(``OffloadAttention``, ``OffloadConv``), every kernel prebuilt in one nvcc batch, then the kernels
TVM builds shaped and scheduled (row kernels for softmax and layer norm, column sums, split
reductions, bounded fusion, DLight rules applied per function)."""

"""Custom Relax ops of the training graph, each with its shape rule, legalisation and gradient:
``tvm_evt.attention`` (flash attention), ``tvm_evt.batch_norm`` (training batch norm with a
closed-form gradient), ``tvm_evt.conv2d`` with its two gradients (implicit GEMM),
``tvm_evt.depthwise_conv2d`` with its two gradients (direct kernels), ``tvm_evt.hardtanh``
(ReLU6, its gradient from its output) and ``tvm_evt.max_pool2d_backward`` (a max pooling's input
gradient as two gathers)."""

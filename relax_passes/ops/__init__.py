"""Custom Relax ops of the training graph, each with its shape rule, legalisation and gradient:
``tvm_evt.attention`` (flash attention), ``tvm_evt.batch_norm`` (training batch norm with a
closed-form gradient) and ``tvm_evt.conv2d`` with its two gradients (implicit GEMM)."""

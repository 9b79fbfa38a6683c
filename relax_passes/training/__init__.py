"""The training graph: the imported forward rewritten for training, differentiated and given its
optimizer step (steps 3-6 of ``tvm_evt.training``).

Forward rewrites, before ``relax.transform.Gradient``: ``RecognizeActivations`` (a written-out GELU
as its op), ``LowerDropout`` (Philox masks),
``ExpandSmallPower``, ``SplitFusedProjection``, ``FoldNormAffine``, ``ConvertConvLayout``, ``CancelTransposes``,
``Conv2dToMatmul``, ``FuseAttention``, ``GroupAttentionHeads`` (grouped-query attention's
repeated key/value heads into the attention op), ``PadAttentionKeys``, ``AutoMixedPrecision`` and
``ScaleLoss``, ``FuseBatchNorm``.  ``gradient_rules`` registers the gradients TVM 0.27 lacks;
``AppendOptimizer`` appends the fused optimizer update (``optimizers``, ``optimizer_update``,
``write_back``) as ``train_step``.  For data parallel (``tvm_evt.distributed``), ``SplitAdjoint``
cuts ``main_adjoint`` into one function per gradient bucket and ``AppendBucketUpdates`` adds each
bucket's update (or ZeRO-1 shard's) and the step counter's ``advance``.
"""

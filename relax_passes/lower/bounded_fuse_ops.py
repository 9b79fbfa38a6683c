"""BoundedFuseOps: TVM's ``FuseOps`` with a cap on the ops one fused function may hold.

TVM 0.27 fuses up to 256 ops into one PrimFunc (``relax.FuseOps.max_depth``).  The backward of
XML-CNN's convolutions over the sequence (pads, strided slices and adds per output position)
became one function of several hundred blocks, on which DLight's GEMV rule (``compute_inline``
over every block pair) did not finish in ten minutes; the GPU step never got compiled.  A cap of
``MAX_FUSED_OPS`` keeps every fused function small enough for DLight's rules while leaving the
chains of real models whole (LayerNorm, softmax and their gradients fuse fewer than ten ops).
The cap was 32 until col2im (the gradient of a 3x3 im2col, `SplitToSlices`) needed about 45:
9 slices, 9 squeezes, 14 pads, 8 adds, the pad's slice and ReLU's backward; at 32 four taps
were written out padded and read back (ResNet-50 conv3_x), and XML-CNN's schedule took 38 s
instead of 33 s on the CPU at 64.
"""

from __future__ import annotations

import tvm
from tvm import relax

MAX_FUSED_OPS = 64
CONFIG_KEY = "relax.FuseOps.max_depth"


@tvm.transform.module_pass(opt_level=0, name="BoundedFuseOps")
class BoundedFuseOps:
    """``relax.transform.FuseOps()`` with ``relax.FuseOps.max_depth`` at most ``max_depth``."""

    def __init__(self, max_depth: int = MAX_FUSED_OPS):
        self.max_depth = max_depth

    def transform_module(self, mod: tvm.IRModule, ctx: tvm.transform.PassContext) -> tvm.IRModule:
        config = dict(ctx.config.items()) if ctx.config is not None else {}
        depth = min(int(config.get(CONFIG_KEY, self.max_depth)), self.max_depth)
        config[CONFIG_KEY] = depth
        with tvm.transform.PassContext(opt_level=ctx.opt_level, config=config,
                                       required_pass=list(ctx.required_pass),
                                       disabled_pass=list(ctx.disabled_pass)):
            return relax.transform.FuseOps()(mod)

"""SaveSoftmaxLowPrecision: the softmax gradient reads the probabilities as rounded for the forward.

Under mixed precision the attention probabilities ``p = softmax(s)`` are float32, and the forward
immediately rounds them (``pb = astype(p, bf16)``) for the ``P·V`` GEMM.  The backward's
``dS = p * (dP - D)`` reads ``p`` itself, so the training step keeps a float32 B×H×S×S tensor
alive from forward to backward: on BERT-Large (32x16x512x512) 537 MB written by the softmax
kernel and read again by the dS GEMM's epilogue, twice the bytes of the bf16 copy that exists
anyway.  This pass makes every float32 reader of ``p`` other than the cast read
``astype(pb, float32)`` instead, so only ``pb`` is kept (the partitioner fuses the widening cast
into the dS epilogue's load, and ``FuseSoftmaxDropout`` writes ``pb`` next to the dropped copy).

The values change by the bf16 rounding of ``p`` (relative 2^-9), the same rounding ``dS`` itself
gets when it is stored in bf16 for the dQ/dK GEMMs one op later; FlashAttention-style kernels
instead recompute ``p`` in float32.  Softmaxes without a low-precision cast are left alone.
"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from .._rewrite import mutate_relax_functions, static_shape
from ..lower._row_kernel import LOW

SOFTMAX = tvm.ir.Op.get("relax.nn.softmax")
ASTYPE = tvm.ir.Op.get("relax.astype")
RESHAPE = tvm.ir.Op.get("relax.reshape")


def softmaxes(bindings: list) -> set:
    """The vars bound to a softmax."""
    return {b.var for b in bindings if isinstance(b.value, relax.Call) and b.value.op == SOFTMAX}


def low_precision_copies(func: relax.Function, sources=softmaxes, through_reshape: bool = False) -> dict:
    """``{p: pb}`` for each float32 ``p`` of ``sources(bindings)`` (a softmax, by default) with a
    binding ``pb = astype(p, low)`` (or, `through_reshape`, ``pb = astype(reshape(p), low)``)."""
    bindings = [b for block in func.body.blocks for b in block.bindings if isinstance(b, relax.VarBinding)]
    wide = {v for v in sources(bindings) if str(v.ty.dtype) == "float32"}
    reshaped = {b.var: b.value.args[0] for b in bindings if through_reshape
                and isinstance(b.value, relax.Call) and b.value.op == RESHAPE and b.value.args[0] in wide}
    copies = {}
    for b in bindings:
        v = b.value
        if isinstance(v, relax.Call) and v.op == ASTYPE and str(v.attrs.dtype) in LOW:
            p = reshaped.get(v.args[0], v.args[0])
            if p in wide:
                copies.setdefault(p, b.var)
    return copies


@mutator
class LowPrecisionReader(PyExprMutator):
    """Readers of a float32 value of ``sources`` after its 16-bit copy read the widened copy
    (``prime(func, sources, through_reshape)`` before each function)."""

    def prime(self, func: relax.Function, sources=softmaxes, through_reshape: bool = False) -> None:
        self.copies = low_precision_copies(func, sources, through_reshape)
        self.ready = set()  # values whose copy is bound already (readers before it keep p)
        self.widened = {}

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        value = self._reroute(binding.value)
        if value is None:
            super().visit_var_binding_(binding)
        else:
            self.set_var_remap(binding.var, self.builder_.emit(self.visit_expr(value)))
        self.ready |= {p for p, pb in self.copies.items() if pb.same_as(binding.var)}

    def _reroute(self, value):
        """`value` with each such value it reads replaced by the widened low-precision copy, or
        None when it reads none."""
        if not isinstance(value, relax.Call) or not any(a in self.ready for a in value.args):
            return None
        args = [self._widened(a) if a in self.ready else a for a in value.args]
        return relax.Call(value.op, args, value.attrs, value.ty_args)

    def _widened(self, p):
        if p not in self.widened:
            low = self.visit_expr(self.copies[p])
            if static_shape(low) != static_shape(p):  # a copy of reshape(p): a view back to p's shape
                low = self.builder_.emit(relax.op.reshape(low, p.ty.shape))
            self.widened[p] = self.builder_.emit(relax.op.astype(low, "float32"))
        return self.widened[p]


@tvm.transform.module_pass(opt_level=0, name="SaveSoftmaxLowPrecision")
class SaveSoftmaxLowPrecision:
    """Readers of a float32 softmax that also has a 16-bit copy read the widened copy instead."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        rewriter = LowPrecisionReader(mod)
        return mutate_relax_functions(rewriter, mod, before_each=rewriter.prime)

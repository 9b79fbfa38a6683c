"""GatherBeforeSlice: a pick (``gather_elements``) from a prefix slice reads the sliced tensor.

``gather_elements(strided_slice(x, [a], [0], [n], [1]), idx, a)`` → ``gather_elements(x, idx, a)``
when the slice only cuts ``x`` along the gather axis ``a`` to a prefix: every index lies in
``[0, n)`` (``gather_elements`` requires it), where the slice and ``x`` hold the same elements.

A causal LM's loss picks each token's label logit from logits that ``PadUnalignedMatmuls`` computed
padded (GPT-2's vocabulary 50257 → 50264 columns) and sliced back.  The pick cannot take the slice
into its kernel (an indexed load: FuseOps fuses nothing into it), so the whole slice was copied for
it: 3.3 GB a step at GPT-2 medium's [16384, 50257] (``tuning.kernel_traffic``'s model), for one
element a row.  CUDA route, before ``RecomputeElementwise`` (the slice's other readers recompute
it in their kernels).
"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from .._rewrite import mutate_relax_functions, producer, static_shape

GATHER_ELEMENTS = tvm.ir.Op.get("relax.gather_elements")
SLICE = tvm.ir.Op.get("relax.strided_slice")


def prefix_slice_along(call: relax.Call, axis: int) -> bool:
    """Is `call` a ``strided_slice`` that keeps a prefix of its operand along `axis` and all of
    every other axis?"""
    src, out = static_shape(call.args[0]), static_shape(call)
    if src is None or out is None or len(src) != len(out):
        return False
    bounds = call.args[1:5]  # axes, begin, end and (when given) strides
    if not all(isinstance(v, relax.Tuple) and all(isinstance(f, tvm.tirx.IntImm) for f in v.fields)
               for v in bounds):
        return False  # (symbolic bounds: left alone)
    axes, begin, _end, *given = ([int(f) for f in v.fields] for v in bounds)
    strides = given[0] if given else [1] * len(axes)
    sliced = {a % len(src): (b, s) for a, b, s in zip(axes, begin, strides)}
    cut = [a for a in range(len(src)) if out[a] != src[a]]
    return set(sliced) <= {axis} and set(cut) <= {axis} and all(b == 0 and s == 1 for b, s in sliced.values())


@mutator
class _Picker(PyExprMutator):
    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if call.op != GATHER_ELEMENTS:
            return call
        data, idx = call.args
        ndim = len(static_shape(data) or ())
        axis = int(call.attrs.axis) % ndim if ndim else 0
        sliced = producer(self, data, SLICE)
        if sliced is None or not prefix_slice_along(sliced, axis):
            return call
        return relax.op.gather_elements(sliced.args[0], idx, axis)


@tvm.transform.module_pass(opt_level=0, name="GatherBeforeSlice")
class GatherBeforeSlice:
    """Picks from a prefix slice read the sliced tensor (module docstring)."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        return mutate_relax_functions(_Picker(mod), mod)

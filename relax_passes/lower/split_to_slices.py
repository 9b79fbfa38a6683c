"""SplitToSlices: ``split`` as one ``strided_slice`` per piece, so each piece fuses into its reader.

``split`` legalizes to one PrimFunc with a tensor per piece, and FuseOps fuses nothing after a
multi-output op: every piece is written out and read back.  Concat's gradient is a split, and
im2col's (`Conv2dToMatmul`: taps stacked by ``concat``) is a split of the column gradient into the
KH*KW taps, each then padded back to the input's window and summed (col2im).  On H100 the split
of ResNet-50 conv3_x's [100352, 9, 128] bf16 column gradient took 0.46 ms as 9 kernels, and the
pads four more kernels, before the one that summed them.  As slices, FuseOps can make the whole
col2im one gather: each input-gradient element reads its KH*KW column entries.

Static shapes only; a split whose piece boundaries are not known stays as it is.  CUDA only (the
evt pipeline's CUDA phase), before ``LegalizeOps``.
"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from .._rewrite import mutate_relax_functions, static_shape

SPLIT = tvm.ir.Op.get("relax.split")


def piece_bounds(extent: int, indices_or_sections) -> list[tuple[int, int]] | None:
    """[begin, end) of each piece of a split of an axis of `extent`, or None."""
    if isinstance(indices_or_sections, (int, tvm.tirx.IntImm)):
        sections = int(indices_or_sections)
        if sections <= 0 or extent % sections:
            return None
        step = extent // sections
        return [(k * step, (k + 1) * step) for k in range(sections)]
    edges = [0, *[int(i) for i in indices_or_sections], extent]
    if any(b < a for a, b in zip(edges, edges[1:])):
        return None  # unsorted or out-of-range cuts: left to split's own legalization
    return list(zip(edges, edges[1:]))


@mutator
class _Rewriter(PyExprMutator):
    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if call.op != SPLIT:
            return call
        shape = static_shape(call.args[0])
        if shape is None:
            return call
        axis = int(call.attrs.axis) % len(shape)
        bounds = piece_bounds(shape[axis], call.attrs.indices_or_sections)
        if bounds is None:
            return call
        x = call.args[0]
        return relax.Tuple([self.builder_.emit(relax.op.strided_slice(x, [axis], [b], [e])) for b, e in bounds])


@tvm.transform.module_pass(opt_level=0, name="SplitToSlices")
class SplitToSlices:
    """Rewrite every static ``split`` of every Relax function (module docstring)."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        mod = mutate_relax_functions(_Rewriter(mod), mod)
        # piece i read as slice_i, not through a tuple of the slices: FuseOps fuses no producer
        # into a tuple, so the slices would stay kernels of their own
        mod = relax.transform.CanonicalizeBindings()(mod)
        out = tvm.IRModule(dict(mod.functions_items()), attrs=mod.attrs)
        for gv, func in mod.functions_items():
            if isinstance(func, relax.Function):
                out[gv] = relax.analysis.remove_all_unused(func)  # the tuples nobody reads now
        return out

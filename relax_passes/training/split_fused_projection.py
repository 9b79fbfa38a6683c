"""SplitFusedProjection: a linear layer whose output is split along its features (a fused
projection, such as one computing queries, keys and values at once) as one linear layer per piece,
on the matching rows of its weight and bias.

    y = add(b, matmul(x, permute_dims(W, [1, 0])))         # W [N, K], b [N]
    t = split(reshape(y, [..., N]), [n1, n2], axis=-1)
  ->
    y_i = add(strided_slice(b, [0], [s_i], [e_i]),
              matmul(x, permute_dims(strided_slice(W, [0], [s_i], [e_i]), [1, 0])))
    t = (reshape(y_0, [..., n1]), reshape(y_1, [..., n2 - n1]), reshape(y_2, [..., N - n2]))

A weight stored [K, N] and read as it is (transformers' ``Conv1D``, GPT-2's ``c_attn``:
``addmm(b, x, W)``) is sliced along its columns instead: ``matmul(x, strided_slice(W, [1], [s_i],
[e_i]))``.

The same GEMM work as three N/3 GEMMs, but the split no longer copies the [tokens, N] output into
three tensors, and the backward pass no longer concatenates the three gradients back into one
[tokens, N] tensor for the input-gradient and weight-gradient GEMMs: the input gradient becomes a
sum of three GEMMs (adds the epilogues can take), the weight gradient three GEMMs whose rows
``strided_slice``'s gradient places.  Only the weight and bias (kilobytes to megabytes) are sliced.
On by default (``pipeline.OPTIONAL["split_projection"]``): on H100 (bf16) GPT-2 medium's step went
from 3.93 to 3.87 ms; the copies and the concatenation (0.07 + 0.07 ms) gave way to 14 more,
smaller kernel launches.
"""
from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from .._rewrite import mutate_relax_functions, producer, static_shape, swaps_last_two
from ..lower.split_to_slices import piece_bounds

ADD = tvm.ir.Op.get("relax.add")
MATMUL = tvm.ir.Op.get("relax.matmul")
PERMUTE = tvm.ir.Op.get("relax.permute_dims")
RESHAPE = tvm.ir.Op.get("relax.reshape")
SPLIT = tvm.ir.Op.get("relax.split")


def _sections(split: relax.Call, n: int) -> list[tuple[int, int]] | None:
    """The [begin, end) feature ranges of a split of the last axis (extent `n`), else None."""
    ndim = split.args[0].ty.ndim
    if int(split.attrs.axis) % ndim != ndim - 1:
        return None
    bounds = piece_bounds(n, split.attrs.indices_or_sections)
    return bounds if bounds is not None and all(b < e for b, e in bounds) else None


@mutator
class _Splitter(PyExprMutator):
    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if call.op != SPLIT:
            return call
        reshape = producer(self, call.args[0], RESHAPE)
        linear = producer(self, reshape.args[0] if reshape is not None else call.args[0], ADD)
        if linear is None:
            return call
        bias, product = linear.args
        matmul = producer(self, product, MATMUL)
        if matmul is None:
            bias, matmul = product, producer(self, bias, MATMUL)
        if matmul is None:
            return call
        permute = producer(self, matmul.args[1], PERMUTE)
        if permute is not None and permute.args[0].ty.ndim == 2 and swaps_last_two(permute):
            weight, features = permute.args[0], 0  # W [N, K] read transposed (torch.nn.Linear)
        elif matmul.args[1].ty.ndim == 2:
            weight, features = matmul.args[1], 1  # W [K, N] read as it is (transformers' Conv1D: GPT-2)
        else:
            return call
        shape = static_shape(weight)
        n = shape[features] if shape is not None else None
        out_shape = static_shape(call.args[0])
        if n is None or out_shape is None or out_shape[-1] != n or static_shape(bias) != (n,):
            return call
        sections = _sections(call, n)
        if sections is None:
            return call
        pieces = []
        for begin, end in sections:
            w = self.builder_.emit(relax.op.strided_slice(weight, [features], [begin], [end]))
            b = self.builder_.emit(relax.op.strided_slice(bias, [0], [begin], [end]))
            mm = self.builder_.emit(relax.op.matmul(matmul.args[0], relax.op.permute_dims(w, [1, 0]) if features == 0
                                                    else w, out_dtype=matmul.attrs.out_dtype))
            y = self.builder_.emit(relax.op.add(b, mm))
            pieces.append(self.builder_.emit(relax.op.reshape(y, [*out_shape[:-1], end - begin])))
        return relax.Tuple(pieces)


@tvm.transform.module_pass(opt_level=0, name="SplitFusedProjection")
class SplitFusedProjection:
    """Split every linear layer whose output is split along its features into one layer per piece."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        mod = mutate_relax_functions(_Splitter(mod), mod)
        return relax.transform.DeadCodeElimination()(relax.transform.CanonicalizeBindings()(mod))

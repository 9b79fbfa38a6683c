"""FuseSoftmaxDropout: attention's softmax and the dropout applied to it as one CUDA kernel.

In the training graph the attention probabilities leave the softmax twice: in float32 for the
softmax gradient, and cast to the low-precision dtype, masked and scaled (dropout) as the operand
of the ``P·V`` GEMM.  TVM legalizes ``softmax`` into an opaque PrimFunc, so FuseOps cannot give
it the elementwise tail, and DLight ran the tail as a separate kernel that read the float32
probabilities back (BERT-Large, 32x16x512x512: softmax 0.44 ms + tail 0.74 ms on H100).  Here::

    p  = softmax(s, axis=-1)          # s: float32 [..., n] (or astype(s16, float32)), p used elsewhere
                                      # s (or s16) may be add(x, bias) with a constant bias [n]
    pb = astype(p, low)               # then, each optional, in this order:
    pw = where(mask, pb, 0)           #   the dropout keep mask
    pd = multiply(pw, scale)          #   the 1/(1-rate) scale (a scalar)

becomes one ``call_tir`` with outputs ``(p, pd)``, scheduled here: one thread block per row
(rows staged in shared memory, max and sum as cross-thread reductions), each element computed
with the same operations in the same order as before.  ``p`` is bit-identical; in the 16-bit tail
the code generator may keep the cast-then-scale in float32 and round once where the separate
kernels rounded twice (a difference of at most 1 ulp).  ``p`` is only written when something
else reads it; a widening ``astype`` that only feeds the softmax is read through (the
partitioner leaves it out of the GEMM epilogue: ``evt_cost.WIDENING_CONSUMERS``), and so is the
add of a constant row bias read by nothing else (``PadAttentionKeys``' -inf on the padded keys,
which a GEMM epilogue cannot take: it has no vector constants).  The tail's intermediate values
must have no other user, and ``p``'s other users must come after ``pd`` (the fused call sits
where ``pd`` was).
CUDA only: part of the evt pipeline's CUDA phase, before ``LegalizeOps``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import tvm
from tvm import relax, te, tirx

from .._rewrite import add_function_once, binding_uses, emit_call_tir, flat_bindings, scalar_value, static_shape
from ._row_kernel import LOW, block_names, fuse_chains, schedule_rows, scheduled as mark_scheduled

SOFTMAX = tvm.ir.Op.get("relax.nn.softmax")
ASTYPE = tvm.ir.Op.get("relax.astype")
WHERE = tvm.ir.Op.get("relax.where")
MULTIPLY = tvm.ir.Op.get("relax.multiply")
ADD = tvm.ir.Op.get("relax.add")


@dataclass(frozen=True)
class SoftmaxDropoutMatch:
    """One match, keyed by the tail's last var ``pd``: ``write_p`` when something besides the
    tail reads ``p``; ``pb`` the cast's var when something besides the tail reads it, else None."""

    p: relax.Var
    s: relax.Expr
    mask: relax.Expr | None
    scale: float | None
    low: str
    write_p: bool
    pb: relax.Var | None
    bias: relax.Expr | None = None  # a constant [n] added to s first

    @property
    def absorbed(self) -> frozenset:
        return frozenset({self.p})  # the tail's own bindings go unused: dead-code elimination


def softmax_dropout_primfunc(shape: tuple[int, ...], low: str, masked: bool, scale: float | None,
                             write_p: bool, scheduled: bool = True, in_dtype: str = "float32",
                             write_pb: bool = False, biased: bool = False) -> tirx.PrimFunc:
    """``p = softmax(s.astype(float32), axis=-1)``, ``pb = p.astype(low)`` and
    ``pd = where(mask, pb, 0) * scale`` for tensors of `shape`; outputs ``[p] [pb] pd`` as
    `write_p` / `write_pb` say; scheduled for CUDA (module docstring) unless `scheduled` is False.
    With `biased`, ``s`` is ``x + bias`` for a second input ``bias`` [n] (in `in_dtype`)."""
    *lead, n = shape
    x = te.placeholder(shape, in_dtype, name="s")
    bias = te.placeholder((n,), in_dtype, name="bias") if biased else None

    def s(idx):
        v = x[idx] if bias is None else x[idx] + bias[idx[-1]]
        return v if in_dtype == "float32" else v.astype("float32")

    mask = te.placeholder(shape, "bool", name="mask") if masked else None
    k1 = te.reduce_axis((0, n), name="k1")
    k2 = te.reduce_axis((0, n), name="k2")
    row_max = te.compute(lead, lambda *r: te.max(s((*r, k1)), axis=k1), name="row_max")
    row_sum = te.compute(lead, lambda *r: te.sum(te.exp(s((*r, k2)) - row_max[r]), axis=k2), name="row_sum")

    def prob(*idx):
        return te.exp(s(idx) - row_max[idx[:-1]]) / row_sum[idx[:-1]]

    def dropped(*idx):
        v = prob(*idx).astype(low)
        if masked:
            v = tirx.Select(mask[idx], v, tirx.const(0, low))
        if scale is not None:  # the graph's scale is a constant cast to `low`: round it the same way
            v = v * tirx.const(_round_to(scale, low), low)
        return v

    def values(*idx):  # one block, up to three outputs
        return tuple(([prob(*idx)] if write_p else []) + ([prob(*idx).astype(low)] if write_pb else [])
                     + [dropped(*idx)])

    n_out = 1 + int(write_p) + int(write_pb)
    outs = list(te.compute(shape, values, name="out")) if n_out > 1 else [te.compute(shape, dropped, name="out")]
    func = te.create_prim_func([x, *([bias] if biased else []), *([mask] if masked else []), *outs])
    if not scheduled:
        return func
    sch = tvm.s_tir.Schedule(func)  # the row staged in shared memory, then max, sum and the outputs
    schedule_rows(sch, block_names("out", n_out), ["row_max", "row_sum"], n, stage=True)
    return mark_scheduled(sch)


def _round_to(value: float, dtype: str) -> float:
    import ml_dtypes

    return float(np.array(value, "float32").astype(ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype))


def _row_constant(expr: relax.Expr, n: int, dtype: str) -> bool:
    return isinstance(expr, tvm.ir.GenericConst) and static_shape(expr) == (n,) and str(expr.ty.dtype) == dtype


def find_fusions(func: relax.Function) -> dict:
    """``{pd: SoftmaxDropoutMatch}`` for each match of the module docstring's pattern."""
    bindings = flat_bindings(func)[0]
    bound = {b.var: b.value for b in bindings}
    index = {b.var: i for i, b in enumerate(bindings)}
    uses = binding_uses(func)

    def only_user(var):
        users = uses.get(var, [])
        if len(users) != 1 or users[0] >= len(bindings):
            return None
        return bindings[users[0]]

    found = {}
    for b in bindings:
        call = b.value
        if not (isinstance(call, relax.Call) and call.op == SOFTMAX):
            continue
        shape = static_shape(call)
        if shape is None or str(call.ty.dtype) != "float32" or int(call.attrs.axis) % len(shape) != len(shape) - 1:
            continue
        cast = next((bindings[i] for i in uses.get(b.var, []) if i < len(bindings)
                     and isinstance(bindings[i].value, relax.Call) and bindings[i].value.op == ASTYPE
                     and str(bindings[i].value.attrs.dtype) in LOW), None)
        if cast is None:
            continue
        tail, mask, scale = cast, None, None
        where = next((bindings[i] for i in uses.get(cast.var, []) if i < len(bindings)
                      and isinstance(bindings[i].value, relax.Call) and bindings[i].value.op == WHERE
                      and bindings[i].value.args[1].same_as(cast.var)
                      and scalar_value(bound, bindings[i].value.args[2]) == 0.0
                      and static_shape(bindings[i].value.args[0]) == shape), None)
        if where is not None:
            tail, mask = where, where.value.args[0]
        nxt = only_user(tail.var)
        if nxt is not None and nxt.value.op == MULTIPLY and nxt.value.args[0].same_as(tail.var):
            scale = scalar_value(bound, nxt.value.args[1])
            tail = nxt if scale is not None else tail
        if mask is None and scale is None:
            continue  # a bare cast: nothing to gain over TVM's two kernels
        if tail.var.same_as(cast.var) or (mask is None and len(uses.get(cast.var, [])) != 1):
            continue
        others = [i for i in uses.get(b.var, []) if i != index[cast.var]]
        # the cast read besides the tail (SaveSoftmaxLowPrecision: the softmax gradient): an output
        first = where if mask is not None else tail  # the tail's op that reads the cast
        cast_others = [i for i in uses.get(cast.var, []) if i != index[first.var]]
        if any(i <= index[tail.var] for i in others + cast_others):
            continue
        s = call.args[0]
        widen = bound.get(s)  # s = astype(x16, float32) read by the softmax alone: read x16
        if isinstance(widen, relax.Call) and widen.op == ASTYPE and str(widen.args[0].ty.dtype) in LOW \
                and uses.get(s) == [index[b.var]]:
            s = widen.args[0]
        biased, bias = bound.get(s), None  # s = add(x, constant row bias) read by nothing else
        if isinstance(biased, relax.Call) and biased.op == ADD and len(uses.get(s, [])) == 1 \
                and _row_constant(biased.args[1], shape[-1], str(s.ty.dtype)):
            s, bias = biased.args[0], biased.args[1]
        found[tail.var] = SoftmaxDropoutMatch(b.var, s, mask, scale, str(cast.value.attrs.dtype), bool(others),
                                              cast.var if cast_others else None, bias)
    return found


def _fuse(scheduled: bool):
    def fuse(mutator, binding: relax.VarBinding, m: SoftmaxDropoutMatch):
        shape = static_shape(binding.var)
        in_dtype = str(m.s.ty.dtype)
        name = f"softmax_dropout_{in_dtype}_" + "x".join(map(str, shape)) + f"_{m.low}" \
            + ("_mask" if m.mask is not None else "") \
            + (f"_s{m.scale:.6g}".replace(".", "p") if m.scale is not None else "") \
            + ("" if m.write_p else "_nop") + ("_pb" if m.pb is not None else "") \
            + ("_bias" if m.bias is not None else "")
        gvar = add_function_once(mutator.builder_, name, lambda: softmax_dropout_primfunc(
            shape, m.low, m.mask is not None, m.scale, m.write_p, scheduled, in_dtype, m.pb is not None,
            m.bias is not None))
        args = [mutator.visit_expr(m.s)] + ([m.bias] if m.bias is not None else []) \
            + ([mutator.visit_expr(m.mask)] if m.mask is not None else [])
        outs = ([(m.p, "float32")] if m.write_p else []) + ([(m.pb, m.low)] if m.pb is not None else []) \
            + [(binding.var, m.low)]
        types = [relax.TensorType(shape, dtype) for _, dtype in outs]
        return zip([var for var, _ in outs], emit_call_tir(mutator.builder_, gvar, args, types))

    return fuse


@tvm.transform.module_pass(opt_level=0, name="FuseSoftmaxDropout")
class FuseSoftmaxDropout:
    """Fuse ``softmax`` and its cast/mask/scale tail into one scheduled CUDA kernel (see the
    module docstring); the tail's now unused bindings are removed.  ``scheduled=False`` leaves
    the kernels unscheduled, for checking the rewrite's numbers on a CPU."""

    def __init__(self, scheduled: bool = True):
        self.scheduled = scheduled

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        return fuse_chains(mod, find_fusions, _fuse(self.scheduled))

"""FuseSoftmaxDropout: attention's softmax and the dropout applied to it as one CUDA kernel.

In the training graph the attention probabilities leave the softmax twice: in float32 for the
softmax gradient, and cast to the low-precision dtype, masked and scaled (dropout) as the operand
of the ``P·V`` GEMM.  TVM legalizes ``softmax`` into an opaque PrimFunc, so FuseOps cannot give
it the elementwise tail, and DLight ran the tail as a separate kernel that read the float32
probabilities back (BERT-Large, 32x16x512x512: softmax 0.44 ms + tail 0.74 ms on H100).  Here::

    p  = softmax(s, axis=-1)          # s: float32 [..., n] (or astype(s16, float32)), p used elsewhere
    pb = astype(p, low)               # then, each optional, in this order:
    pw = where(mask, pb, 0)           #   the dropout keep mask
    pd = multiply(pw, scale)          #   the 1/(1-rate) scale (a scalar)

becomes one ``call_tir`` with outputs ``(p, pd)``, scheduled here: one thread block per row
(rows staged in shared memory, max and sum as cross-thread reductions), each element computed
with the same operations in the same order as before.  ``p`` is bit-identical; in the 16-bit tail
the code generator may keep the cast-then-scale in float32 and round once where the separate
kernels rounded twice (a difference of at most 1 ulp).  ``p`` is only written when something
else reads it; a widening ``astype`` that only feeds the softmax is read through (the
partitioner leaves it out of the GEMM epilogue: ``evt_cost.WIDENING_CONSUMERS``).  The tail's
intermediate values must have no other user, and ``p``'s other users must come after ``pd`` (the
fused call sits where ``pd`` was).
CUDA only: part of the evt pipeline's CUDA phase, before ``LegalizeOps``.
"""

from __future__ import annotations

import math

import numpy as np
import tvm
from tvm import relax, te, tirx
from tvm.relax.expr_functor import PyExprMutator, mutator

from ._rewrite import (add_function_once, binding_uses, emit_call_tir, flat_bindings, mutate_relax_functions,
                       scalar_value, static_shape)

SOFTMAX = tvm.ir.Op.get("relax.nn.softmax")
ASTYPE = tvm.ir.Op.get("relax.astype")
WHERE = tvm.ir.Op.get("relax.where")
MULTIPLY = tvm.ir.Op.get("relax.multiply")
LOW = ("bfloat16", "float16")
OPAQUE = 8  # tvm::relax::OpPatternKind::kOpaque


def _threads(n: int) -> int:
    """Threads per row: a warp multiple covering the row in at most 8 elements a thread."""
    return min(1024, max(32, 32 * math.ceil(math.ceil(n / 8) / 32)))


def softmax_dropout_primfunc(shape: tuple[int, ...], low: str, masked: bool, scale: float | None,
                             write_p: bool, scheduled: bool = True, in_dtype: str = "float32",
                             write_pb: bool = False) -> tirx.PrimFunc:
    """``p = softmax(s.astype(float32), axis=-1)``, ``pb = p.astype(low)`` and
    ``pd = where(mask, pb, 0) * scale`` for tensors of `shape`; outputs ``[p] [pb] pd`` as
    `write_p` / `write_pb` say; scheduled for CUDA (module docstring) unless `scheduled` is False."""
    *lead, n = shape
    x = te.placeholder(shape, in_dtype, name="s")

    def s(idx):
        return x[idx] if in_dtype == "float32" else x[idx].astype("float32")

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
    func = te.create_prim_func([x, *([mask] if masked else []), *outs])
    if not scheduled:
        return func
    func = _schedule(func, n, [f"out_v{i}" for i in range(n_out)] if n_out > 1 else ["out"])
    return func.with_attr("tirx.is_scheduled", True).with_attr("op_pattern", OPAQUE)  # FuseOps: leave whole


def _round_to(value: float, dtype: str) -> float:
    import ml_dtypes

    return float(np.array(value, "float32").astype(ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype))


def _schedule(func: tirx.PrimFunc, n: int, outputs: list[str]) -> tirx.PrimFunc:
    """One thread block per row: the row staged in shared memory, then max, sum and the outputs,
    each a loop over the row split across the block's threads."""
    threads = _threads(n)
    sch = tvm.s_tir.Schedule(func)
    outs = [sch.get_sblock(name) for name in outputs]  # under one loop nest
    row_max, row_sum = sch.get_sblock("row_max"), sch.get_sblock("row_sum")
    *lead, col = sch.get_loops(outs[0])
    row = sch.fuse(*lead) if len(lead) > 1 else lead[0]
    sch.compute_at(row_sum, row)
    sch.compute_at(row_max, row)
    for block in (row_max, row_sum):
        sch.set_scope(block, 0, "shared")
    staged = sch.cache_read(row_max, 0, "shared", consumer_blocks=[row_max, row_sum, *outs])
    sch.compute_at(staged, row)
    sch.bind(row, "blockIdx.x")
    for loop in (sch.get_loops(b)[-1] for b in (staged, row_max, row_sum)):
        sch.bind(sch.split(loop, [None, threads])[1], "threadIdx.x")
    sch.bind(sch.split(col, [None, threads])[1], "threadIdx.x")
    return sch.mod["main"]


def find_fusions(func: relax.Function) -> dict:
    """``{pd: (p, s, mask, scale, low, write_p, pb)}`` for each match of the module docstring's
    pattern (``write_p``: something besides the tail reads ``p``; ``pb``: the cast's var when
    something besides the tail reads it, else None)."""
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
        found[tail.var] = (b.var, s, mask, scale, str(cast.value.attrs.dtype), bool(others),
                           cast.var if cast_others else None)
    return found


@mutator
class _Fuser(PyExprMutator):
    def __init__(self, mod: tvm.IRModule, scheduled: bool):
        super().__init__(mod)
        self.scheduled = scheduled

    def prime(self, func: relax.Function) -> None:
        self.fusions = find_fusions(func)
        self.dropped = {p for p, *_ in self.fusions.values()}

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        if binding.var in self.dropped:
            return  # computed by the fused call below
        if binding.var not in self.fusions:
            return super().visit_var_binding_(binding)
        p, s, mask, scale, low, write_p, pb = self.fusions[binding.var]
        shape = static_shape(binding.var)
        in_dtype = str(s.ty.dtype)
        name = f"softmax_dropout_{in_dtype}_" + "x".join(map(str, shape)) + f"_{low}" \
            + ("_mask" if mask is not None else "") \
            + (f"_s{scale:.6g}".replace(".", "p") if scale is not None else "") + ("" if write_p else "_nop") \
            + ("_pb" if pb is not None else "")
        gvar = add_function_once(self.builder_, name, lambda: softmax_dropout_primfunc(
            shape, low, mask is not None, scale, write_p, self.scheduled, in_dtype, pb is not None))
        args = [self.visit_expr(s)] + ([self.visit_expr(mask)] if mask is not None else [])
        outs = ([(p, "float32")] if write_p else []) + ([(pb, low)] if pb is not None else []) + [(binding.var, low)]
        types = [relax.TensorType(shape, dtype) for _, dtype in outs]
        for (var, _), out in zip(outs, emit_call_tir(self.builder_, gvar, args, types)):
            self.set_var_remap(var, out)


@tvm.transform.module_pass(opt_level=0, name="FuseSoftmaxDropout")
class FuseSoftmaxDropout:
    """Fuse ``softmax`` and its cast/mask/scale tail into one scheduled CUDA kernel (see the
    module docstring); the tail's now unused bindings are removed.  ``scheduled=False`` leaves
    the kernels unscheduled, for checking the rewrite's numbers on a CPU."""

    def __init__(self, scheduled: bool = True):
        self.scheduled = scheduled

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        fuser = _Fuser(mod, self.scheduled)
        mod = mutate_relax_functions(fuser, mod, before_each=fuser.prime)
        return relax.transform.DeadCodeElimination()(mod)

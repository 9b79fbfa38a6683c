"""FuseLayerNorm: a decomposed layer norm's statistics and elementwise tail as one CUDA kernel.

`DecomposeLayerNorm` spells the forward as row reductions and elementwise ops so that the
backward can share them and the partitioner can see them.  Whatever the partitioner leaves to
TVM, DLight schedules op by op: on BERT-Large (32x512x1024, float32 under AMP) one layer norm
became seven kernels (mean/subtract, square, mean/rsqrt, normalize, affine, two casts), ~0.5 ms
on H100, each re-reading the 64 MB row block.  On the CUDA route this pass turns the chain::

    mean   = mean(x, [-1], keepdims)      centered = x - mean      square = centered * centered
    var    = mean(square, [-1], keepdims) rstd = rsqrt(var + eps)  xhat = centered * rstd
    y      = xhat * gamma                 z = y + beta             # each optional, in this order
    [zl    = astype(z, low)  |  astype(reshape(z, s), low)]        # casts of the result, optional

into one ``call_tir`` whose outputs are the chain's values that something else reads, scheduled
here: one thread block per row, the row staged in shared memory, both sums as cross-thread
reductions.  An element value (``xhat``, ``z``) whose readers are all ops that take elementwise
producers into their kernels (FuseOps, RecomputeElementwise, FuseLayerNormBackward's prologues)
is not written: the call writes ``mean`` and ``rstd``, and the value is bound again after it, the
graph's own ops on ``x`` and them, for each reader to compute from ``x`` (BERT-Large: two bytes an
element of bf16 ``x`` read, not four of float32 ``xhat`` written and read back two or three times).
Typically the call writes ``mean``, ``rstd`` and ``zl`` for the next GEMM.
Every element is computed with the graph's operations in the graph's order (the sums may
associate differently).  The chain must be float32 over the last axis, in one dataflow block,
and an ``x = astype(x16, float32)`` is read through (the kernel widens ``x16`` as it loads it:
half the bytes, and the GEMM before it can store the narrow value; other readers of ``x`` keep
it); its
values may only be read after its last op (the fused call sits there).  Row statistics that are
outputs (``rstd`` for the gradient) are stored in the same row loop once the sums are in
(``Schedule.merge`` joins their nest to the elements'; every thread of the row's block stores the
same value); only a call that writes no element value has a nest of statistics alone.  Before,
they came from a second launch that summed the rows again (Llama's RMS norms: 35 us of 85 a norm
on an H200).  An RMS norm's chain (``RecognizeRMSNorm``, ``DecomposeLayerNorm``)::

    square = x * x        var = mean(square, [-1], keepdims)   rstd = rsqrt(var + eps)
    xhat   = x * rstd     y = xhat * gamma                     [casts]

is matched and fused the same way, with no mean taken out.
CUDA only: part of the evt pipeline's CUDA phase, before ``LegalizeOps``.
"""

from __future__ import annotations

from dataclasses import dataclass

import tvm
from tvm import relax, te, tirx

from .._rewrite import (add_function_once, binding_uses, emit_call_tir, flat_bindings, op_name, scalar_value,
                       static_shape)
from ._row_kernel import LOW, block_names, fuse_chains, schedule_rows, scheduled as mark_scheduled
from .recompute_elementwise import FUSABLE

MEAN = tvm.ir.Op.get("relax.mean")
SUBTRACT = tvm.ir.Op.get("relax.subtract")
MULTIPLY = tvm.ir.Op.get("relax.multiply")
ADD = tvm.ir.Op.get("relax.add")
RSQRT = tvm.ir.Op.get("relax.rsqrt")
ASTYPE = tvm.ir.Op.get("relax.astype")
RESHAPE = tvm.ir.Op.get("relax.reshape")
MAX_ROW_BYTES = 48 * 1024  # the staged row lives in (static) shared memory
# the kernel's attribute naming its parameters and outputs by role (``low``: the result's cast)
NORM_ATTR = "tvm_evt.norm"

# The chain's values: row statistics have shape [..., 1], the others [..., n].
STATS = ("mean", "var", "var_eps", "rstd")
ELEMENTS = ("centered", "square", "xhat", "y", "z")
# what an element value is computed from (itself included): recomputing it needs these
DEPENDS = {"centered": {"centered", "mean"}, "square": {"square", "centered", "mean"},
           "xhat": {"xhat", "centered", "mean", "rstd"}, "y": {"y", "xhat", "centered", "mean", "rstd"},
           "z": {"z", "y", "xhat", "centered", "mean", "rstd"}}


@dataclass(frozen=True)
class LayerNormChain:
    """One match: the vars of the chain by role, what the kernel reads and what it must write."""

    x: relax.Var
    eps: float
    gamma: relax.Expr | None
    beta: relax.Expr | None
    values: dict  # role -> var, for the roles present
    outputs: tuple[str, ...]  # roles read outside the chain, in STATS + ELEMENTS order
    low: str | None  # dtype of the absorbed casts of the result
    casts: tuple  # (cast var, reshape shape or None) for each absorbed cast
    absorbed: frozenset  # vars whose bindings the fused call replaces
    source: relax.Expr | None = None  # the 16-bit x that x widens, read by the kernel instead
    recomputed: tuple = ()  # (var, bound call) of the element values bound again after the call
    centered: bool = True  # a layer norm's; False: an RMS norm's (no mean, square = x * x)


def layer_norm_primfunc(shape: tuple[int, ...], eps: float, gamma_shape, beta_shape, outputs: tuple[str, ...],
                        low: str | None, scheduled: bool = True, in_dtype: str = "float32",
                        centered: bool = True) -> tirx.PrimFunc:
    """The fused kernel for an input of `shape` (`in_dtype`, widened to float32 as it is read):
    parameters ``x[, gamma][, beta]``, then the `outputs` (roles, stats first) and, with `low`,
    the result cast to `low`.  `centered` False: an RMS norm's (``square = x * x``, no mean)."""
    *lead, n = shape
    x_in = te.placeholder(shape, in_dtype, name="x")

    class _Widened:  # x[idx] in float32
        def __getitem__(self, idx):
            return x_in[idx] if in_dtype == "float32" else x_in[idx].astype("float32")

    x = _Widened()
    gamma = te.placeholder(gamma_shape, "float32", name="gamma") if gamma_shape else None
    beta = te.placeholder(beta_shape, "float32", name="beta") if beta_shape else None
    inv_n = tirx.const(1.0 / n, "float32")  # TVM's mean: the sum times 1/n
    eps_c = tirx.const(eps, "float32")

    def row_sums(tag):
        """sum(x) and sum(centered^2) per row (an RMS norm's: sum(x^2) alone), one loop nest's."""
        k1, k2 = te.reduce_axis((0, n), name="k1"), te.reduce_axis((0, n), name="k2")
        s1 = te.compute(lead, lambda *r: te.sum(x[(*r, k1)], axis=k1), name=f"row_sum{tag}") if centered else None
        c = (lambda idx: x[idx] - s1[idx[:-1]] * inv_n) if centered else (lambda idx: x[idx])  # noqa: E731
        s2 = te.compute(lead, lambda *r: te.sum(c((*r, k2)) * c((*r, k2)), axis=k2), name=f"row_sqsum{tag}")
        return s1, s2

    def stat_values(s1, s2, r):
        var = s2[r] * inv_n
        return {**({"mean": s1[r] * inv_n} if centered else {}),
                "var": var, "var_eps": var + eps_c, "rstd": tirx.rsqrt(var + eps_c)}

    def vector(t, idx):  # gamma / beta broadcast along the last axis: [n] or [1, ..., 1, n]
        return t[(0,) * (len(t.shape) - 1) + (idx[-1],)]

    stats = [o for o in outputs if o in STATS]
    elems = [o for o in outputs if o in ELEMENTS]
    n_elem = len(elems) + (1 if low else 0)
    elem_tensors, stat_tensors = [], []
    if n_elem:
        s1, s2 = row_sums("")

        def elem_values(*idx):
            st = stat_values(s1, s2, idx[:-1])
            v = {"centered": x[idx] - st["mean"]} if centered else {}
            base = v["centered"] if centered else x[idx]
            v["square"] = base * base
            v["xhat"] = base * st["rstd"]
            result = v["y"] = v["xhat"] * vector(gamma, idx) if gamma is not None else v["xhat"]
            if beta is not None:
                result = v["z"] = result + vector(beta, idx)
            return tuple([v[o] for o in elems] + ([result.astype(low)] if low else []))

        elem_tensors = _as_list(te.compute(shape, elem_values, name="out"))
    if stats:  # from the element values' sums, else a nest of their own
        t1, t2 = (s1, s2) if n_elem else row_sums("_stats")
        stat_tensors = _as_list(te.compute((*lead, 1), lambda *r: tuple(
            stat_values(t1, t2, r[:-1])[o] for o in stats), name="stats"))
    params = [x_in] + [t for t in (gamma, beta) if t is not None]
    func = te.create_prim_func(params + stat_tensors + elem_tensors)  # outputs: stats first
    # what FuseLayerNormBackward's gradient kernel needs to compute the result again as this does
    func = func.with_attr(NORM_ATTR, {
        "inputs": ["x"] + [name for name, t in (("gamma", gamma), ("beta", beta)) if t is not None],
        "outputs": stats + elems + (["low"] if low else []), "centered": centered})
    if not scheduled:
        return func
    # the row of x staged in shared memory, then both sums; only the first output block reads the
    # staged row (the others read x again: the form the GPU kernel tests passed with); the
    # statistics are written in the same row loop, once the sums are in
    sch = tvm.s_tir.Schedule(func)
    sums = ["row_sum", "row_sqsum"] if centered else ["row_sqsum"]
    stat_block = block_names("stats", len(stats))[:1] if stats else []
    if n_elem:
        schedule_rows(sch, block_names("out", n_elem)[:1], sums, n, stage=True, row_outputs=stat_block)
    elif stats:
        schedule_rows(sch, stat_block, [f"{s}_stats" for s in sums], n, stage=True)
    return mark_scheduled(sch)


def _as_list(t):
    return list(t) if isinstance(t, (list, tuple)) else [t]


def _is_last_axis_mean(call, rank: int) -> bool:
    return (isinstance(call, relax.Call) and call.op == MEAN and call.attrs.keepdims
            and call.attrs.axis is not None and [int(a) % rank for a in call.attrs.axis] == [rank - 1])


def _is_row_vector(expr, n: int) -> bool:
    shape = static_shape(expr)
    return bool(shape) and shape[-1] == n and all(s == 1 for s in shape[:-1]) \
        and str(expr.ty.dtype) == "float32"


def find_chains(func: relax.Function) -> dict:
    """``{last var of the chain: LayerNormChain}`` for each match of the module docstring."""
    bindings, blocks = flat_bindings(func)
    bound = {b.var: b.value for b in bindings}
    index = {b.var: i for i, b in enumerate(bindings)}
    uses = binding_uses(func)

    def users(var):
        return [bindings[i] if i < len(bindings) else None for i in uses.get(var, [])]

    def sole_user(var, op):
        us = users(var)
        if len(us) == 1 and us[0] is not None and isinstance(us[0].value, relax.Call) and us[0].value.op == op:
            return us[0]
        return None

    def call_of(var, op, *args):
        """The binding of a user of `var` calling `op` on exactly `args` (any order for mul/add)."""
        for u in users(var):
            if u is None or not isinstance(u.value, relax.Call) or u.value.op != op:
                continue
            got = list(u.value.args)
            if all(a.same_as(b) for a, b in zip(got, args)) or (
                    op in (MULTIPLY, ADD) and all(a.same_as(b) for a, b in zip(got, reversed(args)))):
                return u
        return None

    def affine_user(var, op, n):
        """(binding, vector) of the user of `var` computing ``op(var, vector)`` with a float32
        vector broadcast along the last axis, else None."""
        for u in users(var):
            if u is not None and isinstance(u.value, relax.Call) and u.value.op == op:
                other = [a for a in u.value.args if not a.same_as(var)]
                if len(other) == 1 and _is_row_vector(other[0], n):
                    return u, other[0]
        return None

    def centered_row(var) -> bool:  # var = y - mean(y): a layer norm's second mean reads its square
        value = bound.get(var)
        if not (isinstance(value, relax.Call) and value.op == SUBTRACT):
            return False
        mean = bound.get(value.args[1])
        return isinstance(mean, relax.Call) and mean.op == MEAN and mean.args[0].same_as(value.args[0])

    def rms_square(var):
        """x where `var` is ``x * x`` read by one mean alone (an RMS norm's), else None."""
        value = bound.get(var)
        if isinstance(value, relax.Call) and value.op == MULTIPLY and value.args[0].same_as(value.args[1]) \
                and len(uses.get(var, [])) == 1 and not centered_row(value.args[0]):
            return value.args[0]
        return None

    found = {}
    for b in bindings:
        shape = static_shape(b.value.args[0]) if isinstance(b.value, relax.Call) and b.value.args else None
        if shape is None or not _is_last_axis_mean(b.value, len(shape)):
            continue
        averaged, n = b.value.args[0], shape[-1]
        root = rms_square(averaged)
        centered = root is None
        x = averaged if centered else root
        if str(x.ty.dtype) != "float32" or static_shape(x) != shape or n * 4 > MAX_ROW_BYTES:
            continue
        if not centered:  # mean(x * x): the RMS norm's variance
            v, step = {"square": averaged, "var": b.var}, b
        else:
            v = {"mean": b.var}
            step = call_of(b.var, SUBTRACT, x, b.var)
            v["centered"] = step and step.var
            step = step and call_of(step.var, MULTIPLY, step.var, step.var)
            v["square"] = step and step.var
            step = step and sole_user(step.var, MEAN)
            if step is None or not _is_last_axis_mean(step.value, len(shape)):
                continue
            v["var"] = step.var
        step = sole_user(step.var, ADD)
        eps = step and scalar_value(bound, step.value.args[1])
        if eps is None:
            continue
        v["var_eps"] = step.var
        step = sole_user(step.var, RSQRT)
        v["rstd"] = step and step.var
        base = v["centered"] if centered else x
        step = step and call_of(base, MULTIPLY, base, v["rstd"])
        if step is None:
            continue
        v["xhat"] = step.var
        gamma = beta = None
        nxt = affine_user(step.var, MULTIPLY, n)
        if nxt is not None:
            gamma, v["y"], step = nxt[1], nxt[0].var, nxt[0]
            nxt = affine_user(step.var, ADD, n)
            if nxt is not None:
                beta, v["z"], step = nxt[1], nxt[0].var, nxt[0]
        last = step.var
        chain = {var: role for role, var in v.items()}
        # casts of the result: astype(result, low), or astype(reshape(result), low) with the
        # reshape read by the cast alone
        casts, low, cast_vars = [], None, set()
        for u in users(last):
            if u is None or not isinstance(u.value, relax.Call):
                continue
            cast, reshape = u, None
            if u.value.op == RESHAPE:
                cast, reshape = sole_user(u.var, ASTYPE), u
            if cast is None or cast.value.op != ASTYPE or str(cast.value.attrs.dtype) not in LOW:
                continue
            if low not in (None, str(cast.value.attrs.dtype)):
                continue
            low = str(cast.value.attrs.dtype)
            casts.append((cast.var, static_shape(reshape.var) if reshape else None))
            cast_vars |= {cast.var} | ({reshape.var} if reshape else set())
        # every chain value read elsewhere becomes an output, or is recomputed after the call from
        # x and the statistics (an element value whose readers all fuse elementwise producers);
        # those readers must come after `last`
        outputs, recomputed, ok = [], [], True
        for role in STATS + ELEMENTS:
            var = v.get(role)
            if var is None:
                continue
            outside = [i for i in uses.get(var, []) if i >= len(bindings)
                       or (bindings[i].var not in chain and bindings[i].var not in cast_vars)]
            if outside:
                recompute = role in ELEMENTS and all(i < len(bindings) and _recomputes(bindings[i].value)
                                                     for i in outside)
                (recomputed if recompute else outputs).append(role)
                ok &= all(i > index[last] for i in outside)
        # with the element values they are computed from (unless written) and the statistics
        recomputed = [role for role in ELEMENTS if role in v and role not in outputs
                      and any(role in DEPENDS[r] for r in recomputed)]
        outputs = [role for role in STATS + ELEMENTS if role in outputs
                   or (role in STATS and role in v and any(role in DEPENDS[r] for r in recomputed))]
        members = set(chain) | cast_vars
        # x = astype(x16, float32) read by the chain alone: the kernel reads x16 and widens it
        widen, source = bound.get(x), None
        if isinstance(widen, relax.Call) and widen.op == ASTYPE and str(widen.args[0].ty.dtype) in LOW:
            source = widen.args[0]
            if isinstance(x, relax.DataflowVar) and not recomputed and all(
                    i < len(bindings) and bindings[i].var in chain for i in uses.get(x, [])):
                members.add(x)  # read by the chain alone: its binding goes
        ok &= len({blocks.get(var) for var in members}) == 1 and blocks.get(last) is not None
        ok &= all(isinstance(var, relax.DataflowVar) for var in members)
        if not ok or not (outputs or casts):
            continue
        found[last] = LayerNormChain(x, float(eps), gamma, beta, v, tuple(outputs), low, tuple(casts),
                                     frozenset(members) - {last}, source,
                                     tuple((v[role], bound[v[role]]) for role in recomputed), centered)
    return found


def _recomputes(value) -> bool:
    """Does a reader computing `value` take an elementwise producer into its own kernel (FuseOps,
    RecomputeElementwise, FuseLayerNormBackward's prologues), so that recomputing the value there
    costs a read of x instead of a read of the value?"""
    return op_name(value) in FUSABLE


def _name(shape, chain: LayerNormChain) -> str:
    parts = ["layer_norm" if chain.centered else "rms_norm", "x".join(map(str, shape))]
    parts += [t for t, v in (("g", chain.gamma), ("b", chain.beta)) if v is not None]
    parts += [f"eps{chain.eps:.3g}".replace(".", "p").replace("-", "m").replace("+", "")]
    parts += list(chain.outputs) + ([chain.low] if chain.low else [])
    return "_".join(parts)


def _fuse(scheduled: bool):
    def fuse(mutator, binding: relax.VarBinding, chain: LayerNormChain):
        builder = mutator.builder_
        shape = static_shape(chain.x)
        vectors = [t for t in (chain.gamma, chain.beta) if t is not None]
        x = chain.x if chain.source is None else chain.source
        in_dtype = str(x.ty.dtype)
        name = _name(shape, chain) + ("" if in_dtype == "float32" else f"_from_{in_dtype}")
        gvar = add_function_once(builder, name, lambda: layer_norm_primfunc(
            shape, chain.eps, static_shape(chain.gamma) if chain.gamma is not None else None,
            static_shape(chain.beta) if chain.beta is not None else None, chain.outputs, chain.low, scheduled,
            in_dtype, chain.centered))
        stat_shape = (*shape[:-1], 1)
        types = [relax.TensorType(stat_shape if o in STATS else shape, "float32") for o in chain.outputs]
        types += [relax.TensorType(shape, chain.low)] if chain.low else []
        outs = emit_call_tir(builder, gvar, [mutator.visit_expr(a) for a in (x, *vectors)], types)
        remaps = [(chain.values[role], out) for role, out in zip(chain.outputs, outs)]
        for var, out in remaps:
            mutator.set_var_remap(var, out)
        for var, value in chain.recomputed:  # the graph's own ops, now after the call
            remaps.append((var, builder.emit(mutator.visit_expr(value))))
            mutator.set_var_remap(*remaps[-1])
        for cast_var, reshape in chain.casts if chain.low else ():
            out = outs[-1] if reshape is None else builder.emit(relax.op.reshape(outs[-1], reshape))
            remaps.append((cast_var, out))
        return remaps

    return fuse


@tvm.transform.module_pass(opt_level=0, name="FuseLayerNorm")
class FuseLayerNorm:
    """Fuse each decomposed layer norm (statistics, normalization, affine, result casts) into one
    scheduled CUDA kernel (see the module docstring).  ``scheduled=False`` leaves the kernels
    unscheduled, for checking the rewrite's numbers on a CPU."""

    def __init__(self, scheduled: bool = True):
        self.scheduled = scheduled

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        return fuse_chains(mod, find_chains, _fuse(self.scheduled))

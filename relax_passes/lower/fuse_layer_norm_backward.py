"""FuseLayerNormBackward: the input gradient of a layer norm as one CUDA kernel.

`gradient_rules.layer_norm_grad` writes the input gradient of ``y = xhat * gamma + beta`` over the
last axis as row means and elementwise ops::

    g  = dy * gamma                     # or g given (the partitioner put it in a GEMM epilogue)
    h  = g * xhat                       # or h given
    dx = rstd * ((g - mean(g)) - xhat * mean(h))
    [dxl = astype(dx, low)]             # optional casts of the result

and the RMS norm's (``gradient_rules.rms_norm_grad``: ``y = xhat * w``, ``xhat = x * rstd``, no
mean taken out) the same without ``mean(g)``: ``dx = rstd * (g - xhat * mean(h))``.

DLight ran it as four or five kernels over the [rows, n] float32 block (BERT-Large: ~0.35 ms per
layer norm on H100).  On the CUDA route this pass makes it one ``call_tir``, scheduled one thread
block per row with both means as cross-thread reductions, writing ``dx`` (when something other
than the casts reads it) and its cast.  ``g`` and ``h`` are computed inside when nothing else
reads them, and so are the elementwise producers of its inputs where nothing else reads them or
recomputing pays (``_prologue.py``): ``xhat`` from the bf16 ``x`` and the statistics FuseLayerNorm
writes, a loss gradient ``dy`` from them and the target.  With ``epilogue=True`` (the pipeline's
``ln_epilogue``, on by default) the elementwise ops that alone read ``dx`` -- GPT-2's residual add, cast,
dropout scale and mask -- run in the kernel too, which writes their result instead of ``dx``; and
where ``dx``'s one cast has other readers after such a chain (BERT-Large: dropout's backward of the
bf16 ``dx`` a GEMM epilogue also reads), the kernel writes the cast and the chain's result.
The norm's weight gradients over the rows, ``sum(dy * xhat)`` (the scale's) and ``sum(dy)`` (the
shift's), come out of the same kernel when it takes ``dy`` and there are rows enough
(``_row_kernel.rows_per_block``): each thread block walks a group of rows one after the other,
each thread adds the values it computes at its columns into registers, and writes them once as a
``[groups, V, threads]`` partial sum, whose sum over the groups is a small kernel.  They were a
column-sum kernel each that read ``dy`` and ``x`` again (Llama: 9 of 269 MB a step; the partials
are 16 MB).
With ``norm_output=True`` (the pipeline's ``norm_output``) the kernel also writes the forward's
bf16 result ``y = astype(xhat * gamma + beta)`` again where weight-gradient GEMMs read ``y`` in the
backward, and those GEMMs move after the kernel (``_norm_outputs``): ``xhat`` is already in its
registers, computed from what the forward kept for it (the norm's input and statistics), so the
step no longer keeps ``y`` across the forward as well (BERT-Large: 48 [tokens, 1024] bf16 tensors).
The copy has the forward's bits: FuseLayerNorm's kernel computes ``y`` from the same values with
the same ops, and says which of its outputs are which (``NORM_ATTR``).
Each element is computed with the graph's operations in the graph's order (the sums may associate
differently).  All values float32, in one dataflow block; only ``dx`` is read
outside the chain.  CUDA only: part of the evt pipeline's CUDA phase, before ``LegalizeOps``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import tvm
from tvm import relax, te, tirx

from .._rewrite import (add_function_once, bind_as, binding_uses, bound_call, emit_call_tir, flat_bindings, op_name,
                        static_shape)
from ._prologue import (ELEMENTWISE, Prologue, at, epilogue_chain, inline_prologue, leaf_index, placeholders,
                        prologue_compute, prologue_tag, unique_leaves)
from ._row_kernel import (LOW, block_names, column_partials, fuse_chains, partials_shape, rows_per_block,
                          schedule_rows, scheduled as mark_scheduled)
from .fuse_layer_norm import MAX_ROW_BYTES, NORM_ATTR, _as_list, _is_last_axis_mean, _is_row_vector

MEAN = tvm.ir.Op.get("relax.mean")
SUBTRACT = tvm.ir.Op.get("relax.subtract")
MULTIPLY = tvm.ir.Op.get("relax.multiply")
ASTYPE = tvm.ir.Op.get("relax.astype")
SUM = tvm.ir.Op.get("relax.sum")
RESHAPE = tvm.ir.Op.get("relax.reshape")
CALL_TIR = tvm.ir.Op.get("relax.call_tir")
MAX_DEFERRED = 32  # bindings one norm's output moves after its gradient kernel
# a weight gradient's column sum the kernel can make from what it reads: kind -> value at an index
COLUMN_SUMS = {"dy_xhat": lambda dy, xhat: dy * xhat, "dy": lambda dy, _xhat: dy}


@dataclass(frozen=True)
class NormOutput:
    """A forward norm kernel's (FuseLayerNorm's) low-precision result ``y = astype(xhat * gamma
    [+ beta], low)``, which the gradient kernel writes again from its ``xhat`` (the same float32
    values: the forward's input and statistics, the same ops) for the readers moved after it."""

    var: relax.Var  # y as the forward kernel wrote it
    gamma: relax.Expr | None
    beta: relax.Expr | None
    low: str
    aliases: tuple = ()  # (var, shape): reshapes of y read after the gradient kernel


@dataclass(frozen=True)
class LayerNormGradChain:
    """One match: the kernel's inputs as prologues (what it reads and recomputes), whether ``dx``
    itself is written, the absorbed casts."""

    g: Prologue | None  # given g, else None (computed from dy * gamma)
    dy: Prologue | None
    gamma: relax.Expr | None
    h: Prologue | None  # given h, else None (computed as g * xhat)
    xhat: Prologue
    rstd: relax.Expr
    write_dx: bool
    low: str | None
    casts: tuple  # cast vars, all reading dx
    absorbed: frozenset
    tail: Prologue | None = None  # elementwise ops applied in the kernel to `tail_from`, the last one written
    dx: relax.Var | None = None
    tail_from: relax.Var | None = None  # dx, or its one cast (which the kernel then writes too)
    centered: bool = True  # a layer norm's (g - mean(g)); False: an RMS norm's g
    col_sums: tuple = ()  # (sum var, COLUMN_SUMS kind): weight gradients the kernel makes partial sums of
    group_rows: int = 1  # rows a thread block walks when col_sums (rows_per_block)
    output: NormOutput | None = None  # the forward's result, written again for `deferred`
    deferred: tuple = ()  # bindings (in order) moved after the kernel, reading its `output`


def layer_norm_grad_primfunc(shape: tuple[int, ...], gamma_shape, given_h: bool, write_dx: bool,
                             low: str | None, scheduled: bool = True, centered: bool = True) -> tirx.PrimFunc:
    """Parameters ``(g | dy, gamma), [h], xhat, rstd``, then ``dx`` (if `write_dx`) and
    ``astype(dx, low)`` (if `low`); `centered` False: the RMS norm's gradient (no ``mean(g)``)."""
    *lead, n = shape
    names = (["dy", "gamma"] if gamma_shape else ["g"]) + (["h"] if given_h else []) + ["xhat", "rstd"]
    shapes = {"gamma": gamma_shape, "rstd": (*lead, 1)}
    ts = {name: te.placeholder(shapes.get(name, shape), "float32", name=name) for name in names}
    read = lambda name: (lambda idx: at(ts[name], idx))  # noqa: E731
    return _grad_primfunc(shape, list(ts.values()), None if gamma_shape else read("g"),
                          read("dy") if gamma_shape else None, ts.get("gamma"), read("h") if given_h else None,
                          read("xhat"), ts["rstd"], write_dx, low, scheduled, centered=centered)


def _grad_primfunc(shape, params, g_of, dy_of, gamma, h_of, xhat_of, rstd, write_dx: bool, low: str | None,
                   scheduled: bool, tail_of=None, centered: bool = True, col_sums: tuple[str, ...] = (),
                   group_rows: int = 1, output_of=None) -> tirx.PrimFunc:
    """The kernel over the placeholders `params`; each input is a function of the index (``*_of``),
    ``g`` either given or ``dy * gamma``, ``h`` either given or ``g * xhat``; ``tail_of(idx, dx)``,
    if given, an output computed from ``dx``; ``output_of(idx, xhat)``, if given, a last element
    output computed from ``xhat`` (the forward norm's result); `centered` False leaves out
    ``mean(g)``.  Each of `col_sums` (``COLUMN_SUMS`` kinds) adds an output of partial column sums
    over groups of `group_rows` rows (``column_partials``)."""
    *lead, n = shape
    inv_n = tirx.const(1.0 / n, "float32")
    g = g_of if g_of is not None else (lambda idx: dy_of(idx) * at(gamma, idx))
    h = h_of if h_of is not None else (lambda idx: g(idx) * xhat_of(idx))
    k1, k2 = te.reduce_axis((0, n), name="k1"), te.reduce_axis((0, n), name="k2")
    sum_g = te.compute(lead, lambda *r: te.sum(g((*r, k1)), axis=k1), name="sum_g") if centered else None
    sum_h = te.compute(lead, lambda *r: te.sum(h((*r, k2)), axis=k2), name="sum_h")

    def values(*idx):
        r = idx[:-1]
        a = g(idx) - sum_g[r] * inv_n if centered else g(idx)
        c = xhat_of(idx) * (sum_h[r] * inv_n)
        dx = rstd[(*r, 0)] * (a - c)
        return tuple(([dx] if write_dx else []) + ([dx.astype(low)] if low else [])
                     + ([tail_of(idx, dx)] if tail_of else []) + ([output_of(idx, xhat_of(idx))] if output_of else []))

    n_out = int(write_dx) + int(bool(low)) + int(tail_of is not None) + int(output_of is not None)
    outs = _as_list(te.compute(shape, values, name="dx"))
    names = [f"colsum{k}" for k in range(len(col_sums))]
    partials = [column_partials(shape, group_rows, lambda idx, kind=kind: COLUMN_SUMS[kind](dy_of(idx), xhat_of(idx)),
                                name) for kind, name in zip(col_sums, names)]
    func = te.create_prim_func([*params, *outs, *partials])
    if not scheduled:
        return func
    sch = tvm.s_tir.Schedule(func)  # both sums read straight from global memory (no staging)
    schedule_rows(sch, block_names("dx", n_out), ["sum_g", "sum_h"] if centered else ["sum_h"], n, stage=False,
                  column_sums=tuple(names), group_rows=group_rows)
    return mark_scheduled(sch)


def find_chains(func: relax.Function, epilogue: bool = False, mod: tvm.IRModule | None = None,
                norm_output: bool = False) -> dict:
    """``{dx var (or its tail's last var): LayerNormGradChain}`` for each match of the module
    docstring's pattern.

    With `epilogue`, a chain whose dx (or its cast) is also read by another chain's tail (ViT-B/16:
    the bf16 dx of one layer norm feeds the dropout backward and the next layer norm's residual
    add) gets a second look: that reader is then a kernel of its own reading the value, like a
    GEMM, and the tail takes the other reader.  A second-look tail that would share an op with
    another chain's tail is not taken.  With `norm_output` (and `mod`, where the forward kernels
    are), each chain also takes its forward norm's result where that moves its backward readers
    after the kernel (``_norm_outputs``)."""
    found = _find_chains_with_tails(func, epilogue)
    return _norm_outputs(func, found, mod) if norm_output and mod is not None else found


def _find_chains_with_tails(func: relax.Function, epilogue: bool) -> dict:
    found = _find_chains(func, epilogue)
    tails = {c.dx: c.tail.vars for c in found.values() if c.tail is not None}
    if not epilogue or not tails or all(c.tail is not None for c in found.values()):
        return found
    others = {c.dx: frozenset().union(*[v for d, v in tails.items() if not d.same_as(c.dx)])
              for c in found.values()}
    again = {c.dx: c for c in _find_chains(func, epilogue, others).values()}
    out = {}
    for key, c in found.items():
        c2 = again.get(c.dx)
        if c.tail is None and c2 is not None and c2.tail is not None and not (c2.tail.vars & others[c.dx]):
            out[c2.tail.root] = c2
        else:
            out[key] = c
    return out


def _find_chains(func: relax.Function, epilogue: bool, other_tails: dict | None = None) -> dict:
    """``find_chains``' matches; `other_tails` (dx -> the vars other chains' tails take) are
    readers the tail search passes over, as it does kernels."""
    other_tails = other_tails or {}
    bindings, blocks = flat_bindings(func)
    bound = {b.var: b.value for b in bindings}
    index = {b.var: i for i, b in enumerate(bindings)}
    uses = binding_uses(func)

    def call(var, op):
        value = bound.get(var)
        return value if isinstance(value, relax.Call) and value.op == op else None

    def only_read_by(var, readers) -> bool:
        got = uses.get(var, [])
        return bool(got) and all(i < len(bindings) and bindings[i].var in readers for i in got)

    def f32(expr, shape):
        return static_shape(expr) == shape and str(expr.ty.dtype) == "float32"

    def readers(var):
        return [bindings[i].var if i < len(bindings) else None for i in uses.get(var, [])]

    found, claimed = {}, set()  # claimed: weight-gradient sums a chain's kernel makes
    for b in bindings:
        dx = b.var
        mul = call(dx, MULTIPLY)
        shape = static_shape(dx) if mul is not None else None
        if shape is None or str(dx.ty.dtype) != "float32" or shape[-1] * 4 > MAX_ROW_BYTES:
            continue
        stat_shape = (*shape[:-1], 1)
        rstd, d = mul.args if f32(mul.args[0], stat_shape) else mul.args[::-1]
        sub = call(d, SUBTRACT)
        if not (f32(rstd, stat_shape) and sub is not None and only_read_by(d, {dx})):
            continue
        a, c = sub.args
        sub_a, mul_c = call(a, SUBTRACT), call(c, MULTIPLY)
        if mul_c is None or not only_read_by(c, {d}):
            continue
        mean1 = call(sub_a.args[1], MEAN) if sub_a is not None else None
        centered = mean1 is not None and mean1.args[0].same_as(sub_a.args[0])
        if centered:  # a layer norm's: a = g - mean(g)
            g, m1 = sub_a.args
            if not _is_last_axis_mean(mean1, len(shape)) or not only_read_by(a, {d}) \
                    or not only_read_by(m1, {a}) or not f32(g, shape):
                continue
        else:  # an RMS norm's: a is g
            g, m1 = a, None
            if not f32(g, shape):
                continue
        xhat, m2 = mul_c.args if call(mul_c.args[1], MEAN) is not None else mul_c.args[::-1]
        mean2 = call(m2, MEAN)
        if mean2 is None or not _is_last_axis_mean(mean2, len(shape)) or not only_read_by(m2, {c}) \
                or not f32(xhat, shape):
            continue
        h = mean2.args[0]
        chain = {dx, d, a, c, m1, m2} if centered else {dx, d, c, m2}
        mul_h = call(h, MULTIPLY)
        if mul_h is not None and only_read_by(h, {m2}) and (
                (mul_h.args[0].same_as(g) and mul_h.args[1].same_as(xhat))
                or (mul_h.args[1].same_as(g) and mul_h.args[0].same_as(xhat))):
            chain.add(h)
            h = None
        elif not f32(h, shape):
            continue
        dy = gamma = None
        mul_g = call(g, MULTIPLY)
        if mul_g is not None and only_read_by(g, chain):
            vec = [i for i, arg in enumerate(mul_g.args) if _is_row_vector(arg, shape[-1])]
            other = mul_g.args[1 - vec[0]] if len(vec) == 1 else None
            if other is not None and f32(other, shape):
                dy, gamma = other, mul_g.args[vec[0]]
                chain.add(g)
                g = None
        casts, low = [], None
        for i in uses.get(dx, []):
            cast = bindings[i] if i < len(bindings) else None
            value = cast and cast.value
            if isinstance(value, relax.Call) and value.op == ASTYPE and str(value.attrs.dtype) in LOW \
                    and low in (None, str(value.attrs.dtype)):
                low = str(value.attrs.dtype)
                casts.append(cast.var)
        write_dx = not only_read_by(dx, set(casts))
        members = chain | set(casts)
        if len({blocks.get(v) for v in members}) != 1 or blocks.get(dx) is None \
                or not all(isinstance(v, relax.DataflowVar) for v in members):
            continue
        key, tail, tail_from = dx, None, None
        if epilogue:  # elementwise consumers in the kernel; the call sits at the last of them
            same_block = lambda v: blocks.get(v) == blocks.get(dx)  # noqa: E731
            # the chain starts at dx, beside its casts; else at its one cast, beside the cast's
            # readers that are not elementwise (BERT-Large: dropout's backward of the bf16 dx, which
            # a GEMM epilogue also reads)
            taken = other_tails.get(dx, frozenset())
            starts = [(dx, set(casts) | taken)]
            if len(casts) == 1:
                starts.append((casts[0], {r for r in readers(casts[0])
                                          if r is None or op_name(bound.get(r)) not in ELEMENTWISE or r in taken}))
            for start, skip in starts:
                tail = epilogue_chain(start, bound, readers, skip, shape, same_block)
                if tail is None:
                    continue
                # every other reader of dx and its cast must come after the call; dx is written
                # only if something besides its casts and the chain reads it
                inside = set(casts) | tail.vars
                outside = lambda v: [i for i in uses.get(v, [])  # noqa: E731
                                     if i >= len(bindings) or bindings[i].var not in inside]
                if all(i > index[tail.root] for v in (dx, *casts) for i in outside(v)):
                    key, tail_from = tail.root, start
                    write_dx = bool(outside(dx))
                    members = members | tail.vars
                    break
                tail = None
        group_rows = rows_per_block(shape) if dy is not None else None
        col_sums = tuple((s, kind) for s, kind in (_column_sums(dy, xhat, bindings, uses, blocks, index[key])
                                                   if group_rows else ()) if s not in claimed)
        claimed |= {s for s, _ in col_sums}
        members = members | {s for s, _ in col_sums} | {bound[s].args[0] for s, kind in col_sums if kind == "dy_xhat"}

        def prologue(expr):  # the elementwise producers the kernel recomputes (_prologue.py)
            if expr is None:
                return None
            p = inline_prologue(expr, bound, readers, members, shape)
            return p if all(blocks.get(v) == blocks.get(dx) for v in p.vars) else Prologue(expr, (), (expr,))

        found[key] = LayerNormGradChain(prologue(g), prologue(dy), gamma, prologue(h), prologue(xhat), rstd,
                                        write_dx, low, tuple(casts), frozenset(members - {key}), tail, dx, tail_from,
                                        centered, col_sums, group_rows or 1)
    return found


def _norm_outputs(func: relax.Function, found: dict, mod: tvm.IRModule) -> dict:
    """`found` with each chain given its forward norm's low-precision result ``y`` where that
    frees ``y`` across the backward (``NormOutput``): the kernel recomputes ``y`` from its ``xhat``
    and the forward's scale and shift, and the bindings that read ``y`` (or a reshape of it) before
    the kernel -- a weight gradient's GEMM, the next layer's in a post-LN network, this one's in a
    pre-LN network -- move after it with what reads them there (``deferred``), so that ``y`` is
    last read in the forward.  Taken when the chain's ``xhat`` is the forward kernel's own
    ``(x - mean) * rstd`` (an RMS norm's ``x * rstd``) of its input and the statistics it wrote,
    that kernel writes ``y`` as its cast result, and every reader of ``y`` that stays before the
    kernel comes before every one that moves (the forward's; the backward's all move)."""
    bindings, blocks = flat_bindings(func)
    bound = {b.var: b.value for b in bindings}
    index = {b.var: i for i, b in enumerate(bindings)}
    uses = binding_uses(func)
    keys = {index[k] for k in found}
    fixed = keys | {index[v] for c in found.values() for v in c.absorbed if v in index}
    out, claimed = {}, set()  # claimed: binding indices some chain already defers
    for key, chain in found.items():
        got = _forward_output(chain.xhat.root, bound, bindings, uses, mod)
        if got is None or static_shape(got.var) != static_shape(chain.dx):
            out[key] = chain
            continue
        found_readers = _deferred_readers(got.var, index[key], bindings, uses, blocks, fixed | claimed)
        if found_readers is None:
            out[key] = chain
            continue
        deferred, aliases = found_readers
        claimed |= set(deferred)
        output = NormOutput(got.var, got.gamma, got.beta, got.low, aliases)
        out[key] = dataclasses.replace(chain, output=output, deferred=tuple(bindings[i] for i in deferred))
    return out


def _tuple_item(expr, bound) -> tuple:
    """(tuple var, index) where `expr` is bound to ``tuple[index]``, else (None, None)."""
    value = bound.get(expr)
    return (value.tuple_value, int(value.index)) if isinstance(value, relax.TupleGetItem) else (None, None)


def _forward_output(xhat, bound: dict, bindings: list, uses: dict, mod: tvm.IRModule) -> NormOutput | None:
    """The cast result of the FuseLayerNorm kernel `xhat` is computed from as that kernel computes
    it -- ``(x - mean) * rstd``, an RMS norm's ``x * rstd``, x its input (or that widened to
    float32), mean and rstd its outputs -- with the kernel's scale and shift; None otherwise."""
    value = bound_call(bound, xhat, MULTIPLY)
    if value is None:
        return None
    for base, rstd in (value.args, value.args[::-1]):
        call_var, k = _tuple_item(rstd, bound)
        call = bound_call(bound, call_var, CALL_TIR) if call_var is not None else None
        if call is None or call.args[0] not in mod.get_global_vars():
            continue
        callee = mod[call.args[0]]
        info = callee.attrs.get(NORM_ATTR) if callee.attrs is not None else None
        if info is None:
            continue
        roles, inputs = [str(r) for r in info["outputs"]], [str(i) for i in info["inputs"]]
        args = list(call.args[1].fields)
        if roles[k] != "rstd" or "low" not in roles or len(args) != len(inputs):
            continue
        if bool(info["centered"]):
            sub = bound_call(bound, base, SUBTRACT)
            if sub is None:
                continue
            base, mean = sub.args
            mean_of, j = _tuple_item(mean, bound)
            if mean_of is None or not mean_of.same_as(call_var) or roles[j] != "mean":
                continue
        widen = bound_call(bound, base, ASTYPE)
        if not (base.same_as(args[0]) or (widen is not None and str(widen.attrs.dtype) == "float32"
                                          and widen.args[0].same_as(args[0]))):
            continue
        result = [bindings[i].var for i in uses.get(call_var, []) if i < len(bindings)
                  and _tuple_item(bindings[i].var, bound) == (call_var, roles.index("low"))]
        if len(result) != 1:
            continue
        vectors = dict(zip(inputs, args))
        return NormOutput(result[0], vectors.get("gamma"), vectors.get("beta"), str(result[0].ty.dtype))
    return None


def _deferred_readers(y: relax.Var, key: int, bindings: list, uses: dict, blocks: dict,
                      fixed: set) -> tuple | None:
    """(binding indices to move after binding `key`, in order; the reshapes of `y` that they or
    the bindings after `key` read), or None where reading the kernel's copy of `y` there frees
    nothing.  A reader of `y` (or of a reshape of it) before `key` moves with every binding before
    `key` that reads what it binds, transitively, unless one of those is `fixed` (a fused chain's,
    or moved already), in another block, or more than ``MAX_DEFERRED``; the rest stay.  Readers
    after `key` read the copy where they are.  That frees `y` when some reader reads the copy and
    every reader that stays comes before every one that moves."""
    aliases, readers, stack = [], set(), [y]
    while stack:  # y's readers through its reshapes
        var = stack.pop()
        for i in uses.get(var, []):
            if i >= len(bindings):
                return None  # the function's result is y itself
            value = bindings[i].value
            if isinstance(value, relax.Call) and value.op == RESHAPE and value.args[0].same_as(var):
                aliases.append(bindings[i].var)
                stack.append(bindings[i].var)
            else:
                readers.add(i)
    block = blocks.get(bindings[key].var)

    def closure(start: int) -> set | None:
        taken, todo = set(), [start]
        while todo:
            i = todo.pop()
            if i in taken:
                continue
            if i in fixed or blocks.get(bindings[i].var) != block or len(taken) >= MAX_DEFERRED:
                return None
            taken.add(i)
            todo += [u for u in uses.get(bindings[i].var, []) if u <= key]
        return taken

    moved = set()
    for i in sorted(r for r in readers if r < key):
        if i not in moved:
            moved |= closure(i) or set()
    stay = [i for i in readers if i < key and i not in moved]
    late = moved | {i for i in readers if i > key}  # what reads the copy
    if not late or (stay and moved and max(stay) > min(moved)):
        return None
    read_late = [v for v in aliases if any(j in late for j in uses.get(v, []))]
    return tuple(sorted(moved)), tuple((v, static_shape(v)) for v in read_late)


def _output_tag(out: NormOutput, index) -> str:
    """The kernel name's part for a norm output: where its scale and shift are read."""
    return f"_y{out.low}" + "".join(f"_{role}{index(v)}" for role, v in (("g", out.gamma), ("b", out.beta))
                                    if v is not None)


def _column_sums(dy, xhat, bindings, uses, blocks, key: int) -> tuple:
    """``(var, kind)`` of each weight gradient of the norm the kernel can make while it reads `dy`
    and `xhat`: ``sum(dy * xhat)`` (the scale's) or ``sum(dy)`` (the shift's) over every axis but
    the last, bound in the block of binding `key` (where the fused call goes), the product read by
    nothing else and the sum by nothing before the call.  Found from `dy`'s readers."""
    ndim = len(static_shape(dy))
    block = blocks.get(bindings[key].var)

    def reader(i, op):  # binding i, if it calls `op` in the block
        b = bindings[i] if i < len(bindings) else None
        return b if b is not None and isinstance(b.value, relax.Call) and b.value.op == op \
            and blocks.get(b.var) == block else None

    def row_sum(b) -> bool:  # a float32 sum over every axis but the last, read by nothing before the call
        attrs = b.value.attrs
        return attrs.axis is not None and not bool(attrs.keepdims) and str(b.var.ty.dtype) == "float32" \
            and sorted(int(a) % ndim for a in attrs.axis) == list(range(ndim - 1)) \
            and all(i > key for i in uses.get(b.var, []))

    found = {}  # binding index of the sum -> (its var, kind)
    for i in set(uses.get(dy, [])):
        if (s := reader(i, SUM)) is not None and row_sum(s):
            found[i] = (s.var, "dy")
        product = reader(i, MULTIPLY)
        if product is None or not any(p.same_as(dy) and q.same_as(xhat)
                                      for p, q in (product.value.args, product.value.args[::-1])):
            continue
        readers = uses.get(product.var, [])
        if len(readers) == 1 and (s := reader(readers[0], SUM)) is not None and row_sum(s):
            found[readers[0]] = (s.var, "dy_xhat")
    return tuple(found[i] for i in sorted(found))  # in binding order


def _fuse(scheduled: bool):
    def fuse(mutator, binding: relax.VarBinding, chain: LayerNormGradChain):
        shape = static_shape(chain.dx)
        roles = {"g": chain.g, "dy": chain.dy, "h": chain.h, "xhat": chain.xhat}
        prologues = [p for p in roles.values() if p is not None]
        extra = (chain.gamma,) if chain.gamma is not None else ()
        tail = [chain.tail] if chain.tail is not None else []
        out = chain.output
        vectors = tuple(v for v in (out.gamma, out.beta) if v is not None) if out is not None else ()
        leaves = unique_leaves(*prologues, *tail, extra=(*extra, chain.rstd, *vectors))
        index = leaf_index(leaves)
        name = (("layer_norm_grad_" if chain.centered else "rms_norm_grad_") + "x".join(map(str, shape))
                + ("_dyg" if chain.gamma is not None else "_g")
                + ("_h" if chain.h is not None else "") + ("_dx" if chain.write_dx else "")
                + (f"_{chain.low}" if chain.low else "") + ("_tail" if tail else "")
                + "".join(f"_sum_{kind}" for _, kind in chain.col_sums)
                + (f"_g{chain.group_rows}" if chain.col_sums else "")
                + (_output_tag(out, index) if out is not None else "")
                + prologue_tag(prologues + tail, leaves))

        def make():
            tensors = placeholders(leaves)
            of = {role: p and prologue_compute(p, leaves, tensors) for role, p in roles.items()}
            read = lambda e: tensors[leaf_index(leaves)(e)]  # noqa: E731
            tail_of = None
            if chain.tail is not None:
                compute = prologue_compute(chain.tail, leaves, tensors)
                start = (lambda dx: dx) if chain.tail_from.same_as(chain.dx) else (lambda dx: dx.astype(chain.low))
                tail_of = lambda idx, dx: compute(idx, {chain.tail_from: start(dx)})  # noqa: E731
            output_of = None
            if out is not None:  # as FuseLayerNorm's kernel computes its result from xhat
                def output_of(idx, xhat):
                    y = xhat * at(read(out.gamma), idx) if out.gamma is not None else xhat
                    return (y + at(read(out.beta), idx) if out.beta is not None else y).astype(out.low)
            return _grad_primfunc(shape, tensors, of["g"], of["dy"], read(chain.gamma) if extra else None,
                                  of["h"], of["xhat"], read(chain.rstd), chain.write_dx, chain.low, scheduled,
                                  tail_of, chain.centered, tuple(kind for _, kind in chain.col_sums),
                                  chain.group_rows, output_of)

        gvar = add_function_once(mutator.builder_, name, make)
        partial_shape = partials_shape(shape, chain.group_rows)
        types = ([relax.TensorType(shape, "float32")] if chain.write_dx else []) \
            + ([relax.TensorType(shape, chain.low)] if chain.low else []) \
            + ([chain.tail.root.ty] if tail else []) \
            + ([relax.TensorType(shape, out.low)] if out is not None else []) \
            + [relax.TensorType(partial_shape, "float32")] * len(chain.col_sums)
        builder = mutator.builder_
        outs = emit_call_tir(builder, gvar, [mutator.visit_expr(x) for x in leaves], types)
        outs, partials = outs[:len(outs) - len(chain.col_sums)], outs[len(outs) - len(chain.col_sums):]
        remaps = [(chain.dx, outs[0])] if chain.write_dx else []
        remaps += [(cast, outs[int(chain.write_dx)]) for cast in chain.casts]
        if out is not None:  # y read after the kernel: its copy (and reshapes of that)
            written, outs = outs[-1], outs[:-1]
            remaps += [(out.var, written)] + [(v, builder.emit(relax.op.reshape(written, alias_shape)))
                                              for v, alias_shape in out.aliases]
        remaps += [(chain.tail.root, outs[-1])] if tail else []
        for (var, _), partial in zip(chain.col_sums, partials):  # the sum over the groups: a small column sum
            rows = builder.emit(relax.op.reshape(partial, (partial_shape[0], shape[-1])))
            remaps.append((var, bind_as(builder, var, relax.op.sum(rows, [0]))))
        return remaps

    return fuse


@tvm.transform.module_pass(opt_level=0, name="FuseLayerNormBackward")
class FuseLayerNormBackward:
    """Fuse each layer norm input gradient (two row means and the elementwise combine, with the
    ``g``/``h`` products and the result casts where only it reads them) into one scheduled CUDA
    kernel (see the module docstring).  ``scheduled=False`` leaves the kernels unscheduled."""

    def __init__(self, scheduled: bool = True, epilogue: bool = False, norm_output: bool = False):
        self.scheduled = scheduled
        self.epilogue = epilogue
        self.norm_output = norm_output

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        return fuse_chains(mod, lambda func: find_chains(func, self.epilogue, mod, self.norm_output),
                           _fuse(self.scheduled))

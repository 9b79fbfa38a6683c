"""Two column sums of a tensor in one pass over it: ``tvm_evt`` column moments.

A training batch norm over the leading axes of a channel-last ``[..., C]`` tensor takes two sums
per channel in each direction (`batch_norm_op`), and a layer norm's parameter gradients are two
more over the rows of its output gradient::

    batch norm, forward   Σ x,  Σ x·x                     (mean and the one-pass variance)
    batch norm, backward  Σ g,  Σ g·(x - mean)            (dβ and, times rstd, dγ; mean per channel)
    layer norm, backward  Σ g,  Σ g·((x - mean)·rstd)     (dβ and dγ; mean and rstd per row)

These are the three ``KINDS``: ``moments``, ``centered`` and ``normalized``.

As separate reductions they read ``x`` (``g``) twice: at ResNet-50 conv3_x's 100352 x 512 that is
103 MB a read, and the column sums were 2.2 ms of its 9.8 ms step; a layer norm of GPT-2 medium
reads its float32 ``g`` twice, 64 MB a read.  ``emit_moments`` emits both sums as one ``call_tir``:

* the portable form (``moments_primfunc``, TE) is what any target builds: float32 partial sums of
  the row blocks of ``grid``, then the sums of the partials;
* on CUDA, ``ScheduleTIRForGPU`` swaps in ``moments_gpu_primfunc`` (``gpu_variant``): thread
  (tx, ty) of a block keeps ``LANES`` adjacent channels (one vector load of each input a row) of
  every ``TY``-th row of its row block in float32 registers, the block adds its ``TY`` rows of
  partials in shared memory, and a second kernel adds the row blocks' partials (``FINAL_TY``
  threads a channel).

Both forms return the partials of the same row blocks as the call's third and fourth outputs.
ResNet-50's largest (206 MB, the backward pair) streams at 2.8 TB/s on H100.

The PrimFunc is opaque to ``FuseOps`` (its inputs are values other kernels also read; a producer
fused into it would make a PrimFunc without the attribute its GPU form is rebuilt from).
"""
from __future__ import annotations

import contextlib
import json
import math

from tvm import relax, te, tirx

from ._rewrite import OPAQUE, emit_call_tir

MOMENTS_ATTR = "tvm_evt.column_moments"  # {"shape": [...], "dtypes": [...], "kind": KINDS, "out": [...]}
# the second sum's term, by kind: g·g, g·(x - mean[channel]), g·((x - mean[row])·rstd[row])
KINDS = ("moments", "centered", "normalized")
F32 = "float32"
LANES, TX, TY = 4, 32, 8  # channels a thread (one 8-byte bf16 load), threads along C and along rows
UNROLL = 4  # rows a thread loads before it adds them
TARGET_BLOCKS = 4 * 132  # blocks of the first kernel: four a streaming multiprocessor of an H100
FINAL_TY = 32  # threads a channel in the second kernel


def supported(shape, axes) -> bool:
    """Can the moments of a tensor of `shape` over `axes` take this form: a static channel-last
    reduction over every axis but the last, the channels a multiple of ``LANES``?"""
    rank = len(shape)
    return (rank >= 2 and all(isinstance(d, int) for d in shape) and sorted(axes) == list(range(rank - 1))
            and shape[-1] % LANES == 0)


def grid(shape) -> tuple[int, int, int]:
    """(column blocks, row blocks, rows a row block) of the first kernel."""
    c, m = shape[-1], math.prod(shape[:-1])
    col_blocks = -(-c // (LANES * TX))
    step = TY * UNROLL
    steps = -(-m // step)
    want = max(1, min(steps, TARGET_BLOCKS // col_blocks))
    if m % step == 0:  # row blocks that tile the rows exactly, if some are near `want`: no guards
        exact = [d for d in range(want, (want + 1) // 2 - 1, -1) if steps % d == 0]
        if exact:
            return col_blocks, exact[0], m // exact[0]
    rows = -(-steps // want) * step
    return col_blocks, -(-m // rows), rows


def keep_shape(shape) -> list[int]:
    """The sums' shape: `shape` with every axis but the last 1."""
    return [1] * (len(shape) - 1) + [shape[-1]]


def row_shape(shape) -> list[int]:
    """A per-row statistic's shape (a ``normalized`` kind's mean and rstd): `shape` with the last axis 1."""
    return list(shape[:-1]) + [1]


def _stats(shape, kind):
    """(name, shape) of the float32 statistics a kind reads after its two tensors."""
    return {"moments": [], "centered": [("mean", keep_shape(shape))],
            "normalized": [("mean", row_shape(shape)), ("rstd", row_shape(shape))]}[kind]


def _check(shape, kind, out) -> list[int]:
    if kind not in KINDS:
        raise ValueError(f"column moments: unknown kind {kind!r}; known: {', '.join(KINDS)}")
    out = keep_shape(shape) if out is None else [int(d) for d in out]
    if math.prod(out) != shape[-1]:
        raise ValueError(f"column moments: sums of shape {out} for {shape[-1]} channels")
    return out


def moments_primfunc(shape, dtypes, kind: str, out=None) -> tirx.PrimFunc:
    """Portable form: ``(a[, b, stats]) -> (s0, s1, p0, p1)`` with ``s0 = Σ a`` and ``s1`` the sum
    of the kind's term (``KINDS``) over every axis but the last, in float32, shaped `out` (default
    ``keep_shape``), and the partial sums ``p0``/``p1`` ``[row blocks, C]`` they are the sums of."""
    shape = [int(d) for d in shape]
    out = _check(shape, kind, out)
    c, m = shape[-1], math.prod(shape[:-1])
    _, row_blocks, rows = grid(shape)
    a = te.placeholder(shape, dtypes[0], name="a")
    ins = [a]
    if kind != "moments":
        b = te.placeholder(shape, dtypes[1], name="b")
        stats = {name: te.placeholder(st, F32, name=name) for name, st in _stats(shape, kind)}
        ins += [b, *stats.values()]

    def at(tensor, r, ch):  # element (row r of the flattened leading axes, channel ch)
        idx, rest = [], r
        for d in reversed(shape[:-1]):
            idx.append(rest % d)
            rest = rest // d
        return tensor[tuple(reversed(idx)) + (ch,)]

    def term(k, r, ch):
        x = at(a, r, ch).astype(F32)
        if k == 0:
            return x
        match kind:
            case "centered":
                return x * (at(b, r, ch).astype(F32) - stats["mean"][(0,) * (len(shape) - 1) + (ch,)])
            case "normalized":
                return x * ((at(b, r, ch).astype(F32) - at(stats["mean"], r, 0)) * at(stats["rstd"], r, 0))
            case _:
                return x * x

    def partial(k):
        i = te.reduce_axis((0, rows), name="i")
        return te.compute(
            (row_blocks, c),
            lambda rb, ch: te.sum(tirx.if_then_else(rb * rows + i < m, term(k, rb * rows + i, ch), tirx.const(0.0, F32)),
                                  axis=i),
            name=f"p{k}")

    def total(p, k):
        rb = te.reduce_axis((0, row_blocks), name="rb")

        def channel(idx):  # the flat channel of an index of `out`
            flat = idx[0]
            for i, d in zip(idx[1:], out[1:]):
                flat = flat * d + i
            return flat
        return te.compute(out, lambda *idx: te.sum(p[rb, channel(idx)], axis=rb), name=f"s{k}")

    p0, p1 = partial(0), partial(1)
    func = te.create_prim_func(ins + [total(p0, 0), total(p1, 1), p0, p1]).without_attr("global_symbol")
    func = func.with_attr("op_pattern", OPAQUE)
    return func.with_attr(MOMENTS_ATTR, json.dumps({"shape": shape, "dtypes": list(dtypes), "kind": kind, "out": out}))


def moments_gpu_primfunc(shape, dtypes, kind: str, out=None) -> tirx.PrimFunc:
    """``moments_primfunc``'s arguments, scheduled for CUDA (the module docstring)."""
    from tvm.script.ir_builder import IRBuilder
    from tvm.script.ir_builder import tirx as T

    shape = [int(d) for d in shape]
    out = _check(shape, kind, out)
    paired = kind != "moments"  # reads a second tensor b
    c, m = shape[-1], math.prod(shape[:-1])
    col_blocks, row_blocks, rows = grid(shape)
    idx = "int64" if m * c >= 2**31 else "int32"
    const = lambda v: tirx.const(v, idx)  # noqa: E731
    zero = tirx.const(0.0, F32)

    def column_total(buf, k, count, col):  # buf[k, 0, col] + ... + buf[k, count - 1, col]
        total = buf[k, 0, col]
        for t in range(1, count):
            total = total + buf[k, t, col]
        return total

    @contextlib.contextmanager
    def guard(row):  # rows past the end: only where the row blocks do not tile the rows
        if row_blocks * rows == m:
            yield
        else:
            with T.If(row < const(m)):
                with T.Then():
                    yield

    with IRBuilder() as ib:
        with T.prim_func():
            T.func_name("column_moments")
            T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True})
            a = T.arg("a", T.buffer(shape, dtypes[0]))
            if paired:
                b = T.arg("b", T.buffer(shape, dtypes[1]))
                stats = {name: T.arg(name, T.buffer(st, F32)) for name, st in _stats(shape, kind)}
            s = [T.arg(f"s{k}", T.buffer(out, F32)) for k in range(2)]
            p = [T.arg(f"p{k}", T.buffer((row_blocks, c), F32)) for k in range(2)]
            # a root block, as DLight's schedules have (RewriteDataflowReshape asks every one-input
            # PrimFunc whether it is a reshape, and that analysis wants a block at the root)
            root = T.sblock("root")
            root.__enter__()
            flat = lambda buf, n: T.decl_buffer((n,), buf.dtype, data=buf.data)  # noqa: E731
            fa = flat(a, m * c)
            fb = flat(b, m * c) if paired else None
            fmean = flat(stats["mean"], c if kind == "centered" else m) if paired else None
            frstd = flat(stats["rstd"], m) if kind == "normalized" else None
            fs = [flat(buf, c) for buf in s]
            with T.thread_binding(const(col_blocks), thread="blockIdx.x") as bx:
                with T.thread_binding(const(row_blocks), thread="blockIdx.y") as by:
                    red = T.alloc_buffer((2, TY, TX * LANES), F32, scope="shared")
                    with T.thread_binding(const(TY), thread="threadIdx.y") as ty:
                        with T.thread_binding(const(TX), thread="threadIdx.x") as tx:
                            acc = T.alloc_buffer((2, LANES), F32, scope="local")
                            va = T.alloc_buffer((UNROLL, LANES), dtypes[0], scope="local")
                            vb = T.alloc_buffer((UNROLL, LANES), dtypes[1], scope="local") if paired else None
                            # the mean of each channel (centered), or the statistics of each row (normalized)
                            vm = T.alloc_buffer((LANES,), F32, scope="local") if kind == "centered" else None
                            vs = T.alloc_buffer((2, UNROLL), F32, scope="local") if kind == "normalized" else None
                            c0 = (bx * const(TX) + tx) * const(LANES)
                            for k in range(2):
                                for v in range(LANES):
                                    T.buffer_store(acc, zero, [k, v])
                            with T.If(c0 < const(c)):
                                with T.Then():
                                    if kind == "centered":
                                        with T.vectorized(0, LANES) as v:
                                            T.buffer_store(vm, fmean[c0 + v], [v])
                                    with T.serial(0, rows // (TY * UNROLL)) as i:
                                        row = lambda u: by * const(rows) + (i * const(UNROLL) + u) * const(TY) + ty  # noqa: E731
                                        for u in range(UNROLL):  # the loads of UNROLL rows, then their sums
                                            with guard(row(u)):
                                                with T.vectorized(0, LANES) as v:
                                                    T.buffer_store(va, fa[row(u) * const(c) + c0 + v], [u, v])
                                                if paired:
                                                    with T.vectorized(0, LANES) as v:
                                                        T.buffer_store(vb, fb[row(u) * const(c) + c0 + v], [u, v])
                                                if kind == "normalized":
                                                    T.buffer_store(vs, fmean[row(u)], [0, u])
                                                    T.buffer_store(vs, frstd[row(u)], [1, u])
                                        for u in range(UNROLL):
                                            with guard(row(u)):
                                                for v in range(LANES):
                                                    x = T.Cast(F32, va[u, v])
                                                    match kind:
                                                        case "centered":
                                                            y = T.Cast(F32, vb[u, v]) - vm[v]
                                                        case "normalized":
                                                            y = (T.Cast(F32, vb[u, v]) - vs[0, u]) * vs[1, u]
                                                        case _:
                                                            y = x
                                                    T.buffer_store(acc, acc[0, v] + x, [0, v])
                                                    T.buffer_store(acc, acc[1, v] + x * y, [1, v])
                            for k in range(2):
                                for v in range(LANES):
                                    T.buffer_store(red, acc[k, v], [k, ty, tx * const(LANES) + v])
                            T.evaluate(T.tvm_storage_sync("shared"))
                            with T.If(tirx.all(ty == const(0), c0 < const(c))):
                                with T.Then():
                                    for k in range(2):
                                        for v in range(LANES):
                                            T.buffer_store(p[k], column_total(red, k, TY, tx * const(LANES) + v),
                                                           [by, c0 + v])
            # the row blocks' partials (a second kernel): TX channels a block, FINAL_TY threads a
            # channel striding over the row blocks, then added in shared memory
            # (a thread a channel looping over 448 row blocks took 15 us at C = 128)
            with T.thread_binding(const(-(-c // TX)), thread="blockIdx.x") as bx:
                red2 = T.alloc_buffer((2, FINAL_TY, TX), F32, scope="shared")
                with T.thread_binding(const(FINAL_TY), thread="threadIdx.y") as ty:
                    with T.thread_binding(const(TX), thread="threadIdx.x") as tx:
                        ch = bx * const(TX) + tx
                        tot = T.alloc_buffer((2,), F32, scope="local")
                        for k in range(2):
                            T.buffer_store(tot, zero, [k])
                        with T.If(ch < const(c)):
                            with T.Then():
                                with T.serial(0, -(-row_blocks // FINAL_TY)) as i:
                                    rb = i * const(FINAL_TY) + ty
                                    with T.If(rb < const(row_blocks)):
                                        with T.Then():
                                            for k in range(2):
                                                T.buffer_store(tot, tot[k] + p[k][rb, ch], [k])
                        for k in range(2):
                            T.buffer_store(red2, tot[k], [k, ty, tx])
                        T.evaluate(T.tvm_storage_sync("shared"))
                        with T.If(tirx.all(ty == const(0), ch < const(c))):
                            with T.Then():
                                for k in range(2):
                                    T.buffer_store(fs[k], column_total(red2, k, FINAL_TY, tx), [ch])
            root.__exit__(None, None, None)
    return ib.get()


def gpu_variant(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """The CUDA form of a ``moments_primfunc`` (one tagged ``MOMENTS_ATTR``)."""
    spec = json.loads(str(func.attrs[MOMENTS_ATTR]))
    return moments_gpu_primfunc(spec["shape"], spec["dtypes"], spec["kind"], spec["out"])


def emit_moments(bb: relax.BlockBuilder, a: relax.Expr, b: relax.Expr | None = None, *stats: relax.Expr,
                 out=None) -> tuple[relax.Var, relax.Var]:
    """Emit ``(Σ a, Σ a·a)``; given `b` and a per-channel mean, ``(Σ a, Σ a·(b - mean))``; given
    `b` and per-row mean and rstd, ``(Σ a, Σ a·((b - mean)·rstd))``: sums over every axis but the
    last, as float32 values of one ``call_tir`` shaped `out` (default ``keep_shape``; check
    `supported` first).  `a` and `b` are read in their own dtypes."""
    shape = [int(d) for d in a.ty.shape.values]
    if b is None:
        kind = "moments"
    elif len(stats) in (1, 2):
        kind = "centered" if len(stats) == 1 else "normalized"
    else:
        raise ValueError(f"column moments: a second tensor needs a mean per channel, or a mean and an rstd per "
                         f"row; got {len(stats)} statistics")
    dtypes = [str(a.ty.dtype), str(b.ty.dtype) if b is not None else str(a.ty.dtype)]
    func = moments_primfunc(shape, dtypes, kind, out)
    gv = bb.add_func(func, "column_moments" if kind == "moments" else f"column_moments_{kind}")
    _, row_blocks, _ = grid(shape)
    total = relax.TensorType(_check(shape, kind, out), F32)
    part = relax.TensorType((row_blocks, shape[-1]), F32)
    outs = emit_call_tir(bb, gv, [a] if b is None else [a, b, *stats], [total, total, part, part])
    return outs[0], outs[1]

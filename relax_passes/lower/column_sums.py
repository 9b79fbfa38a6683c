"""Column sums of elementwise terms in one pass over their inputs: ``tvm_evt`` column sums.

A column sum reduces a channel-last ``[..., C]`` value over every axis but the last.  Training
graphs take several over values computed from the same tensors: a batch norm's two sums a
direction, a layer norm's dγ and dβ, and at BERT-Large's loss the mean squared error beside the
last layer norm's dγ and dβ, all three functions of that layer norm's bf16 input and the float32
target (``FuseColumnSums``).  As separate kernels each reads those tensors again (BERT-Large: 101
MB a read).  Here one kernel reads the *leaves* once and adds up every *term*:

* a leaf is a tensor that broadcasts to the shape one of four ways (``leaf_class``): ``full``
  (the shape itself), ``row`` (``[..., 1]``: a per-row statistic), ``col`` (``[1, ..., C]`` or
  ``[C]``: a per-channel parameter) or ``scalar``;
* a term is an expression over the leaves, as JSON-able nested lists of ``_prologue.ELEMENTWISE``'s
  ops (the ones a prologue inlines, without their ``relax.`` prefix; a cast names its dtype last):
  ``["multiply", ["astype", ["in", 0], "float32"], ["in", 2]]``, ``["const", 2.0, "float32"]``.
  Each term's value is float32, and the kernel sums it per channel in float32.

The portable form (``sums_primfunc``, TE) is what any target builds: float32 partial sums of the
row blocks of ``grid``, then the sums of the partials.  On CUDA, ``ScheduleTIRForGPU`` swaps in
``sums_gpu_primfunc`` (``gpu_variant``): thread (tx, ty) of a block keeps ``LANES`` adjacent
channels of every ``TY``-th row of its row block in float32 registers, reading each ``full`` leaf
as one vector load a row, each ``row`` leaf as one scalar a row and the ``col``/``scalar`` leaves
once; the block adds its ``TY`` rows of partials in shared memory, and a second kernel adds the
row blocks' partials (``FINAL_TY`` threads a channel).  Both forms return the sums (shaped as asked),
then the partials ``[row blocks, C]`` they are the sums of.

The PrimFunc is opaque to ``FuseOps`` (its inputs are values other kernels also read; a producer
fused into it would make a PrimFunc without the attribute its GPU form is rebuilt from).
"""
from __future__ import annotations

import contextlib
import json
import math
from types import SimpleNamespace
from typing import Callable

from tvm import relax, te, tirx

from ._prologue import ELEMENTWISE, at
from .._rewrite import OPAQUE, emit_call_tir

SUMS_ATTR = "tvm_evt.column_sums"  # {"shape": [...], "leaves": [[shape, dtype], ...], "terms": [...], "outs": [...]}
F32 = "float32"
LANES, TX, TY = 4, 32, 8  # channels a thread (one 8-byte bf16 load), threads along C and along rows
UNROLL = 4  # rows a thread loads before it adds them
TARGET_BLOCKS = 4 * 132  # blocks of the first kernel: four a streaming multiprocessor of an H100
FINAL_TY = 32  # threads a channel in the second kernel
LEAF_CLASSES = ("full", "row", "col", "scalar")

def _op(term) -> tuple[Callable, list, object]:
    """(the TE builder of `term`'s op, its operand terms, the op's attributes)."""
    build = ELEMENTWISE.get("relax." + term[0])
    if build is None:
        known = ", ".join(name[len("relax."):] for name in ELEMENTWISE)
        raise ValueError(f"column sums: unknown term op {term[0]!r}; known: in, const, {known}")
    if term[0] == "astype":
        return build, term[1:2], SimpleNamespace(dtype=term[2])
    return build, term[1:], None


def evaluate(term, read: Callable[[int], tirx.PrimExpr]) -> tirx.PrimExpr:
    """The value of `term` with leaf ``i`` read as ``read(i)``."""
    if term[0] == "in":
        return read(int(term[1]))
    if term[0] == "const":
        return tirx.const(float(term[1]), term[2])
    build, operands, attrs = _op(term)
    return build([evaluate(t, read) for t in operands], attrs)


def leaves_of(term) -> set[int]:
    """The leaves `term` reads (checking its ops)."""
    if term[0] == "in":
        return {int(term[1])}
    if term[0] == "const":
        return set()
    return set().union(*(leaves_of(t) for t in _op(term)[1]))


def leaf_class(leaf_shape, shape) -> str | None:
    """How a leaf of `leaf_shape` broadcasts to `shape` (``LEAF_CLASSES``), None if otherwise."""
    leaf_shape, shape = [int(d) for d in leaf_shape], [int(d) for d in shape]
    if len(leaf_shape) > len(shape):
        return None
    padded = [1] * (len(shape) - len(leaf_shape)) + leaf_shape
    if padded == shape:
        return "full"
    if all(d == 1 for d in padded):
        return "scalar"
    if padded[:-1] == shape[:-1] and padded[-1] == 1:
        return "row"
    if all(d == 1 for d in padded[:-1]) and padded[-1] == shape[-1]:
        return "col"
    return None


def supported(shape, leaf_shapes=()) -> bool:
    """Can column sums over a tensor of `shape` take this form: static, rank >= 2, the channels a
    multiple of ``LANES``, every leaf of a ``leaf_class``?"""
    return (len(shape) >= 2 and all(isinstance(d, int) for d in shape) and shape[-1] % LANES == 0
            and all(leaf_class(s, shape) is not None for s in leaf_shapes))


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
    """A sum's default shape: `shape` with every axis but the last 1."""
    return [1] * (len(shape) - 1) + [shape[-1]]


def _spec(shape, leaves, terms, outs) -> dict:
    shape = [int(d) for d in shape]
    leaves = [[[int(d) for d in s], str(dt)] for s, dt in leaves]
    terms = json.loads(json.dumps(terms))  # lists all the way down: the attribute's form
    outs = [keep_shape(shape) for _ in terms] if outs is None else [[int(d) for d in o] for o in outs]
    if not terms or len(outs) != len(terms):
        raise ValueError(f"column sums: {len(terms)} terms, {len(outs)} output shapes")
    if any(math.prod(o) != shape[-1] for o in outs):
        raise ValueError(f"column sums: sums of shapes {outs} for {shape[-1]} channels")
    if not supported(shape, [s for s, _ in leaves]):
        raise ValueError(f"column sums: shape {shape} with leaves {leaves} not supported "
                         f"(channels a multiple of {LANES}; each leaf one of {LEAF_CLASSES})")
    used = set().union(*(leaves_of(t) for t in terms))
    if used - set(range(len(leaves))):
        raise ValueError(f"column sums: terms read leaves {sorted(used)}, there are {len(leaves)}")
    return {"shape": shape, "leaves": leaves, "terms": terms, "outs": outs}


def _flat_index(idx, dims):
    flat = idx[0]
    for i, d in zip(idx[1:], dims[1:]):
        flat = flat * d + i
    return flat


def sums_primfunc(shape, leaves, terms, outs=None) -> tirx.PrimFunc:
    """Portable form: ``(leaves...) -> (s_0, ..., s_K-1, p_0, ..., p_K-1)`` with ``s_k`` the float32
    sum of ``terms[k]`` over every axis but the last, shaped ``outs[k]`` (default ``keep_shape``),
    and ``p_k`` the partial sums ``[row blocks, C]`` it is the sum of.  `leaves`: (shape, dtype)."""
    spec = _spec(shape, leaves, terms, outs)
    shape, outs = spec["shape"], spec["outs"]
    c, m = shape[-1], math.prod(shape[:-1])
    _, row_blocks, rows = grid(shape)
    ins = [te.placeholder(s, dt, name=f"in{i}") for i, (s, dt) in enumerate(spec["leaves"])]

    def index(r, ch):  # the index of row r of the flattened leading axes, channel ch
        idx, rest = [], r
        for d in reversed(shape[:-1]):
            idx.append(rest % d)
            rest = rest // d
        return tuple(reversed(idx)) + (ch,)

    def partial(k, term):
        i = te.reduce_axis((0, rows), name="i")
        value = lambda rb, ch: evaluate(term, lambda j: at(ins[j], index(rb * rows + i, ch)))  # noqa: E731
        return te.compute((row_blocks, c), lambda rb, ch: te.sum(
            tirx.if_then_else(rb * rows + i < m, value(rb, ch), tirx.const(0.0, F32)), axis=i), name=f"p{k}")

    def total(p, k):
        rb = te.reduce_axis((0, row_blocks), name="rb")
        return te.compute(outs[k], lambda *idx: te.sum(p[rb, _flat_index(idx, outs[k])], axis=rb), name=f"s{k}")

    parts = [partial(k, t) for k, t in enumerate(spec["terms"])]
    func = te.create_prim_func(ins + [total(p, k) for k, p in enumerate(parts)] + parts).without_attr("global_symbol")
    return func.with_attr("op_pattern", OPAQUE).with_attr(SUMS_ATTR, json.dumps(spec))


def sums_gpu_primfunc(shape, leaves, terms, outs=None) -> tirx.PrimFunc:
    """``sums_primfunc``'s arguments, scheduled for CUDA (the module docstring)."""
    from tvm.script.ir_builder import IRBuilder
    from tvm.script.ir_builder import tirx as T

    spec = _spec(shape, leaves, terms, outs)
    shape, leaves, terms, outs = spec["shape"], spec["leaves"], spec["terms"], spec["outs"]
    n_terms = len(terms)
    classes = [leaf_class(s, shape) for s, _ in leaves]
    c, m = shape[-1], math.prod(shape[:-1])
    col_blocks, row_blocks, rows = grid(shape)
    idx = "int64" if m * c >= 2**31 else "int32"
    const = lambda v: tirx.const(v, idx)  # noqa: E731
    zero = tirx.const(0.0, F32)
    flat_size = {"full": m * c, "row": m, "col": c, "scalar": 1}

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
            T.func_name("column_sums")
            T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True})
            ins = [T.arg(f"in{i}", T.buffer(s, dt)) for i, (s, dt) in enumerate(leaves)]
            s = [T.arg(f"s{k}", T.buffer(outs[k], F32)) for k in range(n_terms)]
            p = [T.arg(f"p{k}", T.buffer((row_blocks, c), F32)) for k in range(n_terms)]
            # a root block, as DLight's schedules have (RewriteDataflowReshape asks every one-input
            # PrimFunc whether it is a reshape, and that analysis wants a block at the root)
            root = T.sblock("root")
            root.__enter__()
            flat = [T.decl_buffer((flat_size[cls],), buf.dtype, data=buf.data) for buf, cls in zip(ins, classes)]
            fs = [T.decl_buffer((c,), F32, data=buf.data) for buf in s]
            with T.thread_binding(const(col_blocks), thread="blockIdx.x") as bx:
                with T.thread_binding(const(row_blocks), thread="blockIdx.y") as by:
                    red = T.alloc_buffer((n_terms, TY, TX * LANES), F32, scope="shared")
                    with T.thread_binding(const(TY), thread="threadIdx.y") as ty:
                        with T.thread_binding(const(TX), thread="threadIdx.x") as tx:
                            acc = T.alloc_buffer((n_terms, LANES), F32, scope="local")
                            local_shape = {"full": (UNROLL, LANES), "row": (UNROLL,), "col": (LANES,), "scalar": (1,)}
                            regs = [T.alloc_buffer(local_shape[cls], dt, scope="local")
                                    for cls, (_, dt) in zip(classes, leaves)]
                            c0 = (bx * const(TX) + tx) * const(LANES)
                            for k in range(n_terms):
                                for v in range(LANES):
                                    T.buffer_store(acc, zero, [k, v])
                            with T.If(c0 < const(c)):
                                with T.Then():
                                    for j, cls in enumerate(classes):  # the per-channel and scalar leaves, once
                                        if cls == "col":
                                            with T.vectorized(0, LANES) as v:
                                                T.buffer_store(regs[j], flat[j][c0 + v], [v])
                                        elif cls == "scalar":
                                            T.buffer_store(regs[j], flat[j][const(0)], [0])
                                    with T.serial(0, rows // (TY * UNROLL)) as i:
                                        row = lambda u: by * const(rows) + (i * const(UNROLL) + u) * const(TY) + ty  # noqa: E731
                                        for u in range(UNROLL):  # the loads of UNROLL rows, then their sums
                                            with guard(row(u)):
                                                for j, cls in enumerate(classes):
                                                    if cls == "full":
                                                        with T.vectorized(0, LANES) as v:
                                                            T.buffer_store(regs[j], flat[j][row(u) * const(c) + c0 + v], [u, v])
                                                    elif cls == "row":
                                                        T.buffer_store(regs[j], flat[j][row(u)], [u])
                                        for u in range(UNROLL):
                                            with guard(row(u)):
                                                for v in range(LANES):
                                                    at = {"full": lambda j: regs[j][u, v], "row": lambda j: regs[j][u],  # noqa: B023
                                                          "col": lambda j: regs[j][v], "scalar": lambda j: regs[j][0]}  # noqa: B023
                                                    read = lambda j: at[classes[j]](j)  # noqa: E731
                                                    for k, term in enumerate(terms):
                                                        T.buffer_store(acc, acc[k, v] + evaluate(term, read), [k, v])
                            for k in range(n_terms):
                                for v in range(LANES):
                                    T.buffer_store(red, acc[k, v], [k, ty, tx * const(LANES) + v])
                            T.evaluate(T.tvm_storage_sync("shared"))
                            with T.If(tirx.all(ty == const(0), c0 < const(c))):
                                with T.Then():
                                    for k in range(n_terms):
                                        for v in range(LANES):
                                            T.buffer_store(p[k], column_total(red, k, TY, tx * const(LANES) + v),
                                                           [by, c0 + v])
            # the row blocks' partials (a second kernel): TX channels a block, FINAL_TY threads a
            # channel striding over the row blocks, then added in shared memory
            # (a thread a channel looping over 448 row blocks took 15 us at C = 128)
            with T.thread_binding(const(-(-c // TX)), thread="blockIdx.x") as bx:
                red2 = T.alloc_buffer((n_terms, FINAL_TY, TX), F32, scope="shared")
                with T.thread_binding(const(FINAL_TY), thread="threadIdx.y") as ty:
                    with T.thread_binding(const(TX), thread="threadIdx.x") as tx:
                        ch = bx * const(TX) + tx
                        tot = T.alloc_buffer((n_terms,), F32, scope="local")
                        for k in range(n_terms):
                            T.buffer_store(tot, zero, [k])
                        with T.If(ch < const(c)):
                            with T.Then():
                                with T.serial(0, -(-row_blocks // FINAL_TY)) as i:
                                    rb = i * const(FINAL_TY) + ty
                                    with T.If(rb < const(row_blocks)):
                                        with T.Then():
                                            for k in range(n_terms):
                                                T.buffer_store(tot, tot[k] + p[k][rb, ch], [k])
                        for k in range(n_terms):
                            T.buffer_store(red2, tot[k], [k, ty, tx])
                        T.evaluate(T.tvm_storage_sync("shared"))
                        with T.If(tirx.all(ty == const(0), ch < const(c))):
                            with T.Then():
                                for k in range(n_terms):
                                    T.buffer_store(fs[k], column_total(red2, k, FINAL_TY, tx), [ch])
            root.__exit__(None, None, None)
    return ib.get()


def gpu_variant(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """The CUDA form of a ``sums_primfunc`` (one tagged ``SUMS_ATTR``)."""
    spec = json.loads(str(func.attrs[SUMS_ATTR]))
    return sums_gpu_primfunc(spec["shape"], spec["leaves"], spec["terms"], spec["outs"])


def emit_sums(bb: relax.BlockBuilder, leaves: list, func: tirx.PrimFunc, name: str = "column_sums") -> list[relax.Var]:
    """Emit a ``sums_primfunc`` `func` (added as `name`) over the Relax `leaves` as one ``call_tir``;
    the vars of its float32 sums."""
    spec = json.loads(str(func.attrs[SUMS_ATTR]))
    shape, outs = spec["shape"], spec["outs"]
    gv = bb.add_func(func, name)
    _, row_blocks, _ = grid(shape)
    types = [relax.TensorType(o, F32) for o in outs] + [relax.TensorType((row_blocks, shape[-1]), F32)] * len(outs)
    return emit_call_tir(bb, gv, leaves, types)[:len(outs)]

"""What the row-kernel fusions share (FuseSoftmaxDropout, FuseLayerNorm, FuseLayerNormBackward):
the one-thread-block-per-row CUDA schedule of a TE kernel whose outputs need row reductions (or a
block a group of rows, where the kernel also sums columns over the rows), and the mutator that
replaces a matched chain of bindings with one fused call."""

from __future__ import annotations

import math
from typing import Callable

import tvm
from tvm import relax, te, tirx
from tvm.relax.expr_functor import PyExprMutator, mutator

from .._rewrite import OPAQUE, mutate_relax_functions

LOW = ("bfloat16", "float16")
MIN_GROUP_ROWS = 4  # rows_per_block's least: fewer, and the partial sums cost about what they save
# the GPU the row kernels are scheduled for (H100 and H200): its SMs, and the threads and thread
# blocks an SM holds at once
SMS, SM_THREADS, SM_BLOCKS = 132, 2048, 32
GROUP_BLOCKS = None  # rows_per_block's target thread blocks where set (scripts/bench_tir.py --norm-blocks)


def threads_per_row(n: int) -> int:
    """Threads per row: a warp multiple covering the row in at most 8 elements a thread."""
    return min(1024, max(32, 32 * math.ceil(math.ceil(n / 8) / 32)))


def block_names(name: str, outputs: int) -> list[str]:
    """The blocks of a te.compute named `name`: one per output (``name_v0``, ...) under one loop
    nest when it has several."""
    return [f"{name}_v{i}" for i in range(outputs)] if outputs > 1 else [name]


def schedule_rows(sch: tvm.s_tir.Schedule, outputs: list[str], reductions: list[str], n: int,
                  stage: bool, column_sums: tuple[str, ...] = (), group_rows: int = 1,
                  row_outputs: tuple[str, ...] = ()) -> None:
    """One thread block per row of the loop nest of the `outputs` blocks (one nest).  The
    `reductions` (row-shaped blocks, producers first) are computed per row in shared memory as
    cross-thread reductions; with `stage`, the first reduction's input row is first copied into
    shared memory, read from there by the reductions and the `outputs`.  Every loop over the row
    is split across the block's threads.  `row_outputs` (a block a nest, over ``[..., 1]``: values
    of the reductions written once a row) join the row loop, after the `outputs`; every thread of
    the row's block computes and stores their (equal) values.

    With `column_sums` (blocks ``[groups, V, threads]`` that sum a value over the rows of each group
    of `group_rows` rows: ``column_partials``' shape), a block walks its group's rows one after
    the other, and each thread adds the columns it computes the outputs of into registers, at the
    same index as it reads them for the outputs (so the loads are shared); each thread writes its
    partial sums once, after the group."""
    threads = threads_per_row(n)
    outs = [sch.get_sblock(o) for o in outputs]
    reds = [sch.get_sblock(r) for r in reductions]
    sums = [sch.get_sblock(c) for c in column_sums]
    *lead, col = sch.get_loops(outs[0])
    row = sch.fuse(*lead) if len(lead) > 1 else lead[0]
    for name in row_outputs:
        *lead_o, _unit = sch.get_loops(sch.get_sblock(name))
        row = sch.merge(row, sch.fuse(*lead_o) if len(lead_o) > 1 else lead_o[0])
    if sums:
        group, row = sch.split(row, [None, group_rows])
        for block in sums:  # [groups, V, threads, rows of the group] -> [groups, rows of the group, V, threads]
            g, v, t, i = sch.get_loops(block)
            sch.reorder(i, v, t)
        group = sch.merge(group, *[sch.get_loops(b)[0] for b in sums])
        row = sch.merge(sch.get_loops(outs[0])[1], *[sch.get_loops(b)[1] for b in sums])
        vec, col = sch.split(sch.get_loops(outs[0])[-1], [n // threads, threads])
        vec = sch.merge(vec, *[sch.get_loops(b)[2] for b in sums])
    for block in reversed(reds):  # consumers first: each lands before what reads it
        sch.compute_at(block, row)
    for block in reds:
        sch.set_scope(block, 0, "shared")
    row_blocks = list(reds)
    if stage:
        staged = sch.cache_read(reds[0], 0, "shared", consumer_blocks=[*reds, *outs])
        sch.compute_at(staged, row)
        row_blocks.insert(0, staged)
    sch.bind(group if sums else row, "blockIdx.x")
    for loop in (sch.get_loops(b)[-1] for b in row_blocks):
        sch.bind(sch.split(loop, [None, threads])[1], "threadIdx.x")
    if not sums:
        sch.bind(sch.split(col, [None, threads])[1], "threadIdx.x")
        return
    sch.bind(col, "threadIdx.x")
    sch.unroll(vec)
    for block in sums:
        sch.bind(sch.get_loops(block)[-1], "threadIdx.x")
        partial = sch.cache_write(block, 0, "local")  # V registers a thread
        sch.reverse_compute_at(partial, group)
        v, t = sch.get_loops(partial)[-2:]
        sch.bind(t, "threadIdx.x")
        sch.unroll(v)


def partials_shape(shape: tuple[int, ...], group_rows: int) -> tuple[int, int, int]:
    """``(groups, V, threads)``: the shape of `column_partials` over `shape`."""
    *lead, n = shape
    threads = threads_per_row(n)
    return math.prod(lead) // group_rows, n // threads, threads


def column_partials(shape: tuple[int, ...], group_rows: int, value, name: str):
    """``[groups, V, threads]`` float32 (`partials_shape`): the sum of ``value(idx)`` over each
    group of `group_rows` consecutive rows of `shape` (its leading axes flattened) at column
    ``v * threads + t`` (``schedule_rows``' column sums; their sum over the groups, read as
    ``[groups, n]``, is the column sum)."""
    *lead, _n = shape
    threads = threads_per_row(shape[-1])
    i = te.reduce_axis((0, group_rows), name=f"{name}_i")

    def index(group, v, t):
        flat, idx = group * group_rows + i, []
        for extent in reversed(lead):
            idx.append(tirx.floormod(flat, extent))
            flat = tirx.floordiv(flat, extent)
        return (*reversed(idx), v * threads + t)

    return te.compute(partials_shape(shape, group_rows), lambda g, v, t: te.sum(value(index(g, v, t)), axis=i),
                      name=name)


def resident_blocks(threads: int) -> int:
    """Thread blocks of `threads` threads the whole GPU holds at once (one full residency)."""
    return SMS * min(SM_BLOCKS, SM_THREADS // threads)


def rows_per_block(shape: tuple[int, ...], blocks: int | None = None) -> int | None:
    """Rows a thread block of a row kernel with column sums walks: the divisor of the row count
    (at least ``MIN_GROUP_ROWS``) whose block count is nearest, by ratio, `blocks`, by default one
    full residency of the GPU (`resident_blocks`), and at least half of it; so the blocks fill every
    SM once and the partial sums stay small against the rows.  None where no divisor leaves half
    that many blocks (the partials would cost about what they save, or idle SMs) or the row does not
    split evenly over the threads.

    Measured on an H200 (scripts/bench_tir.py --norm-blocks, us a call; docs/bench/h200-2026-11-30f):
    BERT-Large's layer-norm gradient (16384 rows of 1024, 128 threads: 2112 blocks a residency) 68-70
    with groups of 8 rows (2048 blocks) against 77-81 with 16 (the earlier rule's: at least 528
    blocks) and 70-73 with 4; Llama's RMS-norm gradient (8192 rows of 4096, 512 threads: 528) 84.6
    with groups of 16 against 85.8 with 8, 89.0 with 4."""
    *lead, n = shape
    threads = threads_per_row(n)
    if n % threads:
        return None
    rows, blocks = math.prod(lead), blocks or GROUP_BLOCKS or resident_blocks(threads)
    fits = [d for d in range(MIN_GROUP_ROWS, 2 * rows // blocks + 1) if rows % d == 0]  # >= blocks / 2 blocks
    return min(fits, key=lambda d: (abs(math.log(rows / d / blocks)), -d)) if fits else None


def scheduled(sch: tvm.s_tir.Schedule) -> tirx.PrimFunc:
    """The schedule's function, marked scheduled (DLight skips it) and opaque (FuseOps too)."""
    return sch.mod["main"].with_attr("tirx.is_scheduled", True).with_attr("op_pattern", OPAQUE)


@mutator
class _ChainFuser(PyExprMutator):
    def __init__(self, mod: tvm.IRModule, find: Callable, fuse: Callable):
        super().__init__(mod)
        self.find, self.fuse = find, fuse

    def prime(self, func: relax.Function) -> None:
        self.chains = self.find(func)
        self.absorbed = set().union(*(c.absorbed for c in self.chains.values())) if self.chains else set()
        self.deferred = {b.var for c in self.chains.values() for b in getattr(c, "deferred", ())}

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        if binding.var in self.absorbed:
            return  # computed by the fused call
        if binding.var in self.deferred:
            return  # bound again after its chain's call
        chain = self.chains.get(binding.var)
        if chain is None:
            return super().visit_var_binding_(binding)
        for var, out in self.fuse(self, binding, chain):
            self.set_var_remap(var, out)
        for later in getattr(chain, "deferred", ()):  # in their order, reading the call's outputs
            super().visit_var_binding_(later)


def fuse_chains(mod: tvm.IRModule, find: Callable, fuse: Callable) -> tvm.IRModule:
    """Rewrite every Relax function of `mod`: ``find(func)`` maps the var of each match's last
    binding to the match (an object with ``absorbed``: the other bindings the fused call replaces),
    and at that binding ``fuse(mutator, binding, match)`` emits the fused call through
    ``mutator.builder_`` and returns the (old var, new var) pairs to remap.  A match's optional
    ``deferred`` bindings (earlier ones, in order) are moved after the call, their reads remapped.
    Bindings left unused are removed."""
    fuser = _ChainFuser(mod, find, fuse)
    mod = mutate_relax_functions(fuser, mod, before_each=fuser.prime)
    return relax.transform.DeadCodeElimination()(mod)

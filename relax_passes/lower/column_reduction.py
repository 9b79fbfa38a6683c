"""ColumnReduction: a DLight GPU rule for sums (and maxima, minima, products) over a
non-innermost axis (column reductions), each thread a 16-byte vector of columns.

Batch-norm statistics and gradients, bias gradients and split reductions are column sums: an
``[..., R, N]`` input (after inlining its elementwise producers) summed over ``R`` into
``[..., N]``, ``N`` innermost in both.  DLight's ``Reduction`` gives each thread one column
(16 x 16 threads, one bf16 element a load): on H100 ResNet-50's batch-norm sums ran at about
2 TB/s (2.2 ms a step) and BERT-Large's bias-gradient sums at 1.5 TB/s.  With this rule
ResNet-50's largest went 0.454 -> 0.368 ms and 0.288 -> 0.139 ms (5 and 7 calls a step).

This rule gives each thread ``v`` consecutive columns (16 bytes of the widest type read along
``N`` or accumulated: 4 columns for a float32 sum) and ``TY`` threads of a block the rows, split so:

1. ``rfactor`` over the ``TY`` row groups: every thread sums its rows of its ``v`` columns in
   float registers, the ``v`` loads one vector;
2. the ``TY`` partial sums of each column are added across ``threadIdx.y`` and written once.

A max, min or product takes the same schedule, its partial results starting from the reducer's
identity (``REDUCERS``).

``v`` is the widest vector of which ``TX`` divide ``N``; where none does (``N`` not a multiple of
64 bf16 or 32 float32 columns: EfficientNet's 96-672 channels, a depthwise weight gradient's
``[G, R, S, K]`` partial sums) the widest vector that divides ``N`` into a number of vectors with
a divisor from ``TX / 2`` to ``TX``, that divisor the block's threads along ``N`` (96 float32
columns: 24 threads of 4; 480: 30 of 4), where such sums went to DLight's ``Reduction``.  No
block is partial: TVM 0.27's ``LowerCrossThreadReduction`` drops a predicated block's condition
from the write of the combined result (a partial last block of 32 threads wrote its idle
threads' zeros into the next row's columns: 3c144dc, caught by the GPU tier).

A *short* reduction, at most ``SHORT_ROWS`` rows under at least ``SHORT_MIN_THREADS`` column
vectors, is one thread's work instead: each of ``THREADS`` threads a block keeps its ``v`` columns
in float registers over all the rows and writes them once, with no partial results to combine.
Grouped-query attention makes one: its key and value gradients are computed per query head and
summed over the query heads that share a key/value head (``[B, Hk, G, S, D]`` summed over
``G``, 4 for Llama's 32 query heads over 8).  Under the row-group schedule each thread read one
vector and four threads combined theirs across ``threadIdx.y``: on H200 that kernel took 1.1 ms a
step of the bench's Llama (eight 100 MB calls, 0.73 TB/s); with this schedule about 0.2 ms
(the step's kernels 84.32 -> about 83.4 ms, ``docs/bench/h200-2026-11-30d/``).

It takes a function that is, after inlining, one block with spatial iterators ``[..., n]`` and
one reduction iterator ``r``, reducing into ``out[..., n]`` with one of ``REDUCERS``, where every
load uses ``n`` only in its last index, as ``n`` itself (or not at all: a per-column vector such
as a batch-norm mean), and ``r`` never in the last index; a sum with at least ``MIN_BLOCKS``
thread blocks (fewer go to DLight's ``Reduction``, which takes no other reducer: those are taken
at any count).  Anything else is declined and goes to the next rule.
"""

from __future__ import annotations

import math

import tvm
from tvm import tirx
from tvm.s_tir.dlight.base import try_inline_contiguous_spatial
from tvm.s_tir.dlight.gpu.base import GPUScheduleRule

from .vectorized_elementwise import VECTOR_BYTES, _accesses, _uses_var, inlined_blocks

# The combiners the reduction rules take: the binary ones of TVM 0.27's reducer registry, for
# which ``rfactor`` and the cross-thread reduction find the identity (0, 1, the type's lowest and
# highest value) and a block's init must be that identity (a max from -inf is refused by rfactor,
# and the rule passes the function on).  DLight's ``Reduction`` takes only sums, so a max (a
# cross-entropy's over the vocabulary) had no rule but ``Fallback``'s: one thread a row.
REDUCERS = (tirx.Add, tirx.Max, tirx.Min, tirx.Mul)
TX = 32  # column vectors a block
# Row groups a block.  H100, BERT-Large's column sums (`scripts/bench_tir.py bert_large --match sum
# --column-rows 2,4,8`): 4 against 8 took the bias gradients 13.0 -> 8.3 us, the layer-norm weight
# gradients 41-43 -> 37-38 us, the FFN bias gradient 51.3 -> 47.9 us; 2 and 16 were no better
# than 4 anywhere.  In the training step: 0.092 -> 0.071 ms for the five bias gradients.
TY = 4
# Fewer thread blocks than this (half of H100's SMs) are declined.  The second stages of split
# sums ([128, 512] -> [512]: 4 blocks) ran 2.6 -> 9.5 us under this rule on H100.
MIN_BLOCKS = 66
# A short reduction (module docstring): at most this many rows, and at least this many column
# vectors (threads) to spread (about one H100's worth of resident threads: 132 SMs x 2048).
SHORT_ROWS = 32
SHORT_MIN_THREADS = 1 << 18
THREADS = 256  # threads a block of a short reduction


def single_reduction_block(rule: GPUScheduleRule, func, target):
    """(schedule, block, its loops) where `func` is a PrimFunc for a target `rule` takes and is,
    after inlining its elementwise producers, one block of spatial iterators and then one
    reduction iterator that combines into its output with one of ``REDUCERS``, one loop per
    iterator; else None.  What the reduction rules (``ColumnReduction``, ``RowReduction``) start
    from."""
    found = inlined_blocks(rule, func, target, try_inline_contiguous_spatial)
    if found is None or len(found[1]) != 1:
        return None
    sch, infos = found
    block_rv = infos[0].block_rv
    block, loops = sch.get(block_rv), sch.get_loops(block_rv)
    kinds = [iv.iter_type for iv in block.iter_vars]
    if len(loops) != len(kinds) or not kinds or kinds[-1] != tirx.IterVar.CommReduce or \
            any(k != tirx.IterVar.DataPar for k in kinds[:-1]):
        return None
    if not isinstance(block.body, tirx.BufferStore) or not isinstance(block.body.value, REDUCERS):
        return None
    return sch, block_rv, loops


def fit_lanes(widest_bits: int, extent, threads: int) -> int:
    """16 bytes of the widest type, halved until ``lanes * threads`` divides `extent` (1: none)."""
    if not isinstance(extent, tirx.IntImm):
        return 1
    lanes = VECTOR_BYTES * 8 // widest_bits
    while lanes > 1 and int(extent) % (lanes * threads):
        lanes //= 2
    return lanes if int(extent) % (lanes * threads) == 0 else 1


def column_lanes(block) -> tuple[int, int]:
    """(columns a thread, threads along the columns a block) in `block`, a `single_reduction_block`
    (lanes 1: the rule does not apply): 16 bytes of the widest type where ``TX`` such vectors divide
    the columns, else as few as do; where none does, the widest vector that divides the columns into
    a number of vectors with a divisor of at least ``TX // 2`` threads (at most ``TX``)."""
    if len(block.iter_vars) < 2:
        return 1, TX
    n, r = block.iter_vars[-2].var, block.iter_vars[-1].var
    if not block.body.indices or not block.body.indices[-1].same_as(n):
        return 1, TX
    # the widest type along n sets the lanes; the accumulator counts too: its register vector is
    # as wide, and TVM 0.27's CUDA codegen has no 8-lane float (make_ulonglong4 of 8 arguments)
    widest = 8
    for buf, idx in _accesses(block):
        if not idx:
            continue
        if any(_uses_var(i, n) for i in idx[:-1]) or _uses_var(idx[-1], r):
            return 1, TX
        if _uses_var(idx[-1], n):
            if not idx[-1].same_as(n):
                return 1, TX
            widest = max(widest, tvm.DataType(str(buf.dtype)).bits)
    extent = block.iter_vars[-2].dom.extent
    full = fit_lanes(widest, extent, TX)
    if full > 1 or not isinstance(extent, tirx.IntImm):
        return full, TX
    lanes = VECTOR_BYTES * 8 // widest
    while lanes > 1:
        if int(extent) % lanes == 0:
            vectors = int(extent) // lanes
            threads = max(d for d in range(1, TX + 1) if vectors % d == 0)
            if threads >= TX // 2:
                return lanes, threads
        lanes //= 2
    return 1, TX


class ColumnReduction(GPUScheduleRule):
    """Column reductions, ``v`` columns a thread and `row_groups` (``TY``) row groups a block
    (module docstring)."""

    def __init__(self, row_groups: int = TY):
        self.row_groups = row_groups

    def apply(self, func: tirx.PrimFunc, target, _tunable: bool):
        found = single_reduction_block(self, func, target)
        if found is None:
            return None
        sch, block_rv, loops = found
        lanes, tx = column_lanes(sch.get(block_rv))
        if lanes == 1:
            return None
        extents = [int(sch.get(lp).extent) for lp in loops]
        if extents[-1] <= SHORT_ROWS and math.prod(extents[:-1]) // lanes >= SHORT_MIN_THREADS:
            return self._short(sch, block_rv, loops, lanes)
        blocks = math.prod(extents[:-1]) // (tx * lanes)
        if blocks < MIN_BLOCKS and isinstance(sch.get(block_rv).body.value, tirx.Add):
            return None  # too few blocks: DLight's rule spreads a few columns' rows over more
        *outer, n, r = loops
        ro, ry = sch.split(r, [None, self.row_groups])
        nb, nx, nv = sch.split(n, [None, tx, lanes])
        sch.reorder(*outer, nb, nx, ry, ro, nv)
        rf = sch.rfactor(ry, 0)  # [TY, ..., N] partial results, each over its rows ro
        *rf_outer, rf_nb, rf_nx, rf_ry, rf_ro, rf_nv = sch.get_loops(rf)
        bx = sch.fuse(*rf_outer, rf_nb)
        sch.bind(bx, "blockIdx.x")
        sch.bind(rf_nx, "threadIdx.x")
        sch.bind(rf_ry, "threadIdx.y")
        sch.set_scope(rf, 0, "local")
        sch.vectorize(rf_nv)  # before the init is split off: a vectorized loop needs a reduction block
        sch.decompose_reduction(rf, rf_ro)

        # the TY partial results of each column, combined across threadIdx.y
        sch.reverse_compute_at(block_rv, bx, preserve_unit_loops=True)
        _, w_ry, *_, w_n = sch.get_loops(block_rv)  # the block's iterators: ry, then [..., n]
        w_nx, w_nv = sch.split(w_n, [tx, lanes])
        sch.reorder(w_nx, w_nv, w_ry)
        sch.bind(w_nx, "threadIdx.x")
        sch.bind(w_ry, "threadIdx.y")
        return sch

    @staticmethod
    def _short(sch, block_rv, loops, lanes: int):
        """A short reduction: thread t of the grid sums the rows of column vector t in registers."""
        *outer, n, r = loops
        nq, nv = sch.split(n, [None, lanes])
        sch.reorder(*outer, nq, r, nv)
        bx, tx = sch.split(sch.fuse(*outer, nq), [None, THREADS])
        sch.bind(bx, "blockIdx.x")
        sch.bind(tx, "threadIdx.x")
        acc = sch.cache_write(block_rv, 0, "local")  # the sums in registers, written once after
        sch.reverse_compute_at(acc, tx, preserve_unit_loops=True)
        sch.vectorize(sch.get_loops(acc)[-1])
        sch.vectorize(nv)  # before the init is split off, as above
        sch.decompose_reduction(block_rv, r)
        return sch

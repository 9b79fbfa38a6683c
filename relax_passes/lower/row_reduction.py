"""RowReduction: a DLight GPU rule for sums over the innermost axis (row sums), each thread
16-byte vectors of its row.

A loss's full sum (after ``SplitReduction``: ``[rows, 1024]`` partial sums, then a small sum of
those) is a row sum of an elementwise expression: ResNet-50's MSE reads the bf16 output and the
float32 target, BERT-Large's two float32 tensors.  DLight's ``Reduction`` gives each of 1024
threads of a block one element of one row, then adds 1024 values across the block: on H100 these
ran at 1.3 TB/s (ResNet-50, 0.24 ms) and 1.6 TB/s (BERT-Large).

This rule gives a block one row, ``TX`` threads, each ``v`` consecutive elements a load (16
bytes of the widest type read along the row or accumulated: 4 for a float32 sum):

1. ``rfactor`` over the ``TX * v`` lanes: every thread sums its ``v`` lanes of each of the row's
   ``R / (TX * v)`` chunks in float registers, each chunk one vector load;
2. the ``TX * v`` partial sums are added, first the ``v`` of a thread, then across the block.

It takes a function that is, after inlining, one block with spatial iterators ``[...]`` and one
reduction iterator ``r``, summing into ``out[...]``, where every load that uses ``r`` has it as
its last index, as ``r`` itself, and nowhere else; ``R`` a multiple of ``32 * v`` and at least
``MIN_ROWS`` rows.  Anything else is declined and goes to the next rule.
"""

from __future__ import annotations

import math

import tvm
from tvm import tirx
from tvm.s_tir.dlight.gpu.base import GPUScheduleRule

from .column_reduction import fit_lanes, single_sum_block
from .vectorized_elementwise import _accesses, _uses_var

TX_CHOICES = (128, 64, 32)  # threads a row (block): the first that divides R / v
MIN_ROWS = 264  # two blocks an SM of H100 at least; fewer long rows are DLight's (they split a row)


def row_lanes(block) -> int:
    """The elements a thread loads at once in `block`, a `single_sum_block` (1: the rule does
    not apply)."""
    r = block.iter_vars[-1].var
    if any(_uses_var(i, r) for i in block.body.indices):
        return 1
    widest = tvm.DataType(str(block.body.buffer.dtype)).bits  # the accumulator is a register vector too
    for buf, idx in _accesses(block):
        if not idx or not any(_uses_var(i, r) for i in idx):
            continue
        if any(_uses_var(i, r) for i in idx[:-1]) or not idx[-1].same_as(r):
            return 1
        widest = max(widest, tvm.DataType(str(buf.dtype)).bits)
    return fit_lanes(widest, block.iter_vars[-1].dom.extent, TX_CHOICES[-1])


class RowReduction(GPUScheduleRule):
    """Row sums, a block a row and ``v`` elements a thread's load (module docstring)."""

    def apply(self, func: tirx.PrimFunc, target, _tunable: bool):
        found = single_sum_block(self, func, target)
        if found is None:
            return None
        sch, block_rv, loops = found
        lanes = row_lanes(sch.get(block_rv))
        if lanes == 1:
            return None
        *outer, r = loops
        extent = int(sch.get(r).extent)
        if math.prod(int(sch.get(lp).extent) for lp in outer) < MIN_ROWS:
            return None
        tx = next(t for t in TX_CHOICES if extent % (t * lanes) == 0)
        ro, rl = sch.split(r, [None, tx * lanes])
        rf = sch.rfactor(rl, 0)  # [TX * v, rows...] partial sums, each over the row's chunks ro
        *rf_outer, rf_ro, rf_rl = sch.get_loops(rf)
        rf_tx, rf_v = sch.split(rf_rl, [tx, lanes])
        sch.reorder(*rf_outer, rf_tx, rf_ro, rf_v)
        bx = sch.fuse(*rf_outer) if len(rf_outer) > 1 else rf_outer[0]
        sch.bind(bx, "blockIdx.x")
        sch.bind(rf_tx, "threadIdx.x")
        sch.set_scope(rf, 0, "local")
        sch.vectorize(rf_v)  # before the init is split off: a vectorized loop needs a reduction block
        sch.decompose_reduction(rf, rf_ro)

        # a thread's v partial sums, then the TX threads' sums across the block
        sch.reverse_compute_at(block_rv, bx, preserve_unit_loops=True)
        _, w_rl, *w_row = sch.get_loops(block_rv)  # the block's iterators: the lanes, then the row's
        w_tx, w_v = sch.split(w_rl, [tx, lanes])
        sch.reorder(*w_row, w_tx, w_v)  # the reduction loops innermost, as cross-thread reduction needs
        sch.bind(w_tx, "threadIdx.x")
        return sch

"""RowReduction: a DLight GPU rule for sums (and maxima, minima, products) over the innermost
axis (row reductions), each thread 16-byte vectors of its row.

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

A max, min or product (``REDUCERS``) takes the same schedule, its partial results starting from
the reducer's identity.  DLight's ``Reduction`` takes only sums, so these had no rule but
``Fallback``'s, one thread a row looping over all of it: a causal LM's cross-entropy max over
a 32000 vocabulary (``[8192, 32000]`` bf16 logits, Llama at batch 4 x 2048) took 21.4 ms on
H200, 20 % of the training step.  So a reduction other than a sum is taken at any row count,
and a row no vector fits (a vocabulary of 50257 or 30522) gets DLight's own form instead,
``SCALAR_TX`` threads a row, one element a load, the last chunk cut by a predicate.

It takes a function that is, after inlining, one block with spatial iterators ``[...]`` and one
reduction iterator ``r``, combining into ``out[...]`` with one of ``REDUCERS``, where every load
that uses ``r`` has it as its last index, as ``r`` itself, and nowhere else; for a sum, ``R`` a
multiple of ``32 * v`` and at least ``MIN_ROWS`` rows (other sums are DLight's).  Anything else is
declined and goes to the next rule.
"""

from __future__ import annotations

import math

import tvm
from tvm import tirx
from tvm.s_tir.dlight.gpu.base import GPUScheduleRule

from .column_reduction import fit_lanes, single_reduction_block
from .vectorized_elementwise import _accesses, _uses_var

TX_CHOICES = (128, 64, 32)  # threads a row (block): the first that divides R / v
MIN_ROWS = 264  # two blocks an SM of H100 at least; fewer long rows are DLight's (they split a row)
# Threads a row read one element a load (a row no vector fits): DLight's Reduction's for CUDA,
# its block of 1024 threads (fewer for a row shorter than that: the largest power of two in it).
SCALAR_TX = 1024


def row_bits(block) -> int | None:
    """The widest type read along the row or accumulated in `block`, a `single_reduction_block`,
    in bits; None where `block` does not read rows (a load uses ``r`` other than as its last
    index, or the output uses it)."""
    r = block.iter_vars[-1].var
    if any(_uses_var(i, r) for i in block.body.indices):
        return None
    widest = tvm.DataType(str(block.body.buffer.dtype)).bits  # the accumulator is a register vector too
    for buf, idx in _accesses(block):
        if not idx or not any(_uses_var(i, r) for i in idx):
            continue
        if any(_uses_var(i, r) for i in idx[:-1]) or not idx[-1].same_as(r):
            return None
        widest = max(widest, tvm.DataType(str(buf.dtype)).bits)
    return widest


def row_lanes(block) -> int:
    """The elements a thread loads at once in `block`, a `single_reduction_block` (1: no vector
    fits the row, or `block` does not read rows)."""
    bits = row_bits(block)
    return 1 if bits is None else fit_lanes(bits, block.iter_vars[-1].dom.extent, TX_CHOICES[-1])


class RowReduction(GPUScheduleRule):
    """Row reductions, a block a row and ``v`` elements a thread's load (module docstring)."""

    def apply(self, func: tirx.PrimFunc, target, _tunable: bool):
        found = single_reduction_block(self, func, target)
        if found is None:
            return None
        sch, block_rv, loops = found
        block = sch.get(block_rv)
        if row_bits(block) is None or not isinstance(block.iter_vars[-1].dom.extent, tirx.IntImm):
            return None
        lanes = row_lanes(block)
        *outer, r = loops
        extent = int(sch.get(r).extent)
        if isinstance(block.body.value, tirx.Add) and \
                (lanes == 1 or math.prod(int(sch.get(lp).extent) for lp in outer) < MIN_ROWS):
            return None  # DLight's Reduction takes this sum
        if lanes > 1:
            tx = next(t for t in TX_CHOICES if extent % (t * lanes) == 0)
        else:  # one element a load; the last chunk of the row cut by a predicate
            tx = min(SCALAR_TX, 1 << (extent.bit_length() - 1))
        ro, rl = sch.split(r, [None, tx * lanes])
        rf = sch.rfactor(rl, 0)  # [TX * v, rows...] partial results, each over the row's chunks ro
        *rf_outer, rf_ro, rf_rl = sch.get_loops(rf)
        rf_tx, rf_v = sch.split(rf_rl, [tx, lanes])
        sch.reorder(*rf_outer, rf_tx, rf_ro, rf_v)
        bx = sch.fuse(*rf_outer) if len(rf_outer) > 1 else rf_outer[0]
        sch.bind(bx, "blockIdx.x")
        sch.bind(rf_tx, "threadIdx.x")
        sch.set_scope(rf, 0, "local")
        if lanes > 1:
            sch.vectorize(rf_v)  # before the init is split off: a vectorized loop needs a reduction block
        sch.decompose_reduction(rf, rf_ro)

        # a thread's v partial results, then the TX threads' across the block
        sch.reverse_compute_at(block_rv, bx, preserve_unit_loops=True)
        _, w_rl, *w_row = sch.get_loops(block_rv)  # the block's iterators: the lanes, then the row's
        w_tx, w_v = sch.split(w_rl, [tx, lanes])
        sch.reorder(*w_row, w_tx, w_v)  # the reduction loops innermost, as cross-thread reduction needs
        sch.bind(w_tx, "threadIdx.x")
        return sch

"""TiledTranspose: a DLight GPU rule for injective kernels that read one operand transposed,
through a shared-memory tile, so that both its reads and the output's writes are coalesced.

DLight's ``Fallback`` maps one output element to a thread: the writes are coalesced along the
output's innermost axis, and the transposed operand is read with a stride of its row length.
ResNet-50's NCHW <-> NHWC boundaries ran so on H100: the fp32 input cast to a bf16 NHWC
activation (616 MB) in 0.56 ms, and the MSE loss's NCHW target subtracted from the NHWC output
(514 MB) in 0.30 ms, about 1.1 and 1.7 TB/s.

The rule takes a function that is, after inlining, one all-spatial block writing its output in
iterator order, ``out[v0, ..., vk]``, that loads a buffer whose indices are the iterators
permuted, its last index some ``vj`` with ``j != k``.  It tiles ``vj`` by ``tj`` and ``vk`` by
``tk`` (the largest of ``TILES`` that divide their extents; ``vj`` whole where none divides it and
it is short), one thread block a tile:

1. the block's threads copy the tile of the transposed operand into shared memory, ``tj``
   consecutive elements of its innermost axis at a time;
2. they compute the ``tj x tk`` outputs with ``vk`` innermost, reading the tile across its rows
   (padded by one element, so the column reads do not conflict on banks) and every other operand
   from global memory, as the output, along ``vk``.

On H100 the ResNet input's cast and transpose went from 0.563 to 0.271 ms.  Everything else is
declined and goes to the next rule.
"""

from __future__ import annotations

import tvm
from tvm import tirx
from tvm.s_tir.dlight.gpu.base import GPUScheduleRule

from .vectorized_elementwise import _accesses, single_spatial_block

THREADS = 256
TILES = (64, 32, 16, 8)  # tile edges tried, largest first


def _tile(extent, limit: int = max(TILES), whole: bool = False) -> int | None:
    """The largest of `TILES` up to `limit` that divides `extent`; with `whole`, else the whole
    extent if it is at most ``max(TILES)`` (ResNet's 28-wide rows: one 112-byte read a row)."""
    if not isinstance(extent, tirx.IntImm):
        return None
    found = next((t for t in TILES if t <= limit and int(extent) % t == 0), None)
    return found if found or not whole or int(extent) > max(TILES) else int(extent)


def transposed_read(block) -> tuple[tirx.Buffer, int, int] | None:
    """(the buffer `block` reads transposed, the iterator position of its innermost index, that
    of the output's innermost axis within its indices), or None where the rule does not apply."""
    ivars = [iv.var for iv in block.iter_vars]
    if not ivars or any(iv.iter_type != tirx.IterVar.DataPar for iv in block.iter_vars):
        return None
    body = block.body
    if not isinstance(body, tirx.BufferStore) or len(body.indices) != len(ivars) or \
            any(not i.same_as(v) for i, v in zip(body.indices, ivars)):
        return None
    k = len(ivars) - 1
    best = None
    for buf, idx in _accesses(block):
        if buf.same_as(body.buffer):
            continue
        order = [next((a for a, v in enumerate(ivars) if v.same_as(i)), None) for i in idx]
        if None in order or sorted(order) != list(range(len(ivars))):
            continue  # not the iterators permuted (a broadcast, a diagonal, an offset)
        j, position = order[-1], order.index(k)
        if j == k:
            continue
        size = tvm.DataType(str(buf.dtype)).bits * len(idx)
        if best is None or size > best[0]:
            best = (size, buf, j, position)
    return None if best is None else best[1:]


class TiledTranspose(GPUScheduleRule):
    """Injective kernels with one transposed operand: shared-memory tiles (module docstring)."""

    def apply(self, func: tirx.PrimFunc, target, _tunable: bool):
        found = single_spatial_block(self, func, target)
        if found is None:
            return None
        sch, block_rv, loops = found
        block = sch.get(block_rv)
        found = transposed_read(block)
        if found is None:
            return None
        buf, j, position = found
        k = len(loops) - 1
        tj, tk = _tile(sch.get(loops[j]).extent, 32, whole=True), _tile(sch.get(loops[k]).extent)
        if tj is None or tk is None or tj * tk < 32:
            return None
        jo, ji = sch.split(loops[j], [None, tj])
        ko, ki = sch.split(loops[k], [None, tk])
        others = [lp for a, lp in enumerate(loops) if a not in (j, k)]
        sch.reorder(*others, jo, ko, ji, ki)
        bx = sch.fuse(*others, jo, ko)
        sch.bind(bx, "blockIdx.x")
        threads = min(THREADS, tj * tk)

        index = [r.source.same_as(buf) for r in block.reads].index(True)
        tile = sch.cache_read(block_rv, index, "shared")
        sch.compute_at(tile, bx)
        _, tx = sch.split(sch.fuse(*sch.get_loops(tile)[1:]), [None, threads])
        sch.bind(tx, "threadIdx.x")
        # rows of tj + 1: the compute reads a column (consecutive vk) without bank conflicts
        sch.storage_align(tile, 0, axis=position, factor=tj, offset=1)

        _, tx = sch.split(sch.fuse(ji, ki), [None, threads])
        sch.bind(tx, "threadIdx.x")
        return sch

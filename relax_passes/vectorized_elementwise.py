"""VectorizedElementwise: a DLight GPU rule for injective kernels whose innermost axis is
contiguous, with 16-byte vector loads and stores.

DLight's ``Fallback`` (what TVM 0.27 gives elementwise kernels) maps one element to one thread.
On H100 the training graph's elementwise kernels then ran at about a third of the memory
bandwidth (BERT-Large: a [16384, 1024] bf16 where/multiply 0.088 ms for 80 MB; the attention
head transposes [B,S,H,d] -> [B,H,S,d] 0.065 ms for 64 MB).  This rule takes a function that is,
after inlining, one all-spatial block, and gives each thread ``v`` consecutive elements of the
innermost axis as one vector (16 bytes of the widest element type), provided every buffer access
is vector-friendly:

* the innermost iterator ``i`` appears only in the last index, as ``i + rest`` with ``rest`` a
  provable multiple of ``v`` (so vectors start aligned), or not at all (a broadcast);
* every buffer's last extent and ``i``'s extent are multiples of ``v``.

Bool data along the vector (a dropout mask read, ReLU's backward comparison
``where(x > 0, dy, 0)``) cannot be one vector: TVM 0.27's CUDA codegen has no ``boolxN`` type.
Such a kernel is *staged* instead: each thread still owns ``v`` consecutive elements, the other
buffers are loaded into registers and the results stored from them as 16-byte vectors, and the
``v`` elements are computed one by one in an unrolled loop, the bool bytes read as they are used
(one 8-byte span a thread, which the L1 serves after the first of its loads).  A buffer read at
several places, or under an ``if_then_else`` (padding: its region is only valid where the guard
holds), is read the same way, element by element.  Before, these kernels ran one element a thread
(BERT-Large's dropout backward, a bf16 [16384, 1024] where/multiply: 0.084 ms for 84 MB, 1 TB/s;
staged, 0.025 ms on H100).

Anything else (true transposes that move the innermost axis, strided slices, reductions) is
declined and goes to the next rule.
"""

from __future__ import annotations

import dataclasses
import math

import tvm
import tvm_ffi
from tvm import s_tir, sym, tirx
from tvm.s_tir.dlight.analysis import normalize_prim_func
from tvm.s_tir.dlight.base import try_inline
from tvm.s_tir.dlight.gpu.base import GPUScheduleRule

THREADS = 256
VECTOR_BYTES = 16
IF_THEN_ELSE = tvm.ir.Op.get("prim.if_then_else")
# the expression kinds that make bool values: comparisons, logic, casts
BOOL_VALUED = (tirx.GT, tirx.GE, tirx.LT, tirx.LE, tirx.EQ, tirx.NE, tirx.And, tirx.Or, tirx.Not, tirx.Cast)


def _accesses(block: tirx.SBlock) -> list[tuple[tirx.Buffer, list]]:
    """(buffer, indices) of every load and store in the block body."""
    found = _accesses_in(block.body)
    tvm_ffi.structural_walk(block.body, (tirx.BufferStore, lambda n: found.append((n.buffer, list(n.indices)))),
                            order="post")
    return found


def _accesses_in(node) -> list[tuple[tirx.Buffer, list]]:
    """(buffer, indices) of every load in `node`."""
    found = []  # TVM 0.27: a BufferLoad is an ir.TensorLoad of its buffer
    tvm_ffi.structural_walk(node, (tvm.ir.expr.TensorLoad, lambda n: found.append((n.source, list(n.indices)))),
                            order="post")
    return found


def _uses_var(expr, var) -> bool:
    hit = []
    tvm_ffi.structural_walk(expr, (tvm.ir.expr.Var, lambda n: hit.append(1) if n.same_as(var) else None), order="post")
    return bool(hit)


def _bool_values_along(block: tirx.SBlock, var) -> bool:
    """Does the block compute a bool value that varies along `var` (it would be a boolxN vector)?"""
    hit = []

    def visit(node) -> None:
        if str(node.ty) == "bool" and _uses_var(node, var):
            hit.append(node)

    tvm_ffi.structural_walk(block.body, [(kind, visit) for kind in BOOL_VALUED], order="post")
    return bool(hit)


def _guarded_buffers(block: tirx.SBlock) -> set:
    """Buffers loaded inside an ``if_then_else`` branch (read only where its guard holds)."""
    guarded = set()

    def visit(call) -> None:
        if call.op.same_as(IF_THEN_ELSE):
            for branch in call.args[1:]:
                guarded.update(b for b, _ in _accesses_in(branch))

    tvm_ffi.structural_walk(block.body, (tvm.ir.expr.Call, visit), order="post")
    return guarded


@dataclasses.dataclass(frozen=True)
class Plan:
    """How `VectorizedElementwise` schedules a block: `lanes` elements a thread (1: declined);
    `staged`: bool data along them, so vector loads and stores through registers around a scalar
    loop, the buffers in `staged_reads` (read once, unguarded) loaded as vectors."""

    lanes: int
    staged: bool = False
    staged_reads: tuple = ()


def plan(block: tirx.SBlock) -> Plan:
    """The lanes every access of `block` allows along its innermost iterator, and whether bool
    data along them makes the block staged (module docstring)."""
    if not block.iter_vars or any(iv.iter_type != tirx.IterVar.DataPar for iv in block.iter_vars):
        return Plan(1)
    inner = block.iter_vars[-1]
    extent = int(inner.dom.extent) if isinstance(inner.dom.extent, tirx.IntImm) else 0
    accesses = _accesses(block)
    along = [(b, idx) for b, idx in accesses if any(_uses_var(i, inner.var) for i in idx)]
    staged = _bool_values_along(block, inner.var) or any(str(b.dtype) == "bool" for b, _ in along)
    vector = [(b, idx) for b, idx in accesses if str(b.dtype) != "bool"] if staged else accesses
    widest = max((tvm.DataType(str(b.dtype)).bits for b, _ in vector), default=8)
    lanes = max(1, VECTOR_BYTES * 8 // widest)
    analyzer = sym.Analyzer()
    for iv in block.iter_vars:
        analyzer.bind(iv.var, iv.dom)
    while lanes > 1:
        if extent % lanes == 0 and all(_friendly(buf, idx, inner.var, lanes, analyzer) for buf, idx in vector):
            break
        lanes //= 2
    if lanes == 1 or not staged:
        return Plan(lanes)
    guarded = _guarded_buffers(block)
    written = {r.source for r in block.writes}
    places: dict = {}  # buffer -> the index tuples it is read at
    for b, idx in along:
        if str(b.dtype) != "bool" and b not in written:
            seen = places.setdefault(b, [])
            if not any(tvm_ffi.structural_equal(idx, other) for other in seen):
                seen.append(idx)
    once = tuple(b for b, seen in places.items() if len(seen) == 1 and b not in guarded)
    return Plan(lanes, True, once)


def vector_lanes(block: tirx.SBlock) -> int:
    """The lanes `block` gets (1: declined)."""
    return plan(block).lanes


def _friendly(buf, indices, var, lanes: int, analyzer) -> bool:
    if not indices:
        return True
    if any(_uses_var(i, var) for i in indices[:-1]):
        return False
    last = indices[-1]
    if not _uses_var(last, var):
        return True  # broadcast along the vector
    shape = [int(s) if isinstance(s, tirx.IntImm) else None for s in buf.shape]
    if shape[-1] is None or shape[-1] % lanes:
        return False
    rest = analyzer.simplify(last - var)
    if _uses_var(rest, var):
        return False
    return analyzer.can_prove(tirx.floormod(rest, lanes) == 0)


def single_spatial_block(rule: GPUScheduleRule, func, target):
    """(schedule, block, its loops) where `func` is a PrimFunc for a target `rule` takes and is,
    after inlining, one all-spatial block with one loop per iterator, in iterator order; else
    None.  What the injective rules here start from."""
    if not isinstance(func, tirx.PrimFunc) or not rule.is_target_available(target):
        return None
    sch = s_tir.Schedule(func)
    infos = normalize_prim_func(sch)
    if infos is None:
        return None
    infos = try_inline(sch, infos)
    if len(infos) != 1 or any(k != "S" for k in infos[0].dom_kind()):
        return None
    block_rv = infos[0].block_rv
    loops = sch.get_loops(block_rv)
    iters = infos[0].iters  # normalized: one loop per iterator, in order
    if not loops or len(iters) != len(loops) or len(sch.get(block_rv).iter_vars) != len(loops) or \
            any(not sch.get(i.loop_rv).same_as(sch.get(lp)) for i, lp in zip(iters, loops)):
        return None
    return sch, block_rv, loops


class VectorizedElementwise(GPUScheduleRule):
    """Injective kernels with a contiguous innermost axis: ``THREADS`` threads a block, each
    thread one aligned vector of up to 16 bytes (module docstring)."""

    def apply(self, func: tirx.PrimFunc, target, _tunable: bool):
        found = single_spatial_block(self, func, target)
        if found is None:
            return None
        sch, block_rv, loops = found
        block = sch.get(block_rv)
        how = plan(block)
        lanes = how.lanes
        if lanes == 1:
            return None
        total = math.prod(int(sch.get(lp).extent) for lp in loops)
        threads = THREADS  # a divisor of the vector count where one exists: no tail predicate
        while threads > 32 and (total // lanes) % threads:
            threads //= 2
        # Split the lanes off the innermost loop before fusing, so that the outer iterators do not
        # depend on the lane: a broadcast operand (NCHW's per-channel s[c]) is then one scalar load.
        # Fused first, its index was floordiv(ramp, HW) -> a gather by an int32x8 index vector, which
        # TVM 0.27's CUDA codegen emits as make_longlong4 with 8 arguments (NVRTC: "too many arguments").
        outer, vec = sch.split(loops[-1], [None, lanes])
        bx, tx = sch.split(sch.fuse(*loops[:-1], outer), [None, threads])
        sch.bind(bx, "blockIdx.x")
        sch.bind(tx, "threadIdx.x")
        if not how.staged:
            sch.vectorize(vec)
            return sch
        for buf in how.staged_reads:
            index = [r.source.same_as(buf) for r in sch.get(block_rv).reads].index(True)
            _vectorize_at(sch, sch.cache_read(block_rv, index, "local"), tx, reverse=False)
        for index in range(len(sch.get(block_rv).writes)):
            _vectorize_at(sch, sch.cache_write(block_rv, index, "local"), tx, reverse=True)
        sch.unroll(vec)
        return sch


def _vectorize_at(sch, copy, loop, reverse: bool) -> None:
    """Move the register copy `copy` under `loop` (before the block, or after it for a store) and
    make its one lane loop a vector."""
    (sch.reverse_compute_at if reverse else sch.compute_at)(copy, loop)
    sch.vectorize(sch.get_loops(copy)[-1])

"""VectorizedElementwise: a DLight GPU rule for injective kernels whose innermost axis is
contiguous, with 16-byte vector loads and stores.

DLight's ``Fallback`` (what TVM 0.27 gives elementwise kernels) maps one element to one thread.
On H100 the training graph's elementwise kernels then ran at about a third of the memory
bandwidth (BERT-Large: a [16384, 1024] bf16 where/multiply 0.088 ms for 80 MB; the attention
head transposes [B,S,H,d] -> [B,H,S,d] 0.065 ms for 64 MB).  This rule takes a function that is,
after inlining, one all-spatial block, and gives each thread ``v`` consecutive elements of the
innermost axis as one vector (16 bytes of the widest element type), provided every buffer access
is vector-friendly:

* the innermost iterator ``i`` enters the access's row-major offset as ``i + rest`` with
  ``rest`` free of ``i`` and a provable multiple of ``v`` (so vectors are contiguous and start
  aligned: ``x[..., i + c]``, or a reshape's ``x[..., i // 64, i % 64]``), or not at all (a
  broadcast);
* ``i``'s extent is a multiple of ``v``, and so is every bound ``c`` of an ``if_then_else`` guard
  ``c <= i`` (a concatenation along ``i``), or of a range ``a <= i and i < b`` (rotary embeddings'
  ``rotate_half`` and its gradient: ``pad`` and ``strided_slice`` over the two halves of the head):
  such a guard holds for a whole vector, and is written on ``i - i % v`` so that the vectorizer keeps
  one guard and vector loads in its branches.

Bool data along the vector (a dropout mask read, ReLU's backward comparison
``where(x > 0, dy, 0)``) cannot be one vector: TVM 0.27's CUDA codegen has no ``boolxN`` type.
Nor can a ``Select`` between values along the vector on a condition that is not (a slice
scatter's row test, circular padding's): the vectorizer broadcasts the condition to one.
Such a kernel is *staged* instead: each thread still owns ``v`` consecutive elements, the other
buffers are loaded into registers and the results stored from them as 16-byte vectors, and the
``v`` elements are computed one by one in an unrolled loop, the bool bytes read as they are used
(one 8-byte span a thread, which the L1 serves after the first of its loads).  A buffer read at
several places, or under an ``if_then_else`` (padding: its region is only valid where the guard
holds), is read the same way, element by element.  Before, these kernels ran one element a thread
(BERT-Large's dropout backward, a bf16 [16384, 1024] where/multiply: 0.084 ms for 84 MB, 1 TB/s;
staged, 0.025 ms on H100).

In a staged kernel only the accesses along the vector set its width: a per-row value it reads (a
cross-entropy gradient's int64 label, a float32 row statistic) is one scalar a row, and no longer
halves a bf16 kernel's lanes (that gradient over Llama's [8192, 32000] logits ran 2 lanes wide).
A staged kernel may also *gather* under a guard: a buffer read inside an ``if_then_else`` branch at
an index that is not contiguous along the vector (an im2col row of a convolution on 3 channels,
``x[img, i(col), j(col), col % 3]`` where the window is inside the image, zero where it overlaps
the padding) is read element by element in the unrolled loop, and the lanes come from the other
accesses and the stores.  DLight's ``Fallback`` gave such a kernel one element a thread: on H200
ResNet-50's stem columns (batch 128, [1605632, 152] bf16 gathered from the float32 input) took
1.04 ms a step, about 0.5 TB/s.

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


def _bool_values_along(block: tirx.SBlock, var, exclude=()) -> bool:
    """Does the block compute a bool value that varies along `var` (it would be a boolxN vector),
    apart from the conditions in `exclude`?"""
    hit = []

    def visit(node) -> None:
        if str(node.ty) == "bool" and _uses_var(node, var) and not any(node.same_as(e) for e in exclude):
            hit.append(node)

    tvm_ffi.structural_walk(block.body, [(kind, visit) for kind in BOOL_VALUED], order="post")
    return bool(hit)


def _selects_on_a_broadcast(block: tirx.SBlock, var) -> bool:
    """Does the block select between values along `var` on a condition that does not vary along it
    (a slice-scatter's ``where`` on a row index)?  The vectorizer broadcasts that condition into a
    boolxN, which TVM 0.27's CUDA codegen cannot declare ("Cannot convert type T.boolx8")."""
    hit = []

    def visit(sel) -> None:
        if not _uses_var(sel.condition, var) and (_uses_var(sel.true_value, var) or _uses_var(sel.false_value, var)):
            hit.append(sel)

    tvm_ffi.structural_walk(block.body, (tirx.Select, visit), order="post")
    return bool(hit)


def _guard_bound(cond, var) -> int | None:
    """The constant ``c`` of an ``if_then_else`` condition that compares `var` itself with it
    (``c <= var``, ``var < c``, ...: which input of a concatenation an element comes from)."""
    if not isinstance(cond, (tirx.LE, tirx.LT, tirx.GE, tirx.GT)):
        return None
    bound = cond.b if cond.a.same_as(var) else cond.a if cond.b.same_as(var) else None
    return int(bound.value) if isinstance(bound, tirx.IntImm) else None


def _guard_bounds(cond, var) -> list[int] | None:
    """The constants of an ``if_then_else`` condition that is one comparison of `var` itself with a
    constant (`_guard_bound`) or a conjunction of such (a range, ``a <= var and var < b``), else None."""
    if isinstance(cond, tirx.And):
        a, b = _guard_bounds(cond.a, var), _guard_bounds(cond.b, var)
        return a + b if a is not None and b is not None else None
    bound = _guard_bound(cond, var)
    return None if bound is None else [bound]


def _conditions(cond) -> list:
    """`cond` and, for a conjunction, the conditions it joins (each a bool value along the vector)."""
    return [cond, *_conditions(cond.a), *_conditions(cond.b)] if isinstance(cond, tirx.And) else [cond]


def _guards(block: tirx.SBlock, var) -> list:
    """The ``if_then_else`` conditions of the block that are guards on `var` (`_guard_bounds`)."""
    found = []

    def visit(call) -> None:
        if call.op.same_as(IF_THEN_ELSE) and _guard_bounds(call.args[0], var) is not None:
            found.append(call.args[0])

    tvm_ffi.structural_walk(block.body, (tvm.ir.expr.Call, visit), order="post")
    return found


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
    data along them makes the block staged (module docstring).  Guards on the iterator whose bounds
    are multiples of the lanes (a concatenation's) hold or fail for a whole vector, so they are
    not bool data along it (`_align_guards`); where the lanes cannot honour them, they are."""
    if not block.iter_vars or any(iv.iter_type != tirx.IterVar.DataPar for iv in block.iter_vars):
        return Plan(1)
    guards = _guards(block, block.iter_vars[-1].var)
    found = _plan(block, guards) if guards else Plan(1)
    return found if found.lanes > 1 else _plan(block, ())


def _plan(block: tirx.SBlock, guards: list) -> Plan:
    """`plan`, with the conditions in `guards` taken as aligned to the vectors."""
    inner = block.iter_vars[-1]
    extent = int(inner.dom.extent) if isinstance(inner.dom.extent, tirx.IntImm) else 0
    bounds = [c for g in guards for c in _guard_bounds(g, inner.var)]
    accesses = _accesses(block)
    along = [(b, idx) for b, idx in accesses if any(_uses_var(i, inner.var) for i in idx)]
    conditions = [c for g in guards for c in _conditions(g)]
    staged = _bool_values_along(block, inner.var, conditions) or any(str(b.dtype) == "bool" for b, _ in along) \
        or _selects_on_a_broadcast(block, inner.var)
    vector = [(b, idx) for b, idx in accesses if str(b.dtype) != "bool"] if staged else accesses
    analyzer = sym.Analyzer()
    for iv in block.iter_vars:
        analyzer.bind(iv.var, iv.dom)
    if staged:  # gathers under a guard are read element by element: the stores set the lanes
        guarded, written = _guarded_buffers(block), {r.source for r in block.writes}
        vector = [(b, idx) for b, idx in vector
                  if b in written or b not in guarded or _friendly(b, idx, inner.var, 1, analyzer)]
    # staged, the values are computed one lane at a time: only the accesses along the vector are
    # vectors (a per-row label or statistic read by a bf16 kernel does not narrow its lanes)
    sized = [(b, idx) for b, idx in vector if any(_uses_var(i, inner.var) for i in idx)] if staged else vector
    widest = max((tvm.DataType(str(b.dtype)).bits for b, _ in sized), default=8)
    lanes = max(1, VECTOR_BYTES * 8 // widest)
    while lanes > 1:
        if extent % lanes == 0 and all(c % lanes == 0 for c in bounds) and \
                all(_friendly(buf, idx, inner.var, lanes, analyzer) for buf, idx in vector):
            break
        lanes //= 2
    if lanes == 1 or not staged:
        return Plan(lanes)
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
    """Does the access read `lanes` consecutive, aligned elements as `var` steps through a vector?
    Its row-major offset must be ``var + rest`` with ``rest`` free of `var` and a multiple of
    `lanes`: ``x[..., i]`` as well as a reshape's ``x[..., i // 64, i % 64]``."""
    if not indices or not any(_uses_var(i, var) for i in indices):
        return True  # broadcast along the vector
    shape = [int(s) if isinstance(s, tirx.IntImm) else None for s in buf.shape]
    if None in shape:
        return False
    offset = indices[0]
    for index, extent in zip(indices[1:], shape[1:]):
        offset = offset * extent + index
    rest = analyzer.simplify(offset - var)
    if _uses_var(rest, var):
        return False
    return analyzer.can_prove(tirx.floormod(rest, lanes) == 0)


def _align_guards(func: tirx.PrimFunc, var, lanes: int) -> tirx.PrimFunc:
    """`func` with each ``if_then_else`` guard ``c <= var`` / ``var < c`` (and the mirrored forms, and
    conjunctions of them) whose bound ``c`` is a multiple of `lanes` written on ``var - var % lanes``
    instead: the same truth value, now equal across a vector of `lanes`, so the vectorizer keeps one
    guard and vector loads in its branches (a concatenation: which input a vector comes from)
    instead of splitting the vector into scalar lanes."""

    base = var - tirx.floormod(var, tirx.const(lanes, str(var.ty)))

    def aligned(cond):
        if isinstance(cond, tirx.And):
            a, b = aligned(cond.a), aligned(cond.b)
            return cond if a.same_as(cond.a) and b.same_as(cond.b) else tirx.And(a, b)
        bound = _guard_bound(cond, var)
        if bound is None or bound % lanes:
            return cond
        return type(cond)(base if cond.a.same_as(var) else cond.a, base if cond.b.same_as(var) else cond.b)

    def visit(call):
        if not call.op.same_as(IF_THEN_ELSE):
            return call
        cond = aligned(call.args[0])
        return call if cond.same_as(call.args[0]) else tirx.if_then_else(cond, call.args[1], call.args[2])

    return func.with_body(tvm_ffi.structural_map(func.body, (tvm.ir.expr.Call, visit)))


def inlined_blocks(rule: GPUScheduleRule, func, target, inline=try_inline):
    """(schedule, the normalized blocks left after `inline`) where `func` is a PrimFunc for a
    target `rule` takes; else None.  Where every rule here starts."""
    if not isinstance(func, tirx.PrimFunc) or not rule.is_target_available(target):
        return None
    sch = s_tir.Schedule(func)
    infos = normalize_prim_func(sch)
    return None if infos is None else (sch, inline(sch, infos))


def single_spatial_block(rule: GPUScheduleRule, func, target):
    """(schedule, block, its loops) where `func` is a PrimFunc for a target `rule` takes and is,
    after inlining, one all-spatial block with one loop per iterator, in iterator order; else
    None.  What the injective rules here start from."""
    found = inlined_blocks(rule, func, target)
    if found is None:
        return None
    sch, infos = found
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
        if not how.staged and _guards(block, block.iter_vars[-1].var):  # align them, on the inlined function
            (_, inlined), = sch.mod.functions_items()
            found = single_spatial_block(self, _align_guards(inlined, block.iter_vars[-1].var, lanes), target)
            if found is None:
                return None
            sch, block_rv, loops = found
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

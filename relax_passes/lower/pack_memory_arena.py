"""PackMemoryArena: the tensors TVM's memory plan placed, packed at byte offsets of one arena.

``StaticPlanBlockMemory`` decides which tensors it can plan (static shapes, allocated and read in
one block, read only by kernels, not returned) and gives each a storage token.  It reuses a freed
token only for a tensor of the same dtype and scope, no more than 16 times smaller or larger, and
every tensor sits at offset 0 of its token: a float32 temporary never reuses the bytes a freed bf16
activation held.  On a step with a memory budget, whose backward interleaves recomputed copies with
tensors of other dtypes and sizes, that costs a third: BERT-Large (bf16, batch 204, rematerialised
for 72 GB) had 2003 planned tensors in 722 storages of 81.2 GB, where at most 52.9 GB of them are
alive at once.

This pass keeps TVM's choice of tensors and their lifetimes and replaces the storages with one
arena: each tensor lives from its ``alloc_tensor`` to the last binding that reads it or a view,
tuple or alias of it, and gets an offset where no tensor alive at the same time lies — greedily by
size, the largest first, each at the lowest offset free over its lifetime (``pack``), aligned to
``ALIGN`` bytes.  The arena is one ``alloc_storage`` at the function's start (``RewriteCUDAGraph``
lifts it like any static storage), and each tensor is made by ``tvm_evt.arena_tensor``
(``codegen/build/arena_runtime.py``): ``R.memory.alloc_tensor`` would record the offset as a
``byte_offset``, which TVM's kernels refuse.

A function is left as TVM planned it when a planned tensor reaches anything but a kernel call, a
view, a tuple or an alias (TVM's planner does not plan those, so this is a guard), when it has
control flow, or when the arena would not lower the most bytes alive at once.  In a function run
as CUDA graphs (``capture_step_graphs.captured``) every static storage is allocated once and kept,
so that is the arena against the storages' sum; elsewhere, ``arena_peak`` against
``storage_peak``: the arena lives from the first planned tensor to the last, where TVM frees each
storage after its last tensor, and the tensors the runtime allocates (outputs among them) add to
both.  Runs right after
``StaticPlanBlockMemory``; with ``budgeted_only``, only in functions with a memory budget
(``BUDGET_ATTR``).  If the runtime function cannot be built (no C++ compiler), the plan stays
TVM's, with a warning.
"""

from __future__ import annotations

import bisect
import warnings

import tvm
from tvm import relax

from ...codegen.build import arena_runtime
from ...codegen.build.cache import BuildError
from .._rewrite import flat_bindings
from ..partition.rematerialize import budgeted
from .capture_step_graphs import captured

ALIGN = 256  # bytes: every tensor's data pointer (cudaMalloc's alignment; TMA needs 16)
ALLOC_STORAGE = tvm.ir.Op.get("relax.memory.alloc_storage")
ALLOC_TENSOR = tvm.ir.Op.get("relax.memory.alloc_tensor")
BUILTIN_ALLOC = tvm.ir.Op.get("relax.builtin.alloc_tensor")
CALL_TIR_DYN = tvm.ir.Op.get("relax.vm.call_tir_dyn")
# ops whose result is their first operand's memory (TVM's planner gives them its token)
VIEW_OPS = frozenset(tvm.ir.Op.get(n) for n in ("relax.reshape", "relax.memory.view",
                                                 "relax.memory.ensure_zero_offset"))


class _Unsafe(Exception):
    """A planned tensor is used in a way this pass does not model."""


def _int(expr) -> int | None:
    return int(expr.value) if isinstance(expr, tvm.tirx.IntImm) else None


def _static_bytes(shape: relax.ShapeExpr, dtype: str) -> int | None:
    size = tvm.runtime.DataType(dtype).itemsize
    for extent in shape.values:
        if not isinstance(extent, tvm.tirx.IntImm):
            return None
        size *= int(extent)
    return size


class Lifetimes:
    """The planned tensors of `func` (placed in a packable storage), the tensors the runtime
    allocates (``builtin.alloc_tensor``: outputs, tensors the planner left), and the bindings each
    lives over."""

    def __init__(self, mod: tvm.IRModule, func: relax.Function):
        self.mod = mod
        self.bindings, _ = flat_bindings(func)
        if len(self.bindings) != sum(len(b.bindings) for b in func.body.blocks):
            raise _Unsafe("a binding is not a var binding")
        if any(isinstance(b, relax.DataflowBlock) for b in func.body.blocks):
            raise _Unsafe("a dataflow block (the plan comes after ToNonDataflow)")
        self.storages: dict = {}  # storage var -> [bytes, its binding, the last read of a tensor in it]
        self.tensors: dict = {}  # planned tensor var -> [first, last, bytes]
        self.loose: dict = {}  # runtime-allocated tensor var -> [first, last, bytes]
        self.of: dict = {}  # var -> the tensor vars it holds
        self.storage_of: dict = {}  # tensor var -> the storage var TVM placed it in
        for i, binding in enumerate(self.bindings):
            self._bind(i, binding.var, binding.value)
        returned = self._flat(self._held(func.body.body))
        if returned & self.tensors.keys():
            raise _Unsafe("the function returns a planned tensor")
        self._use(returned, len(self.bindings))

    def _held(self, expr):
        """The planned tensors `expr` holds: a frozenset of tensor vars, or a tuple of such for a
        tuple (so a projection holds only its field's tensors)."""
        if isinstance(expr, relax.Var):
            if expr in self.storages:
                raise _Unsafe(f"storage {expr.name} is read by something other than alloc_tensor")
            return self.of.get(expr, frozenset())
        if isinstance(expr, relax.Tuple):
            return tuple(self._held(f) for f in expr.fields)
        if isinstance(expr, relax.TupleGetItem):
            whole = self._held(expr.tuple_value)
            return whole[expr.index] if isinstance(whole, tuple) else whole
        if isinstance(expr, (relax.If, relax.SeqExpr, relax.Function)):
            raise _Unsafe("control flow")
        return frozenset()

    @staticmethod
    def _flat(held) -> frozenset:
        return frozenset().union(*map(Lifetimes._flat, held)) if isinstance(held, tuple) else held

    def _use(self, held, i: int) -> None:
        for t in self._flat(held):
            span = self.tensors[t] if t in self.tensors else self.loose[t]
            span[1] = max(span[1], i)

    def _bind(self, i: int, var: relax.Var, value) -> None:
        if isinstance(value, relax.Call) and value.op == ALLOC_STORAGE:
            size = value.args[0]
            nbytes = _int(size.values[0]) if isinstance(size, relax.ShapeExpr) and len(size.values) == 1 else None
            if nbytes is not None and _int(value.args[1]) == 0 and value.args[2].value in ("global", ""):
                self.storages[var] = [nbytes, i, i]
            return
        if isinstance(value, relax.Call) and value.op == ALLOC_TENSOR and value.args[0] in self.storages:
            nbytes = _static_bytes(value.args[2], str(value.args[3].value))
            if _int(value.args[1]) != 0 or nbytes is None:
                raise _Unsafe(f"alloc_tensor {var.name} at a non-zero or symbolic offset or of a symbolic shape")
            self.tensors[var] = [i, i, nbytes]
            self.storage_of[var] = value.args[0]
            self.of[var] = frozenset({var})
            return
        if isinstance(value, relax.Call) and value.op == BUILTIN_ALLOC:
            nbytes = _static_bytes(value.args[0], str(value.args[1].value))
            if nbytes is not None:
                self.loose[var] = [i, i, nbytes]
                self.of[var] = frozenset({var})
            return
        if not isinstance(value, relax.Call) or value.op in VIEW_OPS:
            # an alias, a tuple of tensors, a projection of one, a view: the same memory
            held = self._held(value if not isinstance(value, relax.Call) else value.args[0])
            self._use(held, i)
            if self._flat(held):
                self.of[var] = held
            return
        held = self._flat(tuple(self._held(a) for a in value.args))
        if held & self.tensors.keys() and not self._kernel(value):
            raise _Unsafe(f"{var.name} = {value.op} reads a planned tensor")
        self._use(held, i)

    def _kernel(self, call: relax.Call) -> bool:
        """A call that reads its arguments and keeps none (TVM's planner counts these as uses)."""
        if isinstance(call.op, relax.ExternFunc) or call.op == CALL_TIR_DYN:
            return True
        return isinstance(call.op, tvm.ir.GlobalVar) and isinstance(self.mod[call.op], tvm.tirx.PrimFunc)

    def live_peak(self) -> int:
        """Most bytes of the planned tensors alive at once (what no packing goes below)."""
        return _peak(self.tensors.values())

    def storage_peak(self) -> int:
        """Most bytes alive at once under TVM's plan: its storages, each from its ``alloc_storage``
        to the last read of a tensor placed in it (``KillAfterLastUse`` frees it there), and the
        runtime-allocated tensors."""
        for t, storage in self.storage_of.items():
            self.storages[storage][2] = max(self.storages[storage][2], self.tensors[t][1])
        storages = [(first, last, nbytes) for nbytes, first, last in self.storages.values()]
        return _peak(storages + list(self.loose.values()))

    def arena_peak(self, total: int) -> int:
        """Most bytes alive at once with an arena of `total` bytes in place of the storages (alive
        from the first planned tensor's allocation to the last read of one), and the
        runtime-allocated tensors."""
        first = min(f for f, _, _ in self.tensors.values())
        last = max(l for _, l, _ in self.tensors.values())
        return _peak([(first, last, total)] + list(self.loose.values()))


def _peak(intervals) -> int:
    """Most bytes alive at once of (first, last, bytes) intervals."""
    events = sorted(e for first, last, n in intervals for e in ((first, n), (last + 1, -n)))
    live = peak = 0
    for _, delta in events:
        live += delta
        peak = max(peak, live)
    return peak


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def pack(intervals: list[tuple[int, int, int]]) -> tuple[list[int], int]:
    """(an offset for each (first, last, bytes), the arena's bytes): no two intervals that overlap
    in [first, last] overlap in bytes.  Greedy by size: the largest first, each at the lowest
    aligned offset where it fits between the ones already placed that live at the same time."""
    order = sorted(range(len(intervals)), key=lambda j: (-intervals[j][2], intervals[j][0], j))
    placed: list = []  # (first, last, offset, end), sorted by first
    offsets = [0] * len(intervals)
    total = 0
    for j in order:
        first, last, nbytes = intervals[j]
        size = _aligned(nbytes)
        # the placed intervals overlapping [first, last]; those starting after `last` cannot
        stop = bisect.bisect_right(placed, (last, float("inf")))
        busy = sorted((off, end) for f, l, off, end in placed[:stop] if l >= first)
        offset = 0
        for off, end in busy:
            if off - offset >= size:
                break
            offset = max(offset, end)
        offsets[j] = offset
        total = max(total, offset + size)
        bisect.insort(placed, (first, last, offset, offset + size))
    return offsets, total


def _rewrite(func: relax.Function, lifetimes: Lifetimes, offsets: dict, total: int) -> relax.Function:
    bb = relax.BlockBuilder()
    storage = relax.Var("evt_arena_storage", relax.ObjectType())
    arena = relax.Var("evt_arena", relax.TensorType([total], "uint8"))
    head = [
        relax.VarBinding(storage, bb.normalize(relax.op.memory.alloc_storage(relax.ShapeExpr([total]), 0, "global",
                                                                             "uint8"))),
        relax.VarBinding(arena, bb.normalize(relax.op.memory.alloc_tensor(storage, 0, relax.ShapeExpr([total]),
                                                                          "uint8"))),
    ]
    maker = relax.ExternFunc(arena_runtime.FUNCTION)
    blocks = []
    for k, block in enumerate(func.body.blocks):
        bindings = head if k == 0 else []
        for b in block.bindings:
            if b.var in lifetimes.storages:
                continue
            if b.var in offsets:
                value = b.value
                call = relax.Call(maker, [arena, tvm.tirx.IntImm("int64", offsets[b.var]),
                                          value.args[2], value.args[3]], ty_args=[b.var.ty])
                b = relax.VarBinding(b.var, bb.normalize(call))
            bindings.append(b)
        blocks.append(relax.BindingBlock(bindings))
    return relax.Function(func.params, relax.SeqExpr(blocks, func.body.body), func.ret_ty, func.is_pure,
                          func.attrs, func.span)


def plan(mod: tvm.IRModule, func: relax.Function, captured: bool = False) -> tuple[Lifetimes, dict, int] | None:
    """(the lifetimes, {tensor var: offset}, the arena's bytes) for `func`, or None where it is left
    as TVM planned it (module docstring).  `captured`: the build lifts static storages into CUDA
    graphs, where each lives as long as the executable."""
    try:
        lifetimes = Lifetimes(mod, func)
    except _Unsafe:
        return None
    if not lifetimes.tensors:
        return None
    tensors = list(lifetimes.tensors)
    offsets, total = pack([tuple(lifetimes.tensors[t]) for t in tensors])
    if captured:
        if total >= sum(nbytes for nbytes, _, _ in lifetimes.storages.values()):
            return None
    elif lifetimes.arena_peak(total) >= lifetimes.storage_peak():
        return None
    return lifetimes, dict(zip(tensors, offsets)), total


@tvm.transform.module_pass(opt_level=0, name="PackMemoryArena")
class PackMemoryArena:
    """Planned tensors packed into one arena per function (module docstring)."""

    def __init__(self, budgeted_only: bool = False):
        self.budgeted_only = budgeted_only

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        updates = {}
        for gv, func in mod.functions_items():
            if not isinstance(func, relax.Function) or (self.budgeted_only and not budgeted(func)):
                continue
            planned = plan(mod, func, captured(gv.name_hint))  # CaptureStepGraphs keeps its storages
            if planned is None:
                continue
            updates[gv] = (func, *planned)
        if not updates:
            return mod
        try:
            arena_runtime.load()
        except BuildError as err:
            warnings.warn(f"PackMemoryArena: {err}; the memory plan stays StaticPlanBlockMemory's", stacklevel=2)
            return mod
        for gv, (func, lifetimes, offsets, total) in updates.items():
            mod[gv] = _rewrite(func, lifetimes, offsets, total)
        return mod

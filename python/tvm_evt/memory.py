"""The memory report of a compiled training step, read from its memory plan.

``memory_plan(mod, target)`` runs the build a `TrainingStep` ran (``pipeline.phases(target)``) on
``train_step`` up to and including its memory plan (TVM's ``StaticPlanBlockMemory``, then
``PackMemoryArena``); ``memory_report`` walks the
planned function and returns::

    {"categories": {"parameters", "optimizer_state", "inputs", "buffers", "counters", "gradients",
                    "saved_activations", "temporaries", "step_outputs": bytes},
     "saved_activations": [{"op", "name", "shape", "dtype", "bytes"}, ...],
     "planned_peak_bytes": int,       # most bytes live at once under the plan (arguments included)
     "planned_storage_bytes": int,    # the plan's storages added up (each alive the whole step)
     "unplanned_total_bytes": int,    # every tensor in its own buffer for the whole step
     "timeline": [{"index", "op", "phase", "live_bytes", "storage_bytes", "unplanned_bytes"}, ...],
     "measured_peak_bytes": int | None, "notes": [str, ...]}

Every argument of ``train_step`` and every tensor the planned function allocates falls in exactly one
category, so the categories add up to ``unplanned_total_bytes``.  How each is decided:

* the arguments by their position (``StepLayout``): inputs (and loss targets), parameters, model
  ``buffers`` (batch-norm statistics) and the dropout RNG state, optimizer slots
  (``optimizer_state``), the step count and loss scaler (``counters``), the weights' bf16/fp16
  copies (``parameters`` too: ``StepLayout.copies``);
* ``step_outputs``: tensors the step returns (the loss, new parameters and slots, the step count)
  that it allocates, which an in-place step does not;
* ``gradients``: the tensors the optimizer update reads as gradients (each of its calls takes a
  run of parameters, then their gradients: ``optimizer_update.emit_update``);
* ``saved_activations``: tensors written before the loss (the call that produces it, or the scaled
  loss of an fp16 step) and read after it: what the forward keeps for the backward.  Derivatives
  the graph passes compute in the forward (a GELU's, the loss's own gradient after
  ``EliminateLoss``) are among them: they too stay alive across the boundary;
* ``temporaries``: the rest (backward intermediates, forward values dead by the loss).

A saved activation's ``op`` is the kernel that writes it: on the CPU route the PrimFunc TVM's
legalisation named after the Relax op (``gelu``, ``multiply3``), on CUDA a fused kernel
(``fused_matmul_add_gelu``) or a partition.  No torch module is named: ``Gradient`` and the passes
after it make new variables, so the importer's origins (``ImportedModel.origins``, keyed by the
imported ``main``'s variables) no longer reach them, and their names are reused.

The timeline has one point per kernel call: the arguments, the storages alive (from their
allocation to the last read of a tensor placed in them: ``KillAfterLastUse`` frees them there; a
step built as CUDA graphs allocates them all once and keeps them) and the tensors allocated outside
the plan (the outputs, and any the planner could not place).  Where ``PackMemoryArena`` ran, the plan
is one storage, the arena, and each planned tensor a ``tvm_evt.arena_tensor`` placed in it.
"""
from __future__ import annotations

import contextlib
import dataclasses

import numpy as np
import tvm
from tvm import relax

from .pipeline import PLANNER, graph_capture, pass_context, phases
from .relax_passes._rewrite import VIEWS

FUNCTION = "train_step"

ARENA = "PackMemoryArena"
ALLOC_STORAGE = "relax.memory.alloc_storage"
ALLOC_TENSOR = "relax.memory.alloc_tensor"  # a tensor placed in a storage of the plan
BUILTIN_ALLOC = "relax.builtin.alloc_tensor"  # a tensor the plan left to the runtime
ARENA_TENSOR = "tvm_evt.arena_tensor"  # a tensor PackMemoryArena placed in its arena

CATEGORIES = ("parameters", "optimizer_state", "inputs", "buffers", "counters", "gradients",
              "saved_activations", "temporaries", "step_outputs")


def planning_passes(target: tvm.target.Target) -> list:
    """The passes of the step's build (``pipeline.phases``) up to and including its memory plan
    (TVM's ``StaticPlanBlockMemory``, then ``PackMemoryArena``)."""
    passes = phases(target)
    names = [p.info.name for p in passes]
    if PLANNER not in names:
        raise RuntimeError(f"memory_plan: the build has no {PLANNER} pass (passes: {names[-8:]})")
    last = names.index(ARENA) if ARENA in names else names.index(PLANNER)
    return passes[: last + 1]


def memory_plan(mod: tvm.IRModule, target: tvm.target.Target, graphs: bool = False,
                kernels: bool = True) -> relax.Function:
    """``train_step`` of the training module `mod` as `target`'s build plans its memory.  The build
    runs again (``main_adjoint`` left out): the partitioner's solutions come from its cache, and on
    CUDA the kernels the step's compile built from the object cache.  `graphs`: the step is built as
    CUDA graphs (``graph_capture``, which ``PackMemoryArena`` weighs its plan by); `kernels` False:
    none is built (``unbuilt.without_builds``)."""
    from .logs import quiet_known_warnings
    from .unbuilt import without_builds

    kept = {gv: f for gv, f in mod.functions_items()
            if gv.name_hint == FUNCTION or not isinstance(f, relax.Function)}
    if not any(gv.name_hint == FUNCTION for gv in kept):
        raise KeyError(f"memory_plan: the module has no {FUNCTION} function")
    step_only = relax.transform.DeadCodeElimination(entry_functions=[FUNCTION])(tvm.IRModule(kept, attrs=mod.attrs))
    passes = planning_passes(target) if kernels else without_builds(planning_passes(target))
    with target, graph_capture() if graphs else contextlib.nullcontext(), quiet_known_warnings():
        planned = tvm.transform.Sequential(passes)(step_only)
    return planned[FUNCTION]


@tvm.instrument.pass_instrument
class PlannedStepKeeper:
    """A pass instrument that keeps ``train_step`` as the build leaves it after its memory plan
    (``PLANNER``, then ``ARENA`` where it runs): with it around `tvm.compile`, `memory_report` needs
    no second run of the build's passes."""

    def __init__(self):
        self.function = None

    def run_after_pass(self, mod, info):
        if info.name in (PLANNER, ARENA) and any(gv.name_hint == FUNCTION for gv in mod.get_global_vars()):
            self.function = mod[FUNCTION]

    def watching(self) -> tvm.transform.PassContext:
        """The current PassContext with this instrument added."""
        return pass_context(instruments=[self])


# ------------------------------------------------------------------------ the walk


@dataclasses.dataclass
class _Tensor:
    name: str
    shape: tuple
    dtype: str
    nbytes: int
    # "argument", "planned" (in a storage), "unplanned" (runtime alloc or a callee's result), "arena"
    # (PackMemoryArena's whole arena as one uint8 tensor: its bytes are the planned tensors')
    kind: str
    storage: int | None = None
    alloc: int = 0  # binding index of its allocation (arguments: -1)
    producer: int | None = None  # call index of the first call that writes it
    op: str = ""
    last: int = -1  # binding index of its last read
    read_after: list = dataclasses.field(default_factory=list)  # call indices reading it
    names: list = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class _Storage:
    nbytes: int
    alloc: int
    last: int


def _bytes(ty) -> tuple[tuple, str, int]:
    if not isinstance(ty, relax.TensorType) or ty.shape is None:
        raise ValueError(f"memory_report: {FUNCTION} has a value of type {ty} whose size is unknown (the report "
                         "needs static shapes)")
    shape = tuple(int(d) for d in ty.shape.values)
    dtype = str(ty.dtype)
    return shape, dtype, int(np.prod(shape, dtype=np.int64)) * tvm.runtime.DataType(dtype).itemsize


def _callee(call: relax.Call) -> str:
    op = call.op
    if isinstance(op, tvm.ir.GlobalVar):
        return op.name_hint
    if isinstance(op, relax.ExternFunc):
        return str(op.global_symbol)
    return op.name if isinstance(op, tvm.ir.Op) else type(op).__name__


class _Walk:
    """The planned function's tensors, storages and kernel calls, in binding order."""

    def __init__(self, func: relax.Function):
        self.tensors: list[_Tensor] = []
        self.storages: dict = {}  # storage var -> _Storage
        self.of: dict = {}  # var -> tensor index, or a tuple of them
        self.calls: list[tuple[int, str, list, list]] = []  # (binding index, op, tensors read, tensors written)
        for param in func.params:
            shape, dtype, nbytes = _bytes(param.ty)
            self.of[param] = self._new(_Tensor(param.name, shape, dtype, nbytes, "argument", alloc=-1))
        bindings = [b for block in func.body.blocks for b in block.bindings]
        for i, binding in enumerate(bindings):
            self._bind(i, binding.var, binding.value)
        self.end = len(bindings)
        self.result = self._resolve(func.body.body)
        for t in self._flat(self.result):  # what the step returns lives to its end
            self._read(t, self.end)

    def _new(self, tensor: _Tensor) -> int:
        self.tensors.append(tensor)
        return len(self.tensors) - 1

    def _resolve(self, expr):
        if isinstance(expr, relax.Var):
            return self.of.get(expr)
        if isinstance(expr, relax.Tuple):
            return tuple(self._resolve(f) for f in expr.fields)
        if isinstance(expr, relax.TupleGetItem):
            whole = self._resolve(expr.tuple_value)
            return whole[expr.index] if isinstance(whole, tuple) else None
        return None

    def _flat(self, value) -> list:
        if value is None:
            return []
        if isinstance(value, tuple):
            return [t for f in value for t in self._flat(f)]
        return [value]

    def _read(self, t: int, i: int) -> None:
        tensor = self.tensors[t]
        tensor.last = max(tensor.last, i)
        if tensor.storage is not None:
            storage = self.storages[tensor.storage]
            storage.last = max(storage.last, i)

    def _bind(self, i: int, var: relax.Var, value) -> None:
        if not isinstance(value, relax.Call):
            resolved = self._resolve(value)
            if resolved is not None:
                self.of[var] = resolved
                for t in self._flat(resolved):
                    self.tensors[t].names.append(var.name)
            return
        op = _callee(value)
        if op == ALLOC_STORAGE:
            self.storages[var] = _Storage(int(value.args[0].values[0]), i, i)
            return
        if op in (ALLOC_TENSOR, BUILTIN_ALLOC):
            shape, dtype, nbytes = _bytes(var.ty)
            planned = op == ALLOC_TENSOR
            self.of[var] = self._new(_Tensor(var.name, shape, dtype, nbytes, "planned" if planned else "unplanned",
                                             storage=value.args[0] if planned else None, alloc=i))
            if planned:
                self._read(self.of[var], i)
            return
        args = [t for a in value.args for t in self._flat(self._resolve(a))]
        if op == ARENA_TENSOR and args:  # a tensor placed in the arena args[0] is a view of
            arena = self.tensors[args[0]]
            arena.kind = "arena"
            shape, dtype, nbytes = _bytes(var.ty)
            self.of[var] = self._new(_Tensor(var.name, shape, dtype, nbytes, "planned", storage=arena.storage, alloc=i))
            self._read(self.of[var], i)
            return
        if op in VIEWS and args:  # the same memory under another shape
            self.of[var] = args[0]
            self.tensors[args[0]].names.append(var.name)
            self._read(args[0], i)
            return
        call = len(self.calls)
        written = [t for t in args if self.tensors[t].kind != "argument" and self.tensors[t].producer is None]
        if isinstance(var.ty, relax.TensorType) and var.ty.shape is not None:  # a result the callee allocates
            shape, dtype, nbytes = _bytes(var.ty)
            t = self._new(_Tensor(var.name, shape, dtype, nbytes, "unplanned", alloc=i))
            self.of[var] = t
            written.append(t)
        for t in written:
            self.tensors[t].producer, self.tensors[t].op = call, op
        read = [t for t in args if t not in written]
        for t in read:
            self.tensors[t].read_after.append(call)
        for t in args:
            self._read(t, i)
        self.calls.append((i, op, read, written))


# ------------------------------------------------------------------------ the report


def _argument_categories(layout, num_args: int) -> list[str]:
    n_in, n_p = layout.num_inputs, layout.num_params
    cats = ["inputs"] * n_in + ["parameters"] * n_p
    cats += ["buffers"] * layout.num_rest + ["optimizer_state"] * layout.num_slot_tensors
    cats += ["counters"] * (num_args - len(cats) - len(layout.copies))  # the step count, the loss scaler
    cats += ["parameters"] * len(layout.copies)
    if len(cats) != num_args:
        raise ValueError(f"memory_report: {FUNCTION} takes {num_args} arguments, its layout {layout} names more")
    return cats


def _update_calls(walk: _Walk, num_args: int, layout):
    """(index of the first, the gradients they read) of the optimizer update's calls: each reads a
    run of parameters, their gradients, their optimizer slots and the new step count, in that order
    (``emit_update``, one call a group of ``kernel_groups``); (None, []) where there are none."""
    n_p, n_slots = layout.num_params, len(layout.slots)
    first_param, first_slot = layout.num_inputs, layout.num_inputs + n_p + layout.num_rest
    first, grads = None, []
    for index, (_, _, read, _) in enumerate(walk.calls):
        if not read or not first_param <= read[0] < first_param + n_p:
            continue
        start = read[0] - first_param
        run = min(n_p - start, len(read))
        n = next((k for k in range(run) if read[k] != first_param + start + k), run)
        slots = [first_slot + s * n_p + start + k for s in range(n_slots) for k in range(n)]
        if len(read) > 2 * n + len(slots) and read[2 * n: 2 * n + len(slots)] == slots:
            first = index if first is None else first
            grads += read[n: 2 * n]
    return first, grads


def _boundary(walk: _Walk, layout) -> int:
    """The call index that writes the loss (with loss scaling: the scaled loss the step unscales)."""
    loss = walk._flat(walk.result)[0]
    producer = walk.tensors[loss].producer
    if producer is None:
        raise ValueError(f"memory_report: no call of {FUNCTION} writes its loss {walk.tensors[loss].name}")
    if layout.loss_scaling:  # loss * (1 / scale), emitted after the backward: the boundary is its operand
        _, _, read, _ = walk.calls[producer]
        made = [walk.tensors[t].producer for t in read if walk.tensors[t].producer is not None]
        producer = min(made) if made else producer
    return producer


def memory_report(func: relax.Function, layout, measured_peak_bytes: int | None = None,
                  notes: tuple[str, ...] = (), storages_kept: bool = False) -> dict:
    """The report (module docstring) of a planned ``train_step`` (`memory_plan`) laid out as `layout`
    (``StepLayout``).  `storages_kept`: the step runs as CUDA graphs, whose build (TVM's
    ``RewriteCUDAGraph``) allocates every storage of the plan once, before the step, and keeps it:
    the timeline counts each storage alive throughout instead of from its allocation to its last read."""
    walk = _Walk(func)
    num_args = len(func.params)
    category = _argument_categories(layout, num_args) + [None] * (len(walk.tensors) - num_args)
    boundary = _boundary(walk, layout)
    update, update_grads = _update_calls(walk, num_args, layout)
    notes = list(notes)
    if update is None:
        notes.append("no optimizer update call found (its first arguments the parameters): gradients counted as "
                     "temporaries")
    grads = set(update_grads)
    returned = set(walk._flat(walk.result))
    for t, tensor in enumerate(walk.tensors):
        if category[t] is not None or tensor.kind == "arena":
            continue
        if t in returned:
            category[t] = "step_outputs"
        elif t in grads:
            category[t] = "gradients"
        elif tensor.producer is not None and tensor.producer <= boundary and any(c > boundary for c in tensor.read_after):
            category[t] = "saved_activations"
        else:
            category[t] = "temporaries"
    categories = {c: 0 for c in CATEGORIES}
    for t, tensor in enumerate(walk.tensors):
        if category[t] is not None:
            categories[category[t]] += tensor.nbytes
    saved = [{"op": tensor.op, "name": tensor.names[0] if tensor.names else tensor.name, "shape": list(tensor.shape),
              "dtype": tensor.dtype, "bytes": tensor.nbytes}
             for t, tensor in enumerate(walk.tensors) if category[t] == "saved_activations"]
    timeline = _timeline(walk, num_args, boundary, update, storages_kept)
    return {
        "categories": categories,
        "saved_activations": saved,
        "planned_peak_bytes": max((p["live_bytes"] for p in timeline), default=0),
        "planned_storage_bytes": sum(s.nbytes for s in walk.storages.values()),
        "unplanned_total_bytes": sum(t.nbytes for t in walk.tensors if t.kind != "arena"),
        "timeline": timeline,
        "measured_peak_bytes": measured_peak_bytes,
        "notes": notes,
    }


def _timeline(walk: _Walk, num_args: int, boundary: int, update, storages_kept: bool = False) -> list[dict]:
    arguments = sum(t.nbytes for t in walk.tensors[:num_args])
    unplanned = [t for t in walk.tensors[num_args:] if t.kind == "unplanned"]
    points = []
    for index, (i, op, _, _) in enumerate(walk.calls):
        storage = sum(s.nbytes for s in walk.storages.values() if storages_kept or s.alloc <= i <= s.last)
        loose = sum(t.nbytes for t in unplanned if t.alloc <= i <= max(t.last, t.alloc))
        phase = "forward" if index <= boundary else "update" if update is not None and index >= update else "backward"
        points.append({"index": index, "op": op, "phase": phase, "live_bytes": arguments + storage + loose,
                       "storage_bytes": storage, "unplanned_bytes": loose})
    return points


# ------------------------------------------------------------------------ measurement and picture


def device_used_bytes(device) -> int | None:
    """Bytes in use on `device` (CUDA's free-memory query), or None where TVM cannot say (the CPU)."""
    if device.dlpack_device_type() != tvm.cuda(0).dlpack_device_type():
        return None
    total, free = device.total_global_memory, device.available_global_memory
    return None if total is None or free is None else int(total) - int(free)


def draw(report: dict, path: str, title: str = "") -> str:
    """Write `report` as a PNG: bytes by category (stacked bar) and live bytes over the step."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:  # optional dependency: pip install matplotlib
        raise ImportError("memory_report_png needs matplotlib (pip install matplotlib)") from err
    mib = 1 << 20
    fig, (bar, line) = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [1, 3]})
    bottom = 0.0
    for name, nbytes in report["categories"].items():
        if nbytes:
            bar.bar([0], [nbytes / mib], bottom=[bottom], label=f"{name} {nbytes / mib:.2f}")
            bottom += nbytes / mib
    bar.set_xticks([0], ["no reuse"])
    bar.set_ylabel("MiB")
    bar.legend(fontsize=7)
    points = report["timeline"]
    xs = [p["index"] for p in points]
    line.plot(xs, [p["live_bytes"] / mib for p in points], label="live (plan)")
    line.plot(xs, [p["storage_bytes"] / mib for p in points], label="planned storages", linewidth=0.8)
    for phase in ("backward", "update"):
        start = next((p["index"] for p in points if p["phase"] == phase), None)
        if start is not None:
            line.axvline(start, color="#999999", linestyle="--", linewidth=0.8)
            line.text(start, 0, f" {phase}", fontsize=7, color="#555555")
    if report.get("measured_peak_bytes"):
        line.axhline(report["measured_peak_bytes"] / mib, color="#c00000", linewidth=0.8, label="measured peak")
    line.set_xlabel("kernel call")
    line.set_ylabel("MiB")
    line.legend(fontsize=7)
    fig.suptitle(title or f"{FUNCTION}: planned peak {report['planned_peak_bytes'] / mib:.2f} MiB")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

"""Data-parallel training over torch.distributed: ``compile_training(..., data_parallel=True)``.

Every rank (a process that ``torchrun`` started, with the process group that
``torch.distributed.init_process_group`` set up: NCCL on GPUs, gloo on the CPU) compiles the same
step and runs it on its shard of the batch.  One step of `DataParallelStep`:

1. the adjoint (forward + backward) runs as one function, or with ``overlap=True`` as the segments
   ``SplitAdjoint`` cuts it into, one per gradient bucket (parameters in the order the backward
   produces their gradients, buckets of about `bucket_mb`); after the segment that completes
   bucket b, its gradients are copied into the bucket's region of one flat buffer and the
   region's collective is launched (``async_op=True``): an all-reduce, or under ZeRO-1 a
   reduce-scatter.  The collectives run on NCCL's stream on a GPU (gloo's worker threads on the
   CPU); nothing else waits for them until step 3;
2. ``advance``: the step counter (and the dropout seed's counter) for the update;
3. for each bucket in order: wait for its collective, divide by the number of ranks, run its
   update (``AppendBucketUpdates``: the optimizer's fused kernel over the bucket's parameters);
   bucket b's update runs while the later buckets' collectives are still in flight.  Under
   ZeRO-1 the update covers this rank's shard of the bucket only, and the new shard is
   all-gathered (``async_op=True``) into the flat parameter buffer the step's parameters are
   views of; the step waits for every all-gather before it returns.

What overlaps, honestly: a bucket's collective with the updates of the buckets before it, and
with ``overlap=True`` also with the backward segments after it.  Not by default, because the
cut costs more than it hides on the models measured: the lowering passes see each segment
alone, so the forward values a later segment reads (layer-norm statistics, a loss's
intermediates) are written and read back instead of kept in one kernel (``SplitAdjoint``'s
docstring has the numbers).  Not overlapped: the gradient copies into the flat buffer
(host-ordered torch copies), and the forward with anything (its all-gathers are waited for at
the end of the previous step).  Cutting the adjoint costs the fusions across a cut.
Not supported: fp16 (its dynamic loss scale would need an overflow check across ranks),
``inplace``/``cuda_graph``, uneven shards.
"""

from __future__ import annotations

import dataclasses
import math
import time

import numpy as np
import tvm
from tvm import relax

from .errors import DataParallelMismatchError
from .frontend import ImportedModel
from .logs import quiet_known_warnings
from .pipeline import PIPELINE_NAME
from .relax_passes.training.append_bucket_updates import ADVANCE_NAME, UPDATE_NAME, AppendBucketUpdates
from .relax_passes.training.split_adjoint import SegmentPlan, SplitAdjoint
from .tensors import input_arguments, to_torch

BUCKET_MB = 25.0  # torch DistributedDataParallel's default bucket_cap_mb
ALIGN_BYTES = 64  # TVM asks DLPack tensors for 64-byte aligned data: every view in a flat buffer is


# ------------------------------------------------------------------------ graph


@dataclasses.dataclass(frozen=True)
class FlatLayout:
    """The flat gradient (and, under ZeRO-1, parameter) buffer: bucket b's region is
    ``[starts[b], starts[b] + sizes[b])``, parameter p starts at ``offsets[p]``; every region is
    padded to a multiple of ``world_size`` aligned pieces, so each rank's shard is aligned."""

    dtype: str
    world_size: int
    starts: tuple[int, ...]
    sizes: tuple[int, ...]
    offsets: tuple[int, ...]
    total: int

    def shard(self, bucket: int, rank: int) -> tuple[int, int]:
        """(start, length) in the flat buffer of `rank`'s shard of `bucket`."""
        length = self.sizes[bucket] // self.world_size
        return self.starts[bucket] + rank * length, length


def _aligned(n: int, align: int) -> int:
    return (n + align - 1) // align * align


def flat_layout(buckets, shapes: list[tuple[int, ...]], dtype: str, world_size: int) -> FlatLayout:
    """Lay `buckets` (parameter indices) out one after the other in a flat `dtype` buffer."""
    align = ALIGN_BYTES // (tvm.DataType(dtype).bits // 8)
    starts, sizes, offsets = [], [], [0] * len(shapes)
    start = 0
    for bucket in buckets:
        at = 0
        for p in bucket:
            offsets[p] = start + at
            at = _aligned(at + math.prod(shapes[p]), align)
        size = _aligned(max(at, 1), align * world_size)
        starts.append(start)
        sizes.append(size)
        start += size
    return FlatLayout(dtype, world_size, tuple(starts), tuple(sizes), tuple(offsets), start)


@dataclasses.dataclass
class DataParallelGraph:
    """The module a `DataParallelStep` runs and how: the adjoint's segments (``plan``), one
    update function per bucket, ``advance``, the flat buffers' layout."""

    mod: tvm.IRModule
    plan: SegmentPlan
    flat: FlatLayout
    optimizer: object
    precision: str
    zero: bool
    has_seed: bool


def build_data_parallel_module(adjoint_mod: tvm.IRModule, imported: ImportedModel, optimizer, precision: str,
                               world_size: int, zero: bool = False, bucket_mb: float = BUCKET_MB,
                               has_seed: bool = False, overlap: bool = False) -> DataParallelGraph:
    """From a module with ``main_adjoint`` (``training.build_adjoint_module``): its segments
    (``SplitAdjoint``: one, or with `overlap` one per bucket), the bucket updates and ``advance``
    (``AppendBucketUpdates``), without ``main`` and ``main_adjoint``."""
    names = imported.param_names
    values = [imported.param_values[n] for n in names]
    dtypes = {str(v.dtype).replace("torch.", "") for v in values}
    if len(dtypes) != 1:
        raise ValueError(f"data_parallel: the parameters must share one dtype (one flat gradient buffer), got "
                         f"{ {n: str(v.dtype) for n, v in zip(names, values)} }")
    dtype = dtypes.pop()
    splitter = SplitAdjoint(len(names), bucket_mb * 2**20, cut=overlap)
    mod = splitter(adjoint_mod)
    plan = splitter.plan
    shapes = [tuple(v.shape) for v in values]
    flat = flat_layout(plan.buckets, shapes, dtype, world_size)
    if zero:
        groups = [[((flat.sizes[b] // world_size,), dtype)] for b in range(len(plan.buckets))]
    else:
        groups = [[(shapes[p], dtype) for p in bucket] for bucket in plan.buckets]
    mod = AppendBucketUpdates(optimizer, groups, has_seed)(mod)
    entries = [s.name for s in plan.segments] + [UPDATE_NAME.format(b) for b in range(len(groups))] + [ADVANCE_NAME]
    mod = tvm.IRModule({gv: f for gv, f in mod.functions_items() if gv.name_hint not in ("main", "main_adjoint")},
                       attrs=mod.attrs)
    mod = relax.transform.DeadCodeElimination(entry_functions=entries)(mod)
    return DataParallelGraph(mod, plan, flat, optimizer, precision, zero, has_seed)


# ------------------------------------------------------------------------ runtime


def process_group(group=None):
    """`group`, or torch.distributed's default group; a clear error when there is none."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("data_parallel=True needs an initialised torch.distributed process group: start the "
                           "script with torchrun and call torch.distributed.init_process_group() (backend nccl "
                           "on GPUs, gloo on the CPU) before compile_training")
    return group if group is not None else dist.group.WORLD


def shard_batch(tensors, group=None) -> list:
    """This rank's equal share of each tensor of a global batch (along dim 0), as
    DistributedSampler deals a dataset out; the batch must divide by the number of ranks."""
    import torch.distributed as dist

    group = process_group(group)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    out = []
    for i, t in enumerate(tensors):
        if t.shape[0] % world:
            raise ValueError(f"shard_batch: tensor {i} has batch {t.shape[0]}, not a multiple of the {world} ranks "
                             "(data parallel needs equal shards: the mean of the ranks' gradients is the "
                             "full batch's only then)")
        n = t.shape[0] // world
        out.append(t[rank * n:(rank + 1) * n])
    return out


def _all_gather(output, input, group):
    import torch.distributed as dist

    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, input, group=group, async_op=True)


def _reduce_scatter(output, input, group):
    import torch.distributed as dist

    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return scatter(output, input, group=group, async_op=True)


def first_mismatch(fingerprints: list[dict]) -> str | None:
    """What differs between the ranks' `fingerprint`s (one per rank), first difference only."""
    ref = fingerprints[0]
    for rank, fp in enumerate(fingerprints[1:], start=1):
        for key in list(ref) + [k for k in fp if k not in ref]:
            if ref.get(key) != fp.get(key):
                return (f"{key} is {ref.get(key, 'absent')} on rank 0 but {fp.get(key, 'absent')} on rank {rank}")
    return None


class DataParallelStep:
    """A compiled training step that each rank of a torch.distributed process group runs on its
    shard of the batch (see the module docstring).  ``step(*local_inputs)`` returns this rank's
    loss (of its shard, as DistributedDataParallel does); `parameters`, `state_dict`,
    `load_state_dict`."""

    def __init__(self, imported: ImportedModel, graph: DataParallelGraph, executable, target, compile_seconds: float,
                 seed: int = 0, group=None):
        import torch
        import torch.distributed as dist

        self.imported, self.graph, self.target = imported, graph, target
        self.compile_seconds = compile_seconds
        self.group = process_group(group)
        self.rank, self.world_size = dist.get_rank(self.group), dist.get_world_size(self.group)
        if graph.flat.world_size != self.world_size:
            raise ValueError(f"the graph was built for {graph.flat.world_size} ranks, the group has {self.world_size}")
        if target.kind.name == "cuda":
            index = torch.cuda.current_device()
            self.device, self._torch_device = tvm.cuda(index), torch.device("cuda", index)
        else:
            self.device, self._torch_device = tvm.cpu(0), torch.device("cpu")
        self.vm = relax.VirtualMachine(executable, self.device)
        plan, flat = graph.plan, graph.flat
        self._slots = graph.optimizer.slots()
        names = imported.param_names
        tdtype = getattr(torch, flat.dtype)
        new = lambda n: torch.zeros(n, dtype=tdtype, device=self._torch_device)
        self._shapes = [tuple(imported.param_values[n].shape) for n in names]
        view = lambda buf, p: buf[flat.offsets[p]: flat.offsets[p] + math.prod(self._shapes[p])].view(self._shapes[p])
        self._grad_flat = new(flat.total)
        self._grad_views = [view(self._grad_flat, p) for p in range(len(names))]
        self._grad_args = [tvm.runtime.from_dlpack(v) for v in self._grad_views]  # exact views (aligned)
        if graph.zero:
            # the parameters are views of one flat buffer, which the all-gathers write
            self._param_flat = new(flat.total)
            for p, n in enumerate(names):
                view(self._param_flat, p).copy_(imported.param_values[n].detach())
            self._params = [tvm.runtime.from_dlpack(view(self._param_flat, p)) for p in range(len(names))]
            shards = [flat.shard(b, self.rank) for b in range(len(plan.buckets))]
            self._shard_grads = [new(length) for _, length in shards]
            self._shard_params = [tvm.runtime.from_dlpack(self._param_flat[s: s + n]) for s, n in shards]
            self._state = [[self._zeros((n,)) for _ in self._slots] for _, n in shards]  # [bucket][slot]
        else:
            self._params = [self._tensor(imported.param_values[n].detach().clone()) for n in names]
            self._state = [[[self._zeros(self._shapes[p]) for p in bucket] for _ in self._slots]
                           for bucket in plan.buckets]  # [bucket][slot][param of the bucket]
        self._buffers = {k: self._tensor(v.detach().clone()) for k, v in imported.buffer_values.items()}
        self._step = tvm.runtime.tensor(np.array(0.0, dtype="float32"), self.device)
        self._rng = None
        if graph.has_seed:  # each rank draws its own dropout masks
            self._rng = tvm.runtime.tensor(np.array([(int(seed) + self.rank) & 0xFFFFFFFF, 0], dtype="uint32"),
                                           self.device)
        self._synchronized = False

    # -- helpers
    def _tensor(self, t):
        return tvm.runtime.from_dlpack(t.to(self._torch_device).contiguous())

    def _zeros(self, shape):
        return tvm.runtime.tensor(np.zeros(shape, dtype=self.graph.flat.dtype), self.device)

    def _arguments(self, inputs) -> list:
        args = input_arguments(self.imported, inputs, self.device) + list(self._params)
        args += [self._buffers[n] for n in self.imported.buffer_names]
        return args + ([self._rng] if self._rng is not None else [])

    def fingerprint(self, inputs) -> dict:
        """What every rank must agree on, by what a mismatch message calls it."""
        imp, g = self.imported, self.graph
        fp = {f"input '{n}' (shape, dtype)": (list(t.shape), str(t.dtype).replace("torch.", ""))
              for n, t in zip(imp.input_names, inputs)}
        fp["the parameter names"] = list(imp.param_names)
        fp.update({f"parameter '{n}' (shape, dtype)": (list(v.shape), str(v.dtype).replace("torch.", ""))
                   for n, v in imp.param_values.items()})
        fp["the buffer names"] = list(imp.buffer_names)
        fp.update({f"buffer '{n}' shape": list(v.shape) for n, v in imp.buffer_values.items()})
        fp.update({"the optimizer": repr(g.optimizer), "the precision": g.precision, "zero": g.zero,
                   "the gradient buckets": [list(b) for b in g.plan.buckets], "the target": self.target.kind.name})
        return fp

    def _synchronize(self, inputs) -> None:
        """First step: every rank checks that all compiled the same step, then takes rank 0's
        parameters and buffers."""
        import torch.distributed as dist

        fingerprints = [None] * self.world_size
        dist.all_gather_object(fingerprints, self.fingerprint(inputs), group=self.group)
        problem = first_mismatch(fingerprints)
        if problem:
            raise DataParallelMismatchError(
                f"data-parallel ranks compiled different training steps: {problem} (each rank must compile the "
                "same model with the same optimizer and precision, and get an equal shard of the batch)")
        src = dist.get_global_rank(self.group, 0)
        tensors = [self._param_flat] if self.graph.zero else [to_torch(p) for p in self._params]
        for t in tensors + [to_torch(b) for b in self._buffers.values()]:
            dist.broadcast(t, src, group=self.group)
        self._synchronized = True

    # -- public API
    def __call__(self, *inputs):
        import torch.distributed as dist

        if not self._synchronized:
            self._synchronize(inputs)
        plan, flat, world = self.graph.plan, self.graph.flat, self.world_size
        env = {f"arg{i}": v for i, v in enumerate(self._arguments(inputs))}
        pending = {}  # bucket -> its collective
        for s, seg in enumerate(plan.segments):
            outs = self.vm[seg.name](*[env[k] for k in seg.inputs])
            env.update(zip(seg.outputs, outs))
            for b in (b for b, after in enumerate(plan.ready_after) if after == s):
                for p in plan.buckets[b]:
                    self._grad_views[p].copy_(to_torch(env[plan.grads[p]]))
                region = self._grad_flat[flat.starts[b]: flat.starts[b] + flat.sizes[b]]
                if self.graph.zero:
                    pending[b] = _reduce_scatter(self._shard_grads[b], region, self.group)
                else:
                    pending[b] = dist.all_reduce(region, group=self.group, async_op=True)
        advanced = self.vm[ADVANCE_NAME](*([self._step] + ([self._rng] if self._rng is not None else [])))
        self._step = advanced[0]
        gathers = []
        for b, bucket in enumerate(plan.buckets):
            pending[b].wait()
            update = self.vm[UPDATE_NAME.format(b)]
            state = self._state[b]
            if self.graph.zero:
                self._shard_grads[b].div_(world)
                outs = update(self._shard_params[b], tvm.runtime.from_dlpack(self._shard_grads[b]), *state, self._step)
                start = flat.starts[b]
                gathers.append(_all_gather(self._param_flat[start: start + flat.sizes[b]], to_torch(outs[0]),
                                           self.group))
                self._state[b] = list(outs[1:])
            else:
                region = self._grad_flat[flat.starts[b]: flat.starts[b] + flat.sizes[b]]
                region.div_(world)
                n = len(bucket)
                outs = update(*[self._params[p] for p in bucket], *[self._grad_args[p] for p in bucket],
                              *[t for slot in state for t in slot], self._step)
                for k, p in enumerate(bucket):
                    self._params[p] = outs[k]
                self._state[b] = [[outs[n * (1 + j) + k] for k in range(n)] for j in range(len(self._slots))]
        for work in gathers:
            work.wait()
        for name, key in zip(self.imported.mutated_buffers, plan.new_buffers):
            self._buffers[name] = env[key]
        if self._rng is not None:
            self._rng = advanced[1]
        return to_torch(env[plan.loss])

    @property
    def step_count(self) -> int:
        return int(self._step.numpy())

    def parameters(self) -> dict:
        """{name: tensor} of the current parameters and buffers, torch views of the step's tensors
        (under ZeRO-1 the all-gathers write over them: ``.clone()`` them to keep a snapshot)."""
        params = {n: to_torch(v) for n, v in zip(self.imported.param_names, self._params)}
        params.update({n: to_torch(v) for n, v in self._buffers.items()})
        return params

    def _sharding(self) -> dict:
        flat = self.graph.flat
        return {"zero": self.graph.zero, "world_size": self.world_size, "rank": self.rank,
                "buckets": [list(b) for b in self.graph.plan.buckets], "sizes": list(flat.sizes)}

    def state_dict(self) -> dict:
        """This rank's training state, copied: ``params`` and ``buffers`` {name: tensor}, ``step``,
        ``rng`` (the dropout seed and counter, or None), ``optimizer`` {slot: {param: tensor}}, or
        under ZeRO-1 {slot: [this rank's shard of each bucket]}, and ``sharding``, which
        `load_state_dict` checks (a ZeRO-1 state loads only into the same rank of as many ranks)."""
        names = self.imported.param_names
        copy = lambda v: to_torch(v).clone()
        if self.graph.zero:
            optimizer = {s: [copy(self._state[b][j]) for b in range(len(self._state))]
                         for j, s in enumerate(self._slots)}
        else:
            optimizer = {s: {names[p]: copy(self._state[b][j][k]) for b, bucket in enumerate(self.graph.plan.buckets)
                             for k, p in enumerate(bucket)} for j, s in enumerate(self._slots)}
        return {"params": {n: copy(v) for n, v in zip(names, self._params)},
                "buffers": {n: copy(v) for n, v in self._buffers.items()},
                "step": self.step_count,
                "rng": None if self._rng is None else copy(self._rng),
                "optimizer": optimizer,
                "sharding": self._sharding()}

    def load_state_dict(self, state: dict) -> None:
        """Load what `state_dict` returned (on this rank; under ZeRO-1, this rank's own file)."""
        mine, theirs = self._sharding(), state.get("sharding", {})
        keys = ["zero", "buckets", "sizes"] + (["world_size", "rank"] if self.graph.zero else [])
        for k in keys:
            if theirs.get(k) != mine[k]:
                raise DataParallelMismatchError(
                    f"load_state_dict on rank {self.rank}: the state's {k} is {theirs.get(k)}, this step's {mine[k]} "
                    "(a ZeRO-1 state loads into the same rank of a step compiled the same way on as many ranks)")
        names = self.imported.param_names
        params, buffers = state["params"], state["buffers"]
        missing = [n for n in names if n not in params] + [n for n in self._buffers if n not in buffers]
        if missing:
            raise KeyError(f"load_state_dict: the state has no values for {missing[:5]}")
        for p, n in enumerate(names):
            if tuple(params[n].shape) != self._shapes[p]:
                raise DataParallelMismatchError(f"load_state_dict: parameter '{n}' has shape {list(params[n].shape)}, "
                                                f"the step's {list(self._shapes[p])}")
            if self.graph.zero:
                to_torch(self._params[p]).copy_(params[n])
            else:
                self._params[p] = self._tensor(params[n].detach().clone())
        self._buffers = {n: self._tensor(buffers[n].detach().clone()) for n in self._buffers}
        self._step = tvm.runtime.tensor(np.array(float(state["step"]), dtype="float32"), self.device)
        if self._rng is not None and state.get("rng") is not None:
            self._rng = self._tensor(state["rng"].clone())
        optimizer = state["optimizer"]
        for j, s in enumerate(self._slots):
            if self.graph.zero:
                for b in range(len(self._state)):
                    self._state[b][j] = self._tensor(optimizer[s][b].clone())
            else:
                for b, bucket in enumerate(self.graph.plan.buckets):
                    self._state[b][j] = [self._tensor(optimizer[s][names[p]].clone()) for p in bucket]


def compile_data_parallel(imported: ImportedModel, adjoint_mod: tvm.IRModule, optimizer, precision: str, target,
                          has_seed: bool, seed: int = 0, zero: bool = False, bucket_mb: float = BUCKET_MB,
                          group=None, tuning_dir=None, start: float | None = None,
                          overlap: bool = False) -> DataParallelStep:
    """Build and compile the data-parallel step of `imported` for this rank of `group` (what
    ``compile_training(..., data_parallel=True)`` runs after building ``main_adjoint``)."""
    import torch.distributed as dist

    start = time.perf_counter() if start is None else start
    group = process_group(group)
    graph = build_data_parallel_module(adjoint_mod, imported, optimizer, precision, dist.get_world_size(group),
                                       zero=zero, bucket_mb=bucket_mb, has_seed=has_seed, overlap=overlap)
    with quiet_known_warnings():
        if tuning_dir is None:
            executable = tvm.compile(graph.mod, target=target, relax_pipeline=PIPELINE_NAME)
        else:
            from .tuned import compile_tuned

            executable = compile_tuned(graph.mod, target, tuning_dir)
    return DataParallelStep(imported, graph, executable, target, time.perf_counter() - start, seed=seed, group=group)

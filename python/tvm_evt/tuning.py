"""Tuning a training step: CUTLASS configurations for the evt partitions, MetaSchedule for the rest.

``tune(model, target, work_dir, trials)`` builds the training graph exactly as `compile_training`
does, partitions it with the ``evt`` pipeline's front passes, then

1. **CUTLASS** (CUDA targets): every distinct ``Codegen="evt"`` partition is profiled on the GPU
   with ``codegen.select.tune`` (plain-GEMM main-loop ranking, then the best few re-timed with the
   partition's epilogue); choices go to ``<work_dir>/cutlass_select.json``;
2. **MetaSchedule** (any target, XGBoost cost model): the TIR functions left to TVM (what
   ``FuseTIR`` produces in the compile pipeline; the evt partitions are opaque calls) are tuned one
   task at a time, largest estimated cost first, into the JSON database in ``work_dir``.

Both steps are resumable: a partition whose signature has a choice, or a task that already got its
trials (``<work_dir>/progress.json``), is skipped; ``time_budget`` stops starting new work.

A work dir is compiled with by ``tuned.compile_tuned`` (what ``compile_training(...,
tuning_dir=...)`` calls).  This module is a driver: it uses the library (``training``, ``tuned``,
``bench_e2e``'s models), and no library module imports it.
"""
from __future__ import annotations

import dataclasses
import fnmatch
import importlib
import importlib.util
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Callable, Iterable

import tvm
import tvm_ffi
from tvm import relax

from .pipeline import front_passes, phases
from .tuned import CUTLASS_FILE, _names, split_phases
from .unbuilt import OpaqueEVTCalls, evt_functions, without_builds  # noqa: F401 (this module's API too)

PROGRESS_FILE = "progress.json"
BENCH_PREFIX = "bench:"  # load_model("bench:resnet50"): a scripts/bench.py model


def _log(msg: str) -> None:
    print(f"[tune] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------- models
def load_model(spec: str, **overrides):
    """A `models.ZooEntry` from ``bench:KEY`` (a ``scripts/bench.py --models`` key: the bench's
    shapes and memory format, so ``bench.py --tuning-dir`` finds the choices), a zoo name, a preset
    name, or ``package.module:factory`` (a callable returning a ZooEntry, or an ``(nn.Module,
    example_inputs, loss_fn)`` tuple).  Bench keys take the prefix because two of them are also
    zoo or preset names of other shapes (``xml_cnn``, ``vit_b16``)."""
    from . import bench_e2e, models

    if spec.startswith(BENCH_PREFIX):
        key = spec[len(BENCH_PREFIX):]
        if key not in bench_e2e.MODELS:
            raise ValueError(f"unknown bench model {key!r}: the bench's are {', '.join(bench_e2e.MODELS)}")
        return bench_e2e.build_entry(key, **overrides)
    if spec in models.PRESETS:
        return models.PRESETS[spec](**overrides)
    if spec in models.ZOO:
        return models.ZOO[spec](**overrides)
    if ":" not in spec:
        hint = f"; the bench's is {BENCH_PREFIX}{spec}" if spec in bench_e2e.MODELS else ""
        raise ValueError(f"unknown model {spec!r}: not in models.ZOO or models.PRESETS, not "
                         f"'bench:KEY' and not 'module:factory'{hint}")
    module_name, _, attr = spec.partition(":")
    factory = getattr(importlib.import_module(module_name), attr)
    made = factory(**overrides)
    if isinstance(made, models.ZooEntry):
        return made
    model, example, loss_fn = made
    inputs = tuple(example)
    return models.ZooEntry(model, lambda: inputs, loss_fn, f"{spec}", num_targets=1 if loss_fn else 0)


def training_graph(entry, precision: str = "bf16", optimizer=None, target: tvm.target.Target | None = None):
    """(imported, TrainingGraph) as `compile_training` builds them for `target`: in place where it
    captures CUDA graphs (``captures_graphs``), functional without a target."""
    from .frontend import from_torch
    from .training import build_training_module, captures_graphs

    imported = from_torch(entry.model, entry.example_inputs(), entry.loss_fn)
    inplace = target is not None and captures_graphs(target, precision, None)
    return imported, build_training_module(imported, optimizer, precision, inplace=inplace)


# ----------------------------------------------------------------------------- pipeline split
def until_scheduling(target: tvm.target.Target, opaque: "OpaqueEVTCalls | None" = None) -> tuple[list, object]:
    """(the CUDA route's passes before ``ScheduleTIRForGPU``, without nvcc (``without_builds``);
    that pass): the TVM kernels as they are scheduled, without building any."""
    passes = without_builds(phases(target), opaque)
    names = _names(passes)
    if "ScheduleTIRForGPU" not in names:
        raise ValueError(f"the TVM kernels are scheduled on the CUDA route; target {target} has no ScheduleTIRForGPU")
    at = names.index("ScheduleTIRForGPU")
    return passes[:at], passes[at]


# ------------------------------------------------------------------------------- partitions
def partitioned(mod: tvm.IRModule, target: tvm.target.Target) -> tvm.IRModule:
    """The training module after the ``evt`` pipeline's front passes (graph passes, PartitionEVT)."""
    with target:
        return tvm.transform.Sequential(front_passes(target=target))(mod)


def kernel_traffic(mod: tvm.IRModule, target: tvm.target.Target,
                   function: str | tuple[str, ...] = "train_step") -> list[dict]:
    """The kernels one call of `function` (or of each of several) runs on the ``evt`` pipeline's
    route for `target`, each
    with the bytes of its buffers (a model of its global-memory traffic: every input read once,
    every output written once), largest total first: ``{"kernel", "kind": "tir" | "cutlass" | "flash" | "conv",
    "calls", "bytes_per_call", "bytes"}``.  CUTLASS partitions and flash-attention kernels count as
    opaque calls (no nvcc; a flash kernel's workspace and the S x S tiles it keeps on chip are not
    counted);
    the TIR kernels are those after scheduling, with pure reshapes as the views they become.
    A lower bound on memory time to compare graph rewrites by, without a GPU."""
    opaque = OpaqueEVTCalls()
    before, schedule = until_scheduling(target, opaque)
    with target:
        mod = tvm.transform.Sequential([*before, schedule])(mod)
        mod = relax.transform.RewriteDataflowReshape()(mod)  # pure reshapes become views

    from .relax_passes.partition.evt_cost import tensor_bytes

    call_tir, call_packed = tvm.ir.Op.get("relax.call_tir"), tvm.ir.Op.get("relax.call_dps_packed")
    rows: dict = {}

    def visit(e) -> None:
        if not isinstance(e, relax.Call) or e.op not in (call_tir, call_packed):
            return
        if e.op == call_tir:
            kind, name = "tir", e.args[0].name_hint
        else:
            name = e.args[0].global_symbol
            kind = opaque.kinds.get(name, "cutlass")
        row = rows.setdefault(name, {"kernel": name, "kind": kind, "calls": 0,
                                     "bytes_per_call": sum(tensor_bytes(a) for a in e.args[1].fields) + tensor_bytes(e)})
        row["calls"] += 1

    for name in (function,) if isinstance(function, str) else function:
        relax.analysis.post_order_visit(mod[name].body, visit)
    for row in rows.values():
        row["bytes"] = row["calls"] * row["bytes_per_call"]
    return sorted(rows.values(), key=lambda r: (-r["bytes"], r["kernel"]))


def cutlass_partitions(mod: tvm.IRModule) -> tuple[list, dict]:
    """(distinct lowered `Partition`s, {symbol: reason} of those the codegen cannot take)."""
    from .codegen import select
    from .codegen.errors import Unsupported
    from .codegen.frontend import from_function
    from .codegen.passes import lower

    found, skipped, seen = [], {}, set()
    for gv, func in sorted(evt_functions(mod).items(), key=lambda kv: kv[0].name_hint):
        try:
            p = lower(from_function(func, symbol=gv.name_hint))
        except Unsupported as err:
            skipped[gv.name_hint] = err.reason
            continue
        sig = select.signature(p)
        if sig not in seen:
            seen.add(sig)
            found.append(p)
    return found, skipped


# -------------------------------------------------------------------------- CUTLASS profiling
class GpuMeasure:
    """A ``select.Measure`` for any partition: build every job in parallel, run each on random
    inputs, check it against the default configuration's output of the same partition (relative
    L2 error <= 1e-2, finite), then time it with CUDA events (median of ``iters``)."""

    def __init__(self, jobs: int = os.cpu_count() or 1, iters: int = 20, warmup: int = 3):
        import torch

        self.torch, self.jobs, self.iters, self.warmup = torch, jobs, iters, warmup
        self.records: dict[str, dict] = {}

    def _tensor(self, desc, role: str, k: int):
        t = self.torch
        dtypes = {"bfloat16": t.bfloat16, "float16": t.float16, "float32": t.float32,
                  "int32": t.int32, "int64": t.int64, "uint8": t.uint8}
        if desc.dtype == "uint32":
            return t.randint(0, 2**31 - 1, desc.shape, dtype=t.int32, device="cuda").view(t.uint32)
        if desc.dtype == "bool":
            return t.rand(desc.shape, device="cuda") < 0.5
        if desc.dtype not in ("bfloat16", "float16", "float32"):
            return t.zeros(desc.shape, dtype=dtypes[desc.dtype], device="cuda")
        scale = k ** -0.5 if role == "b" else 1.0
        return (t.randn(desc.shape, device="cuda") * scale).to(dtypes[desc.dtype])

    def matmul_ms(self, gemm) -> float:
        """``torch.matmul`` (cuBLAS) on `gemm`'s shapes and operand layouts (a ``GemmSpec``),
        median of ``iters`` after ``warmup``: the library's time for the plain GEMM."""
        t = self.torch
        a = t.randn(gemm.batch, gemm.m, gemm.k, device="cuda").to(t.bfloat16)
        b = t.randn(gemm.batch, gemm.k, gemm.n, device="cuda").to(t.bfloat16)
        if not gemm.a_k_major:  # stored [k, m]
            a = a.transpose(1, 2).contiguous().transpose(1, 2)
        if gemm.b_k_major:  # stored [n, k]
            b = b.transpose(1, 2).contiguous().transpose(1, 2)
        if gemm.batch == 1:
            a, b = a[0], b[0]
        return self._median_ms(lambda: t.matmul(a, b))

    def _median_ms(self, run) -> float:
        """The median of ``iters`` CUDA-event timings of `run` after ``warmup`` calls."""
        from .bench_e2e import time_steps

        for _ in range(self.warmup):
            run()
        return sorted(time_steps(run, self.iters))[self.iters // 2]

    def _outputs(self, partition):
        t = self.torch
        dt = {"bfloat16": t.bfloat16, "float32": t.float32, "float16": t.float16, "bool": t.bool}
        return [t.zeros(d.shape, dtype=dt[d.dtype], device="cuda") for d in partition.outputs]

    def __call__(self, jobs: dict) -> dict[str, float]:
        from .codegen import bench as cbench
        from .codegen.backend import default_config, emit
        from .codegen.errors import Unsupported

        sources = {}
        for name, (p, cfg) in jobs.items():
            self.records[name] = {"config": cfg.name, "ms": math.inf, "error": None}
            try:
                sources[name] = emit(p, cfg)
            except Unsupported as err:
                self.records[name]["error"] = f"unsupported: {err.reason}"
        objects, failed, _stats = cbench.build_tolerant(sources, self.jobs)
        for name, err in failed.items():
            self.records[name]["error"] = "nvcc: " + err.strip().splitlines()[-1][:300]
        if not objects:
            return {n: math.inf for n in jobs}
        lib = cbench.load_library(objects)
        groups: dict[str, list[str]] = {}
        for name in jobs:
            groups.setdefault(name.rsplit("__", 1)[0], []).append(name)
        times = {}
        t = self.torch
        for group, names in groups.items():
            p0 = jobs[names[0]][0]
            g = p0.gemm
            roles = {g.a_param: "a", g.b_param: "b"}
            inputs = [self._tensor(d, roles.get(i, "aux"), g.k) for i, d in enumerate(p0.params)]
            default = default_config(g.dtype_a).name
            # the default configuration first: it is the reference of the others
            names = sorted(names, key=lambda n: jobs[n][1].name != default)
            ref = None
            for name in names:
                if name not in objects:
                    continue
                rec, fn = self.records[name], lib[name]
                outputs = self._outputs(jobs[name][0])
                try:
                    fn(*inputs, *outputs)
                    t.cuda.synchronize()
                    got = [o.float() for o in outputs if o.is_floating_point()]
                    if not all(bool(t.isfinite(o).all()) for o in got):
                        rec["error"] = "non-finite output"
                        continue
                    if ref is None:
                        ref = got
                    else:
                        err = max(float((a - b).norm() / max(float(b.norm()), 1e-30)) for a, b in zip(got, ref))
                        if err > 1e-2:
                            rec["error"] = f"differs from the default configuration (rel err {err:.3g})"
                            continue
                    rec["ms"] = times[name] = self._median_ms(lambda: fn(*inputs, *outputs))
                except Exception as err:  # noqa: BLE001 - one bad kernel must not stop tuning
                    rec["error"] = f"{type(err).__name__}: {str(err)[:300]}"
        return {n: times.get(n, math.inf) for n in jobs}


def compare_configs(partitions: list, measure: Callable | None = None) -> list[dict]:
    """Each partition timed on the GPU under the default configuration and under the one an
    untuned build gives it (``select.heuristic_config``, fitted to shared memory as
    ``relax.ext.evt`` does): one row per partition, slowest heuristic first.  A partition whose
    two configurations coincide is timed once."""
    from .codegen import select
    from .codegen.backend import default_config
    from .codegen.legality import fitting_config

    measure = measure or GpuMeasure()
    jobs, rows = {}, []
    for p in partitions:
        default = fitting_config(p, default_config(p.gemm.dtype_a))
        chosen = fitting_config(p, select.heuristic_config(p))
        row = {"symbol": p.symbol, "batch": p.gemm.batch, "mnk": [p.gemm.m, p.gemm.n, p.gemm.k],
               "default": default.name, "heuristic": chosen.name}
        for cfg in dict.fromkeys([default, chosen]):
            name = f"{p.symbol}__{cfg.name}"
            jobs[name] = (dataclasses.replace(p, symbol=name), cfg)
        rows.append(row)
    times = measure(jobs)
    errors = getattr(measure, "records", {})
    for row in rows:
        row["default_ms"] = times[f"{row['symbol']}__{row['default']}"]
        row["heuristic_ms"] = times[f"{row['symbol']}__{row['heuristic']}"]
        row["speedup"] = row["default_ms"] / row["heuristic_ms"] if row["heuristic_ms"] else math.nan
        row["errors"] = {k.rsplit("__", 1)[1]: r["error"] for k, r in errors.items()
                         if k.rsplit("__", 1)[0] == row["symbol"] and r.get("error")}
    return sorted(rows, key=lambda r: -r["heuristic_ms"])  # a failed build (inf) first


HEURISTIC_SPACE = "heuristic"  # sweep_configs: the heuristic's configuration alone


def sweep_configs(partitions: list, space: str = "quick", measure: Callable | None = None,
                  only: Iterable[str] | None = None) -> list[dict]:
    """Each partition timed under every configuration of ``space`` that ``select.candidates`` keeps
    for its shape, and their narrow-epilogue variants (fitted to shared memory as ``relax.ext.evt``
    does), next to its plain GEMM (same operands, only the D store) under the default
    configuration: what the epilogue costs, and whether some configuration hides it.  The
    shape heuristic's choice (``select.heuristic_config``, what an untuned build runs) is timed
    too.  ``only`` keeps the configurations of those names or shell patterns (after fitting).  One row per partition:
    ``plain_ms``, ``ms`` {configuration: ms}, ``best``, ``heuristic`` (its name), ``errors``, and
    ``library_ms``: the plain GEMM by ``measure.matmul_ms`` (cuBLAS through torch on a GPU), None
    where the measure has none.  ``space="heuristic"`` times only the heuristic's choice: where
    each partition of an untuned build stands against its plain GEMM and the library's."""
    from .codegen import select
    from .codegen.backend import default_config
    from .codegen.legality import fitting_config

    measure = measure or GpuMeasure()
    jobs, rows = {}, []
    for p in partitions:
        configs = [] if space == HEURISTIC_SPACE else \
            [c for base in select.candidates(p, space) for c in (base, select.epilogue_variant(base))]
        configs.append(select.heuristic_config(p))  # what an untuned build runs
        names = []
        fitted = list(dict.fromkeys(fitting_config(p, c) for c in configs))
        for cfg in fitted:
            if only is not None and not any(fnmatch.fnmatchcase(cfg.name, pattern) for pattern in only):
                continue
            name = f"{p.symbol}__{cfg.name}"
            jobs[name] = (dataclasses.replace(p, symbol=name), cfg)
            names.append(name)
        if not names:
            raise ValueError(f"{p.symbol}: none of {sorted(only)} is a configuration of the {space!r} space "
                             f"for it; its configurations are {[c.name for c in fitted]}")
        default = default_config(p.gemm.dtype_a)
        plain = f"{p.symbol}_plain__{default.name}"
        jobs[plain] = (select.plain_partition(p, plain), default)
        rows.append({"symbol": p.symbol, "batch": p.gemm.batch, "mnk": [p.gemm.m, p.gemm.n, p.gemm.k],
                     "layout": p.gemm.layout_name, "heuristic": fitting_config(p, select.heuristic_config(p)).name,
                     "plain": plain, "jobs": names})
    times = measure(jobs)
    matmul = getattr(measure, "matmul_ms", None)
    by_symbol = {p.symbol: p for p in partitions}
    errors = getattr(measure, "records", {})
    for row in rows:
        row["plain_ms"] = times[row.pop("plain")]
        names = row.pop("jobs")
        row["ms"] = {n.rsplit("__", 1)[1]: times[n] for n in names}
        row["best"] = min(row["ms"], key=row["ms"].get)
        row["errors"] = {n.rsplit("__", 1)[1]: errors[n]["error"] for n in names if errors.get(n, {}).get("error")}
        row["library_ms"] = matmul(by_symbol[row["symbol"]].gemm) if matmul is not None else None
    return sorted(rows, key=lambda r: -r["ms"][r["best"]])


def tune_cutlass(partitions: list, work_dir, *, space: str = "quick", top_k: int = 1, chunk: int = 4,
                 deadline: float = math.inf, measure: Callable | None = None, gpu: str | None = None,
                 progress=None) -> dict:
    """Choose a configuration for each partition not yet in ``<work_dir>/cutlass_select.json``,
    ``chunk`` partitions at a time (choices are persisted after each chunk)."""
    from .codegen import select

    gpu = gpu or select.gpu_name()
    if gpu is None:
        raise RuntimeError("CUTLASS tuning needs a CUDA GPU")
    cache = select.SelectionCache(Path(work_dir) / CUTLASS_FILE)
    todo = [p for p in partitions if cache.get(select.signature(p), gpu) is None]
    summary = {"partitions": len(partitions), "already_tuned": len(partitions) - len(todo), "chosen": {},
               "no_choice": [], "stopped_by_budget": False}
    if progress is not None:
        progress.update(len(partitions) - len(todo))
    measure = measure or GpuMeasure()
    num_sms = _num_sms()
    for i in range(0, len(todo), chunk):
        if time.monotonic() >= deadline:
            summary["stopped_by_budget"] = True
            break
        part = todo[i : i + chunk]
        choices = select.tune(part, measure, gpu, space=space, top_k=top_k, cache=cache, num_sms=num_sms)
        for p in part:
            c = choices.get(p.symbol)
            if c is None:
                summary["no_choice"].append(p.symbol)
            else:
                summary["chosen"][p.symbol] = {"config": c.config.name, "ms": c.time_ms,
                                               "mnk": [p.gemm.m, p.gemm.n, p.gemm.k]}
        if progress is not None:
            progress.update(len(part))
    return summary


def _num_sms() -> int:
    from .codegen import select

    try:
        import torch

        return torch.cuda.get_device_properties(0).multi_processor_count
    except Exception:  # noqa: BLE001
        return select.H100_SMS


# -------------------------------------------------------------------------------- MetaSchedule
def tir_module(mod: tvm.IRModule, target: tvm.target.Target, entry: str = "train_step") -> tvm.IRModule:
    """The fused TIR the compile pipeline hands to ``MetaScheduleApplyDatabase``, for ``entry``
    only (main/main_adjoint share most kernels), with the evt partitions as opaque calls."""
    before, _after = split_phases(target)
    before = without_builds(before)
    with target:
        fused = tvm.transform.Sequential(before)(mod)
    return relax.transform.DeadCodeElimination(entry_functions=[entry])(fused)


# The search needs these target attributes; a bare {"kind": "cuda", "arch": ...} lacks them.
_CUDA_DEFAULTS = {"max_threads_per_block": 1024, "max_num_threads": 1024, "thread_warp_size": 32,
                  "max_shared_memory_per_block": 49152, "registers_per_block": 65536}
# Mutators that crash (segfault) in InitializeWithTuneContext in the TVM 0.27 wheel; the search
# keeps the tile-size and unroll mutators (93-98% of the default probability mass).
_SAFE_MUTATORS = ("MutateTileSize", "MutateUnroll")


def search_target(target: tvm.target.Target) -> tvm.target.Target:
    """``target`` with what MetaSchedule's search needs: ``num-cores`` (physical cores) for llvm,
    thread limits for CUDA."""
    config = dict(target.export())
    if target.kind.name == "llvm" and not config.get("num-cores"):
        import psutil

        config["num-cores"] = psutil.cpu_count(logical=False) or os.cpu_count() or 1
    elif target.kind.name == "cuda":
        config = {**_CUDA_DEFAULTS, **config}
    return tvm.target.Target(config)


def space_generator(target: tvm.target.Target):
    """TVM's default design space for ``target`` with only `_SAFE_MUTATORS`."""
    from tvm.s_tir import meta_schedule as ms

    kind = "cuda" if target.kind.name == "cuda" else "llvm"
    mutators = {m: p for m, p in ms.mutator.Mutator.create(kind).items() if type(m).__name__ in _SAFE_MUTATORS}
    return ms.space_generator.PostOrderApply(
        sch_rules=ms.schedule_rule.ScheduleRule.create(kind),
        postprocs=ms.postproc.Postproc.create(kind),
        mutator_probs=mutators,
    )


def extract_tasks(fused: tvm.IRModule, target: tvm.target.Target) -> list:
    """MetaSchedule tasks, largest estimated cost (FLOPs x calls) first."""
    from tvm.s_tir import meta_schedule as ms
    from tvm.s_tir.analysis import estimate_tir_flops

    from .relax_passes.lower.schedule_tir_for_gpu import has_own_gpu_form

    def func(task):  # the task's PrimFunc (its module's one function)
        return task.dispatched[0].functions_items()[0][1]

    tasks = ms.relax_integration.extract_tasks(fused, target)
    tasks = [t for t in tasks if not int((func(t).attrs or {}).get("tirx.is_scheduled", 0))]
    if target.kind.name == "cuda":  # the dropout masks and the optimizer update: ScheduleTIRForGPU's own forms
        tasks = [t for t in tasks if not has_own_gpu_form(func(t))]

    def cost(task):
        try:
            return estimate_tir_flops(task.dispatched[0]) * task.weight
        except Exception:  # noqa: BLE001
            return 0.0

    return sorted(tasks, key=lambda t: (-cost(t), t.task_name))


def _task_key(task) -> str:
    return str(tvm_ffi.structural_hash(task.dispatched[0]))


def _progress(work_dir) -> dict:
    try:
        return json.loads((Path(work_dir) / PROGRESS_FILE).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def _write_progress(work_dir, data: dict) -> None:
    path = Path(work_dir) / PROGRESS_FILE
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    os.replace(tmp, path)


def tune_tir(tasks: list, target: tvm.target.Target, work_dir, trials_per_task: int, *,
             max_tasks: int | None = None, deadline: float = math.inf, num_threads: int | None = None,
             seed: int = 0, progress=None) -> dict:
    """Tune ``tasks`` one at a time (``trials_per_task`` each) into the JSON database in
    ``work_dir``; a task already tuned with at least that many trials is skipped.

    The search runs in a child process (``python -m tvm_evt.tuning``) that records each finished
    task in ``progress.json``: a task that crashes the child (MetaSchedule segfaults in some TVM
    0.27 builds) is recorded as failed and the child restarts on the remaining tasks; after
    ``_MAX_CRASHES`` crashes in a row the search gives up."""
    import subprocess

    work = Path(work_dir)
    tasks = tasks[:max_tasks] if max_tasks else tasks
    jobs_dir = work / "tasks"
    jobs_dir.mkdir(parents=True, exist_ok=True)
    keys = []
    for task in tasks:
        key = _task_key(task)
        keys.append(key)
        path = jobs_dir / f"{key}.json"
        if not path.exists():
            path.write_text(json.dumps({"name": task.task_name, "weight": int(task.weight),
                                        "mod": tvm.ir.save_json(task.dispatched[0]),
                                        "target": json.dumps(dict(task.target.export()), default=list)}))
    summary = {"tasks": len(tasks), "already_tuned": 0, "tuned": [], "failed": {}, "stopped_by_budget": False}

    def state():
        data = _progress(work).get("tir", {})
        return {k: v for k, v in data.items() if v.get("trials", 0) >= trials_per_task or v.get("error")}

    done0 = state()
    summary["already_tuned"] = sum(1 for k in keys if k in done0 and not done0[k].get("error"))
    shown = sum(1 for k in keys if k in done0)
    if progress is not None:
        progress.update(shown)
    crashes = 0
    while True:
        finished = state()
        todo = [k for k in keys if k not in finished]
        if not todo:
            break
        if time.monotonic() >= deadline:
            summary["stopped_by_budget"] = True
            break
        job = {"work_dir": str(work), "keys": todo, "trials": trials_per_task, "seed": seed,
               "num_threads": num_threads or max(1, (os.cpu_count() or 2) // 2),
               "seconds_left": None if deadline == math.inf else deadline - time.monotonic()}
        child = subprocess.Popen([sys.executable, "-m", "tvm_evt.tuning", "tir-child", json.dumps(job)])
        while child.poll() is None:
            time.sleep(1.0)
            now = state()
            new = sum(1 for k in keys if k in now)
            if progress is not None and new > shown:
                progress.update(new - shown)
                shown = new
        if child.returncode == 0:
            crashes = 0
            continue
        crashes += 1
        current = _progress(work).get("tir_current")
        if current in todo:
            _mark(work, current, {"error": f"the search process died (exit code {child.returncode})",
                                  "name": json.loads((jobs_dir / f"{current}.json").read_text())["name"]})
        if crashes >= _MAX_CRASHES or current not in todo:
            summary["gave_up"] = (f"MetaSchedule's search process died {crashes} time(s) in a row "
                                  f"(exit code {child.returncode}); see the log above")
            break
    final = _progress(work).get("tir", {})
    for k in keys:
        rec = final.get(k)
        if rec and rec.get("error"):
            summary["failed"][rec.get("name", k)] = rec["error"]
        elif rec and k not in done0:
            summary["tuned"].append(rec)
    if progress is not None and len(keys) > shown:
        progress.update(0)
    return summary


_MAX_CRASHES = 2


def metaschedule_problem() -> str | None:
    """Why MetaSchedule cannot run here, or None.  Its JSON database serializes TIR with
    ``tvm.ir.save_json``, which segfaults in some TVM 0.27 wheels: tried in a child process."""
    import subprocess

    for module in ("cloudpickle", "psutil", "xgboost"):
        if importlib.util.find_spec(module) is None:
            return f"MetaSchedule needs the Python package {module!r} (pip install {module})"
    probe = "import tvm; tvm.ir.save_json(tvm.tirx.const(1.0, 'float32'))"
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    if proc.returncode != 0:
        return (f"tvm.ir.save_json crashes in this TVM build (exit code {proc.returncode}), so "
                "MetaSchedule's JSON database cannot be written")
    return None


def _mark(work: Path, key: str, record: dict) -> None:
    data = _progress(work)
    data.setdefault("tir", {})[key] = record
    _write_progress(work, data)


def _tir_child(job: dict) -> int:
    """The search process of `tune_tir`: tune each task of ``job["keys"]`` in order."""
    from tvm.s_tir import meta_schedule as ms

    work = Path(job["work_dir"])
    deadline = time.monotonic() + job["seconds_left"] if job.get("seconds_left") else math.inf
    trials, threads = int(job["trials"]), int(job["num_threads"])
    database = ms.database.JSONDatabase(work_dir=str(work), module_equality="structural")
    builder = ms.builder.LocalBuilder(max_workers=threads)
    runner = ms.runner.LocalRunner()
    cost_model = ms.cost_model.XGBModel(num_tuning_cores=threads, tree_method="auto")
    for key in job["keys"]:
        if time.monotonic() >= deadline:
            break
        spec = json.loads((work / "tasks" / f"{key}.json").read_text())
        mod = tvm.ir.load_json(spec["mod"])
        target = tvm.target.Target(json.loads(spec["target"]))
        data = _progress(work)
        data["tir_current"] = key
        _write_progress(work, data)
        start = time.monotonic()
        task = ms.ExtractedTask(spec["name"], mod, target, [mod], spec["weight"])
        contexts, weights = ms.relax_integration.extracted_tasks_to_tune_contexts(
            [task], str(work), space=space_generator(target), num_threads=threads, seed=job.get("seed"))
        ms.tune.tune_tasks(
            tasks=contexts, task_weights=weights, work_dir=str(work),
            max_trials_global=trials, max_trials_per_task=trials, num_trials_per_iter=min(64, trials),
            builder=builder, runner=runner, database=database, cost_model=cost_model,
            task_scheduler="round-robin",
        )
        _mark(work, key, {"name": spec["name"], "trials": trials, "weight": spec["weight"],
                          "best_us": _best_us(database, mod), "seconds": round(time.monotonic() - start, 1)})
    return 0


def _best_us(database, mod) -> float | None:
    try:
        workload = database.commit_workload(mod)
        top = database.get_top_k(workload, 1)
        if top and top[0].run_secs:
            return round(float(top[0].run_secs[0]) * 1e6, 2)
    except Exception:  # noqa: BLE001
        pass
    return None


# ----------------------------------------------------------------------------------- the driver
@dataclasses.dataclass
class TuningResult:
    work_dir: str
    model: str
    target: str
    cutlass: dict
    tir: dict
    seconds: float

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def tune(model, target=None, work_dir: str | os.PathLike = "tuning", trials: int = 64, *,
         trials_per_task: int | None = None, max_tasks: int | None = None, precision: str = "bf16",
         optimizer=None, cutlass: bool = True, tir: bool = True, space: str = "quick", top_k: int = 1,
         time_budget: float | None = None, model_kwargs: dict | None = None, show_progress: bool = True,
         cutlass_measure: Callable | None = None) -> TuningResult:
    """Tune the training step of ``model`` (a zoo/preset name, ``module:factory`` or a ZooEntry)
    for ``target`` into ``work_dir``; see the module docstring.  ``trials`` is MetaSchedule's total
    trial budget, spread evenly over the tasks (at least ``trials_per_task`` when given, else 8)
    and cut to ``max_tasks`` tasks, largest cost first."""
    from tqdm import tqdm

    from .training import as_target

    start = time.monotonic()
    deadline = start + time_budget if time_budget else math.inf
    work = Path(work_dir)
    work.mkdir(parents=True, exist_ok=True)
    name = model if isinstance(model, str) else type(getattr(model, "model", model)).__name__
    entry = load_model(model, **(model_kwargs or {})) if isinstance(model, str) else model
    tgt = as_target(target)
    _log(f"{name}: building the training graph ({precision}) for {tgt.kind.name}")
    _imported, graph = training_graph(entry, precision, optimizer, tgt)
    mod = partitioned(graph.mod, tgt)
    cutlass_summary: dict = {"skipped": "not a CUDA target" if tgt.kind.name != "cuda" else "disabled"}
    if cutlass and tgt.kind.name == "cuda":
        parts, unsupported = cutlass_partitions(mod)
        _log(f"{len(parts)} distinct evt partitions ({len(unsupported)} not offloadable)")
        with tqdm(total=len(parts), desc="CUTLASS partitions", unit="part", disable=not show_progress) as bar:
            cutlass_summary = tune_cutlass(parts, work, space=space, top_k=top_k, deadline=deadline,
                                           measure=cutlass_measure, progress=bar)
        cutlass_summary["unsupported"] = unsupported
    tir_summary: dict = {"skipped": "disabled"}
    problem = metaschedule_problem() if tir and trials > 0 else None
    if problem:
        _log(f"skipping MetaSchedule: {problem}")
        tir_summary = {"skipped": problem}
    elif tir and trials > 0:
        fused = tir_module(mod, tgt)
        tasks = extract_tasks(fused, search_target(tgt))
        n = min(len(tasks), max_tasks or len(tasks))
        per_task = max(trials_per_task or 0, trials // max(n, 1), 1)
        _log(f"{len(tasks)} MetaSchedule tasks; tuning {n} with {per_task} trials each")
        with tqdm(total=n, desc="MetaSchedule tasks", unit="task", disable=not show_progress) as bar:
            tir_summary = tune_tir(tasks, tgt, work, per_task, max_tasks=n, deadline=deadline, progress=bar)
    result = TuningResult(str(work), name, str(tgt), cutlass_summary, tir_summary,
                          round(time.monotonic() - start, 1))
    data = _progress(work)
    data.setdefault("runs", []).append({k: v for k, v in result.to_json().items() if k not in ("tir",)}
                                       | {"tir_tasks": tir_summary.get("tasks"), "time": time.time()})
    _write_progress(work, data)
    return result


if __name__ == "__main__":  # the MetaSchedule search process of tune_tir
    if len(sys.argv) == 3 and sys.argv[1] == "tir-child":
        sys.exit(_tir_child(json.loads(sys.argv[2])))
    sys.exit("usage: python -m tvm_evt.tuning tir-child JOB_JSON (internal; see scripts/tune.py)")

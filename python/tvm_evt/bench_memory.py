"""The largest batch each system trains in a memory limit, and its samples/s there
(``scripts/bench.py --max-batch GB``).

Systems (``MAX_BATCH_SYSTEMS``), each as `bench_e2e` builds it (bf16 autocast or precision="bf16",
AdamW):

* ``eager``, ``compile`` (torch.compile default mode);
* ``eager_checkpoint``: eager with the library's own activation checkpointing, which wraps each
  layer in ``torch.utils.checkpoint`` (transformers' ``gradient_checkpointing_enable``, timm's
  ``set_grad_checkpointing``); not applicable to a model without it;
* ``tvm_evt``: ``compile_training`` as the bench's tvm_evt row;
* ``tvm_evt_budget``: ``compile_training(..., memory_budget=BUDGET_SHARE * limit)``: forward values
  recomputed where that makes the step fit (``Rematerialize``);
* ``tvm_evt_at_eager_batch``: tvm_evt at the batch eager found, the throughput the budget's
  batch is compared against;
* ``tvm_evt_budget_at_twice_eager``: ``tvm_evt_budget`` at twice the batch eager found (the
  rematerialisation target: twice eager's batch at little throughput lost against
  ``tvm_evt_at_eager_batch``), compiled with the budget whose memory plan holds ``PLAN_SHARE`` of
  the limit (``aimed_budget``: memory plans made without building kernels, kept in ``--out`` so
  that ``--estimate-only`` finds it on any machine and the GPU run uses it).

One *trial* (a subprocess, so that an out-of-memory state or a crash loses only itself) builds the
model at one batch, runs ``--warmup`` steps and times ``--steps``.  It fits when

* torch systems: no ``torch.OutOfMemoryError`` with the caching allocator capped at the limit
  (``torch.cuda.set_per_process_memory_fraction``); its peak is ``max_memory_allocated``;
* tvm_evt systems: the device memory in use after the steps, less what was in use before the model
  was built (``cudaMemGetInfo``: TVM's pooled allocator, the kernels' workspaces and the step's
  state), is at most the limit.  TVM's allocator is not capped, so a trial over the limit runs and
  says by how much.

The search (``largest_batch``) tries ``start`` and ``2 * start`` (doubling while a peak is under
the limit), then the batch the last two fitting trials' peaks predict (a peak affine in the batch),
then bisects between the largest batch that fit and the smallest that did not, until they are
within ``RESOLUTION`` of each other or ``--max-trials`` trials ran.  The tvm_evt systems'
first trials are not run but estimated, no kernel built: ``tvm_evt`` by its memory plan
(``tvm_evt.budget.planned_step_peak``), ``tvm_evt_budget`` by the estimate its budget bounds
(``estimate_step_peak``: the passes up to the rematerialisation); only the estimated largest batch
is compiled and run.  A
batch whose measured memory is over the limit is scaled down by the excess and run again; one under
it (the estimate errs high) is scaled up once by the room left, and kept if that fits
(``CONFIRM_RUNS`` runs at most).  Estimates and trials that ran are kept in ``--out``: a run cut
short goes on where it stopped, and ``--estimate-only`` makes the estimates on any machine (no GPU:
they build no kernel), so that the GPU run only confirms them.

Each system's row: the batch, its trial's peak and step time, samples/s, and the trials made.
"""
from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from . import bench_e2e as e2e
from .bench_e2e import MAX_BATCH_SYSTEMS  # noqa: F401 - the systems, named with the bench's

TORCH_SYSTEMS = ("eager", "eager_checkpoint", "compile")
ESTIMATED_SYSTEMS = ("tvm_evt", "tvm_evt_budget")  # their batch is estimated first, then confirmed by trials
AT_EAGER_BATCH = {"tvm_evt_at_eager_batch": 1, "tvm_evt_budget_at_twice_eager": 2}  # run at this multiple of eager's batch
BUDGET_SYSTEMS = ("tvm_evt_budget", "tvm_evt_budget_at_twice_eager")  # compiled with a memory_budget
BUDGET_SHARE = 0.8  # of the limit, for the step's estimated peak: TVM's memory plan keeps more (BERT-Large at batch 204, 72 GB: 84.4 GB planned), and the CUDA context and kernels' workspaces take their share
PLAN_SHARE = 0.97  # of the limit, for the memory plan of a budget aimed at it (BERT-Large at batch 102: planned 79.8, on the H200 80.0 GB)
CONFIRM_RUNS = 3  # tvm_evt systems: compiled runs at most to confirm (and grow or shrink) the estimated batch
RESOLUTION = 1 / 32  # the search stops once the largest fitting batch is known within this share of itself
RESULTS_JSON, RESULTS_MD = "bench_memory.json", "bench_memory.md"


# ----------------------------------------------------------------------------------------- search
def largest_batch(peak_at: Callable[[int], int | None], limit: int, start: int = 1, max_trials: int = 8,
                  ceiling: int = 1 << 16, resolution: float = RESOLUTION) -> tuple[int | None, dict]:
    """(the largest batch whose peak `peak_at` says is at most `limit` bytes, or None when not even
    `start` fits; the trials: {batch: peak bytes, or None where it did not fit at all}).

    `peak_at(batch)` runs or estimates one trial.  Doubling from `start` until a peak is over the
    limit, then the batch the two largest fitting trials predict (peaks affine in the batch), until
    the largest fitting and smallest failing batch are within `resolution` of the former (or
    adjacent), or `max_trials` ran.  Where the line says the largest fitting batch is one already
    tried, the next one up is tried to confirm it.  Once that line overshoots (a plan's peak grows
    faster past small batches: BERT-Large's 0.26 GB a sample from 1 to 2, 0.56 from 2 to 109), the
    line through the bracket's two ends, which bisection takes over from when it moves the same end
    twice running (a curved peak) or an end has no peak (out of memory)."""
    trials: dict[int, int | None] = {}

    def fits(batch: int) -> bool:
        trials[batch] = peak_at(batch)
        return trials[batch] is not None and trials[batch] <= limit

    if not fits(start):
        return None, trials
    lo, hi, overshot, moved = start, None, False, []  # moved: which end each bracket-line trial moved
    while len(trials) < max_trials and lo < ceiling:
        if hi is not None and hi - lo <= max(1, math.floor(lo * resolution)):
            break
        if not overshot:
            guess = _prediction(trials, limit)
        else:
            guess = None if moved[-2:] in (["lo", "lo"], ["hi", "hi"]) else _secant(trials, lo, hi, limit)
        if guess is not None and (guess <= lo or guess in trials or (hi is not None and guess >= hi)):
            guess = lo + 1 if lo + 1 not in trials else None  # the line says lo: one more confirms it
        from_line = guess is not None
        if guess is None:  # no line (or it overshot once): double, or bisect the bracket (in log
            # space while it spans more than a factor 4: a line far past the limit leaves a wide one)
            guess = 2 * lo if hi is None else int(math.sqrt(lo * hi)) if hi > 4 * lo else (lo + hi) // 2
        guess = min(max(guess, lo + 1), (hi - 1) if hi is not None else ceiling)
        bracketed = overshot
        if fits(guess):
            lo = guess
        else:
            hi, overshot = guess, overshot or (from_line and guess > lo + 1)
        if bracketed:
            moved = moved + ["lo" if lo == guess else "hi"] if from_line else []
    return lo, trials


def _secant(trials: dict, lo: int, hi: int | None, limit: int) -> int | None:
    """The batch at which the line through the bracket's ends (`lo` fits, `hi` does not) reaches
    `limit`; None where `hi` has no peak (it ran out of memory) or there is no bracket."""
    if hi is None or trials.get(hi) is None or trials.get(lo) is None or trials[hi] <= trials[lo]:
        return None
    return lo + int((limit - trials[lo]) * (hi - lo) / (trials[hi] - trials[lo]))


def _prediction(trials: dict, limit: int) -> int | None:
    """The batch at which the line through the two largest fitting trials reaches `limit`, once
    two trials fit (else None)."""
    fit = sorted((b, p) for b, p in trials.items() if p is not None and p <= limit)
    if len(fit) < 2:
        return None
    (b0, p0), (b1, p1) = fit[-2], fit[-1]
    slope = (p1 - p0) / (b1 - b0)
    if slope <= 0:
        return None
    return b1 + int((limit - p1) / slope)


# ------------------------------------------------------------------------------------- one trial
def checkpointing(module) -> str | None:
    """Switch on the activation checkpointing the library of `module` (or a submodule) offers;
    what was switched on, or None where there is none."""
    for m in module.modules():
        if getattr(m, "supports_gradient_checkpointing", False):  # transformers' PreTrainedModel
            for name, kwargs in (("activation_checkpointing_enable", "activation_checkpointing_kwargs"),  # >= 5.2x
                                 ("gradient_checkpointing_enable", "gradient_checkpointing_kwargs")):
                if callable(getattr(m, name, None)):
                    getattr(m, name)(**{kwargs: {"use_reentrant": False}})
                    return f"{type(m).__name__}.{name}"
        if callable(getattr(m, "set_grad_checkpointing", None)):  # timm
            m.set_grad_checkpointing(True)
            return f"{type(m).__name__}.set_grad_checkpointing"
    return None


def trial(job: dict) -> dict:
    """Run in the trial subprocess: the model at ``job["batch"]`` under ``job["system"]``."""
    import torch

    model, system, batch, limit = job["model"], job["system"], job["batch"], job["limit_bytes"]
    row = {"model": model, "system": system, "batch": batch, "ok": False}
    torch.cuda.init()
    free0, total = torch.cuda.mem_get_info()
    torch.cuda.reset_peak_memory_stats()
    entry = e2e.build_entry(model, job.get("quick", False), batch=batch)
    channels_last = model in e2e.CHANNELS_LAST
    try:
        if system in TORCH_SYSTEMS:
            torch.cuda.set_per_process_memory_fraction(min(1.0, limit / total))
            if system == "eager_checkpoint":
                how = checkpointing(entry.model)
                if how is None:
                    return {**row, "ok": True, "skipped": "the model's library offers no activation checkpointing"}
                row["checkpointing"] = how
        inputs = [t.cuda() for t in entry.example_inputs()]
        if system in TORCH_SYSTEMS:
            step, _ = e2e._torch_step(entry, inputs, "compile" if system == "compile" else "eager",
                                      channels_last=channels_last)
        else:
            budget = job["memory_budget"] if "memory_budget" in job else _budget(system, limit)
            step, compile_s, _ts = e2e._tvm_step(entry, inputs, "tvm_evt", None, memory_budget=budget)
            row["compile_s"] = round(compile_s, 1)
        for _ in range(max(1, job.get("warmup", 2))):
            step()
        torch.cuda.synchronize()
        times = e2e.time_steps(step, job.get("steps", 10))
    except (torch.OutOfMemoryError, RuntimeError) as err:  # (an allocation inside a compiled kernel's launcher)
        if not isinstance(err, torch.OutOfMemoryError) and "out of memory" not in str(err).lower():
            raise
        return {**row, "ok": True, "fits": False, "error": e2e.error_summary(err, 200)}
    used = free0 - torch.cuda.mem_get_info()[0]
    peak = torch.cuda.max_memory_allocated() if system in TORCH_SYSTEMS else used
    step_ms = sorted(times)[len(times) // 2]
    return {**row, "ok": True, "fits": peak <= limit, "peak_bytes": int(peak), "device_used_bytes": int(used),
            "step_ms": round(step_ms, 3), "samples_per_s": round(batch * 1e3 / step_ms, 1)}


def _budget(system: str, limit: int) -> int | None:
    """The ``memory_budget`` `system` compiles with under `limit` bytes (unless one was aimed)."""
    return int(BUDGET_SHARE * limit) if system in BUDGET_SYSTEMS else None


def aimed_budget(model: str, batch: int, limit: int, quick: bool = False) -> dict:
    """{"memory_budget", "planned_peak_bytes"}: the budget whose step's memory plan holds at most
    ``PLAN_SHARE * limit`` at `batch` (``budget.aim_memory_budget``: memory plans made without
    building kernels, on any machine; the budget is None where the step fits without one)."""
    from .budget import aim_memory_budget
    from .errors import MemoryBudgetError

    module, inputs, *rest = _step_arguments(model, batch, quick)
    try:
        budget, planned = aim_memory_budget(module, inputs, int(PLAN_SHARE * limit), *rest)
    except MemoryBudgetError as err:
        return {"memory_budget": None, "planned_peak_bytes": None, "error": str(err)[:300]}
    return {"memory_budget": budget, "planned_peak_bytes": planned}


def run_trial(args, model: str, system: str, batch: int, limit: int, aimed: dict | None = None) -> dict:
    """One trial in a subprocess (its errors and time-outs come back as the row's error); `aimed`:
    the budget `aimed_budget` found, compiled with instead of ``BUDGET_SHARE`` of the limit."""
    job = {"model": model, "system": system, "batch": batch, "limit_bytes": limit, "steps": args.steps,
           "warmup": args.warmup, "quick": args.quick}
    if aimed is not None and "error" not in aimed:
        job["memory_budget"] = aimed["memory_budget"]
    cmd = [sys.executable, "-m", "tvm_evt.bench_memory", "--trial", json.dumps(job)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"model": model, "system": system, "batch": batch, "ok": False,
                "error": f"timed out after {args.timeout:.0f} s"}
    return e2e.result_row(proc.stdout) or {"model": model, "system": system, "batch": batch, "ok": False,
                                          "error": f"exit code {proc.returncode}: {proc.stderr[-400:]}"}


HOPPER = {"kind": "cuda", "arch": "sm_90a"}  # the estimates' target on a machine without a GPU


def estimate_target():
    """The target the estimates run the passes for: this machine's GPU, else a Hopper GPU's (the
    CUDA route's graph: attention offloaded, matmuls padded; the llvm route's differs)."""
    from .training import as_target

    target = as_target(None)
    return target if target.kind.name == "cuda" else as_target(HOPPER)


def _step_arguments(model: str, batch: int, quick: bool) -> tuple:
    """(module, example inputs, loss, optimizer, target, precision): the step the tvm_evt systems
    compile, for the budget functions that build no kernel (``estimate_target``)."""
    from . import optim

    entry = e2e.build_entry(model, quick, batch=batch)
    return entry.model, entry.example_inputs(), entry.loss_fn, optim.AdamW(lr=1e-4), estimate_target(), "bf16"


def estimate_basis(system: str) -> str:
    """What `estimated_peak` gives for `system`: "plan" (the step's memory plan, whose peak the H200
    measured within 0.3 % at BERT-Large batch 102) or "estimate" (the rematerialisation's estimate,
    which a budget bounds)."""
    return "estimate" if system in BUDGET_SYSTEMS else "plan"


def estimated_peak(model: str, system: str, batch: int, limit: int, quick: bool = False) -> int | None:
    """The tvm_evt step's peak at `batch` before any kernel is built: its memory plan's
    (``planned_step_peak``), or with a budget the estimate the budget bounds (``estimate_step_peak``);
    None where the budget's rematerialisation cannot meet it."""
    from .budget import estimate_step_peak, planned_step_peak
    from .errors import MemoryBudgetError

    args = _step_arguments(model, batch, quick)
    if estimate_basis(system) == "plan":
        return planned_step_peak(*args)
    try:
        return estimate_step_peak(*args, _budget(system, limit))
    except MemoryBudgetError:
        return None


# --------------------------------------------------------------------------------- one system
def search_system(args, model: str, system: str, limit: int, eager_batch: int | None,
                  trial_fn=None, estimate_fn=None, estimated: tuple | None = None) -> dict:
    """Row for one (model, system): the largest batch found and its trial."""
    trial_fn = trial_fn or (lambda b: run_trial(args, model, system, b, limit))
    estimate_fn = estimate_fn or (lambda b: estimated_peak(model, system, b, limit, args.quick))
    runs: dict[int, dict] = {}
    if system in AT_EAGER_BATCH:
        if eager_batch is None:
            return {"model": model, "system": system, "skipped": "no eager batch"}
        batch = AT_EAGER_BATCH[system] * eager_batch
        runs[batch] = trial_fn(batch)
        return _row(model, system, batch, runs)
    if system in TORCH_SYSTEMS:
        def peak_at(b: int) -> int | None:
            runs[b] = r = trial_fn(b)
            if r.get("skipped"):
                raise _Skip(r["skipped"])
            if not r.get("ok"):
                raise _Failed(r.get("error", "failed"))
            return r.get("peak_bytes")  # (none where it ran out of memory)
        try:
            batch, _ = largest_batch(peak_at, limit, args.start_batch, args.max_trials)
        except _Skip as why:
            return {"model": model, "system": system, "skipped": str(why)}
        except _Failed as why:
            return {"model": model, "system": system, "ok": False, "error": str(why), "trials": _trials(runs)}
        return _row(model, system, batch, runs)
    # tvm_evt: the estimate finds the batch, runs confirm it
    batch, estimates = estimated or largest_batch(estimate_fn, limit, args.start_batch, args.max_trials)
    best, grown = None, False
    for _ in range(CONFIRM_RUNS):
        if batch is None or batch < 1 or batch in runs:
            break
        runs[batch] = r = trial_fn(batch)
        if not r.get("ok"):
            break
        used = r.get("peak_bytes") or 0
        if r.get("fits"):
            best = max(best or 0, batch)
            # the estimate errs high: grow once by what the device says is left (a peak affine in
            # the batch with a positive intercept stays under the limit scaled so)
            if grown or used <= 0 or used >= (1 - RESOLUTION) * limit:
                break
            batch, grown = int(batch * limit / used), True
        elif best is not None:
            break
        else:
            batch = min(batch - 1, int(batch * limit / used) if used else batch // 2)
    row = _row(model, system, best, runs)
    row["estimates"] = {str(b): p for b, p in sorted(estimates.items())}
    return row


class _Skip(Exception):
    pass


class _Failed(Exception):
    pass


def _trials(runs: dict) -> dict:
    return {str(b): {k: r.get(k) for k in ("fits", "peak_bytes", "step_ms", "error") if r.get(k) is not None}
            for b, r in sorted(runs.items())}


def _row(model: str, system: str, batch: int | None, runs: dict) -> dict:
    row = {"model": model, "system": system, "trials": _trials(runs)}
    failed = [r for r in runs.values() if not r.get("ok")]
    if batch is None or batch not in runs or not runs[batch].get("fits"):
        why = failed[-1].get("error") if failed else "no batch fits the limit"
        return {**row, "ok": False, "error": why}
    best = runs[batch]
    return {**row, "ok": True, "batch": batch, **{k: best[k] for k in ("peak_bytes", "device_used_bytes", "step_ms",
                                                                          "samples_per_s", "compile_s",
                                                                          "checkpointing") if k in best}}


# ------------------------------------------------------------------------------------------ run
def run(args) -> int:
    """``bench.py --max-batch GB``: every model and system, rows written as they come."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    limit = int(args.max_batch * 1e9)
    data = e2e.load_results(out, RESULTS_JSON) if not args.fresh else {"meta": {}, "rows": []}
    if data["meta"].get("limit_bytes", limit) != limit:  # rows found under another limit answer another question
        e2e._log(f"{out / RESULTS_JSON}: rows for {data['meta']['limit_bytes'] / 1e9:g} GB dropped (--max-batch {args.max_batch:g})")
        data["rows"] = []
    data["meta"] = {**e2e.meta(args), "limit_bytes": limit}
    run_info = e2e.run_id()
    started = time.monotonic()
    for model in args.models:
        done = {r["system"]: r for r in data["rows"] if r["model"] == model and (r.get("ok") or r.get("skipped"))}
        for system in args.systems:
            if system in done:
                continue
            estimate_fn = estimated = None
            if system in ESTIMATED_SYSTEMS:
                estimate_fn = _kept(data, out, "estimates", model, system, limit, basis=estimate_basis(system),
                                    fn=lambda b, model=model, system=system: estimated_peak(model, system, b, limit,
                                                                                         args.quick))
                estimated = _estimated_batch(data, out, model, system, limit, args, estimate_fn)
            aim = None  # a budget system at a multiple of eager's batch: the budget aimed at the limit
            eager = done.get("eager", {}).get("batch")
            if system in AT_EAGER_BATCH and system in BUDGET_SYSTEMS and eager is not None:
                aim = _kept(data, out, "aimed_budgets", model, system, limit,
                            lambda b, model=model: aimed_budget(model, b, limit, args.quick))(AT_EAGER_BATCH[system] * eager)
                e2e._log(f"{model} / {system}: memory_budget {aim.get('memory_budget')} aimed at a plan of "
                         f"{aim.get('planned_peak_bytes')} bytes")
            if args.estimate_only:
                if estimated:
                    e2e._log(f"{model} / {system}: estimated largest batch {estimated[0]}")
                continue
            if not e2e.fits(time.monotonic() - started, args.timeout, args.deadline):
                e2e._log(f"--deadline {args.deadline:.0f} s: not started: {model} / {system}")
                continue

            def run_one(batch: int, model=model, system=system) -> dict:
                if not e2e.fits(time.monotonic() - started, args.timeout, args.deadline):
                    return {"model": model, "system": system, "batch": batch, "ok": False,
                            "error": f"--deadline {args.deadline:.0f} s reached before this trial"}
                return run_trial(args, model, system, batch, limit, aim)
            # a trial at an aimed budget answers for that budget only
            trial_fn = _kept(data, out, "trials", model, system, limit, run_one, keep=lambda r: r.get("ok"),
                             basis=None if aim is None else f"memory_budget {aim.get('memory_budget')}")

            row = {**search_system(args, model, system, limit, eager, trial_fn, estimated=estimated), **run_info}
            if aim is not None:
                row["aimed_budget"] = aim
            done[system] = row
            data["rows"] = [r for r in data["rows"] if (r["model"], r["system"]) != (model, system)] + [row]
            e2e.save_results(data, out, RESULTS_JSON)
            (out / RESULTS_MD).write_text(markdown(data))
            e2e._log(f"{model} / {system}: " + (f"batch {row['batch']}" if row.get("ok") else
                                                row.get("skipped") or f"FAILED: {row.get('error')}"))
    print(markdown(data))
    return 0


def _kept(data: dict, out: Path, kind: str, model: str, system: str, limit: int, fn: Callable,
          keep: Callable = lambda value: True, basis: str | None = None) -> Callable:
    """`fn(batch)` with its values kept in `data[kind]` (saved to `out` as they come), under the
    model, the system, the limit and what the values are (`basis`), where `keep(value)` says so:
    estimates made by ``--estimate-only`` (on any machine) wait there for the GPU run, and a run cut
    short by its deadline or a device call's end resumes without estimating or running a trial again."""
    kept = data.setdefault(kind, {}).setdefault(f"{model}/{system}", {})
    if kept.get("limit_bytes") != limit or kept.get("basis") != basis:
        kept.clear()
        kept.update(limit_bytes=limit, values={}, **({"basis": basis} if basis else {}))

    def kept_fn(batch: int):
        if str(batch) in kept["values"]:
            return kept["values"][str(batch)]
        value = fn(batch)
        if keep(value):
            kept["values"][str(batch)] = value
            e2e.save_results(data, out, RESULTS_JSON)
        return value
    return kept_fn


def _estimated_batch(data: dict, out: Path, model: str, system: str, limit: int, args, estimate_fn) -> tuple:
    """(the estimated largest batch, the estimates made) of a tvm_evt system: the search's result
    is kept with the estimates, so that the GPU run confirms the batch an ``--estimate-only`` run
    found whatever its own ``--start-batch`` and ``--max-trials`` (a different walk would estimate
    on the GPU's host, where each estimate takes about a minute of device time)."""
    kept = data["estimates"][f"{model}/{system}"]
    if "largest" not in kept:
        kept["largest"], _ = largest_batch(estimate_fn, limit, args.start_batch, args.max_trials)
        e2e.save_results(data, out, RESULTS_JSON)
    return kept["largest"], {int(b): p for b, p in kept["values"].items()}


def markdown(data: dict) -> str:
    """The table: per model and system the largest batch, its peak, step time and samples/s, with
    the batch and throughput against eager's and the budget's samples/s against tvm_evt at eager's batch."""
    m = data.get("meta", {})
    limit = m.get("limit_bytes", 0)
    lines = [f"# Largest batch in {limit / 1e9:.0f} GB — {m.get('gpu', 'GPU')}", "",
             f"torch {m.get('torch')}; {m.get('precision', 'bf16')}; {m.get('optimizer', 'AdamW')}. Peak: torch's "
             "max_memory_allocated (torch systems, allocator capped at the limit) or the device memory the step "
             "took (tvm_evt systems). samples/s at each system's own largest batch; ≥ B: no larger batch was "
             "tried; B (plan): the step's memory plan at B is over the limit (no trial ran there).", "",
             "| model | system | largest batch | smallest that did not fit | × eager's | peak GB | ms/step | samples/s | "
             "vs eager | trials | note |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    rows = data.get("rows", [])
    by = {(r["model"], r["system"]): r for r in rows}
    for r in rows:
        eager = by.get((r["model"], "eager"), {})
        note = r.get("skipped") or r.get("error") or r.get("checkpointing") or ""
        ok = r.get("ok") and "batch" in r
        ratio = lambda key: (f"{r[key] / eager[key]:.2f}×" if ok and eager.get("ok") and eager.get(key) else "–")  # noqa: E731
        above = _first_failing(r) or _first_over_plan(r, limit)
        searched = ok and r["system"] in TORCH_SYSTEMS
        lines.append("| " + " | ".join([
            r["model"], r["system"],
            ("≥ " if searched and above is None else "") + str(r["batch"]) if ok else "–",  # no bracket: a lower bound
            str(above or "–"), ratio("batch"),
            f"{r['peak_bytes'] / 1e9:.1f}" if ok and r.get("peak_bytes") else "–",
            f"{r['step_ms']:.1f}" if ok else "–", f"{r['samples_per_s']:.1f}" if ok else "–",
            ratio("samples_per_s"), str(len(r.get("trials", {}))), str(note)[:120].replace("|", "/")]) + " |")
    for model in dict.fromkeys(r["model"] for r in rows):
        base = by.get((model, "tvm_evt_at_eager_batch"), {})
        for system in ("tvm_evt",) + BUDGET_SYSTEMS:  # #41's target: twice eager's batch at <= 10 % lost
            row = by.get((model, system), {})
            if row.get("ok") and base.get("ok"):
                lines.append(f"\n{model}: {system}'s batch {row['batch']} ({row['batch'] / base['batch']:.2f}× "
                             f"eager's) at {row['samples_per_s'] / base['samples_per_s']:.2f}× the samples/s of "
                             f"tvm_evt at eager's batch {base['batch']}.")
    return "\n".join(lines) + "\n"


def _first_failing(row: dict) -> int | None:
    """The smallest batch above the row's whose trial did not fit (the search's bracket: the
    largest batch lies between the two)."""
    return min((int(b) for b, t in row.get("trials", {}).items()
                if t.get("fits") is False and int(b) > row.get("batch", 0)), default=None)


def _first_over_plan(row: dict, limit: int) -> str | None:
    """For a tvm_evt row confirmed from its memory plans: "B (plan)", B the smallest batch above the
    row's whose plan is over `limit` (no trial ran there), else None."""
    over = [int(b) for b, p in row.get("estimates", {}).items() if p > limit and int(b) > row.get("batch", 0)]
    return f"{min(over)} (plan)" if over else None


def main(argv=None) -> int:
    """``scripts/bench.py``: with ``--max-batch`` the search here, else `bench_e2e.main`'s step times."""
    args = e2e.parse_args(argv)
    if args.max_batch is None:
        return e2e.main(argv)
    why = None if args.estimate_only else e2e.gpu_problem()
    if why:
        print(f"bench: cannot run: {why}; --max-batch needs a CUDA GPU.", file=sys.stderr)
        return 2
    return run(args)


def _trial_main(job_json: str) -> int:
    return e2e.job_main(job_json, trial, keys=("model", "system", "batch"))


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--trial":
        sys.exit(_trial_main(sys.argv[2]))
    sys.exit(main(sys.argv[1:]))

"""Data-parallel training throughput on the GPUs of one host: tvm_evt against torch's
DistributedDataParallel, eager and under torch.compile.

One *measurement* is (model, system, N ranks).  N > 1 runs under ``torchrun --standalone
--nproc-per-node N`` (one process per GPU, NCCL); N = 1 is the same system on one GPU without a
process group, the baseline of the scaling efficiency:

* ``tvm_evt``: ``compile_training(..., data_parallel=True)`` on every rank (gradients all-reduced
  in 25 MiB buckets as the backward produces them, overlapping it); on one GPU the plain
  single-GPU step (``compile_training``, CUDA graphs);
* ``ddp``: torch ``DistributedDataParallel`` (its defaults: 25 MiB buckets, overlap), autocast bf16,
  fused AdamW; on one GPU the module without the wrapper;
* ``ddp_compile``: ``torch.compile`` (default mode) of the DDP module (DDPOptimizer splits the
  graph at the buckets); on one GPU ``torch.compile`` of the module.

Weak scaling, as data-parallel training is run: every rank gets the bench's per-GPU batch
(``bench_e2e.MODELS``), so N ranks train on N times the samples.  Every rank builds the same
weights (seed 0) and draws its own batch (seed 1000 + rank).  Each rank times ``--steps`` steps
with CUDA events after ``--warmup`` untimed ones; a step's time is the slowest rank's median
(the collectives keep the ranks in step).  samples/s = N × batch / step time; scaling
efficiency = samples/s on N GPUs / (N × samples/s of the same system on one GPU, same run).

Results are appended to ``<out>/bench_dp.json`` and ``bench_dp.md`` is rewritten after every
measurement; a failed or timed-out measurement is a row with its error.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from . import bench_e2e
from .bench_e2e import MODELS, build_entry, error_summary, profile_kernels, run_id, time_steps

SYSTEMS = {
    "tvm_evt": ("tvm_evt, data parallel (NCCL all-reduce per 25 MiB bucket after the backward)",
                "tvm_evt, one GPU (CUDA graphs)"),
    "tvm_evt_overlap": ("tvm_evt, data parallel, the backward cut per bucket (overlap=True)", "(tvm_evt's)"),
    "ddp": ("torch DistributedDataParallel (eager, autocast bf16, fused AdamW)", "PyTorch eager, one GPU"),
    "ddp_compile": ("torch.compile (default) of the DDP module", "torch.compile (default), one GPU"),
}
DEFAULT_SYSTEMS = ("tvm_evt", "ddp", "ddp_compile")  # tvm_evt_overlap: an A/B asked for by name
ONE_GPU_OF = {"tvm_evt_overlap": "tvm_evt"}  # systems whose one-GPU row is another's (not measured twice)
BASELINE = "ddp_compile"  # the system to beat at every N
RESULTS_JSON, RESULTS_MD = "bench_dp.json", "bench_dp.md"


def _log(msg: str) -> None:
    print(f"[bench_dp] {msg}", file=sys.stderr, flush=True)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="bench_dp.py", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Data-parallel samples/s on 1..N GPUs of this host: tvm_evt, torch DDP, DDP + torch.compile.")
    ap.add_argument("--models", default="hf_bert_large,hf_gpt2_medium", help=f"comma-separated subset of {', '.join(MODELS)}")
    ap.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS), help=f"comma-separated subset of {', '.join(SYSTEMS)}")
    ap.add_argument("--gpus", default="1,2,4", help="comma-separated rank counts (each at most the visible GPUs)")
    ap.add_argument("--steps", type=int, default=20, help="timed steps per measurement (median)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps after the first")
    ap.add_argument("--quick", action="store_true", help="the bench's small sizes, for a smoke run")
    ap.add_argument("--profile", action="store_true", help="also list rank 0's top kernels and its GPU busy time")
    ap.add_argument("--out", default="./bench_dp_out", help="output directory (JSON, Markdown)")
    ap.add_argument("--timeout", type=float, default=540, help="seconds per measurement (all its ranks)")
    ap.add_argument("--deadline", type=float, default=None,
                    help="seconds this run may take: a measurement starts only while its --timeout still fits")
    return ap


def parse_args(argv=None) -> argparse.Namespace:
    args = parser().parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    args.systems = [s for s in args.systems.split(",") if s]
    args.gpus = [int(n) for n in args.gpus.split(",") if n]
    for kind, names, known in (("model", args.models, MODELS), ("system", args.systems, SYSTEMS)):
        unknown = [n for n in names if n not in known]
        if unknown:
            parser().error(f"unknown {kind}(s) {', '.join(unknown)}; choose from {', '.join(known)}")
    if not args.gpus or min(args.gpus) < 1:
        parser().error("--gpus: rank counts of at least 1")
    return args


# ------------------------------------------------------------------------ the driver
def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("bench_dp.py needs CUDA GPUs (NCCL); none is visible", file=sys.stderr)
        return 2
    visible = torch.cuda.device_count()
    out = Path(args.out)
    data = load_results(out)
    data["meta"] = {**run_id(), "gpus_visible": visible, "steps": args.steps, "quick": args.quick}
    start = time.monotonic()
    for model in args.models:
        for n in args.gpus:
            for system in args.systems:
                if n == 1 and system in ONE_GPU_OF:
                    continue
                if any(r["model"] == model and r["system"] == system and r["ranks"] == n and r.get("ok")
                       for r in data["rows"]):
                    continue  # measured by an earlier run into the same --out
                if n > visible:
                    row = {"model": model, "system": system, "ranks": n, "ok": False,
                           "error": f"{n} ranks, {visible} GPUs visible"}
                elif args.deadline is not None and time.monotonic() - start + args.timeout > args.deadline:
                    _log(f"no time left for {model} / {system} / {n} GPUs")
                    continue
                else:
                    _log(f"{model} / {system} / {n} GPUs")
                    row = run_measurement(args, model, system, n)
                row.update(run_id())
                data["rows"] = [r for r in data["rows"]
                                if (r["model"], r["system"], r["ranks"]) != (model, system, n)] + [row]
                write_reports(data, out)
                _log(f"  -> {_summary(row)}")
    print(markdown(data))
    return 0


def _summary(row: dict) -> str:
    if not row.get("ok"):
        return f"FAILED: {row.get('error')}"
    return f"{row['step_ms']:.2f} ms/step, {row['samples_per_s']:.1f} samples/s, compiled in {row['compile_s']:.0f} s"


def run_measurement(args, model: str, system: str, ranks: int) -> dict:
    """One measurement in subprocesses: torchrun with `ranks` processes, or one process."""
    job = {"model": model, "system": system, "steps": args.steps, "warmup": args.warmup, "quick": args.quick,
           "profile": args.profile}
    inner = ["-m", "tvm_evt.bench_dp", "--measure", json.dumps(job)]
    cmd = [sys.executable] + (["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
                              if ranks > 1 else []) + inner
    row = {"model": model, "system": system, "ranks": ranks, "ok": False}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired as err:
        tail = err.stderr.decode(errors="replace") if isinstance(err.stderr, bytes) else (err.stderr or "")
        return {**row, "error": f"timed out after {args.timeout:.0f} s", "log_tail": tail[-1500:]}
    sys.stderr.write(proc.stderr[-3000:])
    result = bench_e2e.result_row(proc.stdout)
    if result is not None:
        return result
    return {**row, "error": f"exit code {proc.returncode}", "log_tail": proc.stderr[-1500:]}


# ------------------------------------------------------------------- one measurement (every rank)
def measure(job: dict) -> dict | None:
    """Run by every rank (or the one process): build, compile, warm up, time; rank 0's row."""
    import torch

    model, system = job["model"], job["system"]
    ranks = int(os.environ.get("WORLD_SIZE", 1))
    rank = int(os.environ.get("RANK", 0))
    dist = None
    if ranks > 1:
        import torch.distributed as dist

        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl")
    row = {"model": model, "system": system, "ranks": ranks, "ok": False}
    try:
        entry = build_entry(model, job["quick"])  # seed 0: the same weights on every rank
        torch.manual_seed(1000 + rank)
        inputs = [t.cuda() for t in entry.example_inputs()]
        row["batch_per_gpu"] = int(inputs[0].shape[0])
        free0 = torch.cuda.mem_get_info()[0]
        start = time.perf_counter()
        step = (_tvm_step if system.startswith("tvm_evt") else _torch_step)(entry, inputs, system, ranks)
        step()  # torch.compile compiles here; a data-parallel step checks the ranks agree and broadcasts
        torch.cuda.synchronize()
        compile_s = time.perf_counter() - start
        for _ in range(job["warmup"]):
            step()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        times = time_steps(step, job["steps"])
        mine = {"median": statistics.median(times), "compile_s": compile_s,
                "device_used_mb": (free0 - torch.cuda.mem_get_info()[0]) / 2**20,
                "torch_peak_mb": torch.cuda.max_memory_allocated() / 2**20}
        every = [mine]
        if dist is not None:
            every = [None] * ranks
            dist.all_gather_object(every, mine)
        step_ms = max(m["median"] for m in every)
        row.update(ok=True, step_ms=round(step_ms, 3), steps=job["steps"],
                   rank_medians_ms=[round(m["median"], 3) for m in every],
                   samples_per_s=round(1e3 * ranks * row["batch_per_gpu"] / step_ms, 2),
                   compile_s=round(max(m["compile_s"] for m in every), 1),
                   device_used_mb=round(max(m["device_used_mb"] for m in every)),
                   torch_peak_mb=round(max(m["torch_peak_mb"] for m in every)))
        if job.get("profile"):  # every rank profiles (their collectives pair up); rank 0's is kept
            kernels, active = profile_kernels(step, system)
            row.update(kernel_ms=round(sum(k["ms_per_step"] for k in kernels), 3), active_ms=active,
                       kernels=kernels[:25])
    except Exception as err:  # noqa: BLE001 - reported as the row's error
        import traceback

        traceback.print_exc()
        row["error"] = error_summary(err)
    finally:
        if dist is not None:
            dist.destroy_process_group()
    return row if rank == 0 else None


def _torch_step(entry, inputs, system: str, ranks: int):
    """bench_e2e's eager or torch.compile step, of the module wrapped in DistributedDataParallel
    on several ranks."""
    import torch

    def ddp(module):
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(module, device_ids=[torch.cuda.current_device()])

    step, _ = bench_e2e._torch_step(entry, inputs, "compile" if system == "ddp_compile" else "eager",
                                    wrap=ddp if ranks > 1 else None)
    return step


def _tvm_step(entry, inputs, system: str, ranks: int):
    from . import optim
    from .training import compile_training

    parallel = dict(data_parallel=True, overlap=system == "tvm_evt_overlap") if ranks > 1 else {}
    step = compile_training(entry.model, [t.cpu() for t in inputs], loss_fn=entry.loss_fn,
                            optimizer=optim.AdamW(lr=1e-4), precision="bf16", **parallel)
    return lambda: step(*inputs)


# ------------------------------------------------------------------------------ reports
def load_results(out: Path) -> dict:
    return bench_e2e.load_results(out, RESULTS_JSON)


def write_reports(data: dict, out: Path) -> None:
    (bench_e2e.save_results(data, out, RESULTS_JSON) / RESULTS_MD).write_text(markdown(data))


def efficiencies(rows: list[dict]) -> dict:
    """{(model, system, ranks): samples/s / (ranks × the same system's samples/s on one GPU)}."""
    one = {(r["model"], r["system"]): r["samples_per_s"] for r in rows if r.get("ok") and r["ranks"] == 1}
    of = lambda r: (r["model"], ONE_GPU_OF.get(r["system"], r["system"]))
    return {(r["model"], r["system"], r["ranks"]): r["samples_per_s"] / (r["ranks"] * one[of(r)])
            for r in rows if r.get("ok") and of(r) in one}


def markdown(data: dict) -> str:
    rows = data["rows"]
    eff = efficiencies(rows)
    base = {(r["model"], r["ranks"]): r["samples_per_s"] for r in rows if r.get("ok") and r["system"] == BASELINE}
    m = data.get("meta", {})
    lines = [f"# Data-parallel training throughput — {m.get('gpu') or 'GPU'} × {m.get('gpus_visible', '?')}", "",
             f"bf16, AdamW; per-GPU batch fixed (weak scaling); step = the slowest rank's median of {m.get('steps')} "
             "steps (CUDA events); efficiency = samples/s ÷ (ranks × the same system's samples/s on one GPU); "
             f"vs {BASELINE} = samples/s ÷ {BASELINE}'s at the same rank count.", "",
             "| model | GPUs | system | ms/step | samples/s | scaling efficiency | vs ddp_compile | compile s | device used MB |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|"]
    order = {s: i for i, s in enumerate(SYSTEMS)}
    morder = {k: i for i, k in enumerate(MODELS)}
    for r in sorted(rows, key=lambda r: (morder.get(r["model"], 99), r["ranks"], order.get(r["system"], 99))):
        label = MODELS.get(r["model"], (None, None, None, r["model"]))[3]
        if not r.get("ok"):
            err = str(r.get("error", "failed")).replace("|", "/").replace("\n", " ")[:160]
            lines.append(f"| {label} | {r['ranks']} | {r['system']} | – | – | – | – | – | – | FAILED: {err} |")
            continue
        e = eff.get((r["model"], r["system"], r["ranks"]))
        b = base.get((r["model"], r["ranks"]))
        cells = [label, str(r["ranks"]), r["system"], f"{r['step_ms']:.2f}", f"{r['samples_per_s']:.1f}",
                 "–" if e is None else f"{100 * e:.1f} %", "–" if not b else f"{r['samples_per_s'] / b:.2f}×",
                 f"{r['compile_s']:.0f}", f"{r['device_used_mb']}"]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Systems (N GPUs / one GPU):", ""]
    lines += [f"- `{s}`: {many} / {one}" for s, (many, one) in SYSTEMS.items()]
    return "\n".join(lines) + "\n"


def _measure_main(job_json: str) -> int:
    row = measure(json.loads(job_json))
    if row is not None:
        print(bench_e2e.RESULT + json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "--measure":
        sys.exit(_measure_main(sys.argv[2]))
    sys.exit(main(sys.argv[1:]))

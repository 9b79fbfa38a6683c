"""End-to-end training-step benchmark: PyTorch eager, torch.compile and TVM pipelines on one GPU.

One *measurement* is (system, model): a fresh subprocess builds the model, compiles it for the
system, runs ``--warmup`` steps, then times ``--steps`` steps with CUDA events around each step
(forward + backward + optimizer update) and reports the median.  A system too slow for that
within ``--timeout`` (TVM's default pipeline on DLight's fallback GEMMs) is timed over fewer
steps, at least one, and its row says so (``fit_steps``).  Results are appended to
``<out>/bench_e2e.json`` and the Markdown table / PNG chart are rewritten after every measurement,
so a run cut short keeps what it measured; a failing or timed-out measurement is recorded with its
error and the run goes on.

Conventions (stated in the report):

* bf16 mixed precision with fp32 master weights everywhere: torch runs fp32 parameters under
  ``torch.autocast("cuda", torch.bfloat16)``; TVM compiles with ``precision="bf16"``
  (AutoMixedPrecision keeps fp32 weights and fp32 normalisations/softmax/loss).
* Optimizer: AdamW(lr=1e-4) for every system (torch: ``fused=True``; TVM: fused into the step).
* Attention on the torch side both as explicit matmul/softmax (``eager``, ``compile``, ...) and
  as ``F.scaled_dot_product_attention`` (the ``*_sdpa`` systems); TVM systems compile the
  explicit form (the one the EVT partitioner sees).
* ResNet runs channels-last: torch's module and both systems' 4-D inputs (image and target).
  TVM imports the NCHW graph, takes those inputs in place as NHWC parameters and runs its
  convolutions NHWC (``ConvertConvLayout``), so neither side transposes them.
* Peak memory: ``torch.cuda.max_memory_allocated`` for torch systems; for every system also the
  device memory in use (``cudaMemGetInfo``) after the steps minus before the model was built —
  the only number that sees TVM's pooled allocator.  ``--memory``: each tvm_evt row also gets its
  step's memory plan (``TrainingStep.memory_report``: planned peak, parameters, gradients,
  optimizer state, saved activations, temporaries) in a table of its own.
* Compile time: torch: the first step (tracing + compilation); TVM: ``compile_training``.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

# model key -> (preset, kwargs at full size, kwargs with --quick, label)
MODELS = {
    "bert_large": ("bert_large_layer", {"batch": 32, "seq": 512}, {"batch": 8, "seq": 128}, "BERT-Large layer"),
    "gpt2_medium": ("gpt2_medium_block", {"batch": 16, "seq": 1024}, {"batch": 4, "seq": 256}, "GPT-2 medium block"),
    "vit_b16": ("vit_b16_block", {"batch": 128}, {"batch": 16}, "ViT-B/16 block"),
    "resnet50": ("resnet50_conv3", {"batch": 128}, {"batch": 16, "size": 28}, "ResNet-50 conv3_x stage"),
    "xml_cnn": ("xml_cnn_eurlex", {}, {"batch": 8, "seq": 128}, "XML-CNN (EUR-Lex)"),
    # the third-party suite: whole models as transformers and timm build them, with the library's
    # default attention (SDPA) for every system; batches to be confirmed against an 80 GB H100
    "hf_bert_layer": ("hf_bert_large_layer", {"batch": 32, "seq": 512}, {"batch": 4, "seq": 128},
                      "BertLayer (BERT-Large, transformers)"),
    "hf_bert_large": ("hf_bert_large_mlm", {"batch": 32, "seq": 512}, {"batch": 4, "seq": 128, "layers": 2},
                      "BertForMaskedLM (BERT-Large, transformers)"),
    "hf_gpt2_medium": ("hf_gpt2_medium_lm", {"batch": 16, "seq": 1024}, {"batch": 2, "seq": 256, "layers": 2},
                       "GPT2LMHeadModel (gpt2-medium, transformers)"),
    "hf_llama": ("hf_llama_4x4096", {"batch": 4, "seq": 2048}, {"batch": 1, "seq": 512, "layers": 1},
                 "LlamaForCausalLM (4 layers of 4096, 32/8 heads, transformers)"),
    "timm_vit_b16": ("timm_vit_b16", {"batch": 128}, {"batch": 16}, "vit_base_patch16_224 (timm)"),
    # whole CNNs as torchvision and timm build them, channels-last for every system
    "tv_resnet18": ("tv_resnet18", {"batch": 64, "image": 224}, {"batch": 8, "image": 64}, "resnet18 (torchvision)"),
    "tv_resnet50": ("tv_resnet50", {"batch": 128, "image": 224}, {"batch": 8, "image": 64}, "resnet50 (torchvision)"),
    "tv_mobilenet_v2": ("tv_mobilenet_v2", {"batch": 128, "image": 224}, {"batch": 8, "image": 64}, "mobilenet_v2 (torchvision)"),
    "timm_effnet_b0": ("timm_efficientnet_b0", {"batch": 128, "image": 224}, {"batch": 8, "image": 64},
                       "efficientnet_b0 (timm)"),
}
ATTENTION_MODELS = ("bert_large", "gpt2_medium", "vit_b16")
SYSTEMS = {
    "eager": "PyTorch eager (math attention)",
    "eager_sdpa": "PyTorch eager (SDPA)",
    "compile": "torch.compile default (math attention)",
    "compile_sdpa": "torch.compile default (SDPA)",
    "compile_cudagraphs": "torch.compile reduce-overhead: CUDA graphs (math attention)",
    "compile_max_autotune": "torch.compile max-autotune (math attention)",
    "compile_max_autotune_sdpa": "torch.compile max-autotune (SDPA)",
    "tvm_default": "TVM Relax default CUDA pipeline (no evt)",
    "tvm_evt": "tvm_evt (evt pipeline, untuned; CUDA graphs)",
    "tvm_evt_tuned": "tvm_evt (evt pipeline, tuned)",
    "tvm_evt_launched": "tvm_evt (evt pipeline, untuned, kernel by kernel: no CUDA graphs)",
}
# --max-batch (bench_memory.py): the largest batch each trains in a memory limit
MAX_BATCH_SYSTEMS = {
    "eager": "PyTorch eager",
    "eager_checkpoint": "PyTorch eager, the library's activation checkpointing per layer",
    "compile": "torch.compile default",
    "tvm_evt": "tvm_evt",
    "tvm_evt_budget": "tvm_evt, memory_budget from the limit (rematerialisation)",
    "tvm_evt_at_eager_batch": "tvm_evt at eager's largest batch",
    "tvm_evt_budget_at_twice_eager": "tvm_evt, memory_budget from the limit, at twice eager's largest batch",
}
# measured unless --systems says otherwise (tvm_evt_launched: an A/B of the CUDA graphs, asked for by name)
DEFAULT_SYSTEMS = [s for s in SYSTEMS if s != "tvm_evt_launched"]
BASELINE = "eager"
TUNED_MARK = "progress.json"  # tuning.PROGRESS_FILE: scripts/tune.py writes it as it goes
RESULTS_JSON, RESULTS_MD, RESULTS_PNG = "bench_e2e.json", "bench_e2e.md", "bench_e2e.png"


def _log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------- the CLI
def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="bench.py", description="Training-step time, peak memory and compile time per model "
        "for PyTorch eager, torch.compile and TVM (default pipeline, tvm_evt untuned/tuned) on one GPU.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma-separated subset of {', '.join(MODELS)}")
    ap.add_argument("--systems", default=None, help=f"comma-separated subset of {', '.join(SYSTEMS)} (default: all "
                    f"but tvm_evt_launched); with --max-batch of {', '.join(MAX_BATCH_SYSTEMS)} (default: all)")
    ap.add_argument("--steps", type=int, default=20, help="timed steps per measurement (median)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps after the first (compiling) one")
    ap.add_argument("--out", default="./bench_out", help="output directory (JSON, Markdown, PNG)")
    ap.add_argument("--quick", action="store_true", help="smaller batch/sequence for a fast smoke run")
    ap.add_argument("--tuning-dir", default=None,
                    help="root of tune.py work dirs: <dir>/<model key> is used by tvm_evt_tuned (else skipped)")
    ap.add_argument("--timeout", type=float, default=540, help="seconds per measurement subprocess")
    ap.add_argument("--deadline", type=float, default=None,
                    help="seconds this run may take: a measurement starts only while its --timeout still fits "
                    "(the rest are listed; run again with the same --out to go on)")
    ap.add_argument("--profile", action="store_true", help="also list the top kernels of each measurement")
    ap.add_argument("--top", type=int, default=15, help="kernels listed per measurement with --profile")
    ap.add_argument("--fresh", action="store_true", help="drop earlier results in --out instead of skipping them")
    ap.add_argument("--memory", action="store_true",
                    help="also report each tvm_evt system's memory plan (TrainingStep.memory_report): planned peak, "
                         "activations saved for the backward, gradients, optimizer state")
    ap.add_argument("--replot", action="store_true", help="only rewrite the table and chart from --out's JSON")
    ap.add_argument("--max-batch", type=float, default=None, metavar="GB",
                    help="instead of step times at the models' batches: the largest batch each system trains in GB "
                         "(1e9 bytes) of device memory, and its samples/s there (tvm_evt/bench_memory.py; "
                         "--timeout is then per trial)")
    ap.add_argument("--start-batch", type=int, default=1, help="--max-batch: the first batch tried")
    ap.add_argument("--max-trials", type=int, default=8, help="--max-batch: trials (or estimates) per system at most")
    ap.add_argument("--estimate-only", action="store_true",
                    help="--max-batch: only the tvm_evt systems' estimated largest batches (no kernel built, no GPU "
                         "needed), kept in --out: a later run there confirms them on the GPU without estimating again")
    return ap


def parse_args(argv=None) -> argparse.Namespace:
    args = parser().parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    systems = MAX_BATCH_SYSTEMS if args.max_batch is not None else SYSTEMS
    default = list(MAX_BATCH_SYSTEMS) if args.max_batch is not None else DEFAULT_SYSTEMS
    args.systems = [s for s in args.systems.split(",") if s] if args.systems is not None else default
    for kind, names, known in (("model", args.models, MODELS), ("system", args.systems, systems)):
        unknown = [n for n in names if n not in known]
        if unknown:
            parser().error(f"unknown {kind}(s) {', '.join(unknown)}; choose from {', '.join(known)}")
    if args.steps < 1:
        parser().error("--steps must be >= 1")
    return args


def gpu_problem() -> str | None:
    """Why this machine cannot run the benchmark, or None."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return f"no CUDA GPU is visible to torch {torch.__version__}"
    return None


def applicable(system: str, model: str, tuning_dir: str | None) -> str | None:
    """Why (system, model) is not measured, or None."""
    if system.endswith("_sdpa") and model not in ATTENTION_MODELS:
        return "no attention"
    if system == "tvm_evt_tuned":
        if not (tuning_dir and (Path(tuning_dir) / model).is_dir()):
            return "no tuning dir"
        if not (Path(tuning_dir) / model / TUNED_MARK).is_file():
            return f"no tuning results (no {TUNED_MARK}: run scripts/tune.py bench:{model} first)"
    return None


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    if args.replot:
        write_reports(load_results(out), out)
        return 0
    why = gpu_problem()
    if why:
        print(f"bench: cannot run: {why}; this benchmark needs a CUDA GPU (H100).", file=sys.stderr)
        return 2
    if args.max_batch is not None:  # (bench_memory.main takes it, and the rest to here)
        print("bench: --max-batch is tvm_evt.bench_memory.main's (scripts/bench.py calls it)", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    data = {"meta": {}, "rows": []} if args.fresh else load_results(out)
    data["meta"] = meta(args)
    run = run_id()
    done = {(r["model"], r["system"]) for r in data["rows"] if r.get("ok") or r.get("skipped")}
    started, left = time.monotonic(), []
    for model in args.models:
        for system in args.systems:
            if (model, system) in done:
                _log(f"{model} / {system}: in {out / RESULTS_JSON} already (use --fresh to re-measure)")
                continue
            skip = applicable(system, model, args.tuning_dir)
            if not skip and not fits(time.monotonic() - started, args.timeout, args.deadline):
                left.append(f"{model} / {system}")
                continue
            row = {"model": model, "system": system, "skipped": skip} if skip else run_measurement(args, model, system)
            row.update(run)
            data["rows"] = [r for r in data["rows"] if (r["model"], r["system"]) != (model, system)] + [row]
            write_reports(data, out)
            _log(f"{model} / {system}: " + (f"skipped ({skip})" if skip else
                 f"{row['step_ms']:.2f} ms/step" if row.get("ok") else f"FAILED: {row.get('error')}"))
    print(markdown(data))
    if left:
        _log(f"--deadline {args.deadline:.0f} s: not started: {', '.join(left)}; run again with --out {out} to go on")
    return 0


def progress(log: str, model: str, system: str) -> str:
    """What a measurement's log says it got through (compile time, first and warm-up step times),
    as " (compiled in 20.1 s; first step 150.20 s)", or "" if nothing."""
    prefix = f"[bench] {model} / {system}: "
    done = [ln[len(prefix):].strip() for ln in log.splitlines() if ln.startswith(prefix)]
    return f" ({'; '.join(done)})" if done else ""


def fits(elapsed: float, timeout: float, deadline: float | None) -> bool:
    """Does a measurement that may take `timeout` seconds still fit a run `deadline` seconds long?"""
    return deadline is None or elapsed + timeout <= deadline


def run_id() -> dict:
    """What each row of this invocation records of where it ran: the host and start time (rows of one
    run share a GPU and a process tree) and the commit (``TVM_EVT_COMMIT``, else git's, else None)."""
    commit = os.environ.get("TVM_EVT_COMMIT")
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                    cwd=Path(__file__).parent, timeout=10).stdout.strip() or None
        except (OSError, subprocess.SubprocessError):
            commit = None
    return {"run": f"{platform.node()} {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}", "commit": commit}


def meta(args) -> dict:
    info = {"quick": args.quick, "steps": args.steps, "warmup": args.warmup, "python": platform.python_version(),
            "precision": "bf16 autocast, fp32 master weights", "optimizer": "AdamW(lr=1e-4)"}
    try:
        import torch

        info.update(torch=torch.__version__, cuda=torch.version.cuda,
                    gpu=torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
    except ImportError:
        pass
    return info


def run_measurement(args, model: str, system: str) -> dict:
    """One measurement in a subprocess (a crash or hang loses only this row)."""
    job = {"model": model, "system": system, "steps": args.steps, "warmup": args.warmup, "quick": args.quick,
           "tuning_dir": str(Path(args.tuning_dir) / model) if args.tuning_dir else None,
           "profile": args.profile, "top": args.top, "timeout_s": args.timeout, "memory": args.memory}
    cmd = [sys.executable, "-m", "tvm_evt.bench_e2e", "--measure", json.dumps(job)]
    start = time.monotonic()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired as err:
        tail = (err.stderr or b"")[-1500:]
        tail = tail.decode(errors="replace") if isinstance(tail, bytes) else tail
        return {"model": model, "system": system, "ok": False, "log_tail": tail,
                "error": f"timed out after {args.timeout:.0f} s" + progress(tail, model, system)}
    sys.stderr.write(proc.stderr[-4000:])
    result = result_row(proc.stdout)
    if result is not None:
        return result
    return {"model": model, "system": system, "ok": False, "seconds": round(time.monotonic() - start, 1),
            "error": f"exit code {proc.returncode}", "log_tail": proc.stderr[-1500:]}


# ----------------------------------------------------------------------------- one measurement
# models whose 4-D inputs (image and target) are channels-last for every system, as torch runs a
# CNN on tensor cores: torch also converts the module; TVM takes the inputs as NHWC parameters
CHANNELS_LAST = frozenset({"resnet50", "tv_resnet18", "tv_resnet50", "tv_mobilenet_v2", "timm_effnet_b0"})


def build_entry(model: str, quick: bool = False, **overrides):
    """The ZooEntry a bench model key names (at full size, or --quick's), with `overrides` on top."""
    from . import models

    preset, full, small, _label = MODELS[model]
    import torch

    torch.manual_seed(0)
    entry = models.PRESETS[preset](**{**(small if quick else full), **overrides})
    if model in CHANNELS_LAST:
        make = entry.example_inputs
        entry = dataclasses.replace(entry, example_inputs=lambda: tuple(
            t.contiguous(memory_format=torch.channels_last) if t.dim() == 4 else t for t in make()))
    return entry


def _use_sdpa(module, on: bool) -> None:
    from .models import MultiHeadSelfAttention

    for m in module.modules():
        if isinstance(m, MultiHeadSelfAttention):
            m.use_sdpa = on


def measure(job: dict) -> dict:
    """Run in the measurement subprocess: build, compile, warm up, time."""
    import torch

    started = time.monotonic()
    model, system = job["model"], job["system"]
    row = {"model": model, "system": system, "ok": False}
    torch.cuda.init()
    free0, total = torch.cuda.mem_get_info()
    entry = build_entry(model, job["quick"])
    row["description"] = entry.description
    inputs = [t.cuda() for t in entry.example_inputs()]  # (.cuda() keeps a channels-last layout)
    if system.startswith("tvm"):
        step, compile_s, ts = _tvm_step(entry, inputs, system, job.get("tuning_dir"))
        if system != "tvm_default":
            row["rewrites"] = [n for n in rewrites_in_effect() if n != "cuda_graph" or system != "tvm_evt_launched"]
            row["attention"] = attention_summary(ts)
        _log(f"{model} / {system}: compiled in {compile_s:.1f} s")
        if job.get("memory") and system != "tvm_default":  # (tvm_default builds with TVM's pipeline, not ours)
            row["memory_plan"] = memory_columns(ts.memory_report())
    else:
        step, compile_s = _torch_step(entry, inputs, system, channels_last=model in CHANNELS_LAST)
    start = time.perf_counter()
    step()  # the first step: torch.compile compiles here
    torch.cuda.synchronize()
    row["first_step_s"] = round(time.perf_counter() - start, 2)
    _log(f"{model} / {system}: first step {row['first_step_s']:.2f} s")  # a timed-out row's log tail says how far it got
    row["compile_s"] = round(compile_s if compile_s is not None else row["first_step_s"], 2)
    if compile_s is not None and job.get("timeout_s") and \
            only_the_first_step(row["first_step_s"], job["timeout_s"] - (time.monotonic() - started)):
        # (TVM systems compile before the first step, so it is a step like the others)
        row.update(_timed([1e3 * row["first_step_s"]], free0),
                   note=f"1 step, the first: a step takes {row['first_step_s']:.1f} s")
        return row
    warmup, steps = job["warmup"], job["steps"]
    if warmup:  # one warm-up step, timed on the host, tells whether the rest fits the time left
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        step_s = time.perf_counter() - start
        warmup -= 1
        _log(f"{model} / {system}: a warm-up step {step_s:.2f} s")
        if job.get("timeout_s"):
            left = job["timeout_s"] - (time.monotonic() - started)
            extra = PROFILE_STEPS if job.get("profile") else 0
            fitted = fit_steps(step_s, left, steps, warmup, extra)
            if fitted != (steps, warmup):
                steps, warmup = fitted
                row["note"] = f"{steps} steps: a step takes {step_s:.1f} s"
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = time_steps(step, steps)
    row.update(_timed(times, free0), torch_peak_mb=round(torch.cuda.max_memory_allocated() / 2**20, 1))
    if job.get("profile"):
        kernels, active = profile_kernels(step, system)
        # GPU busy time against the step time: the difference is the GPU idling on the host
        row["kernel_ms"] = round(sum(k["ms_per_step"] for k in kernels), 3)
        if active is not None:  # with side streams the kernels' sum counts overlapping time twice
            row["active_ms"] = round(active, 3)
        row["launches"] = round(sum(k["calls_per_step"] for k in kernels), 1)
        row["kernels"] = kernels[:job.get("top", 15)]
    return row


MEMORY_COLUMNS = ("planned_peak", "parameters", "gradients", "optimizer_state", "saved_activations", "temporaries")


def memory_columns(report: dict) -> dict:
    """`TrainingStep.memory_report`'s figures a --memory row keeps, in MiB."""
    figures = {"planned_peak": report["planned_peak_bytes"], **report["categories"]}
    return {name: round(figures[name] / 2**20, 1) for name in MEMORY_COLUMNS}


def _timed(times: list[float], free0: int) -> dict:
    """A measured row's fields from its step milliseconds, and the device memory in use since
    `free0` bytes were free."""
    import torch

    return {"ok": True, "step_ms": statistics.median(times), "step_ms_min": min(times), "step_ms_max": max(times),
            "steps": len(times), "device_used_mb": round((free0 - torch.cuda.mem_get_info()[0]) / 2**20, 1)}


def fit_steps(step_s: float, left_s: float, steps: int, warmup: int, extra: int = 0,
              margin: float = 0.7) -> tuple[int, int]:
    """(timed steps, warm-up steps) that fit ``margin`` of the ``left_s`` seconds a measurement
    has, at ``step_s`` a step, with ``extra`` steps after them (profiling).  A slow system (TVM's
    default pipeline, whose GEMMs run on DLight's fallback schedules) gets fewer steps rather
    than a timeout: warm-up goes first, then timed steps, down to one."""
    room = int(margin * left_s / step_s) - extra if step_s > 0 else steps + warmup
    if steps + warmup <= room:
        return steps, warmup
    warmup = max(0, min(warmup, room - steps))
    return max(1, min(steps, room - warmup)), warmup


def only_the_first_step(first_s: float, left_s: float, margin: float = 0.7) -> bool:
    """Must a measurement whose first step took `first_s` seconds report that step alone, with
    `left_s` seconds left (a second step would not fit ``margin`` of them)?  For systems that
    compile before their first step (TVM's), on which TVM's default pipeline spends about a
    minute a step (BERT-Large: 55 s, then 58 s) and a warm-up step and a timed one would double
    the device time for a number no closer."""
    return first_s > margin * left_s


def rewrites_in_effect() -> list[str]:
    """The optional rewrites (``pipeline.OPTIONAL``) this process compiles with."""
    from .pipeline import OPTIONAL, enabled

    return [name for name in OPTIONAL if enabled(name)]


def _rewrites_note(row: dict) -> str:
    """How a row's optional rewrites differ from today's defaults ("+pad_keys -vectorize")."""
    from .pipeline import OPTIONAL

    if "rewrites" not in row:
        return ""
    on = set(row["rewrites"])
    return " ".join([f"+{n}" for n, r in OPTIONAL.items() if n in on and not r.default]
                    + [f"-{n}" for n, r in OPTIONAL.items() if n not in on and r.default])


def time_steps(step, n: int) -> list[float]:
    """Milliseconds of each of ``n`` steps between CUDA events on the current stream."""
    import torch

    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
    for start, end in events:
        start.record()
        step()
        end.record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in events]


def _torch_step(entry, inputs, system: str, channels_last: bool = False, wrap=None):
    """A torch training step of `system`'s kind (`wrap`: a function applied to the module before
    the optimizer and torch.compile see it, e.g. DistributedDataParallel)."""
    import torch

    module = entry.training_module().cuda()
    _use_sdpa(module, system.endswith("_sdpa"))
    if channels_last:
        module = module.to(memory_format=torch.channels_last)
    if wrap is not None:
        module = wrap(module)
    opt = torch.optim.AdamW(module.parameters(), lr=1e-4, fused=True)
    compiled = module
    graphs = system.startswith("compile_cudagraphs")
    if system.startswith("compile"):
        mode = "max-autotune" if "max_autotune" in system else "reduce-overhead" if graphs else None
        compiled = torch.compile(module, mode=mode)

    def step():
        if graphs:  # a new training iteration: the previous one's graph outputs may be overwritten
            torch.compiler.cudagraph_mark_step_begin()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = compiled(*inputs)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step, None


def _tvm_step(entry, inputs, system: str, tuning_dir: str | None, memory_budget: int | None = None):
    import tvm

    from . import optim
    from .training import TrainingStep, as_target, build_training_module, compile_training
    from .frontend import from_torch
    from .pipeline import tvm_default_cuda_pipeline

    optimizer = optim.AdamW(lr=1e-4)
    example = [t.cpu() for t in inputs]
    start = time.perf_counter()
    if system == "tvm_default":
        imported = from_torch(entry.model, example, entry.loss_fn)
        graph = build_training_module(imported, optimizer, "bf16")
        target = as_target(None)
        executable = tvm.compile(graph.mod, target=target, relax_pipeline=tvm_default_cuda_pipeline())
        ts = TrainingStep(imported, graph, executable, target, time.perf_counter() - start)
    else:
        ts = compile_training(entry.model, example, loss_fn=entry.loss_fn, optimizer=optimizer, precision="bf16",
                              tuning_dir=tuning_dir if system == "tvm_evt_tuned" else None,
                              cuda_graph=False if system == "tvm_evt_launched" else None,
                              memory_budget=memory_budget)
    compile_s = time.perf_counter() - start
    return (lambda: ts(*inputs)), compile_s, ts


def attention_summary(ts) -> dict:
    """How many fused attention calls the step's gradient function has, and how many of them
    the flash-attention kernels run (the rest: why not)."""
    from .report import attention_calls

    calls = attention_calls(ts.graph.mod["main_adjoint"])
    return {"fused": len(calls), "kernels": sum(c["kernel"] for c in calls),
            "reasons": sorted({c["reason"] for c in calls if not c["kernel"]})}


PROFILE_STEPS = 3  # steps torch.profiler records


def active_time(spans) -> float:
    """The time covered by at least one of the (start, duration) `spans`: kernels on several
    streams overlap, so their durations add up to more than the time the GPU was busy."""
    total, end = 0.0, None
    for start, dur in sorted(spans):
        if end is None or start > end:
            total, end = total + dur, start + dur
        elif start + dur > end:
            total, end = total + start + dur - end, start + dur
    return total


def _trace_active_ms(prof) -> float | None:
    """GPU-active milliseconds a step in `prof`'s trace (kernels, memsets and copies), or None."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text()).get("traceEvents", [])
    spans = [(e["ts"], e["dur"]) for e in events
             if e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy") and "dur" in e]
    return active_time(spans) / (1e3 * PROFILE_STEPS) if spans else None


def profile_kernels(step, system: str) -> tuple[list[dict], float | None]:
    """The GPU kernels of a few steps, most time first (torch.profiler sees TVM's kernels as well,
    through CUPTI; CUTLASS kernels are named by the evt partitions they run), and the milliseconds
    a step the GPU ran at least one of them."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(PROFILE_STEPS):
            step()
        torch.cuda.synchronize()
    from .codegen.relax_ext import kernel_partitions

    rows = []
    for ev in prof.key_averages():
        dev_us = getattr(ev, "device_time_total", None)
        if dev_us is None:
            dev_us = getattr(ev, "cuda_time_total", 0)
        if dev_us > 0:
            parts = kernel_partitions(ev.key)  # a CUTLASS kernel: name the partitions it runs
            name = f"cutlass {' = '.join(parts)}" if parts else ev.key[:120]
            rows.append({"kernel": name, "calls_per_step": ev.count / PROFILE_STEPS,
                         "ms_per_step": dev_us / (1e3 * PROFILE_STEPS)})
    rows.sort(key=lambda r: -r["ms_per_step"])
    return rows, _trace_active_ms(prof)


# ------------------------------------------------------------------------------------- reports
def load_results(out: Path, name: str = RESULTS_JSON) -> dict:
    """The results `name` in `out` holds ({"meta", "rows"}; empty when there are none yet)."""
    try:
        data = json.loads((Path(out) / name).read_text())
        if isinstance(data, dict) and isinstance(data.get("rows"), list):
            return data
    except (FileNotFoundError, json.JSONDecodeError):
        pass
    return {"meta": {}, "rows": []}


def save_results(data: dict, out: Path, name: str = RESULTS_JSON) -> Path:
    """Write `data` to `out`/`name` atomically (a run cut short leaves the last whole file)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / (name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str))
    os.replace(tmp, out / name)
    return out


def write_reports(data: dict, out: Path) -> None:
    out = save_results(data, out)
    (out / RESULTS_MD).write_text(markdown(data))
    try:
        plot(data, out / RESULTS_PNG)
    except ImportError:
        _log("matplotlib is not installed: no PNG (pip install '.[bench]'; or --replot later)")


def _speedups(data: dict) -> dict:
    base = {r["model"]: r["step_ms"] for r in data["rows"] if r.get("ok") and r["system"] == BASELINE}
    return {(r["model"], r["system"]): base[r["model"]] / r["step_ms"]
            for r in data["rows"] if r.get("ok") and r["model"] in base and r["step_ms"] > 0}


def _usual_steps(data: dict) -> int | None:
    """The timed-step count most rows have (the table's header states it; a row that differs says so)."""
    counts = [r["steps"] for r in data["rows"] if r.get("ok") and "steps" in r]
    return statistics.mode(counts) if counts else data.get("meta", {}).get("steps")


def _runs(data: dict) -> list[str]:
    """Markdown lines naming each run (host and start time, commit) and its rows."""
    runs: dict[tuple, list[str]] = {}
    for r in data["rows"]:
        if "run" in r and not r.get("skipped"):
            runs.setdefault((r["run"], r.get("commit")), []).append(f"{r['model']}/{r['system']}")
    if not runs:
        return []
    lines = ["", "Runs (one GPU each; compare rows of one run):", ""]
    for (run, commit), rows in runs.items():
        lines.append(f"- `{run}`, commit {commit or 'unknown'}: {', '.join(rows)}")
    return lines


def markdown(data: dict) -> str:
    m = data.get("meta", {})
    speed = _speedups(data)
    usual = _usual_steps(data)
    lines = [
        f"# Training-step benchmark — {m.get('gpu') or 'GPU'}", "",
        f"torch {m.get('torch')} (CUDA {m.get('cuda')}), Python {m.get('python')}; {m.get('precision')}; "
        f"{m.get('optimizer')}; median of {usual} steps (unless a row's note says otherwise) after warm-up "
        f"(CUDA events per step: forward + backward + optimizer update)" + ("; **--quick sizes**" if m.get("quick") else "")
        + ". Speedup = eager ms / system ms. Memory: torch's peak allocated (torch systems) and device memory "
        "in use after the steps (cudaMemGetInfo, all systems; includes TVM's memory pool).", "",
        "| model | system | ms/step | speedup vs eager | compile s | torch peak MB | device used MB | note |",
        "|---|---|---:|---:|---:|---:|---:|---|",
    ]
    order = {s: i for i, s in enumerate(SYSTEMS)}
    morder = {k: i for i, k in enumerate(MODELS)}
    for r in sorted(data["rows"], key=lambda r: (morder.get(r["model"], 99), order.get(r["system"], 99))):
        label = MODELS.get(r["model"], (None, None, None, r["model"]))[3]
        if r.get("skipped"):
            lines.append(f"| {label} | {r['system']} | – | – | – | – | – | n/a: {r['skipped']} |")
        elif not r.get("ok"):
            err = str(r.get("error", "failed")).replace("|", "/").replace("\n", " ")[:160]
            lines.append(f"| {label} | {r['system']} | – | – | – | – | – | FAILED: {err} |")
        else:
            sp = speed.get((r["model"], r["system"]))
            torch_mb = r.get("torch_peak_mb") if not r["system"].startswith("tvm") else None
            fewer = "" if r.get("steps") in (None, usual) or "steps" in r.get("note", "") else f"{r['steps']} steps"
            note = "; ".join(n for n in (_rewrites_note(r), r.get("note", ""), fewer) if n).replace("|", "/")
            cells = [label, r["system"], f"{r['step_ms']:.2f}", _fmt(sp, "x"), _fmt(r.get("compile_s"), "1"),
                     _fmt(torch_mb, "0"), _fmt(r.get("device_used_mb"), "0")]
            lines.append("| " + " | ".join(cells) + " |" + (f" {note} |" if note else " |"))
    lines += _runs(data)
    planned = [r for r in data["rows"] if r.get("memory_plan")]
    if planned:
        lines += ["", "## Memory plan (MiB; --memory)", "",
                  "From train_step's memory plan (TrainingStep.memory_report): the planned peak counts the "
                  "arguments and the plan's live storages; kernel workspaces are outside it. Compare with "
                  "the eager row's torch peak MB.", "",
                  "| model | system | " + " | ".join(c.replace("_", " ") for c in MEMORY_COLUMNS) + " |",
                  "|---|---|" + "---:|" * len(MEMORY_COLUMNS)]
        for r in planned:
            label = MODELS.get(r["model"], (None, None, None, r["model"]))[3]
            lines.append(f"| {label} | {r['system']} | "
                         + " | ".join(_fmt(r["memory_plan"][c], "1") for c in MEMORY_COLUMNS) + " |")
    prof = [r for r in data["rows"] if r.get("kernels")]
    for r in prof:
        lines += ["", f"## Top kernels: {r['model']} / {r['system']} ({r['step_ms']:.2f} ms/step)", ""]
        if "active_ms" in r:
            lines += [f"GPU busy {r['kernel_ms']:.2f} ms/step summed over {r['launches']:.0f} kernel launches; "
                      f"active {r['active_ms']:.2f} ms (some kernel running, on any stream); "
                      f"idle {max(r['step_ms'] - r['active_ms'], 0):.2f} ms.", ""]
        elif "kernel_ms" in r:
            lines += [f"GPU busy {r['kernel_ms']:.2f} ms/step in {r['launches']:.0f} kernel launches; "
                      f"idle {max(r['step_ms'] - r['kernel_ms'], 0):.2f} ms.", ""]
        lines += ["| kernel | calls/step | ms/step | % of step |", "|---|---:|---:|---:|"]
        for k in r["kernels"]:
            name = k["kernel"].replace("|", "/")
            lines.append(f"| `{name}` | {k['calls_per_step']:.0f} | {k['ms_per_step']:.3f} | "
                         f"{100 * k['ms_per_step'] / r['step_ms']:.1f} |")
    return "\n".join(lines) + "\n"


def _fmt(x, how: str) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "–"
    if how == "x" and 0 < x < 0.01:  # TVM's default pipeline: a minute a step, not "0.00x"
        return f"{x:.1g}×"
    return {"x": f"{x:.2f}×", "1": f"{x:.1f}", "0": f"{x:.0f}"}[how]


def plot(data: dict, path: Path) -> Path:
    """Grouped bars: speedup over eager per model and system."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    speed = _speedups(data)
    models = [m for m in MODELS if any(k[0] == m for k in speed)]
    systems = [s for s in SYSTEMS if any(k[1] == s for k in speed)]
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * max(1, len(models)) + 2), 4.5))
    width = 0.8 / max(1, len(systems))
    for i, s in enumerate(systems):
        xs = [j + (i - (len(systems) - 1) / 2) * width for j in range(len(models))]
        ys = [speed.get((m, s), 0.0) for m in models]
        ax.bar(xs, ys, width, label=SYSTEMS[s])
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(models)))
    ax.set_xticklabels([MODELS[m][3] for m in models], rotation=15)
    ax.set_ylabel("speedup over PyTorch eager (×)")
    ax.set_title(f"Training step, bf16 — {data.get('meta', {}).get('gpu') or 'GPU'}")
    if systems:
        ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def error_summary(err: BaseException, limit: int = 400) -> str:
    """``Type: message`` for the report, where the message is the compiler's error lines when the
    text has any (NVRTC and nvcc put pages of warnings before the one line that matters)."""
    text = str(err)
    errors = [ln.strip() for ln in text.splitlines()
              if re.search(r"\berror\b", ln, re.IGNORECASE) and not re.search(r"\bwarning\b", ln, re.IGNORECASE)]
    first = text.splitlines()[0].strip() if text.strip() else ""
    picked = " / ".join(dict.fromkeys([first] + errors[:3])) if errors else text
    return f"{type(err).__name__}: {picked[:limit]}"


RESULT = "RESULT "  # the line a measurement subprocess prints its row on (job_main), for result_row


def result_row(stdout: str) -> dict | None:
    """The row a measurement subprocess printed last on its ``RESULT`` line, or None."""
    for line in reversed(stdout.splitlines()):
        if line.startswith(RESULT):
            return json.loads(line[len(RESULT):])
    return None


def job_main(job_json: str, run, keys: tuple = ("model", "system")) -> int:
    """A measurement subprocess's main: ``run(job)``'s row, or the job's `keys` with the error, on a
    ``RESULT`` line of stdout (what the parent reads)."""
    job = json.loads(job_json)
    try:
        row = run(job)
    except Exception as err:  # noqa: BLE001 - reported as the row's error
        import traceback

        traceback.print_exc()
        row = {**{k: job[k] for k in keys}, "ok": False, "error": error_summary(err)}
    print(RESULT + json.dumps(row, default=str), flush=True)
    return 0


def _measure_main(job_json: str) -> int:
    return job_main(job_json, measure)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--measure":
        sys.exit(_measure_main(sys.argv[2]))
    sys.exit(main(sys.argv[1:]))

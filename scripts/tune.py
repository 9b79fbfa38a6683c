#!/usr/bin/env python3
"""Tune a model's training step: CUTLASS configs of the evt partitions (GPU profiling) and the
remaining TVM kernels (MetaSchedule, XGBoost cost model) into a work dir; resumable.

    python scripts/tune.py bert_large_layer --work-dir /tmp/tune/bert --trials 256 --time-budget 480
    python scripts/tune.py mlp --target llvm --work-dir /tmp/tune/mlp --trials 16 --max-tasks 3
    python scripts/tune.py bench:resnet50 --no-tir --work-dir /tmp/tune/resnet50   # a bench model

Later compiles use it: ``compile_training(..., tuning_dir=WORK_DIR)``, or ``scripts/bench.py
--tuning-dir /tmp/tune`` for bench model keys tuned into ``/tmp/tune/<key>``.
"""
import argparse
import json
import sys


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="tune.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="bench:KEY (a scripts/bench.py --models key, at the bench's shapes), zoo or "
                    "preset name (tvm_evt.models.ZOO / PRESETS) or package.module:factory")
    ap.add_argument("--target", default="auto", help="auto (CUDA if present), llvm, cuda, or a TVM tag")
    ap.add_argument("--work-dir", required=True, help="tuning work dir (created; reused to resume)")
    ap.add_argument("--trials", type=int, default=64, help="MetaSchedule trial budget (total; 0: skip MetaSchedule)")
    ap.add_argument("--trials-per-task", type=int, default=None, help="at least this many trials per task")
    ap.add_argument("--max-tasks", type=int, default=None, help="tune only the N costliest MetaSchedule tasks")
    ap.add_argument("--time-budget", type=float, default=None, help="seconds: start no new work after this")
    ap.add_argument("--precision", default="bf16", choices=["fp32", "bf16", "fp16"])
    ap.add_argument("--space", default="quick", choices=["quick", "default", "full"], help="CUTLASS candidate table")
    ap.add_argument("--top-k", type=int, default=1, help="main-loop configs re-profiled with each epilogue")
    ap.add_argument("--no-cutlass", action="store_true", help="skip CUTLASS profiling")
    ap.add_argument("--no-tir", action="store_true", help="skip MetaSchedule")
    ap.add_argument("--model-arg", action="append", default=[], metavar="KEY=VALUE",
                    help="constructor override, e.g. --model-arg batch=8 (repeatable; values parsed as JSON)")
    return ap


def _value(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    from tvm_evt.cli import _target_arg
    from tvm_evt.tuning import tune

    kwargs = dict((k, _value(v)) for k, v in (a.split("=", 1) for a in args.model_arg))
    result = tune(args.model, _target_arg(args.target), args.work_dir, args.trials,
                  trials_per_task=args.trials_per_task, max_tasks=args.max_tasks, precision=args.precision,
                  cutlass=not args.no_cutlass, tir=not args.no_tir, space=args.space, top_k=args.top_k,
                  time_budget=args.time_budget, model_kwargs=kwargs)
    print(json.dumps(result.to_json(), indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())

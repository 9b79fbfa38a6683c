"""Command line: ``tvm-evt train`` (the README's main job) and friends."""

from __future__ import annotations

import argparse
import statistics
import sys
import time


def _target_arg(name: str):
    if name == "auto":
        return None
    if name in ("llvm", "cpu"):
        return {"kind": "llvm"}
    if name == "cuda":
        return None if _has_gpu() else _fail("--target cuda asked for, but no CUDA GPU is visible")
    return name  # a TVM target tag such as nvidia/nvidia-h100


def _has_gpu() -> bool:
    import tvm

    return bool(tvm.cuda(0).exist)


def _fail(msg: str):
    raise SystemExit(f"tvm-evt: {msg}")


def _eager_twin(entry):
    """(a copy of the model, a function of a batch -> PyTorch eager's loss of the copy on it)."""
    import copy
    import dataclasses

    import torch

    twin = copy.deepcopy(entry.model)
    module = dataclasses.replace(entry, model=twin).training_module()

    def loss(batch) -> float:
        with torch.no_grad():
            return float(module(*batch))

    return twin, loss


def _launch_ranks(args: argparse.Namespace, argv: list[str]) -> int:
    """``--nproc N``: this command again under torchrun, N ranks on this host (standalone
    rendezvous); each rank sees torchrun's RANK/WORLD_SIZE and trains data-parallel."""
    import subprocess

    rest, skip = [], False
    for a in argv:  # the same arguments without --nproc
        if skip:
            skip = False
        elif a == "--nproc":
            skip = True
        elif not a.startswith("--nproc="):
            rest.append(a)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
           "-m", "tvm_evt.cli", *rest]
    print("launching:", " ".join(cmd), flush=True)
    return subprocess.call(cmd)


def _join_process_group(args: argparse.Namespace):
    """Under torchrun: the process group (NCCL when the step runs on CUDA, else gloo) and this
    rank's GPU; (rank, world size)."""
    import os

    import torch
    import torch.distributed as dist

    cuda = args.target != "llvm" and args.target != "cpu" and _has_gpu()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    return dist.get_rank(), dist.get_world_size()


def train(args: argparse.Namespace) -> int:
    import os

    import tvm_evt
    from tvm_evt import models

    if args.model not in models.ZOO:
        _fail(f"unknown model {args.model!r}; choose from {', '.join(sorted(models.ZOO))}")
    if args.nproc > 1 and "WORLD_SIZE" not in os.environ:
        return _launch_ranks(args, args.argv)
    data_parallel = int(os.environ.get("WORLD_SIZE", 1)) > 1
    if (args.zero or args.overlap) and not data_parallel:
        _fail(f"--{'zero' if args.zero else 'overlap'} is for data-parallel ranks: give --nproc N (or run under torchrun)")
    rank, world = _join_process_group(args) if data_parallel else (0, 1)
    log = print if rank == 0 else (lambda *a, **k: None)
    if data_parallel:
        import torch

        torch.manual_seed(rank)  # each rank draws its own synthetic batches (the weights: rank 0's)
    entry = models.ZOO[args.model]()
    example = entry.example_inputs()
    twin, eager_loss = _eager_twin(entry)
    optimizer = (tvm_evt.optim.AdamW(lr=args.lr) if args.optimizer == "adamw"
                 else tvm_evt.optim.SGD(lr=args.lr, momentum=0.9))
    log(f"model: {entry.description}")
    t0 = time.perf_counter()
    options = dict(inplace=args.inplace, cuda_graph=args.cuda_graph)
    if data_parallel:
        options = dict(data_parallel=True, zero=args.zero, overlap=args.overlap)
    step = tvm_evt.compile_training(
        entry.model, example, loss_fn=entry.loss_fn, optimizer=optimizer,
        target=_target_arg(args.target), precision=args.precision, **options,
    )
    log(f"target: {step.target.kind.name}  precision: {args.precision}  "
        f"compiled in {time.perf_counter() - t0:.1f} s")
    if data_parallel:
        log(f"data parallel: {world} ranks, each on its own batch of the zoo's size{', ZeRO-1' if args.zero else ''}; "
            "the loss printed is rank 0's")
    if args.compare and rank == 0:
        print(f"the first {args.compare} steps also print PyTorch eager's loss of the same weights on the same "
              "batch (each draws its own dropout masks)")
    times = []
    for i in range(args.steps):
        batch = entry.example_inputs()  # a fresh synthetic batch every step
        eager = ""
        if i < args.compare and rank == 0:  # before the step: it updates the weights the loss was computed with
            twin.load_state_dict({k: v.detach().cpu() for k, v in step.parameters().items()}, strict=False)
            eager = f"  eager {eager_loss(batch):.4f}"
        start = time.perf_counter()
        loss = float(step(*batch))
        times.append(time.perf_counter() - start)
        log(f"step {i + 1:4d}  loss {loss:.4f}{eager}", flush=True)
    steady = times[1:] or times
    log(f"time per step: {statistics.median(steady) * 1e3:.2f} ms "
        f"(median of {len(steady)} steps after the first)")
    if data_parallel:
        import torch.distributed as dist

        dist.destroy_process_group()
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="tvm-evt", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("train", help="train a zoo model on synthetic data")
    p.add_argument("--model", default="bert_tiny", help="zoo model name (default: bert_tiny)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--target", default="auto", help="auto (GPU if present), llvm, cuda or a TVM tag")
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"])
    p.add_argument("--optimizer", default="adamw", choices=["adamw", "sgd"])
    p.add_argument("--lr", type=float, default=3e-3, help="learning rate (default 3e-3: the demo's loss falls visibly in 20 steps)")
    p.add_argument("--compare", type=int, default=3,
                   help="steps that also print PyTorch eager's loss on the same weights and batch (default 3)")
    p.add_argument("--inplace", action="store_true",
                   help="the update writes over the step's parameters and optimizer state (not with fp16)")
    p.add_argument("--cuda-graph", action=argparse.BooleanOptionalAction, default=None,
                   help="on CUDA: in place, and later steps replay the first one's CUDA graphs "
                        "(default: on, except fp16)")
    p.add_argument("--nproc", type=int, default=1,
                   help="data-parallel ranks on this host: relaunches the command under torchrun "
                        "(a command already under torchrun trains data-parallel over its ranks)")
    p.add_argument("--zero", action="store_true", help="data parallel with ZeRO-1: the optimizer state sharded")
    p.add_argument("--overlap", action="store_true",
                   help="data parallel with the backward cut per gradient bucket, each bucket's all-reduce "
                        "overlapping the rest of the backward (slower on the transformers measured)")
    p.set_defaults(func=train)
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    args.argv = argv
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())

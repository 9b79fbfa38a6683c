"""Data-parallel training (``compile_training(..., data_parallel=True)``, ``tvm_evt.distributed``).

CPU tier: two gloo processes (torch.multiprocessing, spawn) each train a tiny MLP on their half of
the batch; after three steps their losses (averaged) and parameters must equal one process's on
the whole batch within fp32 rounding, with plain all-reduce and with ZeRO-1; the state saved
after those steps, loaded into a freshly compiled step, continues exactly as the original does.
Ranks that compiled different shapes raise a clear error on both ranks (no hang), and a rank
that dies makes the other's step raise.  GPU tier (``gpu``, two GPUs): the same on NCCL in bf16.
"""

from __future__ import annotations

import datetime
import os
import socket
import time
import traceback

import pytest
import torch

import tvm_evt
from tvm_evt import distributed
from tvm_evt.errors import DataParallelMismatchError

BATCH, STEPS, MORE = 8, 3, 2
TIMEOUT_S = 240  # a whole two-rank run (imports and two compiles per rank on a shared CPU)


class _MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(6, 12), torch.nn.Linear(12, 3)

    def forward(self, x):
        return self.fc2(torch.nn.functional.gelu(self.fc1(x)))


def _model(perturb: bool = False) -> _MLP:
    """The same initial weights everywhere (a rank that `perturb`s starts elsewhere: the first
    step's broadcast must give it rank 0's)."""
    torch.manual_seed(0)
    model = _MLP()
    if perturb:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
    return model


def _batches(n: int, batch: int = BATCH) -> list:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(batch, 6, generator=gen), torch.randn(batch, 3, generator=gen)) for _ in range(n)]


def _optimizer(name: str = "sgd"):
    """SGD's update is proportional to the gradient, so a wrong average (a sum, say) shows;
    AdamW's is nearly invariant to the gradient's scale, but has two slots for ZeRO-1 to shard."""
    if name == "adamw":
        return tvm_evt.optim.AdamW(lr=0.05, weight_decay=0.1)
    return tvm_evt.optim.SGD(lr=0.1, momentum=0.9, weight_decay=0.01)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_ranks(worker, world: int, out_dir, *args, timeout: float = TIMEOUT_S) -> list[dict]:
    """Run `worker(rank, world, port, out_dir, *args)` in `world` spawned processes; each saves a
    dict to ``out_dir/rank{r}.pt``.  Fails (and kills them) if they are not done in `timeout`."""
    import torch.multiprocessing as mp

    port = _free_port()
    ctx = mp.start_processes(worker, args=(world, port, str(out_dir), *args), nprocs=world, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=1.0):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"the {world} ranks did not finish in {timeout} s (a hang)")
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(world)]


def _init(rank: int, world: int, port: int, backend: str = "gloo", timeout_s: float = 60):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s))


def _train_worker(rank, world, port, out_dir, zero, optimizer, target, precision, backend, overlap=False):
    """Three steps on this rank's shard, the state saved, two more; then a fresh step loads the
    saved state and runs the same two."""
    import torch.distributed as dist

    if backend == "nccl":
        torch.cuda.set_device(rank)
    _init(rank, world, port, backend)
    batches = [distributed.shard_batch(b) for b in _batches(STEPS + MORE)]
    compile_step = lambda: tvm_evt.compile_training(
        _model(perturb=rank > 0), batches[0], torch.nn.functional.mse_loss, _optimizer(optimizer), target=target,
        precision=precision, data_parallel=True, zero=zero, bucket_mb=1e-4,  # a bucket per parameter or two
        overlap=overlap)
    step = compile_step()
    losses = [float(step(*b)) for b in batches[:STEPS]]
    params = {k: v.detach().cpu().clone() for k, v in step.parameters().items()}
    path = os.path.join(out_dir, f"state{rank}.pt")
    torch.save(step.state_dict(), path)
    more = [float(step(*b)) for b in batches[STEPS:]]
    after = {k: v.detach().cpu().clone() for k, v in step.parameters().items()}
    fresh = compile_step()
    fresh.load_state_dict(torch.load(path))
    again = [float(fresh(*b)) for b in batches[STEPS:]]
    resumed = {k: v.detach().cpu().clone() for k, v in fresh.parameters().items()}
    state = step.state_dict()
    torch.save({"losses": losses, "params": params, "more": more, "after": after, "again": again,
                "resumed": resumed, "segments": len(step.graph.plan.segments),
                "buckets": len(step.graph.plan.buckets), "step_count": fresh.step_count,
                "slot_numel": {s: sum(t.numel() for t in (v if isinstance(v, list) else v.values()))
                               for s, v in state["optimizer"].items()}},
               os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def _reference(optimizer, target=None, precision="fp32"):
    """One process, the whole batch: the losses and parameters after STEPS steps."""
    step = tvm_evt.compile_training(_model(), _batches(1)[0], torch.nn.functional.mse_loss, _optimizer(optimizer),
                                    target=target, precision=precision)
    losses = [float(step(*b)) for b in _batches(STEPS)]
    return losses, {k: v.detach().cpu().clone() for k, v in step.parameters().items()}


def _assert_ranks_match_one_process(results, reference, rtol: float, atol: float, loss_atol: float | None = None):
    """Two ranks' mean losses and rank 0's parameters against one process on the whole batch
    (`reference`: its losses and parameters), and the ranks' parameters bitwise equal."""
    ref_losses, ref_params = reference
    r0, r1 = results
    mean_losses = [(a + b) / 2 for a, b in zip(r0["losses"], r1["losses"])]
    assert mean_losses == pytest.approx(ref_losses, rel=rtol, abs=atol if loss_atol is None else loss_atol)
    for name, want in ref_params.items():
        torch.testing.assert_close(r0["params"][name], want, rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")
        assert torch.equal(r0["params"][name], r1["params"][name]), f"{name}: the ranks' parameters differ"


@pytest.mark.parametrize("zero,optimizer,overlap", [(False, "sgd", False), (False, "sgd", True), (True, "sgd", False),
                                                    (True, "adamw", True)],
                         ids=["allreduce-sgd", "allreduce-sgd-overlap", "zero1-sgd", "zero1-adamw-overlap"])
def test_two_gloo_ranks_match_one_process_on_the_whole_batch(tmp_path, zero, optimizer, overlap):
    results = _run_ranks(_train_worker, 2, tmp_path, zero, optimizer, "llvm", "fp32", "gloo", overlap)
    r0, r1 = results
    assert r0["buckets"] > 1  # buckets really launched apart
    assert r0["segments"] > 1 if overlap else r0["segments"] == 1  # with overlap, the backward really was cut
    _assert_ranks_match_one_process(results, _reference(optimizer, "llvm"), rtol=1e-5, atol=1e-6)
    # the saved state resumes exactly: the fresh step's losses and parameters are the original's
    for r in results:
        assert r["again"] == r["more"]
        assert r["step_count"] == STEPS + MORE
        for name in r["after"]:
            assert torch.equal(r["resumed"][name], r["after"][name]), f"{name}: resumed from the saved state differs"
    # the optimizer's slots: whole on every rank, or a shard of each bucket (aligned, padded) under ZeRO-1
    numel = sum(p.numel() for p in _model().parameters())
    assert set(r0["slot_numel"]) == set(_optimizer(optimizer).slots())
    for slot in r0["slot_numel"]:
        if zero:
            assert r0["slot_numel"][slot] < numel and r0["slot_numel"][slot] == r1["slot_numel"][slot]
        else:
            assert r0["slot_numel"][slot] == numel


def _mismatch_worker(rank, world, port, out_dir):
    """Rank 1 compiles for a batch of 3 where rank 0 has 4."""
    _init(rank, world, port, timeout_s=30)
    x, y = distributed.shard_batch(_batches(1)[0])
    if rank == 1:
        x, y = x[:3], y[:3]
    result = {"error": None}
    try:
        step = tvm_evt.compile_training(_model(), [x, y], torch.nn.functional.mse_loss, _optimizer(), target="llvm",
                                        data_parallel=True)
        step(x, y)
    except Exception as e:  # noqa: BLE001  (the test checks which)
        result = {"error": type(e).__name__, "message": str(e), "trace": traceback.format_exc()}
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    # the result is saved: leave without gloo's teardown, which after a failed step sometimes aborts
    # ("terminate called without an active exception", seen once in a loaded full run)
    os._exit(0)


def test_ranks_that_compiled_different_shapes_raise_on_every_rank(tmp_path):
    results = _run_ranks(_mismatch_worker, 2, tmp_path, timeout=120)
    for rank, r in enumerate(results):
        assert r["error"] == DataParallelMismatchError.__name__, f"rank {rank}: {r}"
        assert "input 'args_0'" in r["message"] and "[4, 6]" in r["message"] and "[3, 6]" in r["message"]


def _dead_rank_worker(rank, world, port, out_dir):
    """Rank 1 dies before the first step; rank 0's step must fail, not hang."""
    _init(rank, world, port, timeout_s=20)
    if rank == 1:
        torch.save({"error": None}, os.path.join(out_dir, f"rank{rank}.pt"))
        os._exit(0)
    x, y = distributed.shard_batch(_batches(1)[0])
    step = tvm_evt.compile_training(_model(), [x, y], torch.nn.functional.mse_loss, _optimizer(), target="llvm",
                                    data_parallel=True)
    start = time.monotonic()
    result = {"error": None}
    try:
        step(x, y)
    except Exception as e:  # noqa: BLE001
        result = {"error": type(e).__name__, "message": str(e)}
    result["seconds"] = time.monotonic() - start
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))


def test_a_dead_rank_makes_the_others_step_raise(tmp_path):
    r0 = _run_ranks(_dead_rank_worker, 2, tmp_path, timeout=150)[0]
    assert r0["error"] is not None and r0["seconds"] < 60, r0


def test_data_parallel_without_a_process_group_says_how_to_start_one():
    import torch.distributed as dist

    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="torchrun"):
        tvm_evt.compile_training(_model(), _batches(1)[0], torch.nn.functional.mse_loss, target="llvm",
                                 data_parallel=True)
    with pytest.raises(ValueError, match="data_parallel=True"):
        tvm_evt.compile_training(_model(), _batches(1)[0], torch.nn.functional.mse_loss, target="llvm", zero=True)


def test_first_mismatch_names_the_field_and_the_ranks():
    same = {"input 'x' (shape, dtype)": ([4, 6], "float32"), "the optimizer": "SGD"}
    assert distributed.first_mismatch([same, dict(same)]) is None
    other = {**same, "the optimizer": "AdamW"}
    assert distributed.first_mismatch([same, dict(same), other]) == "the optimizer is SGD on rank 0 but AdamW on rank 2"
    assert "absent on rank 1" in distributed.first_mismatch([same, {"the optimizer": "SGD"}])


def test_flat_layout_aligns_every_parameter_and_shard():
    layout = distributed.flat_layout([[2, 0], [1]], [(3, 5), (7,), (2,)], "float32", world_size=4)
    align = distributed.ALIGN_BYTES // 4
    assert all(o % align == 0 for o in layout.offsets)
    for b in range(2):
        for rank in range(4):
            start, length = layout.shard(b, rank)
            assert start % align == 0 and length % align == 0
    assert layout.offsets[2] == 0 and layout.offsets[0] == align  # bucket order, then position in it
    assert layout.starts[1] == layout.sizes[0] >= 2 * align and layout.total == sum(layout.sizes)


# ------------------------------------------------------------------------- GPU tier (NCCL)


@pytest.mark.gpu
@pytest.mark.parametrize("zero,optimizer", [(False, "sgd"), (True, "adamw")], ids=["allreduce-sgd", "zero1-adamw"])
def test_two_nccl_ranks_match_one_gpu_on_the_whole_batch_in_bf16(tmp_path, zero, optimizer):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA GPUs")
    results = _run_ranks(_train_worker, 2, tmp_path, zero, optimizer, None, "bf16", "nccl", timeout=580)
    _assert_ranks_match_one_process(results, _reference(optimizer, None, "bf16"), rtol=2e-2, atol=2e-2, loss_atol=1e-2)
    for r in results:
        assert r["again"] == r["more"]


def test_train_script_with_nproc_trains_over_two_ranks():
    """``scripts/train.py --nproc 2``: torchrun on this host, gloo on the CPU, the zoo MLP (with
    dropout: each rank's seed advances on the device)."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "scripts" / "train.py"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(script), "--nproc", "2", "--model", "mlp", "--steps", "3",
                           "--target", "llvm", "--compare", "1", "--zero"],
                          capture_output=True, text=True, timeout=TIMEOUT_S, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "data parallel: 2 ranks" in proc.stdout and "ZeRO-1" in proc.stdout
    steps = [line for line in proc.stdout.splitlines() if line.startswith("step")]
    assert len(steps) == 3 and "eager" in steps[0], proc.stdout  # rank 0 prints, once per step

"""PackMemoryArena: the tensors StaticPlanBlockMemory planned, at byte offsets of one arena.

TVM's planner reuses a storage only for a tensor of its dtype; the arena shares bytes across
dtypes by lifetime.  Checked: the packing never overlaps two tensors alive at once; a float32 and a
bfloat16 temporary with disjoint lifetimes share bytes; the step computes bit for bit what TVM's
plan computes, and its memory report reads the arena."""

import numpy as np
import pytest
import torch
import tvm
from tvm import relax
from tvm.script import relax as R

from tvm_evt import compile_training, models
from tvm_evt.codegen.build import arena_runtime
from tvm_evt.pipeline import DEFAULT_BUILD, DISABLE_ENV, PLANNER
from tvm_evt.relax_passes.lower.pack_memory_arena import ALIGN, PackMemoryArena, pack, plan
from tvm_evt.relax_passes.training.optimizers import AdamW

needs_compiler = pytest.mark.skipif(arena_runtime.compiler() is None, reason="no C++ compiler")


def _overlap(a, b) -> bool:
    return a[0] <= b[1] and b[0] <= a[1]


@pytest.mark.parametrize("seed", range(4))
def test_packing_never_overlaps_tensors_alive_at_once(seed):
    rng = np.random.default_rng(seed)
    intervals = []
    for _ in range(300):
        first = int(rng.integers(0, 500))
        intervals.append((first, first + int(rng.integers(0, 80)), int(rng.integers(1, 1 << 20))))
    offsets, total = pack(intervals)
    assert all(o % ALIGN == 0 for o in offsets)
    spans = [(o, o + n) for o, (_, _, n) in zip(offsets, intervals)]
    assert max(end for _, end in spans) <= total
    for i in range(len(intervals)):
        for j in range(i):
            if _overlap(intervals[i], intervals[j]):
                assert spans[i][1] <= spans[j][0] or spans[j][1] <= spans[i][0], (i, j)
    # not far above what is alive at once (the bound no packing beats)
    live = max(sum(n for f, l, n in intervals if f <= t <= l) for t in range(600))
    assert live <= total <= 1.5 * live


@tvm.script.ir_module
class TwoDtypes:
    @R.function
    def main(x: R.Tensor((256, 256), "float32")) -> R.Tensor((), "float32"):
        with R.dataflow():
            a = R.exp(x)  # float32, dead once b is made
            b = R.astype(a, "bfloat16")
            c = R.negative(b)  # bfloat16: TVM places none of these in a's float32 storage ...
            d = R.abs(c)
            e = R.astype(d, "float32")  # ... which it keeps for e
            f = R.sum(e)
            R.output(f)
        return f


def _passes(arena: bool) -> list:
    passes = [make() for make in DEFAULT_BUILD]
    at = [p.info.name for p in passes].index(PLANNER) + 1
    return passes[:at] + ([PackMemoryArena()] if arena else [])


def _calls(func, name):
    return [b for block in func.body.blocks for b in block.bindings
            if isinstance(b.value, relax.Call) and name in (getattr(b.value.op, "name", None),
                                                           getattr(b.value.op, "global_symbol", None))]


F32 = 256 * 256 * 4


@needs_compiler
@pytest.mark.parametrize("captured", [False, True], ids=["freed_after_use", "cuda_graph"])
def test_tensors_of_two_dtypes_share_the_arena(captured):
    with tvm.target.Target("llvm"):
        planned = tvm.transform.Sequential(_passes(False))(TwoDtypes)
    # TVM: a float32 storage for a and e, two bfloat16 storages for b, c, d: 8 units of 2 bytes
    assert sum(int(b.value.args[0].values[0]) for b in _calls(planned["main"], "relax.memory.alloc_storage")) \
        == 2 * F32
    lifetimes, offsets, total = plan(planned, planned["main"], captured)
    assert lifetimes.storage_peak() == 2 * F32  # a's storage is kept for e while b, c, d live
    assert total == lifetimes.live_peak() == F32 + F32 // 2  # a + b, then d + e
    with tvm.target.Target("llvm"):
        packed = tvm.transform.Sequential(_passes(True))(TwoDtypes)["main"]
    storages = _calls(packed, "relax.memory.alloc_storage")
    assert len(storages) == 1 and int(storages[0].value.args[0].values[0]) == total
    made = _calls(packed, arena_runtime.FUNCTION)
    assert sorted(int(b.value.args[1].value) for b in made) == sorted(offsets.values())
    assert len(_calls(packed, "relax.memory.alloc_tensor")) == 1  # the arena itself


@needs_compiler
def test_the_arena_computes_what_tvms_plan_computes():
    x = np.random.default_rng(0).standard_normal((256, 256)).astype("float32")
    outs = []
    for arena in (False, True):
        pipeline = tvm.transform.Sequential(_passes(arena) + [make() for make in DEFAULT_BUILD][
            [make().info.name for make in DEFAULT_BUILD].index(PLANNER) + 1:])
        built = tvm.compile(TwoDtypes, target="llvm", relax_pipeline=pipeline)
        outs.append(relax.VirtualMachine(built, tvm.cpu())["main"](tvm.runtime.tensor(x)).numpy())
    assert outs[0] == outs[1]
    bf16 = torch.tensor(np.exp(x)).bfloat16().float().sum().item()
    assert abs(float(outs[1]) - bf16) <= 1e-3 * abs(bf16)


@needs_compiler
def test_a_training_step_in_the_arena_is_bit_for_bit_tvms(monkeypatch):
    def run(arena):
        monkeypatch.setenv(DISABLE_ENV, "" if arena else "arena")  # on by default
        torch.manual_seed(0)
        entry = models.ZOO["bert_layer"](batch=2, seq=8, hidden=32, heads=2)
        step = compile_training(entry.training_module(), entry.example_inputs(), optimizer=AdamW(lr=1e-3),
                                target="llvm", inplace=True)  # no new parameters allocated at the end
        losses = [float(step(*entry.example_inputs())) for _ in range(2)]
        return step, losses

    (tvm_plan, a), (arena, b) = run(False), run(True)
    assert _calls(arena.planned_function, arena_runtime.FUNCTION)  # packed
    assert not _calls(tvm_plan.planned_function, arena_runtime.FUNCTION)
    assert a == b
    for name, value in tvm_plan.parameters().items():
        np.testing.assert_array_equal(value.numpy(), arena.parameters()[name].numpy(), err_msg=name)
    before, after = tvm_plan.memory_report(), arena.memory_report()
    assert after["categories"] == before["categories"]  # the same tensors, placed elsewhere
    assert sum(after["categories"].values()) == after["unplanned_total_bytes"] == before["unplanned_total_bytes"]
    assert after["planned_storage_bytes"] < before["planned_storage_bytes"]
    assert after["planned_peak_bytes"] < before["planned_peak_bytes"]


@pytest.mark.gpu
@needs_compiler
@pytest.mark.parametrize("cuda_graph", [True, False], ids=["cuda_graph", "no_graph"])
def test_gpu_step_in_the_arena_matches_and_holds_less(monkeypatch, cuda_graph):
    """On CUDA every kind of kernel (CUTLASS epilogues, flash attention, TVM's) reads and writes
    tensors placed in the arena: the step computes what it computes in TVM's plan, in less memory."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")

    def run(arena):
        monkeypatch.setenv(DISABLE_ENV, "" if arena else "arena")  # on by default
        torch.manual_seed(0)
        entry = models.ZOO["bert_layer"](batch=8, seq=128, hidden=256, heads=4)
        inputs = [t.cuda() for t in entry.example_inputs()]
        step = compile_training(entry.training_module(), entry.example_inputs(), optimizer=AdamW(lr=1e-3),
                                target="cuda", precision="bf16", cuda_graph=cuda_graph)
        report = step.memory_report(*inputs)  # runs the first step
        losses = [float(step(*inputs)) for _ in range(3)]
        return step, report, losses

    (plain, before, a), (packed, after, b) = run(False), run(True)
    np.testing.assert_allclose(a, b, rtol=1e-5)
    for name, value in plain.parameters().items():
        np.testing.assert_allclose(value.float().cpu().numpy(), packed.parameters()[name].float().cpu().numpy(),
                                   rtol=1e-3, atol=1e-5, err_msg=name)
    # Under CUDA graphs every storage is held for the whole step, and the arena (the most bytes alive
    # at once) is smaller than their sum.  Kernel by kernel, TVM frees each storage after its last
    # use, and for this layer that peak (25.1 MB planned) is not above the arena's, which lives from
    # the first planned tensor to the last: the pass leaves the plan as TVM made it.
    assert bool(_calls(packed.planned_function, arena_runtime.FUNCTION)) == cuda_graph
    if cuda_graph:
        assert after["planned_peak_bytes"] < before["planned_peak_bytes"]
        assert after["measured_peak_bytes"] < before["measured_peak_bytes"]
    else:
        assert after["planned_peak_bytes"] == before["planned_peak_bytes"]

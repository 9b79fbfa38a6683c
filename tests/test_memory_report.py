"""The memory report of a compiled step (tvm_evt.memory): its categories add up to the plan's
buffers, the parameters and optimizer state are their tensors' bytes exactly, an MLP saves what a
hand count says, and the activations grow with the batch while the parameters do not."""
import numpy as np
import pytest
import torch
import tvm
from tvm import relax

from tvm_evt import compile_training, models, pipeline
from tvm_evt.memory import ALLOC_TENSOR, BUILTIN_ALLOC, memory_plan
from tvm_evt.relax_passes.training.optimizers import SGD, AdamW
from tvm_evt.training import runtime_module

BATCH, IN, HIDDEN, OUT = 2, 8, 16, 4
F32 = 4


def _mlp(batch=BATCH, optimizer=None, inplace=False):
    torch.manual_seed(0)
    entry = models.ZOO["mlp"](batch=batch, in_features=IN, hidden=HIDDEN, out_features=OUT, layers=1, dropout=0.0)
    step = compile_training(entry.training_module(), entry.example_inputs(), optimizer=optimizer, target="llvm",
                            inplace=inplace)
    return step, entry


def _param_bytes(step) -> int:
    return sum(p.numel() * p.element_size() for n, p in step.parameters().items() if n in step.imported.param_names)


def _nbytes(ty) -> int:
    return int(np.prod([int(d) for d in ty.shape.values], dtype=np.int64)) * tvm.runtime.DataType(ty.dtype).itemsize


@pytest.fixture(scope="module")
def adamw_mlp():
    step, entry = _mlp(optimizer=AdamW(lr=1e-3))
    return step, entry, step.memory_report()


def test_categories_add_up_to_the_plans_buffers(adamw_mlp):
    step, _, report = adamw_mlp
    func = memory_plan(runtime_module(step.graph.mod), step.target)
    allocated = []  # counted here from the planned function itself
    for block in func.body.blocks:
        for b in block.bindings:
            if isinstance(b.value, relax.Call) and isinstance(b.value.op, tvm.ir.Op) \
                    and b.value.op.name in (ALLOC_TENSOR, BUILTIN_ALLOC):
                allocated.append(_nbytes(b.var.ty))
    arguments = sum(_nbytes(p.ty) for p in func.params)
    assert sum(report["categories"].values()) == arguments + sum(allocated) == report["unplanned_total_bytes"]
    # reuse: the storages hold less than the tensors placed in them
    assert 0 < report["planned_storage_bytes"] < sum(allocated)
    assert max(p["live_bytes"] for p in report["timeline"]) == report["planned_peak_bytes"]
    assert report["planned_peak_bytes"] < report["unplanned_total_bytes"]
    assert report["measured_peak_bytes"] is None  # the CPU: TVM reports no memory use


def test_parameters_gradients_and_adamw_state_are_exact(adamw_mlp):
    step, _, report = adamw_mlp
    cats = report["categories"]
    params = _param_bytes(step)
    assert params == F32 * (HIDDEN * IN + HIDDEN + OUT * HIDDEN + OUT)
    assert cats["parameters"] == params
    assert cats["gradients"] == params  # fp32: one gradient per parameter, as the update reads them
    assert cats["optimizer_state"] == 2 * params  # exp_avg, exp_avg_sq
    assert cats["inputs"] == F32 * (BATCH * IN + BATCH * OUT)  # x and the regression target
    # not in place: the new parameters, both slots, the loss and the step count are allocated
    assert cats["step_outputs"] == 3 * params + F32 + F32


def test_sgd_without_momentum_keeps_no_state_and_an_inplace_step_allocates_no_new_parameters():
    step, _ = _mlp(optimizer=SGD(lr=1e-3), inplace=True)
    cats = step.memory_report()["categories"]
    assert cats["optimizer_state"] == 0
    assert cats["parameters"] == _param_bytes(step)
    # the update writes over the parameters and the step count is written back: only the loss is new
    assert cats["step_outputs"] == F32


def test_a_single_parameter_is_told_from_the_forward_call_that_reads_it():
    """Linear(8, 4, bias=False): the forward's first call reads the one parameter too, but only the
    update reads it with its gradient and the new step count."""
    torch.manual_seed(0)
    model = torch.nn.Linear(IN, OUT, bias=False)
    inputs = (torch.randn(BATCH, IN), torch.randn(BATCH, OUT))
    step = compile_training(model, inputs, loss_fn=torch.nn.functional.mse_loss, target="llvm")
    report = step.memory_report()
    assert report["categories"]["gradients"] == report["categories"]["parameters"] == F32 * IN * OUT
    assert [p["op"] for p in report["timeline"] if p["phase"] == "update"] == ["optimizer_update"]
    assert not any("no optimizer update" in note for note in report["notes"])


def test_a_deep_models_update_calls_each_read_their_gradients():
    """70 parameters: the update is one call a repeat of layers (``optimizer_update.kernel_groups``);
    every gradient is still told by the update call that reads it."""
    from tvm_evt.relax_passes.training import optimizer_update

    torch.manual_seed(0)
    entry = models.ZOO["mlp"](batch=BATCH, in_features=IN, hidden=IN, out_features=OUT, layers=34, dropout=0.0)
    step = compile_training(entry.training_module(), entry.example_inputs(), optimizer=AdamW(lr=1e-3), target="llvm")
    report = step.memory_report()
    params = _param_bytes(step)
    assert len(step.imported.param_names) > optimizer_update.MAX_KERNEL_PARAMS
    assert report["categories"]["gradients"] == params and report["categories"]["optimizer_state"] == 2 * params
    update = [p["op"] for p in report["timeline"] if p["phase"] == "update"]
    assert len(update) > 1 and all(op.startswith("optimizer_update") for op in update)


def test_mlp_saves_what_a_hand_count_says(adamw_mlp):
    """Linear(8, 16) -> GELU -> Linear(16, 4) -> MSE: live across the loss are the GELU's output (the
    second linear's input, for its weight gradient), the GELU's derivative (the graph passes compute it
    in the forward, where the GELU's input is) and the loss's gradient (EliminateLoss writes it next to
    the loss).  The first linear's input is the step's argument x: an input, not an allocation."""
    _, _, report = adamw_mlp
    saved = report["saved_activations"]
    ops = sorted((s["shape"], s["op"]) for s in saved)
    assert [s for s, _ in ops] == [[BATCH, OUT], [BATCH, HIDDEN], [BATCH, HIDDEN]]
    assert "gelu" in [op for _, op in ops]
    assert report["categories"]["saved_activations"] == F32 * (2 * BATCH * HIDDEN + BATCH * OUT)
    assert sum(s["bytes"] for s in saved) == report["categories"]["saved_activations"]


def test_doubled_batch_doubles_activations_and_keeps_parameters(adamw_mlp):
    _, _, small = adamw_mlp
    step, _ = _mlp(batch=2 * BATCH, optimizer=AdamW(lr=1e-3))
    big = step.memory_report()
    s, b = small["categories"], big["categories"]
    assert b["saved_activations"] == 2 * s["saved_activations"]
    assert b["inputs"] == 2 * s["inputs"]
    for name in ("parameters", "gradients", "optimizer_state"):
        assert b[name] == s[name]
    assert big["planned_peak_bytes"] > small["planned_peak_bytes"]


def test_timeline_marks_forward_backward_and_update(adamw_mlp):
    _, _, report = adamw_mlp
    phases = [p["phase"] for p in report["timeline"]]
    assert phases[0] == "forward" and phases[-1] == "update"
    first_backward = phases.index("backward")
    assert set(phases[:first_backward]) == {"forward"} and "forward" not in phases[first_backward:]
    loss_kernel = report["timeline"][first_backward - 1]["op"]
    assert loss_kernel == "mean"  # MSE's mean writes the loss: the forward ends with it
    update = [p for p in report["timeline"] if p["phase"] == "update"]
    assert [p["op"] for p in update] == ["optimizer_update"]


@pytest.mark.parametrize("regenerate", [False, True])
def test_bert_layer_with_dropout_reports_its_masks_as_saved_unless_regenerated(regenerate, monkeypatch):
    """Kept dropout masks are saved activations of a byte an element; RegenerateInBackward (on by
    default) generates them again in the backward, and then none is saved."""
    monkeypatch.setenv(pipeline.ENABLE_ENV if regenerate else pipeline.DISABLE_ENV, "regenerate")
    torch.manual_seed(0)
    entry = models.ZOO["bert_layer"](batch=2, seq=8, hidden=32, heads=2)
    step = compile_training(entry.training_module(), entry.example_inputs(), optimizer=SGD(lr=1e-3), target="llvm")
    report = step.memory_report()
    cats = report["categories"]
    assert cats["parameters"] == _param_bytes(step) == cats["gradients"]
    assert cats["buffers"] == 8  # the dropout RNG state: (seed, counter) as uint32
    masks = [s for s in report["saved_activations"] if s["dtype"] == "bool"]
    if regenerate:
        assert masks == []
    else:
        assert masks and all(s["bytes"] == int(np.prod(s["shape"])) for s in masks)
    assert sum(cats.values()) == report["unplanned_total_bytes"]


def test_memory_report_png(adamw_mlp, tmp_path):
    pytest.importorskip("matplotlib")
    step, _, _ = adamw_mlp
    path = step.memory_report_png(str(tmp_path / "memory.png"))
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_the_report_reads_the_plan_the_build_made(adamw_mlp, monkeypatch):
    import tvm_evt.memory

    step, _, report = adamw_mlp
    assert step.planned_function is not None
    monkeypatch.setattr(tvm_evt.memory, "memory_plan", lambda *a: pytest.fail("the build's passes ran again"))
    again = step.memory_report()
    assert again["planned_peak_bytes"] == report["planned_peak_bytes"]
    assert again["categories"] == report["categories"]
    # and it is the plan memory_plan makes from the module
    assert tvm_evt.memory.memory_report(memory_plan(runtime_module(step.graph.mod), step.target),
                                        step.layout)["planned_peak_bytes"] == report["planned_peak_bytes"]


def test_a_step_built_as_cuda_graphs_keeps_every_storage(adamw_mlp):
    """RewriteCUDAGraph allocates the plan's storages once, before the step: the timeline counts them
    all at every point, not from allocation to last read."""
    from tvm_evt.memory import memory_report

    step, _, freed = adamw_mlp
    kept = memory_report(step.planned_function, step.layout, storages_kept=True)
    assert {p["storage_bytes"] for p in kept["timeline"]} == {kept["planned_storage_bytes"]}
    assert min(p["storage_bytes"] for p in freed["timeline"]) < kept["planned_storage_bytes"]
    assert kept["planned_peak_bytes"] >= freed["planned_peak_bytes"]
    assert kept["categories"] == freed["categories"]

"""Weight copies (``AppendOptimizer(weight_copies=True)``, on by default: ``TVM_EVT_DISABLE=weight_copies``):
a float32 weight a bf16/fp16 step casts for its GEMMs is an argument of the step in that dtype,
written by the optimizer update, and the step computes bit for bit what it computes casting."""
import copy

import numpy as np
import pytest
import torch
import tvm
from tvm import relax

import tvm_evt
from tvm_evt import models, optim, pipeline
from tvm_evt.frontend import from_torch
from tvm_evt.relax_passes.training.append_optimizer import ASTYPE, _moved_from
from tvm_evt.training import build_training_module


class _Net(torch.nn.Module):
    """Two linear layers (their weights cast for the GEMMs), a layer norm (weights read in float32)
    and dropout (a step that advances its seed: the copies come before the next seed)."""

    def __init__(self, dropout: float):
        super().__init__()
        self.fc1, self.norm, self.fc2 = torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 8)
        self.drop = torch.nn.Dropout(dropout)

    def forward(self, x, t):
        return torch.nn.functional.mse_loss(self.fc2(self.drop(torch.relu(self.norm(self.fc1(x))))), t)


def _inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(4, 16, generator=g), torch.randn(4, 8, generator=g)]


def _graph(precision="bf16", copies=True, dropout=0.0):
    torch.manual_seed(0)
    imported = from_torch(_Net(dropout), _inputs(), None)
    return imported, build_training_module(imported, optim.AdamW(lr=1e-2), precision, weight_copies=copies)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_the_step_reads_its_weights_copies_instead_of_casting_them(precision):
    low = {"bf16": "bfloat16", "fp16": "float16"}[precision]
    imported, graph = _graph(precision)
    names = imported.param_names
    copied = [names[i] for i, _ in graph.layout.copies]
    assert {"fc1.weight", "fc2.weight"} <= set(copied) and not any(n.startswith("norm") for n in copied)
    assert {d for _, d in graph.layout.copies} == {low}
    step = graph.mod["train_step"]
    assert [p.name for p in step.params if str(p.ty.dtype) == low] == [f"{low}.{n.replace('.', '_')}" for n in copied]
    # the casts the step made of those parameters (the plain step's) are gone
    _, plain = _graph(precision, copies=False)

    def cast_params(func):  # the parameters func casts, directly or after a transpose or reshape
        lay = graph.layout
        params = set(func.params[lay.num_inputs:lay.num_inputs + lay.num_params])
        values = {b.var: b.value for block in func.body.blocks for b in block.bindings}
        found = []

        def visit(e):
            if isinstance(e, relax.Call) and e.op == ASTYPE and isinstance(e.args[0], relax.Var):
                source, _ = _moved_from(e.args[0], values.get)
                if source in params:
                    found.append(source.name)

        relax.analysis.post_order_visit(func.body, visit)
        return sorted(found)

    assert cast_params(plain.mod["train_step"]) and not cast_params(step)
    n = len(copied)
    assert len(plain.mod["train_step"].params) == len(step.params) - n
    # the new copies are results, in the copies' dtype, after the step counter (and the loss scaler)
    fields = step.ret_ty.fields
    assert [str(f.dtype) for f in fields[len(fields) - n:]] == [low] * n
    assert len(plain.mod["train_step"].ret_ty.fields) == len(fields) - n


@pytest.mark.parametrize("precision,inplace", [("bf16", False), ("bf16", True), ("fp16", False)])
@pytest.mark.parametrize("dropout", [0.0, 0.25])
def test_steps_with_copies_train_bit_for_bit_as_casting(precision, inplace, dropout, monkeypatch):
    """Three steps (llvm): every loss and parameter equal bit for bit with and without copies (fp16:
    with its dynamic loss scaler, which keeps the old copies with the old parameters on an overflow)."""
    torch.manual_seed(0)
    model = _Net(dropout)

    def trained(on: bool):
        monkeypatch.setenv(pipeline.DISABLE_ENV, "" if on else "weight_copies")
        step = tvm_evt.compile_training(copy.deepcopy(model), _inputs(), precision=precision, target="llvm",
                                        inplace=inplace, optimizer=optim.AdamW(lr=1e-2))
        assert bool(step.layout.copies) == on
        losses = [float(step(*_inputs(k))) for k in range(3)]
        return losses, {n: p.clone() for n, p in step.parameters().items()}

    (losses, params), (want_losses, want_params) = trained(True), trained(False)
    assert losses == want_losses
    for name, value in want_params.items():
        assert torch.equal(params[name], value), name


def test_loaded_parameters_make_their_copies_again():
    """After load_parameters, a step reads the loaded weights (their copies made again): its loss
    equals that of a step compiled from the loaded model."""
    torch.manual_seed(0)
    model, other = _Net(0.0), _Net(0.0)
    step = tvm_evt.compile_training(copy.deepcopy(model), _inputs(), precision="bf16", target="llvm")
    assert step.layout.copies
    step(*_inputs())
    step.load_parameters(other.state_dict())
    fresh = tvm_evt.compile_training(copy.deepcopy(other), _inputs(), precision="bf16", target="llvm")
    assert float(step(*_inputs(1))) == float(fresh(*_inputs(1)))


def test_llama_with_copies_equals_llama_casting(monkeypatch):
    """transformers' LlamaForCausalLM (its projections and untied head copied, the embedding and
    norms not): two bf16 steps equal bit for bit with and without copies."""
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    entry = models.hf_llama_lm(batch=2, seq=16, layers=2, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=100)

    def trained(on: bool):
        monkeypatch.setenv(pipeline.DISABLE_ENV, "" if on else "weight_copies")
        step = tvm_evt.compile_training(copy.deepcopy(entry.model), entry.example_inputs(), loss_fn=entry.loss_fn,
                                        precision="bf16", target="llvm")
        copied = {step.imported.param_names[i] for i, _ in step.layout.copies}
        torch.manual_seed(1)
        losses = [float(step(*entry.example_inputs())) for _ in range(2)]
        return copied, losses, {n: p.clone() for n, p in step.parameters().items()}

    copied, losses, params = trained(True)
    assert len(copied) == 2 * 7 + 1 and "model.lm_head.weight" in copied
    assert not any("norm" in n or "embed" in n for n in copied)
    _, want_losses, want_params = trained(False)
    assert losses == want_losses
    for name, value in want_params.items():
        assert torch.equal(params[name], value), name


def test_memory_report_counts_the_copies_as_parameters():
    torch.manual_seed(0)
    step = tvm_evt.compile_training(_Net(0.0), _inputs(), precision="bf16", target="llvm")
    report = step.memory_report()
    params = sum(p.numel() * 4 for n, p in step.parameters().items() if n in step.imported.param_names)
    values = step.parameters()
    names = step.imported.param_names
    copies = sum(values[names[i]].numel() * 2 for i, _ in step.layout.copies)
    assert copies >= (32 * 16 + 8 * 32) * 2  # the two weights at least
    assert report["categories"]["parameters"] == params + copies

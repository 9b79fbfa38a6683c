"""GPU tier: compiled training steps on CUDA through the evt pipeline (skipped without CUDA)."""

from __future__ import annotations

import copy

import pytest
import torch

import tvm_evt
from tvm_evt import models, pipeline

from _torch_ref import grad_err, no_dropout, rel_err

pytestmark = pytest.mark.gpu


def _torch_bf16(entry, inputs):
    module = copy.deepcopy(entry.training_module()).cuda().train()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = module(*[t.cuda() for t in inputs])
    loss.float().backward()
    model = module.model if hasattr(module, "loss_fn") else module
    return loss.float().cpu(), {n: p.grad.float().cpu() for n, p in model.named_parameters()}


SMALL = {  # vit: 17 tokens, so with pad_keys on attention runs over 32 keys (PadAttentionKeys)
    "bert_layer": dict(batch=4, seq=64, hidden=128, heads=4),
    "vit": dict(batch=8, image=32, patch=8, hidden=128, heads=4),
    "resnet_basic": dict(batch=8, in_channels=32, channels=32, size=8),
}
CASES = [  # (model, switch of pipeline.OPTIONAL): the defaults, all off, and each opt-in where it acts
    ("bert_layer", "default"), ("bert_layer", "disable=all"), ("resnet_basic", "default"),
    ("resnet_basic", "enable=nhwc"),
    ("vit", "enable=pad_keys"),  # without it, the 17-key attention GEMMs are left to TVM (misaligned)
]


@pytest.mark.parametrize("name,switch", CASES)
def test_bf16_step_on_cuda_runs_every_matmul_in_evt(name, switch, monkeypatch):
    monkeypatch.delenv(pipeline.DISABLE_ENV, raising=False)
    monkeypatch.delenv(pipeline.ENABLE_ENV, raising=False)
    if switch != "default":
        how, names = switch.split("=")
        monkeypatch.setenv(pipeline.DISABLE_ENV if how == "disable" else pipeline.ENABLE_ENV, names)
    entry = models.ZOO[name](**SMALL[name])
    no_dropout(entry.model)
    step = tvm_evt.compile_training(
        copy.deepcopy(entry.model), entry.example_inputs(), loss_fn=entry.loss_fn,
        precision="bf16",
    )
    assert step.target.kind.name == "cuda"
    report = step.report()
    assert report["unfused_matmuls"] == [], report["unfused_matmuls"]
    assert any("relax.matmul" in p["ops"] for p in report["partitions"])
    inputs = entry.example_inputs()
    loss, grads = step.loss_and_grads(*[t.cuda() for t in inputs])
    ref_loss, ref_grads = _torch_bf16(entry, inputs)
    assert rel_err(loss.cpu(), ref_loss) <= 2e-2, (float(loss), float(ref_loss))
    names = sorted(ref_grads)
    flat = lambda gs: torch.cat([gs[n].cpu().flatten().double() for n in names])
    largest = max(float(g.norm()) for g in ref_grads.values())
    errs = {n: grad_err(grads[n].cpu(), ref_grads[n], 100 * largest) for n in names}
    worst = sorted(errs.items(), key=lambda kv: -kv[1])[:5]
    assert rel_err(flat(grads), flat(ref_grads)) <= 2e-2, worst
    assert worst[0][1] <= 5e-2, worst
    # and a full update step runs
    before = step.parameters()[names[0]].clone()
    step(*[t.cuda() for t in entry.example_inputs()])
    assert not torch.equal(before, step.parameters()[names[0]])

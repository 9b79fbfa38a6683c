"""GPU tier: what the CPU tier checks only on llvm, on CUDA in bf16 against torch in fp32 -- the
normalisations and resampling of ``test_cnn_layers`` (group and instance norm, batch norm without
running statistics, ``F.interpolate`` nearest and bilinear, grouped and dilated convolutions) and
``max_grad_norm`` clipping inside the step (skipped without CUDA).

Run it without xdist workers, as the other GPU tiers: each compile builds its CUTLASS kernels on
every core."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import tvm_evt
from tvm_evt import models

from _torch_ref import assert_bf16_step_close, no_dropout, rel_err
from test_cnn_layers import MODELS

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU", allow_module_level=True)

LAYERS = ("group_norm", "group_norm_no_affine", "instance_norm", "batch_norm_no_running_stats", "fpn_upsample",
          "resnext_grouped", "dilated")


def _entry(name: str, batch: int = 8, size: int = 32) -> models.ZooEntry:
    torch.manual_seed(0)
    model = MODELS[name]()
    cin = 3 if name == "fpn_upsample" else model[0].conv1.in_channels
    x = torch.randn(batch, cin, size - 1 if name == "fpn_upsample" else size, size)  # odd: bilinear x1.5 rounds
    y = torch.randint(0, 10, (batch,))
    return models.ZooEntry(model, lambda: (x, y), F.cross_entropy, name, num_targets=1)


@pytest.mark.parametrize("name", LAYERS)
def test_cnn_layer_bf16_step(name):
    entry = _entry(name)
    step = tvm_evt.compile_training(copy.deepcopy(entry.model), entry.example_inputs(), loss_fn=entry.loss_fn,
                                    precision="bf16")
    assert step.target.kind.name == "cuda"
    assert_bf16_step_close(step, entry, entry.example_inputs())


def test_max_grad_norm_clips_on_the_gpu():
    """SGD with ``max_grad_norm`` far under the gradient's norm: the update is the clipped one (an
    unclipped update would be 1 / coefficient times larger), as torch's clip_grad_norm_ + SGD make it."""
    entry = models.ZOO["mlp"]()
    no_dropout(entry.model)
    model = copy.deepcopy(entry.model)
    lr, clip = 0.05, 0.05
    step = tvm_evt.compile_training(copy.deepcopy(model), entry.example_inputs(), loss_fn=entry.loss_fn,
                                    optimizer=tvm_evt.optim.SGD(lr=lr, max_grad_norm=clip), precision="bf16")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    batch = entry.example_inputs()
    ref = copy.deepcopy(entry.training_module())  # (the same weights as `model`)
    ref_model = ref.model if hasattr(ref, "loss_fn") else ref
    ref(*batch).backward()
    norm = float(torch.nn.utils.clip_grad_norm_(ref_model.parameters(), clip))
    assert norm > 10 * clip  # the clipping matters
    torch.optim.SGD(ref_model.parameters(), lr=lr).step()
    step(*[t.cuda() for t in batch])
    got = step.parameters()
    for n, p in ref_model.named_parameters():
        want = p.detach() - before[n]
        assert rel_err((got[n].cpu().double() - before[n].double()), want.double()) <= 5e-2, n

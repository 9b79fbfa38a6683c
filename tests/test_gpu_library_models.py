"""GPU tier: models as transformers and timm build them (random weights, no downloads) train in
bf16 on CUDA as torch computes them in fp32, every GEMM on CUTLASS and every attention on the
flash-attention kernels (skipped without CUDA; timm only where it is installed).

Run it without xdist workers (or `-n 1`): each compile builds ~20 CUTLASS kernels on every core, and
four at once left an H200 host with no case finished in 530 s (docs/bench/h200-2026-11-28b)."""

from __future__ import annotations

import copy

import pytest
import torch

import tvm_evt
from tvm_evt import models

from _passes import affine_free_layer_norms
from _torch_ref import assert_bf16_step_close

pytestmark = pytest.mark.gpu
transformers = pytest.importorskip("transformers")

# Small models of the libraries' own classes. Vocabularies and class counts are left unaligned on
# purpose (1001, 50257, 100): their GEMMs' extents are not a multiple of 16 bytes.
CASES = {
    "bert_mlm": lambda: models.hf_bert_mlm(batch=4, seq=64, layers=2, hidden=256, heads=4, vocab=1001, dropout=0.0),
    "gpt2_lm": lambda: models.hf_gpt2_lm(batch=2, seq=128, layers=2, hidden=256, heads=4, vocab=50257, dropout=0.0),
    # grouped-query attention (4 query heads over 2 key/value heads) at every head dimension the
    # flash-attention kernels take
    **{f"llama_lm_d{d}": (lambda d=d: models.hf_llama_lm(batch=2, seq=96, layers=2, hidden=4 * d, heads=4,
                                                          kv_heads=2, ffn=256, vocab=1000))
       for d in (32, 64, 80, 96, 128)},
    # 17 tokens (16 patches and the class token), 100 classes
    "timm_vit": lambda: models.timm_model("vit_tiny_patch16_224", batch=8, image=32, classes=100, img_size=32,
                                          patch_size=8, depth=2),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_library_model_bf16_step(name):
    if name.startswith("timm"):
        pytest.importorskip("timm")
    torch.manual_seed(0)
    entry = CASES[name]()
    step = tvm_evt.compile_training(copy.deepcopy(entry.model), entry.example_inputs(), loss_fn=entry.loss_fn,
                                    precision="bf16")
    assert step.target.kind.name == "cuda"
    report = step.report()
    assert report["unfused_matmuls"] == [], report["unfused_matmuls"]
    assert report["attention"] and all(a["kernel"] for a in report["attention"]), report["attention"]
    assert_bf16_step_close(step, entry, entry.example_inputs())
    before = {n: v.clone() for n, v in step.parameters().items()}
    step(*[t.cuda() for t in entry.example_inputs()])
    assert any(not torch.equal(before[n], v) for n, v in step.parameters().items())


# Enough tokens for FoldNormAffine (every weight a layer norm feeds no larger than its [tokens, H]
# output): the bf16 step with the layer norms' scale and shift in the weights, against torch fp32
# (H200: both passed, docs/bench/h200-2026-11-30b/gpu_folded.txt)
FOLDED = {
    "gpt2_lm": lambda: models.hf_gpt2_lm(batch=8, seq=128, layers=2, hidden=128, heads=2, vocab=50257, dropout=0.0),
    "timm_vit": lambda: models.timm_model("vit_tiny_patch16_224", batch=64, image=32, classes=100, img_size=32,
                                          patch_size=8, depth=2),
}


@pytest.mark.parametrize("name", sorted(FOLDED))
def test_folded_layer_norms_bf16_step(name, monkeypatch):
    monkeypatch.setenv("TVM_EVT_ENABLE", "fold_norm")  # pipeline.OPTIONAL: opt-in
    if name.startswith("timm"):
        pytest.importorskip("timm")
    torch.manual_seed(0)
    entry = FOLDED[name]()
    step = tvm_evt.compile_training(copy.deepcopy(entry.model), entry.example_inputs(), loss_fn=entry.loss_fn,
                                    precision="bf16")
    assert affine_free_layer_norms(step.graph.mod["main"]) >= 3, "FoldNormAffine did not apply"
    assert_bf16_step_close(step, entry, entry.example_inputs())


def test_rms_norm_op_bf16_step():
    """Llama with its RMS norms as relax.nn.rms_norm (RecognizeRMSNorm, on by default) and their input
    gradients as FuseLayerNormBackward's row kernels: the bf16 step against torch fp32."""
    torch.manual_seed(0)
    entry = models.hf_llama_lm(batch=2, seq=96, layers=2, hidden=256, heads=4, kv_heads=2, ffn=256, vocab=1000)
    step = tvm_evt.compile_training(copy.deepcopy(entry.model), entry.example_inputs(), loss_fn=entry.loss_fn,
                                    precision="bf16")
    assert step.graph.mod["main"].script().count("R.nn.rms_norm") == 5, "RecognizeRMSNorm did not apply"
    assert_bf16_step_close(step, entry, entry.example_inputs())


# Convolutional networks as torchvision and timm build them, small images: a 7x7/2 stem on 3
# channels, strided 1x1 downsamples, depthwise 3x3 and 5x5 (EfficientNet), squeeze-excitation
CNN_CASES = {
    "tv_resnet18": ("torchvision", lambda: models.torchvision_model("resnet18", batch=8, image=64, classes=100)),
    "tv_mobilenet_v2": ("torchvision", lambda: models.torchvision_model("mobilenet_v2", batch=8, image=64,
                                                                        classes=100)),
    "timm_efficientnet_b0": ("timm", lambda: models.timm_model("efficientnet_b0", batch=8, image=64, classes=100)),
    # hardswish, hard-sigmoid squeeze-excitation, depthwise 3x3 and 5x5 at stride 1 and 2
    "tv_mobilenet_v3_small": ("torchvision", lambda: models.torchvision_model("mobilenet_v3_small", batch=8, image=64,
                                                                              classes=100)),
}


@pytest.mark.parametrize("name", sorted(CNN_CASES))
def test_library_cnn_bf16_step(name):
    library, make = CNN_CASES[name]
    pytest.importorskip(library)
    torch.manual_seed(0)
    entry = make()
    step = tvm_evt.compile_training(copy.deepcopy(entry.model), entry.example_inputs(), loss_fn=entry.loss_fn,
                                    precision="bf16")
    report = step.report()
    assert report["unfused_matmuls"] == [], report["unfused_matmuls"]
    depthwise = [c for c in report["convolutions"] if c.get("kind") == "depthwise"]
    assert all(c["kernel"] for c in depthwise) and (depthwise or name == "tv_resnet18"), report["convolutions"]
    assert_bf16_step_close(step, entry, entry.example_inputs())


@pytest.mark.parametrize("batch", [4, 32])
def test_resnet18_bf16_gradients_within_autocast_error(batch):
    """torchvision's ResNet-18 at 32x32 (the shape its bf16 gradients were once 1.14x the largest
    gradient's norm off): our bf16 step's gradients against fp32, next to torch's own autocast step
    on the same weights and batch; both errors go to $OUT/resnet18_bf16_b{batch}.json when OUT is set."""
    pytest.importorskip("torchvision")
    import json
    import os

    torch.manual_seed(0)
    entry = models.torchvision_model("resnet18", batch=batch, image=32, classes=100)
    step = tvm_evt.compile_training(copy.deepcopy(entry.model), entry.example_inputs(), loss_fn=entry.loss_fn,
                                    precision="bf16")
    ours, autocast = assert_bf16_step_close(step, entry, entry.example_inputs())
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], f"resnet18_bf16_b{batch}.json"), "w") as f:
            json.dump({"batch": batch, "image": 32, "tvm_evt_vs_fp32": ours, "autocast_vs_fp32": autocast}, f)

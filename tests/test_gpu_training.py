"""GPU tier: compiled training steps on CUDA through the evt pipeline (skipped without CUDA)."""

from __future__ import annotations

import copy
import re

import pytest
import torch

import tvm_evt
from tvm_evt import models, pipeline

from _torch_ref import assert_bf16_step_close, no_dropout, rel_err

pytestmark = pytest.mark.gpu


SMALL = {  # vit: 17 tokens, so attention runs over 32 keys (PadAttentionKeys, on by default)
    "bert_layer": dict(batch=4, seq=64, hidden=128, heads=4),
    "bert_layer_d64": dict(batch=4, seq=80, hidden=256, heads=4),  # flash attention's head dimension
    "gpt2_block_d64": dict(batch=2, seq=96, hidden=256, heads=4),
    "gpt2_block_d128": dict(batch=2, seq=96, hidden=256, heads=2),  # flash attention's two-panel head
    "bert_layer_d80": dict(batch=4, seq=80, hidden=320, heads=4),  # D = 80: a partly padded panel
    "vit": dict(batch=8, image=32, patch=8, hidden=128, heads=4),
    "resnet_basic": dict(batch=8, in_channels=32, channels=32, size=8),
    "resnet_basic_cl": dict(batch=8, in_channels=32, channels=32, size=8),  # channels-last inputs
    # stride 2: the 3x3 convolution's input gradient runs as four unit-stride dgrads (stride phases)
    "resnet_basic_s2_cl": dict(batch=8, in_channels=32, channels=32, size=8, stride=2),
    # conv1d outputs of 63, 61 and 57 positions into 4 adaptive max-pool windows
    "xml_cnn": dict(batch=8, seq=64, vocab=500, embed=64, filters=16, pool_chunks=4, bottleneck=64, labels=128),
    # every GEMM unaligned (K = 147, N = 100, N = 10 and their gradients): PadUnalignedMatmuls
    "mlp": dict(batch=256, in_features=147, hidden=100, out_features=10),
}
CASES = [  # (model, switch of pipeline.OPTIONAL): the defaults, all off, and each opt-in where it acts
    ("bert_layer", "default"), ("bert_layer", "disable=all"), ("resnet_basic", "default"),
    ("resnet_basic", "disable=nhwc"),
    ("vit", "default"),  # without pad_keys the 17-key attention GEMMs are left to TVM (misaligned)
    ("bert_layer_d64", "default"), ("gpt2_block_d64", "default"),  # flash attention (head dim 64)
    ("gpt2_block_d128", "default"), ("bert_layer_d80", "default"),  # and head dims 128, 80
    ("gpt2_block_d64", "disable=split_projection"), ("resnet_basic_cl", "default"),
    ("resnet_basic_cl", "disable=implicit_conv"),  # 3x3 convolutions as im2col + GEMM
    ("resnet_basic_s2_cl", "default"),
    ("xml_cnn", "default"),
    ("mlp", "default"),  # with pad_matmuls off its 8 GEMMs are left to TVM (misaligned)
    # the loss and the last layer norm's dgamma and dbeta as separate reductions (one column_sums kernel by default)
    ("bert_layer", "disable=column_sums"), ("vit", "disable=column_sums"),
    # a layer norm gradient's dy * gamma stored by a GEMM epilogue (left to its row kernel by default)
    ("bert_layer", "disable=partition_row_kernels"), ("vit", "disable=partition_row_kernels"),
    ("gpt2_block_d64", "disable=partition_row_kernels"),
]


@pytest.mark.parametrize("name,switch", CASES)
def test_bf16_step_on_cuda_runs_every_matmul_in_evt(name, switch, monkeypatch):
    monkeypatch.delenv(pipeline.DISABLE_ENV, raising=False)
    monkeypatch.delenv(pipeline.ENABLE_ENV, raising=False)
    if switch != "default":
        how, names = switch.split("=")
        monkeypatch.setenv(pipeline.DISABLE_ENV if how == "disable" else pipeline.ENABLE_ENV, names)
    entry = models.ZOO[re.sub(r"(_d\d+|_s2|_cl)+$", "", name)](**SMALL[name])
    no_dropout(entry.model)
    example_inputs = entry.example_inputs
    if name.endswith("_cl"):  # the step takes the image and target as NHWC, in place
        example_inputs = lambda: [t.contiguous(memory_format=torch.channels_last) if t.dim() == 4 else t
                                  for t in entry.example_inputs()]
    step = tvm_evt.compile_training(
        copy.deepcopy(entry.model), example_inputs(), loss_fn=entry.loss_fn,
        precision="bf16",
    )
    assert step.target.kind.name == "cuda"
    report = step.report()
    assert report["unfused_matmuls"] == [], report["unfused_matmuls"]
    # GEMMs run as evt partitions, or (implicit_conv) as implicit-GEMM convolution kernels
    assert any("relax.matmul" in p["ops"] for p in report["partitions"]) \
        or any(c["kernel"] for c in report["convolutions"]), report
    if name.startswith("resnet") and switch == "default":
        assert report["convolutions"] and all(c["kernel"] for c in report["convolutions"]), report["convolutions"]
    if re.search(r"_d\d+$", name):  # the attention core is one op, and the kernels take it
        assert [a["op"] for a in report["attention"]] == ["forward", "backward"], report["attention"]
        assert all(a["kernel"] for a in report["attention"]), report["attention"]
    assert_bf16_step_close(step, entry, example_inputs())
    # and a full update step runs (checked over all weights: a key bias's gradient is zero in
    # exact arithmetic, and with fp32 accumulation too small to move it)
    before = {n: v.clone() for n, v in step.parameters().items()}
    step(*[t.cuda() for t in example_inputs()])
    assert any(not torch.equal(before[n], v) for n, v in step.parameters().items())


# GPT-2's key bias has no gradient in exact arithmetic (softmax ignores a per-query constant), so
# its computed gradient is rounding noise, which AdamW scales up to +-lr a step (on an H100 its
# parameters then differed by 8e-3 relative); SGD keeps noise at noise level.
GRAPH_CASES = [("resnet_basic_cl", "adamw"), ("gpt2_block_d64", "sgd"), ("xml_cnn", "adamw")]


@pytest.mark.parametrize("name,optimizer", GRAPH_CASES)
def test_cuda_graph_step_matches_the_eager_step(name, optimizer):
    """cuda_graph=True: the step runs in place and TVM replays its captured CUDA graphs from the
    second step on (each CUTLASS entry launched on the capture stream, the split weight gradients'
    side streams joined back); losses and parameters track the step launched kernel by kernel."""
    make_optimizer = {"adamw": lambda: tvm_evt.optim.AdamW(lr=1e-3),
                      "sgd": lambda: tvm_evt.optim.SGD(lr=1e-2, momentum=0.9)}[optimizer]
    entry = models.ZOO[re.sub(r"(_d\d+|_s2|_cl)+$", "", name)](**SMALL[name])
    no_dropout(entry.model)
    make = entry.example_inputs
    if name.endswith("_cl"):
        make = lambda: [t.contiguous(memory_format=torch.channels_last) if t.dim() == 4 else t
                        for t in entry.example_inputs()]
    batches = [[t.cuda() for t in make()] for _ in range(4)]
    steps = {graphs: tvm_evt.compile_training(copy.deepcopy(entry.model), make(), loss_fn=entry.loss_fn,
                                              optimizer=make_optimizer(), precision="bf16",
                                              cuda_graph=graphs)
             for graphs in (False, True)}
    losses = {g: [float(st(*b)) for b in batches] for g, st in steps.items()}
    assert losses[True] == pytest.approx(losses[False], rel=1e-3), losses
    want, got = steps[False].parameters(), steps[True].parameters()
    for n in want:
        assert rel_err(got[n].float().cpu(), want[n].float().cpu()) <= 1e-3, n

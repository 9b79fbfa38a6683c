"""FuseAttention: the imported attention core as one tvm_evt.attention call (structure, values,
and whole training steps with and without it)."""
import copy

import numpy as np
import pytest
import torch
import tvm
from tvm import relax
from tvm.relax import op as R
from tvm.script import ir as I
from tvm.script import relax as R_

import tvm_evt
from tvm_evt import models, pipeline
from tvm_evt.relax_passes.ops import attention_op as A
from tvm_evt.relax_passes.training.fuse_attention import FuseAttention, find_attention
from tvm_evt.relax_passes.training.lower_dropout import keep_mask_function

from _torch_ref import grad_err, no_dropout, rel_err

B, H, S, D = 2, 3, 8, 4
RATE, SITE = 0.25, 2
BIAS = np.array([0.5, -0.25, 0.0, 1.0, 0.0, -1.0, -np.inf, -np.inf], "float32")  # two padded keys


def _attention(causal=False, dropout=False, bias=False, leak=None, mask_offset=0, bias_first=False,
               learned_bias=False):
    """The attention core as the torch importer and LowerDropout write it (BERT's, or GPT-2's with
    `causal`, with PadAttentionKeys' constant key bias with `bias`); `leak` names an intermediate
    that is also returned; `mask_offset` shifts GPT-2's mask (1: the diagonal masked too);
    `bias_first` adds the bias before the scaling; `learned_bias` makes it a parameter."""
    bb = relax.BlockBuilder()
    q, k, v = (relax.Var(n, relax.TensorType((B, H, S, D), "float32")) for n in "qkv")
    params = [q, k, v]
    b = relax.Var("b", relax.TensorType((S,), "float32")) if learned_bias else relax.const(BIAS)
    seed = relax.Var("rng_seed", relax.TensorType((2,), "uint32"))
    params += [b] if learned_bias else []
    params += [seed] if dropout else []
    named = {}
    with bb.function("main", params):
        with bb.dataflow():
            kt = bb.emit(R.permute_dims(k, [0, 1, 3, 2]))
            q3 = bb.emit(R.reshape(bb.emit(R.broadcast_to(q, [B, H, S, D])), [B * H, S, D]))
            k3 = bb.emit(R.reshape(bb.emit(R.broadcast_to(kt, [B, H, D, S])), [B * H, D, S]))
            named["gemm"] = bb.emit(R.matmul(q3, k3, out_dtype="float32"))
            x = named["scores"] = bb.emit(R.reshape(named["gemm"], [B, H, S, S]))
            if bias and bias_first:
                x = bb.emit(R.add(x, b))
            x = named["scaled"] = bb.emit(R.divide(x, relax.const(4.0, "float32")))
            if causal:
                full = bb.emit(R.full([S, S], relax.const(True, "bool"), "bool"))
                cols = bb.emit(R.expand_dims(R.arange(0, S, 1, "int64"), [-2]))
                rows = bb.emit(R.expand_dims(R.arange(0, S, 1, "int64"), [-1]))
                keep_lower = R.less_equal(bb.emit(R.subtract(cols, rows)), relax.const(mask_offset, "int64"))
                mask = bb.emit(R.bitwise_not(bb.emit(R.logical_and(bb.emit(keep_lower), full))))
                x = named["masked"] = bb.emit(R.where(mask, relax.const(-np.inf, "float32"), x))
            if bias and not bias_first:
                x = bb.emit(R.add(x, b))
            p = named["probs"] = bb.emit(R.nn.softmax(x, axis=-1))
            if dropout:
                keep = named["keep"] = bb.emit(relax.call_tir(
                    keep_mask_function(bb, [B, H, S, S], RATE), [seed, relax.const(SITE, "uint32")],
                    relax.TensorType([B, H, S, S], "bool")))
                p = named["dropped"] = bb.emit(R.where(keep, p, relax.const(0.0, "float32")))
                p = bb.emit(R.multiply(p, relax.const(1 / (1 - RATE), "float32")))
            p3 = bb.emit(R.reshape(bb.emit(R.broadcast_to(p, [B, H, S, S])), [B * H, S, S]))
            v3 = bb.emit(R.reshape(bb.emit(R.broadcast_to(v, [B, H, S, D])), [B * H, S, D]))
            o = R.reshape(bb.emit(R.matmul(p3, v3, out_dtype="float32")), [B, H, S, D])
            out = bb.emit_output(relax.Tuple([bb.emit(o), named[leak]]) if leak else o)
        bb.emit_func_output(out)
    return bb.get()


def _no_seed():
    return A.no_seed()


@I.ir_module
class Expected:
    @R_.function
    def main(q: R_.Tensor((2, 3, 8, 4), "float32"), k: R_.Tensor((2, 3, 8, 4), "float32"),
             v: R_.Tensor((2, 3, 8, 4), "float32")):
        with R_.dataflow():
            attention = A.attention(q, k, v, _no_seed(), 0.25)
            o = attention[0]
            R_.output(o)
        return o


@I.ir_module
class ExpectedDropout:
    @R_.function
    def main(q: R_.Tensor((2, 3, 8, 4), "float32"), k: R_.Tensor((2, 3, 8, 4), "float32"),
             v: R_.Tensor((2, 3, 8, 4), "float32"), rng_seed: R_.Tensor((2,), "uint32")):
        with R_.dataflow():
            attention = A.attention(q, k, v, rng_seed, 0.25, False, 0.25, 2)
            o = attention[0]
            R_.output(o)
        return o


@I.ir_module
class ExpectedCausal:
    @R_.function
    def main(q: R_.Tensor((2, 3, 8, 4), "float32"), k: R_.Tensor((2, 3, 8, 4), "float32"),
             v: R_.Tensor((2, 3, 8, 4), "float32")):
        with R_.dataflow():
            attention = A.attention(q, k, v, _no_seed(), 0.25, True)
            o = attention[0]
            R_.output(o)
        return o


@I.ir_module
class ExpectedCausalBiasDropout:
    @R_.function
    def main(q: R_.Tensor((2, 3, 8, 4), "float32"), k: R_.Tensor((2, 3, 8, 4), "float32"),
             v: R_.Tensor((2, 3, 8, 4), "float32"), rng_seed: R_.Tensor((2,), "uint32")):
        with R_.dataflow():
            attention = A.attention(q, k, v, rng_seed, 0.25, True, 0.25, 2, R_.const(BIAS))
            o = attention[0]
            R_.output(o)
        return o


@pytest.mark.parametrize("case, before, expected", [
    ("plain", dict(), Expected),
    ("dropout", dict(dropout=True), ExpectedDropout),
    ("causal", dict(causal=True), ExpectedCausal),
    ("causal_bias_dropout", dict(causal=True, bias=True, dropout=True), ExpectedCausalBiasDropout),
])
def test_attention_core_becomes_one_call(case, before, expected):
    after = FuseAttention()(_attention(**before))
    tvm.ir.assert_structural_equal(after, expected)  # the keep-mask kernel went with its call


@pytest.mark.parametrize("case, before", [
    *[(f"leaked_{what}", dict(dropout=True, causal=True, leak=what))
      for what in ("gemm", "scores", "scaled", "masked", "probs", "keep", "dropped")],
    ("mask_is_not_causal", dict(causal=True, mask_offset=1)),
    ("bias_before_the_scaling", dict(bias=True, bias_first=True)),
    ("learned_bias", dict(bias=True, learned_bias=True)),  # the op would give it no gradient
])
def test_left_alone(case, before):
    mod = _attention(**before)
    assert not find_attention(mod["main"], mod)
    tvm.ir.assert_structural_equal(FuseAttention()(mod), mod)


def _run(mod, args):
    vm = relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu())
    return vm["main"](*[tvm.runtime.tensor(a) for a in args]).numpy()


def test_fused_attention_computes_the_same_values():
    rng = np.random.default_rng(0)
    args = [rng.standard_normal((B, H, S, D)).astype("float32") for _ in range(3)]
    args += [np.array([7, 11], "uint32")]
    mod = _attention(causal=True, bias=True, dropout=True)
    np.testing.assert_allclose(_run(FuseAttention()(mod), args), _run(mod, args), rtol=1e-5, atol=1e-6)


def _fused_calls(mod):
    found = []
    relax.analysis.post_order_visit(mod["main"].body, lambda e: found.append(e) if isinstance(e, relax.Call)
                                    and e.op.same_as(tvm.ir.Op.get(A.FORWARD)) else None)
    return found


def test_build_training_module_fuses_by_default_where_the_kernels_take_the_head_dim(monkeypatch):
    entry = models.ZOO["gpt2_block"](hidden=128, heads=2)  # head dim 64
    imported = tvm_evt.from_torch(entry.model, entry.example_inputs(), entry.loss_fn)
    assert pipeline.OPTIONAL["flash_attention"].default
    sgd = tvm_evt.optim.SGD(lr=0.1)
    monkeypatch.setenv(pipeline.DISABLE_ENV, "flash_attention")
    assert not _fused_calls(tvm_evt.build_training_module(imported, sgd, "bf16").mod)
    monkeypatch.delenv(pipeline.DISABLE_ENV)
    # fp32: no kernel computes it, so the unfused graph stays (and keeps PadAttentionKeys' padding)
    assert not _fused_calls(tvm_evt.build_training_module(imported, sgd, "fp32").mod)
    graph = tvm_evt.build_training_module(imported, sgd, "bf16")
    [call] = _fused_calls(graph.mod)
    assert A.operands(call).attrs == A.AttentionAttrs(0.125, True, 0.1, 0)  # head dim 64, p = 0.1, site 0
    names = [gv.name_hint for gv, _ in graph.mod.functions_items()]
    assert "dropout_keep_2x2x16x16_0p1" not in names  # the attention's keep-mask kernel is gone
    # head dimension 16: no kernel takes it, so the attention is left to the partitioner as it is
    small = models.ZOO["gpt2_block"]()
    imported = tvm_evt.from_torch(small.model, small.example_inputs(), small.loss_fn)
    assert not _fused_calls(tvm_evt.build_training_module(imported, sgd, "bf16").mod)


@pytest.mark.parametrize("hidden, heads", [(64, 2), (160, 2), (256, 2)])
def test_every_head_dim_the_kernels_take_is_fused_with_its_own_scale(hidden, heads):
    """Head dimensions 32, 80 and 128 fuse as 64 does, each scaled by 1/sqrt(D) of its true D."""
    entry = models.ZOO["gpt2_block"](hidden=hidden, heads=heads)
    imported = tvm_evt.from_torch(entry.model, entry.example_inputs(), entry.loss_fn)
    [call] = _fused_calls(tvm_evt.build_training_module(imported, tvm_evt.optim.SGD(lr=0.1), "bf16").mod)
    assert A.operands(call).attrs.scale == pytest.approx((hidden // heads) ** -0.5)


# name, dropout kept: ViT's keys (17) are padded by PadAttentionKeys when not fused, which draws
# its dropout mask at the padded shape, so ViT is compared without dropout
E2E = [("bert_layer", True), ("gpt2_block", True), ("vit", False)]
HEAD_DIM_64 = dict(hidden=128, heads=2)


@pytest.mark.parametrize("name, dropout", E2E)
def test_training_step_is_unchanged_by_fusion(name, dropout, monkeypatch):
    """Same seed, same dropout masks: loss and gradients of the fused step equal the unfused ones
    (fused at fp32 too here, so that the two compare to float32 rounding)."""
    monkeypatch.setattr(tvm_evt.training, "FLASH_PRECISIONS", ("fp32",))
    entry = models.ZOO[name](**HEAD_DIM_64)
    if not dropout:
        no_dropout(entry.model)
    inputs = entry.example_inputs()
    results = []
    for switch in ("flash_attention", ""):  # disabled, then on (the default)
        monkeypatch.setenv(pipeline.DISABLE_ENV, switch)
        step = tvm_evt.compile_training(copy.deepcopy(entry.model), inputs, loss_fn=entry.loss_fn,
                                        target={"kind": "llvm"})
        results.append(step.loss_and_grads(*inputs))
    assert A.FORWARD in step.graph.mod["main"].script(), "nothing was fused"
    (loss, grads), (fused_loss, fused_grads) = results
    assert rel_err(fused_loss, loss) <= 1e-5
    scale = float(torch.stack([g.double().norm() for g in grads.values()]).norm())
    errs = {n: grad_err(fused_grads[n], g, scale) for n, g in grads.items()}
    worst = max(errs, key=errs.get)
    assert errs[worst] <= 1e-5, f"{worst}: {errs[worst]:.3g}"


def test_causal_masks_of_real_sequence_lengths_are_recognised(monkeypatch):
    """GPT-2's mask at 128 tokens (FoldConstant leaves a 128 x 128 mask unfolded: it is evaluated)."""
    monkeypatch.setenv(pipeline.ENABLE_ENV, "flash_attention")
    entry = models.ZOO["gpt2_block"](seq=128, **HEAD_DIM_64)
    imported = tvm_evt.from_torch(entry.model, entry.example_inputs(), entry.loss_fn)
    main = tvm_evt.build_training_module(imported, tvm_evt.optim.SGD(lr=0.1), "bf16").mod["main"]
    calls = []
    relax.analysis.post_order_visit(main.body, lambda e: calls.append(e) if isinstance(e, relax.Call)
                                    and e.op.same_as(tvm.ir.Op.get(A.FORWARD)) else None)
    [call] = calls
    assert A.operands(call).attrs.causal

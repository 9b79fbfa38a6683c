"""GroupAttentionHeads: keys and values repeated over groups of query heads (transformers'
``repeat_kv``) become the attention op's grouped-query operands; other repeats stay."""
import copy

import numpy as np
import pytest
import torch
import tvm
from tvm import relax
from tvm.relax import op as R

import tvm_evt
from tvm_evt import models
from tvm_evt.relax_passes.ops import attention_op
from tvm_evt.relax_passes.training.group_attention_heads import GroupAttentionHeads, repeated_heads

from _passes import assert_unchanged

B, H, S, D = 2, 8, 16, 32


def _repeat(bb, x, groups, axis=2, unit_by_reshape=False):
    """x [B, Hkv, S, D] repeated as repeat_kv does (axis 2: each head `groups` times in a row; axis 1:
    the heads tiled `groups` times)."""
    b, hk, s, d = (int(n) for n in x.ty.shape)
    if unit_by_reshape:
        unit = bb.emit(R.reshape(x, [b, hk, 1, s, d]))
    else:
        unit = bb.emit(R.expand_dims(x, [axis]))
    wide = [b, hk, groups, s, d] if axis == 2 else [b, groups, hk, s, d]
    return bb.emit(R.reshape(bb.emit(R.broadcast_to(unit, wide)), [b, hk * groups, s, d]))


def _module(kv_heads, repeat=True, v_groups=None, axis=2, unit_by_reshape=False, read_repeat=False):
    """main(q, k, v) -> O of tvm_evt.attention over k and v repeated to H heads (or, with
    `repeat` False, over k and v themselves)."""
    bb = relax.BlockBuilder()
    q = relax.Var("q", relax.TensorType((B, H, S, D), "float32"))
    k, v = (relax.Var(n, relax.TensorType((B, kv_heads, S, D), "float32")) for n in "kv")
    with bb.function("main", [q, k, v]):
        with bb.dataflow():
            kr, vr = k, v
            if repeat:
                kr = _repeat(bb, k, H // kv_heads, axis, unit_by_reshape)
                vr = _repeat(bb, v, v_groups or H // kv_heads, axis, unit_by_reshape)
            att = bb.emit(attention_op.attention(q, kr, vr, attention_op.no_seed(), 0.125, True))
            out = bb.emit(relax.TupleGetItem(att, 0))
            if read_repeat:  # the repeated keys read by something else too
                out = bb.emit(R.add(out, R.sum(kr, axis=[3], keepdims=True)))
            result = bb.emit_output(out)
        bb.emit_func_output(result)
    return bb.get()


@pytest.mark.parametrize("unit_by_reshape", [False, True], ids=["expand_dims", "reshape"])
def test_repeated_heads_become_the_grouped_operands(unit_by_reshape):
    after = GroupAttentionHeads()(_module(2, unit_by_reshape=unit_by_reshape))
    tvm.ir.assert_structural_equal(after, _module(2, repeat=False))


def test_one_head_for_all_queries():
    tvm.ir.assert_structural_equal(GroupAttentionHeads()(_module(1)), _module(1, repeat=False))


@pytest.mark.parametrize("kwargs", [dict(axis=1), dict(v_groups=2)], ids=["tiled_heads", "groups_differ"])
def test_other_repeats_stay(kwargs):
    """Heads tiled (head h reads x's head h % Hkv, not h // G) are not grouped-query attention;
    k and v must repeat alike (here v is a 2-group repeat of 4 heads, k of 2)."""
    if "v_groups" in kwargs:
        bb = relax.BlockBuilder()
        q = relax.Var("q", relax.TensorType((B, H, S, D), "float32"))
        k = relax.Var("k", relax.TensorType((B, 2, S, D), "float32"))
        v = relax.Var("v", relax.TensorType((B, 4, S, D), "float32"))
        with bb.function("main", [q, k, v]):
            with bb.dataflow():
                att = bb.emit(attention_op.attention(q, _repeat(bb, k, 4), _repeat(bb, v, 2), attention_op.no_seed(),
                                                     0.125, True))
                result = bb.emit_output(relax.TupleGetItem(att, 0))
            bb.emit_func_output(result)
        mod = bb.get()
    else:
        mod = _module(2, **kwargs)
    assert_unchanged(GroupAttentionHeads(), mod)


def test_a_repeat_read_elsewhere_stays_for_that_reader():
    after = GroupAttentionHeads()(_module(2, read_repeat=True))
    calls = [e for e in _bindings(after["main"]) if isinstance(e, relax.Call) and e.op.name == attention_op.FORWARD]
    assert [int(calls[0].args[1].ty.shape[1])] == [2]
    assert any(isinstance(e, relax.Call) and e.op.name == "relax.broadcast_to" for e in _bindings(after["main"]))


def _bindings(func):
    return [b.value for block in func.body.blocks for b in block.bindings]


def test_repeated_heads_reads_through_aliases():
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((B, 2, S, D), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(_repeat(bb, x, 4))
        bb.emit_func_output(out)
    func = bb.get()["main"]
    bound = {b.var: b.value for block in func.body.blocks for b in block.bindings}
    source, groups = repeated_heads(bound, func.body.body)
    assert source.same_as(x) and groups == 4


def test_llama_step_attends_over_its_key_value_heads(kv_heads=2):
    """transformers' Llama (repeat_kv before SDPA): the attention op reads the key/value heads
    themselves, and the loss and every gradient equal torch fp32's (CPU, llvm)."""
    torch.manual_seed(0)
    entry = models.hf_llama_lm(batch=2, seq=16, layers=1, hidden=64, heads=4, kv_heads=kv_heads, ffn=64, vocab=100)
    inputs = entry.example_inputs()
    step = tvm_evt.compile_training(copy.deepcopy(entry.model), inputs, loss_fn=entry.loss_fn, precision="fp32")
    assert [a["kv_heads"] for a in step.report()["attention"]] == [kv_heads, kv_heads]  # forward, backward
    loss, grads = step.loss_and_grads(*inputs)
    model = copy.deepcopy(entry.model)
    want = model(*inputs)
    want.backward()
    np.testing.assert_allclose(float(loss.numpy()), want.item(), rtol=1e-5)
    ref = {n: p.grad for n, p in model.named_parameters()}
    largest = max(g.norm().item() for g in ref.values())
    for name, g in ref.items():
        err = (torch.from_numpy(np.asarray(grads[name].numpy())) - g).norm().item() / largest
        assert err <= 1e-4, (name, err)


def test_eager_attention_over_repeated_heads_is_grouped_too():
    """transformers' "eager" attention (repeat_kv, then the written-out math FuseAttention takes)
    reaches the flash-attention kernels over the key/value heads themselves (bf16, CUDA route; the
    training graph only, no kernel built)."""
    from tvm_evt import optim, tuning
    from tvm_evt.report import attention_calls
    from tvm_evt.training import hopper_target

    entry = models.hf_llama_lm(batch=2, seq=64, layers=1, hidden=256, heads=4, kv_heads=2, ffn=128, vocab=100,
                               attention="eager")
    _, graph = tuning.training_graph(entry, "bf16", optim.AdamW(lr=1e-4), hopper_target())
    calls = attention_calls(graph.mod["train_step"])
    assert [(c["op"], c["kv_heads"], c["kernel"]) for c in calls] == [("forward", 2, True), ("backward", 2, True)]

"""tvm_evt.attention / tvm_evt.attention_backward: their FLegalize decomposition on llvm against a
float64 torch reference with the same Philox dropout mask, the gradient rule through
relax.transform.Gradient against torch autograd, type checking, and the mixed-precision policy."""
import importlib

import numpy as np
import pytest
import torch
import tvm
from tvm import relax
from tvm.relax import op as R

from tvm_evt.codegen import philox
from tvm_evt.relax_passes.ops import attention_op
from tvm_evt.relax_passes.training.auto_mixed_precision import AutoMixedPrecision

B, H, D = 2, 3, 8
SEED = (0x1234ABCD, 0x0BADF00D)
SITE = 5
CASES = {  # name: (Sq, Sk, causal, bias, dropout[, key/value heads: H unless given])
    "plain": (8, 8, False, False, 0.0),
    # one key/value head read by all three query heads (multi-query; grouped-query attention's sums)
    "one_kv_head_causal_dropout": (8, 12, True, False, 0.25, 1),
    "causal": (8, 8, True, False, 0.0),
    "bias": (8, 12, False, True, 0.0),
    "dropout": (8, 12, False, False, 0.25),
    "causal_bias_dropout": (8, 8, True, True, 0.1),
}


def _keep(sq: int, sk: int, rate: float) -> np.ndarray:
    """LowerDropout's mask over the row-major [B, H, Sq, Sk] index (the numpy reference)."""
    return philox.dropout_keep((B * H, sq, sk), SEED, SITE, rate).reshape(B, H, sq, sk)


def _inputs(sq, sk, bias, rng, hk=H):
    q, k, v = (rng.standard_normal(s).astype("float32") for s in ((B, H, sq, D), (B, hk, sk, D), (B, hk, sk, D)))
    b = None
    if bias:
        b = (0.5 * rng.standard_normal(sk)).astype("float32")
        b[-2:] = -np.inf  # padded keys, as PadAttentionKeys writes them
    return q, k, v, b


def _torch_attention(q, k, v, b, scale, causal, rate):
    """float64 (O, LSE) with the same semantics and mask (k and v repeated over the query heads)."""
    k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    s = q @ k.transpose(-1, -2) * scale
    if b is not None:
        s = s + b
    sq, sk = s.shape[-2:]
    if causal:
        s = s.masked_fill(torch.ones(sq, sk, dtype=torch.bool).triu(1), float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.softmax(s, -1)
    if rate > 0:
        p = torch.where(torch.from_numpy(_keep(sq, sk, rate)), p, 0.0) / (1 - rate)
    return p @ v, lse


def _module(sq, sk, causal, bias, rate, dtype="float32", loss=False, lse_in_loss=False, hk=H):
    """main(q, k, v, seed[, bias][, w]) -> (O, LSE), or the loss sum(O * w) [+ sum(LSE)]; float32
    parameters, the attention in `dtype` (as AutoMixedPrecision leaves it)."""
    bb = relax.BlockBuilder()
    q = relax.Var("q", relax.TensorType((B, H, sq, D), "float32"))
    k = relax.Var("k", relax.TensorType((B, hk, sk, D), "float32"))
    v = relax.Var("v", relax.TensorType((B, hk, sk, D), "float32"))
    seed = relax.Var("seed", relax.TensorType((2,), "uint32"))
    params = [q, k, v, seed]
    b = relax.Var("b", relax.TensorType((sk,), "float32")) if bias else None
    params += [b] if bias else []
    w = relax.Var("w", relax.TensorType((B, H, sq, D), "float32"))
    params += [w] if loss else []
    with bb.function("main", params):
        with bb.dataflow():
            qkv = [x if dtype == "float32" else bb.emit(R.astype(x, dtype)) for x in (q, k, v)]
            att = bb.emit(attention_op.attention(*qkv, seed, 0.35, causal, rate, SITE, b))
            if loss:
                out = R.sum(R.multiply(R.astype(bb.emit(relax.TupleGetItem(att, 0)), "float32"), w))
                if lse_in_loss:
                    out = R.add(out, R.sum(bb.emit(relax.TupleGetItem(att, 1))))
                result = bb.emit_output(out)
            else:
                result = relax.Tuple([bb.emit_output(relax.TupleGetItem(att, i)) for i in range(2)])
        bb.emit_func_output(result)
    return bb.get()


def _run(mod, fn, *args):
    vm = relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu())
    return vm[fn](*[tvm.runtime.tensor(a) for a in args if a is not None])


def _t(x):
    return None if x is None else torch.from_numpy(x).double()


@pytest.mark.parametrize("case", sorted(CASES))
def test_forward_matches_torch(case):
    sq, sk, causal, bias, rate, *hk = CASES[case]
    hk = hk[0] if hk else H
    q, k, v, b = _inputs(sq, sk, bias, np.random.default_rng(0), hk)
    o, lse = _run(_module(sq, sk, causal, bias, rate, hk=hk), "main", q, k, v, np.array(SEED, "uint32"), b)
    want_o, want_lse = _torch_attention(_t(q), _t(k), _t(v), _t(b), 0.35, causal, rate)
    np.testing.assert_allclose(o.numpy(), want_o.numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(lse.numpy(), want_lse.numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", sorted(CASES))
def test_gradient_matches_torch_autograd(case):
    sq, sk, causal, bias, rate, *hk = CASES[case]
    hk = hk[0] if hk else H
    rng = np.random.default_rng(1)
    q, k, v, b = _inputs(sq, sk, bias, rng, hk)
    w = rng.standard_normal((B, H, sq, D)).astype("float32")
    mod = _module(sq, sk, causal, bias, rate, loss=True, hk=hk)
    mod = relax.transform.Gradient("main", require_grads=mod["main"].params[:3])(mod)
    loss, grads = _run(mod, "main_adjoint", q, k, v, np.array(SEED, "uint32"), b, w)
    tq, tk, tv = (_t(x).requires_grad_() for x in (q, k, v))
    o, _ = _torch_attention(tq, tk, tv, _t(b), 0.35, causal, rate)
    want = (o * _t(w)).sum()
    want.backward()
    np.testing.assert_allclose(loss.numpy(), want.item(), rtol=1e-5)
    for got, ref in zip(grads, (tq, tk, tv)):
        np.testing.assert_allclose(got.numpy(), ref.grad.numpy(), rtol=1e-4, atol=1e-5)


def test_gradient_rule_emits_one_backward_call_on_the_saved_outputs():
    mod = _module(8, 8, True, True, 0.1, loss=True)
    mod = relax.transform.Gradient("main", require_grads=mod["main"].params[:3])(mod)
    bindings = {b.var: b.value for blk in mod["main_adjoint"].body.blocks for b in blk.bindings}
    calls = [v for v in bindings.values() if isinstance(v, relax.Call) and v.op == tvm.ir.Op.get(attention_op.BACKWARD)]
    assert len(calls) == 1
    back = attention_op.operands(calls[0])
    fwd_var = next(var for var, v in bindings.items()
                   if isinstance(v, relax.Call) and v.op == tvm.ir.Op.get(attention_op.FORWARD))
    o, lse = (bindings[back.tensors[w]] for w in ("o", "lse"))
    assert (o.tuple_value, o.index, lse.tuple_value, lse.index) == (fwd_var, 0, fwd_var, 1)
    params = mod["main_adjoint"].params
    assert [back.tensors[w] for w in ("q", "k", "v")] == list(params[:3])
    assert back.seed.same_as(params[3]) and back.bias.same_as(params[4])
    assert back.attrs == attention_op.AttentionAttrs(0.35, True, 0.1, SITE)


def test_a_gradient_reaching_the_lse_is_ignored():
    """LSE is a statistic saved for the backward: d(sum LSE) does not flow back into q and k."""
    rng = np.random.default_rng(2)
    q, k, v, _ = _inputs(8, 8, False, rng)
    w = rng.standard_normal((B, H, 8, D)).astype("float32")
    grads = []
    for lse_in_loss in (False, True):
        mod = _module(8, 8, False, False, 0.0, loss=True, lse_in_loss=lse_in_loss)
        mod = relax.transform.Gradient("main", require_grads=mod["main"].params[:3])(mod)
        grads.append([g.numpy() for g in _run(mod, "main_adjoint", q, k, v, np.zeros(2, "uint32"), w)[1]])
    for with_lse, without in zip(grads[1], grads[0]):
        np.testing.assert_array_equal(with_lse, without)


def test_bf16_forward_and_backward_are_bf16_with_float32_lse():
    rng = np.random.default_rng(3)
    q, k, v, b = _inputs(8, 8, True, rng)
    mod = _module(8, 8, True, True, 0.1, dtype="bfloat16", loss=True)
    mod = relax.transform.Gradient("main", require_grads=mod["main"].params[:3])(mod)
    bindings = [b for blk in mod["main_adjoint"].body.blocks for b in blk.bindings]
    back = next(b for b in bindings if isinstance(b.value, relax.Call)
                and b.value.op == tvm.ir.Op.get(attention_op.BACKWARD))
    ops = attention_op.operands(back.value)
    assert [str(ops.tensors[w].ty.dtype) for w in attention_op.TENSORS[attention_op.BACKWARD]] == \
        ["bfloat16"] * 4 + ["float32", "bfloat16"]
    assert [str(t.dtype) for t in back.var.ty.fields] == ["bfloat16"] * 3
    w = rng.standard_normal((B, H, 8, D)).astype("float32")
    loss, grads = _run(mod, "main_adjoint", q, k, v, np.array(SEED, "uint32"), b, w)
    tq, tk, tv = (_t(x).requires_grad_() for x in (q, k, v))
    o, _ = _torch_attention(tq, tk, tv, _t(b), 0.35, True, 0.1)
    (o * _t(w)).sum().backward()
    for got, ref in zip(grads, (tq, tk, tv)):  # bf16 inputs, P, dS and outputs: 2^-8 relative rounding
        assert np.linalg.norm(got.numpy() - ref.grad.numpy()) <= 2e-2 * np.linalg.norm(ref.grad.numpy())


def test_operands_are_type_checked():
    q = relax.Var("q", relax.TensorType((B, H, 8, D), "float32"))
    k = relax.Var("k", relax.TensorType((B, H, 12, D), "float32"))
    wrong_bias = relax.Var("b", relax.TensorType((8,), "float32"))
    bb = relax.BlockBuilder()
    with pytest.raises(Exception, match=r"bias must be float32 \[Sk\]"):
        bb.normalize(attention_op.attention(q, k, k, attention_op.no_seed(), 1.0, bias=wrong_bias))
    with pytest.raises(Exception, match="v must have shape"):
        bb.normalize(attention_op.attention(q, k, q, attention_op.no_seed(), 1.0))
    with pytest.raises(Exception, match="dropout rate 1.0 outside"):
        bb.normalize(attention_op.attention(q, k, k, attention_op.no_seed(), 1.0, dropout=1.0))
    two_heads = relax.Var("k2", relax.TensorType((B, 2, 12, D), "float32"))  # 2 does not divide H = 3
    with pytest.raises(Exception, match="with Hkv dividing 3"):
        bb.normalize(attention_op.attention(q, two_heads, two_heads, attention_op.no_seed(), 1.0))


def test_registration_is_idempotent():
    importlib.reload(attention_op)
    importlib.reload(attention_op)
    names = set(tvm.ir.Op.list_op_names())
    assert {attention_op.FORWARD, attention_op.BACKWARD} <= names
    q, k, v, _ = _inputs(8, 8, False, np.random.default_rng(4))
    o, _ = _run(_module(8, 8, False, False, 0.0), "main", q, k, v, np.zeros(2, "uint32"))
    np.testing.assert_allclose(o.numpy(), _torch_attention(_t(q), _t(k), _t(v), None, 0.35, False, 0.0)[0].numpy(),
                               rtol=1e-5, atol=1e-5)


def test_mixed_precision_computes_attention_in_bf16_with_a_float32_bias():
    mod = _module(8, 12, False, True, 0.0)
    after = AutoMixedPrecision("bfloat16")(mod)
    call = next(b.value for blk in after["main"].body.blocks for b in blk.bindings
                if isinstance(b.value, relax.Call) and b.value.op == tvm.ir.Op.get(attention_op.FORWARD))
    ops = attention_op.operands(call)
    assert [str(t.ty.dtype) for t in ops.tensors.values()] == ["bfloat16"] * 3
    assert ops.bias.same_as(after["main"].params[4])  # not cast
    o, lse = after["main"].ret_ty.fields
    assert (str(o.dtype), str(lse.dtype)) == ("float32", "float32")  # outputs keep their dtypes

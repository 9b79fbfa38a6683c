"""PadAttentionKeys: misaligned key lengths padded to a multiple of 8, values and gradients unchanged."""
import numpy as np
import pytest
import tvm
from tvm import relax

from tvm_evt.relax_passes.training.lower_dropout import keep_mask_function
from tvm_evt.relax_passes.training.pad_attention_keys import PadAttentionKeys, find_chains

B, H, D = 2, 3, 16


def _attention(s: int, dropout: bool = False, leak_scores: bool = False, loss: bool = False):
    """matmul(Q, Kᵀ) -> reshape -> /sqrt(d) -> softmax -> [dropout] -> reshape -> matmul(P, V)
    [-> a weighted sum: a scalar loss to differentiate]."""
    bb = relax.BlockBuilder()
    q = relax.Var("q", relax.TensorType((B * H, s, D), "float32"))
    kt = relax.Var("kt", relax.TensorType((B * H, D, s), "float32"))
    v = relax.Var("v", relax.TensorType((B * H, s, D), "float32"))
    params = [q, kt, v]
    if dropout:
        seed = relax.Var("rng_seed", relax.TensorType((2,), "uint32"))
        params.append(seed)
    with bb.function("main", params):
        with bb.dataflow():
            scores = bb.emit(relax.op.matmul(q, kt))
            x = bb.emit(relax.op.reshape(scores, [B, H, s, s]))
            x = bb.emit(relax.op.divide(x, relax.const(4.0, "float32")))
            p = bb.emit(relax.op.nn.softmax(x, axis=-1))
            if dropout:
                keep = bb.emit(relax.call_tir(keep_mask_function(bb, [B, H, s, s], 0.25),
                                              [seed, relax.const(0, "uint32")], relax.TensorType([B, H, s, s], "bool")))
                p = bb.emit(relax.op.where(keep, p, relax.const(0.0, "float32")))
                p = bb.emit(relax.op.multiply(p, relax.const(1 / 0.75, "float32")))
            p = bb.emit(relax.op.reshape(p, [B * H, s, s]))
            out = bb.emit(relax.op.matmul(p, v))
            if loss:
                w = np.linspace(-1, 1, B * H * s * D).reshape(B * H, s, D).astype("float32")
                result = bb.emit_output(relax.op.sum(relax.op.multiply(out, relax.const(w))))
            else:
                result = bb.emit_output(relax.Tuple([out, scores]) if leak_scores else out)
        bb.emit_func_output(result)
    return bb.get()


def _expected(s: int, padded: int):
    bb = relax.BlockBuilder()
    q = relax.Var("q", relax.TensorType((B * H, s, D), "float32"))
    kt = relax.Var("kt", relax.TensorType((B * H, D, s), "float32"))
    v = relax.Var("v", relax.TensorType((B * H, s, D), "float32"))
    bias = np.zeros([padded], "float32")
    bias[s:] = -np.inf
    with bb.function("main", [q, kt, v]):
        with bb.dataflow():
            zk = bb.emit(relax.op.zeros([B * H, D, padded - s], "float32"))
            ktp = bb.emit(relax.op.concat([kt, zk], axis=-1))
            scores = bb.emit(relax.op.matmul(q, ktp))
            x = bb.emit(relax.op.reshape(scores, [B, H, s, padded]))
            x = bb.emit(relax.op.divide(x, relax.const(4.0, "float32")))
            x = bb.emit(relax.op.add(x, relax.const(bias, "float32")))
            p = bb.emit(relax.op.nn.softmax(x, axis=-1))
            p = bb.emit(relax.op.reshape(p, [B * H, s, padded]))
            zv = bb.emit(relax.op.zeros([B * H, padded - s, D], "float32"))
            vp = bb.emit(relax.op.concat([v, zv], axis=-2))
            out = bb.emit(relax.op.matmul(p, vp))
            result = bb.emit_output(out)
        bb.emit_func_output(result)
    return bb.get()


def _run(mod, *args, fn="main"):
    ex = tvm.compile(mod, target="llvm")
    return relax.VirtualMachine(ex, tvm.cpu())[fn](*[tvm.runtime.tensor(a) for a in args])


def _inputs(s, rng):
    return [rng.standard_normal(shape).astype("float32") for shape in ((B * H, s, D), (B * H, D, s), (B * H, s, D))]


def test_misaligned_keys_are_padded_with_a_masking_bias():
    after = PadAttentionKeys()(_attention(13))
    tvm.ir.assert_structural_equal(after, _expected(13, 16))


def test_padded_attention_computes_the_same_values():
    rng = np.random.default_rng()
    args = _inputs(13, rng)
    want = _run(_attention(13), *args).numpy()
    got = _run(PadAttentionKeys()(_attention(13)), *args).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_padded_gradients_equal_the_original_ones():
    rng = np.random.default_rng()
    args = _inputs(13, rng)
    grads = []
    for mod in (_attention(13, loss=True), PadAttentionKeys()(_attention(13, loss=True))):
        loss, g = _run(relax.transform.Gradient("main")(mod), *args, fn="main_adjoint")
        grads.append([x.numpy() for x in g])
    assert [g.shape for g in grads[1]] == [a.shape for a in args]
    for got, want in zip(grads[1], grads[0]):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_dropout_mask_is_drawn_at_the_padded_shape():
    after = PadAttentionKeys()(_attention(13, dropout=True))
    keep_funcs = [gv.name_hint for gv, f in after.functions_items() if isinstance(f, tvm.tirx.PrimFunc)]
    assert keep_funcs == ["dropout_keep_2x3x13x16_0p25"]  # the 13-wide kernel was dropped with its call
    text = after["main"].script()
    assert "R.where" in text and "R.nn.softmax" in text


@pytest.mark.parametrize("case", ["aligned", "leaked_scores"])
def test_left_alone(case):
    mod = _attention(16) if case == "aligned" else _attention(13, leak_scores=True)
    assert not find_chains(mod["main"], mod)
    tvm.ir.assert_structural_equal(PadAttentionKeys()(mod), mod)

"""FoldNormAffine (``TVM_EVT_ENABLE=fold_norm``: a layer norm's scale and shift into the weights of the
matmuls it feeds) and SaveNormalizedLowPrecision (the affine-free layer norm's gradient reads the bf16
xhat its GEMMs read)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import tvm
from tvm import relax

import tvm_evt
from tvm_evt import optim, pipeline
from tvm_evt.frontend import from_torch
from tvm_evt.models import FirstOutput
from tvm_evt.relax_passes.graph.save_normalized_low_precision import SaveNormalizedLowPrecision
from tvm_evt.relax_passes.training.fold_norm_affine import FoldNormAffine
from tvm_evt.training import build_training_module

from _passes import affine_free_layer_norms, assert_unchanged
from _torch_ref import matches_torch

T, H, N = 16, 8, 12  # tokens (2 x 8), features, outputs: the weights [N, H] are no larger than [T, H]
LN = dict(axes=[-1], epsilon=1e-5)


def _vars(n=N):
    return (relax.Var("x", relax.TensorType((2, T // 2, H), "float32")),
            relax.Var("g", relax.TensorType((H,), "float32")), relax.Var("be", relax.TensorType((H,), "float32")),
            relax.Var("w", relax.TensorType((n, H), "float32")), relax.Var("b", relax.TensorType((n,), "float32")))


def _before(residual=False, n=N):
    """y = layer_norm(x); z = add(b, matmul(reshape(y), permute_dims(w))) (a torch.nn.Linear);
    with `residual`, y + x is an output too (a post-LN block's residual)."""
    bb = relax.BlockBuilder()
    x, g, be, w, b = _vars(n)
    with bb.function("main", [x, g, be, w, b]):
        with bb.dataflow():
            y = bb.emit(relax.op.nn.layer_norm(x, g, be, **LN))
            r = bb.emit(relax.op.reshape(y, [T, H]))
            wt = bb.emit(relax.op.permute_dims(w, [1, 0]))
            z = bb.emit(relax.op.add(b, bb.emit(relax.op.matmul(r, wt, out_dtype="float32"))))
            outs = [z, bb.emit(relax.op.add(y, x))] if residual else [z]
            out = bb.emit_output(relax.Tuple(outs) if residual else z)
        bb.emit_func_output(out)
    return bb.get()


def _expected():
    bb = relax.BlockBuilder()
    x, g, be, w, b = _vars()
    with bb.function("main", [x, g, be, w, b]):
        with bb.dataflow():
            ones, zeros = (relax.const(np.full([H], v, "float32"), "float32") for v in (1, 0))
            xhat = bb.emit(relax.op.nn.layer_norm(x, ones, zeros, **LN, center=False, scale=False))
            r = bb.emit(relax.op.reshape(xhat, [T, H]))
            scaled = bb.emit(relax.op.multiply(w, bb.emit(relax.op.reshape(g, [1, H]))))
            wt = bb.emit(relax.op.permute_dims(scaled, [1, 0]))
            shift = bb.emit(relax.op.sum(bb.emit(relax.op.multiply(w, bb.emit(relax.op.reshape(be, [1, H])))), [1]))
            mm = bb.emit(relax.op.matmul(r, wt, out_dtype="float32"))
            z = bb.emit(relax.op.add(bb.emit(relax.op.add(b, shift)), mm))
            out = bb.emit_output(z)
        bb.emit_func_output(out)
    return relax.transform.CanonicalizeBindings()(bb.get())


def _run(mod, args):
    ex = tvm.compile(mod, target=tvm.target.Target({"kind": "llvm"}))
    out = relax.VirtualMachine(ex, tvm.cpu())["main"](*map(tvm.runtime.tensor, args))
    return [out.numpy()] if hasattr(out, "numpy") else [t.numpy() for t in out]


def test_scale_and_shift_move_into_the_linear_layer():
    """The layer norm loses its affine part, the weight's columns take gamma and the bias takes
    sum(beta * w).  The outputs are those of the module before."""
    after = FoldNormAffine()(_before())
    tvm.ir.assert_structural_equal(after, _expected())
    rng = np.random.default_rng(0)
    args = [rng.standard_normal([int(s) for s in v.ty.shape.values]).astype("float32") for v in _vars()]
    for got, want in zip(_run(after, args), _run(_before(), args)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_a_layer_norm_that_is_also_a_residual_is_left_alone():
    """A post-LN block's layer norm feeds the residual too: its forward would have to write xhat
    besides y, so it keeps its affine part."""
    assert_unchanged(FoldNormAffine(), _before(residual=True))


def test_a_weight_larger_than_the_normalized_tensor_is_left_alone():
    """A vocabulary head at few tokens: the weight-sized work would cost more than the saved
    tensor, so the layer norm keeps its affine part."""
    assert_unchanged(FoldNormAffine(), _before(n=4 * T))


class _PreLN(torch.nn.Module):
    def __init__(self, h=32, affine=True):
        super().__init__()
        self.ln1, self.ln2 = torch.nn.LayerNorm(h, elementwise_affine=affine), torch.nn.LayerNorm(h)
        self.qkv, self.proj = torch.nn.Linear(h, 3 * h), torch.nn.Linear(h, h)
        self.fc1, self.fc2 = torch.nn.Linear(h, 4 * h), torch.nn.Linear(4 * h, h)

    def forward(self, x):
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        x = x + self.proj(torch.sigmoid(q) * k + v)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


def _folded(module, x, t) -> int:
    """How many layer norms of the step's training graph lost their affine part."""
    graph = build_training_module(from_torch(module, [x, t], F.mse_loss), optim.SGD(lr=0.1))
    return affine_free_layer_norms(graph.mod["main"])


@pytest.fixture
def fold_on(monkeypatch):
    monkeypatch.setenv(pipeline.ENABLE_ENV, "fold_norm")


@pytest.mark.parametrize("affine", [True, False])
def test_folded_block_trains_as_torch(affine, fold_on):
    """A pre-LN block (fused QKV, then the split) whose layer norms feed its linear layers only:
    every gradient (gamma's and beta's now through the weights) equals torch fp32's.  Without
    `elementwise_affine` (imported as a scale of ones and a shift of zeros) the layer norm becomes
    affine-free with no weight-sized work, and its gradient reads its output all the same."""
    torch.manual_seed(0)
    module, x, t = _PreLN(affine=affine), torch.randn(4, 32, 32), torch.randn(4, 32, 32)
    assert _folded(module, x, t) == 2
    matches_torch(module, (x, t), F.mse_loss)


def test_off_by_default(monkeypatch):
    monkeypatch.delenv(pipeline.ENABLE_ENV, raising=False)
    torch.manual_seed(0)
    assert _folded(_PreLN(), torch.randn(4, 32, 32), torch.randn(4, 32, 32)) == 0


def test_transformers_blocks_train_as_torch_with_the_fold(fold_on):
    """transformers' GPT2Block (Conv1D weights [H, N], fused c_attn; folded) and BertLayer (post-LN:
    the layer norms' outputs are residuals too; left alone), at sizes where the fold would apply."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.bert.modeling_bert import BertLayer
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    torch.manual_seed(0)
    x, t = torch.randn(4, 32, 32), torch.randn(4, 32, 32)
    gpt2 = transformers.GPT2Config(n_embd=32, n_head=2, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0)
    bert = transformers.BertConfig(hidden_size=32, num_attention_heads=2, intermediate_size=128,
                                   hidden_dropout_prob=0, attention_probs_dropout_prob=0)
    # GPT-2: ln_1 -> c_attn, ln_2 -> c_fc; BERT's layer norms also feed residuals (post-LN): none
    for layer, folded in ((GPT2Block(gpt2), 2), (BertLayer(bert), 0)):
        module = FirstOutput(layer).train()
        assert _folded(module, x, t) == folded
        matches_torch(module, (x, t), F.mse_loss)


def _normalized_before():
    """A decomposed affine-free layer norm (as DecomposeLayerNorm spells it), its bf16 copy through
    a reshape (the GEMM's operand), and a later float32 reader (the gradient's xhat * mean(...))."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((2, 4, H), "float32"))
    d = relax.Var("d", relax.TensorType((2, 4, 1), "float32"))
    with bb.function("main", [x, d]):
        with bb.dataflow():
            mean = bb.emit(relax.op.mean(x, [2], keepdims=True))
            centered = bb.emit(relax.op.subtract(x, mean))
            var = bb.emit(relax.op.mean(bb.emit(relax.op.multiply(centered, centered)), [2], keepdims=True))
            rstd = bb.emit(relax.op.rsqrt(bb.emit(relax.op.add(var, relax.const(1e-5, "float32")))))
            xhat = bb.emit(relax.op.multiply(centered, rstd))
            low = bb.emit(relax.op.astype(bb.emit(relax.op.reshape(xhat, [8, H])), "bfloat16"))
            out = bb.emit_output(relax.Tuple([low, bb.emit(relax.op.multiply(xhat, d))]))
        bb.emit_func_output(out)
    return bb.get()


def test_the_gradient_reads_the_bf16_xhat():
    after = SaveNormalizedLowPrecision()(_normalized_before())
    main = after["main"]
    bindings = [b for blk in main.body.blocks for b in blk.bindings]
    last = bindings[-2].value  # the reader, before the output tuple
    widened = {b.var: b.value for b in bindings}[last.args[0]]
    assert widened.op.name == "relax.astype" and str(widened.attrs.dtype) == "float32"
    view = {b.var: b.value for b in bindings}[widened.args[0]]
    assert view.op.name == "relax.reshape" and [int(s) for s in view.args[1].values] == [2, 4, H]


def test_a_softmax_is_not_a_normalized_row():
    """Only ``(x - mean(x)) * rsqrt(...)`` is taken: a module without it is left alone."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((2, H), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            p = bb.emit(relax.op.nn.softmax(x))
            low = bb.emit(relax.op.astype(p, "bfloat16"))
            out = bb.emit_output(relax.Tuple([low, bb.emit(relax.op.multiply(p, x))]))
        bb.emit_func_output(out)
    assert_unchanged(SaveNormalizedLowPrecision(), bb.get())

"""RecognizeRMSNorm (on by default; ``TVM_EVT_DISABLE=rms_norm``): an RMS norm written out as ops becomes
``relax.nn.rms_norm``; Llama as transformers builds it trains as torch computes it with the op, and
on the CUDA route each norm's input gradient is one row kernel."""
import numpy as np
import pytest
import torch
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

from tvm_evt import models, pipeline
from tvm_evt.relax_passes.graph.decompose_layer_norm import DecomposeLayerNorm
from tvm_evt.relax_passes.training.recognize_rms_norm import RecognizeRMSNorm

from _passes import assert_unchanged
from _torch_ref import matches_torch


@I.ir_module
class Before:
    @R.function
    def main(x: R.Tensor((2, 8, 16), "float32"), w: R.Tensor((16,), "float32")):
        with R.dataflow():
            s = R.multiply(x, x)
            s1 = s
            m = R.mean(s1, axis=[-1], keepdims=True)
            v = R.add(m, R.const(1e-6, "float32"))
            r = R.rsqrt(v)
            n = R.multiply(x, r)
            y = R.multiply(w, n)
            R.output(y)
        return y


@I.ir_module
class Expected:
    @R.function
    def main(x: R.Tensor((2, 8, 16), "float32"), w: R.Tensor((16,), "float32")):
        with R.dataflow():
            y = R.nn.rms_norm(x, w, axes=[-1], epsilon=9.9999999747524271e-07)  # float32(1e-6)
            R.output(y)
        return y


def test_written_out_rms_norm_becomes_the_op():
    tvm.ir.assert_structural_equal(RecognizeRMSNorm()(Before), Expected)


def _run(mod, *args):
    ex = tvm.compile(mod, target="llvm")
    return relax.VirtualMachine(ex, tvm.cpu())["main"](*[tvm.runtime.tensor(a) for a in args]).numpy()


def test_the_op_and_its_decomposition_compute_what_the_ops_computed():
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((2, 8, 16)).astype("float32"), rng.standard_normal(16).astype("float32")
    want = _run(Before, x, w)
    np.testing.assert_allclose(_run(RecognizeRMSNorm()(Before), x, w), want, rtol=1e-5, atol=1e-6)
    decomposed = DecomposeLayerNorm()(RecognizeRMSNorm()(Before))
    assert "rms_norm" not in decomposed.script()
    np.testing.assert_allclose(_run(decomposed, x, w), want, rtol=1e-5, atol=1e-6)


@I.ir_module
class NoWeight:
    @R.function
    def main(x: R.Tensor((4, 16), "float32")):
        with R.dataflow():
            s = R.multiply(x, x)
            m = R.mean(s, axis=[1], keepdims=True)
            r = R.rsqrt(R.add(R.const(1e-5, "float32"), m))
            n = R.multiply(r, x)
            y = R.add(n, x)  # not a weight: the norm alone is rms_norm(x, ones)
            R.output(y)
        return y


def test_a_norm_without_weight_takes_ones():
    after = RecognizeRMSNorm()(NoWeight)
    assert after["main"].script().count("R.nn.rms_norm") == 1
    x = np.random.default_rng(1).standard_normal((4, 16)).astype("float32")
    np.testing.assert_allclose(_run(after, x), _run(NoWeight, x), rtol=1e-5, atol=1e-6)


@I.ir_module
class StatisticReadElsewhere:
    @R.function
    def main(x: R.Tensor((4, 16), "float32"), w: R.Tensor((16,), "float32")):
        with R.dataflow():
            s = R.multiply(x, x)
            m = R.mean(s, axis=[-1], keepdims=True)
            r = R.rsqrt(R.add(m, R.const(1e-5, "float32")))
            y = R.multiply(w, R.multiply(x, r))
            out = (y, m)  # the mean square is an output too: left alone
            R.output(out)
        return out


@I.ir_module
class NotTheLastAxis:
    @R.function
    def main(x: R.Tensor((4, 16), "float32"), w: R.Tensor((16,), "float32")):
        with R.dataflow():
            s = R.multiply(x, x)
            m = R.mean(s, axis=[0], keepdims=True)
            r = R.rsqrt(R.add(m, R.const(1e-5, "float32")))
            y = R.multiply(w, R.multiply(x, r))
            R.output(y)
        return y


@pytest.mark.parametrize("mod", [StatisticReadElsewhere, NotTheLastAxis])
def test_left_alone(mod):
    assert_unchanged(RecognizeRMSNorm(), mod)


def test_llama_trains_as_torch_with_the_op():
    """transformers' LlamaForCausalLM (three LlamaRMSNorms) with the norms as the op: loss and every
    gradient equal torch fp32 (the LlamaRMSNorm weights' too)."""
    pytest.importorskip("transformers")
    assert pipeline.enabled("rms_norm")
    torch.manual_seed(0)
    entry = models.hf_llama_lm(batch=2, seq=16, layers=2, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=100)
    matches_torch(entry.model, entry.example_inputs())


def test_llama_norm_gradients_are_row_kernels_on_cuda():
    """On the CUDA route (no GPU needed: the front passes and FuseLayerNormBackward), each of a
    small Llama's RMS norms has its input gradient as one rms_norm_grad kernel."""
    pytest.importorskip("transformers")
    from tvm_evt import tuning
    from tvm_evt.training import hopper_target

    entry = models.hf_llama_lm(batch=1, seq=64, layers=1, hidden=256, heads=4, kv_heads=2, ffn=512, vocab=512)
    cuda = hopper_target()
    _, graph = tuning.training_graph(entry, "bf16", target=cuda)
    rows = tuning.kernel_traffic(graph.mod, cuda)
    grads = [r for r in rows if r["kernel"].startswith("rms_norm_grad")]
    assert sum(r["calls"] for r in grads) == 3, [r["kernel"] for r in rows]


NORMS = {  # transformers' own RMS norms, each spelt its own way (Gemma scales by 1 + w)
    "llama": ("transformers.models.llama.modeling_llama", "LlamaRMSNorm"),
    "qwen2": ("transformers.models.qwen2.modeling_qwen2", "Qwen2RMSNorm"),
    "gemma": ("transformers.models.gemma.modeling_gemma", "GemmaRMSNorm"),
    "t5": ("transformers.models.t5.modeling_t5", "T5LayerNorm"),
}


@pytest.mark.parametrize("family", sorted(NORMS))
def test_library_rms_norms_become_the_op_and_train_as_torch(family):
    import importlib

    import torch.nn.functional as F

    from tvm_evt.frontend import from_torch
    from tvm_evt.relax_passes.training.expand_small_power import ExpandSmallPower

    pytest.importorskip("transformers")
    module, name = NORMS[family]
    norm = getattr(importlib.import_module(module), name)(16)
    torch.manual_seed(0)
    with torch.no_grad():
        norm.weight.normal_()  # Gemma's starts at zero (its scale is 1 + w)
    model = torch.nn.Sequential(norm, torch.nn.Linear(16, 8))
    x, target = torch.randn(2, 6, 16), torch.randn(2, 6, 8)
    imported = from_torch(model, (x, target), F.mse_loss)
    assert RecognizeRMSNorm()(ExpandSmallPower()(imported.mod))["main"].script().count("R.nn.rms_norm") == 1
    matches_torch(model, (x, target), F.mse_loss)

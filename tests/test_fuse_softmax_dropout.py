import shutil

import numpy as np
import pytest
import tvm
from tvm import relax

from tvm_evt.relax_passes.lower.fuse_softmax_dropout import FuseSoftmaxDropout, softmax_dropout_primfunc

CUDA = {"kind": "cuda", "arch": "sm_90a"}


def _attention_probs(n=40, dropout=True, p_used_early=False, widen=False, bias=False):
    """softmax -> bf16 cast -> dropout (mask, scale) -> P·V; p also read later (the softmax gradient).
    With `bias`, the scores first get PadAttentionKeys' row bias (-inf on the last 3 keys)."""
    bb = relax.BlockBuilder()
    s = relax.Var("s", relax.TensorType((2, 3, 5, n), "bfloat16" if widen else "float32"))
    keep = relax.Var("keep", relax.TensorType((2, 3, 5, n), "bool"))
    v = relax.Var("v", relax.TensorType((2, 3, n, 8), "bfloat16"))
    with bb.function("main", [s, keep, v]):
        with bb.dataflow():
            x = s
            if bias:
                row = np.zeros([n], "float32")
                row[n - 3:] = -np.inf
                if widen:
                    import ml_dtypes

                    x = bb.emit(relax.op.add(x, relax.const(row.astype(ml_dtypes.bfloat16), "bfloat16")))
                else:
                    x = bb.emit(relax.op.add(x, relax.const(row, "float32")))
            p = bb.emit(relax.op.nn.softmax(bb.emit(relax.op.astype(x, "float32")) if widen else x, axis=-1))
            early = bb.emit(relax.op.multiply(p, relax.const(2.0, "float32")))
            pb = bb.emit(relax.op.astype(p, "bfloat16"))
            pw = bb.emit(relax.op.where(keep, pb, relax.const(0.0, "bfloat16")))
            scale = bb.emit(relax.op.astype(relax.const(1.1111111640930176, "float32"), "bfloat16"))
            pd = bb.emit(relax.op.multiply(pw, scale))
            o = bb.emit(relax.op.matmul(pd if dropout else pb, v))
            late = bb.emit(relax.op.multiply(p, early if p_used_early else p))
            out = bb.emit_output(relax.Tuple([o, late, pd]))
        bb.emit_func_output(out)
    return relax.transform.DeadCodeElimination()(bb.get())


def _calls(mod, name="main"):
    return [b.value for block in mod[name].body.blocks for b in block.bindings if isinstance(b.value, relax.Call)]


def test_softmax_and_dropout_tail_become_one_call_with_two_outputs():
    after = FuseSoftmaxDropout()(_attention_probs())
    ops = [c.op.name for c in _calls(after) if isinstance(c.op, tvm.ir.Op)]
    assert "relax.nn.softmax" not in ops and "relax.where" not in ops and "relax.astype" not in ops
    fused = [c for c in _calls(after) if c.op == tvm.ir.Op.get("relax.call_tir")]
    assert len(fused) == 1
    gv = fused[0].args[0]
    assert gv.name_hint == "softmax_dropout_float32_2x3x5x40_bfloat16_mask_s1p11111"
    assert [str(t.dtype) for t in fused[0].ty.fields] == ["float32", "bfloat16"]  # p (still read), pd
    assert after[gv].attrs["tirx.is_scheduled"]


def test_widening_cast_into_the_softmax_is_read_through():
    after = FuseSoftmaxDropout()(_attention_probs(widen=True))
    (fused,) = [c for c in _calls(after) if c.op == tvm.ir.Op.get("relax.call_tir")]
    assert str(fused.args[1].fields[0].ty.dtype) == "bfloat16"
    assert "relax.astype" not in [c.op.name for c in _calls(after) if isinstance(c.op, tvm.ir.Op)]


@pytest.mark.parametrize("widen", [False, True])
def test_row_bias_before_the_softmax_is_an_input_of_the_kernel(widen):
    after = FuseSoftmaxDropout()(_attention_probs(widen=widen, bias=True))
    (fused,) = [c for c in _calls(after) if c.op == tvm.ir.Op.get("relax.call_tir")]
    assert fused.args[0].name_hint.endswith("_bias")
    s, bias, _mask = fused.args[1].fields
    assert isinstance(bias, tvm.ir.GenericConst) and bias.ty.shape.values[0] == 40
    assert "relax.add" not in [c.op.name for c in _calls(after) if isinstance(c.op, tvm.ir.Op)]


def test_left_alone_when_p_is_read_before_the_tail():
    before = _attention_probs(p_used_early=True)
    tvm.ir.assert_structural_equal(FuseSoftmaxDropout()(before), before)


def test_cast_read_besides_the_tail_becomes_an_output():
    """The P·V GEMM (or, after SaveSoftmaxLowPrecision, the softmax gradient) reads the bf16 copy."""
    after = FuseSoftmaxDropout()(_attention_probs(dropout=False))
    (fused,) = [c for c in _calls(after) if c.op == tvm.ir.Op.get("relax.call_tir")]
    assert fused.args[0].name_hint.endswith("_mask_s1p11111_pb")
    assert [str(t.dtype) for t in fused.ty.fields] == ["float32", "bfloat16", "bfloat16"]  # p, pb, pd
    assert "relax.astype" not in [c.op.name for c in _calls(after) if isinstance(c.op, tvm.ir.Op)]


def _run(mod, args, target="llvm", dev=None):
    ex = tvm.compile(mod, target=target)
    vm = relax.VirtualMachine(ex, dev or tvm.cpu())
    return [x.numpy() for x in vm["main"](*[tvm.runtime.tensor(a, dev or tvm.cpu()) for a in args])]


@pytest.mark.parametrize("n,widen,dropout,bias", [(40, False, True, False), (197, False, True, False),
                                                  (40, True, True, False), (40, False, False, False),
                                                  (208, True, True, True), (40, False, True, True)])
def test_fused_kernel_computes_what_the_ops_computed(n, widen, dropout, bias):
    """The rewrite with unscheduled kernels, on the CPU: outputs equal the unfused graph's."""
    import ml_dtypes

    rng = np.random.default_rng()
    args = [(rng.standard_normal((2, 3, 5, n)) * 4).astype(ml_dtypes.bfloat16 if widen else "float32"),
            rng.random((2, 3, 5, n)) > 0.1,
            rng.standard_normal((2, 3, n, 8)).astype(ml_dtypes.bfloat16)]
    before = _attention_probs(n, widen=widen, dropout=dropout, bias=bias)
    want = _run(before, args)
    got = _run(FuseSoftmaxDropout(scheduled=False)(before), args)
    (o_want, late_want, pd_want), (o_got, late_got, pd_got) = want, got
    np.testing.assert_allclose(late_got, late_want, rtol=1e-5, atol=1e-7)  # float32 p: same ops, same order
    # the bf16 tail: LLVM's bf16 legalisation may round cast-then-scale once instead of twice (1 ulp)
    f32 = lambda x: x.astype("float32")
    np.testing.assert_allclose(f32(pd_got), f32(pd_want), rtol=2**-7, atol=0)
    np.testing.assert_allclose(f32(o_got), f32(o_want), rtol=2e-2, atol=2e-2)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc to build CUDA code")
@pytest.mark.parametrize("n,biased", [(197, False), (512, False), (1024, False), (208, True)])
def test_scheduled_kernel_builds_for_cuda(n, biased):
    """No GPU needed: the schedule lowers and the CUDA source has the row reductions."""
    func = softmax_dropout_primfunc((4, 16, n), "bfloat16", True, 1.25, True, biased=biased)
    lib = tvm.compile(tvm.IRModule({"main": func}), target=tvm.target.Target(CUDA))
    src = lib.mod.imports[0].inspect_source()
    assert "__shfl_down_sync" in src and "__shared__" in src


@pytest.mark.gpu
@pytest.mark.parametrize("n,biased", [(197, False), (512, False), (1024, False), (208, True)])
def test_scheduled_kernel_on_gpu_matches_torch(n, biased):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    rows, scale = 4096, 1 / 0.9
    func = softmax_dropout_primfunc((rows, n), "bfloat16", True, scale, True, biased=biased)
    lib = tvm.compile(tvm.IRModule({"main": func}), target=tvm.target.Target(CUDA))
    s = torch.randn(rows, n, device="cuda") * 4
    bias = torch.zeros(n, device="cuda")
    bias[197:] = float("-inf")  # PadAttentionKeys' mask: 197 keys padded to 208
    keep = torch.rand(rows, n, device="cuda") > 0.1
    p = torch.full((rows, n), float("nan"), device="cuda")
    pd = torch.full((rows, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    lib["main"](*[tvm.runtime.from_dlpack(t) for t in (s, *([bias] if biased else []), keep, p, pd)])
    torch.cuda.synchronize()
    ref = torch.softmax((s + bias).double() if biased else s.double(), dim=-1)
    if biased:
        assert torch.equal(p[:, 197:], torch.zeros_like(p[:, 197:]))  # the padded keys: exactly 0
    assert torch.allclose(p.double(), ref, rtol=1e-5, atol=1e-7)
    # the low-precision copy rounds the kernel's own float32 P: rounding the float64 reference
    # instead lands one bf16 ulp away where P sits at a rounding boundary (0.4-0.8% each, twice
    # with the scale), which 4M elements of a 1024-wide row hit
    ref_pd = torch.where(keep, p.to(torch.bfloat16), 0) * torch.tensor(scale).to(torch.bfloat16)
    assert torch.equal(pd.isnan(), ref_pd.isnan()) and not pd.isnan().any()
    assert torch.allclose(pd.float(), ref_pd.float(), rtol=1e-2, atol=1e-6)


def test_scale_only_tail_fuses_without_extra_outputs():
    """softmax -> cast -> scale (no mask): one kernel writing just the scaled copy."""
    bb = relax.BlockBuilder()
    s = relax.Var("s", relax.TensorType((2, 3, 5, 40), "float32"))
    with bb.function("main", [s]):
        with bb.dataflow():
            p = bb.emit(relax.op.nn.softmax(s, axis=-1))
            pb = bb.emit(relax.op.astype(p, "bfloat16"))
            out = bb.emit_output(bb.emit(relax.op.multiply(pb, relax.const(1.5, "bfloat16"))))
        bb.emit_func_output(out)
    (fused,) = [c for c in _calls(FuseSoftmaxDropout()(bb.get())) if c.op == tvm.ir.Op.get("relax.call_tir")]
    assert fused.args[0].name_hint == "softmax_dropout_float32_2x3x5x40_bfloat16_s1p5_nop"
    assert str(fused.ty.dtype) == "bfloat16"  # one output

import shutil

import numpy as np
import pytest
import tvm
from tvm import relax

from tvm_evt.relax_passes.lower.fuse_layer_norm_backward import FuseLayerNormBackward, find_chains, layer_norm_grad_primfunc

CUDA = {"kind": "cuda", "arch": "sm_90a"}
CALL_TIR = tvm.ir.Op.get("relax.call_tir")


def _input_gradient(emit, g, xhat, rstd, h=None):
    """dx = rstd * (g - mean(g) - xhat * mean(h)), h = g * xhat unless given: the ops
    FuseLayerNormBackward matches."""
    h = h if h is not None else emit(relax.op.multiply(g, xhat))
    a = emit(relax.op.subtract(g, emit(relax.op.mean(g, [2], keepdims=True))))
    c = emit(relax.op.multiply(xhat, emit(relax.op.mean(h, [2], keepdims=True))))
    return emit(relax.op.multiply(rstd, emit(relax.op.subtract(a, c))))


def _grad(n=64, given=False, dx_read=False):
    """gradient_rules.layer_norm_grad's spelling: dx = rstd * ((g - mean(g)) - xhat * mean(g * xhat)),
    g = dy * gamma (or g and h given, as a GEMM epilogue leaves them), dx cast to bf16."""
    bb = relax.BlockBuilder()
    t = lambda name, shape: relax.Var(name, relax.TensorType(shape, "float32"))  # noqa: E731
    dy, gamma, xhat, rstd = t("dy", (2, 5, n)), t("gamma", (n,)), t("xhat", (2, 5, n)), t("rstd", (2, 5, 1))
    gin, hin = t("g", (2, 5, n)), t("h", (2, 5, n))
    params = [gin, hin, xhat, rstd] if given else [dy, gamma, xhat, rstd]
    with bb.function("main", params):
        with bb.dataflow():
            emit = bb.emit
            if given:
                g, h = gin, hin
            else:
                g = emit(relax.op.multiply(dy, emit(relax.op.reshape(gamma, (1, 1, n)))))
                h = None
            dx = _input_gradient(emit, g, xhat, rstd, h)
            outs = [emit(relax.op.astype(dx, "bfloat16"))] + ([emit(relax.op.multiply(dx, dx))] if dx_read else [])
            out = bb.emit_output(relax.Tuple(outs))
        bb.emit_func_output(out)
    return bb.get()


def _calls(mod, name="main"):
    return [b.value for block in mod[name].body.blocks for b in block.bindings if isinstance(b.value, relax.Call)]


@pytest.mark.parametrize("given,dx_read,name", [
    (False, False, "layer_norm_grad_2x5x64_dyg_bfloat16"),
    (True, False, "layer_norm_grad_2x5x64_g_h_bfloat16"),
    (False, True, "layer_norm_grad_2x5x64_dyg_dx_bfloat16")])
def test_gradient_chain_becomes_one_call(given, dx_read, name):
    after = FuseLayerNormBackward()(_grad(given=given, dx_read=dx_read))
    ops = [c.op.name for c in _calls(after) if isinstance(c.op, tvm.ir.Op)]
    assert "relax.mean" not in ops and "relax.subtract" not in ops and "relax.astype" not in ops
    (fused,) = [c for c in _calls(after) if c.op == CALL_TIR]
    assert fused.args[0].name_hint == name
    assert after[fused.args[0]].attrs["tirx.is_scheduled"]


def test_left_alone_when_an_intermediate_is_read_elsewhere():
    before = _grad()
    func = before["main"]
    assert find_chains(func)
    # read mean(g) a second time: the chain no longer owns it
    bb = relax.BlockBuilder()
    n = 64
    t = lambda name, shape: relax.Var(name, relax.TensorType(shape, "float32"))  # noqa: E731
    g, h, xhat, rstd = t("g", (2, 5, n)), t("h", (2, 5, n)), t("xhat", (2, 5, n)), t("rstd", (2, 5, 1))
    with bb.function("main", [g, h, xhat, rstd]):
        with bb.dataflow():
            m1 = bb.emit(relax.op.mean(g, [2], keepdims=True))
            a = bb.emit(relax.op.subtract(g, m1))
            c = bb.emit(relax.op.multiply(xhat, bb.emit(relax.op.mean(h, [2], keepdims=True))))
            dx = bb.emit(relax.op.multiply(rstd, bb.emit(relax.op.subtract(a, c))))
            out = bb.emit_output(relax.Tuple([dx, m1]))
        bb.emit_func_output(out)
    mod = bb.get()
    tvm.ir.assert_structural_equal(FuseLayerNormBackward()(mod), mod)


def _run(mod, args):
    ex = tvm.compile(mod, target="llvm")
    out = relax.VirtualMachine(ex, tvm.cpu())["main"](*[tvm.runtime.tensor(a) for a in args])
    return [x.numpy() for x in out]


@pytest.mark.parametrize("given,dx_read,n", [(False, False, 64), (True, True, 64), (False, True, 1000)])
def test_fused_kernel_computes_what_the_ops_computed(given, dx_read, n):
    rng = np.random.default_rng()
    shapes = [(2, 5, n), (2, 5, n) if given else (n,), (2, 5, n), (2, 5, 1)]
    args = [rng.standard_normal(s).astype("float32") for s in shapes]
    before = _grad(n, given, dx_read)
    want, got = _run(before, args), _run(FuseLayerNormBackward(scheduled=False)(before), args)
    assert len(want) == len(got)
    for w, g in zip(want, got):
        np.testing.assert_allclose(g.astype("float32"), w.astype("float32"), rtol=2**-7, atol=1e-5)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc to build CUDA code")
def test_scheduled_kernel_builds_for_cuda():
    func = layer_norm_grad_primfunc((4, 16, 1024), (1, 1, 1024), False, True, "bfloat16")
    lib = tvm.compile(tvm.IRModule({"main": func}), target=tvm.target.Target(CUDA))
    src = lib.mod.imports[0].inspect_source()
    assert "__shfl_down_sync" in src and "__shared__" in src


@pytest.mark.gpu
@pytest.mark.parametrize("n", [768, 1024])
def test_scheduled_kernel_on_gpu_matches_torch_autograd(n):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    rows = 4096
    func = layer_norm_grad_primfunc((rows, n), (n,), False, True, "bfloat16")
    lib = tvm.compile(tvm.IRModule({"main": func}), target=tvm.target.Target(CUDA))
    x = (torch.randn(rows, n, device="cuda", dtype=torch.float64) * 3 + 1).requires_grad_()
    gamma, dy = torch.randn(n, device="cuda", dtype=torch.float64), torch.randn(rows, n, device="cuda", dtype=torch.float64)
    torch.nn.functional.layer_norm(x, (n,), gamma, None, 1e-5).backward(dy)
    rstd = 1 / torch.sqrt(x.detach().var(-1, unbiased=False, keepdim=True) + 1e-5)
    xhat = (x.detach() - x.detach().mean(-1, keepdim=True)) * rstd
    dx = torch.full((rows, n), float("nan"), device="cuda")
    dxl = torch.full((rows, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    ins = [t.float().contiguous() for t in (dy, gamma, xhat, rstd)]
    lib["main"](*[tvm.runtime.from_dlpack(t) for t in (*ins, dx, dxl)])
    torch.cuda.synchronize()
    ref = x.grad
    assert (dx.double() - ref).norm() <= 1e-5 * ref.norm()
    assert (dxl.double() - ref).norm() <= 1e-2 * ref.norm()


def _recomputed_inputs(n=64, lead=(2, 5)):
    """The gradient of a layer norm whose forward saved x16 and the row statistics, not xhat
    (FuseLayerNorm's recompute): xhat = (astype(x16) - mean) * rstd, and dy an elementwise
    function of xhat (a loss on the normalized value), both also read by the weight gradients."""
    bb = relax.BlockBuilder()
    x16 = relax.Var("x16", relax.TensorType((*lead, n), "bfloat16"))
    t = lambda name, shape: relax.Var(name, relax.TensorType(shape, "float32"))  # noqa: E731
    mean, rstd, gamma, y = t("mean", (*lead, 1)), t("rstd", (*lead, 1)), t("gamma", (n,)), t("y", (*lead, n))
    with bb.function("main", [x16, mean, rstd, gamma, y]):
        with bb.dataflow():
            emit = bb.emit
            xhat = emit(relax.op.multiply(emit(relax.op.subtract(emit(relax.op.astype(x16, "float32")), mean)), rstd))
            dy = emit(relax.op.multiply(emit(relax.op.subtract(xhat, y)), relax.const(2.0, "float32")))
            g = emit(relax.op.multiply(dy, gamma))
            dx = _input_gradient(emit, g, xhat, rstd)
            dgamma = emit(relax.op.sum(emit(relax.op.multiply(dy, xhat)), list(range(len(lead)))))
            dbeta = emit(relax.op.sum(dy, list(range(len(lead)))))
            out = bb.emit_output(relax.Tuple([emit(relax.op.astype(dx, "bfloat16")), dgamma, dbeta]))
        bb.emit_func_output(out)
    return bb.get()


def test_elementwise_producers_of_the_inputs_are_computed_in_the_kernel():
    """xhat and dy are not read: the kernel reads x16 (2 bytes an element), the statistics and y,
    and computes them -- their bindings stay for the weight gradients' sums."""
    before = _recomputed_inputs()
    after = FuseLayerNormBackward()(before)
    (fused,) = [c for c in _calls(after) if c.op == CALL_TIR]
    assert fused.args[0].name_hint.startswith("layer_norm_grad_2x5x64_dyg_bfloat16_p")
    x16, mean, rstd, gamma, y = after["main"].params
    got = list(fused.args[1].fields)
    assert len(got) == 5 and all(any(a.same_as(p) for a in got) for p in (x16, mean, rstd, gamma, y))
    ops = [c.op.name for c in _calls(after) if isinstance(c.op, tvm.ir.Op)]
    assert ops.count("relax.mean") == 0 and ops.count("relax.sum") == 2


def test_a_kernel_with_a_prologue_computes_what_the_ops_computed():
    import ml_dtypes

    rng = np.random.default_rng()
    n = 64
    args = [(rng.standard_normal((2, 5, n)) * 2 + 1).astype(ml_dtypes.bfloat16),
            rng.standard_normal((2, 5, 1)).astype("float32"), rng.uniform(0.5, 2, (2, 5, 1)).astype("float32"),
            rng.standard_normal(n).astype("float32"), rng.standard_normal((2, 5, n)).astype("float32")]
    before = _recomputed_inputs(n)
    want, got = _run(before, args), _run(FuseLayerNormBackward(scheduled=False)(before), args)
    for w, g in zip(want, got):
        np.testing.assert_allclose(g.astype("float32"), w.astype("float32"), rtol=2**-7, atol=1e-4)


ROWS = (4, 4224)  # 16896 rows: groups of 4 at 64 columns (rows_per_block: 4224 blocks of 32 threads fill the GPU)


def _ml_inputs(n, lead):
    import ml_dtypes

    rng = np.random.default_rng(0)
    return [(rng.standard_normal((*lead, n)) * 2 + 1).astype(ml_dtypes.bfloat16),
            rng.standard_normal((*lead, 1)).astype("float32"), rng.uniform(0.5, 2, (*lead, 1)).astype("float32"),
            rng.standard_normal(n).astype("float32"), rng.standard_normal((*lead, n)).astype("float32")]


def test_the_weight_gradients_are_partial_sums_of_the_kernel():
    """With rows enough, sum(dy * xhat) and sum(dy) over the rows come out of the kernel as
    partial sums over groups of 4 rows ([groups, V, threads]); what is left of them is a sum over
    the 4224 groups."""
    after = FuseLayerNormBackward()(_recomputed_inputs(64, ROWS))
    (fused,) = [c for c in _calls(after) if c.op == CALL_TIR]
    assert fused.args[0].name_hint.startswith("layer_norm_grad_4x4224x64_dyg_bfloat16_sum_dy_xhat_sum_dy_g4_p")
    assert [tuple(int(d) for d in f.shape) for f in fused.ty.fields] == [(4, 4224, 64), (4224, 2, 32), (4224, 2, 32)]
    sums = [c for c in _calls(after) if isinstance(c.op, tvm.ir.Op) and c.op.name == "relax.sum"]
    assert [tuple(int(d) for d in c.args[0].ty.shape) for c in sums] == [(4224, 64), (4224, 64)]
    assert not any(c.op.name == "relax.multiply" for c in _calls(after) if isinstance(c.op, tvm.ir.Op))


def test_a_kernel_with_weight_gradient_partials_computes_what_the_ops_computed():
    args = _ml_inputs(64, ROWS)
    before = _recomputed_inputs(64, ROWS)
    want, got = _run(before, args), _run(FuseLayerNormBackward(scheduled=False)(before), args)
    np.testing.assert_allclose(got[0].astype("float32"), want[0].astype("float32"), rtol=2**-7, atol=1e-4)
    for w, g in zip(want[1:], got[1:]):  # float32 sums over 4224 rows, associated differently
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4 * np.abs(w).max())


def test_a_weight_gradient_read_before_the_kernel_stays_a_sum():
    """The fused call sits at the chain's last op: a sum something reads before that is left."""
    before = _recomputed_inputs(64, ROWS)
    bb = relax.BlockBuilder()
    params = list(before["main"].params)
    with bb.function("main", params):
        x16, mean, rstd, gamma, y = params
        with bb.dataflow():
            emit = bb.emit
            xhat = emit(relax.op.multiply(emit(relax.op.subtract(emit(relax.op.astype(x16, "float32")), mean)), rstd))
            dy = emit(relax.op.multiply(emit(relax.op.subtract(xhat, y)), relax.const(2.0, "float32")))
            dbeta = emit(relax.op.sum(dy, [0, 1]))
            early = emit(relax.op.multiply(dbeta, relax.const(3.0, "float32")))  # before the chain's end
            dx = _input_gradient(emit, emit(relax.op.multiply(dy, gamma)), xhat, rstd)
            dgamma = emit(relax.op.sum(emit(relax.op.multiply(dy, xhat)), [0, 1]))
            out = bb.emit_output(relax.Tuple([emit(relax.op.astype(dx, "bfloat16")), dgamma, early]))
        bb.emit_func_output(out)
    after = FuseLayerNormBackward()(bb.get())
    (fused,) = [c for c in _calls(after) if c.op == CALL_TIR]
    assert "_bfloat16_sum_dy_xhat_g4_p" in fused.args[0].name_hint  # dgamma's partials alone
    args = _ml_inputs(64, ROWS)
    want, got = _run(bb.get(), args), _run(FuseLayerNormBackward(scheduled=False)(bb.get()), args)
    for w, g in zip(want, got):
        np.testing.assert_allclose(g.astype("float32"), w.astype("float32"), rtol=1e-2, atol=1e-3 * np.abs(w.astype("float32")).max())


def _with_tail(n=64):
    """A layer norm's input gradient whose only reader is a residual add, a cast to bf16,
    dropout's scale and its mask (GPT-2's first layer norm): the kernel's epilogue."""
    bb = relax.BlockBuilder()
    t = lambda name, shape, dtype="float32": relax.Var(name, relax.TensorType(shape, dtype))  # noqa: E731
    g, xhat, rstd = t("g", (2, 5, n)), t("xhat", (2, 5, n)), t("rstd", (2, 5, 1))
    resid, keep, scale = t("resid", (2, 5, n)), t("keep", (2, 5, n), "bool"), t("scale", (), "bfloat16")
    with bb.function("main", [g, xhat, rstd, resid, keep, scale]):
        with bb.dataflow():
            emit = bb.emit
            dx = _input_gradient(emit, g, xhat, rstd)
            total = emit(relax.op.add(resid, dx))
            scaled = emit(relax.op.multiply(emit(relax.op.astype(total, "bfloat16")), scale))
            masked = emit(relax.op.where(keep, scaled, relax.const(0.0, "bfloat16")))
            out = bb.emit_output(relax.Tuple([masked]))
        bb.emit_func_output(out)
    return bb.get()


def test_the_ops_that_alone_read_dx_are_the_kernels_epilogue():
    after = FuseLayerNormBackward(epilogue=True)(_with_tail())
    ops = [c.op.name for c in _calls(after) if isinstance(c.op, tvm.ir.Op)]
    assert ops == ["relax.call_tir"], ops  # and the returned tuple
    (fused,) = [c for c in _calls(after) if c.op == CALL_TIR]
    assert fused.args[0].name_hint.startswith("layer_norm_grad_2x5x64_g_tail_p")
    assert str(fused.ty.dtype) == "bfloat16"  # only the masked result is written
    # without epilogue=True (the pipeline passes ln_epilogue's switch): dx is written and the tail left to TVM
    default = FuseLayerNormBackward()(_with_tail())
    assert [c.op.name for c in _calls(default) if isinstance(c.op, tvm.ir.Op)].count("relax.where") == 1


def test_a_kernel_with_an_epilogue_computes_what_the_ops_computed():
    import ml_dtypes

    rng = np.random.default_rng()
    n = 64
    f = lambda *s: rng.standard_normal(s).astype("float32")  # noqa: E731
    args = [f(2, 5, n), f(2, 5, n), rng.uniform(0.5, 2, (2, 5, 1)).astype("float32"), f(2, 5, n),
            rng.integers(0, 2, (2, 5, n)).astype(bool), np.array(1.1111, dtype=ml_dtypes.bfloat16)]
    before = _with_tail(n)
    want, got = _run(before, args), _run(FuseLayerNormBackward(scheduled=False, epilogue=True)(before), args)
    np.testing.assert_allclose(got[0].astype("float32"), want[0].astype("float32"), rtol=2**-7, atol=1e-5)


def _with_cast_tail(n=64):
    """BERT-Large's layer-norm gradients: dx cast to bf16, the cast read by dropout's backward
    (scale, mask) and, after it, by a GEMM (here a matmul): the kernel writes the cast and the
    masked result."""
    bb = relax.BlockBuilder()
    t = lambda name, shape, dtype="float32": relax.Var(name, relax.TensorType(shape, dtype))  # noqa: E731
    g, xhat, rstd = t("g", (2, 5, n)), t("xhat", (2, 5, n)), t("rstd", (2, 5, 1))
    keep, scale, w = t("keep", (2, 5, n), "bool"), t("scale", (), "bfloat16"), t("w", (n, 8), "bfloat16")
    with bb.function("main", [g, xhat, rstd, keep, scale, w]):
        with bb.dataflow():
            emit = bb.emit
            dx = _input_gradient(emit, g, xhat, rstd)
            dx16 = emit(relax.op.astype(dx, "bfloat16"))
            masked = emit(relax.op.where(keep, emit(relax.op.multiply(dx16, scale)), relax.const(0.0, "bfloat16")))
            proj = emit(relax.op.matmul(dx16, w))
            out = bb.emit_output(relax.Tuple([masked, proj]))
        bb.emit_func_output(out)
    return bb.get()


def test_a_chain_on_dx_s_cast_beside_its_other_readers_is_the_kernels_epilogue():
    after = FuseLayerNormBackward(epilogue=True)(_with_cast_tail())
    ops = [c.op.name for c in _calls(after) if isinstance(c.op, tvm.ir.Op)]
    assert ops.count("relax.where") == 0 and ops.count("relax.matmul") == 1, ops
    (fused,) = [c for c in _calls(after) if c.op == CALL_TIR]
    assert fused.args[0].name_hint.startswith("layer_norm_grad_2x5x64_g_bfloat16_tail_p")
    assert [str(f.dtype) for f in fused.ty.fields] == ["bfloat16", "bfloat16"]  # the cast and the masked result
    import ml_dtypes

    rng = np.random.default_rng()
    f = lambda *s: rng.standard_normal(s).astype("float32")  # noqa: E731
    args = [f(2, 5, 64), f(2, 5, 64), rng.uniform(0.5, 2, (2, 5, 1)).astype("float32"),
            rng.integers(0, 2, (2, 5, 64)).astype(bool), np.array(1.1111, dtype=ml_dtypes.bfloat16),
            f(64, 8).astype(ml_dtypes.bfloat16)]
    before = _with_cast_tail()
    want = _run(before, args)
    got = _run(FuseLayerNormBackward(scheduled=False, epilogue=True)(before), args)
    # the cast the GEMM reads is the ops' to the bit; the masked result within a bf16 ulp: TVM's
    # CPU lowering computes bf16 arithmetic in float32 and drops the round trip of the cast that
    # feeds it, so the fused kernel rounds dx * scale once where the separate kernels round twice
    np.testing.assert_array_equal(got[1], want[1])
    np.testing.assert_allclose(got[0].astype("float32"), want[0].astype("float32"), rtol=2**-7, atol=1e-5)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc to build CUDA code")
def test_a_scheduled_kernel_with_a_cast_epilogue_builds_for_cuda():
    """On CUDA the chain multiplies the bf16 cast in bf16, as the separate kernel does."""
    after = FuseLayerNormBackward(epilogue=True)(_with_cast_tail(1024))
    (fused,) = [c for c in _calls(after) if c.op == CALL_TIR]
    func = after[fused.args[0]].with_attr("global_symbol", "main")
    src = tvm.compile(tvm.IRModule({"main": func}), target=tvm.target.Target(CUDA)).mod.imports[0].inspect_source()
    assert "nv_bfloat16* __restrict__ dx_v0_ptr, nv_bfloat16* __restrict__ dx_v1_ptr" in src  # cast, masked
    assert "__shfl_down_sync" in src


def test_a_cast_chain_is_left_when_a_reader_of_the_cast_comes_before_it():
    """The fused call sits at the chain's last op: a reader of the cast bound before that would
    read a value not yet computed, so the kernel keeps no tail."""
    mod = _with_cast_tail()
    bb = relax.BlockBuilder()
    params = list(mod["main"].params)
    with bb.function("main", params):
        g, xhat, rstd, keep, scale, w = params
        with bb.dataflow():
            emit = bb.emit
            dx = _input_gradient(emit, g, xhat, rstd)
            dx16 = emit(relax.op.astype(dx, "bfloat16"))
            proj = emit(relax.op.matmul(dx16, w))  # before the chain
            masked = emit(relax.op.where(keep, emit(relax.op.multiply(dx16, scale)), relax.const(0.0, "bfloat16")))
            out = bb.emit_output(relax.Tuple([masked, proj]))
        bb.emit_func_output(out)
    after = FuseLayerNormBackward(epilogue=True)(bb.get())
    (fused,) = [c for c in _calls(after) if c.op == CALL_TIR]
    assert "_tail" not in fused.args[0].name_hint
    assert [c.op.name for c in _calls(after) if isinstance(c.op, tvm.ir.Op)].count("relax.where") == 1


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc to build CUDA code")
def test_a_scheduled_kernel_with_an_epilogue_builds_for_cuda():
    after = FuseLayerNormBackward(epilogue=True)(_with_tail(1024))
    (fused,) = [c for c in _calls(after) if c.op == CALL_TIR]
    func = after[fused.args[0]]
    lib = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target=tvm.target.Target(CUDA))
    assert "__shfl_down_sync" in lib.mod.imports[0].inspect_source()


def _rms_grad(n=64, given=False, lead=(2, 5), dw=False):
    """gradient_rules.rms_norm_grad's spelling: dx = rstd * (g - xhat * mean(g * xhat)), g = dy * w
    (or g given, as a GEMM epilogue leaves it), dx cast to bf16; with `dw`, the weight's gradient
    sum(dy * xhat) over the rows too."""
    bb = relax.BlockBuilder()
    t = lambda name, shape: relax.Var(name, relax.TensorType(shape, "float32"))  # noqa: E731
    dy, w, xhat, rstd = t("dy", (*lead, n)), t("w", (n,)), t("xhat", (*lead, n)), t("rstd", (*lead, 1))
    gin = t("g", (*lead, n))
    with bb.function("main", [gin, xhat, rstd] if given else [dy, w, xhat, rstd]):
        with bb.dataflow():
            emit = bb.emit
            g = gin if given else emit(relax.op.multiply(dy, emit(relax.op.reshape(w, (1,) * len(lead) + (n,)))))
            c = emit(relax.op.multiply(xhat, emit(relax.op.mean(emit(relax.op.multiply(g, xhat)), [len(lead)],
                                                                keepdims=True))))
            dx = emit(relax.op.multiply(rstd, emit(relax.op.subtract(g, c))))
            outs = [emit(relax.op.astype(dx, "bfloat16"))]
            if dw:
                outs.append(emit(relax.op.sum(emit(relax.op.multiply(dy, xhat)), list(range(len(lead))))))
            out = bb.emit_output(relax.Tuple(outs))
        bb.emit_func_output(out)
    return bb.get()


@pytest.mark.parametrize("given,name", [(False, "rms_norm_grad_2x5x64_dyg_bfloat16"),
                                        (True, "rms_norm_grad_2x5x64_g_bfloat16")])
def test_rms_norm_gradient_chain_becomes_one_call(given, name):
    after = FuseLayerNormBackward()(_rms_grad(given=given))
    ops = [c.op.name for c in _calls(after) if isinstance(c.op, tvm.ir.Op)]
    assert "relax.mean" not in ops and "relax.subtract" not in ops and "relax.astype" not in ops
    (fused,) = [c for c in _calls(after) if c.op == CALL_TIR]
    assert fused.args[0].name_hint == name
    script = after[fused.args[0]].script()
    assert "sum_h" in script and "sum_g" not in script  # no mean(g) taken out


@pytest.mark.parametrize("given,n", [(False, 64), (True, 1000)])
def test_rms_norm_kernel_computes_what_the_ops_computed(given, n):
    rng = np.random.default_rng()
    shapes = [(2, 5, n), (2, 5, n), (2, 5, 1)] if given else [(2, 5, n), (n,), (2, 5, n), (2, 5, 1)]
    args = [rng.standard_normal(s).astype("float32") for s in shapes]
    before = _rms_grad(n, given)
    (want,), (got,) = _run(before, args), _run(FuseLayerNormBackward(scheduled=False)(before), args)
    np.testing.assert_allclose(got.astype("float32"), want.astype("float32"), rtol=2**-7, atol=1e-5)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc to build CUDA code")
def test_scheduled_rms_norm_kernel_builds_for_cuda():
    func = layer_norm_grad_primfunc((4, 16, 4096), (1, 1, 4096), False, True, "bfloat16", centered=False)
    lib = tvm.compile(tvm.IRModule({"main": func}), target=tvm.target.Target(CUDA))
    assert "__shfl_down_sync" in lib.mod.imports[0].inspect_source()


def _rms_kernel_with_dw(n, lead):
    """The fused kernel of `_rms_grad` with its weight gradient, and the names of the main
    function's values it reads, in its parameter order (``w`` read through its reshape)."""
    after = FuseLayerNormBackward()(_rms_grad(n, lead=lead, dw=True))
    (fused,) = [c for c in _calls(after) if c.op == CALL_TIR]
    assert "_sum_dy_xhat_g" in fused.args[0].name_hint
    params = {p: p.name for p in after["main"].params}
    names = [next((name for p, name in params.items() if p.same_as(a)), "w") for a in fused.args[1].fields]
    return after[fused.args[0]].with_attr("global_symbol", "main"), names


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc to build CUDA code")
def test_scheduled_rms_norm_kernel_with_weight_gradient_partials_builds_for_cuda():
    """Each thread keeps its 8 columns' partial sums in registers (4096 over 512 threads)."""
    func, _ = _rms_kernel_with_dw(4096, ROWS)
    src = tvm.compile(tvm.IRModule({"main": func}), target=tvm.target.Target(CUDA)).mod.imports[0].inspect_source()
    assert "float colsum0_local_ptr[8];" in src and "__shfl_down_sync" in src


def test_scheduled_rms_norm_kernel_with_weight_gradient_partials_serialized_computes_what_the_ops_computed():
    """The CUDA schedule (groups of rows walked by a block, merged loop nests, partial sums in
    registers), its thread bindings made serial loops and built for llvm, against the kernel
    before scheduling: the schedule keeps what the kernel computes."""
    from _te_kernels import run_on_llvm, serial

    func, names = _rms_kernel_with_dw(256, ROWS)
    plain = FuseLayerNormBackward(scheduled=False)(_rms_grad(256, lead=ROWS, dw=True))
    (call,) = [c for c in _calls(plain) if c.op == CALL_TIR]
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal([int(d) for d in p.shape]).astype(str(p.dtype)) for p in func.params]
    want, got = (run_on_llvm(f, arrays)[len(names):] for f in (plain[call.args[0]], serial(func)))
    for w, g in zip(want, got):
        np.testing.assert_array_equal(g.astype("float32"), w.astype("float32"))


@pytest.mark.gpu
@pytest.mark.parametrize("n,lead", [(4096, (4, 2048)), (1024, (16, 512))])
def test_rms_norm_kernel_with_weight_gradient_partials_on_gpu_matches_torch(n, lead):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    func, names = _rms_kernel_with_dw(n, lead)
    lib = tvm.compile(tvm.IRModule({"main": func}), target=tvm.target.Target(CUDA))
    x = torch.randn(*lead, n, device="cuda", dtype=torch.float64).requires_grad_()
    w, dy = torch.randn(n, device="cuda", dtype=torch.float64), torch.randn(*lead, n, device="cuda", dtype=torch.float64)
    torch.nn.functional.rms_norm(x, (n,), w, 1e-6).backward(dy)
    rstd = torch.rsqrt(x.detach().pow(2).mean(-1, keepdim=True) + 1e-6)
    xhat = x.detach() * rstd
    values = {"dy": dy, "w": w.reshape(*(1,) * len(lead), n), "xhat": xhat, "rstd": rstd}
    dx = torch.full((*lead, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    partial = torch.full([int(d) for d in func.params[-1].shape], float("nan"), device="cuda")
    ins = [values[name].float().contiguous() for name in names]
    lib["main"](*[tvm.runtime.from_dlpack(t) for t in (*ins, dx, partial)])
    torch.cuda.synchronize()
    dw = partial.double().reshape(-1, n).sum(0)
    want = (dy * xhat).sum(tuple(range(len(lead))))
    assert (dw - want).norm() <= 1e-5 * want.norm()
    assert (dx.double() - x.grad).norm() <= 1e-2 * x.grad.norm()


@pytest.mark.parametrize("shape,rows", [
    ((4, 2048, 4096), 16),  # Llama: 8192 rows, 512 groups (512 threads: 528 blocks fill an H100/H200)
    ((32, 512, 1024), 8),   # BERT-Large: 16384 rows, 2048 groups (128 threads: 2112 blocks)
    ((128, 197, 768), 8),   # ViT-B/16: 25216 = 2^7 * 197 rows, 3152 groups (96 threads: 2772 blocks)
    ((66, 1024, 1024), 32),  # GPT-2 medium at batch 66: 2112 groups
    ((1, 512, 4096), None),  # 512 rows: groups of 4 leave a quarter of the GPU's 528 blocks
    ((2, 5, 64), None),     # too few rows for groups of 4
    ((4, 2048, 1000), None),  # 1000 columns do not split over 128 threads
])
def test_rows_a_block_walks(shape, rows):
    from tvm_evt.relax_passes.lower._row_kernel import rows_per_block

    assert rows_per_block(shape) == rows


def _norm_step(n=64, m=32, lead=(2, 5), centered=True, wgrad="before", reader_after=False):
    """A norm's forward and backward as the step spells them before FuseLayerNorm: the norm of a
    widened bf16 x (a layer norm with scale and shift, or an RMS norm with a scale), its bf16 result
    y read by a forward GEMM whose output the norm's incoming gradient dy is computed from, and,
    through a reshape, by that GEMM's weight gradient, bound `wgrad` ("before", "after" or None)
    the norm's input gradient; `reader_after`: y also read by the computation of dy, after the
    weight gradient."""
    bb = relax.BlockBuilder()
    rows = int(np.prod(lead))
    x16 = relax.Var("x16", relax.TensorType((*lead, n), "bfloat16"))
    gamma, beta = relax.Var("gamma", relax.TensorType((n,), "float32")), relax.Var("beta", relax.TensorType((n,), "float32"))
    w, w2 = relax.Var("w", relax.TensorType((n, m), "bfloat16")), relax.Var("w2", relax.TensorType((m, n), "bfloat16"))
    dz = relax.Var("dz", relax.TensorType((rows, m), "bfloat16"))
    axis = [len(lead)]
    with bb.function("main", [x16, gamma, beta, w, w2, dz]):
        with bb.dataflow():
            emit = bb.emit
            x = emit(relax.op.astype(x16, "float32"))
            if centered:
                mean = emit(relax.op.mean(x, axis, keepdims=True))
                base = emit(relax.op.subtract(x, mean))
            else:
                base = x
            var = emit(relax.op.mean(emit(relax.op.multiply(base, base)), axis, keepdims=True))
            rstd = emit(relax.op.rsqrt(emit(relax.op.add(var, relax.const(1e-5, "float32")))))
            xhat = emit(relax.op.multiply(base, rstd))
            g_row = emit(relax.op.reshape(gamma, (1,) * len(lead) + (n,)))
            y = emit(relax.op.multiply(xhat, g_row))
            if centered:
                y = emit(relax.op.add(y, emit(relax.op.reshape(beta, (1,) * len(lead) + (n,)))))
            yl = emit(relax.op.astype(y, "bfloat16"))
            out = emit(relax.op.matmul(yl, w))

            def weight_gradient():
                return emit(relax.op.matmul(emit(relax.op.permute_dims(emit(relax.op.reshape(yl, (rows, n))))), dz))

            results = [out]
            if wgrad == "before":
                results.append(weight_gradient())
            t = emit(relax.op.matmul(out, w2))
            if reader_after:
                t = emit(relax.op.add(t, yl))
            dy = emit(relax.op.astype(t, "float32"))
            g = emit(relax.op.multiply(dy, g_row))
            dx = _input_gradient(emit, g, xhat, rstd) if centered else _rms_input_gradient(emit, g, xhat, rstd)
            results.append(emit(relax.op.astype(dx, "bfloat16")))
            if wgrad == "after":
                results.append(weight_gradient())
            result = bb.emit_output(relax.Tuple(results))
        bb.emit_func_output(result)
    return bb.get()


def _rms_input_gradient(emit, g, xhat, rstd):
    """dx = rstd * (g - xhat * mean(g * xhat)): an RMS norm's (gradient_rules.rms_norm_grad)."""
    c = emit(relax.op.multiply(xhat, emit(relax.op.mean(emit(relax.op.multiply(g, xhat)), [2], keepdims=True))))
    return emit(relax.op.multiply(rstd, emit(relax.op.subtract(g, c))))


def _norm_passes(mod, norm_output, scheduled=True):
    from tvm_evt.relax_passes.lower.fuse_layer_norm import FuseLayerNorm

    return FuseLayerNormBackward(scheduled=scheduled, norm_output=norm_output)(FuseLayerNorm(scheduled=scheduled)(mod))


def _order(mod):
    """[(var, bound value)] of main's bindings, in order."""
    return [(b.var, b.value) for block in mod["main"].body.blocks for b in block.bindings]


@pytest.mark.parametrize("centered", [True, False])
def test_the_norm_s_result_is_written_again_for_the_weight_gradient_moved_after_the_kernel(centered):
    """The weight gradient read the forward's bf16 y (through a reshape) before the norm's
    gradient: it now runs after the gradient kernel and reads that kernel's copy of y, so the
    forward's y is last read by the forward GEMM."""
    after = _norm_passes(_norm_step(centered=centered), norm_output=True)
    order = _order(after)
    calls = [(i, v) for i, (_, v) in enumerate(order) if isinstance(v, relax.Call) and v.op == CALL_TIR]
    (fwd_i, fwd), (grad_i, grad) = calls
    kind = "layer_norm" if centered else "rms_norm"
    assert fwd.args[0].name_hint.startswith(kind + "_2x5x64") and "bfloat16" in fwd.args[0].name_hint
    assert grad.args[0].name_hint.startswith(kind + "_grad_2x5x64_dyg_bfloat16_ybfloat16_g")
    # the kernel reads the forward's scale (and shift), and writes dx's cast and y again
    assert [str(t.dtype) for t in grad.ty_args[0].fields] == ["bfloat16", "bfloat16"]
    y_fwd = next(v for v, value in order if isinstance(value, relax.TupleGetItem)
                 and value.tuple_value.same_as(order[fwd_i][0]) and str(v.ty.dtype) == "bfloat16")
    y_grad = next(v for v, value in order if isinstance(value, relax.TupleGetItem)
                  and value.tuple_value.same_as(order[grad_i][0]) and value.index == 1)
    readers = lambda var: [i for i, (_, value) in enumerate(order) if isinstance(value, relax.Call)  # noqa: E731
                           and any(a.same_as(var) for a in value.args)]
    assert all(i < grad_i for i in readers(y_fwd))  # the forward GEMM alone
    (reshape_i,) = readers(y_grad)
    assert reshape_i > grad_i and order[reshape_i][1].op.name == "relax.reshape"
    (permute_i,) = readers(order[reshape_i][0])
    (matmul_i,) = readers(order[permute_i][0])
    assert order[matmul_i][1].op.name == "relax.matmul" and matmul_i > permute_i


@pytest.mark.parametrize("centered", [True, False])
def test_a_step_with_the_norm_s_result_written_again_computes_the_same_bits(centered):
    import ml_dtypes

    rng = np.random.default_rng()
    n, m = 64, 32
    bf16 = lambda shape, scale=1.0: (rng.standard_normal(shape) * scale).astype(ml_dtypes.bfloat16)  # noqa: E731
    args = [(rng.standard_normal((2, 5, n)) * 2 + 1).astype(ml_dtypes.bfloat16),
            rng.standard_normal(n).astype("float32"), rng.standard_normal(n).astype("float32"),
            bf16((n, m), 0.2), bf16((m, n), 0.2), bf16((10, m))]
    before = _norm_step(n, m, centered=centered)
    plain, rewritten = (_norm_passes(before, flag, scheduled=False) for flag in (False, True))
    assert "_ybfloat16" in str([gv.name_hint for gv in rewritten.get_global_vars()])
    want, got = _run(plain, args), _run(rewritten, args)
    assert len(want) == len(got) == 3
    for w, g in zip(want, got):  # y again from the forward's input and statistics, by the same ops
        np.testing.assert_array_equal(g.astype("float32"), w.astype("float32"))


@pytest.mark.parametrize("case", ["forward_only", "read_after_the_weight_gradient"])
def test_the_norm_s_result_is_left_where_the_copy_frees_nothing(case):
    """y read by the forward alone (nothing reads it in the backward), or read by what the
    gradient is computed from after the weight gradient (y stays alive past that reader anyway):
    the kernel does not write y again."""
    before = _norm_step(wgrad=None if case == "forward_only" else "before",
                        reader_after=case == "read_after_the_weight_gradient")
    plain, rewritten = (_norm_passes(before, flag) for flag in (False, True))
    tvm.ir.assert_structural_equal(rewritten, plain)


def test_a_weight_gradient_already_after_the_kernel_reads_the_copy():
    after = _norm_passes(_norm_step(wgrad="after"), norm_output=True)
    assert any("_ybfloat16" in gv.name_hint for gv in after.get_global_vars())


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc to build CUDA code")
def test_a_scheduled_kernel_writing_the_norm_s_result_builds_for_cuda():
    after = _norm_passes(_norm_step(1024, 64, lead=(4, 128)), norm_output=True)
    (name,) = [gv for gv in after.get_global_vars() if "_ybfloat16" in gv.name_hint]
    lib = tvm.compile(tvm.IRModule({"main": after[name]}), target=tvm.target.Target(CUDA))
    assert "__shfl_down_sync" in lib.mod.imports[0].inspect_source()


@pytest.mark.gpu
@pytest.mark.parametrize("centered", [True, False])
def test_the_gradient_kernel_s_copy_of_the_norm_s_result_has_the_forward_s_bits_on_gpu(centered):
    """The scheduled forward norm kernel and the gradient kernel that writes its result again,
    run on the GPU at BERT-Large's row size: the copy is the forward's bf16 result bit for bit
    (the same float32 ops on the same input and statistics), and dx is written everywhere."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    n, m, lead = 1024, 64, (8, 512)
    before = _norm_step(n, m, lead=lead, centered=centered)
    after = _norm_passes(before, norm_output=True)
    order = _order(after)
    bound = dict(order)
    calls = [(var, value) for var, value in order if isinstance(value, relax.Call) and value.op == CALL_TIR]
    (fwd_var, fwd), (grad_var, grad) = calls
    gen = torch.Generator(device="cuda").manual_seed(0)

    def rand(shape, dtype, scale=1.0, shift=0.0):
        return (torch.randn(*shape, generator=gen, device="cuda") * scale + shift).to(dtype)

    dtypes = {"bfloat16": torch.bfloat16, "float32": torch.float32}
    values = {p: rand([int(s) for s in p.ty.shape.values], dtypes[str(p.ty.dtype)], 2.0 if i == 0 else 0.5,
                      1.0 if i == 0 else 0.0) for i, p in enumerate(after["main"].params)}

    def value_of(arg):
        if arg in values:
            return values[arg]
        b = bound.get(arg)
        if isinstance(b, relax.Call) and b.op.name == "relax.reshape":  # gamma / beta as rows
            return value_of(b.args[0]).reshape([int(s) for s in arg.ty.shape.values])
        values[arg] = rand([int(s) for s in arg.ty.shape.values], dtypes[str(arg.ty.dtype)])  # dy's source
        return values[arg]

    def run(var, call):
        lib = tvm.compile(tvm.IRModule({"main": after[call.args[0]]}), target=tvm.target.Target(CUDA))
        ins = [value_of(a).contiguous() for a in call.args[1].fields]
        outs = [torch.full([int(s) for s in t.shape.values], float("nan"), device="cuda",
                           dtype=dtypes[str(t.dtype)]) for t in call.ty_args[0].fields]
        lib["main"](*[tvm.runtime.from_dlpack(t) for t in ins + outs])
        torch.cuda.synchronize()
        for item, value in order:
            if isinstance(value, relax.TupleGetItem) and value.tuple_value.same_as(var):
                values[item] = outs[value.index]
        return outs

    forward, (dxl, copy) = run(fwd_var, fwd), run(grad_var, grad)
    y = forward[-1]
    differ = (copy.view(torch.int16) != y.view(torch.int16)).sum().item()
    assert differ == 0, f"{differ} of {y.numel()} elements differ from the forward's result"
    assert not torch.isnan(dxl.float()).any()

import shutil

import numpy as np
import pytest
import tvm
from tvm import relax

from tvm_evt.relax_passes.lower.fuse_layer_norm import FuseLayerNorm, find_chains, layer_norm_primfunc

from _passes import flat_numpy

CUDA = {"kind": "cuda", "arch": "sm_90a"}
CALL_TIR = tvm.ir.Op.get("relax.call_tir")


def _layer_norm(n=64, affine=True, stats_read=True, read_early=False, casts=True, widened=None):
    """DecomposeLayerNorm's spelling, then what the training graph does with it: rstd and xhat
    read by the gradient, the result cast to bf16 (directly and through a reshape).  `widened`:
    x is ``astype(x16, float32)`` of a bf16 parameter, read by the chain alone ("alone") or
    also by a residual add ("shared")."""
    bb = relax.BlockBuilder()
    x16 = relax.Var("x16", relax.TensorType((2, 5, n), "bfloat16")) if widened else None
    x = relax.Var("x", relax.TensorType((2, 5, n), "float32"))
    g = relax.Var("g", relax.TensorType((n,), "float32"))
    b = relax.Var("b", relax.TensorType((n,), "float32"))
    with bb.function("main", [x16 if widened else x, g, b]):
        with bb.dataflow():
            emit = bb.emit
            if widened:
                x = emit(relax.op.astype(x16, "float32"))
            mean = emit(relax.op.mean(x, [2], keepdims=True))
            centered = emit(relax.op.subtract(x, mean))
            var = emit(relax.op.mean(emit(relax.op.multiply(centered, centered)), [2], keepdims=True))
            rstd = emit(relax.op.rsqrt(emit(relax.op.add(var, relax.const(1e-5, "float32")))))
            y = xhat = emit(relax.op.multiply(centered, rstd))
            early = emit(relax.op.multiply(xhat, relax.const(3.0, "float32"))) if read_early else None
            if affine:
                y = emit(relax.op.multiply(y, emit(relax.op.reshape(g, (1, 1, n)))))
                y = emit(relax.op.add(y, emit(relax.op.reshape(b, (1, 1, n)))))
            outs = [y]
            if casts:
                outs += [emit(relax.op.astype(emit(relax.op.reshape(y, (10, n))), "bfloat16")),
                         emit(relax.op.astype(y, "bfloat16"))]
            if stats_read:
                outs += [emit(relax.op.multiply(xhat, rstd))]  # the gradient's reads
            outs += [early] if early is not None else []
            outs += [emit(relax.op.add(x, x))] if widened == "shared" else []
            out = bb.emit_output(relax.Tuple(outs))
        bb.emit_func_output(out)
    return bb.get()


def _calls(mod, name="main"):
    return [b.value for block in mod[name].body.blocks for b in block.bindings if isinstance(b.value, relax.Call)]


def test_layer_norm_chain_and_its_casts_become_one_call():
    after = FuseLayerNorm()(_layer_norm(stats_read=False))
    ops = {c.op.name for c in _calls(after) if isinstance(c.op, tvm.ir.Op)}
    assert not ops & {"relax.mean", "relax.rsqrt", "relax.subtract", "relax.astype", "relax.add"}
    (fused,) = [c for c in _calls(after) if c.op == CALL_TIR]
    assert fused.args[0].name_hint == "layer_norm_2x5x64_g_b_eps1em05_z_bfloat16"
    # z (returned in float32), z in bf16 (both casts read it)
    assert [(tuple(int(s) for s in t.shape), str(t.dtype)) for t in fused.ty.fields] == [
        ((2, 5, 64), "float32"), ((2, 5, 64), "bfloat16")]
    assert after[fused.args[0]].attrs["tirx.is_scheduled"]


@pytest.mark.parametrize("widened", [None, "alone"])
def test_values_the_gradient_reads_are_recomputed_from_x_and_the_statistics(widened):
    """xhat read by an elementwise op (the gradient's reads) is not written: the kernel writes the
    row statistics, and xhat = (x - mean) * rstd is bound again after the call, the graph's own
    ops on them, for the reader's kernel to compute from x (two bytes an element when x widens a
    bf16 x16) instead of reading a float32 xhat.  Returned z is written."""
    after = FuseLayerNorm()(_layer_norm(widened=widened))
    (fused,) = [c for c in _calls(after) if c.op == CALL_TIR]
    suffix = "_from_bfloat16" if widened else ""
    assert fused.args[0].name_hint == "layer_norm_2x5x64_g_b_eps1em05_mean_rstd_z_bfloat16" + suffix
    assert [(tuple(int(s) for s in t.shape), str(t.dtype)) for t in fused.ty.fields] == [
        ((2, 5, 1), "float32"), ((2, 5, 1), "float32"), ((2, 5, 64), "float32"), ((2, 5, 64), "bfloat16")]
    bindings = [b for block in after["main"].body.blocks for b in block.bindings]
    call = next(i for i, b in enumerate(bindings) if b.value.same_as(fused))
    mean, rstd = bindings[call + 1].var, bindings[call + 2].var
    centered, xhat = bindings[call + 5], bindings[call + 6]  # after the call's four outputs
    x = after["main"].params[0] if not widened else next(b.var for b in bindings if b.var.same_as(centered.value.args[0]))
    assert centered.value.op.name == "relax.subtract" and list(centered.value.args) == [x, mean]
    assert xhat.value.op.name == "relax.multiply" and list(xhat.value.args) == [centered.var, rstd]


def test_without_affine_the_normalized_value_is_the_result():
    after = FuseLayerNorm()(_layer_norm(affine=False, stats_read=False))
    (fused,) = [c for c in _calls(after) if c.op == CALL_TIR]
    assert fused.args[0].name_hint == "layer_norm_2x5x64_eps1em05_xhat_bfloat16"


@pytest.mark.parametrize("variant", [dict(read_early=True), dict(n=16384)])
def test_left_alone_when_a_value_is_read_before_the_chain_ends_or_the_row_is_too_long(variant):
    before = _layer_norm(**variant)
    assert not find_chains(before["main"])
    tvm.ir.assert_structural_equal(FuseLayerNorm()(before), before)


def _run(mod, args, target="llvm", dev=None):
    ex = tvm.compile(mod, target=target)
    vm = relax.VirtualMachine(ex, dev or tvm.cpu())
    out = vm["main"](*[tvm.runtime.tensor(a, dev or tvm.cpu()) for a in args])
    return [x.numpy() for x in out]


@pytest.mark.parametrize("widened", ["alone", "shared"])
def test_a_widened_input_is_read_narrow(widened):
    """x = astype(x16, float32): the kernel reads x16 and widens it; the cast's binding goes when
    only the chain read it, and stays for its other reader otherwise."""
    after = FuseLayerNorm()(_layer_norm(widened=widened, stats_read=False))
    (fused,) = [c for c in _calls(after) if c.op == CALL_TIR]
    assert fused.args[0].name_hint == "layer_norm_2x5x64_g_b_eps1em05_z_bfloat16_from_bfloat16"
    assert fused.args[1].fields[0].same_as(after["main"].params[0])
    casts = [c for c in _calls(after) if isinstance(c.op, tvm.ir.Op) and c.op.name == "relax.astype"]
    assert len(casts) == (1 if widened == "shared" else 0)


@pytest.mark.parametrize("variant", [dict(), dict(affine=False), dict(casts=False), dict(n=1000),
                                     dict(widened="alone"), dict(widened="shared")])
def test_fused_kernel_computes_what_the_ops_computed(variant):
    """The rewrite with unscheduled kernels, on the CPU: outputs equal the unfused graph's."""
    n = variant.get("n", 64)
    rng = np.random.default_rng()
    import ml_dtypes

    x = (rng.standard_normal((2, 5, n)) * 3 + 1).astype(ml_dtypes.bfloat16 if variant.get("widened") else "float32")
    args = [x,
            rng.standard_normal(n).astype("float32"), rng.standard_normal(n).astype("float32")]
    before = _layer_norm(**variant)
    want = _run(before, args)
    got = _run(FuseLayerNorm(scheduled=False)(before), args)
    assert len(got) == len(want)
    for w, g in zip(want, got):
        np.testing.assert_allclose(g.astype("float32"), w.astype("float32"),
                                   rtol=2**-7 if w.dtype != np.float32 else 1e-5, atol=1e-5)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc to build CUDA code")
@pytest.mark.parametrize("n, in_dtype", [(768, "float32"), (1024, "float32"), (1024, "bfloat16")])
def test_scheduled_kernel_builds_for_cuda(n, in_dtype):
    """No GPU needed: the schedule lowers and the CUDA source has the row reductions."""
    func = layer_norm_primfunc((4, 16, n), 1e-5, (n,), (1, 1, n), ("rstd", "xhat"), "bfloat16", in_dtype=in_dtype)
    lib = tvm.compile(tvm.IRModule({"main": func}), target=tvm.target.Target(CUDA))
    src = lib.mod.imports[0].inspect_source()
    assert "__shfl_down_sync" in src and "__shared__" in src


@pytest.mark.gpu
@pytest.mark.parametrize("n, in_dtype", [(768, "float32"), (1000, "float32"), (1024, "float32"),
                                         (1024, "bfloat16"), (768, "bfloat16")])
def test_scheduled_kernel_on_gpu_matches_torch(n, in_dtype):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    rows = 4096
    func = layer_norm_primfunc((rows, n), 1e-5, (n,), (n,), ("rstd", "xhat", "z"), "bfloat16", in_dtype=in_dtype)
    lib = tvm.compile(tvm.IRModule({"main": func}), target=tvm.target.Target(CUDA))
    x_in = (torch.randn(rows, n, device="cuda") * 3 + 1).to(getattr(torch, in_dtype))
    x = x_in.float()  # what the kernel widens it to
    g, b = torch.randn(n, device="cuda"), torch.randn(n, device="cuda")
    outs = [torch.full(shape, float("nan"), device="cuda", dtype=dt) for shape, dt in
            [((rows, 1), torch.float32), ((rows, n), torch.float32), ((rows, n), torch.float32),
             ((rows, n), torch.bfloat16)]]
    lib["main"](*[tvm.runtime.from_dlpack(t) for t in (x_in, g, b, *outs)])
    torch.cuda.synchronize()
    rstd, xhat, z, zl = outs
    xd = x.double()
    ref_xhat = (xd - xd.mean(-1, keepdim=True)) / torch.sqrt(xd.var(-1, unbiased=False, keepdim=True) + 1e-5)
    ref = torch.nn.functional.layer_norm(xd, (n,), g.double(), b.double(), 1e-5)
    assert torch.allclose(rstd.double().squeeze(-1), 1 / torch.sqrt(xd.var(-1, unbiased=False) + 1e-5), rtol=1e-5)
    assert torch.allclose(xhat.double(), ref_xhat, rtol=1e-4, atol=1e-5)
    assert torch.allclose(z.double(), ref, rtol=1e-4, atol=1e-4)
    assert torch.allclose(zl.double(), ref, rtol=1e-2, atol=1e-2)


def _random_args(func, rng):
    args = []
    for p in func.params:
        shape, dtype = [int(s) for s in p.ty.shape.values], str(p.ty.dtype)
        if dtype.startswith("float"):
            args.append(rng.standard_normal(shape).astype(dtype))
        else:
            args.append(rng.integers(0, 2, shape).astype(dtype))
    return args


def _run_adjoint(mod, args) -> list:
    """`mod`'s ``main_adjoint`` on `args` (numpy) on the CPU: its results, flattened, as numpy."""
    ex = tvm.compile(relax.transform.DeadCodeElimination(entry_functions=["main_adjoint"])(mod), target="llvm")
    out = relax.VirtualMachine(ex, tvm.cpu())["main_adjoint"](*[tvm.runtime.tensor(a) for a in args])
    return flat_numpy(out)


@pytest.mark.parametrize("model,precision,dropout,epilogue", [
    ("bert_layer", "fp32", True, False), ("bert_layer", "bf16", True, False), ("bert_layer", "bf16", False, False),
    # GPT-2's first layer-norm gradient takes an epilogue.  Its whole-step check is in fp32: in bf16
    # the epilogue's result is within a bf16 ulp of the ops' (its float32 sum rounds once, fused),
    # and on this small random block a 1-ulp change of that gradient (x 1.0078) moves the QKV
    # gradients by 12-18 % -- the attention backward amplifies it, the epilogue is not wrong
    ("gpt2_block", "fp32", True, True), ("gpt2_block", "bf16", True, False),
    # ViT: the first layer norm gradient's bf16 dx feeds both the dropout backward and the next
    # one's residual add; the epilogue takes the dropout backward (find_chains' second look)
    ("vit", "fp32", True, True)])
def test_training_step_of_a_bert_layer_is_unchanged_by_the_rewrites(model, precision, dropout, epilogue):
    """The CUDA route's layer norm rewrites on a whole training graph (both layer norms of a
    BERT layer or a GPT-2 block, forward and backward, with the recomputation after them), run on
    the CPU with unscheduled kernels: loss and gradients as before."""
    from tvm_evt import models, pipeline, tuning
    from tvm_evt.pipeline import InlineEVTPartitions
    from tvm_evt.relax_passes.graph.fuse_column_moments import LAYER_NORM, FuseColumnMoments
    from tvm_evt.relax_passes.lower.fuse_layer_norm_backward import FuseLayerNormBackward
    from tvm_evt.relax_passes.lower.recompute_elementwise import RecomputeElementwise
    from tvm_evt.relax_passes.lower.split_reduction import SplitReduction

    from _torch_ref import no_dropout

    small = {"vit": dict(batch=2, image=16, patch=4, hidden=64, heads=4)}
    entry = models.ZOO[model](**small.get(model, dict(batch=2, seq=16, hidden=64, heads=4)))
    if not dropout:  # the graph the GPU tier's whole-step tests compile
        no_dropout(entry.model)
    _imported, graph = tuning.training_graph(entry, precision)
    with tvm.target.Target("llvm"):
        inlined = tvm.transform.Sequential(pipeline.front_passes() + [InlineEVTPartitions()])(graph.mod)
    fused = FuseLayerNormBackward(scheduled=False, epilogue=epilogue)(FuseLayerNorm(scheduled=False)(inlined))
    # and the rewrites that take the recomputed values into their readers' kernels, in the CUDA
    # route's order (the CPU graph's inlined partitions store nothing the pair reads, so
    # FuseColumnMoments here pairs the layer norms' parameter gradients with stored=False)
    fused = SplitReduction()(FuseColumnMoments(LAYER_NORM)(RecomputeElementwise()(fused)))
    pairs = [b.value.args[0].name_hint for block in fused["main_adjoint"].body.blocks for b in block.bindings
             if isinstance(b.value, relax.Call) and b.value.op == tvm.ir.Op.get("relax.call_tir")
             and b.value.args[0].name_hint.startswith("column_moments_normalized")]
    assert len(pairs) == (3 if model == "vit" else 2), pairs  # every layer norm's dgamma and dbeta
    names = [gv.name_hint for gv in fused.get_global_vars() if gv.name_hint.startswith("layer_norm_")]
    assert len([n for n in names if not n.startswith("layer_norm_grad")]) >= 2, names  # both forwards
    # both gradients (GPT-2: the second one's combine is in a GEMM epilogue, its means in TVM's kernels)
    assert len([n for n in names if n.startswith("layer_norm_grad")]) >= (2 if model == "bert_layer" else 1), names
    assert any("_tail" in n for n in names) == epilogue, names
    if model == "vit":  # the last layer norm's dx feeds two elementwise readers; its kernel takes one
        assert all("_tail" in n for n in names if n.startswith("layer_norm_grad")), names
    rng = np.random.default_rng()
    args = _random_args(inlined["main_adjoint"], rng)
    want, got = _run_adjoint(inlined, args), _run_adjoint(fused, args)
    assert len(want) == len(got) > 2
    for w, g in zip(want, got):
        if precision == "fp32":
            np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)
        else:  # a bf16 rounding may flip where the fused kernel rounds once instead of twice
            w, g = w.astype("float32"), g.astype("float32")
            assert np.linalg.norm(g - w) <= 2e-2 * np.linalg.norm(w) + 1e-6


@pytest.mark.parametrize("model,layer_norms", [("bert_layer", 1), ("gpt2_block", 1), ("vit", 2)])
def test_layer_norm_results_written_again_by_the_gradient_kernels_give_the_same_step(model, layer_norms):
    """FuseLayerNormBackward(norm_output=True) on whole bf16 training graphs (post-LN BERT, pre-LN
    GPT-2 and ViT): the gradient kernels of the layer norms whose bf16 results weight gradients
    read write those results again, from the forward's input and statistics with the forward's
    ops, and the weight gradients read that copy -- the step's loss and gradients bit for bit as
    without (CPU, unscheduled kernels).  BERT's second layer norm feeds the loss alone."""
    from tvm_evt import models, pipeline, tuning
    from tvm_evt.pipeline import InlineEVTPartitions
    from tvm_evt.relax_passes.lower.fuse_layer_norm_backward import FuseLayerNormBackward

    small = {"vit": dict(batch=2, image=16, patch=4, hidden=64, heads=4)}
    entry = models.ZOO[model](**small.get(model, dict(batch=2, seq=16, hidden=64, heads=4)))
    _imported, graph = tuning.training_graph(entry, "bf16")
    with tvm.target.Target("llvm"):
        inlined = tvm.transform.Sequential(pipeline.front_passes() + [InlineEVTPartitions()])(graph.mod)
    forward = FuseLayerNorm(scheduled=False)(inlined)
    plain, rewritten = (FuseLayerNormBackward(scheduled=False, norm_output=flag)(forward) for flag in (False, True))
    written = [b.value.args[0].name_hint for block in rewritten["main_adjoint"].body.blocks for b in block.bindings
               if isinstance(b.value, relax.Call) and b.value.op == CALL_TIR and "_ybfloat16" in b.value.args[0].name_hint]
    assert len(written) == layer_norms, written
    args = _random_args(inlined["main_adjoint"], np.random.default_rng())
    want, got = _run_adjoint(plain, args), _run_adjoint(rewritten, args)
    assert len(want) == len(got) > 2
    for w, g in zip(want, got):
        np.testing.assert_array_equal(g, w)


def _rms_norm(n=64, rstd_read=True, widened=False):
    """DecomposeLayerNorm's spelling of an RMS norm (``rstd = rsqrt(mean(x * x) + eps)``,
    ``y = x * rstd * w``), the result cast to bf16 for a GEMM and, as the gradient does, xhat and
    rstd read after it."""
    bb = relax.BlockBuilder()
    x_in = relax.Var("x", relax.TensorType((2, 5, n), "bfloat16" if widened else "float32"))
    w = relax.Var("w", relax.TensorType((n,), "float32"))
    with bb.function("main", [x_in, w]):
        with bb.dataflow():
            emit = bb.emit
            x = emit(relax.op.astype(x_in, "float32")) if widened else x_in
            var = emit(relax.op.mean(emit(relax.op.multiply(x, x)), [2], keepdims=True))
            rstd = emit(relax.op.rsqrt(emit(relax.op.add(var, relax.const(1e-6, "float32")))))
            xhat = emit(relax.op.multiply(x, rstd))
            y = emit(relax.op.multiply(xhat, emit(relax.op.reshape(w, (1, 1, n)))))
            outs = [emit(relax.op.astype(y, "bfloat16"))]
            outs += [emit(relax.op.multiply(xhat, rstd))] if rstd_read else []
            out = bb.emit_output(relax.Tuple(outs))
        bb.emit_func_output(out)
    return bb.get()


@pytest.mark.parametrize("rstd_read,name", [(True, "rms_norm_2x5x64_g_eps1em06_rstd_bfloat16"),
                                            (False, "rms_norm_2x5x64_g_eps1em06_bfloat16")])
def test_rms_norm_chain_becomes_one_call(rstd_read, name):
    after = FuseLayerNorm()(_rms_norm(rstd_read=rstd_read))
    ops = [c.op.name for c in _calls(after) if isinstance(c.op, tvm.ir.Op)]
    assert not set(ops) & {"relax.mean", "relax.rsqrt", "relax.astype", "relax.add"}
    (fused,) = [c for c in _calls(after) if c.op == CALL_TIR]
    assert fused.args[0].name_hint == name
    script = after[fused.args[0]].script()
    assert "row_sqsum" in script and "row_sum" not in script.replace("row_sqsum", "")  # no mean taken out
    # the gradient's xhat: the graph's multiply, bound again after the call from x and rstd
    assert ops.count("relax.multiply") == (2 if rstd_read else 0)


@pytest.mark.parametrize("widened", [False, True])
def test_rms_norm_kernel_computes_what_the_ops_computed(widened):
    import ml_dtypes

    rng = np.random.default_rng()
    args = [(rng.standard_normal((2, 5, 64)) * 3 + 1).astype(ml_dtypes.bfloat16 if widened else "float32"),
            rng.standard_normal(64).astype("float32")]
    before = _rms_norm(widened=widened)
    want, got = _run(before, args), _run(FuseLayerNorm(scheduled=False)(before), args)
    for w, g in zip(want, got):
        np.testing.assert_allclose(g.astype("float32"), w.astype("float32"), rtol=2**-7 if g.dtype != np.float32
                                   else 1e-5, atol=1e-5)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc to build CUDA code")
@pytest.mark.parametrize("centered", [True, False])
def test_statistics_are_written_by_the_kernel_that_writes_the_elements(centered):
    """One kernel: the row statistics come from the sums the element values use (no second
    launch reading x again)."""
    import re

    func = layer_norm_primfunc((4, 16, 4096), 1e-6, (4096,), None, ("rstd",), "bfloat16", in_dtype="bfloat16",
                               centered=centered)
    src = tvm.compile(tvm.IRModule({"main": func}), target=tvm.target.Target(CUDA)).mod.imports[0].inspect_source()
    assert len(set(re.findall(r"__global__ void __launch_bounds__\(\d+\) (\w+)\(", src))) == 1
    assert "stats_ptr[" in src


@pytest.mark.gpu
@pytest.mark.parametrize("n, in_dtype", [(4096, "float32"), (4096, "bfloat16"), (1000, "float32")])
def test_rms_norm_kernel_on_gpu_matches_torch(n, in_dtype):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    rows = 4096
    func = layer_norm_primfunc((rows, n), 1e-6, (n,), None, ("rstd",), "bfloat16", in_dtype=in_dtype, centered=False)
    lib = tvm.compile(tvm.IRModule({"main": func}), target=tvm.target.Target(CUDA))
    x_in = (torch.randn(rows, n, device="cuda") * 3 + 1).to(getattr(torch, in_dtype))
    w = torch.randn(n, device="cuda")
    rstd = torch.full((rows, 1), float("nan"), device="cuda")
    y = torch.full((rows, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    lib["main"](*[tvm.runtime.from_dlpack(t) for t in (x_in, w, rstd, y)])
    torch.cuda.synchronize()
    xd = x_in.double()
    ref_rstd = torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6)
    assert torch.allclose(rstd.double(), ref_rstd, rtol=1e-5)
    ref = torch.nn.functional.rms_norm(xd, (n,), w.double(), 1e-6)
    assert (y.double() - ref).norm() <= 1e-2 * ref.norm()

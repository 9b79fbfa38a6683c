"""ScheduleTIRForGPU: TVM's opaque embedding-gradient kernel, the dropout masks' own GPU form (builds for CUDA without a GPU)."""

import shutil

import numpy as np
import pytest
import tvm
from tvm import relax

from tvm_evt.relax_passes.lower.schedule_tir_for_gpu import ScheduleTIRForGPU, single_thread, vectorized_bool_blocks

CUDA = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"})


def _fused(mod):
    """`mod` legalized and fused into PrimFuncs for CUDA, as the pipeline has them before scheduling."""
    with CUDA:
        return tvm.transform.Sequential(
            [relax.transform.LegalizeOps(), relax.transform.AnnotateTIROpPattern(),
             relax.transform.FuseOps(), relax.transform.FuseTIR()]
        )(mod)


def _embedding_grad_module():
    bb = relax.BlockBuilder()
    grad = relax.Var("grad", relax.TensorType((32, 16), "float32"))
    table = relax.Var("table", relax.TensorType((10, 16), "float32"))
    idx = relax.Var("idx", relax.TensorType((32,), "int32"))
    with bb.function("main", [grad, table, idx]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.grad.take_backward(grad, table, idx, axis=0))
        bb.emit_func_output(out)
    return _fused(bb.get())


def test_unschedulable_kernel_runs_on_one_thread():
    mod = _embedding_grad_module()
    with CUDA, pytest.warns(UserWarning, match="take_backward"):
        scheduled = ScheduleTIRForGPU()(mod)
    prims = [f for _, f in scheduled.functions_items() if isinstance(f, tvm.tirx.PrimFunc)]
    assert prims and all(int(f.attrs["tirx.is_scheduled"]) == 1 for f in prims)
    assert any("threadIdx.x" in f.script() for f in prims)


def test_single_thread_keeps_the_computation():
    """The wrapper only adds the launch: on the CPU the same PrimFunc body computes the
    scatter-add that numpy does."""
    mod = _embedding_grad_module()
    gv, func = next((gv, f) for gv, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc))
    assert single_thread(func).body.body.body.same_as(func.body)
    lib = tvm.compile(tvm.IRModule({"f": func.with_attr("global_symbol", "f")}),
                      target=tvm.target.Target({"kind": "llvm"}))
    rng = np.random.default_rng()
    g = rng.standard_normal((32, 16)).astype("float32")
    t = np.zeros((10, 16), "float32")
    idx = rng.integers(0, 10, 32).astype("int32")
    out = tvm.runtime.tensor(np.zeros((10, 16), "float32"))
    lib["f"](*(tvm.runtime.tensor(a) for a in (g, t, idx)), out)
    expected = np.zeros((10, 16))
    np.add.at(expected, idx, g)
    np.testing.assert_allclose(out.numpy(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc to build CUDA code")
def test_scheduled_module_builds_for_cuda():
    mod = _embedding_grad_module()
    with CUDA, pytest.warns(UserWarning):
        mod = ScheduleTIRForGPU()(mod)
    tvm.compile(mod, target=CUDA)


def _dropout_module(shape=(3, 5, 70)):
    from tvm_evt.relax_passes.training.lower_dropout import LowerDropout

    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(shape, "float16"))
    with bb.function("main", [x]):
        with bb.dataflow():
            d = bb.emit(relax.op.nn.dropout(x, 0.3))
            y = bb.emit_output(relax.TupleGetItem(d, 0))
        bb.emit_func_output(y)
    with CUDA:
        return tvm.transform.Sequential(
            [LowerDropout(), relax.transform.LegalizeOps(), relax.transform.AnnotateTIROpPattern(),
             relax.transform.FuseOps(), relax.transform.FuseTIR()]
        )(bb.get())


def test_dropout_masks_take_their_own_gpu_form():
    """One thread per Philox draw (eight mask elements), not DLight's one thread per element."""
    with CUDA:
        mod = ScheduleTIRForGPU()(_dropout_module())
    (keep,) = [f for gv, f in mod.functions_items() if gv.name_hint.startswith("dropout_keep")]
    assert int(keep.attrs["tirx.is_scheduled"]) == 1 and 'thread="threadIdx.x"' in keep.script()
    assert "T.thread_binding(1, thread=\"blockIdx.x\")" in keep.script()  # 1050 elements / 8 / 256 threads
    prim = tvm.IRModule({gv: f for gv, f in mod.functions_items() if gv.name_hint.startswith("dropout_keep")})
    source = tvm.tirx.build(prim, target=CUDA).imports[0].inspect_source()
    assert "threadIdx.x" in source and source.count("3528531795") == 10  # ten unrolled rounds


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(3, 5, 70), (2, 16, 33, 65)])
def test_dropout_mask_gpu_form_matches_numpy(shape):
    from tvm_evt.relax_passes.training.philox import dropout_keep_gpu_primfunc, dropout_keep_numpy

    func = dropout_keep_gpu_primfunc(shape, 0.3).with_attr("global_symbol", "keep")
    lib = tvm.tirx.build(tvm.IRModule({"keep": func}), target=CUDA)
    dev = tvm.cuda(0)
    out = tvm.runtime.tensor(np.zeros(shape, "bool"), dev)
    lib["keep"](tvm.runtime.tensor(np.array([7, 99], "uint32"), dev), tvm.runtime.tensor(np.array(4, "uint32"), dev), out)
    np.testing.assert_array_equal(out.numpy().reshape(-1), dropout_keep_numpy(int(np.prod(shape)), (7, 99), 4, 0.3))


def _matmul_mask_module():
    """A GEMM fused with a ReLU mask's where (XML-CNN's backward): DLight's Matmul rule schedules
    it and vectorizes its epilogue, the bool mask's reads included."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((32, 96), "bfloat16"))
    w = relax.Var("w", relax.TensorType((96, 64), "bfloat16"))
    mask = relax.Var("mask", relax.TensorType((32, 64), "bool"))
    with bb.function("main", [x, w, mask]):
        with bb.dataflow():
            y = bb.emit(relax.op.matmul(x, w))
            out = bb.emit_output(relax.op.where(mask, y, relax.const(0, "bfloat16")))
        bb.emit_func_output(out)
    return _fused(bb.get())


def test_bool_buffers_are_not_read_as_vectors():
    from tvm.s_tir import dlight as dl

    mod = _matmul_mask_module()
    gv = next(gv for gv, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc))
    with CUDA:
        matmul_rule = dl.ApplyDefaultSchedule(dl.gpu.Matmul())(tvm.IRModule({gv: mod[gv]}))[gv]
        scheduled = ScheduleTIRForGPU()(mod)[gv]
    assert "T.vectorized" in matmul_rule.script() and vectorized_bool_blocks(matmul_rule)
    assert int(scheduled.attrs["tirx.is_scheduled"]) == 1
    assert not vectorized_bool_blocks(scheduled)
    assert "T.vectorized" in scheduled.script()  # the operand fetches stay vectorized
    # a function scheduled before the pass (as a MetaSchedule database applies them) is made safe too
    presched = ScheduleTIRForGPU()(tvm.IRModule({gv: matmul_rule}))[gv]
    assert not vectorized_bool_blocks(presched) and "T.vectorized" in presched.script()


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc to build CUDA code")
def test_bool_mask_is_read_a_byte_at_a_time_in_cuda():
    """TVM 0.27 loads a pair of bools as a ushort2 (4 bytes); after ScheduleTIRForGPU the mask is
    read element by element."""
    mod = _matmul_mask_module()
    with CUDA:
        scheduled = ScheduleTIRForGPU()(mod)
    gv = next(gv for gv, f in scheduled.functions_items() if isinstance(f, tvm.tirx.PrimFunc))
    lib = tvm.compile(tvm.IRModule({"main": scheduled[gv].with_attr("global_symbol", "main")}), target=CUDA)
    src = lib.mod.imports[0].inspect_source()
    assert "mask_ptr[" in src and "*)(mask_ptr" not in src


def _im2col_module(taps: int = 9):
    """A stem's im2col: `taps` strided slices of a padded input stacked along a new axis (one
    PrimFunc of injective blocks), next to a column sum (a reduction)."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((2, 18, 18, 3), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            cols = [bb.emit(relax.op.expand_dims(relax.op.strided_slice(
                x, axes=[1, 2], begin=[t // 3, t % 3], end=[t // 3 + 16, t % 3 + 16]), 3)) for t in range(taps)]
            stacked = bb.emit(relax.op.concat(cols, axis=3))
            out = bb.emit_output(relax.Tuple([stacked, relax.op.sum(x, axis=[0, 1, 2])]))
        bb.emit_func_output(out)
    return _fused(bb.get())


def test_a_function_without_a_reduction_is_offered_only_to_the_rules_that_may_take_it(monkeypatch):
    """The reduction rules (DLight's Matmul, GEMV, Reduction, GeneralReduction, our column and row
    reductions) each analyse a function and decline it when it has no reduction block: ResNet-50's
    65-block stem im2col cost 0.8 s a rule (issue #40).  Without them tried, the same schedules."""
    from tvm.s_tir import dlight as dl

    from tvm_evt.relax_passes.lower import schedule_tir_for_gpu as S

    mod = _im2col_module()
    prims = {gv: f for gv, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc)}
    (im2col,) = [gv for gv, f in prims.items() if not S.has_reduction_block(f)]
    assert len(prims) == 2
    tried = []
    original = dl.ApplyDefaultSchedule

    def counting(*rules):
        tried.extend(type(r).__name__ for r in rules)
        return original(*rules)

    monkeypatch.setattr(dl, "ApplyDefaultSchedule", counting)
    with CUDA:
        S.ScheduleTIRForGPU(vectorize=True)(tvm.IRModule({im2col: prims[im2col]}))
    assert tried and not {t.__name__ for t in S._reduction_rules()} & set(tried), tried
    with CUDA:
        scheduled = S.ScheduleTIRForGPU(vectorize=True)(mod)
    monkeypatch.setattr(S, "has_reduction_block", lambda f: True)  # every rule tried on every function
    with CUDA:
        tvm.ir.assert_structural_equal(S.ScheduleTIRForGPU(vectorize=True)(mod), scheduled)


def _relax_kernel(build, shapes, dtype):
    """The one PrimFunc `build(*vars)` legalizes and fuses into, for CUDA."""
    bb = relax.BlockBuilder()
    args = [relax.Var(f"a{i}", relax.TensorType(s, dtype)) for i, s in enumerate(shapes)]
    with bb.function("main", args):
        with bb.dataflow():
            out = bb.emit_output(build(*args))
        bb.emit_func_output(out)
    mod = _fused(bb.get())
    (gv, func), = [(gv, f) for gv, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc)]
    return gv, func


def _odd_adaptive_pool(dtype):  # 14 -> 3 overlapping windows: a sum block and a divide block
    return _relax_kernel(lambda x: relax.op.nn.adaptive_avg_pool2d(x, (3, 3)), [(2, 4, 14, 14)], dtype)


def _grouped_conv(dtype):  # NCHW, 2 groups: a padding block and the convolution
    return _relax_kernel(lambda x, w: relax.op.nn.conv2d(x, w, groups=2), [(4, 8, 14, 14), (8, 4, 3, 3)], dtype)


@pytest.mark.parametrize("kernel", [_odd_adaptive_pool, _grouped_conv], ids=["odd_adaptive_pool", "grouped_conv"])
def test_a_kernel_with_intermediate_buffers_runs_on_one_thread_as_written(kernel):
    """The intermediate buffers become the thread's own and producers are inlined; its body, built
    for llvm without the launch, computes what the kernel does."""
    from _te_kernels import run_on_llvm

    _, func = kernel("float32")
    one = single_thread(func)
    body = one.body.body.body  # inside the blockIdx.x and threadIdx.x launches
    assert all(str(b.scope()) == "local" for b in body.block.alloc_buffers)
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal([int(d) for d in ty.shape.values]).astype("float32") for ty in func.ty.params]
    want = run_on_llvm(func, arrays)
    got = run_on_llvm(one.with_body(body), arrays)
    np.testing.assert_allclose(got[-1], want[-1], rtol=1e-6, atol=1e-6)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc to build CUDA code")
@pytest.mark.parametrize("kernel", [_odd_adaptive_pool, _grouped_conv], ids=["odd_adaptive_pool", "grouped_conv"])
def test_bfloat16_kernels_no_rule_schedules_build_for_cuda(kernel):
    """A grouped NCHW convolution and an odd adaptive average pool in bf16: DLight's rules either
    decline them or schedule a cross-thread reduction TVM refuses when building; they run on one
    thread, and the step builds (both failed to on the CUDA route: "Cross-thread reduction
    requires all the reduction-related loops to be the deepest", "Buffer pad_temp is used before
    its definition")."""
    gv, func = kernel("bfloat16")
    with CUDA, pytest.warns(UserWarning, match="one GPU thread"):
        mod = ScheduleTIRForGPU(vectorize=True)(tvm.IRModule({gv: func}))
    src = tvm.compile(tvm.IRModule({gv: mod[gv].with_attr("global_symbol", gv.name_hint)}),
                      target=CUDA).mod.imports[0].inspect_source()
    from tvm.support import nvcc
    with CUDA:
        assert nvcc.compile_cuda(src, target_format="cubin", compiler="nvcc")


def test_a_reduction_schedule_tvm_cannot_lower_is_passed_over():
    from tvm.s_tir import dlight as dl

    from tvm_evt.relax_passes.lower.schedule_tir_for_gpu import cross_thread_reduction_lowers

    gv, func = _grouped_conv("bfloat16")
    with CUDA:
        by_reduction = dl.ApplyDefaultSchedule(dl.gpu.Reduction())(tvm.IRModule({gv: func}))[gv]
    assert "threadIdx.x" in by_reduction.script() and not cross_thread_reduction_lowers(gv, by_reduction)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc to build CUDA code")
def test_a_kernel_that_launches_its_own_threads_is_kept_as_written():
    """TVM's CUDA legalisation of ``scatter_elements`` (DeBERTa-v2's relative-position gradient)
    launches its own threads; wrapped in a one-thread launch it did not build."""
    from tvm_evt.relax_passes.lower.schedule_tir_for_gpu import launches_threads

    bb = relax.BlockBuilder()
    data = relax.Var("data", relax.TensorType((8, 16, 16), "bfloat16"))
    index = relax.Var("index", relax.TensorType((8, 16, 16), "int64"))
    with bb.function("main", [data, index]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.scatter_elements(data, index, data, axis=2))
        bb.emit_func_output(out)
    (gv, func), = [(gv, f) for gv, f in _fused(bb.get()).functions_items() if isinstance(f, tvm.tirx.PrimFunc)]
    assert launches_threads(func)
    with CUDA:
        mod = ScheduleTIRForGPU(vectorize=True)(tvm.IRModule({gv: func}))
    assert mod[gv].body.same_as(func.body)
    src = tvm.compile(tvm.IRModule({gv: mod[gv].with_attr("global_symbol", gv.name_hint)}),
                      target=CUDA).mod.imports[0].inspect_source()
    from tvm.support import nvcc
    with CUDA:
        assert nvcc.compile_cuda(src, target_format="cubin", compiler="nvcc")

"""tvm_evt.max_pool2d_backward: a 2-D max pooling's input gradient as two gathers (the first
maximal tap of each window, then each input element's sum over the windows that chose it)."""
import re
import shutil

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import tvm
from tvm import relax
from tvm.relax import op as R

from _te_kernels import CUDA, schedule, serial
from tvm_evt.relax_passes.lower.vectorized_elementwise import VectorizedElementwise
from tvm_evt.relax_passes.ops import max_pool_op
from tvm_evt.training import cpu_target

OP = max_pool_op.OP


def _adjoint(shape, dtype, layout, kernel, stride, pad, dilation, ceil):
    """loss = sum(max_pool2d(x) * w) and its gradient; a float32 x is cast to `dtype` before the
    pooling (relax's Gradient takes float32 inputs only), its output back after."""
    x = relax.Var("x", relax.TensorType(shape, "float32"))
    pool = lambda v: R.nn.max_pool2d(v, kernel, stride, pad, dilation, ceil_mode=ceil, layout=layout)  # noqa: E731
    w = relax.Var("w", relax.TensorType(relax.BlockBuilder().normalize(pool(x)).ty.shape, "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, w]):
        with bb.dataflow():
            y = bb.emit(pool(bb.emit(R.astype(x, dtype)) if dtype != "float32" else x))
            y = bb.emit(R.astype(y, "float32")) if dtype != "float32" else y
            loss = bb.emit_output(bb.emit(R.sum(R.multiply(y, w))))
        bb.emit_func_output(loss)
    return relax.transform.Gradient("main", require_grads=[x])(bb.get())


def _ops(func) -> list[str]:
    found = []
    relax.analysis.post_order_visit(func.body, lambda e: found.append(e.op.name) if isinstance(e, relax.Call)
                                    and isinstance(e.op, tvm.ir.Op) else None)
    return found


CASES = [  # kernel, stride, pad, dilation, ceil_mode
    (3, 2, 1, 1, False),  # ResNet's stem pool
    (3, 2, 1, 1, True),
    (2, 1, 0, 1, False),  # overlapping, stride 1
    (3, 3, 1, 1, True),  # windows that do not tile the input
    (3, 1, 1, 2, False),  # dilated
    ((3, 2), (2, 3), (1, 0), (1, 2), False),  # each axis its own
    (2, 3, 0, 1, False),  # gaps between the windows
]


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_gradient_matches_torch(layout, ties, case):
    """Every element's gradient against torch's max_pool2d backward (float64), ties included: the
    gradient goes to each window's first maximum in scan order, as torch routes it."""
    kernel, stride, pad, dilation, ceil = case
    rng = np.random.default_rng(0)
    nchw = [2, 3, 9, 10]
    x = (rng.integers(-1, 2, size=nchw) if ties else rng.standard_normal(nchw)).astype("float32")
    xt = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    y = F.max_pool2d(xt, kernel, stride, pad, dilation, ceil_mode=ceil)
    w = rng.standard_normal(list(y.shape)).astype("float32")
    (y * torch.tensor(w, dtype=torch.float64)).sum().backward()
    want = xt.grad.numpy()

    to = (lambda a: a.transpose(0, 2, 3, 1)) if layout == "NHWC" else (lambda a: a)
    pair = lambda v: tuple(v) if isinstance(v, tuple) else (v, v)  # noqa: E731
    mod = _adjoint(list(to(x).shape), "float32", layout, pair(kernel), pair(stride), pair(pad), pair(dilation), ceil)
    assert OP in _ops(mod["main_adjoint"]) and "relax.strided_slice" not in _ops(mod["main_adjoint"])
    vm = relax.VirtualMachine(tvm.compile(mod, target=tvm.target.Target(cpu_target())), tvm.cpu())
    _, (got,) = vm["main_adjoint"](tvm.runtime.tensor(to(x).copy()), tvm.runtime.tensor(to(w).copy()))
    got = got.numpy().transpose(0, 3, 1, 2) if layout == "NHWC" else got.numpy()
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_tiled_windows_keep_their_argmax_rule():
    """kernel = stride over an input the windows tile: one argmax a window, not this op."""
    ops = _ops(_adjoint([2, 3, 8, 9], "float32", "NCHW", (2, 3), (2, 3), (0, 0), (1, 1), False)["main_adjoint"])
    assert "relax.argmax" in ops and OP not in ops


def test_legalized_into_two_opaque_kernels():
    mod = _adjoint([2, 8, 8, 16], "bfloat16", "NHWC", (3, 3), (2, 2), (1, 1), (1, 1), False)
    mod = relax.transform.LegalizeOps()(mod)
    funcs = {gv.name_hint: f for gv, f in mod.functions.items() if isinstance(f, tvm.tirx.PrimFunc)}
    kernels = [n for n in funcs if n.startswith("max_pool2d_")]
    assert sorted(kernels) == ["max_pool2d_backward", "max_pool2d_first_tap"]
    assert all(int(funcs[n].attrs["op_pattern"]) == 8 for n in kernels)  # FuseOps leaves them alone
    first = funcs["max_pool2d_first_tap"]
    assert re.search(r'T\.Buffer\(\([^)]*\), "int8"\)', first.script())  # the tap indices


def test_bad_window_is_refused_with_the_op_name():
    x = relax.Var("x", relax.TensorType([2, 8, 8, 4], "float32"))
    y = relax.Var("y", relax.TensorType([2, 4, 4, 4], "float32"))
    bad = relax.ShapeExpr([3, 3, 2, 2, 1, 1, 1, 1, 1, 1, 2, 1])  # W axis before H
    bb = relax.BlockBuilder()
    with pytest.raises(Exception, match=re.escape(OP)):
        with bb.function("f", [x, y]):
            bb.emit_func_output(bb.emit(relax.Call(tvm.ir.Op.get(OP), [y, x, y, bad])))


def _kernels(shape=(4, 56, 56, 64), out=(4, 28, 28, 64), dtype="bfloat16"):
    window = max_pool_op.Window((3, 3), (2, 2), (1, 1), (1, 1, 1, 1), (1, 2))
    first = max_pool_op.first_tap_tensors(list(shape), list(out), window, dtype)
    gather = max_pool_op.gather_tensors(list(shape), list(out), window, dtype, str(first[-1].dtype))
    return {"first_tap": first, "gather": gather}


@pytest.mark.parametrize("name", ["first_tap", "gather"])
def test_channels_last_kernels_are_vectorized(name):
    """Channels-last, both kernels take VectorizedElementwise: a thread owns 8 bf16 channels, its
    result stored as one vector, and the schedule computes what the kernel computes (its thread
    loops run serially on llvm)."""
    tensors = _kernels((2, 10, 10, 16), (2, 5, 5, 16))[name]
    scheduled = schedule(tensors, VectorizedElementwise())["main"]
    assert "tirx.is_scheduled" in scheduled.attrs
    rng = np.random.default_rng(1)
    ins = []
    for t in tensors[:-1]:
        shape = [int(d) for d in t.shape]
        if str(t.dtype) == "int8":
            ins.append(rng.integers(0, 10, size=shape).astype("int8"))
        else:  # bf16 with ties: small integers
            ins.append(rng.integers(-2, 3, size=shape).astype("float32"))
    outs = []
    for f in (tvm.te.create_prim_func(tensors), serial(scheduled)):
        lib = tvm.compile(tvm.IRModule({"main": f.with_attr("global_symbol", "main")}), target="llvm")
        out = tvm.runtime.empty([int(d) for d in tensors[-1].shape], str(tensors[-1].dtype))
        lib["main"](*[_as(a, str(t.dtype)) for a, t in zip(ins, tensors[:-1])], out)
        outs.append(out.numpy())
    np.testing.assert_array_equal(outs[1], outs[0])


def _as(a: np.ndarray, dtype: str):
    if dtype == "bfloat16":
        import ml_dtypes

        return tvm.runtime.tensor(a.astype(ml_dtypes.bfloat16))
    return tvm.runtime.tensor(a.astype(dtype))


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc")
@pytest.mark.parametrize("name", ["first_tap", "gather"])
def test_channels_last_kernels_compile_with_16_byte_stores(name):
    tensors = _kernels()[name]
    src = tvm.compile(schedule(tensors, VectorizedElementwise()), target=tvm.target.Target(CUDA)).mod.imports[0] \
        .inspect_source()
    assert re.search(r"uint4|float4|int2", src), src[:2000]


def _gather_spec(shape=(2, 10, 10, 16), out=(2, 5, 5, 16), window=None):
    window = window or max_pool_op.Window((3, 3), (2, 2), (1, 1), (1, 1, 1, 1), (1, 2))
    return {"x": list(shape), "y": list(out), "window": [int(v) for v in window.expr().values],
            "dtype": "bfloat16", "index": "int8"}


@pytest.mark.parametrize("window,out", [
    (max_pool_op.Window((3, 3), (2, 2), (1, 1), (1, 1, 1, 1), (1, 2)), (2, 5, 5, 16)),
    (max_pool_op.Window((3, 2), (1, 3), (2, 1), (1, 0, 1, 0), (1, 2)), (2, 10, 3, 16)),  # dilated, gaps
])
def test_gather_cuda_form_computes_what_the_portable_one_does(window, out):
    """The channels-last CUDA form (windows' dy and taps staged in registers) with its threads run
    serially on llvm: bit for bit the portable form's result, on random taps and gradients."""
    import ml_dtypes

    spec = _gather_spec(out=out, window=window)
    portable = tvm.te.create_prim_func(max_pool_op.gather_tensors(spec["x"], spec["y"], window, "bfloat16", "int8"))
    rng = np.random.default_rng(2)
    dy = rng.standard_normal(spec["y"]).astype(ml_dtypes.bfloat16)
    first = rng.integers(0, 7, size=spec["y"]).astype("int8")
    outs = []
    for f in (portable, serial(max_pool_op.gpu_gather(spec))):
        lib = tvm.compile(tvm.IRModule({"main": f.with_attr("global_symbol", "main")}), target="llvm")
        dx = tvm.runtime.empty(spec["x"], "bfloat16")
        lib["main"](tvm.runtime.tensor(dy), tvm.runtime.tensor(first), dx)
        outs.append(dx.numpy().astype("float32"))
    np.testing.assert_array_equal(outs[1], outs[0])
    assert np.abs(outs[0]).sum() > 0


def test_only_channels_last_gathers_get_the_cuda_form():
    for layout, shape, kernel, tagged in (("NHWC", [2, 8, 8, 16], (3, 3), True), ("NCHW", [2, 16, 8, 8], (3, 3), False),
                                          ("NHWC", [2, 8, 8, 12], (3, 3), False),  # 12 channels: no 8-lane vectors
                                          ("NHWC", [2, 14, 14, 16], (12, 11), False)):  # 132 taps: int32 indices
        mod = _adjoint(shape, "bfloat16", layout, kernel, (2, 2), (1, 1), (1, 1), False)
        mod = relax.transform.LegalizeOps()(mod)
        gather = next(f for gv, f in mod.functions.items() if gv.name_hint == "max_pool2d_backward")
        assert (max_pool_op.GATHER_ATTR in gather.attrs) == tagged, (layout, shape, kernel)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc")
def test_gather_cuda_form_reads_each_window_as_one_vector():
    spec = _gather_spec((4, 56, 56, 64), (4, 28, 28, 64))
    func = max_pool_op.gpu_gather(spec).with_attr("global_symbol", "main")
    src = tvm.compile(tvm.IRModule({"main": func}), target=tvm.target.Target(CUDA)).mod.imports[0].inspect_source()
    assert src.count("*(uint4*)(dyw_local_ptr") == 4 and src.count("*(int2*)(tapw_local_ptr") == 4  # 4 windows
    assert "*(uint4*)(dx_ptr" in src


@pytest.mark.gpu
def test_first_tap_kernel_on_gpu_matches_llvm():
    """The CUDA schedule of the first-tap kernel picks the same tap as the llvm build on a bf16 input
    full of ties (small integers), its int8 output poisoned first."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    tensors = _kernels()["first_tap"]
    lib = tvm.compile(schedule(tensors, VectorizedElementwise()), target=tvm.target.Target(CUDA))
    ref = tvm.compile(tvm.IRModule({"main": tvm.te.create_prim_func(tensors)}), target="llvm")
    x = torch.randint(-2, 3, [int(d) for d in tensors[0].shape]).to(torch.bfloat16)
    y = torch.randint(-2, 3, [int(d) for d in tensors[1].shape]).to(torch.bfloat16)
    shape = [int(d) for d in tensors[2].shape]
    got, want = torch.full(shape, -1, dtype=torch.int8, device="cuda"), torch.full(shape, -1, dtype=torch.int8)
    lib["main"](*[tvm.runtime.from_dlpack(t) for t in (x.cuda(), y.cuda(), got)])
    ref["main"](*[tvm.runtime.from_dlpack(t) for t in (x, y, want)])
    torch.cuda.synchronize()
    assert torch.equal(got.cpu(), want) and int((want >= 0).sum()) > 0


@pytest.mark.gpu
def test_resnet_stem_pool_gradient_on_gpu_matches_torch():
    """The whole op on CUDA (both kernels as ScheduleTIRForGPU schedules them) against torch's
    max_pool2d backward on the same bf16 input, ResNet-50's stem pool at batch 8: equal within
    bf16 rounding of the sums (ties route the same way)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    from tvm_evt.relax_passes.lower.schedule_tir_for_gpu import ScheduleTIRForGPU

    from tvm.relax.backend.cuda import pipeline as cuda

    shape = [8, 112, 112, 64]
    mod = _adjoint(shape, "bfloat16", "NHWC", (3, 3), (2, 2), (1, 1), (1, 1), False)
    target = tvm.target.Target(CUDA)
    # the evt pipeline's lowering stages, then TVM's CUDA ones (tvm.compile's default pipeline would
    # annotate and fuse the scheduled kernels a second time)
    lower = [relax.transform.LegalizeOps(), relax.transform.AnnotateTIROpPattern(), relax.transform.FuseOps(),
             relax.transform.FuseTIR(), ScheduleTIRForGPU(vectorize=True)]
    with target:
        steps = tvm.transform.Sequential(lower + cuda.dataflow_lower_passes(target) + cuda.finalize_passes(target))
        exe = tvm.compile(mod, target=target, relax_pipeline=steps)
    vm = relax.VirtualMachine(exe, tvm.cuda())
    x = torch.randn(shape, dtype=torch.bfloat16, device="cuda").round()  # ties
    xt = x.permute(0, 3, 1, 2).detach().requires_grad_()
    y = F.max_pool2d(xt, 3, 2, 1)
    w = torch.randn(y.shape, dtype=torch.bfloat16, device="cuda")
    (y * w).sum().backward()
    args = (x.float(), w.permute(0, 2, 3, 1).float().contiguous())  # float32 in, cast to bf16 inside
    _, (got,) = vm["main_adjoint"](*[tvm.runtime.from_dlpack(a) for a in args])
    got = torch.from_dlpack(got).permute(0, 3, 1, 2).float()
    want = xt.grad.float()
    assert float((got - want).norm() / want.norm()) < 1e-2

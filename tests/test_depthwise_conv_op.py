"""tvm_evt.depthwise_conv2d and its gradient ops (relax_passes/ops/depthwise_conv_op.py):
numbers against torch on the CPU reference path, Conv2dToMatmul(depthwise=True), the kernels'
CUDA form for sm_90a (built here without a GPU), and on a GPU the kernels against torch and their
time against cuDNN through torch on MobileNetV2's depthwise shapes."""

from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest
import torch
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R

from tvm_evt.relax_passes.ops import conv_op
from tvm_evt.relax_passes.ops import depthwise_conv_op as dwc
from tvm_evt.relax_passes.training.conv2d_to_matmul import Conv2dToMatmul

LLVM = tvm.target.Target({"kind": "llvm"})
CUDA = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"})
GEOMETRIES = [  # n, h, w, c, multiplier, r, s, pad (top, left, bottom, right), stride, dilation
    (2, 9, 11, 6, 1, 3, 3, (1, 1, 1, 1), (1, 1), (1, 1)),
    (2, 10, 9, 4, 1, 3, 3, (1, 1, 1, 1), (2, 2), (1, 1)),  # stride 2, odd width: a column no window reads
    (2, 12, 12, 4, 2, 5, 5, (2, 2, 2, 2), (2, 2), (1, 1)),  # stride 2, even width: dgrad in phase strips
    (2, 11, 11, 8, 1, 5, 5, (2, 2, 2, 2), (2, 2), (1, 1)),  # EfficientNet's 5x5/2
    (1, 12, 10, 3, 2, 3, 5, (2, 1, 2, 2), (2, 1), (1, 1)),  # channel multiplier 2, uneven padding and stride
    (2, 9, 9, 4, 1, 3, 3, (2, 2, 2, 2), (1, 1), (2, 2)),  # dilation
]


def _ids(g):
    return f"{g[1]}x{g[2]}x{g[3]}m{g[4]}_{g[5]}x{g[6]}_s{g[8][0]}{g[8][1]}_d{g[9][0]}"


def _step(n, h, w, c, m, r, s, pad, stride, dilation, dtype="float32"):
    """``main(x, w, dy) -> sum(y * dy)`` of float32 operands, the ops computing in `dtype` (the
    operands cast to it: Gradient takes float32 parameters only), and its gradient."""
    g = conv_op.Geometry(pad, stride, dilation)
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType([n, h, w, c], "float32"))
    wt = relax.Var("w", relax.TensorType([c * m, r, s, 1], "float32"))
    p, q = g.out((h, w), (r, s))
    dy = relax.Var("dy", relax.TensorType([n, p, q, c * m], "float32"))
    with bb.function("main", [x, wt, dy]):
        with bb.dataflow():
            low = [bb.emit(relax.op.astype(v, dtype)) if dtype != "float32" else v for v in (x, wt, dy)]
            y = bb.emit(dwc.depthwise_conv2d(low[0], low[1], g))
            dy = low[2]
            loss = bb.emit_output(relax.op.sum(relax.op.astype(relax.op.multiply(y, dy), "float32")))
        bb.emit_func_output(loss)
    return relax.transform.Gradient("main", require_grads=[x, wt])(bb.get())


def _torch_reference(xn, wn, dyn, c, pad, stride, dilation):
    """(y, x grad, w grad) of sum(conv(x, w) * dy) in float64 torch, channels-last like the ops."""
    xt = torch.tensor(xn, dtype=torch.float64).permute(0, 3, 1, 2).requires_grad_()
    wt = torch.tensor(wn, dtype=torch.float64).permute(0, 3, 1, 2).requires_grad_()
    padded = torch.nn.functional.pad(xt, (pad[1], pad[3], pad[0], pad[2]))
    y = torch.nn.functional.conv2d(padded, wt, stride=stride, dilation=dilation, groups=c)
    (y * torch.tensor(dyn, dtype=torch.float64).permute(0, 3, 1, 2)).sum().backward()
    return tuple(t.permute(0, 2, 3, 1).numpy() for t in (y.detach(), xt.grad, wt.grad))


def _check_gradients_on_llvm(geometry, mod) -> None:
    """Both gradients of sum(y * dy) by `mod` (``_step`` of `geometry`) on llvm against float64 torch."""
    n, h, w, c, m, r, s, pad, stride, dilation = geometry
    vm = relax.VirtualMachine(tvm.compile(mod, target=LLVM), tvm.cpu())
    rng = np.random.default_rng(0)
    p, q = conv_op.Geometry(pad, stride, dilation).out((h, w), (r, s))
    xn, wn = rng.standard_normal((n, h, w, c), "float32"), rng.standard_normal((c * m, r, s, 1), "float32")
    dyn = rng.standard_normal((n, p, q, c * m), "float32")
    _, (dx, dw) = vm["main_adjoint"](*(tvm.runtime.tensor(a) for a in (xn, wn, dyn)))
    _, want_dx, want_dw = _torch_reference(xn, wn, dyn, c, pad, stride, dilation)
    for got, want in ((dx.numpy(), want_dx), (dw.numpy(), want_dw)):
        assert got.shape == want.shape
        assert np.abs(got - want).max() <= 1e-5 * max(1.0, np.abs(want).max())


@pytest.mark.parametrize("geometry", GEOMETRIES, ids=_ids)
def test_depthwise_op_and_its_gradient_match_torch(geometry):
    """The three ops' portable (TE) kernels on llvm against float64 torch: both gradients of
    sum(y * dy)."""
    _check_gradients_on_llvm(geometry, _step(*geometry))


@pytest.mark.parametrize("geometry", GEOMETRIES[:3], ids=_ids)
def test_column_partials_give_the_same_weight_gradient(geometry, monkeypatch):
    """With ``COLUMN_PARTIALS`` met, the weight gradient's partial sums are laid out [G, R, S, K]
    and the second stage sums columns, then puts the taps back in [K, R, S, 1]: the same gradients
    on llvm against float64 torch."""
    monkeypatch.setattr(dwc, "COLUMN_PARTIALS", 1)
    _, _, _, c, m, r, s, *_ = geometry
    mod = _step(*geometry)
    (partial,) = [f for gv, f in tvm.relax.transform.LegalizeOps()(mod).functions_items()
                  if gv.name_hint.startswith("depthwise_conv2d_wgrad")]
    groups = json.loads(str(partial.attrs[dwc.DEPTHWISE_ATTR]))["groups"]
    assert [int(d) for d in partial.params[-1].shape] == [groups, r, s, c * m]
    _check_gradients_on_llvm(geometry, mod)


@pytest.mark.parametrize("h, c, r, stride, columns", [
    (112, 32, 3, 1, False),   # R·S·K 288: a column sum of 288 columns over 3584 groups is slow
    (28, 192, 3, 1, False),   # 1728
    (28, 240, 3, 2, False),   # 2160
    (14, 384, 3, 1, True),    # 3456
    (14, 480, 5, 1, True),    # 12000
    (7, 1152, 5, 1, True),
])
def test_weight_gradients_with_enough_taps_lay_their_partials_out_by_column(h, c, r, stride, columns):
    """By default the partial sums are [G, R, S, K] (a warp's stores contiguous) where R·S·K
    reaches ``COLUMN_PARTIALS``, else [K, R, S, G] (the second stage a row sum)."""
    g = conv_op.Geometry((r // 2,) * 4, (stride, stride), (1, 1))
    spec = dwc._spec("wgrad", (128, h, h, c), (c, r, r, 1), g, "bfloat16")
    assert spec.get("columns", False) == columns


def test_conv2d_to_matmul_makes_nhwc_depthwise_convolutions_the_op():
    """An NHWC/OHWI conv2d with groups = its channels becomes the op; with depthwise off (and for
    a grouped convolution) it stays a conv2d, between the NCHW transposes TVM's gradient takes."""

    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((2, 8, 8, 16), "float32"), w: R.Tensor((16, 3, 3, 1), "float32")):
            with R.dataflow():
                y = R.nn.conv2d(x, w, strides=[2, 2], padding=[1, 1, 1, 1], groups=16,
                                data_layout="NHWC", kernel_layout="OHWI", out_layout="NHWC")
                R.output(y)
            return y

    after = Conv2dToMatmul(depthwise=True)(Before)
    x, w = after["main"].params
    bb = relax.BlockBuilder()
    with bb.function("main", [x, w]):
        with bb.dataflow():
            y = bb.emit_output(dwc.depthwise_conv2d(x, w, conv_op.Geometry((1, 1, 1, 1), (2, 2), (1, 1))))
        bb.emit_func_output(y)
    tvm.ir.assert_structural_equal(after, bb.get())
    kept = Conv2dToMatmul(depthwise=False)(Before)
    assert "tvm_evt.depthwise_conv2d" not in kept.script() and "R.nn.conv2d" in kept.script()


def test_grouped_convolutions_are_not_depthwise():
    assert dwc.is_depthwise((2, 8, 8, 16), (16, 3, 3, 1), 16)
    assert dwc.is_depthwise((2, 8, 8, 16), (32, 3, 3, 1), 16)  # multiplier 2
    assert not dwc.is_depthwise((2, 8, 8, 16), (16, 3, 3, 4), 4)  # ResNeXt: 4 channels a group
    assert not dwc.is_depthwise((2, 8, 8, 1), (8, 3, 3, 1), 1)  # one channel: an ordinary convolution


def test_wgrad_grid_covers_the_lines_once():
    for lines, width, channels in ((128 * 112, 112, 32), (128 * 7, 7, 960), (4 * 9, 9, 6), (1, 1, 8), (1009, 997, 144)):
        groups, per = dwc.wgrad_grid(lines, width, channels)
        assert groups * per == lines  # every output line in one group, no partial group
        assert per * width >= min(lines * width, dwc.MIN_PIXELS)
        threads = groups * -(-channels // (dwc.TX * dwc.WGRAD_LANES)) * dwc.TX
        assert threads <= max(dwc.TARGET_THREADS, channels)  # about the target at most
    assert [dwc.strip_width(q) for q in (112, 56, 28, 14, 7, 9, 1)] == [8, 8, 7, 7, 7, 3, 1]


@pytest.mark.parametrize("op", ["fprop", "dgrad", "wgrad"])
def test_cuda_forms_are_scheduled_and_build_for_sm90(op):
    """Each kernel's CUDA form (``gpu_variant``, what ScheduleTIRForGPU swaps in) builds for sm_90a:
    threads bound, float32 sums in registers, bf16 pairs stored as one vector (fprop/dgrad)."""
    x, w, g = (8, 28, 28, 144), (144, 3, 3, 1), conv_op.Geometry((1, 1, 1, 1), (2, 2), (1, 1))
    portable = dwc.primfunc(dwc._spec(op, x, w, g, "bfloat16"))
    func = dwc.gpu_variant(portable)
    assert func.attrs["tirx.is_scheduled"]
    script = func.script()
    assert 'thread="threadIdx.x"' in script and 'scope="local"' in script
    if op != "wgrad":
        assert re.search(r"T.vectorized\(T.int64\(2\)\)", script)
    src = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}),
                      target=CUDA).mod.imports[0].inspect_source()
    assert "__global__" in src


@pytest.mark.parametrize("op, r, stride, rows", [
    ("fprop", 3, 1, 3),  # 3 rows of 10: the whole window (30 values a channel)
    ("fprop", 3, 2, 1),  # 3 rows of 15: a row at a time
    ("fprop", 5, 1, 1),  # 5 rows of 11
    ("dgrad", 3, 1, 3),
    ("dgrad", 5, 1, 1),
    ("wgrad", 3, 1, 3),
    ("wgrad", 5, 1, 5),  # the weight gradient's window whole: by rows it ran slower (H200)
])
def test_large_windows_are_held_a_filter_row_at_a_time(op, r, stride, rows):
    """A strip's input window of more than ``WINDOW`` values a channel is loaded a filter row at a
    time (EfficientNet's 5x5 and the stride-2 3x3 forward kernels took 95-162 registers a thread
    with it whole, 48 a row at a time, by ptxas for sm_90a), except in the weight gradient: the
    CUDA source's register window is `rows` rows of the strip's reach, two bf16 lanes each, and
    the taps one filter row's."""
    x, w = (8, 28, 28, 240), (240, r, r, 1)
    g = conv_op.Geometry((r // 2,) * 4, (stride, stride), (1, 1))
    spec = dwc._spec(op, x, w, g, "bfloat16")
    reach = (spec["strip"] - 1) * (1 if op == "dgrad" else stride) + r
    assert (dwc._window_values(spec) > dwc.WINDOW) == (rows < r or op == "wgrad" and r == 5)
    src = tvm.compile(tvm.IRModule({"main": dwc.gpu_primfunc(spec).with_attr("global_symbol", "main")}),
                      target=CUDA).mod.imports[0].inspect_source()
    assert re.search(rf"nv_bfloat16 pad_local_ptr\[{rows * reach * 2}\];", src), src[:2000]
    if op != "wgrad":  # (whose R·S taps are float32 sums kept over the whole walk)
        assert re.search(rf"nv_bfloat16 w_local_ptr\[{(r if rows > 1 else 1) * r * 2}\];", src)


# (H, C, R, stride[, multiplier, dilation]) of torchvision MobileNetV2's and timm EfficientNet-B0's
# depthwise convolutions (padding (R // 2) · dilation), and small odd ones
CUDA_FORM_SHAPES = [
    (112, 32, 3, 1), (112, 96, 3, 2), (56, 144, 3, 1), (56, 144, 3, 2), (28, 192, 3, 1), (28, 192, 3, 2),
    (14, 384, 3, 1), (14, 576, 3, 1), (14, 576, 3, 2), (7, 960, 3, 1), (56, 144, 5, 2), (28, 240, 5, 1),
    (28, 240, 3, 2), (14, 480, 5, 1), (14, 672, 5, 2), (7, 1152, 5, 1), (10, 6, 3, 2), (15, 40, 5, 2),
    (9, 8, 3, 1, 2), (11, 6, 3, 2, 2), (12, 10, 3, 1, 1, 2),
]


@pytest.mark.parametrize("op, lanes, columns", [("fprop", 1, False), ("fprop", 2, False), ("dgrad", 1, False),
                                               ("dgrad", 2, False), ("wgrad", 1, False), ("wgrad", 2, False),
                                               ("wgrad", 1, True), ("wgrad", 2, True)])
def test_cuda_forms_compute_what_torch_does(op, lanes, columns, monkeypatch):
    """The CUDA forms' index arithmetic, checked without a GPU: each schedule built with its thread
    bindings left as serial loops, lowered by the same TIR passes for llvm, against float64 torch.
    (TVM's index simplification once broke the 14x14x576 stride-2 dgrad here, with every CPU test
    of the portable forms passing.)  `columns`: wgrad's partial sums laid out [G, R, S, K]."""
    monkeypatch.setattr(tvm.s_tir.Schedule, "bind", lambda self, loop, thread: None)
    monkeypatch.setattr(dwc, "COLUMN_PARTIALS", 0 if columns else None)
    rng = np.random.default_rng(0)
    for h, c, r, stride, m, dilation in (shape + (1, 1)[len(shape) - 4:] for shape in CUDA_FORM_SHAPES):
        g = conv_op.Geometry((r // 2 * dilation,) * 4, (stride, stride), (dilation, dilation))
        spec = dwc._spec(op, (2, h, h, c), (c * m, r, r, 1), g, "float32")
        func = dwc.gpu_primfunc(spec, lanes=lanes).with_attr("global_symbol", "main")
        kernel = tvm.compile(tvm.IRModule({"main": func}), target=LLVM)
        p = g.out((h, h), (r, r))[0]
        x, w = rng.standard_normal((2, h, h, c), "float32"), rng.standard_normal((c * m, r, r, 1), "float32")
        dy = rng.standard_normal((2, p, p, c * m), "float32")
        want = dict(zip(("fprop", "dgrad", "wgrad"), _torch_reference(x, w, dy, c, g.pad, g.stride, g.dilation)))[op]
        operands = {"fprop": (x, w), "dgrad": (dy, w), "wgrad": (x, dy)}[op]
        assert spec.get("columns", False) == columns
        shape = want.shape
        if op == "wgrad":
            shape = (spec["groups"], r, r, c * m) if columns else want.shape[:3] + (spec["groups"],)
        out = tvm.runtime.tensor(np.zeros(shape, "float32"))
        kernel(*(tvm.runtime.tensor(a) for a in operands), out)
        got = out.numpy()
        if op == "wgrad":
            got = got.sum(0).transpose(2, 0, 1)[..., None] if columns else got.sum(-1, keepdims=True)
        err = np.linalg.norm(got - want) / np.linalg.norm(want)
        assert err <= 1e-5, f"{op} {(h, c, r, stride, m, dilation)}: {err:.2e}"


RELU6_MASK = ["logical_and", ["greater", 0.0], ["less", 6.0]]


@pytest.mark.parametrize("lanes", [1, 2])
def test_selected_dgrad_cuda_forms_compute_what_torch_does(lanes, monkeypatch):
    """``selected_dgrad``'s kernel (a ReLU6 gradient's select applied to the rounded input
    gradient) on the stride-1 strips, the strided phase strips and the direct form, threads as
    serial loops: ``where(0 < y < 6, dx, 0)`` exactly as torch's float64 dx selected."""
    monkeypatch.setattr(tvm.s_tir.Schedule, "bind", lambda self, loop, thread: None)
    rng = np.random.default_rng(1)
    for h, c, r, stride in ((9, 6, 3, 1), (12, 4, 5, 2), (11, 8, 3, 2)):
        g = conv_op.Geometry((r // 2,) * 4, (stride, stride), (1, 1))
        spec = {**dwc._spec("dgrad", (2, h, h, c), (c, r, r, 1), g, "float32"),
                "select": {"dtype": "float32", "mask": RELU6_MASK}}
        func = dwc.gpu_primfunc(spec, lanes=lanes).with_attr("global_symbol", "main")
        kernel = tvm.compile(tvm.IRModule({"main": func}), target=LLVM)
        p = g.out((h, h), (r, r))[0]
        x, w = rng.standard_normal((2, h, h, c), "float32"), rng.standard_normal((c, r, r, 1), "float32")
        dy = rng.standard_normal((2, p, p, c), "float32")
        y = rng.uniform(-2.0, 8.0, (2, h, h, c)).astype("float32")
        y[0, 0, 0, 0], y[0, 0, 1, 0] = 0.0, 6.0  # the bounds themselves are outside
        dx = _torch_reference(x, w, dy, c, g.pad, g.stride, g.dilation)[1]
        want = np.where((y > 0) & (y < 6), dx, 0.0)
        out = tvm.runtime.tensor(np.zeros(want.shape, "float32"))
        kernel(*(tvm.runtime.tensor(a) for a in (dy, w, y)), out)
        got = out.numpy()
        assert np.array_equal(got == 0, want == 0)
        err = np.linalg.norm(got - want) / np.linalg.norm(want)
        assert err <= 1e-5, f"{(h, c, r, stride)}: {err:.2e}"


def test_selected_dgrad_cuda_form_builds_for_sm90_with_vector_loads():
    """In bf16 the select reads its tensor as the sums are stored: bf16 pairs, one vector each."""
    x, w, g = (8, 28, 28, 144), (144, 3, 3, 1), conv_op.Geometry((1, 1, 1, 1), (1, 1), (1, 1))
    spec = {**dwc._spec("dgrad", x, w, g, "bfloat16"), "select": {"dtype": "bfloat16", "mask": RELU6_MASK}}
    func = dwc.gpu_variant(dwc.primfunc(spec))
    src = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}),
                      target=CUDA).mod.imports[0].inspect_source()
    assert "__global__" in src and re.search(r"\*\(nv_bfloat162\*\)\(sel_ptr \+", src), src


# ---------------------------------------------------------------------------------- GPU tier


def _kernels(cases, dtype):
    """The three ops of each R x R depthwise convolution `cases` lists as (N, H, C, R, stride)
    (padding R // 2), one function each (``fprop{i}(x, w)``, ``dgrad{i}(dy, w)``, ``wgrad{i}(x, dy)``),
    compiled for sm_90 on the evt pipeline's CUDA route in one module (one nvcc run: a module a case
    took over 150 s for 32 cases on the H200 host)."""
    import tvm_evt  # noqa: F401  (registers the "evt" pipeline)

    bb = relax.BlockBuilder()
    for i, (n, h, c, r, stride) in enumerate(cases):
        g = conv_op.Geometry((r // 2,) * 4, (stride, stride), (1, 1))
        p, q = g.out((h, h), (r, r))
        shapes = {"x": [n, h, h, c], "w": [c, r, r, 1], "dy": [n, p, q, c]}
        ops = {"fprop": (("x", "w"), lambda a, b, g=g: dwc.depthwise_conv2d(a, b, g)),
               "dgrad": (("dy", "w"), lambda a, b, g=g, s=shapes: dwc.depthwise_conv2d_dgrad(a, b, g, s["x"])),
               "wgrad": (("x", "dy"), lambda a, b, g=g, s=shapes: dwc.depthwise_conv2d_wgrad(a, b, g, s["w"]))}
        for name, (operands, call) in ops.items():
            params = [relax.Var(v, relax.TensorType(shapes[v], dtype)) for v in operands]
            with bb.function(f"{name}{i}", params):
                with bb.dataflow():
                    out = bb.emit_output(call(*params))
                bb.emit_func_output(out)
    return relax.VirtualMachine(tvm.compile(bb.get(), target=CUDA, relax_pipeline="evt"), tvm.cuda())


@pytest.mark.gpu
def test_depthwise_kernels_match_torch_and_time_against_cudnn_on_gpu():
    """MobileNetV2's and EfficientNet-B0's depthwise shapes in bf16: y, dx and dw at batch 4 against
    torch float64 (norm-wise error <= 1e-2 of the reference's norm); then at batch 128 the median
    time of each kernel, and of torch's bf16 conv2d forward and autograd backward (cuDNN) on the
    same channels-last inputs, written to $OUT/depthwise_times.json when OUT is set."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    from tvm_evt.bench_e2e import time_steps

    def cuda_time_ms(step) -> float:  # median of 20 after 5 warm-up steps
        for _ in range(5):
            step()
        return float(np.median(time_steps(step, 20)))

    def operands(n, h, c, r, stride):
        p = conv_op.Geometry((r // 2,) * 4, (stride, stride), (1, 1)).out((h, h), (r, r))[0]
        return (torch.randn(n, h, h, c, device="cuda").bfloat16(), torch.randn(c, r, r, 1, device="cuda").bfloat16(),
                torch.randn(n, p, p, c, device="cuda").bfloat16())

    shapes = [shape for shape in CUDA_FORM_SHAPES if len(shape) == 4 and shape[1] >= 32]
    small, n = 4, 128
    vm = _kernels([(b, *shape) for b in (small, n) for shape in shapes], "bfloat16")
    rows = []
    for i, (h, c, r, stride) in enumerate(shapes):
        x, w, dy = operands(small, h, c, r, stride)
        tx, tw, tdy = (tvm.runtime.from_dlpack(t) for t in (x, w, dy))
        got = {"y": vm[f"fprop{i}"](tx, tw), "dx": vm[f"dgrad{i}"](tdy, tw), "dw": vm[f"wgrad{i}"](tx, tdy)}
        reference = _torch_reference(*(t.float().cpu().numpy() for t in (x, w, dy)), c, (r // 2,) * 4,
                                     (stride, stride), (1, 1))
        want = {name: torch.from_numpy(ref) for name, ref in zip(("y", "dx", "dw"), reference)}
        for name in got:
            out = torch.from_dlpack(got[name]).double().cpu()
            assert out.shape == want[name].shape and torch.isfinite(out).all(), name
            err = float((out - want[name]).norm() / want[name].norm())
            assert err <= 1e-2, f"{(h, c, r, stride)} {name}: {err:.2e}"

        j = i + len(shapes)  # the same shape at batch n
        x, w, dy = operands(n, h, c, r, stride)
        tx, tw, tdy = (tvm.runtime.from_dlpack(t) for t in (x, w, dy))
        xc = x.permute(0, 3, 1, 2).requires_grad_()  # channels-last memory, as the ops read it
        wc = w.permute(0, 3, 1, 2).contiguous().requires_grad_()
        dyc = dy.permute(0, 3, 1, 2)
        out = torch.nn.functional.conv2d(xc, wc, stride=stride, padding=r // 2, groups=c)
        mine = {"fprop": cuda_time_ms(lambda: vm[f"fprop{j}"](tx, tw)),
                "dgrad": cuda_time_ms(lambda: vm[f"dgrad{j}"](tdy, tw)),
                "wgrad": cuda_time_ms(lambda: vm[f"wgrad{j}"](tx, tdy))}
        theirs = {"forward": cuda_time_ms(lambda: torch.nn.functional.conv2d(xc, wc, stride=stride, padding=r // 2,
                                                                             groups=c)),
                  "backward": cuda_time_ms(lambda: torch.autograd.grad(out, (xc, wc), dyc, retain_graph=True))}
        total, torch_total = sum(mine.values()), sum(theirs.values())
        rows.append({"h": h, "c": c, "r": r, "stride": stride, "batch": n,
                     **{f"{k}_ms": round(v, 4) for k, v in mine.items()},
                     **{f"torch_{k}_ms": round(v, 4) for k, v in theirs.items()},
                     "tvm_evt_ms": round(total, 4), "torch_ms": round(torch_total, 4),
                     "speedup": round(torch_total / total, 3)})
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "depthwise_times.json"), "w") as f:
            json.dump(rows, f, indent=1)
    print(json.dumps(rows, indent=1))

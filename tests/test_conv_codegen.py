"""Implicit-GEMM convolution codegen without a GPU: what ``supported`` refuses, the emitted entries,
the partition function's reading, and (slow) an nvcc build of the three kernels whose exported
entries check their arguments (the kernels' numbers: tests/test_gpu_conv.py)."""
import dataclasses
import os
import shutil
import subprocess

import numpy as np
import pytest

from tvm_evt.codegen.backend.conv import emit_conv, tile
from tvm_evt.codegen.build import toolchain
from tvm_evt.codegen.errors import Unsupported
from tvm_evt.codegen.frontend.conv_call import supported
from tvm_evt.codegen.ir.conv import ConvCall


def call(**kw) -> ConvCall:
    """ResNet-50 conv3_x's 3x3 convolution at batch 2 (bf16, pad 1, stride 1)."""
    base = dict(symbol="conv_fprop", kind="fprop", dtype="bfloat16", x=(2, 28, 28, 128), w=(128, 3, 3, 128),
                y=(2, 28, 28, 128), pad=(1, 1, 1, 1), stride=(1, 1), dilation=(1, 1))
    return ConvCall(**{**base, **kw})


STRIDED = dict(x=(2, 16, 16, 64), w=(128, 3, 3, 64), y=(2, 8, 8, 128), stride=(2, 2))


def test_dps_arguments_and_gemm_of_each_kind():
    assert (call().inputs, call().outputs) == (("x", "w"), ("y",))
    assert (call(kind="dgrad").inputs, call(kind="dgrad").outputs) == (("dy", "w"), ("dx",))
    assert (call(kind="wgrad").inputs, call(kind="wgrad").outputs) == (("x", "dy"), ("dw",))
    assert call().gemm == (2 * 28 * 28, 128, 9 * 128)
    assert call(kind="wgrad").gemm == (128, 9 * 128, 2 * 28 * 28)


@pytest.mark.parametrize("kind, operator, checked, operands", [
    ("fprop", "kFprop", [("x", "2, 28, 28, 128"), ("w", "128, 3, 3, 128"), ("y", "2, 28, 28, 128")], ("x", "w", "y")),
    ("dgrad", "kDgrad", [("dy", "2, 28, 28, 128"), ("w", "128, 3, 3, 128"), ("dx", "2, 28, 28, 128")], ("dy", "w", "dx")),
    ("wgrad", "kWgrad", [("x", "2, 28, 28, 128"), ("dy", "2, 28, 28, 128"), ("dw", "128, 3, 3, 128")], ("dy", "x", "dw")),
])
def test_entry_checks_every_argument_and_binds_the_operands(kind, operator, checked, operands):
    src = emit_conv(call(kind=kind, symbol=f"conv_{kind}"))
    assert f'extern "C" TVM_FFI_DLL_EXPORT int __tvm_ffi_conv_{kind}(' in src
    assert f"cutlass::conv::Operator::{operator};" in src and "expects 3 tensors" in src
    for i, (name, shape) in enumerate(checked):
        assert f"DLTensor* {name} = tensors[{i}];" in src
        assert f'tvm_evt::check_tensor({name}, kKernel, "{name}", {{{shape}}}, kDLBfloat, 16, device_id)' in src
    a, b, d = operands  # CUTLASS's A, B and output: dgrad reads dy, wgrad dy then x
    assert (f"launch(problem, tvm_evt::data_of<Element const>({a}), tvm_evt::data_of<Element const>({b}),\n"
            f"                tvm_evt::data_of<Element>({d}), device_id, stream, kKernel)") in src
    # the problem is always built from the activation x and the filter w
    assert "ProblemShape::TensorExtent{batch, 28, 28, 128}, ProblemShape::TensorExtent{128, 3, 3, 128}" in src
    assert "make_problem(2);" in src
    assert "cutlass::conv::KernelImplicitTmaWarpSpecializedSm90" in src
    assert "TVMFFIEnvGetStream(kDLCUDA, device_id)" in src and "tvm_evt::launch<Conv>(args, stream, kKernel," in src


def test_geometry_epilogue_and_dtype_reach_the_source():
    src = emit_conv(call(dtype="float16", pad=(1, 2, 0, 1), x=(2, 15, 16, 64), w=(64, 3, 5, 64),
                         y=(2, 14, 15, 64), dilation=(1, 1)))
    assert "ProblemShape::ShapePadding{1, 2}, ProblemShape::ShapePadding{0, 1}" in src
    assert "using Element = cutlass::half_t;" in src and "kDLFloat, 16" in src
    assert "cutlass::epilogue::TmaWarpSpecialized" in src and "TensorNHWC;" in src
    wgrad = emit_conv(call(kind="wgrad"))
    assert "cutlass::epilogue::NoSmemWarpSpecialized" in wgrad and "TensorKCSR;" in wgrad
    assert "using TileShape = Shape<_128, Shape<_128>, Shape<_64>>;" in wgrad
    strided = emit_conv(call(**STRIDED))
    assert "ProblemShape::TraversalStride{2, 2}" in strided and "ProblemShape::ShapeDilation{1, 1}" in strided


def test_tile_follows_the_channels():
    assert tile(call()) == (128, 128, 64)
    assert tile(call(x=(2, 28, 28, 64), w=(64, 3, 3, 64), y=(2, 28, 28, 64))) == (128, 64, 64)
    assert tile(call(kind="wgrad", x=(2, 28, 28, 256), w=(64, 3, 3, 256), y=(2, 28, 28, 64))) == (64, 128, 64)
    narrow = call(kind="dgrad", x=(2, 28, 28, 64), w=(128, 3, 3, 64), y=(2, 28, 28, 128))  # dgrad's N is C
    # a weight gradient of 144 tiles of 128x128 (one wave and a tenth on 132 SMs) takes 128x64: 288
    last = dict(kind="wgrad", x=(128, 7, 7, 512), w=(512, 3, 3, 512), y=(128, 7, 7, 512))
    assert tile(call(**last)) == (128, 64, 64)
    assert tile(call(kind="wgrad", x=(128, 14, 14, 256), w=(256, 3, 3, 256), y=(128, 14, 14, 256))) == (128, 128, 64)
    assert tile(call(kind="fprop", x=(128, 7, 7, 512), w=(512, 3, 3, 512), y=(128, 7, 7, 512))) == (128, 128, 64)
    assert "using TileShape = Shape<_128, _64, Shape<_64>>;" in emit_conv(narrow)


def test_same_call_same_source():
    assert emit_conv(call()) == emit_conv(call())
    assert emit_conv(call()) != emit_conv(call(pad=(1, 1, 1, 1), dilation=(1, 1), kind="dgrad"))
    assert emit_conv(call()) != emit_conv(call(dtype="float16"))


@pytest.mark.parametrize("kind", ["fprop", "dgrad", "wgrad"])
def test_supported_takes_the_training_convolutions(kind):
    assert supported(call(kind=kind)) is None
    assert supported(call(kind=kind, x=(2, 12, 20, 32), w=(64, 3, 5, 32), y=(2, 12, 20, 64), pad=(1, 2, 1, 2))) is None
    assert supported(call(kind=kind, x=(2, 16, 16, 64), w=(64, 3, 3, 64), y=(2, 16, 16, 64), pad=(2, 2, 2, 2),
                          dilation=(2, 2))) is None
    pointwise = dict(x=(2, 14, 14, 64), w=(256, 1, 1, 64), y=(2, 7, 7, 256), pad=(0, 0, 0, 0), stride=(2, 2))
    if kind != "dgrad":
        assert supported(call(kind=kind, **STRIDED)) is None
        assert supported(call(kind=kind, **pointwise)) is None


@pytest.mark.parametrize("bad, reason", [
    (dict(dtype="float32"), "dtype float32"),
    (dict(x=(2, 28, 28, 12), w=(128, 3, 3, 12)), "C=12, K=128 must be multiples of 8"),
    (dict(w=(20, 3, 3, 128), y=(2, 28, 28, 20)), "C=128, K=20 must be multiples of 8"),
    (dict(kind="dgrad", **STRIDED), "dgrad with stride"),
    (dict(y=(2, 27, 28, 128)), "disagree"),
    (dict(w=(128, 3, 3, 64)), "disagree"),
    (dict(x=(2, 400, 28, 128), y=(2, 798, 28, 128), pad=(200, 1, 200, 1)), "padding"),
    (dict(x=(2, 600, 28, 128), y=(2, 302, 28, 128), dilation=(150, 1)), "filter extent"),
    (dict(x=(2, 28, 28, 128), w=(128, 1, 1, 128), y=(2, 28, 28, 128), pad=(0, 0, 0, 0), kind="wgrad",
          dilation=(1, 1)), None),
])
def test_supported_says_why_not(bad, reason):
    got = supported(call(**bad))
    if reason is None:
        assert got is None
    else:
        assert got is not None and reason in got, got
        with pytest.raises(Unsupported, match=reason.split(" ")[0]):
            emit_conv(call(**bad))


def test_emitter_refuses_a_symbol_that_is_not_an_identifier():
    with pytest.raises(Unsupported, match="not a C identifier"):
        emit_conv(call(symbol="main-conv0"))


def _op(name):
    import tvm

    try:
        import tvm_evt.relax_passes.ops.conv_op  # noqa: F401  (registers the ops)

        return tvm.ir.Op.get(name)
    except Exception:  # the ops are not registered (yet)
        pytest.skip(f"{name} is not registered")


def _function(op_name, a_type, b_type, geometry, shape=None, swap=False, symbol="main_conv0"):
    from tvm import relax

    op = _op(op_name)
    a, b = relax.Var("a", a_type), relax.Var("b", b_type)
    bb = relax.BlockBuilder()
    with bb.function("conv", [a, b]):
        args = [b, a] if swap else [a, b]
        extra = [relax.ShapeExpr(list(geometry))] + ([relax.ShapeExpr(list(shape))] if shape else [])
        out = bb.emit(relax.Call(op, args + extra))
        bb.emit_func_output(out)
    return bb.get()["conv"].with_attrs({"Codegen": "evt_conv", "global_symbol": symbol})


def test_conv_of_function_reads_the_three_ops():
    from tvm import relax

    from tvm_evt.codegen.frontend.conv_call import conv_of_function

    t = lambda shape, dtype="bfloat16": relax.TensorType(shape, dtype)  # noqa: E731
    geometry = (1, 1, 1, 1, 2, 2, 1, 1)
    fprop = conv_of_function(_function("tvm_evt.conv2d", t((2, 16, 16, 64)), t((128, 3, 3, 64)), geometry))
    assert fprop == ConvCall("main_conv0", "fprop", "bfloat16", (2, 16, 16, 64), (128, 3, 3, 64), (2, 8, 8, 128),
                             (1, 1, 1, 1), (2, 2), (1, 1))
    wgrad = conv_of_function(_function("tvm_evt.conv2d_wgrad", t((2, 16, 16, 64)), t((2, 8, 8, 128)), geometry,
                                       shape=(128, 3, 3, 64)))
    assert wgrad == dataclasses.replace(fprop, kind="wgrad")
    dgrad = (1, 1, 1, 1, 1, 1, 1, 1)
    got = conv_of_function(_function("tvm_evt.conv2d_dgrad", t((2, 16, 16, 128), "float16"), t((128, 3, 3, 64), "float16"),
                                     dgrad, shape=(2, 16, 16, 64)))
    assert (got.kind, got.dtype, got.x, got.y, got.stride) == ("dgrad", "float16", (2, 16, 16, 64), (2, 16, 16, 128), (1, 1))
    with pytest.raises(Unsupported, match="tvm_evt.conv2d_dgrad: dgrad with stride"):
        conv_of_function(_function("tvm_evt.conv2d_dgrad", t((2, 8, 8, 128)), t((128, 3, 3, 64)), geometry,
                                   shape=(2, 16, 16, 64)))
    with pytest.raises(Unsupported, match="tvm_evt.conv2d: dtype float32"):
        conv_of_function(_function("tvm_evt.conv2d", t((2, 16, 16, 64), "float32"), t((128, 3, 3, 64), "float32"),
                                   geometry))


@pytest.fixture
def cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    return tmp_path


@pytest.mark.slow
def test_nvcc_builds_the_three_kernels_and_entries_check_arguments(cache_home, tmp_path):
    """Minutes of nvcc (three CUTLASS kernels in parallel); the exported entries raise TVM FFI errors."""
    if toolchain.find_nvcc() is None or shutil.which("ld") is None:
        pytest.skip("nvcc absent")
    from tvm_evt.codegen.build import kernel_entries
    from tvm_evt.codegen.relax_ext import build_conv

    geometry = dict(x=(2, 8, 8, 64), w=(64, 3, 3, 64), y=(2, 8, 8, 64))
    split = dict(x=(27, 28, 28, 64), w=(64, 3, 3, 64), y=(27, 28, 28, 64))  # 14 uneven chunks (splits)
    calls = [call(kind=kind, symbol=f"build_{kind}", **(split if kind == "wgrad" else geometry))
             for kind in ("fprop", "dgrad", "wgrad")]
    lib = build_conv(calls)
    objects = sorted((cache_home / "tvm_evt").rglob("*.o"))
    kernels = [o for o in objects if kernel_entries(o)]
    assert len(kernels) >= 3 and all(len(kernel_entries(o)) == 1 for o in kernels if "module-" not in o.name)
    # profiles name each convolution's CUTLASS kernel by its call's symbol, as they do partitions
    from tvm_evt.codegen.relax_ext import kernel_partitions

    named = {s for o in kernels for e in kernel_entries(o) for s in kernel_partitions(e)}
    assert {c.symbol for c in calls} <= named, named
    so = tmp_path / "conv.so"
    lib.export_library(str(so))
    syms = subprocess.run(["nm", "-D", "--defined-only", str(so)], capture_output=True, text=True).stdout
    assert all(f"__tvm_ffi_{c.symbol}" in syms for c in calls)
    import tvm_ffi

    module = tvm_ffi.load_module(str(so))
    fprop = module["build_fprop"]
    with pytest.raises(TypeError, match="expects 3 tensors, got 0"):
        fprop()
    x = tvm_ffi.from_dlpack(np.zeros((2, 8, 8, 64), np.float32))
    with pytest.raises(ValueError, match="x must be on cuda"):
        fprop(x, x, x)
    assert os.path.getsize(so) > 0


def test_a_long_weight_gradient_on_few_tiles_is_split_over_the_batch():
    """ResNet-50 conv3_x's weight gradient: 9 tiles, K = 100352 -> 13 launches (117 CTAs, 14 would
    not shorten the largest chunk) on the side streams, 11 of 10 images and 2 of 9, into float32
    partials summed into dw; its forward convolution is one launch."""
    from tvm_evt.codegen.backend.conv import emit_conv, splits

    geometry = dict(dtype="bfloat16", x=(128, 28, 28, 128), w=(128, 3, 3, 128), y=(128, 28, 28, 128),
                    pad=(1, 1, 1, 1), stride=(1, 1), dilation=(1, 1))
    wgrad = ConvCall(symbol="split_wgrad", kind="wgrad", **geometry)
    fprop = ConvCall(symbol="whole_fprop", kind="fprop", **geometry)
    assert (splits(wgrad), splits(fprop)) == (13, 1)
    src = emit_conv(wgrad)
    for text in ("constexpr int kSplits = 13, kChunk = 9, kBig = 11;", "make_problem(kChunk + 1), make_problem(kChunk)",
                 "using ElementD = float;", "constexpr int64_t kImageDy = 100352, kImageX = 100352;",
                 "tvm_evt::sum_partials<<<", "constexpr int64_t kOut = 147456;", "constexpr int kMaxSplits = 16;"):
        assert text in src, text
    whole = emit_conv(fprop)
    assert "sum_partials" not in whole and "make_problem(128)" in whole and "using ElementD = Element;" in whole


@pytest.mark.parametrize("batch,channels,hw,want", [
    (128, 128, 28, 13),  # 9 tiles: 14 chunks fit the 132 SMs, but 13 have the same largest chunk (10 images)
    (8, 128, 56, 8),  # a chunk per image
    (27, 64, 28, 14),  # 13 chunks of two images and one of one
    (1, 128, 128, 1),  # one image cannot be split (OffloadConv leaves it to im2col + GEMM)
])
def test_a_split_weight_gradient_fills_the_sms_with_chunks_an_image_apart(batch, channels, hw, want):
    from tvm_evt.codegen.backend.conv import SMS, splits, tiles

    call = ConvCall(symbol="wgrad", kind="wgrad", dtype="bfloat16", x=(batch, hw, hw, channels),
                    w=(channels, 3, 3, channels), y=(batch, hw, hw, channels), pad=(1, 1, 1, 1), stride=(1, 1),
                    dilation=(1, 1))
    n = splits(call)
    assert n == want and tiles(call) * n <= SMS
    if n > 1:
        chunk, big = batch // n, batch % n
        assert f"constexpr int kSplits = {n}, kChunk = {chunk}, kBig = {big};" in emit_conv(call)
        assert chunk * n + big == batch and 0 <= big < n

"""Implicit-GEMM convolutions (relax.ext.evt_conv) against a float64 torch reference on the GPU.

Each case builds the fprop, dgrad and wgrad kernels the kernels take (``supported``) for one
geometry through ``build_conv``, exports and loads them, and checks y, dx and dw on fresh random
inputs with the outputs poisoned (NaN) before the run: every element finite, the norm-wise
relative error at most 1e-2.  The reference is torch's own convolution and its autograd in float64
on NCHW permutes (asymmetric padding applied with ``F.pad``).
"""
from __future__ import annotations

import os

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

CASES = [
    # id, (N, H, W, C), (K, R, S), pad (top, left, bottom, right), stride, dilation, kinds the kernels take
    ("resnet_conv3", (4, 28, 28, 128), (128, 3, 3), (1, 1, 1, 1), (1, 1), (1, 1), ("fprop", "dgrad", "wgrad")),
    # ResNet's strided 3x3 (H + 2 - 3 odd: the last padded row is never read); no strided dgrad on SM90
    # (OffloadConv runs it as the unit-stride dgrads of its stride phases, the phase_* cases)
    ("stride2", (2, 16, 16, 64), (128, 3, 3), (1, 1, 1, 1), (2, 2), (1, 1), ("fprop", "wgrad")),
    ("downsample_1x1", (2, 14, 14, 64), (256, 1, 1), (0, 0, 0, 0), (2, 2), (1, 1), ("fprop", "wgrad")),
    # non-square input and filter, asymmetric padding, 32 channels (a partial 64-channel K step)
    ("nonsquare", (2, 12, 20, 32), (64, 3, 5), (1, 2, 0, 1), (1, 1), (1, 1), ("fprop", "dgrad", "wgrad")),
    ("dilated", (2, 16, 16, 64), (64, 3, 3), (2, 2, 2, 2), (1, 1), (2, 2), ("fprop", "dgrad", "wgrad")),
    # the stride phases of "stride2"'s dgrad (relax_passes/ops/conv_op.py:split_strided_dgrad): unit-stride
    # dgrads of its 2x2, 2x1, 1x2 and 1x1 sub-filters, padded before only
    ("phase_2x2", (2, 8, 8, 64), (128, 2, 2), (1, 1, 0, 0), (1, 1), (1, 1), ("fprop", "dgrad", "wgrad")),
    ("phase_2x1", (2, 8, 8, 64), (128, 2, 1), (1, 0, 0, 0), (1, 1), (1, 1), ("fprop", "dgrad", "wgrad")),
    ("phase_1x1", (2, 8, 8, 64), (128, 1, 1), (0, 0, 0, 0), (1, 1), (1, 1), ("fprop", "dgrad", "wgrad")),
    # a weight gradient of 9 tiles over K = 25088: split over the batch into 8 concurrent launches
    ("wgrad_split", (8, 56, 56, 64), (64, 3, 3), (1, 1, 1, 1), (1, 1), (1, 1), ("fprop", "dgrad", "wgrad")),
    # 27 images over K = 21168: 14 launches, 13 of two images and one of one
    ("wgrad_uneven_split", (27, 28, 28, 64), (64, 3, 3), (1, 1, 1, 1), (1, 1), (1, 1), ("fprop", "dgrad", "wgrad")),
]


def _calls(name, x, krs, pad, stride, dilation, kinds, dtype):
    from tvm_evt.codegen.frontend.conv_call import output_extent, supported
    from tvm_evt.codegen.ir.conv import ConvCall

    n, h, wd, c = x
    k, r, s = krs
    p = output_extent(h, pad[0], pad[2], r, stride[0], dilation[0])
    q = output_extent(wd, pad[1], pad[3], s, stride[1], dilation[1])
    calls = {}
    for kind in ("fprop", "dgrad", "wgrad"):
        spec = ConvCall(symbol=f"{name}_{dtype}_{kind}", kind=kind, dtype=dtype, x=x, w=(k, r, s, c), y=(n, p, q, k),
                        pad=pad, stride=stride, dilation=dilation)
        reason = supported(spec)
        assert (reason is None) == (kind in kinds), f"{kind}: {reason}"
        if reason is None:
            calls[kind] = spec
    return calls


def _reference(x, w, dy, pad, stride, dilation):
    """y, dx, dw in float64 from NHWC x, KRSC w and NPQK dy (torch's NCHW convolution)."""
    import torch
    import torch.nn.functional as F

    xt = x.double().permute(0, 3, 1, 2).requires_grad_(True)
    wt = w.double().permute(0, 3, 1, 2).requires_grad_(True)
    pt, pl, pb, pr = pad
    y = F.conv2d(F.pad(xt, (pl, pr, pt, pb)), wt, stride=stride, dilation=dilation)
    dx, dw = torch.autograd.grad(y, (xt, wt), dy.double().permute(0, 3, 1, 2))
    nhwc = lambda t: t.detach().permute(0, 2, 3, 1)  # noqa: E731
    return nhwc(y), nhwc(dx), nhwc(dw)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_conv_matches_float64(case, dtype, tmp_path):
    import torch
    import tvm

    from tvm_evt.codegen.relax_ext import build_conv

    name, x_shape, krs, pad, stride, dilation, kinds = case
    calls = _calls(name, x_shape, krs, pad, stride, dilation, kinds, dtype)
    lib = build_conv(list(calls.values()))
    path = os.path.join(str(tmp_path), f"{name}_{dtype}.so")
    lib.export_library(path)
    mod = tvm.runtime.load_module(path)

    spec = next(iter(calls.values()))
    tdt = getattr(torch, dtype)
    gen = torch.Generator(device="cuda").manual_seed(int.from_bytes(os.urandom(4), "little"))

    def randn(shape):
        return torch.randn(*shape, device="cuda", generator=gen).to(tdt)

    tensors = {"x": randn(spec.x), "w": randn(spec.w), "dy": randn(spec.y)}
    outputs = {kind: torch.full(spec.shape(c.outputs[0]), float("nan"), device="cuda", dtype=tdt)
               for kind, c in calls.items()}
    for kind, c in calls.items():
        args = [tensors[n] for n in c.inputs] + [outputs[kind]]
        mod[c.symbol](*[tvm.runtime.from_dlpack(t) for t in args])
    torch.cuda.synchronize()
    y, dx, dw = _reference(tensors["x"], tensors["w"], tensors["dy"], pad, stride, dilation)
    for kind, want in (("fprop", y), ("dgrad", dx), ("wgrad", dw)):
        if kind not in outputs:
            continue
        got = outputs[kind].double()
        assert got.shape == want.shape, f"{kind}: shape {tuple(got.shape)}, expected {tuple(want.shape)}"
        assert torch.isfinite(got).all(), f"{kind}: {int((~torch.isfinite(got)).sum())} non-finite elements"
        err = float((got - want).norm() / want.norm())
        assert err <= 1e-2, f"{kind} ({dtype}): relative error {err:.3e}"


def test_entry_rejects_wrong_shapes_and_dtypes(tmp_path):
    import torch
    import tvm

    from tvm_evt.codegen.relax_ext import build_conv

    calls = _calls("check", (2, 8, 8, 64), (64, 3, 3), (1, 1, 1, 1), (1, 1), (1, 1), ("fprop", "dgrad", "wgrad"),
                   "bfloat16")
    lib = build_conv([calls["fprop"]])
    path = os.path.join(str(tmp_path), "check.so")
    lib.export_library(path)
    fprop = tvm.runtime.load_module(path)[calls["fprop"].symbol]
    x = torch.zeros(2, 8, 8, 64, device="cuda", dtype=torch.bfloat16)
    w = torch.zeros(64, 3, 3, 64, device="cuda", dtype=torch.bfloat16)
    y = torch.zeros(2, 8, 8, 64, device="cuda", dtype=torch.bfloat16)
    ffi = lambda *ts: [tvm.runtime.from_dlpack(t) for t in ts]  # noqa: E731
    fprop(*ffi(x, w, y))
    with pytest.raises(ValueError, match="dim 3 is 32"):
        fprop(*ffi(x[..., :32].contiguous(), w, y))
    with pytest.raises(TypeError, match="dtype"):
        fprop(*ffi(x.half(), w, y))


def test_kernels_of_one_type_in_one_unit_compute_what_each_alone_does(tmp_path):
    """Calls of one kernel type (fprop and wgrad of 128 channels at five geometries, two split over
    the batch) built as one nvcc translation unit, and each built alone: the same bits out of
    every entry (issue #40: the unit compiles the CUTLASS type once)."""
    import dataclasses

    import torch
    import tvm

    from tvm_evt.codegen.build import build_many
    from tvm_evt.codegen.build.units import translation_units
    from tvm_evt.codegen.relax_ext import build_conv, conv_sources

    geometries = [("g28", (4, 28, 28, 128), (1, 1, 1, 1), (1, 1)), ("g14", (2, 14, 14, 128), (1, 1, 1, 1), (1, 1)),
                  ("g16s2", (2, 16, 16, 128), (1, 1, 1, 1), (2, 2)), ("g56", (8, 56, 56, 128), (1, 1, 1, 1), (1, 1)),
                  ("g48", (8, 48, 48, 128), (1, 1, 1, 1), (1, 1))]
    calls = [c for name, x, pad, stride in geometries
             for c in _calls(name, x, (128, 3, 3), pad, stride, (1, 1), ("fprop", "wgrad") if stride != (1, 1)
                             else ("fprop", "dgrad", "wgrad"), "bfloat16").values() if c.kind != "dgrad"]
    units = translation_units(conv_sources(calls))
    assert len(units) < len(calls), [names for names, _ in units]

    def load(lib, name):
        path = os.path.join(str(tmp_path), f"{name}.so")
        lib.export_library(path)
        return tvm.runtime.load_module(path)

    together = load(build_conv(calls), "together")
    alone = [dataclasses.replace(c, symbol=f"alone_{c.symbol}") for c in calls]
    build_many({c.symbol: src for c in alone for src in [conv_sources([c])[c.symbol]]})  # in parallel, then cached
    gen = torch.Generator(device="cuda").manual_seed(int.from_bytes(os.urandom(4), "little"))
    for call, solo in zip(calls, alone):
        module = load(build_conv([solo]), solo.symbol)
        tensors = {"x": torch.randn(*call.x, device="cuda", generator=gen).bfloat16(),
                   "w": torch.randn(*call.w, device="cuda", generator=gen).bfloat16(),
                   "dy": torch.randn(*call.y, device="cuda", generator=gen).bfloat16()}
        outs = []
        for mod, c in ((together, call), (module, solo)):
            out = torch.full(call.shape(c.outputs[0]), float("nan"), device="cuda", dtype=torch.bfloat16)
            mod[c.symbol](*[tvm.runtime.from_dlpack(t) for t in [tensors[n] for n in c.inputs] + [out]])
            outs.append(out)
        torch.cuda.synchronize()
        assert torch.isfinite(outs[0]).all() and torch.equal(outs[0], outs[1]), call.symbol

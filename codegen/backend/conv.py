"""Emit a CUTLASS SM90 implicit-GEMM convolution's C++ for a ``ConvCall`` (one TVM FFI entry).

The entry bakes in the shapes, padding, stride and dilation, checks every DPS argument against
them (``tvm_evt::check_tensor``; TVM's tensors are 64-byte aligned, as TMA needs), builds the
``ConvProblemShape`` from the activation and filter shapes, asks ``can_implement`` and launches on
TVM's current CUDA stream.  The tile follows the GEMM's shape (``tile``): 128 or 64 along M and N,
so that 64-channel layers get no half-empty tiles; K steps are 64 channels.  A weight gradient of
few tiles over a long reduction is split over the batch (``splits``).
"""
from __future__ import annotations

import re

from ..errors import Unsupported
from ..frontend.conv_call import supported
from ..ir.conv import ConvCall
from .conv_templates import (HEADER, KERNEL, KERNEL_TYPES, SINGLE_LAUNCH, SPLIT_LAUNCH, SPLIT_PRELUDE,
                             STRIDE_ACTIVATION, STRIDE_FILTER)
from .kernel_type import type_line
from .sm90_emitter import CODEGEN_VERSION
from .templates import PRELUDE

ELEMENT = {"bfloat16": "cutlass::bfloat16_t", "float16": "cutlass::half_t"}
DL_CODE = {"bfloat16": ("kDLBfloat", 16), "float16": ("kDLFloat", 16)}
OPERATOR = {"fprop": "kFprop", "dgrad": "kDgrad", "wgrad": "kWgrad"}
# kind -> (operand A, operand B, output D) among the DPS arguments (see conv_templates)
OPERANDS = {"fprop": ("x", "w", "y"), "dgrad": ("dy", "w", "dx"), "wgrad": ("dy", "x", "dw")}
# the ConvProblemShape member holding the output [N, P, Q, K] it computes from x and w
XFORMED = {"fprop": "shape_C", "dgrad": "shape_A", "wgrad": "shape_A"}


def tile(call: ConvCall) -> tuple[int, int, int]:
    """(M, N, K) of the CTA tile: N 128 where the GEMM's N dimension (its channel part for wgrad)
    fills it, else 64; M 128, but 64 for a wgrad of fewer than 128 output channels (its M = K).
    A wgrad whose 128-wide tiles fill one wave but not two takes N 64: twice the tiles, so the
    last wave is not mostly idle (ResNet-50's 7x7-map 3x3 weight gradients, 512 channels, 144
    tiles of 128x128 on 132 SMs: 0.071-0.073 ms on 128x64 against 0.078-0.079, H200,
    ``docs/bench/h200-2026-12-01c/conv/``)."""
    channels = {"fprop": call.w[0], "dgrad": call.x[3], "wgrad": call.x[3]}[call.kind]
    rows = 128 if call.kind != "wgrad" or call.w[0] >= 128 else 64
    cols = 128 if channels >= 128 else 64
    if call.kind == "wgrad" and cols == 128 and SMS <= _tile_count(call, rows, cols) < 2 * SMS:
        cols = 64
    return rows, cols, 64


SMS = 132  # the SMs of an H100 SXM (and an H200): one CTA of these kernels each
MIN_CTAS = SMS // 2
MAX_SPLITS = 16  # side streams a split weight gradient runs on (tvm_evt::kMaxSplits)
LONG_K = 8192  # a reduction this long keeps one CTA busy for tens of microseconds


def _tile_count(call: ConvCall, tm: int, tn: int) -> int:
    """Output tiles of `tm` x `tn` of one launch over the whole batch (wgrad's N tiles run over
    the channels of one filter tap each)."""
    m, n, _ = call.gemm
    if call.kind == "wgrad":
        n = call.w[1] * call.w[2] * -(-call.w[3] // tn) * tn
    return -(-m // tm) * -(-n // tn)


def tiles(call: ConvCall) -> int:
    """Output tiles of one launch over the whole batch, on ``tile(call)``."""
    tm, tn, _ = tile(call)
    return _tile_count(call, tm, tn)


def splits(call: ConvCall) -> int:
    """Batch chunks a weight gradient on fewer than ``MIN_CTAS`` tiles, each a reduction longer
    than ``LONG_K``, is split into (each chunk a launch of its own on a side stream, their float32
    partials summed after; chunks differ by at most one image).  All chunks' CTAs fit the SMs at
    once, so the largest chunk sets the time: the fewest chunks whose largest is the smallest that
    fits, at most ``MAX_SPLITS``.  1 for everything else."""
    count, batch = tiles(call), call.x[0]
    if call.kind != "wgrad" or count >= MIN_CTAS or call.gemm[2] <= LONG_K:
        return 1
    candidates = range(1, max(1, min(MAX_SPLITS, batch, SMS // count)) + 1)
    largest = lambda n: -(-batch // n)
    return min(candidates, key=lambda n: (largest(n), n))


def _ints(values) -> str:
    return ", ".join(str(int(v)) for v in values)


def emit_conv(call: ConvCall, cta_tile: tuple[int, int, int] | None = None, chunks: int | None = None) -> str:
    """The C++ source of `call`'s kernel and its entry ``__tvm_ffi_<symbol>``; the same call gives
    the same text (the build cache's key).  `cta_tile` and `chunks` replace ``tile(call)`` and
    ``splits(call)`` (a benchmark's variants: ``codegen.bench_conv``)."""
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", call.symbol):
        raise Unsupported(f"{call.symbol!r} is not a C identifier")
    reason = supported(call)
    if reason is not None:
        raise Unsupported(f"{call.symbol}: {reason}")
    if chunks is not None and not (1 <= chunks <= min(MAX_SPLITS, call.x[0]) and (chunks == 1 or call.kind == "wgrad")):
        raise Unsupported(f"{call.symbol}: {chunks} batch chunks (weight gradients only, 1 to "
                          f"{min(MAX_SPLITS, call.x[0])})")
    code, bits = DL_CODE[call.dtype]
    names = call.inputs + call.outputs
    bind = "\n".join(f"  DLTensor* {name} = tensors[{i}];" for i, name in enumerate(names))
    checks = "\n".join(
        f"  if (tvm_evt::check_tensor({name}, kKernel, \"{name}\", {{{_ints(call.shape(name))}}}, {code}, {bits}, "
        f"device_id)) return -1;"
        for name in names
    )
    tm, tn, tk = cta_tile or tile(call)
    split = chunks or splits(call)
    # wgrad's N mode is (C, S, R): the tile spans channels of one filter tap (CUTLASS's wgrad tiles)
    n_mode = f"Shape<_{tn}>" if call.kind == "wgrad" else f"_{tn}"
    m, n, k = call.gemm
    pt, pl, pb, pr = call.pad
    values = dict(
        namespace=f"tvm_evt_{call.symbol}", symbol=call.symbol, element=ELEMENT[call.dtype],
        element_d="float" if split > 1 else "Element",
        operator=OPERATOR[call.kind], tile_shape=f"Shape<_{tm}, {n_mode}, Shape<_{tk}>>",
        layout_output="cutlass::layout::TensorKCSR" if call.kind == "wgrad" else "cutlass::layout::TensorNHWC",
        # wgrad stores its small filter gradient straight from registers, as CUTLASS's wgrad tests do
        epilogue_schedule="cutlass::epilogue::NoSmemWarpSpecialized" if call.kind == "wgrad"
        else "cutlass::epilogue::TmaWarpSpecialized",
    )
    prelude = PRELUDE + (SPLIT_PRELUDE if split > 1 else "")
    header = HEADER.substitute(
        kernel_type=type_line(prelude + KERNEL_TYPES.substitute(values, namespace="kernel")),
        version=CODEGEN_VERSION, symbol=call.symbol, kind=call.kind, x=_ints(call.x), w=_ints(call.w),
        y=_ints(call.y), pad=_ints(call.pad), stride=_ints(call.stride), dilation=_ints(call.dilation),
        dtype=call.dtype, m=m, n=n, k=k, tile=f"{tm}x{tn}x{tk}" + (f", split {split}" if split > 1 else ""),
    )
    a, b, d = OPERANDS[call.kind]
    (n_img, h, wd, c), (kk, r, ss, _), (_, p, q, _) = call.x, call.w, call.y
    launch = (SPLIT_LAUNCH if split > 1 else SINGLE_LAUNCH).substitute(
        batch=n_img, chunk=n_img // split, big=n_img % split, splits=split, out_elems=kk * r * ss * c,
        image_dy=p * q * kk, image_x=h * wd * c, xformed=XFORMED[call.kind],
        y=_ints(call.y), y0=call.y[0], y1=call.y[1], y2=call.y[2], y3=call.y[3],
        operand_a=a, operand_b=b, operand_d=d,
    )
    kernel = KERNEL.substitute(
        values,
        num_args=len(names), bind=bind, first_tensor=names[0], checks=checks,
        x=_ints(call.x), x_hwc=_ints(call.x[1:]), w=_ints(call.w), pad=_ints(call.pad),
        pad_lower=_ints((pt, pl)), pad_upper=_ints((pb, pr)), stride=_ints(call.stride),
        dilation=_ints(call.dilation),
        stride_d=STRIDE_FILTER if call.kind == "wgrad" else STRIDE_ACTIVATION, launch=launch,
    )
    return header + prelude + kernel

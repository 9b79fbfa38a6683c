"""Two column sums of a tensor in one pass over it: ``tvm_evt`` column moments.

A training batch norm over the leading axes of a channel-last ``[..., C]`` tensor takes two sums
per channel in each direction (`batch_norm_op`), and a layer norm's parameter gradients are two
more over the rows of its output gradient::

    batch norm, forward   Σ x,  Σ x·x                     (mean and the one-pass variance)
    batch norm, backward  Σ g,  Σ g·(x - mean)            (dβ and, times rstd, dγ; mean per channel)
    layer norm, backward  Σ g,  Σ g·((x - mean)·rstd)     (dβ and dγ; mean and rstd per row)

These are the three ``KINDS``: ``moments``, ``centered`` and ``normalized``.

As separate reductions they read ``x`` (``g``) twice: at ResNet-50 conv3_x's 100352 x 512 that is
103 MB a read, and the column sums were 2.2 ms of its 9.8 ms step; a layer norm of GPT-2 medium
reads its float32 ``g`` twice, 64 MB a read.  ``emit_moments`` emits both sums as one ``call_tir``
of ``column_sums`` (``sums_args``: the kind's leaves and terms), whose portable form any target
builds and whose GPU form ``ScheduleTIRForGPU`` swaps in; the function also carries the kind
(``MOMENTS_ATTR``).  The call's third and fourth outputs are the row blocks' partial sums.
ResNet-50's largest (206 MB, the backward pair) streams at 2.8 TB/s on H100.
"""
from __future__ import annotations

import json
import math

from tvm import relax, tirx

from . import column_sums
from .column_sums import LANES, TARGET_BLOCKS, TX, TY, UNROLL, grid, keep_shape  # noqa: F401 (this module's API)

MOMENTS_ATTR = "tvm_evt.column_moments"  # {"shape": [...], "dtypes": [...], "kind": KINDS, "out": [...]}
# the second sum's term, by kind: g·g, g·(x - mean[channel]), g·((x - mean[row])·rstd[row])
KINDS = ("moments", "centered", "normalized")
F32 = "float32"


def supported(shape, axes) -> bool:
    """Can the moments of a tensor of `shape` over `axes` take this form: a static channel-last
    reduction over every axis but the last, the channels a multiple of ``LANES``?"""
    return column_sums.supported(shape) and sorted(axes) == list(range(len(shape) - 1))


def row_shape(shape) -> list[int]:
    """A per-row statistic's shape (a ``normalized`` kind's mean and rstd): `shape` with the last axis 1."""
    return list(shape[:-1]) + [1]


def _stats(shape, kind):
    """(name, shape) of the float32 statistics a kind reads after its two tensors."""
    return {"moments": [], "centered": [("mean", keep_shape(shape))],
            "normalized": [("mean", row_shape(shape)), ("rstd", row_shape(shape))]}[kind]


def _check(shape, kind, out) -> list[int]:
    if kind not in KINDS:
        raise ValueError(f"column moments: unknown kind {kind!r}; known: {', '.join(KINDS)}")
    out = keep_shape(shape) if out is None else [int(d) for d in out]
    if math.prod(out) != shape[-1]:
        raise ValueError(f"column moments: sums of shapes {out} for {shape[-1]} channels")
    return out


def sums_args(shape, dtypes, kind: str, out=None) -> tuple[list, list, list, list]:
    """The column sums (``column_sums``) a kind is: (shape, leaves, terms, output shapes).  The leaves are
    ``a`` (, ``b`` and the kind's statistics); the terms ``Σ a`` and the kind's second sum."""
    shape = [int(d) for d in shape]
    out = _check(shape, kind, out)
    a = ["astype", ["in", 0], F32]
    leaves = [(shape, dtypes[0])]
    if kind != "moments":
        leaves += [(shape, dtypes[1])] + [(st, F32) for _, st in _stats(shape, kind)]
    match kind:
        case "centered":
            second = ["multiply", a, ["subtract", ["astype", ["in", 1], F32], ["in", 2]]]
        case "normalized":
            second = ["multiply", a, ["multiply", ["subtract", ["astype", ["in", 1], F32], ["in", 2]], ["in", 3]]]
        case _:
            second = ["multiply", a, a]
    return shape, leaves, [a, second], [out, out]


def moments_primfunc(shape, dtypes, kind: str, out=None) -> tirx.PrimFunc:
    """Portable form: ``(a[, b, stats]) -> (s0, s1, p0, p1)`` with ``s0 = Σ a`` and ``s1`` the sum
    of the kind's term (``KINDS``) over every axis but the last, in float32, shaped `out` (default
    ``keep_shape``), and the partial sums ``p0``/``p1`` ``[row blocks, C]`` they are the sums of:
    ``column_sums.sums_primfunc`` of ``sums_args``, its GPU form ``column_sums``'."""
    shape, leaves, terms, outs = sums_args(shape, dtypes, kind, out)
    func = column_sums.sums_primfunc(shape, leaves, terms, outs)
    return func.with_attr(MOMENTS_ATTR, json.dumps({"shape": shape, "dtypes": list(dtypes), "kind": kind,
                                                    "out": outs[0]}))


def moments_gpu_primfunc(shape, dtypes, kind: str, out=None) -> tirx.PrimFunc:
    """``moments_primfunc``'s arguments, scheduled for CUDA (``column_sums.sums_gpu_primfunc``)."""
    return column_sums.sums_gpu_primfunc(*sums_args(shape, dtypes, kind, out))


def emit_moments(bb: relax.BlockBuilder, a: relax.Expr, b: relax.Expr | None = None, *stats: relax.Expr,
                 out=None) -> tuple[relax.Var, relax.Var]:
    """Emit ``(Σ a, Σ a·a)``; given `b` and a per-channel mean, ``(Σ a, Σ a·(b - mean))``; given
    `b` and per-row mean and rstd, ``(Σ a, Σ a·((b - mean)·rstd))``: sums over every axis but the
    last, as float32 values of one ``call_tir`` shaped `out` (default ``keep_shape``; check
    `supported` first).  `a` and `b` are read in their own dtypes."""
    shape = [int(d) for d in a.ty.shape.values]
    if b is None:
        kind = "moments"
    elif len(stats) in (1, 2):
        kind = "centered" if len(stats) == 1 else "normalized"
    else:
        raise ValueError(f"column moments: a second tensor needs a mean per channel, or a mean and an rstd per "
                         f"row; got {len(stats)} statistics")
    dtypes = [str(a.ty.dtype), str(b.ty.dtype) if b is not None else str(a.ty.dtype)]
    name = "column_moments" if kind == "moments" else f"column_moments_{kind}"
    func = moments_primfunc(shape, dtypes, kind, out)
    return tuple(column_sums.emit_sums(bb, [a] if b is None else [a, b, *stats], func, name))

"""A channels-last depthwise 2-D convolution and its two gradients as Relax ops, each a direct kernel.

Registered (once) when this module is imported::

    y  = tvm_evt.depthwise_conv2d(x, w, geometry)                  x [N, H, W, C], w [K, R, S, 1] -> [N, P, Q, K]
    dx = tvm_evt.depthwise_conv2d_dgrad(dy, w, geometry, x_shape)  dy [N, P, Q, K]                -> [N, H, W, C]
    dw = tvm_evt.depthwise_conv2d_wgrad(x, dy, geometry, w_shape)                                 -> [K, R, S, 1]

``K = C·m``: output channel ``k`` reads input channel ``k // m`` (a ``groups == C`` convolution with
channel multiplier ``m``; MobileNet's and EfficientNet's have ``m = 1``).  ``geometry`` is
``conv_op.Geometry``'s shape expression; ``w`` is the OHWI weight ``relax.transform.ConvertLayout``
gives a depthwise ``conv2d``.  Tensors share one float dtype, which is also the result's; products
accumulate in float32 and round once.

Why ops: a depthwise convolution is no GEMM (one input channel a filter: R·S multiply-adds an
output), and left to TVM's ``conv2d``, its gradient rule makes a ``conv2d_transpose`` (dx) and a
grouped ``conv2d`` over the batch (dw), which DLight's fallback runs with one thread an output
and the whole N·P·Q reduction in its serial loop: torchvision's MobileNetV2, batch 128, took
1391 ms a step on H200 (one weight gradient 524 ms; eager 20.7 ms).

The kernels read channels-last; consecutive threads take consecutive channel pairs (one 4-byte bf16
load), so every load of a warp is one contiguous row of channels:

* ``fprop`` and a stride-1 ``dgrad`` (the cross-correlation of zero-padded dy with the flipped
  filter): a thread sums a strip of up to ``STRIP`` output pixels of a row in float32 registers.
  The window of the padded input the strip reads (R rows of strip + (S-1)·dilation pixels: the
  ``pad`` stage, whose loads are the only guarded ones) and the filter's taps are loaded into
  registers once: for a 3x3, 30 loads for 8 pixels where each pixel's 9 taps were 9 loads, for
  EfficientNet's 5x5 55 for 7 pixels. A window of more than ``WINDOW`` values a channel (the 5x5,
  a stride-2 3x3's 3 rows of 15) is held a filter row at a time, the row loop outside the strip's
  pixels: the same loads, 48 registers a thread where the whole window took 95-162 (ptxas, sm_90a),
  and faster than cuDNN where the whole window had been slower (H200, ms whole / by rows / cuDNN:
  112²x96 3x3/2 0.148 / 0.107 / 0.140, 56²x144 5x5/2 0.159 / 0.082 / 0.110, 28²x240 5x5 0.127 /
  0.098 / 0.102, its stride-1 dgrad 0.128 / 0.098; ``docs/bench/h200-2026-12-02/``).
* a strided ``dgrad`` (dilation 1) visits only the taps whose output position the stride reaches
  (for a 3x3/2, 4 of 9 a pixel at most): input row a sees taps (a + pad) % stride + t·stride. Where
  a strip of whole stride periods divides the width it runs in strips too, its window of dy (padded
  by the taps' reach) and the filter (padded to whole periods) in registers: MobileNetV2's
  112²x96 layer, 12 loads for 8 pixels. Else a thread a pixel.
* ``wgrad``: the N·P·Q reduction in two stages: float32 partial sums of groups of output lines (N·P
  rows of Q pixels; ``wgrad_grid``: groups that divide the lines, enough to fill the GPU), written
  ``[K, R, S, G]``; then a sum over the groups (a plain ``relax.sum`` over the last axis: a row
  reduction, a block a filter tap), rounded and shaped ``[K, R, S, 1]``.  A first-stage thread
  takes two channels (one 4-byte bf16 load) and walks its lines a strip of up to ``STRIP`` output
  pixels at a time: the strip's dy and the input window it reads (R rows of (strip-1)·stride + S
  pixels, the padding as zeros: the ``pad`` stage) go to registers once, where reading x for each
  of a pixel's R·S taps took 9 loads a pixel for a 3x3 (MobileNetV2 at batch 128 on H200: the
  weight gradients 3.2 ms a step against cuDNN's 0.87). The window stays whole however large:
  loaded a filter row at a time (96-128 -> 80-96 registers for the 5x5, its R·S·lanes sums
  staying) the weight gradients got slower on H200 (ms whole / by rows: 28²x240 5x5 0.158 /
  0.218, 56²x144 3x3/2 0.080 / 0.092, 112²x96 3x3/2 0.166 / 0.180; ``docs/bench/h200-2026-12-02/``).

Each kernel's portable form is a TE compute, which any target builds (the CPU reference path);
the PrimFunc is tagged ``DEPTHWISE_ATTR`` with its spec, opaque to ``FuseOps``, and on CUDA
``ScheduleTIRForGPU`` swaps in the scheduled form (``gpu_variant``).
"""

from __future__ import annotations

import json

from tvm import relax, s_tir, te, tirx
from tvm.relax import op as R
from tvm.relax.op.grad import no_grad

from .._rewrite import MASK_COMPARISONS, MASK_CONNECTIVES, OPAQUE, emit_call_tir
from ..training.gradient_rules import register_op
from .conv_op import Geometry, family_call, operand_shapes, result_type

FPROP, DGRAD, WGRAD = ("tvm_evt.depthwise_conv2d", "tvm_evt.depthwise_conv2d_dgrad",
                       "tvm_evt.depthwise_conv2d_wgrad")
OPS = {FPROP: "fprop", DGRAD: "dgrad", WGRAD: "wgrad"}
DEPTHWISE_ATTR = "tvm_evt.depthwise"  # {"op", "x", "w", "geometry", "dtype"[, "groups", "lines", "select"]}
F32 = "float32"
THREADS = 256  # threads a block of the fprop / dgrad kernels
TX, TY = 32, 4  # wgrad's first stage: channels and row groups a block
TARGET_THREADS = 132 * 1024  # wgrad's first stage: threads in all (half an H100's resident threads)
MIN_PIXELS = 32  # output pixels a wgrad line group walks at least
WGRAD_LANES = 2  # channels a wgrad thread (a bf16 pair: one 4-byte load)
STRIP = 8  # pixels of a row a thread of any of the kernels sums at once, their input window in registers
WINDOW = 32  # values a channel of an fprop / dgrad strip's input window in registers at once (more: a filter row at a time)
# wgrad's partial sums laid out [G, R, S, K] (a warp's stores of one tap contiguous across its
# channels) where R·S·K is at least this; else [K, R, S, G] (a thread's R·S·lanes sums at a stride
# of R·S·G floats each: 50 scattered 4-byte stores a thread for a 5x5).  The second stage is then
# a column sum over G instead of a row sum, slow where its R·S·K columns are too few to spread the
# G rows over enough thread blocks.  H200, bf16, batch 128, both stages (us, [K, R, S, G] -> [G, R,
# S, K]; ``docs/bench/h200-2026-12-02b/``): R·S·K 288 (112²x32 3x3) 169 -> 216, 864 (112²x96 3x3/2)
# 175 -> 190, 1296 (56²x144 3x3) 200 -> 214, 1728 (28²x192 3x3) 70.5 -> 69.0, 2160 (28²x240 3x3/2,
# the whole op against cuDNN's, two runs) 52 -> 56-58; 3456 and up faster: 3456 (14²x384 3x3, as
# that) 47 -> 34-43, 3600 (56²x144 5x5/2) 160 -> 139, 5184 (14²x576 3x3) 64 -> 36.5, 6000 (28²x240
# 5x5) 158 -> 116, 8640 (7²x960 3x3) 35 -> 21, 12000 (14²x480 5x5) 126 -> 63, 16800 (14²x672 5x5)
# 126 -> 71, 28800 (7²x1152 5x5) 90 -> 32.  None: never.
COLUMN_PARTIALS: int | None = 3072


# ------------------------------------------------------------------------------ shapes


def depthwise_shapes(call: relax.Call) -> tuple[tuple, tuple, tuple, Geometry]:
    """(x [N, H, W, C], w [K, R, S, 1], y [N, P, Q, K], geometry) of any of the three ops, checked."""
    return operand_shapes(call, OPS[call.op.name], lambda x, w: w[3] == 1 and w[0] % x[3] == 0, "[C·m, R, S, 1]")


def _infer(call: relax.Call, _bb) -> relax.TensorType:
    return result_type(call, OPS[call.op.name], depthwise_shapes(call))


def depthwise_conv2d(x, w, geometry: Geometry) -> relax.Call:
    return family_call(FPROP, x, w, geometry)


def depthwise_conv2d_dgrad(dy, w, geometry: Geometry, x_shape) -> relax.Call:
    return family_call(DGRAD, dy, w, geometry, x_shape)


def depthwise_conv2d_wgrad(x, dy, geometry: Geometry, w_shape) -> relax.Call:
    return family_call(WGRAD, x, dy, geometry, w_shape)


def wgrad_grid(lines: int, width: int, channels: int) -> tuple[int, int]:
    """(line groups G, output lines a group) of the weight gradient's first stage over `lines` =
    N·P output rows of `width` = Q pixels each: a group's lines divide `lines` (no partial group),
    at least ``MIN_PIXELS`` pixels a group where there are that many, and about ``TARGET_THREADS``
    threads of ``WGRAD_LANES`` channels each where the lines allow."""
    threads = -(-channels // (TX * WGRAD_LANES)) * TX
    least = max(-(-MIN_PIXELS // width), -(-lines * threads // TARGET_THREADS), 1)
    per = min(d for d in range(min(least, lines), lines + 1) if lines % d == 0)
    return lines // per, per


def strip_width(width: int, multiple: int = 1) -> int:
    """Pixels of one row a thread takes at once (their input window in registers): the largest
    divisor of `width` up to ``STRIP`` that is a multiple of `multiple` (a strided dgrad's strips
    hold whole stride periods), or 1."""
    return max([d for d in range(multiple, min(width, STRIP) + 1, multiple) if width % d == 0], default=1)


# ----------------------------------------------------------------------------- TE kernels


def _i64(v: int) -> tirx.IntImm:
    return tirx.IntImm("int64", int(v))


def _shape64(shape) -> tuple:
    return tuple(_i64(d) for d in shape)


def _spec(op: str, x, w, g: Geometry, dtype: str) -> dict:
    spec = {"op": op, "x": [int(d) for d in x], "w": [int(d) for d in w], "dtype": dtype,
            "geometry": [*g.pad, *g.stride, *g.dilation]}
    (n, h, wd, _), (k, r, s, _) = x, w
    p, q = g.out((h, wd), (r, s))
    if op == "wgrad":
        spec["groups"], spec["lines"] = wgrad_grid(n * p, q, k)
        spec["strip"] = strip_width(q)
        if COLUMN_PARTIALS is not None and r * s * k >= COLUMN_PARTIALS:
            spec["columns"] = True  # partial sums [G, R, S, K]
    elif op == "fprop":
        spec["strip"] = strip_width(q)
    elif _flipped_pads(g, r, s) is not None:  # a stride-1 dgrad: the convolution of padded dy
        spec["strip"] = strip_width(wd)
    elif g.dilation == (1, 1) and (periods := strip_width(wd, g.stride[1])) > 1:  # a strided one, in phases
        spec["phase_strip"] = periods
    return spec


def _flipped_pads(g: Geometry, r: int, s: int) -> tuple[int, int] | None:
    """(top, left) zero padding of dy that makes a stride-1 dgrad the cross-correlation of padded dy
    with the flipped filter; None for strides > 1 or a padding wider than the filter reaches."""
    (pt, pl, _, _), (dh, dw) = g.pad, g.dilation
    top, left = (r - 1) * dh - pt, (s - 1) * dw - pl
    return (top, left) if g.stride == (1, 1) and top >= 0 and left >= 0 else None


def _padded(t: te.Tensor, top: int, left: int, rows: int, cols: int, name: str) -> te.Tensor:
    """`t` [N, H, W, C] placed at (top, left) in zeros of [N, rows, cols, C]: a stage of its own,
    which the CUDA forms compute a strip's window of into registers (the only guarded loads)."""
    n, h, wd, c = (int(d) for d in t.shape)
    zero = tirx.const(0, t.dtype)
    return te.compute(_shape64((n, rows, cols, c)), lambda b, y, xx, ch: tirx.if_then_else(
        tirx.all(y >= top, y < h + top, xx >= left, xx < wd + left), t[b, y - top, xx - left, ch], zero), name=name)


def mask_value(tree, v, dtype: str):
    """The condition a select ``tree`` makes of one element ``v`` (of `dtype`) of its tensor:
    ``[comparison, constant]`` (``MASK_COMPARISONS``: ``v > constant``, ...) or ``[connective, tree,
    tree]`` (``MASK_CONNECTIVES``)."""
    if tree[0] in MASK_CONNECTIVES:
        return MASK_CONNECTIVES[tree[0]](*(mask_value(t, v, dtype) for t in tree[1:]))
    return MASK_COMPARISONS[tree[0]](v, tirx.const(tree[1], dtype))


def _tensors(spec: dict) -> list[te.Tensor]:
    """The TE placeholders and computes of `spec`'s kernel: inputs, then outputs (module docstring)."""
    (n, h, wd, c), (k, r, s, _) = spec["x"], spec["w"]
    g = Geometry(tuple(spec["geometry"][:4]), tuple(spec["geometry"][4:6]), tuple(spec["geometry"][6:]))
    (pt, pl, pb, pr), (sh, sw), (dh, dw) = g.pad, g.stride, g.dilation
    p, q = g.out((h, wd), (r, s))
    m, dtype = k // c, spec["dtype"]
    zero = tirx.const(0, dtype)
    f32 = lambda v: v.astype(F32) if dtype != F32 else v  # noqa: E731
    x = te.placeholder(_shape64((n, h, wd, c)), dtype, name="x")
    w = te.placeholder(_shape64((k, r, s, 1)), dtype, name="w")
    dy = te.placeholder(_shape64((n, p, q, k)), dtype, name="dy")

    select = spec.get("select")  # a dgrad's result kept where a mask of a tensor of its shape holds, else 0
    sel = te.placeholder(_shape64((n, h, wd, c)), select["dtype"], name="sel") if select else None

    def rounded(acc: te.Tensor) -> te.Tensor:
        if select:
            return te.compute(acc.shape, lambda *i: tirx.Select(
                mask_value(select["mask"], sel(*i), select["dtype"]), acc(*i).astype(dtype), zero), name="out")
        return te.compute(acc.shape, lambda *i: acc(*i).astype(dtype), name="out")

    def padded_x() -> te.Tensor:
        """x with its zero padding, as a stage of its own: the CUDA forms compute the window a strip
        of output pixels reads into registers once (its loads are the only guarded ones)."""
        return _padded(x, pt, pl, h + pt + pb, wd + pl + pr, "pad")

    if spec["op"] == "fprop":
        rr, ss = te.reduce_axis((0, _i64(r)), "r"), te.reduce_axis((0, _i64(s)), "s")
        xpad = padded_x()
        acc = te.compute(_shape64((n, p, q, k)), lambda b, i, j, o: te.sum(
            f32(xpad[b, i * sh + rr * dh, j * sw + ss * dw, o // m if m > 1 else o]) * f32(w[o, rr, ss, 0]),
            axis=[rr, ss]), name="acc")
        return [x, w, rounded(acc)]

    if spec["op"] == "dgrad":  # input channel ch sums its m output channels ch·m + j, and the taps
        jj = [te.reduce_axis((0, _i64(m)), "j")] if m > 1 else []
        channel = lambda ch: ch * m + jj[0] if m > 1 else ch  # noqa: E731
        if "strip" in spec:  # stride 1: padded dy against the flipped filter
            top, left = _flipped_pads(g, r, s)
            dypad = _padded(dy, top, left, h + (r - 1) * dh, wd + (s - 1) * dw, "pad")
            rr, ss = te.reduce_axis((0, _i64(r)), "r"), te.reduce_axis((0, _i64(s)), "s")

            def value(b, a, cc, ch):
                o = channel(ch)
                return te.sum(f32(dypad[b, a + rr * dh, cc + ss * dw, o]) * f32(w[o, r - 1 - rr, s - 1 - ss, 0]),
                              axis=[*jj, rr, ss])

        elif "phase_strip" in spec:  # strided, dilation 1: in stride phases
            # input row a sees the taps (a + pt) % sh + t·sh of dy row (a + pt) // sh - t; dy padded
            # by the taps' reach (top, left) so every such row is inside, the filter by zero taps up
            # to whole stride periods (both stages computed into registers at the thread on CUDA)
            taps_r, taps_s = -(-r // sh), -(-s // sw)
            top, left = taps_r - 1, taps_s - 1
            dypad = _padded(dy, top, left, (h - 1 + pt) // sh + top + 1, (wd - 1 + pl) // sw + left + 1, "pad")
            wpad = te.compute(_shape64((k, taps_r * sh, taps_s * sw)), lambda o, ri, si: tirx.if_then_else(
                tirx.all(ri < r, si < s), w[o, ri, si, 0], zero), name="wpad")
            rr, ss = te.reduce_axis((0, _i64(taps_r)), "r"), te.reduce_axis((0, _i64(taps_s)), "s")

            def value(b, a, cc, ch):
                o = channel(ch)
                y, xx = (a + pt) // sh - rr + top, (cc + pl) // sw - ss + left
                tap = wpad[o, (a + pt) % sh + rr * sh, (cc + pl) % sw + ss * sw]
                return te.sum(f32(dypad[b, y, xx, o]) * f32(tap), axis=[*jj, rr, ss])

        else:
            # input row a is reached by the taps r with a + pad - r·dilation a multiple of the
            # stride: with dilation 1, r = (a + pad) mod stride + t·stride (2 of 3 taps a 3x3/2 row),
            # else every tap, tested
            phased = (sh > 1 and dh == 1, sw > 1 and dw == 1)
            rr = te.reduce_axis((0, _i64(-(-r // sh) if phased[0] else r)), "r")
            ss = te.reduce_axis((0, _i64(-(-s // sw) if phased[1] else s)), "s")

            def axis(a, t, pad, stride, dil, taps, out, phase):
                """(the tap, the output index it reads, the conditions) for input index `a`, tap `t`."""
                if phase:
                    tap = (a + pad) % stride + t * stride
                    return tap, (a + pad - tap) // stride, [tap < taps, a + pad - tap >= 0,
                                                             (a + pad - tap) // stride < out]
                pos = a + pad - t * dil
                conds = [pos >= 0, pos < out * stride] + ([pos % stride == 0] if stride > 1 else [])
                return t, pos // stride if stride > 1 else pos, conds

            def value(b, i, j, ch):
                ri, yi, ci = axis(i, rr, pt, sh, dh, r, p, phased[0])
                si, xi, cj = axis(j, ss, pl, sw, dw, s, q, phased[1])
                o = channel(ch)
                v = tirx.if_then_else(tirx.all(*ci, *cj), dy[b, yi, xi, o], zero)
                wv = tirx.if_then_else(tirx.all(ri < r, si < s), w[o, ri, si, 0], zero)
                return te.sum(f32(v) * f32(wv), axis=[*jj, rr, ss])

        out = rounded(te.compute(_shape64((n, h, wd, c)), value, name="acc"))
        return [dy, w, sel, out] if select else [dy, w, out]

    groups, lines, strip = spec["groups"], spec["lines"], spec["strip"]
    xpad = padded_x()
    u, jo = te.reduce_axis((0, _i64(lines)), "u"), te.reduce_axis((0, _i64(q // strip)), "jo")
    ji = te.reduce_axis((0, _i64(strip)), "ji")

    def part(o, ri, si, gi):
        line = gi * lines + u  # output row i of image b (groups · lines = N·P: no partial group)
        b, i, j = line // p, line % p, jo * strip + ji
        prod = f32(xpad[b, i * sh + ri * dh, j * sw + si * dw, o // m if m > 1 else o]) * f32(dy[b, i, j, o])
        return te.sum(prod, axis=[u, jo, ji])

    if spec.get("columns"):
        return [x, dy, te.compute(_shape64((groups, r, s, k)), lambda gi, ri, si, o: part(o, ri, si, gi),
                                  name="partial")]
    return [x, dy, te.compute(_shape64((k, r, s, groups)), part, name="partial")]


def primfunc(spec: dict) -> tirx.PrimFunc:
    """The portable (unscheduled) kernel of `spec`, tagged with it."""
    func = te.create_prim_func(_tensors(spec)).without_attr("global_symbol")
    return func.with_attr("op_pattern", OPAQUE).with_attr(DEPTHWISE_ATTR, json.dumps(spec))


# --------------------------------------------------------------------------- GPU schedules


def _vector_lanes(spec: dict) -> int:
    """Channels a thread of fprop / dgrad: two bf16/fp16 (a 4-byte load) where they pair up."""
    channels = spec["w"][0] if spec["op"] == "fprop" else spec["x"][3]
    return 2 if spec["dtype"] != F32 and channels % 2 == 0 else 1


def _row_grid(sch: s_tir.Schedule, out, lanes: int, strip: int) -> tuple:
    """Bind `out` [N, rows, columns, channels]: ``blockIdx.x`` an (image, row), ``blockIdx.y ·
    THREADS + threadIdx.x`` a (strip of `strip` columns, group of `lanes` channels) of it; returns
    the thread's loop and the strip's and the lanes' loops under it.

    Rows and columns come from different indices on purpose: with all four axes fused
    into one thread index, TVM 0.27's ``IterMapSimplify`` (in ``FlattenBuffer``) rewrote the sum of
    a strided dgrad's two tap phases, ``((t % A // B + 1) % 2) * 3 + (t % B // C + 1) % 2``, with the
    row's offset in both terms: the 14x14x576 stride-2 dgrad read the wrong taps (tested on the CPU
    with the threads as serial loops, ``test_cuda_forms_compute_what_torch_does``)."""
    b, i, j, ch = sch.get_loops(out)
    jo, ji = sch.split(j, [None, strip])
    co, lane = sch.split(ch, [None, lanes])
    sch.reorder(b, i, jo, co, ji, lane)
    by, tx = sch.split(sch.fuse(jo, co), [None, THREADS])
    sch.bind(sch.fuse(b, i), "blockIdx.x")
    sch.bind(by, "blockIdx.y")
    sch.bind(tx, "threadIdx.x")
    return tx, ji, lane


def _schedule_direct(sch: s_tir.Schedule, lanes: int) -> None:
    """A strided dgrad: a thread per input pixel and `lanes` channels, its taps summed in registers."""
    out, acc = sch.get_sblock("out"), sch.get_sblock("acc")
    tx, _, vec = _row_grid(sch, out, lanes, 1)
    sch.compute_at(acc, tx)
    sch.set_scope(acc, 0, "local")
    reductions = sum(1 for v in sch.get(acc).iter_vars if v.iter_type == tirx.IterVar.CommReduce)
    loops = sch.get_loops(acc)  # under the thread: the channel lane (where lanes > 1), then the taps
    reduce = loops[-reductions:]
    if lanes > 1:
        lane = loops[-reductions - 1]
        sch.reorder(*reduce, lane)  # (the init stays in the block: LowerInitBlock's test on the taps
        sch.unroll(lane)            # folds away once they are unrolled)
        sch.vectorize(vec)
    for loop in reduce:
        sch.unroll(loop)


def _schedule_strips(sch: s_tir.Schedule, lanes: int, strip: int, phases: bool = False,
                     by_rows: bool = False) -> None:
    """fprop / dgrad: a thread per `strip` output pixels of a row and `lanes` channels; the window of
    the padded input they read (``pad``: R rows of strip + (S-1)·dilation pixels; a strided
    dgrad's, `phases`, R / stride rows of strip / stride + S / stride) and the filter's taps in
    registers, loaded once, and strip·lanes float32 sums (the grid: ``_row_grid``). `by_rows`:
    the window and the taps one filter row at a time, the row loop outside the strip's pixels
    (each row of the window is read by one filter row only, so nothing is loaded twice)."""
    out, acc, pad = sch.get_sblock("out"), sch.get_sblock("acc"), sch.get_sblock("pad")
    tx, ji, lane = _row_grid(sch, out, lanes, strip)
    sch.compute_at(acc, tx)
    sch.set_scope(acc, 0, "local")
    at, outer = tx, 3
    if by_rows:  # under the thread: the strip's pixels, the lanes[, the channel multiplier], r, s
        *pixels, row, _ = sch.get_loops(acc)[3:]
        sch.reorder(row, *pixels)
        at, outer = row, 4
    sch.compute_at(pad, at)
    sch.set_scope(pad, 0, "local")
    _unroll_window(sch, pad, outer, lanes)
    if phases:  # the filter padded to whole stride periods: a stage of its own
        weights = sch.get_sblock("wpad")
        sch.compute_at(weights, at)
        sch.set_scope(weights, 0, "local")
    else:  # the lanes' R·S taps (or a row's S), read once a strip
        weights = sch.cache_read(acc, 1, "local")
        sch.compute_at(weights, at)
    for loop in sch.get_loops(weights)[outer:]:
        sch.unroll(loop)
    for loop in sch.get_loops(acc)[3:]:
        sch.unroll(loop)
    sch.unroll(ji)
    if lanes > 1:
        sch.vectorize(lane)


def _unroll_window(sch: s_tir.Schedule, block, outer: int, lanes: int) -> None:
    """Unroll a register window's loops (those under its `outer` ones), the channels' as a vector."""
    *window, channels = sch.get_loops(block)[outer:]
    for loop in window:
        sch.unroll(loop)
    if lanes > 1 and int(sch.get(channels).extent) == lanes:
        sch.vectorize(channels)
    else:
        sch.unroll(channels)


def _schedule_wgrad(sch: s_tir.Schedule, lanes: int, columns: bool = False) -> None:
    """wgrad's first stage: a block (line groups of TY, channel groups of TX), a thread `lanes`
    channels of a group's lines, walked a strip of output pixels at a time: the strip's input
    window (``pad``) and its dy in registers, R·S·lanes float32 sums.  `columns`: the sums laid
    out [G, R, S, K], a thread's `lanes` of a tap stored as one vector."""
    part, xpad = sch.get_sblock("partial"), sch.get_sblock("pad")
    if columns:
        gi, ri, si, o, u, jo, ji = sch.get_loops(part)
    else:
        o, ri, si, gi, u, jo, ji = sch.get_loops(part)
    o, lane = sch.split(o, [None, lanes])
    bo, tx = sch.split(o, [None, TX])
    bg, ty = sch.split(gi, [None, TY])
    sch.reorder(bg, bo, ty, tx, u, jo, ji, ri, si, lane)
    sch.bind(sch.fuse(bg, bo), "blockIdx.x")
    sch.bind(ty, "threadIdx.y")
    sch.bind(tx, "threadIdx.x")
    sums = sch.cache_write(part, 0, "local")
    sch.reverse_compute_at(sums, tx)
    if columns and lanes > 1:
        sch.vectorize(sch.get_loops(sums)[-1])  # the thread's lanes of one tap, adjacent
    dy = sch.cache_read(part, 1, "local")
    sch.compute_at(dy, jo)
    sch.compute_at(xpad, jo)
    sch.set_scope(xpad, 0, "local")
    sch.decompose_reduction(part, u)
    _unroll_window(sch, dy, 5, lanes)  # under (block, ty, tx, u, jo)
    _unroll_window(sch, xpad, 5, lanes)
    for loop in (ji, ri, si, lane):
        sch.unroll(loop)


def _window_values(spec: dict) -> int:
    """Values a channel of the input window a strip of output pixels reads (R rows of the strip's
    reach) in fprop, wgrad or a stride-1 dgrad; 0 for a strided dgrad's phases."""
    if "strip" not in spec:
        return 0
    (r, s), strip = spec["w"][1:3], spec["strip"]
    sw, dw = spec["geometry"][5], spec["geometry"][7]
    reach = (strip - 1) * (1 if spec["op"] == "dgrad" else sw) + (s - 1) * dw + 1
    return r * reach


def gpu_primfunc(spec: dict, lanes: int | None = None) -> tirx.PrimFunc:
    """`spec`'s kernel scheduled for CUDA (the module docstring); `lanes`: channels a thread of
    fprop / dgrad, by default ``_vector_lanes``."""
    sch = s_tir.Schedule(te.create_prim_func(_tensors(spec)))
    if spec["op"] == "wgrad":
        _schedule_wgrad(sch, lanes or (WGRAD_LANES if spec["w"][0] % WGRAD_LANES == 0 else 1), spec.get("columns", False))
    elif "strip" in spec or "phase_strip" in spec:
        _schedule_strips(sch, lanes or _vector_lanes(spec), spec.get("strip") or spec["phase_strip"],
                         phases="phase_strip" in spec, by_rows=_window_values(spec) > WINDOW)
    else:
        _schedule_direct(sch, lanes or _vector_lanes(spec))
    return sch.mod["main"].with_attr("tirx.is_scheduled", True).without_attr("global_symbol")


def gpu_variant(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """The CUDA form of a ``primfunc`` (one tagged ``DEPTHWISE_ATTR``)."""
    return gpu_primfunc(json.loads(str(func.attrs[DEPTHWISE_ATTR])))


# ------------------------------------------------------------------------------ legalization


def _legalize(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
    x, w, y, g = depthwise_shapes(call)
    dtype = str(call.args[0].ty.dtype)
    op = OPS[call.op.name]
    spec = _spec(op, x, w, g, dtype)
    gv = bb.add_func(primfunc(spec), f"depthwise_conv2d_{op}")
    if op != "wgrad":
        (out,) = emit_call_tir(bb, gv, list(call.args[:2]), [relax.TensorType(y if op == "fprop" else x, dtype)])
        return out
    (k, r, s, _) = w
    if spec.get("columns"):  # [G, R, S, K]: a column sum over G, then [R, S, K] -> [K, R, S, 1]
        (part,) = emit_call_tir(bb, gv, list(call.args[:2]), [relax.TensorType((spec["groups"], r, s, k), F32)])
        dw = bb.emit(R.sum(part, axis=[0]))
        if dtype != F32:
            dw = bb.emit(R.astype(dw, dtype))
        return R.reshape(bb.emit(R.permute_dims(dw, [2, 0, 1])), list(w))
    (part,) = emit_call_tir(bb, gv, list(call.args[:2]), [relax.TensorType((k, r, s, spec["groups"]), F32)])
    dw = bb.emit(R.sum(part, axis=[3]))
    if dtype != F32:
        dw = bb.emit(R.astype(dw, dtype))
    return R.reshape(dw, list(w))


def selected_dgrad(bb: relax.BlockBuilder, call: relax.Call, sel: relax.Expr, mask) -> relax.Var:
    """``where(mask(sel), call, 0)`` for a `call` of ``depthwise_conv2d_dgrad`` as one kernel: the
    dgrad's result rounded, then kept where the ``mask_value`` tree `mask` of `sel` (a tensor of
    its shape) holds, else 0."""
    x, w, _, g = depthwise_shapes(call)
    dtype = str(call.args[0].ty.dtype)
    spec = {**_spec("dgrad", x, w, g, dtype), "select": {"dtype": str(sel.ty.dtype), "mask": mask}}
    gv = bb.add_func(primfunc(spec), "depthwise_conv2d_dgrad_select")
    (out,) = emit_call_tir(bb, gv, [*call.args[:2], sel], [relax.TensorType(x, dtype)])
    return out


def depthwise_grad(orig_var, orig_call, output_grad, ctx):
    """``[dx, dw]`` as the two gradient ops (direct kernels in their own right)."""
    x_shape, w_shape, _, geometry = depthwise_shapes(orig_call)
    x, w = orig_call.args[:2]
    dy = output_grad
    if str(dy.ty.dtype) != str(x.ty.dtype):
        dy = ctx.emit(R.astype(dy, str(x.ty.dtype)))
    return [depthwise_conv2d_dgrad(dy, w, geometry, x_shape), depthwise_conv2d_wgrad(x, dy, geometry, w_shape),
            no_grad(orig_call.args[2])]


def is_depthwise(x_shape, w_shape, groups: int) -> bool:
    """Is an NHWC/OHWI convolution of these shapes one these ops take (``groups == C``, ``K = C·m``)?"""
    return (len(x_shape) == 4 and len(w_shape) == 4 and groups == x_shape[3] > 1 and w_shape[3] == 1
            and w_shape[0] % x_shape[3] == 0)


# ------------------------------------------------------------------------------ registration

register_op(FPROP, "NHWC x [K, R, S, 1] depthwise 2-D cross-correlation (direct kernel)", _infer, _legalize,
            depthwise_grad)
register_op(DGRAD, "input gradient of tvm_evt.depthwise_conv2d", _infer, _legalize)
register_op(WGRAD, "weight gradient of tvm_evt.depthwise_conv2d", _infer, _legalize)

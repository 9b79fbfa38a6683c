"""Implicit-GEMM convolution benchmark (``relax.ext.evt_conv``'s kernels) against cuDNN through torch.

Cases are the 3x3 convolutions of torchvision's ResNet-50 (batch 128, 224², channels-last): each
stage's unit-stride one and its stride-2 first.  Every kernel of a case (fprop, dgrad where the
kernels take it, wgrad) is timed under the configuration a build gives it (``conv.tile``,
``conv.splits``) and under variants (``variants``): the other CTA tiles of 64 or 128 rows and
columns the problem fills, and for a weight gradient other counts of batch chunks (each a launch
on a side stream).  torch runs the same convolution through cuDNN (``cudnn.benchmark`` on, so its fastest
algorithm) on channels-last tensors: ``aten.convolution`` forward, ``aten.convolution_backward``
for the input or the weight gradient alone.

Method as ``codegen.bench``: every kernel of a case built in one parallel batch (a variant that
does not build or does not run is recorded with its error), fresh random inputs before each run,
outputs poisoned (NaN), CUDA events, median of ``iters`` after ``WARMUP`` runs; each variant's
output checked against the built configuration's (relative L2 error at most 1e-2, finite).
"""
from __future__ import annotations

import dataclasses
import math
import os

from .backend.conv import MAX_SPLITS, SMS, emit_conv, splits, tile
from .errors import Unsupported
from .frontend.conv_call import output_extent, supported
from .ir.conv import ConvCall

# name: ((N, H, W, C), (K, R, S), stride); padding 1
CASES = {
    "conv2_3x3": ((128, 56, 56, 64), (64, 3, 3), 1),
    "conv3_3x3_s2": ((128, 56, 56, 128), (128, 3, 3), 2),
    "conv3_3x3": ((128, 28, 28, 128), (128, 3, 3), 1),
    "conv4_3x3_s2": ((128, 28, 28, 256), (256, 3, 3), 2),
    "conv4_3x3": ((128, 14, 14, 256), (256, 3, 3), 1),
    "conv5_3x3_s2": ((128, 14, 14, 512), (512, 3, 3), 2),
    "conv5_3x3": ((128, 7, 7, 512), (512, 3, 3), 1),
}
WARMUP = 3


def case_calls(name: str, dtype: str = "bfloat16") -> dict[str, ConvCall]:
    """The kernels the convolution `name` needs that the kernels take: kind -> call."""
    (n, h, w, c), (k, r, s), stride = CASES[name]
    p, q = output_extent(h, 1, 1, r, stride, 1), output_extent(w, 1, 1, s, stride, 1)
    calls = {}
    for kind in ("fprop", "dgrad", "wgrad"):
        call = ConvCall(symbol=f"bench_{name}_{kind}", kind=kind, dtype=dtype, x=(n, h, w, c), w=(k, r, s, c),
                        y=(n, p, q, k), pad=(1, 1, 1, 1), stride=(stride, stride), dilation=(1, 1))
        if supported(call) is None:
            calls[kind] = call
    return calls


def variants(call: ConvCall) -> list[tuple[tuple[int, int, int], int]]:
    """(CTA tile, batch chunks) to time `call` under, the built configuration first: tiles of 64 or
    128 along M and N where the problem fills them (N: the output channels for fprop, a filter
    tap's channels otherwise; a wgrad's M: its output channels), 256x64 for a forward or input
    gradient of at most 64 channels over two waves of such tiles (the 56² stage's; the GEMMs of
    that shape ran fastest on them), and for a weight gradient none, half, twice the built chunks
    (at most ``MAX_SPLITS``)."""
    built_tile, built_chunks = tile(call), splits(call)
    n_extent = call.w[0] if call.kind == "fprop" else call.x[3]
    m_extent = call.w[0] if call.kind == "wgrad" else call.gemm[0]
    tiles = [(tm, tn, 64) for tm in (64, 128) for tn in (64, 128) if tm <= max(64, m_extent) and tn <= max(64, n_extent)]
    if call.kind != "wgrad" and n_extent <= 64 and call.gemm[0] >= 2 * SMS * 256:
        tiles.append((256, 64, 64))  # 64 channels over many pixels: as the GEMMs of N <= 64 (select)
    chunks = [1]
    if call.kind == "wgrad":
        chunks = sorted({1, max(1, built_chunks // 2), built_chunks, min(MAX_SPLITS, call.x[0], 2 * built_chunks)})
    return [(built_tile, built_chunks)] + [(t, c) for t in tiles for c in chunks if (t, c) != (built_tile, built_chunks)]


def variant_name(call: ConvCall, cta_tile, chunks) -> str:
    return f"{call.symbol}__{cta_tile[0]}x{cta_tile[1]}_s{chunks}"


def sources(calls: list[ConvCall]) -> tuple[dict[str, str], dict[str, str]]:
    """Every variant's source (name -> C++) and the variants the emitter refused (name -> why)."""
    out, refused = {}, {}
    for call in calls:
        for cta_tile, chunks in variants(call):
            name = variant_name(call, cta_tile, chunks)
            try:
                out[name] = emit_conv(dataclasses.replace(call, symbol=name), cta_tile, chunks)
            except Unsupported as err:
                refused[name] = err.reason
    return out, refused


def _torch_run(torch, call: ConvCall, t: dict):
    """The same convolution by cuDNN: a closure computing `call`'s output from the tensors `t`."""
    aten = torch.ops.aten
    stride, pad = list(call.stride), [call.pad[0], call.pad[1]]
    if call.kind == "fprop":
        return lambda: aten.convolution(t["x"], t["w"], None, stride, pad, [1, 1], False, [0, 0], 1)
    mask = [call.kind == "dgrad", call.kind == "wgrad", False]
    return lambda: aten.convolution_backward(t["dy"], t["x"], t["w"], None, stride, pad, [1, 1], False, [0, 0], 1,
                                             mask)


def bench(names: list[str], iters: int = 20, jobs: int = os.cpu_count() or 1) -> list[dict]:
    """One row per kernel of each case: cuDNN's time, each variant's time (or error), the built one."""
    import torch
    import tvm_ffi

    from .bench import build_tolerant, load_library, median_ms

    torch.backends.cudnn.benchmark = True
    calls = [c for name in names for c in case_calls(name).values()]
    srcs, refused = sources(calls)
    objects, failed, _ = build_tolerant(srcs, jobs)
    lib = load_library(objects) if objects else {}
    gen = torch.Generator(device="cuda").manual_seed(int.from_bytes(os.urandom(4), "little"))
    rows = []
    for call in calls:
        bf16 = lambda shape: torch.empty(shape, device="cuda", dtype=torch.bfloat16)  # noqa: E731
        t = {"x": bf16(call.x), "w": bf16(call.w), "dy": bf16(call.y)}  # timed: fresh before each run
        fixed = {k: bf16(v.shape).normal_(generator=gen) for k, v in t.items()}  # checked

        def refresh():
            for v in t.values():
                v.normal_(generator=gen)

        nchw = {k: v.permute(0, 3, 1, 2) for k, v in t.items()}  # channels-last views for torch
        row = {"kernel": call.symbol, "gemm": list(call.gemm), "cudnn_ms": median_ms(_torch_run(torch, call, nchw),
                                                                                   refresh, iters, WARMUP),
               "built": variant_name(call, tile(call), splits(call)).rsplit("__", 1)[1], "ms": {}, "errors": {}}
        ref = None
        for cta_tile, chunks in variants(call):
            name = variant_name(call, cta_tile, chunks)
            label = name.rsplit("__", 1)[1]
            if name not in lib:
                row["errors"][label] = refused.get(name) or failed.get(name, "not built")[-300:]
                continue

            def run(tensors, out, name=name):
                lib[name](*[tvm_ffi.from_dlpack(a) for a in [tensors[n] for n in call.inputs] + [out]])

            out = torch.full(call.shape(call.outputs[0]), math.nan, device="cuda", dtype=torch.bfloat16)
            try:
                run(fixed, out)
                torch.cuda.synchronize()
                got = out.float()
                if not bool(torch.isfinite(got).all()):
                    row["errors"][label] = "non-finite output"
                    continue
                if ref is None:  # the built configuration's: the others' reference
                    ref = got
                else:
                    err = float((got - ref).norm() / ref.norm().clamp_min(1e-30))
                    if err > 1e-2:
                        row["errors"][label] = f"differs from {row['built']} (rel err {err:.3g})"
                        continue

                def poisoned_refresh(out=out):
                    refresh()
                    out.fill_(math.nan)

                row["ms"][label] = median_ms(lambda run=run, out=out: run(t, out), poisoned_refresh, iters, WARMUP)
            except Exception as err:  # noqa: BLE001 - one variant must not stop the others
                row["errors"][label] = f"{type(err).__name__}: {str(err)[:300]}"
        rows.append(row)
    return rows


def markdown(rows: list[dict], gpu: str) -> str:
    lines = [f"# Implicit-GEMM convolutions against cuDNN — {gpu}", "",
             "| kernel | M×N×K | cuDNN ms | built | ms | best variant | ms |", "|---|---|---:|---|---:|---|---:|"]
    for r in rows:
        built = r["built"]
        best = min(r["ms"], key=r["ms"].get) if r["ms"] else "–"
        lines.append(f"| {r['kernel']} | {'×'.join(map(str, r['gemm']))} | {r['cudnn_ms']:.3f} | {built} | "
                     f"{r['ms'].get(built, math.nan):.3f} | {best} | {r['ms'].get(best, math.nan):.3f} |")
    return "\n".join(lines) + "\n"


def main(names: list[str], iters: int = 20, out: str | None = None) -> list[dict]:
    """Bench `names`, print the markdown table; with `out`, write ``bench_conv.json`` and ``.md`` there."""
    import json

    import torch

    rows = bench(names, iters)
    text = markdown(rows, torch.cuda.get_device_name())
    print(text)
    for r in rows:
        for label, ms in sorted(r["ms"].items(), key=lambda kv: kv[1]):
            print(f"  {r['kernel']:32s} {label:12s} {ms:8.4f}")
        for label, err in r["errors"].items():
            print(f"  {r['kernel']:32s} {label:12s} {err}")
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "bench_conv.json"), "w") as f:
            json.dump(rows, f, indent=1)
        with open(os.path.join(out, "bench_conv.md"), "w") as f:
            f.write(text)
    return rows

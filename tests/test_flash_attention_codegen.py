"""Flash-attention codegen without a GPU: the emitted entries, what is refused, and an nvcc build
whose entries check their arguments (the kernels' numbers: tests/test_gpu_flash_attention.py)."""
import os
import re
import shutil
import subprocess

import numpy as np
import pytest

from tvm_evt.codegen.backend.flash_attention import HEAD_DIMS, KEY_TILE, emit_attention
from tvm_evt.codegen.build import cache, link_module, toolchain
from tvm_evt.codegen.errors import Unsupported
from tvm_evt.codegen.ir.attention import AttentionCall


def call(**kw) -> AttentionCall:
    base = dict(symbol="attn_fwd", backward=False, dtype="bfloat16", batch=2, heads=3, sq=197, sk=208,
                head_dim=64, scale=0.125, causal=False, dropout=0.1, site=3, has_bias=True)
    return AttentionCall(**{**base, **kw})


def test_dps_arguments_follow_the_flags():
    assert call().inputs == ("q", "k", "v", "seed", "bias") and call().outputs == ("out", "lse")
    assert call(dropout=0.0, has_bias=False).inputs == ("q", "k", "v")
    back = call(backward=True, dropout=0.0)
    assert back.inputs == ("q", "k", "v", "o", "lse", "dout", "bias") and back.outputs == ("dq", "dk", "dv")


def test_forward_entry_bakes_in_shapes_flags_and_dropout_constants():
    src = emit_attention(call())
    # sk = 208 leaves its last 64-key tile part-filled: the kernels bound each row's keys (kRagged)
    # a CTA per 64-query tile of each of B x H = 6 heads
    assert "flash_fwd<64, true, false, true, true, true>, p.q_blocks,\n      6, false, stream, p);" in src
    assert "p.q_blocks = (197 + kBlock - 1) / kBlock;" in src
    # the Philox threshold and scale of p = 0.1 (codegen/philox.py's convention), the site
    assert "p.threshold = 6554u;" in src and "p.drop_scale = 1.1111111640930176f;" in src
    assert "p.site = 3u;" in src
    # every argument is checked: q [2,3,197,64] bf16 ... seed uint32[2], bias f32[208], lse f32
    assert 'check(q, kKernel, "q", {2, 3, 197, 64}, kDLBfloat, 16, device)' in src
    assert 'check(seed, kKernel, "seed", {2}, kDLUInt, 32, device)' in src
    assert 'check(bias, kKernel, "bias", {208}, kDLFloat, 32, device)' in src
    assert 'check(lse, kKernel, "lse", {2, 3, 197}, kDLFloat, 32, device)' in src
    assert "expects 7 tensors" in src  # q, k, v, seed, bias, out, lse


def test_backward_entry_launches_delta_dkdv_dq():
    src = emit_attention(call(backward=True, dtype="float16", causal=True, dropout=0.0, has_bias=False,
                              symbol="attn_bwd"))
    assert "flash_delta<64, false><<<" in src
    assert "flash_dkdv<64, false, true, false, false, true>" in src and "flash_dq<64, false, true, false, false, true>" in src
    assert "p.seed" not in src.split("int run(")[1]  # no dropout: no seed argument
    assert "expects 9 tensors" in src  # q, k, v, o, lse, dout, dq, dk, dv


def test_backward_entry_with_dropout_computes_dq_without_atomics():
    """dQ comes from its own kernel with dropout too: no fp32 workspace, no atomics (deterministic)."""
    src = emit_attention(call(backward=True, dropout=0.1, symbol="attn_bwd"))
    run = src.split("int run(")[1]
    assert "flash_dkdv<64, true, false, true, true, true>" in run and "flash_dq<64, true, false, true, true, true>" in run
    assert "atomicAdd" not in src and "red.global.add" not in src and "cudaMemsetAsync" not in run


def test_bshd_layout_checks_sequence_major_shapes():
    src = emit_attention(call(layout="bshd", backward=True))
    assert 'check(q, kKernel, "q", {2, 197, 3, 64}, kDLBfloat, 16, device)' in src
    assert 'check(dk, kKernel, "dk", {2, 208, 3, 64}, kDLBfloat, 16, device)' in src
    assert 'check(lse, kKernel, "lse", {2, 3, 197}, kDLFloat, 32, device)' in src  # LSE keeps [B, H, Sq]
    assert "p.bshd = 1;" in src and "p.heads = 3;" in src and "p.bshd = 0;" in emit_attention(call())
    assert emit_attention(call(layout="bshd")) != emit_attention(call())


def test_grouped_query_heads_check_key_value_shapes_and_launch_dkdv_per_key_value_head():
    """Grouped-query attention (8 query heads over 2 key/value heads): K, V, dK and dV have their own
    heads; the dK/dV kernel runs a CTA per key tile of each key/value head (it walks the group's
    query heads), the forward, delta and dQ kernels one per query head."""
    src = emit_attention(call(backward=True, heads=8, kv_heads=2, layout="bshd"))
    assert 'check(k, kKernel, "k", {2, 208, 2, 64}, kDLBfloat, 16, device)' in src
    assert 'check(dv, kKernel, "dv", {2, 208, 2, 64}, kDLBfloat, 16, device)' in src
    assert 'check(dq, kKernel, "dq", {2, 197, 8, 64}, kDLBfloat, 16, device)' in src
    run = src.split("int run(")[1]
    assert "p.heads = 8;" in run and "p.kv_heads = 2;" in run
    assert "true, true, true>, p.k_blocks,\n      4, false, stream, p);" in run  # dK/dV: key tiles of B x Hkv
    assert "true, true, true>, p.q_blocks,\n      16, false, stream, p);" in run  # dQ: query tiles of B x H
    assert "p.kv_heads = 3;" in emit_attention(call())  # without grouping: as many as the query heads
    with pytest.raises(Unsupported, match="8 query heads over 3 key/value heads"):
        emit_attention(call(heads=8, kv_heads=3))


def test_full_key_tiles_drop_the_bound():
    """Keys that fill their tiles (BERT-Large's 512) need no per-score compare unless causal: the
    entry launches the kernels with kRagged false."""
    src = emit_attention(call(sk=512, sq=512, backward=True))
    run = src.split("int run(")[1]
    assert "flash_dkdv<64, true, false, true, true, false>" in run and "flash_dq<64, true, false, true, true, false>" in run
    assert "flash_fwd<64, true, false, true, true, false>," in emit_attention(call(sk=512, sq=512))
    assert "constexpr bool kBounded = kCausal || kRagged;" in src
    assert f"constexpr int kBlock = {KEY_TILE};" in src  # the entry's tile is the kernels'


def test_same_call_same_source():
    assert emit_attention(call()) == emit_attention(call())
    assert emit_attention(call()) != emit_attention(call(site=4))


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_entries_check_and_launch_the_true_head_dim(head_dim):
    """Every head dimension runs in kernels instantiated for it (the tiles padded inside the kernels,
    never in global memory): the entries check [.., D] tensors and launch the kernels of D."""
    fwd = emit_attention(call(head_dim=head_dim, layout="bshd"))
    assert f'check(q, kKernel, "q", {{2, 197, 3, {head_dim}}}, kDLBfloat, 16, device)' in fwd
    assert f'check(out, kKernel, "out", {{2, 197, 3, {head_dim}}}, kDLBfloat, 16, device)' in fwd
    assert f"launch_tiles<FwdShared<{head_dim}, true, true>>(\n      flash_fwd<{head_dim}, true, false, true, true, true>," in fwd
    bwd = emit_attention(call(head_dim=head_dim, backward=True, symbol="attn_bwd"))
    assert f'check(dk, kKernel, "dk", {{2, 3, 208, {head_dim}}}, kDLBfloat, 16, device)' in bwd
    run = bwd.split("int run(")[1]
    for kernel in (f"flash_delta<{head_dim}, true>", f"flash_dkdv<{head_dim}, true,", f"flash_dq<{head_dim}, true,"):
        assert kernel in run, kernel


@pytest.mark.parametrize("bad, reason", [
    (dict(head_dim=48), "head dimension 48"),  # a multiple of 16, but no tested instantiation
    (dict(head_dim=256), "head dimension 256"),
    (dict(head_dim=72), "head dimension 72"),
    (dict(dtype="float32"), "dtype float32"),
    (dict(symbol="not-an-identifier"), "not a C identifier"),
    (dict(layout="sbhd"), "layout 'sbhd'"),
    (dict(scale=-0.125), "scale -0.125"),
])
def test_refuses_what_the_kernels_cannot_take(bad, reason):
    with pytest.raises(Unsupported, match=reason):
        emit_attention(call(**bad))


def test_nvcc_builds_the_kernels_and_entries_check_arguments(tmp_path, monkeypatch):
    """A few seconds of nvcc (no CUTLASS templates); the exported entries raise TVM FFI errors."""
    if toolchain.find_nvcc() is None or shutil.which("ld") is None or shutil.which("g++") is None:
        pytest.skip("nvcc absent")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    calls = [call(), call(backward=True, symbol="attn_bwd", causal=True, heads=6, kv_heads=2)]
    objects = cache.build_many({c.symbol: emit_attention(c) for c in calls})
    module_obj = link_module(list(objects.values()), [c.symbol for c in calls])
    so = tmp_path / "attention.so"
    subprocess.run(["g++", "-shared", "-o", str(so), str(module_obj)], check=True)
    import tvm_ffi

    fwd = tvm_ffi.load_module(str(so))["attn_fwd"]
    with pytest.raises(TypeError, match="expects 7 tensors, got 0"):
        fwd()
    x = tvm_ffi.from_dlpack(np.zeros((2, 3, 197, 64), np.float32))
    with pytest.raises(ValueError, match="q must be on cuda"):
        fwd(*[x] * 7)


def test_bench_cases_emit_in_both_layouts():
    from tvm_evt.codegen import bench_attention

    for name in bench_attention.CASES:
        for layout in ("bhsd", "bshd"):
            fwd, bwd = bench_attention.calls(name, layout=layout)
            assert fwd.layout == bwd.layout == layout and fwd.symbol != bwd.symbol
            emit_attention(fwd), emit_attention(bwd)
    row = {"case": "vit", "layout": "bshd", "shape": [1, 2, 3, 4], "ours_fwd_ms": 1.0, "ours_bwd_ms": 2.0,
           "ours_ms": 3.0, "sdpa_fwd_ms": 1.0, "sdpa_ms": 3.0, "speedup": 1.0}
    assert "| vit (bshd) | 1 x 2 x 3 x 4 | 1.000 | 2.000 | 3.000 | 1.000 | 3.000 | 1.00x |" in \
        bench_attention.markdown([row], "GPU")


def test_each_kernel_calls_one_copy_of_its_softmax():
    """A masking-free copy of the softmax beside the masked one (a uniform branch per tile) made
    every output wrong on H100 with nvcc 13.0, though each copy alone was right
    (docs/bench/h100-2026-11-26-e): the forward and dK/dV kernels call their softmax once."""
    src = emit_attention(call(backward=True))
    kernels = src[src.index("__global__ void __launch_bounds__(kThreads, min_blocks(kDim)) flash_fwd"):]
    assert kernels.count("fwd_softmax<") == 1 and kernels.count("dkdv_scores<") == 1


def _kernel_body(src: str, name: str) -> str:
    start = src.index(f" {name}(Params p) {{")
    return src[start:src.index("\n}\n", start)]


def test_no_tile_waits_on_a_load_issued_for_it():
    """A global load stored to shared memory right where it is issued stalls the tile on its
    latency (dK/dV: 0.62 -> 0.51 ms backward on H100 once it did not; docs/bench/h100-2026-11-26-f).
    The backward kernels fetch the next tile's statistics and keep bits into registers before this
    tile's MMAs and store them after; the key bias comes with the K/V tiles' copies (the dK/dV
    kernel reads its keys' bias once)."""
    src = emit_attention(call(backward=True))
    dkdv = _kernel_body(src, "flash_dkdv")
    assert dkdv.index("fetch(nh, ni)") < dkdv.index("gemm_nk2<") < dkdv.index("stage(buf ^ 1)")
    dq = _kernel_body(src, "flash_dq")
    assert dq.index("keep_next = mask_word(") < dq.index("gemm_nk2<") < dq.index("sm.mask[buf ^ 1][tid] = keep_next")
    for name in ("flash_fwd", "flash_dq"):
        body = _kernel_body(src, name)
        assert "load_bias(sm.bias[buf ^ 1]" in body and "p.bias[" not in body, name
    assert src.count("p.bias[") == 1 and "p.bias[key[r]]" in dkdv


def _ptxas_report(stderr: str) -> dict[str, tuple[int, int]]:
    """kernel (flash_fwd, ...) -> (registers, spill bytes stored + loaded) from ``-Xptxas -v``."""
    kernels, name = {}, None
    for line in stderr.splitlines():
        if m := re.search(r"Compiling entry function '_ZN13tvm_evt_flash(\d+)(flash_\w+?)I", line):
            name = m.group(2)
        elif m := re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line):
            spill = int(m.group(1)) + int(m.group(2))
        elif (m := re.search(r"Used (\d+) registers", line)) and name:
            kernels[name], name = (int(m.group(1)), spill), None
    return kernels


@pytest.mark.slow
def test_ptxas_fits_every_head_dim_without_spills(tmp_path):
    """Every kernel of every head dimension, with dropout, bias and causal masking and without, fits
    its registers with no spill: the codegen's nvcc flags plus ``-Xptxas -v`` (a few minutes of nvcc).
    D = 128 is the tightest (dK/dV at 255 registers, its K and V read from shared memory)."""
    nvcc = toolchain.find_nvcc()
    if nvcc is None:
        pytest.skip("nvcc absent")
    from concurrent.futures import ThreadPoolExecutor

    def ptxas(spec):
        source, output = tmp_path / f"{spec.symbol}.cu", tmp_path / f"{spec.symbol}.o"
        source.write_text(emit_attention(spec))
        done = subprocess.run([*toolchain.compile_command(nvcc, source, output), "-Xptxas", "-v"],
                              capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-2000:]
        return spec.symbol, _ptxas_report(done.stderr)

    specs = [call(symbol=f"d{d}_{flags}_{kind}", head_dim=d, backward=kind == "bwd", scale=d ** -0.5,
                  **(dict(causal=True, has_bias=True, dropout=0.1) if flags == "cbd" else dict(has_bias=False, dropout=0.0)))
             for d in HEAD_DIMS for flags in ("cbd", "plain") for kind in ("fwd", "bwd")]
    with ThreadPoolExecutor(max(1, min(4, (os.cpu_count() or 2)))) as pool:
        reports = dict(pool.map(ptxas, specs))
    for symbol, kernels in reports.items():
        want = {"flash_delta", "flash_dkdv", "flash_dq"} if symbol.endswith("bwd") else {"flash_fwd"}
        assert set(kernels) == want, (symbol, kernels)
        for kernel, (registers, spilled) in kernels.items():
            assert spilled == 0 and registers <= 255, (symbol, kernel, registers, spilled)


def _cta_of(block: int, tiles: int, heads: int, chunk: int) -> tuple[int, int]:
    """the kernels' ``cta_of``, for checking its order on the host"""
    first = block // (chunk * tiles) * chunk
    n = min(chunk, heads - first)
    local = block - first * tiles
    return local // n, first + local % n


@pytest.mark.parametrize("tiles,heads,chunk", [(32, 128, 17), (4, 1536, 132), (3, 5, 2), (7, 1, 1), (2, 3, 3)])
def test_launch_order_covers_every_tile_once_ranks_first_within_chunks(tiles, heads, chunk):
    """The 1-D grid of ``launch_tiles``: every (tile, head) once; within a chunk of heads, every
    rank-r CTA before any of rank r + 1 (a causal launch's longest tiles first); chunks in head order."""
    src = emit_attention(call(backward=True, causal=True))
    assert "const Cta cta = cta_of(p, p.k_blocks);" in src and "p.q_blocks - 1 - cta.rank" in src
    order = [_cta_of(b, tiles, heads, chunk) for b in range(tiles * heads)]
    assert sorted(order) == [(r, h) for r in range(tiles) for h in range(heads)]
    for first in range(0, heads, chunk):
        ranks = [r for r, h in order if first <= h < first + chunk]
        assert ranks == sorted(ranks)
    assert [h // chunk for _, h in order] == sorted(h // chunk for _, h in order)

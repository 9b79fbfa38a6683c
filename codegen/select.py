"""Kernel configuration selection: a candidate table, pruned by shape, chosen by profiling.

As in the EVT paper, the main loop is ranked on the plain GEMM of a partition (same operands,
epilogue reduced to the D store), and only the best few main-loop configurations are re-profiled
with the partition's own epilogue.  The choice is persisted in a JSON file under
``$XDG_CACHE_HOME/tvm_evt`` keyed by (partition signature, GPU name, codegen version) and reused by
``relax.ext.evt`` (``relax_ext``: option ``select`` or ``TVM_EVT_SELECT=1``).  Without a GPU at build
time, or without a persisted choice, the default configuration is used.

Nothing here touches a GPU: profiling is a ``measure`` callable handed to ``tune`` (the direct
kernel runner in ``codegen.bench`` is one), so ranking and persistence are testable on a CPU.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
from pathlib import Path
from typing import Callable, Iterable, Mapping

from .backend import (CODEGEN_VERSION, Decomposition, KernelConfig, Raster, Schedule, atomic_reduction,
                      default_config, emit, smem)
from .backend.functors import BITS
from .build.cache import atomic_write, file_lock
from .ir import (AccFetch, AuxLoad, AuxStore, Compute, Dropout, EpilogueGraph, OpKind, Partition, Reduction,
                 ReduceAxis, TensorDesc)
from .legality import check_partition
from .passes import lower

H100_SMS = 132


def _cfg(tile, cluster=(1, 1), schedule=Schedule.COOPERATIVE, **kw) -> KernelConfig:
    return KernelConfig(tile=tile, cluster=(*cluster, 1), schedule=schedule, **kw)


PP = Schedule.PINGPONG
SK = Decomposition.STREAM_K
SPLIT = Decomposition.SPLIT_K

# Search spaces, smallest first: a space profiles its rows and those of every smaller space.
SPACES = {"quick": 0, "default": 1, "full": 2}

# The candidate table (16-bit operands; tile K = 64 elements = 128 bytes): (smallest space, config).
# Order is the tie-break; ``prune`` drops the rows that cannot pay off for a problem.
_TABLE: tuple[tuple[str, KernelConfig], ...] = (
    ("quick", _cfg((128, 128, 64))),  # the default
    ("quick", _cfg((128, 256, 64))),
    ("quick", _cfg((256, 128, 64), (2, 1))),
    ("default", _cfg((128, 128, 64), (2, 1))),
    # ping-pong: one consumer warpgroup's epilogue overlaps the other's main loop
    ("quick", _cfg((128, 128, 64), schedule=PP)),
    ("default", _cfg((64, 128, 64), schedule=PP)),
    ("full", _cfg((128, 256, 64), (2, 1))),
    ("full", _cfg((128, 256, 64), (1, 2))),
    # cuBLAS's choice (nvjet 256x128, cluster 1x2) for Llama's 8192-row GEMMs (H200, 2026-11-28)
    ("full", _cfg((256, 128, 64), (1, 2))),
    ("full", _cfg((256, 128, 64))),
    ("full", _cfg((128, 128, 64), (1, 2))),
    ("quick", _cfg((128, 128, 64), (2, 1), schedule=PP)),
    ("quick", _cfg((64, 256, 64), schedule=PP)),
    ("full", _cfg((128, 128, 64), raster=Raster.ALONG_M)),
    ("full", _cfg((128, 128, 64), raster=Raster.ALONG_N)),
    # stream-K / split-K: only for long K with few output tiles (see ``prune``)
    ("quick", _cfg((128, 128, 64), decomposition=SK)),
    ("default", _cfg((128, 256, 64), decomposition=SK)),
    ("full", _cfg((128, 128, 64), (2, 1), decomposition=SK)),
    ("quick", _cfg((64, 256, 64), (2, 1), schedule=PP)),
    # small output tiles: more tiles (less wave quantization) for small-N weight gradients
    ("quick", _cfg((128, 64, 64))),
    ("quick", _cfg((128, 64, 64), (2, 1))),
    ("default", _cfg((128, 64, 64), (1, 2))),
    ("default", _cfg((64, 128, 64), (2, 1), schedule=PP)),
    ("quick", _cfg((128, 64, 64), decomposition=SK)),
    ("quick", _cfg((128, 128, 64), decomposition=SPLIT, splits=2)),
    ("default", _cfg((128, 64, 64), decomposition=SPLIT, splits=2)),
    ("full", _cfg((128, 128, 64), decomposition=SPLIT, splits=4)),
)
CANDIDATES: tuple[KernelConfig, ...] = tuple(cfg for _, cfg in _TABLE)


# Tiles fitted to a narrow problem (N < 128 or a 16-bit K <= 32: MobileNet's and EfficientNet's
# first stages, 16-96 channels over 0.4-1.6 M pixels), added to every space's candidates: with the
# table's N = 64-128 and K = 64 most of such a tile's MMAs, shared memory and epilogue work is on
# padding, and each tile has one K step (H200, torchvision MobileNetV2: 1605632x96x16 0.211 ms as
# a plain GEMM on 128x128x64 against cuBLAS's 0.117, 1605632x16x96 0.269 on 256x64x64 against
# 0.103; ``docs/bench/h200-2026-12-01e/partitions/``).  ``heuristic_config`` runs their 256-row
# cooperative tile on many rows (measured: its docstring).
NARROW_N = (16, 32, 48, 64, 96)  # tile widths a narrow problem's N rounds up to
NARROW_K = 32  # the tile K of a 16-bit K at most this long (64 bytes: CUTLASS's 64-byte swizzle)


def narrow_configs(m: int, n: int, k: int, dtype_a: str = "bfloat16") -> list[KernelConfig]:
    """Tiles fitted to an N under 128 (the smallest of ``NARROW_N`` that holds it) and to a 16-bit
    K of at most ``NARROW_K``: 128 and 256 rows cooperative, 128 rows ping-pong; none for a problem
    the table's tiles already fit."""
    bits16 = dtype_a != "float32"
    table_k = 64 if bits16 else 32  # the table's K tile: 128 bytes
    tn = next((w for w in NARROW_N if n <= w), None)
    tk = NARROW_K if bits16 and k <= NARROW_K else table_k
    if tn is None and tk == table_k:
        return []
    tn = tn or 128
    return [_cfg((128, tn, tk)), _cfg((256, tn, tk)), _cfg((128, tn, tk), schedule=PP)]


def space_table(space: str) -> list[KernelConfig]:
    """The table rows a search space profiles (before pruning)."""
    return [cfg for s, cfg in _TABLE if SPACES[s] <= SPACES[space]]


def epilogue_variant(cfg: KernelConfig) -> KernelConfig:
    """``cfg`` with a narrow epilogue subtile (N = 16): less epilogue shared memory, so more
    main-loop stages; tried in the second stage of ``tune`` for partitions with an epilogue."""
    rows = 128 if cfg.schedule is Schedule.COOPERATIVE else 64
    return dataclasses.replace(cfg, epi_tile=(rows, 16))


def reduction_variant(partition: Partition, cfg: KernelConfig) -> KernelConfig | None:
    """``cfg`` with atomically finished row/column sums, for partitions that have a float32 one
    (tried in the second stage of ``tune``); None when no reduction would change."""
    if cfg.atomic_reduce:
        return None
    variant = dataclasses.replace(cfg, atomic_reduce=True)
    if any(isinstance(n, Reduction) and n.axis is not ReduceAxis.SCALAR and atomic_reduction(n, variant)
           for n in partition.epilogue.nodes):
        return variant
    return None


def is_long_k(m: int, n: int, k: int, num_sms: int = H100_SMS) -> bool:
    """Stream-K pays off when the 128x128 output tiles leave SMs idle and each tile has a long K;
    with a thin output (``is_thin``) from K = 2048 on."""
    tiles = math.ceil(m / 128) * math.ceil(n / 128)
    return k >= 4096 and (tiles < 2 * num_sms or k >= 4 * max(m, n)) or is_thin(m, n, k, num_sms)


def is_thin(m: int, n: int, k: int, num_sms: int = H100_SMS) -> bool:
    """At most 64 output rows in at most a quarter wave of 128-wide tiles, over K >= 2048: the
    kernel streams the N x K operand through a handful of CTAs, so it needs K split, and a 128-row
    tile's MMA work on padding rows costs nothing (XML-CNN's weight gradients, 32 x 600..2400 x
    ~16000)."""
    return m <= 64 and k >= 2048 and math.ceil(n / 128) <= num_sms // 4


def prune(configs: Iterable[KernelConfig], m: int, n: int, k: int, dtype_a: str = "bfloat16",
          num_sms: int = H100_SMS) -> list[KernelConfig]:
    """Drop configurations that cannot pay off (or cannot build) for an M x N x K problem."""
    out = []
    for cfg in configs:
        tm, tn, tk = cfg.tile
        if dtype_a == "float32" and tk != 32 or dtype_a != "float32" and tk != 64 and not (tk == NARROW_K >= k):
            continue  # K tile is 128 bytes of operand (64 for a 16-bit K that short: ``narrow_configs``)
        split = cfg.decomposition is not Decomposition.DATA_PARALLEL
        padded = tm > max(64, _round_up(m, 64)) and not (split and is_thin(m, n, k, num_sms))
        if padded or tn > max(64, _round_up(n, 64)):
            continue  # tile larger than the problem: wasted MMA work (hidden where a thin output splits K)
        if math.ceil(m / tm) < cfg.cluster[0] or math.ceil(n / tn) < cfg.cluster[1]:
            continue  # the cluster would span padding
        tiles = math.ceil(m / tm) * math.ceil(n / tn)
        if cfg.cluster[:2] != (1, 1) and tiles < num_sms // 4:
            continue  # a handful of tiles gains nothing from multicast
        if split and not is_long_k(m, n, k, num_sms):
            continue
        if cfg.decomposition is Decomposition.SPLIT_K and tiles >= 2 * num_sms:
            continue  # enough output tiles without splitting K
        if cfg.decomposition is Decomposition.DATA_PARALLEL and m * n < 64 * 64 * num_sms and tm * tn > 128 * 128:
            continue  # too few output tiles for big tiles
        big = math.ceil(m / 128) * math.ceil(n / 128)
        if tm * tn < 128 * 128 and big >= 2 * num_sms and tiles > big:
            continue  # 128x128 tiles already fill two waves: more, smaller tiles only cost operand traffic
        out.append(cfg)
    return out


def candidates(partition: Partition, space: str = "default", num_sms: int = H100_SMS) -> list[KernelConfig]:
    """The rows of ``space`` (see ``_TABLE``), pruned for the problem."""
    g = partition.gemm
    table = space_table(space)
    if g.dtype_a == "float32":
        table = [dataclasses.replace(c, tile=(c.tile[0], c.tile[1], 32)) for c in table]
    table += [c for c in narrow_configs(g.m, g.n, g.k, g.dtype_a) if c not in table]
    found = prune(table, g.m, g.n, g.k, g.dtype_a, num_sms)
    return found or [default_config(g.dtype_a)]


def heuristic_config(partition: Partition, num_sms: int = H100_SMS) -> KernelConfig:
    """A configuration by problem shape, for partitions nobody profiled: the choices the H100
    tuning runs of BERT-Large made most often (scripts/tune.py, 2026-11-23; ms best / default):

    * a batch of K slices at least ``MIN_SLICE`` long within one wave (``k_slices``' weight
      gradients): ``slice_tile``;
    * one GEMM whose N is under 128 or whose K is at most 32 (``narrow_configs``), over many rows:
      a tile as wide as N (16-96) and as deep as K (32 for K <= 32), 256 rows where those fill two
      waves, else 128.  MobileNetV2's first stages (H200, 2026-12-02, ``bench_partitions.py
      --sweep``, ``docs/bench/h200-2026-12-02/``; ms cooperative 256 rows / 128 rows / ping-pong
      128 rows, then the rule before's tile in an earlier run, ``docs/bench/h200-2026-12-01e/``):
      1605632x96x16 0.144 / 0.187 / 0.184, 0.200 on 128x128x64; 1605632x32x16 with a ReLU6 mask
      0.109 / 0.154 / 0.124, 0.183 on 256x64x64; 1605632x16x96 0.144 / 0.174 / 0.169, 0.166;
      401408x144x24 0.096 / 0.136 / 0.133, 0.129 on 128x128x64; three of 401408x24x144 0.041-0.073
      / 0.049-0.097 / 0.047-0.096, 0.049-0.093 on 256x64x64; 401408x96x24 0.075 / 0.079 / 0.111,
      0.095.  The 256-row tile won on eight of the nine partitions and tied on the ninth
      (401408x144x24 storing two outputs: 0.177 / 0.174 / 0.291, 0.178; its plain GEMM 0.086: the
      epilogue's cost, not the tile's).  64 wide with K > 32 it is the next rule's tile;
    * N <= 64 (attention's P·V and dQ/dK, head dim 64): 128x64 tiles (0.146 / 0.156), and 256x64
      where those fill two waves in one GEMM (half the tiles of one 128 rows taller at the same
      padding: no MMA work on the absent columns of a 128x128 tile).  ResNet-50's 64-channel
      layers (H200, 2026-12-01, ``docs/bench/h200-2026-12-01c/``, ms 256x64 / 128x64 / 128x128):
      the stem's 1605632x64x152 0.253 / 0.336 / 0.396, 401408x64x256 0.068 / 0.067 / 0.076 and
      with a ReLU mask loaded 0.080 / 0.079 / 0.089, 401408x64x64 0.033 / 0.033 / 0.040.  Not for a
      weight gradient's long K, which takes the long-K rules below: ResNet-50's 1x1 weight gradient
      256x64x401408 ran data-parallel on 2 CTAs, 0.97 ms a call (H200, 2026-11-28);
    * at most 64 rows over 2048 <= K <= 4 x ``THIN_SLICE`` (``is_thin``): split-K 4 on 128x64 tiles, or on 128x128 tiles
      where 4 slices of the 128x64 ones would pass a wave.  XML-CNN's weight gradients (H100,
      2026-11-27, ms against ping-pong 64x256 / the default, ``docs/bench/h100-2026-11-27-h/
      xml-cnn-split-k/``): 32x1200x15904 0.032 / 0.089 / 0.077, 32x600x15968 0.034 / 0.118 / 0.091,
      32x512x3956 0.027 / 0.036 / 0.037, and 32x2400x15776 on 128x128 tiles 0.044 / 0.092 / 0.078
      (0.050 on 128x64: 152 CTAs); each the best of split-K 2-8 and stream-K on 128x128 tiles, and
      split-K 4 and stream-K on 128x64.  A longer K leaves split-K 4 on a handful of CTAs (ResNet-50's
      7x7 stem weight gradient 64x152x1605632: 12 CTAs, 1.38 ms on H200, 2026-11-28) and takes the
      long-K rules;
    * M <= 64 with N >= 256, short of a weight gradient's long K: ping-pong 64x256 (0.118);
    * long K over at most half a wave of 128x128 tiles (weight gradients 1024x1024x16384, 64
      tiles): split-K 2 (0.055 / 0.079); with fewer tiles, as many K slices (at least 4096 long) as
      fill the SMs: ResNet-50's convolution weight gradients (1152x128x100352: 9 tiles) ran
      split-K 2 on 18 of 132 SMs;
    * long K over at most 8 tiles of 128x64: stream-K on 128x64 tiles.  ResNet-50's weight
      gradients (H200, 2026-11-26, ms stream-K 128x64 / split-K on 128x128): 128x256x401408
      0.146 / 0.203 (66 splits), 512x128x100352 0.067 / 0.086 (24), 128x512x100352 0.075 /
      0.078 (24); with more tiles split-K stayed ahead (128x1152: 0.098 / 0.107 stream-K,
      512x256: 0.078 / 0.085);
    * long K over more than one wave and at most 1.25 of 128x128 tiles: stream-K, which evens out
      the last wave.  ViT-B/16's weight gradients (H200, ms stream-K / before): 768x3072x25216
      (144 tiles) 0.161 / 0.285 (data-parallel); H100, 2026-11-27: 0.163 / 0.256, and 3072x768
      0.161 / 0.255, with stream-K on 128x256 tiles 0.166 and 0.166;
    * long K over 1.25 to 1.5 waves of 128x128 tiles: stream-K on 128x256 tiles, under one wave of
      them (H100, 2026-11-27: BERT-Large's fused QKV 3072x1024x16384, 192 tiles: 0.141 against
      0.171 for stream-K on 128x128 and 0.168 data-parallel);
    * long K over half a wave to one wave of 128x128 tiles: data-parallel, the default (H100,
      2026-11-27: ViT-B/16's 2304x768x25216, 108 tiles, 0.132 against 0.146 stream-K; on an H200
      stream-K had taken 0.129 against split-K 2's 0.153);
    * wide outputs (both sides 4096 to 16384) over K >= 4096, Llama-7B's layer (hidden 4096, FFN
      11008, 8192 tokens; H200, 2026-11-30, ms against the rules below, ``docs/bench/h200-2026-11-30c/``):
      - two or more stores with heavy arithmetic (the SiLU gate's forward, storing the product and
        what its gradient reads): ping-pong 128x128 with a 2x1 cluster, 1.305 / 1.596 (the
        default); its long main loop hides one warp group's epilogue behind the other's MMAs;
      - two or more stores of 16-bit outputs, or K >= 16384: 256x128 with a 1x2 cluster and a
        128x16 epilogue tile, which keeps three main-loop stages where the default epilogue tile
        left two: 8192x11008x4096 (two loads, two bf16 stores) 1.184 / 1.393 (the narrow
        ping-pong below), the 32000-word head's dX (three float32 stores) 2.864 / 3.873; with a
        float32 store at K 4096-11008 it ranged from 3 % ahead to 18 % behind (1.158 / 1.191,
        0.455 / 0.451, 1.296 / 1.101);
      - one float32 store (the weight gradients, a residual sum): ping-pong 128x128 with a 64x16
        epilogue tile, which overlaps the wide store with the other warp group's main loop;
        11008x4096x8192 1.065 / 1.162 (128x256), 4096x11008x8192 1.005 / 1.070, 4096x4096x8192
        0.435 / 0.449, 8192x4096x4096 0.414 / 0.437.  Not past 16384: the head's weight gradient
        32000x4096x8192 took 3.470 against 128x256's 3.229.  A single bf16 store keeps 128x256;
    * short K (256..1024) over two or more waves with at most one stored output: ping-pong
      128x128 (0.049 / 0.056), with a 2x1 cluster when N >= 4096 (0.264 / 0.300); attention's
      K = 64 GEMMs kept the default.  K from 128 with no M x N operand loaded in the epilogue, and
      from 128 more for each loaded one: one warp group's epilogue then has the other's main loop
      to hide behind.  ResNet-50 (H200, 2026-12-01, ms ping-pong / cooperative): 100352x512x128
      with a plain store 0.040 / 0.049; input gradients loading two M x N operands (a residual
      gradient and a ReLU's input) at K = 256, 25088x1024 0.059 / 0.051 and 100352x512 0.115 /
      0.098, at K = 512 25088x1024 0.067 / 0.072; one loaded at K = 512, 100352x128 0.044 / 0.043.  Not with two stores: FFN1's recomputation (bias, GELU,
      dropout, stores of h and of the result) took 1.362 ms ping-pong against 0.416 ms
      cooperative (``scripts/bench_partitions.py bert_large``, H100): one warp group runs the
      whole 128x128 tile's heavy epilogue while the other waits.  Two stores of light arithmetic
      do overlap: a ViT-B/16 dX adding two residual gradients and storing the float32 sum and its
      product with a layer norm's gamma (2 loads, 2 stores, K 768; H100 2026-11-27) took 0.114
      against 0.132 ms cooperative;
    * short K over two or more waves of 128x256 tiles, N >= 3072, with two or more stores and an
      arithmetic-heavy epilogue (``alu_heavy``): 128x256.  FFN1's forward that stores gelu(x)
      and gelu'(x) (H200, 2026-11-26, ms against the plain GEMM's 0.19-0.20): BERT-Large 0.309 /
      0.321 (default), GPT-2 0.263 / 0.272, ViT-B/16 0.304 / 0.324; ping-pong lost there (0.363,
      0.273, 0.402): one warp group alone is too slow at erf and tanh to hide behind the other's
      main loop;
    * K >= 2048 over two or more waves with two or more stores, and no heavy arithmetic:
      ping-pong 128x128 with a 64x16 epilogue tile, whose memory traffic then overlaps the other
      warp group's main loop (H200, ms / default): GPT-2's FFN2 forward with the loss gradient (4
      loads, 3 stores) 0.233 / 0.343, BERT-Large's FFN1 dX (2 stores) 0.203 / 0.240, GPT-2's FFN1
      dX 0.189 / 0.204; H100 (2026-11-27, ``bench_partitions.py --sweep``): GPT-2's FFN2 forward
      0.258 / 0.347 without the narrow tile, its FFN1 dX 0.194 / 0.212;
    * with M x N loads and one store the narrow tile lost on H100 (2026-11-27, ms: ping-pong 64x16
      / cooperative 128x128 / cooperative 128x256): BERT-Large's FFN2 forward (dropout mask and
      residual) 0.240 / 0.202 / 0.192, ViT-B/16's (K 3072) 0.200 / 0.185 / 0.189 (on an H200 it had
      won, 0.194 / 0.200 and 0.170 / 0.183); those take the next rule or the default;
    * K >= 4096 over a full wave of 128x256 tiles (at most 1/16 of the SMs idle) with at most one
      stored output (and no loaded one beside heavy arithmetic: not measured): 128x256 (H100:
      0.200 / 0.233; BERT-Large's FFN weight gradients 4096x1024x16384 and 1024x4096x16384, 128
      tiles: 0.169-0.172 / 0.175-0.177 in three runs on 2026-11-27; its FFN2 forward above).

    16-bit operands only; anything else, or a choice ``prune`` or the emitter rejects, gets the
    default."""
    g = partition.gemm
    default = default_config(g.dtype_a)
    if g.dtype_a not in ("bfloat16", "float16"):
        return default
    m, n, k = g.m, g.n, g.k

    def tiles(tm, tn):
        return g.batch * math.ceil(m / tm) * math.ceil(n / tn)

    stores = sum(isinstance(node, AuxStore) for node in partition.epilogue.nodes)
    loads = sum(isinstance(node, AuxLoad) for node in partition.epilogue.nodes)
    heavy = alu_heavy(partition)
    store_bits = {BITS[node.dtype] for node in partition.epilogue.nodes if isinstance(node, AuxStore)}
    wide = g.batch == 1 and k >= 4096 and 4096 <= min(m, n) and max(m, n) <= 16384
    long_k = g.batch == 1 and k >= 4096 and k >= 4 * max(m, n)  # a weight gradient's reduction
    if g.batch > 1 and k >= MIN_SLICE and tiles(*slice_tile(m, n)[:2]) <= num_sms:
        cfg = _cfg(slice_tile(m, n))  # a batch of K slices (``k_slices``)
    elif g.batch == 1 and m >= 128 and not long_k and (narrow := narrow_configs(m, n, k, g.dtype_a)):
        _, tn, tk = narrow[0].tile
        cfg = _cfg((256 if tiles(256, tn) >= 2 * num_sms else 128, tn, tk))
    elif n <= 64 and m >= 128 and not long_k:
        cfg = _cfg((256, 64, 64) if g.batch == 1 and tiles(256, 64) >= 2 * num_sms else (128, 64, 64))
    elif g.batch == 1 and is_thin(m, n, k, num_sms) and k <= 4 * THIN_SLICE:
        cfg = _cfg((128, 64, 64) if 4 * tiles(128, 64) <= num_sms else (128, 128, 64), decomposition=SPLIT, splits=4)
    elif m <= 64 and n >= 256 and not long_k:
        cfg = _cfg((64, 256, 64), schedule=PP)
    elif long_k and tiles(128, 64) <= 8:
        cfg = _cfg((128, 64, 64), decomposition=SK)
    elif long_k and num_sms < tiles(128, 128) <= 5 * num_sms // 4:
        cfg = _cfg((128, 128, 64), decomposition=SK)
    elif long_k and 5 * num_sms // 4 < tiles(128, 128) < 3 * num_sms // 2:
        cfg = _cfg((128, 256, 64), decomposition=SK)
    elif long_k and num_sms // 2 < tiles(128, 128) <= num_sms:
        return default
    elif long_k and tiles(128, 128) <= num_sms // 2:
        cfg = _cfg((128, 128, 64), decomposition=SPLIT, splits=long_k_splits(m, n, k, num_sms))
    elif wide and heavy and stores > 1:
        cfg = _cfg((128, 128, 64), (2, 1), schedule=PP)
    elif wide and not heavy and stores > 1 and (store_bits == {16} or k >= 16384):
        cfg = _cfg((256, 128, 64), (1, 2), epi_tile=(128, 16))
    elif wide and not heavy and stores == 1 and store_bits == {32}:
        cfg = _cfg((128, 128, 64), schedule=PP, epi_tile=(64, 16))
    elif 128 * (1 + loads) <= k <= 1024 and tiles(128, 128) >= 2 * num_sms and (stores <= 1 or not heavy):
        cfg = _cfg((128, 128, 64), (2, 1) if n >= 4096 else (1, 1), schedule=PP)
    elif 256 <= k <= 1024 and n >= 3072 and tiles(128, 256) >= 2 * num_sms and heavy:
        cfg = _cfg((128, 256, 64))
    elif k >= 2048 and tiles(128, 128) >= 2 * num_sms and stores > 1 and not heavy:
        cfg = _cfg((128, 128, 64), schedule=PP, epi_tile=(64, 16))
    elif k >= 4096 and tiles(128, 256) >= num_sms - num_sms // 16 and stores <= 1 and not (loads and heavy):
        cfg = _cfg((128, 256, 64))
    else:
        return default
    if not prune([cfg], m, n, k, g.dtype_a, num_sms):
        return default
    return cfg if check_partition(partition, cfg) else default  # the emitter's rules for this epilogue


# Epilogue nodes that cost tens of instructions an element (erf, tanh, exp and the Philox rounds
# of dropout), against a few for adds, casts, compares and selects.
ALU_HEAVY_OPS = frozenset({
    OpKind.EXP, OpKind.LOG, OpKind.TANH, OpKind.ERF, OpKind.SIGMOID, OpKind.SILU, OpKind.GELU,
    OpKind.GELU_TANH, OpKind.GELU_GRAD, OpKind.GELU_TANH_GRAD, OpKind.GELU_BACKWARD,
})


def alu_heavy(partition: Partition) -> bool:
    """Whether the epilogue has a transcendental or a dropout draw per element."""
    return any(isinstance(node, Dropout) or isinstance(node, Compute) and node.op in ALU_HEAVY_OPS
               for node in partition.epilogue.nodes)


# The longest K slice of the thin rule's split-K 4 (XML-CNN's weight gradients measured it with
# slices of about 4000); a longer reduction takes the long-K rules, whose CTAs fill the SMs.
THIN_SLICE = 16384


# The shortest K slice ``k_slices`` cuts: 32 k-tiles of 64, enough main loop to hide the prologue
# and the partial's store (ResNet-50's measured slices were 3136 to 12544 long).
MIN_SLICE = 2048


def slice_tile(m: int, n: int) -> tuple[int, int, int]:
    """The CTA tile of a K-slice batch (``k_slices``): 128x64 for an output at most 64 wide, 128x256
    for at most 64 rows over more than 128 columns (the padded rows cost MMA work only: the batched
    64x256x401408 ran 0.070 ms on 128x256 tiles, 0.087 on 128x128, 0.084 on 128x64; H200,
    2026-12-01), else 128x128."""
    if n <= 64:
        return (128, 64, 64)
    if m <= 64 and n > 128:
        return (128, 256, 64)
    return (128, 128, 64)


def k_slices(m: int, n: int, k: int, dtype: str = "bfloat16", num_sms: int = H100_SMS) -> int:
    """How many K slices an M x N x K GEMM should run as: a batch of GEMMs over contiguous slices of
    K writing float32 partial products, which a reduction sums after (``SplitMatmulReduction``);
    1 keeps it one GEMM.

    For a reduction of at least 4096 (a weight gradient's, over a batch's tokens or pixels) whose
    output tiles (``slice_tile``) fill at most half a wave: the most slices, at least ``MIN_SLICE``
    long, that keep slices x tiles within one wave (a divisor of K: the slices are views).  CUTLASS's
    in-kernel split-K and stream-K pass every partial tile through a workspace under one lock per
    tile, so the tile's units queue; the batch writes its partials without waiting.  ResNet-50's
    weight gradients (H200, 2026-12-01, ms: batch + torch's sum of the partials / the in-kernel
    decomposition ``heuristic_config`` gave / cuBLAS): 64x256x401408 0.070 + 0.018 / 0.134 / 0.075,
    256x64x401408 0.065 + 0.019 / 0.147 / 0.072, 64x64x401408 0.035 + 0.017 / 0.188 / 0.037,
    128x256x401408 0.078 + 0.017 / 0.143 / 0.086, 512x128x100352 0.039 + 0.017 / 0.069 / 0.038,
    512x256x100352 0.045 + 0.018 / 0.078 / 0.047, 1024x256x25088 0.024 + 0.017 / 0.041 / 0.031,
    512x1024x25088 0.039 + 0.017 / 0.049 / 0.040, 2048x512x6272 (2 slices) 0.024 + 0.018 / 0.035
    (0.026 stream-K) / 0.030, the 7x7 stem's 64x152x1605632 0.240 + 0.017 (128x128 tiles) / 0.453 /
    0.189 (``docs/bench/h200-2026-12-01b/wgrad-sweep``; torch's sum of the partials took 17-19 us
    whatever their size, the TVM sums of the step 1-5 us).  In the step the sum is a TVM kernel of
    its own (TVM fuses no elementwise reader into a reduction).  A thin output over a K up to ``4 * THIN_SLICE`` keeps the in-kernel split-K 4 measured
    for it (``heuristic_config``)."""
    if dtype not in ("bfloat16", "float16"):
        return 1
    if k < 4096 or is_thin(m, n, k, num_sms) and k <= 4 * THIN_SLICE:
        return 1
    tm, tn, _ = slice_tile(m, n)
    tiles = math.ceil(m / tm) * math.ceil(n / tn)
    fits = [s for s in range(2, num_sms // tiles + 1) if k % s == 0 and k // s >= MIN_SLICE and (k // s) % 8 == 0]
    return max(fits, default=1)


def long_k_splits(m: int, n: int, k: int, num_sms: int = H100_SMS) -> int:
    """Split-K pieces for a long-K problem: enough 128x128 tile slices to fill the SMs, each at
    least 4096 long, and at least 2."""
    tiles = math.ceil(m / 128) * math.ceil(n / 128)
    return max(2, min(num_sms // tiles, k // 4096))


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


# ------------------------------------------------------------------------------------ partitions
def plain_partition(partition: Partition, symbol: str | None = None) -> Partition:
    """The partition's GEMM with the epilogue reduced to the D store (same operands and layout)."""
    g = partition.gemm
    acc = next(n for n in partition.epilogue.nodes if isinstance(n, AccFetch))
    shape = (*partition.batch_shape, g.m, g.n)
    plain = Partition(
        symbol=symbol or f"{partition.symbol}_plain",
        params=(partition.params[g.a_param], partition.params[g.b_param]),
        outputs=(TensorDesc(shape, acc.dtype),),
        batch_shape=partition.batch_shape,
        gemm=dataclasses.replace(g, a_param=0, b_param=1),
        epilogue=EpilogueGraph((AccFetch(dtype=acc.dtype), AuxStore(inputs=(0,), dtype=acc.dtype, output=0))),
        d_output=0,
    )
    return lower(plain)


def signature(partition: Partition) -> str:
    """Hash of what a kernel computes, independent of its symbol and configuration."""
    lowered = partition if partition.visitor is not None else lower(partition)
    anon = dataclasses.replace(lowered, symbol="evt_signature")
    source = emit(anon, default_config(lowered.gemm.dtype_a))
    return hashlib.sha256(source.encode()).hexdigest()[:24]


def rank(timings: Mapping[KernelConfig, float]) -> list[KernelConfig]:
    """Fastest first; equal (or non-finite) times keep table order, so the choice is deterministic."""
    order = {c: i for i, c in enumerate(CANDIDATES)}

    def key(cfg):
        t = timings[cfg]
        return (t if math.isfinite(t) else math.inf, order.get(cfg, len(order)), cfg.name)

    return sorted((c for c in timings if math.isfinite(timings[c])), key=key)


# ----------------------------------------------------------------------------------- the cache
def cache_path() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "tvm_evt" / f"select-v{CODEGEN_VERSION}.json"


def entry_key(sig: str, gpu: str) -> str:
    return f"{sig}|{gpu}|{CODEGEN_VERSION}"


class SelectionCache:
    """The persisted choices: one JSON object, read-merged-written atomically under a lock."""

    def __init__(self, path: Path | None = None):
        self.path = Path(path) if path else cache_path()

    def load(self) -> dict:
        try:
            data = json.loads(self.path.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return {}
        return data if isinstance(data, dict) else {}

    def get(self, sig: str, gpu: str) -> KernelConfig | None:
        entry = self.load().get(entry_key(sig, gpu))
        if not entry:
            return None
        try:
            return KernelConfig.from_json(entry["config"])
        except (KeyError, ValueError, TypeError):
            return None  # written by another codegen revision: ignore

    def put(self, sig: str, gpu: str, config: KernelConfig, timings_ms: Mapping[KernelConfig, float] = (),
            note: str = "") -> None:
        entry = {
            "config": config.to_json(),
            "name": config.name,
            "gpu": gpu,
            "codegen": CODEGEN_VERSION,
            "timings_ms": {c.name: t for c, t in dict(timings_ms).items() if math.isfinite(t)},
            "note": note,
        }
        with file_lock(self.path.with_suffix(".lock")):
            data = self.load()
            data[entry_key(sig, gpu)] = entry
            atomic_write(self.path, json.dumps(data, indent=1, sort_keys=True).encode())


def gpu_name() -> str | None:
    """The name of CUDA device 0 (``TVM_EVT_SELECT_GPU`` overrides it, for cross-compiling)."""
    forced = os.environ.get("TVM_EVT_SELECT_GPU")
    if forced:
        return forced
    try:
        import tvm

        dev = tvm.cuda(0)
        return str(dev.device_name) if dev.exist else None
    except Exception:  # no CUDA runtime in this TVM build
        return None


def lookup(partition: Partition, gpu: str | None = None, cache: SelectionCache | None = None) -> KernelConfig | None:
    gpu = gpu or gpu_name()
    if gpu is None:
        return None
    return (cache or SelectionCache()).get(signature(partition), gpu)


def select_config(partition: Partition, gpu: str | None = None, cache: SelectionCache | None = None) -> KernelConfig:
    """The persisted choice for this partition on this GPU, else ``heuristic_config``."""
    return lookup(partition, gpu, cache) or heuristic_config(partition)


# ------------------------------------------------------------------------------------ profiling
Measure = Callable[[dict[str, tuple[Partition, KernelConfig]]], dict[str, float]]


@dataclasses.dataclass
class Choice:
    config: KernelConfig
    time_ms: float
    mainloop_ms: dict[KernelConfig, float]  # plain GEMM timings (stage 1)
    fused_ms: dict[KernelConfig, float]  # the partition's own epilogue (stage 2)


def tune(partitions: Iterable[Partition], measure: Measure, gpu: str, space: str = "default",
         top_k: int = 2, cache: SelectionCache | None = None, num_sms: int = H100_SMS,
         plain_ms: dict[str, dict[KernelConfig, float]] | None = None,
         include_default: bool = True, epilogue_tiles: bool = True) -> dict[str, Choice]:
    """Choose and persist a configuration for each partition (keyed by its symbol).

    ``measure({name: (partition, config)})`` builds and times kernels, returning milliseconds
    (``inf`` for a kernel that failed to build or verify).  Stage 1 times each distinct plain GEMM
    on every candidate; stage 2 times each partition on its ``top_k`` main-loop configurations
    (plus the default and ``heuristic_config``'s choice when ``include_default``, so a tuned
    build is never slower than an untuned one), and with ``epilogue_tiles`` each of those again
    with a narrow epilogue subtile (``epilogue_variant``), and a partition with float32 row/column
    sums each again with atomic sums (``reduction_variant``); a partition none of whose kernels ran
    gets no choice.  ``plain_ms`` (plain signature -> timings) is filled in for the caller.
    """
    cache = cache or SelectionCache()
    partitions = [p if p.visitor is not None else lower(p) for p in partitions]
    plain_ms = {} if plain_ms is None else plain_ms
    # stage 1: the main loop, on the plain GEMM (shared by partitions with the same operands)
    plains: dict[str, dict[str, KernelConfig]] = {}  # plain signature -> job name -> config
    jobs = {}
    for p in partitions:
        plain = plain_partition(p, symbol=f"evt_plain_{p.symbol}")
        sig = signature(plain)
        if sig in plain_ms or sig in plains:
            continue
        plains[sig] = {}
        for cfg in candidates(p, space, num_sms):
            name = f"{plain.symbol}__{cfg.name}"
            plains[sig][name] = cfg
            jobs[name] = (dataclasses.replace(plain, symbol=name), cfg)
    times = measure(jobs) if jobs else {}
    for sig, named in plains.items():
        plain_ms[sig] = {cfg: times.get(name, math.inf) for name, cfg in named.items()}
    # stage 2: the best few main loops with the partition's epilogue
    jobs, picks, plain_jobs = {}, {}, {}
    for p in partitions:
        mainloop = plain_ms[signature(plain_partition(p))]
        if signature(p) == signature(plain_partition(p)):  # a plain GEMM: stage 1 decided
            plain_jobs[p.symbol] = mainloop
            continue
        best = rank(mainloop)[:top_k]
        default = default_config(p.gemm.dtype_a)
        if include_default or not best:
            # and the shape heuristic's choice, what an untuned build would run: an epilogue can
            # reorder main loops (ping-pong hides loads and stores that the plain GEMM lacks)
            best = [*best, default, heuristic_config(p, num_sms)]
        picks[p.symbol] = list(dict.fromkeys(best))
        if epilogue_tiles:
            picks[p.symbol] += [epilogue_variant(c) for c in picks[p.symbol] if c.epi_tile is None]
        picks[p.symbol] += [v for v in (reduction_variant(p, c) for c in picks[p.symbol]) if v is not None]
        # a configuration whose epilogue leaves the main loop < 2 stages cannot build: not timed
        fitting = [c for c in picks[p.symbol] if smem.usage(p, c).fits]
        fallback = smem.fit_config(p, default)
        picks[p.symbol] = fitting or ([fallback] if fallback is not None else [])
        for cfg in picks[p.symbol]:
            jobs[f"{p.symbol}__{cfg.name}"] = (dataclasses.replace(p, symbol=f"{p.symbol}__{cfg.name}"), cfg)
    times = measure(jobs) if jobs else {}
    choices = {}
    for p in partitions:
        if p.symbol in plain_jobs:
            fused = plain_jobs[p.symbol]
        else:
            fused = {cfg: times.get(f"{p.symbol}__{cfg.name}", math.inf) for cfg in picks[p.symbol]}
        ranked = rank(fused)
        if not ranked:  # nothing built and ran correctly: no choice (the caller reports it)
            continue
        choice = Choice(ranked[0], fused[ranked[0]], plain_ms[signature(plain_partition(p))], fused)
        cache.put(signature(p), gpu, choice.config, fused, note=f"{p.symbol} {p.gemm.layout_name} "
                  f"M={p.gemm.m} N={p.gemm.n} K={p.gemm.k}")
        choices[p.symbol] = choice
    return choices

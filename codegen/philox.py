"""Counter-based dropout masks: the exact Philox4x32-10 convention the epilogue implements.

It is the convention of the training graph's ``LowerDropout`` (relax_passes/training/philox.py), so a GEMM
epilogue regenerates exactly the mask the graph's other dropout sites and backward pass use.
Element ``(l, m, n)`` of an ``L x M x N`` epilogue value (``l`` the flattened batch index; the
indices are logical, independent of memory layout) has the row-major index

    i = (l * M + m) * N + n                                     (a uint64)

and takes 16 bits of one Philox4x32-10 draw (Salmon et al., SC'11; Random123 constants), so
eight consecutive elements share a draw:

    key     = (seed[0], seed[1])                                (the uint32[2] ``rng_seed`` tensor)
    counter = (lo32(i div 8), hi32(i div 8), site, 0)           (``site`` numbers the dropout op)
    u       = (word ((i mod 8) div 2) >> (16 * (i mod 2))) & 0xFFFF

Ten rounds; before every round but the first the key is bumped by (0x9E3779B9, 0xBB67AE85); one
round maps (c0, c1, c2, c3) with ``hi0:lo0 = 0xD2511F53 * c0`` and ``hi1:lo1 = 0xCD9E8D57 * c2``
to ``(hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0)``.  Then

    keep = u >= round(p * 2**16)                  (kept with probability 1 - p, to 2^-17)
    y    = keep ? x * scale : 0                   scale = float32(1 / (1 - p)); y = 0 if p >= 1

One draw per eight elements (not one per element) is what makes the mask cheap: the Philox rounds
are 20 integer multiplies a draw, and where a kernel draws a mask (the flash-attention forward,
``LowerDropout``'s mask kernel) they bound its speed.  16 bits a draw (FlashAttention's 8 would
round p = 0.1 to 26/256) keep the rate within 2^-17 of p.  A Hopper GEMM epilogue holds adjacent
columns in pairs, so it draws once per pair.  ``philox4x32_10`` and ``dropout_keep`` below are the
numpy reference that tests check the device code (``backend/templates.py``:
``tvm_evt::philox_draw``, ``backend/flash_templates.py``, ``relax_passes/training/philox.py``) against.
"""
from __future__ import annotations

import numpy as np

PHILOX_M0 = 0xD2511F53
PHILOX_M1 = 0xCD9E8D57
PHILOX_W0 = 0x9E3779B9
PHILOX_W1 = 0xBB67AE85
ROUNDS = 10

_MASK32 = np.uint64(0xFFFFFFFF)


def _mulhilo(a: int, b: np.ndarray):
    prod = np.uint64(a) * b.astype(np.uint64)
    return (prod >> np.uint64(32)).astype(np.uint64), (prod & _MASK32).astype(np.uint64)


def philox4x32_10(counter, key):
    """Philox4x32-10 of ``counter`` (4 uint32 arrays) under ``key`` (2 uint32 scalars/arrays)."""
    c0, c1, c2, c3 = (np.asarray(c, dtype=np.uint64) & _MASK32 for c in counter)
    k0, k1 = (np.asarray(k, dtype=np.uint64) & _MASK32 for k in key)
    for r in range(ROUNDS):
        if r:
            k0 = (k0 + np.uint64(PHILOX_W0)) & _MASK32
            k1 = (k1 + np.uint64(PHILOX_W1)) & _MASK32
        hi0, lo0 = _mulhilo(PHILOX_M0, c0)
        hi1, lo1 = _mulhilo(PHILOX_M1, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return tuple(c.astype(np.uint32) for c in (c0, c1, c2, c3))


PER_DRAW = 8  # elements a draw: 16 bits each of its four 32-bit words
BITS = 16


def keep_threshold(p: float) -> int:
    return int(round(p * (1 << BITS)))


def uniform16(index: np.ndarray, seed: tuple[int, int], site: int) -> np.ndarray:
    """The 16 random bits of element ``index``: bits 16 (i mod 2).. of word (i mod 8) div 2 of
    draw i div 8."""
    i = np.asarray(index, dtype=np.uint64)
    draw = i // np.uint64(PER_DRAW)
    words = philox4x32_10(
        (draw & _MASK32, draw >> np.uint64(32), np.uint64(site), np.uint64(0)), (seed[0], seed[1])
    )
    lane = i % np.uint64(PER_DRAW)
    word = np.choose((lane >> np.uint64(1)).astype(np.intp), words).astype(np.uint32)
    return (word >> (np.uint32(BITS) * (lane & np.uint64(1)).astype(np.uint32))) & np.uint32(0xFFFF)


def keep(index: np.ndarray, seed: tuple[int, int], site: int, p: float) -> np.ndarray:
    """Whether element ``index`` is kept at dropout rate ``p``."""
    return uniform16(index, seed, site) >= np.uint32(keep_threshold(p))


def dropout_keep(shape_lmn: tuple[int, int, int], seed: tuple[int, int], site: int, p: float) -> np.ndarray:
    """Boolean keep mask of shape (L, M, N)."""
    L, M, N = shape_lmn
    index = np.arange(L * M * N, dtype=np.uint64).reshape(L, M, N)
    return keep(index, seed, site, p)


def dropout_scale(p: float) -> np.float32:
    return np.float32(0.0) if p >= 1.0 else np.float32(1.0) / (np.float32(1.0) - np.float32(p))

"""Counter-based dropout masks: the exact Philox4x32-10 convention the epilogue implements.

Element ``(l, m, n)`` of an ``L x M x N`` epilogue value (``l`` the flattened batch index, all
indices logical, independent of memory layout) has the linear index

    i = (l * M + m) * N + n                                     (a uint64)

and draws from Philox4x32-10 (Salmon et al., SC'11; Random123 constants) with

    counter = (lo32(i), hi32(i), lo32(offset), hi32(offset))    (uint32 x 4)
    key     = (lo32(seed), hi32(seed))                          (uint32 x 2)

where ``seed`` and ``offset`` are the int64 values of the dropout node's two scalar tensors
(reinterpreted as uint64).  Ten rounds; before every round but the first the key is bumped by
(0x9E3779B9, 0xBB67AE85); one round maps (c0, c1, c2, c3) with
``hi0:lo0 = 0xD2511F53 * c0`` and ``hi1:lo1 = 0xCD9E8D57 * c2`` to
``(hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0)``.  Only output word 0 (``r0``) is used:

    u    = (r0 >> 8) * 2**-24                                   (exact in float32, u in [0, 1))
    keep = u >= p
    y    = keep ? x * (1 / (1 - p)) : 0       with 1 / (1 - p) rounded to float32; y = 0 if p >= 1

A training graph reproduces the mask of a forward epilogue in its backward pass by calling the
same convention with the same (seed, offset); ``philox4x32_10`` and ``dropout_keep`` below are the
reference implementation (numpy, vectorised) that tests check the device code against.
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


def uniform(index: np.ndarray, seed: int, offset: int) -> np.ndarray:
    """The float32 uniform in [0, 1) drawn for linear element ``index`` (see module docstring)."""
    i = np.asarray(index, dtype=np.uint64)
    seed, offset = np.uint64(seed & 0xFFFFFFFFFFFFFFFF), np.uint64(offset & 0xFFFFFFFFFFFFFFFF)
    r0, _, _, _ = philox4x32_10(
        (i & _MASK32, i >> np.uint64(32), offset & _MASK32, offset >> np.uint64(32)),
        (seed & _MASK32, seed >> np.uint64(32)),
    )
    return (r0 >> np.uint32(8)).astype(np.float32) * np.float32(2.0**-24)


def dropout_keep(shape_lmn: tuple[int, int, int], seed: int, offset: int, p: float) -> np.ndarray:
    """Boolean keep mask of shape (L, M, N)."""
    L, M, N = shape_lmn
    index = np.arange(L * M * N, dtype=np.uint64).reshape(L, M, N)
    return uniform(index, seed, offset) >= np.float32(p)


def dropout_scale(p: float) -> np.float32:
    return np.float32(0.0) if p >= 1.0 else np.float32(1.0) / (np.float32(1.0) - np.float32(p))

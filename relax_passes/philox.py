"""Counter-based Philox4x32-10 random numbers, as TIR and as a numpy reference.

Convention (shared by every dropout site of a training graph, and by any kernel that
regenerates a mask, e.g. an EVT epilogue):

* key     = (seed[0], seed[1]), the step's 64-bit seed as two uint32 words;
* counter = (i mod 2^32, i div 2^32, site, 0), where ``i`` is the row-major element index
  of the tensor being masked and ``site`` numbers the dropout op in the graph;
* word 0 of Philox4x32-10(counter, key) decides: keep iff ``(word0 >> 8) >= round(p * 2^24)``,
  so an element is kept with probability 1 - p (to 2^-24);
* kept elements are scaled by 1 / (1 - p) (by the graph, not by the mask kernel).

Because the mask is a pure function of (seed, site, index), forward and backward (and any
recomputation) see the same mask without storing it.
"""

from __future__ import annotations

import numpy as np
from tvm import te, tirx

PHILOX_M0, PHILOX_M1 = 0xD2511F53, 0xCD9E8D57
PHILOX_W0, PHILOX_W1 = 0x9E3779B9, 0xBB67AE85
ROUNDS = 10


def keep_threshold(rate: float) -> int:
    """The 24-bit threshold below which an element is dropped."""
    return int(round(rate * (1 << 24)))


def _u32(value: int):
    return tirx.const(value, "uint32")


def _mulhilo(a, m: int):
    prod = tirx.Cast("uint64", a) * tirx.const(m, "uint64")
    # mask before narrowing: the analyzer rejects casts whose bound exceeds uint32
    lo = tirx.Cast("uint32", prod & tirx.const(0xFFFFFFFF, "uint64"))
    hi = tirx.Cast("uint32", prod >> tirx.const(32, "uint64"))
    return hi, lo


def philox_word0(counter, key):
    """TIR expression of word 0 of Philox4x32-10, rounds bound with Let (linear size)."""
    lets = []

    def bind(name, value):
        var = tirx.Var(name, "uint32")
        lets.append((var, value))
        return var

    c, (k0, k1) = list(counter), key
    for r in range(ROUNDS):
        hi0, lo0 = _mulhilo(c[0], PHILOX_M0)
        hi1, lo1 = _mulhilo(c[2], PHILOX_M1)
        c = [bind(f"x{r}", hi1 ^ c[1] ^ k0), bind(f"y{r}", lo1), bind(f"z{r}", hi0 ^ c[3] ^ k1), lo0]
        if r < ROUNDS - 1:
            c[3] = bind(f"w{r}", c[3])
            k0, k1 = bind(f"ka{r}", k0 + _u32(PHILOX_W0)), bind(f"kb{r}", k1 + _u32(PHILOX_W1))
    return c[0], lets


def dropout_keep_primfunc(shape, rate: float):
    """PrimFunc (seed: uint32[2], site: uint32[], keep: bool[*shape]) by the convention above.

    The mask is produced in the tensor's own shape (element index = row-major linear index),
    so no reshape sits between the RNG kernel and its consumers for FuseTIR to trip over."""
    shape = [int(s) for s in shape]
    seed = te.placeholder((2,), "uint32", name="seed")
    site = te.placeholder((), "uint32", name="site")
    threshold = keep_threshold(rate)
    strides = [1] * len(shape)
    for k in range(len(shape) - 2, -1, -1):
        strides[k] = strides[k + 1] * shape[k + 1]

    def element(*index):
        idx = tirx.const(0, "uint64")
        for i, stride in zip(index, strides):
            idx = idx + tirx.Cast("uint64", i) * tirx.const(stride, "uint64")
        counter = [
            tirx.Cast("uint32", idx & tirx.const(0xFFFFFFFF, "uint64")),
            tirx.Cast("uint32", idx >> tirx.const(32, "uint64")),
            site[()],
            _u32(0),
        ]
        word, lets = philox_word0(counter, (seed[0], seed[1]))
        body = (word >> _u32(8)) >= _u32(threshold)
        for var, value in reversed(lets):
            body = tirx.Let(var, value, body)
        return body

    keep = te.compute(shape, element, name="dropout_keep")
    return te.create_prim_func([seed, site, keep])


def philox_numpy(counter, key) -> list[int]:
    """Reference Philox4x32-10 on python ints (Random123 known answer: counter=key=0 gives
    0x6627e8d5 0xe169c58d 0xbc57ac4c 0x9b00dbd8)."""
    c, (k0, k1), m32 = [int(x) for x in counter], (int(key[0]), int(key[1])), 0xFFFFFFFF
    for _ in range(ROUNDS):
        p0, p1 = c[0] * PHILOX_M0, c[2] * PHILOX_M1
        c = [((p1 >> 32) ^ c[1] ^ k0) & m32, p1 & m32, ((p0 >> 32) ^ c[3] ^ k1) & m32, p0 & m32]
        k0, k1 = (k0 + PHILOX_W0) & m32, (k1 + PHILOX_W1) & m32
    return c


def dropout_keep_numpy(numel: int, seed: tuple[int, int], site: int, rate: float) -> np.ndarray:
    """Boolean keep mask by the convention above (slow; for tests)."""
    thr = keep_threshold(rate)
    words = [philox_numpy((i & 0xFFFFFFFF, i >> 32, site, 0), seed)[0] for i in range(numel)]
    return (np.array(words, dtype=np.uint64) >> 8) >= thr

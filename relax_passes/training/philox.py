"""Counter-based Philox4x32-10 random numbers, as TIR and as a numpy reference.

Convention (shared by every dropout site of a training graph, and by any kernel that
regenerates a mask, e.g. an EVT epilogue):

* key     = (seed[0], seed[1]), the step's 64-bit seed as two uint32 words;
* element ``i`` (the row-major element index of the tensor being masked) takes the 16 bits
  ``u = word[(i mod 8) div 2] >> 16 (i mod 2)`` of the Philox4x32-10 draw with counter
  (d mod 2^32, d div 2^32, site, 0), d = i div 8, where ``site`` numbers the dropout op in the
  graph: eight consecutive elements share one draw;
* keep iff ``u >= round(p * 2^16)``, so an element is kept with probability 1 - p (to 2^-17);
* kept elements are scaled by 1 / (1 - p) (by the graph, not by the mask kernel).

Because the mask is a pure function of (seed, site, index), forward and backward (and any
recomputation) see the same mask without storing it.  The numpy reference is
``tvm_evt.codegen.philox`` (the GEMM epilogue implements the same convention).
"""

from __future__ import annotations

import math

import numpy as np
import tvm
from tvm import te, tirx
from tvm.script import tirx as T

from ...codegen import philox as codegen_philox
from ...codegen.philox import BITS, PER_DRAW, PHILOX_M0, PHILOX_M1, PHILOX_W0, PHILOX_W1, ROUNDS, keep_threshold


KEEP_RATE_ATTR = "tvm_evt.dropout_keep"  # a keep-mask PrimFunc's dropout rate
KEEP_SHAPE_ATTR = "tvm_evt.dropout_shape"  # and its mask shape


def _u32(value: int):
    return tirx.const(value, "uint32")


def _mulhilo(a, m: int):
    prod = tirx.Cast("uint64", a) * tirx.const(m, "uint64")
    # mask before narrowing: the analyzer rejects casts whose bound exceeds uint32
    lo = tirx.Cast("uint32", prod & tirx.const(0xFFFFFFFF, "uint64"))
    hi = tirx.Cast("uint32", prod >> tirx.const(32, "uint64"))
    return hi, lo


def philox_words(counter, key):
    """TIR expressions of the four words of Philox4x32-10, rounds bound with Let (linear size)."""
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
    return c, lets


def dropout_keep_primfunc(shape, rate: float):
    """PrimFunc (seed: uint32[2], site: uint32[], keep: bool[*shape]) by the convention above.

    The mask is produced in the tensor's own shape (element index = row-major linear index),
    so no reshape sits between the RNG kernel and its consumers for FuseTIR to trip over.  Each
    element evaluates its whole draw; the function is tagged ``tvm_evt.dropout_keep`` (the rate)
    and ``tvm_evt.dropout_shape`` so that the CUDA build swaps in ``dropout_keep_gpu_primfunc``."""
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
        draw = idx >> tirx.const(3, "uint64")
        counter = [
            tirx.Cast("uint32", draw & tirx.const(0xFFFFFFFF, "uint64")),
            tirx.Cast("uint32", draw >> tirx.const(32, "uint64")),
            site[()],
            _u32(0),
        ]
        words, lets = philox_words(counter, (seed[0], seed[1]))
        lane = tirx.Cast("uint32", idx & tirx.const(PER_DRAW - 1, "uint64"))
        j = lane >> _u32(1)
        word = tirx.Select(j == _u32(0), words[0], tirx.Select(j == _u32(1), words[1],
                           tirx.Select(j == _u32(2), words[2], words[3])))
        u = (word >> ((lane & _u32(1)) * _u32(BITS))) & _u32(0xFFFF)
        body = u >= _u32(threshold)
        for var, value in reversed(lets):
            body = tirx.Let(var, value, body)
        return body

    # int64 extents, as LegalizeOps gives its consumers: FuseTIR requires a fused group's
    # buffers of one Relax var to agree (int32 extents failed for ViT's embedding dropout)
    keep = te.compute([tirx.IntImm("int64", e) for e in shape], element, name="dropout_keep")
    func = te.create_prim_func([seed, site, keep])
    func = func.with_attr(KEEP_RATE_ATTR, tvm.runtime.convert(float(rate)))
    return func.with_attr(KEEP_SHAPE_ATTR, tvm.runtime.convert(shape))


THREADS = 256
U32, BOOL = "uint32", "bool"


def dropout_keep_gpu_primfunc(shape, rate: float):
    """``dropout_keep_primfunc`` scheduled for CUDA: one thread per Philox draw writes eight
    consecutive mask elements (the tail of a tensor whose size is not a multiple of 8 is
    guarded), an eighth of the integer work of one draw per element.

    CUDA only: the same loop built by LLVM for x86 returned wrong masks (with and without
    ``tirx.noalias``, depending on the loop's size), so the CPU keeps the per-element form."""
    shape = tuple(int(s) for s in shape)
    numel = math.prod(shape)
    draws = (numel + PER_DRAW - 1) // PER_DRAW
    idx = "int64" if numel >= 2**31 - PER_DRAW * THREADS else "int32"
    threshold = keep_threshold(rate)
    blocks, threads = (draws + THREADS - 1) // THREADS, THREADS
    m0, m1, w0, w1, mask32 = PHILOX_M0, PHILOX_M1, PHILOX_W0, PHILOX_W1, 0xFFFFFFFF

    @T.prim_func(private=True)
    def dropout_keep(seed: T.Buffer((2,), U32), site: T.Buffer((), U32), keep: T.Buffer(shape, BOOL)):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True})
        flat = T.decl_buffer((numel,), "bool", data=keep.data)
        for bx in T.thread_binding(T.Cast(idx, blocks), thread="blockIdx.x"):
            for tx in T.thread_binding(T.Cast(idx, threads), thread="threadIdx.x"):
                d = bx * threads + tx
                if d < draws:
                    c = T.alloc_buffer((6,), "uint32", scope="local")  # counter c0..c3, key k0, k1
                    prod = T.alloc_buffer((2,), "uint64", scope="local")  # the two 32x32 -> 64-bit products
                    c[0] = T.Cast("uint32", T.Cast("uint64", d) & T.uint64(mask32))
                    c[1] = T.Cast("uint32", T.Cast("uint64", d) >> T.uint64(32))
                    c[2] = site[()]
                    c[3] = T.uint32(0)
                    c[4] = seed[0]
                    c[5] = seed[1]
                    for _r in T.unroll(ROUNDS):
                        prod[0] = T.Cast("uint64", c[0]) * T.uint64(m0)
                        prod[1] = T.Cast("uint64", c[2]) * T.uint64(m1)
                        c[0] = T.Cast("uint32", prod[1] >> T.uint64(32)) ^ c[1] ^ c[4]
                        c[1] = T.Cast("uint32", prod[1] & T.uint64(mask32))
                        c[2] = T.Cast("uint32", prod[0] >> T.uint64(32)) ^ c[3] ^ c[5]
                        c[3] = T.Cast("uint32", prod[0] & T.uint64(mask32))
                        c[4] = c[4] + T.uint32(w0)  # the bump after the last round is unused
                        c[5] = c[5] + T.uint32(w1)
                    for j in T.unroll(PER_DRAW):
                        if d * PER_DRAW + j < numel:
                            flat[d * PER_DRAW + j] = ((c[j // 2] >> T.uint32(BITS * (j % 2))) & T.uint32(0xFFFF)) >= T.uint32(threshold)

    return dropout_keep


def gpu_variant(func):
    """The thread-bound form of a ``dropout_keep_primfunc`` (one tagged ``KEEP_RATE_ATTR``)."""
    shape = [int(x) for x in func.attrs[KEEP_SHAPE_ATTR]]
    return dropout_keep_gpu_primfunc(shape, float(func.attrs[KEEP_RATE_ATTR]))


def dropout_keep_numpy(numel: int, seed: tuple[int, int], site: int, rate: float) -> np.ndarray:
    """Boolean keep mask of ``numel`` elements by the convention above."""
    return codegen_philox.dropout_keep((1, 1, numel), seed, site, rate).reshape(numel)

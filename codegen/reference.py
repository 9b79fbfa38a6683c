"""Numpy interpreter of a partition: the semantics the emitted kernel must reproduce.

Every node is evaluated in float64 and rounded to its dtype, as the kernel's compute nodes convert
their fp32 result to their output type; the GEMM is exact (float64) and rounded to the
accumulator's dtype.  Works before and after layout elimination, so passes can be checked by
running both graphs.
"""
from __future__ import annotations

import math

import ml_dtypes
import numpy as np
from scipy.special import erf

from . import philox
from .ir import (
    AccFetch,
    AuxLoad,
    AuxStore,
    ColBroadcast,
    Compute,
    Dropout,
    OpKind,
    Partition,
    Permute,
    Reduction,
    ReduceAxis,
    ReduceFn,
    Reshape,
    RowBroadcast,
    ScalarBroadcast,
    TensorInput,
)

NP_DTYPES = {
    "float16": np.float16,
    "float32": np.float32,
    "float64": np.float64,
    "bfloat16": ml_dtypes.bfloat16,
    "bool": np.bool_,
    "int64": np.int64,
    "int32": np.int32,
    "uint8": np.uint8,
}


def round_to(x: np.ndarray, dtype: str) -> np.ndarray:
    """Round float64 values to ``dtype`` and return them as float64 again."""
    if dtype == "bool":
        return (np.asarray(x) != 0).astype(np.float64)
    return np.asarray(x, dtype=np.float64).astype(NP_DTYPES[dtype]).astype(np.float64)


def _strided(flat: np.ndarray, shape, strides) -> np.ndarray:
    item = flat.itemsize
    return np.lib.stride_tricks.as_strided(flat, shape=shape, strides=[s * item for s in strides])


def _gelu(x):
    return 0.5 * x * (1.0 + erf(x / math.sqrt(2.0)))


def _gelu_grad(x):
    return 0.5 * (1.0 + erf(x / math.sqrt(2.0))) + x * np.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)


_TANH_C, _TANH_A = math.sqrt(2.0 / math.pi), 0.044715


def _gelu_tanh_grad(x):
    t = np.tanh(_TANH_C * (x + _TANH_A * x**3))
    return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * _TANH_C * (1.0 + 3.0 * _TANH_A * x * x)


def _sigmoid(x):
    with np.errstate(over="ignore"):
        return 1.0 / (1.0 + np.exp(-x))


UNARY = {
    OpKind.NEG: lambda x: -x,
    OpKind.EXP: np.exp,
    OpKind.LOG: np.log,
    OpKind.TANH: np.tanh,
    OpKind.ERF: erf,
    OpKind.SIGMOID: _sigmoid,
    OpKind.RELU: lambda x: np.maximum(x, 0.0),
    OpKind.GELU: _gelu,
    OpKind.GELU_TANH: lambda x: 0.5 * x * (1.0 + np.tanh(_TANH_C * (x + _TANH_A * x**3))),
    OpKind.GELU_GRAD: _gelu_grad,
    OpKind.GELU_TANH_GRAD: _gelu_tanh_grad,
    OpKind.SILU: lambda x: x * _sigmoid(x),
    OpKind.CAST: lambda x: x,
}

BINARY = {
    OpKind.ADD: np.add,
    OpKind.SUB: np.subtract,
    OpKind.MUL: np.multiply,
    OpKind.DIV: np.divide,
    OpKind.MAX: np.maximum,
    OpKind.MIN: np.minimum,
    OpKind.RELU_BACKWARD: lambda g, x: np.where(x > 0, g, 0.0),
    OpKind.GELU_BACKWARD: lambda g, x: g * _gelu_grad(x),
    OpKind.GT: lambda a, b: (a > b).astype(np.float64),
    OpKind.GE: lambda a, b: (a >= b).astype(np.float64),
    OpKind.LT: lambda a, b: (a < b).astype(np.float64),
    OpKind.LE: lambda a, b: (a <= b).astype(np.float64),
    OpKind.EQ: lambda a, b: (a == b).astype(np.float64),
    OpKind.NE: lambda a, b: (a != b).astype(np.float64),
    OpKind.AND: lambda a, b: np.logical_and(a != 0, b != 0).astype(np.float64),
    OpKind.OR: lambda a, b: np.logical_or(a != 0, b != 0).astype(np.float64),
}


def gemm(p: Partition, params) -> np.ndarray:
    """The exact (float64) product, shape ``batch_shape + (M, N)``."""
    g = p.gemm
    a = np.ascontiguousarray(params[g.a_param]).astype(np.float64).reshape(-1)
    b = np.ascontiguousarray(params[g.b_param]).astype(np.float64).reshape(-1)
    am, ak, al = g.a_stride
    bn, bk, bl = g.b_stride
    A = _strided(a, (g.batch, g.m, g.k), (al, am, ak))
    B = _strided(b, (g.batch, g.k, g.n), (bl, bk, bn))
    return np.matmul(A, B).reshape(tuple(p.batch_shape) + (g.m, g.n))


def _load(p: Partition, node, params) -> np.ndarray:
    flat = np.ascontiguousarray(params[node.param]).astype(np.float64).reshape(-1)
    sm, sn, sl = node.stride
    g = p.gemm
    full = _strided(flat, (g.batch, g.m, g.n), (sl, sm, sn))
    return full.reshape(tuple(p.batch_shape) + (g.m, g.n))


def _reduce(x: np.ndarray, node: Reduction) -> np.ndarray:
    axes = {ReduceAxis.ROW: (-2,), ReduceAxis.COL: (-1,), ReduceAxis.SCALAR: (-2, -1)}[node.axis]
    fn = np.sum if node.fn is ReduceFn.SUM else np.max
    return fn(x, axis=axes)


def evaluate(p: Partition, params) -> list[np.ndarray]:
    """Run the partition on numpy ``params``; returns its outputs (in their dtypes)."""
    values: list[np.ndarray] = []
    outputs: dict[int, np.ndarray] = {}
    tile = tuple(p.batch_shape) + (p.gemm.m, p.gemm.n)  # stores write the tile; outputs view it
    for node in p.epilogue.nodes:
        ins = [values[j] for j in node.inputs]
        if isinstance(node, AccFetch):
            v = gemm(p, params)
        elif isinstance(node, TensorInput):
            v = np.asarray(params[node.param]).astype(np.float64)
        elif isinstance(node, Permute):
            v = np.transpose(ins[0], node.axes)
        elif isinstance(node, Reshape):
            v = ins[0].reshape(node.new_shape)
        elif isinstance(node, (AuxLoad, RowBroadcast, ColBroadcast)):
            v = _load(p, node, params)
        elif isinstance(node, ScalarBroadcast):
            v = np.float64(node.value) if node.param is None else _load(p, node, params)
        elif isinstance(node, Compute):
            with np.errstate(all="ignore"):
                if node.op is OpKind.WHERE:
                    v = np.where(ins[0] != 0, ins[1], ins[2])
                elif node.op in UNARY:
                    v = UNARY[node.op](ins[0])
                else:
                    v = BINARY[node.op](ins[0], ins[1])
        elif isinstance(node, Dropout):
            seed = tuple(int(s) for s in np.asarray(params[node.seed_param]).reshape(-1)[:2])
            g = p.gemm
            keep = philox.dropout_keep((g.batch, g.m, g.n), seed, node.site, node.p)
            keep = keep.reshape(tuple(p.batch_shape) + (g.m, g.n))
            v = np.where(keep, ins[0] * np.float64(philox.dropout_scale(node.p)), 0.0)
        elif isinstance(node, AuxStore):
            v = ins[0]
            outputs[node.output] = np.broadcast_to(v, tile).reshape(p.outputs[node.output].shape)  # tile, viewed
        elif isinstance(node, Reduction):
            v = ins[0]
            red = _reduce(np.broadcast_to(v, tile), node)
            outputs[node.output] = round_to(red, node.dtype).reshape(p.outputs[node.output].shape)
        else:
            raise TypeError(f"no reference semantics for {node.kind}")
        values.append(round_to(v, node.dtype) if node.dtype else v)
    return [
        np.asarray(round_to(outputs[i], desc.dtype)).astype(NP_DTYPES[desc.dtype]).reshape(desc.shape)
        for i, desc in enumerate(p.outputs)
    ]

"""Epilogue IR node kinds: frozen dataclasses whose ``inputs`` are ordered indices of earlier nodes.

Shapes are logical.  Before ``EliminateLayout`` a tensor parameter enters the graph as a
``TensorInput`` followed by ``Permute``/``Reshape`` views; afterwards every tensor read is one of the
four load kinds, each carrying element strides ``(stride_m, stride_n, stride_l)`` into the parameter's
memory (0 = broadcast along that mode).  The batch mode L flattens every leading output dimension.
"""
from __future__ import annotations

from dataclasses import dataclass

from .ops import OpKind, ReduceAxis, ReduceFn

Stride = tuple[int, int, int]


@dataclass(frozen=True, kw_only=True)
class Node:
    """Base of every node kind."""

    inputs: tuple[int, ...] = ()
    dtype: str | None = None
    shape: tuple[int, ...] | None = None

    @property
    def kind(self) -> str:
        return type(self).__name__


# ---------------------------------------------------------------------------------------- loads
@dataclass(frozen=True, kw_only=True)
class AccFetch(Node):
    """The GEMM accumulator tile (fp32), rounded to ``dtype`` (the matmul's result type)."""


@dataclass(frozen=True, kw_only=True)
class TensorInput(Node):
    """A partition parameter before layout elimination (``shape`` is the parameter's shape)."""

    param: int


@dataclass(frozen=True, kw_only=True)
class Permute(Node):
    axes: tuple[int, ...]


@dataclass(frozen=True, kw_only=True)
class Reshape(Node):
    new_shape: tuple[int, ...]


@dataclass(frozen=True, kw_only=True)
class AuxLoad(Node):
    """An M x N (x L) tensor; one of stride_m / stride_n is 1 (row- or column-major)."""

    param: int
    stride: Stride

    @property
    def column_major(self) -> bool:
        return self.stride[0] == 1 and self.stride[1] != 1


@dataclass(frozen=True, kw_only=True)
class RowBroadcast(Node):
    """A length-N vector broadcast along M; stride (0, 1, l)."""

    param: int
    stride: Stride


@dataclass(frozen=True, kw_only=True)
class ColBroadcast(Node):
    """A length-M vector broadcast along N; stride (1, 0, l)."""

    param: int
    stride: Stride


@dataclass(frozen=True, kw_only=True)
class ScalarBroadcast(Node):
    """A scalar: a compile-time ``value`` or the first element (per batch) of ``param``."""

    param: int | None = None
    value: float | None = None
    stride: Stride = (0, 0, 0)


# -------------------------------------------------------------------------------------- compute
@dataclass(frozen=True, kw_only=True)
class Compute(Node):
    op: OpKind


@dataclass(frozen=True, kw_only=True)
class Dropout(Node):
    """``keep ? x / (1 - p) : 0`` with ``keep`` drawn from Philox4x32-10 (see ``tvm_evt.codegen.philox``).

    ``seed_param`` is the uint32[2] seed tensor (read on the device); ``site`` the dropout site.
    """

    p: float
    seed_param: int
    site: int


# ---------------------------------------------------------------------------------------- stores
@dataclass(frozen=True, kw_only=True)
class AuxStore(Node):
    """Writes its input (an M x N x L value) to partition output ``output``; passes the value on."""

    output: int


@dataclass(frozen=True, kw_only=True)
class Reduction(Node):
    """Terminal reduction of its input into partition output ``output``; passes the value on."""

    axis: ReduceAxis
    fn: ReduceFn
    output: int


LOAD_KINDS = (AccFetch, AuxLoad, RowBroadcast, ColBroadcast, ScalarBroadcast)
LAYOUT_KINDS = (TensorInput, Permute, Reshape)
STORE_KINDS = (AuxStore, Reduction)

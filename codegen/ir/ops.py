"""Operation kinds an epilogue compute node can apply.

The IR only records *what* an operation means; the C++ functor that implements it lives in
``backend/functors.py`` and the numpy semantics in ``reference.py``.
"""
from __future__ import annotations

import enum


class OpKind(enum.Enum):
    """Elementwise operations of an epilogue compute node (operands are ordered)."""

    # binary arithmetic
    ADD = "add"
    SUB = "sub"
    MUL = "mul"
    DIV = "div"
    MAX = "max"
    MIN = "min"
    # unary
    NEG = "neg"
    EXP = "exp"
    LOG = "log"
    TANH = "tanh"
    ERF = "erf"
    SIGMOID = "sigmoid"
    RELU = "relu"
    GELU = "gelu"  # x * Phi(x), erf form
    GELU_TANH = "gelu_tanh"  # tanh approximation
    SILU = "silu"
    CAST = "cast"  # conversion to the node's dtype
    # derivatives of the activations (what their gradients multiply the incoming gradient by)
    GELU_GRAD = "gelu_grad"  # d/dx gelu(x) = Phi(x) + x phi(x), erf form
    GELU_TANH_GRAD = "gelu_tanh_grad"  # d/dx of the tanh approximation
    # backward forms, operands (grad, x)
    RELU_BACKWARD = "relu_backward"  # grad * (x > 0)
    GELU_BACKWARD = "gelu_backward"  # grad * d/dx gelu(x), erf form
    # comparisons produce 1/0 in the node's dtype (bool is stored as uint8)
    GT = "gt"
    GE = "ge"
    LT = "lt"
    LE = "le"
    EQ = "eq"
    NE = "ne"
    # logical connectives of 1/0 values (comparisons' results, bool masks): 1 or 0
    AND = "and"
    OR = "or"
    # ternary select, operands (condition, if_true, if_false)
    WHERE = "where"


_ARITY = {
    **{k: 2 for k in ("ADD", "SUB", "MUL", "DIV", "MAX", "MIN", "RELU_BACKWARD", "GELU_BACKWARD")},
    **{k: 2 for k in ("GT", "GE", "LT", "LE", "EQ", "NE", "AND", "OR")},
    **{k: 1 for k in ("NEG", "EXP", "LOG", "TANH", "ERF", "SIGMOID", "RELU", "GELU", "GELU_TANH")},
    **{k: 1 for k in ("GELU_GRAD", "GELU_TANH_GRAD")},
    "SILU": 1,
    "CAST": 1,
    "WHERE": 3,
}

COMPARISONS = frozenset({OpKind.GT, OpKind.GE, OpKind.LT, OpKind.LE, OpKind.EQ, OpKind.NE})
LOGICAL = frozenset({OpKind.AND, OpKind.OR})


def arity(op: OpKind) -> int:
    """Number of operands ``op`` takes."""
    return _ARITY[op.name]


class ReduceAxis(enum.Enum):
    """Direction of a terminal reduction, named after the shape of its result (as in CUTLASS).

    ROW reduces over M and yields a length-N row; COL reduces over N and yields a length-M
    column; SCALAR reduces over M and N.  The batch dimension is never reduced.
    """

    ROW = "row"
    COL = "col"
    SCALAR = "scalar"


class ReduceFn(enum.Enum):
    SUM = "sum"
    MAX = "max"

"""Activation derivatives as one node: the expression trees the training graph's gradient rules
(``relax_passes/training/gradient_rules.py``) spell GELU's derivative with become ``GELU_GRAD(x)`` /
``GELU_TANH_GRAD(x)``.

The forward GEMM of an MLP often stores both gelu(x) and gelu'(x) (the partitioner moves the
derivative next to x, so the backward GEMM loads one tensor).  Spelled out, the derivative is a
dozen compute nodes, each rounded to bf16, with an erf (or tanh) of its own: an ALU-bound epilogue
that the cooperative schedule does not hide behind the main loop.  As one node it is computed in
fp32 and rounded once, and its erf (tanh) term is the same C++ expression as gelu's
(``templates.PRELUDE``'s ``gelu_cdf_term``), so nvcc computes it once.

Patterns are data: ``(op, result, pattern)`` rows, a pattern being a nested tuple of operation
names (``add``/``mul`` match either operand order), ``X`` (the activation's input: one node
wherever it appears) and ``Const(v)`` (a compile-time scalar equal to ``v`` rounded to the
node's dtype, as the gradient rule's constants are after mixed precision).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from ..ir import AccFetch, AuxStore, Compute, OpKind, Partition, Reduction, ScalarBroadcast, keep_nodes
from .base import EpiloguePass, InvariantError
from .eliminate_layout import EliminateLayout

X = "x"


@dataclass(frozen=True)
class Const:
    value: float


_SQRT_HALF = math.sqrt(0.5)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
_TANH_C, _TANH_A = math.sqrt(2.0 / math.pi), 0.044715

# gelu_grad: 0.5 (1 + erf(x sqrt(1/2))) + x (exp(x x (-1/2)) / sqrt(2 pi))
_GELU_GRAD = ("add",
              ("mul", Const(0.5), ("add", Const(1.0), ("erf", ("mul", X, Const(_SQRT_HALF))))),
              ("mul", X, ("mul", ("exp", ("mul", ("mul", X, X), Const(-0.5))), Const(_INV_SQRT_2PI))))

# gelu_tanh_grad: 0.5 ((1 + t) + (x (1 - t t)) du), t = tanh((c x)(1 + (a x) x)), du = c (1 + (3a x) x)
_T = ("tanh", ("mul", ("mul", Const(_TANH_C), X), ("add", Const(1.0), ("mul", ("mul", Const(_TANH_A), X), X))))
_DU = ("mul", Const(_TANH_C), ("add", Const(1.0), ("mul", ("mul", Const(3.0 * _TANH_A), X), X)))
_GELU_TANH_GRAD = ("mul", Const(0.5),
                   ("add", ("add", Const(1.0), _T), ("mul", ("mul", X, ("sub", Const(1.0), ("mul", _T, _T))), _DU)))

PATTERNS: tuple[tuple[str, OpKind, tuple], ...] = (
    ("gelu_grad", OpKind.GELU_GRAD, _GELU_GRAD),
    ("gelu_tanh_grad", OpKind.GELU_TANH_GRAD, _GELU_TANH_GRAD),
)

_OPS = {"add": OpKind.ADD, "mul": OpKind.MUL, "sub": OpKind.SUB, "erf": OpKind.ERF, "exp": OpKind.EXP,
        "tanh": OpKind.TANH}
_COMMUTATIVE = frozenset({OpKind.ADD, OpKind.MUL})


def _rounded(value: float, dtype: str) -> float:
    from ..reference import round_to

    return float(round_to(np.float64(value), dtype))


def match(nodes, i: int, pattern, bound: dict) -> bool:
    """Does node ``i`` compute ``pattern``?  ``bound`` collects (and checks) the binding of ``X``."""
    node = nodes[i]
    if pattern == X:
        return bound.setdefault(X, i) == i
    if isinstance(pattern, Const):
        return (isinstance(node, ScalarBroadcast) and node.param is None and node.value is not None
                and node.dtype is not None and float(node.value) == _rounded(pattern.value, node.dtype))
    op, *operands = pattern
    if not isinstance(node, Compute) or node.op is not _OPS[op] or len(node.inputs) != len(operands):
        return False
    orders = [node.inputs]
    if node.op in _COMMUTATIVE:
        orders.append(node.inputs[::-1])
    for inputs in orders:
        trial = dict(bound)
        if all(match(nodes, j, sub, trial) for j, sub in zip(inputs, operands)):
            bound.update(trial)
            return True
    return False


def live(nodes) -> list[int]:
    """Indices of the nodes a store or reduction depends on (and the accumulator fetch)."""
    keep = {i for i, n in enumerate(nodes) if isinstance(n, (AuxStore, Reduction, AccFetch))}
    for i in range(len(nodes) - 1, -1, -1):
        if i in keep:
            keep.update(nodes[i].inputs)
    return sorted(keep)


class FoldActivationGradient(EpiloguePass):
    dependencies = (EliminateLayout,)

    def call(self, p: Partition) -> Partition:
        nodes = list(p.epilogue.nodes)
        folded = False
        for i in range(len(nodes)):
            for _name, op, pattern in PATTERNS:
                bound: dict = {}
                if match(nodes, i, pattern, bound):
                    nodes[i] = Compute(op=op, inputs=(bound[X],), dtype=nodes[i].dtype, shape=nodes[i].shape)
                    folded = True
                    break
        if not folded:
            return p
        return replace(p, epilogue=keep_nodes(nodes, live(nodes)))

    def ensures(self, p: Partition) -> None:
        nodes = p.epilogue.nodes
        for i in range(len(nodes)):
            for name, _op, pattern in PATTERNS:
                if match(nodes, i, pattern, {}):
                    raise InvariantError(f"node {i} still spells {name} out")

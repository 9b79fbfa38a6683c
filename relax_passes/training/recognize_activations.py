"""RecognizeActivations: an activation a model writes out as elementwise ops becomes the Relax op.

transformers' GPT-2 (``NewGELUActivation``, "gelu_new"), GPT-J, Bloom, CodeGen and others write
the tanh GELU as arithmetic, ``0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))``, each in its own order.
Differentiated as written, the backward keeps the intermediates of those eight ops: GPT-2 medium's
FFN1 forward epilogue stored six [16384, 4096] tensors and the FFN2 dX epilogue loaded five (H200,
2026-11-28: 14.0 + 9.4 ms a step, the step's two largest kernels).  As ``relax.nn.gelu_tanh(x)``
the gradient rule computes gelu'(x) from x alone (``GELU_TANH`` / ``GELU_TANH_GRAD`` in the
epilogues), as for a model that calls ``F.gelu(approximate="tanh")``.

A value is recognised by what it computes, not by how it is spelt: a value of a dataflow block that
is an elementwise function of one tensor ``x`` (ops of `EVALUATE` over ``x`` and scalar constants,
same shape and dtype as ``x``), that contains the activation's `anchor` op, and that equals the
activation's `reference` on `SAMPLES` in float64 within `RTOL`, is replaced by the op on ``x``.
Operand order, association, the cube as ``power`` or as products, and constants rounded to float32
do not matter; a different constant does (0.0447 instead of 0.044715 is off by 1e-4).  Runs before
``Gradient``, on imported graphs; the intermediates nothing else reads are dropped.

    lv3 = x * 0.5;  lv4 = power(x, 3.0);  lv5 = lv4 * 0.044715;  lv6 = x + lv5
    lv7 = lv6 * 0.7978846;  lv8 = tanh(lv7);  lv9 = lv8 + 1.0;  y = lv3 * lv9
  ->
    y = gelu_tanh(x)
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np
import tvm
from tvm import relax

from .._rewrite import dtype_of, replace_bindings, scalar_value, static_shape

_erf = np.vectorize(math.erf)

# float64 evaluation of the elementwise ops a written-out activation is made of
EVALUATE: dict[str, Callable] = {
    "relax.add": np.add, "relax.subtract": np.subtract, "relax.multiply": np.multiply,
    "relax.divide": np.divide, "relax.power": np.power, "relax.negative": np.negative,
    "relax.sqrt": np.sqrt, "relax.exp": np.exp, "relax.tanh": np.tanh, "relax.erf": _erf,
    "relax.sigmoid": lambda v: 1.0 / (1.0 + np.exp(-v)),
}
SAMPLES = np.concatenate([np.linspace(-4.0, 4.0, 33), [-8.0, -0.1, 0.1, 8.0]])
RTOL, ATOL = 1e-5, 1e-7
MAX_OPS = 32  # values searched from an anchor either way: an activation is a handful of ops


@dataclass(frozen=True)
class Activation:
    name: str
    anchor: str  # an op every spelling of it contains
    reference: Callable[[np.ndarray], np.ndarray]
    make: Callable[[relax.Expr], relax.Expr]  # the Relax op on x


ACTIVATIONS = (
    Activation("gelu_tanh", "relax.tanh",
               lambda x: 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3))),
               relax.op.nn.gelu_tanh),
    Activation("gelu", "relax.erf", lambda x: 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0))), relax.op.nn.gelu),
)
ANCHORS = {a.anchor for a in ACTIVATIONS}
EXPECTED = {a.name: a.reference(SAMPLES) for a in ACTIVATIONS}  # each activation on SAMPLES, once


class _Block:
    """The elementwise values of one dataflow block as functions of one of its tensors."""

    def __init__(self, block: relax.DataflowBlock):
        self.bound = {b.var: b.value for b in block.bindings if isinstance(b, relax.VarBinding)}
        self.users: dict = {}
        for var, value in self.bound.items():
            if self._call(var) is not None:
                for a in value.args:
                    if isinstance(a, relax.Var):
                        self.users.setdefault(a, []).append(var)

    def _call(self, var):
        value = self.bound.get(var)
        if isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op) and value.op.name in EVALUATE:
            return value
        return None

    def _closure(self, var, step) -> list:
        """`var` and the vars `step` reaches from it, transitively, at most `MAX_OPS` of them."""
        seen, stack = [], [var]
        while stack and len(seen) < MAX_OPS:
            v = stack.pop()
            if v not in seen:
                seen.append(v)
                stack.extend(step(v))
        return seen

    def cone(self, var) -> list:
        """The vars `var`'s elementwise definition reads (itself first)."""
        def inputs(v) -> list:
            call = self._call(v)
            return [] if call is None else [a for a in call.args if isinstance(a, relax.Var)]

        return self._closure(var, inputs)

    def reach(self, var) -> list:
        """The values computed from `var` by elementwise ops alone (itself first)."""
        return self._closure(var, lambda v: self.users.get(v, []))

    def evaluate(self, var, x, memo: dict) -> np.ndarray | None:
        """`var` on `SAMPLES` of `x` (float64), or None where it is not an elementwise function of
        `x` and scalar constants alone."""
        if var.same_as(x):
            return SAMPLES
        if var in memo:
            return memo[var]
        call = self._call(var)
        found = None
        if call is not None:
            args = []
            for a in call.args:
                v = scalar_value({}, a) if not isinstance(a, relax.Var) else self.evaluate(a, x, memo)
                if v is None:
                    break
                args.append(v)
            else:
                with np.errstate(all="ignore"):
                    found = np.broadcast_to(np.asarray(EVALUATE[call.op.name](*args), dtype=np.float64), SAMPLES.shape)
        memo[var] = found
        return found

    def matches(self) -> dict:
        """{var: replacement value} for each value of the block an `ACTIVATIONS` entry recognises."""
        found: dict = {}
        for var in self.bound:
            call = self._call(var)
            if call is None or call.op.name not in ANCHORS:
                continue
            candidates = [v for v in self.cone(var)[1:] if static_shape(v) is not None]
            for x in candidates:
                memo: dict = {}
                for root in self.reach(var):
                    if root in found or static_shape(root) != static_shape(x) or dtype_of(root) != dtype_of(x):
                        continue
                    values = self.evaluate(root, x, memo)
                    if values is None:
                        continue
                    for act in ACTIVATIONS:
                        if act.anchor == call.op.name and np.allclose(values, EXPECTED[act.name], RTOL, ATOL):
                            found[root] = act.make(x)
        return found


def _replacements(block: relax.DataflowBlock) -> dict:
    return {var: (lambda visit, new=new: relax.Call(new.op, [visit(new.args[0])], new.attrs))
            for var, new in _Block(block).matches().items()}


@tvm.transform.module_pass(opt_level=0, name="RecognizeActivations")
class RecognizeActivations:
    """Replace written-out activations (`ACTIVATIONS`) by their Relax ops in every Relax function
    and drop the intermediates nothing else reads (see the module docstring)."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        return replace_bindings(mod, _replacements)

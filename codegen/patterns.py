"""The evt pattern table for TVM's BYOC flow, and ``partition_for_evt``.

TVM's own route to an external codegen is a pattern table in ``tvm.relax.backend.pattern_registry``,
``FuseOpsByPattern(..., annotate_codegen=True)`` and ``RunCodegen``.  This module gives ``relax.ext.evt``
that route: GEMM + epilogue patterns named ``evt.<what>`` (a matmul, its bias, an activation, a
residual add), each with ``legality.pattern_check`` as its check, so a match the epilogue cannot
express stays with TVM.  ``register()`` (what ``import tvm_evt`` calls) adds the table once;
``partition_for_evt(mod)`` partitions with it, as ``partition_for_cutlass`` does for TVM's CUTLASS.

The table covers what a forward graph writes around a linear layer.  The ``evt`` pipeline's ILP
partitioner (``PartitionEVT``) goes further on training graphs: any epilogue DAG the codegen can
express, chosen jointly over the forward and backward.
"""
from __future__ import annotations

import itertools

import tvm
from tvm import relax
from tvm.relax.backend.pattern_registry import get_pattern, get_patterns_with_prefix, register_patterns
from tvm.relax.dpl import is_op, wildcard

from .legality import pattern_check

PREFIX = "evt"
# epilogue activations a pattern may end in (each is one the frontend's UNARY_OPS can emit)
ACTIVATIONS = {
    "relu": "relax.nn.relu",
    "gelu": "relax.nn.gelu",
    "gelu_tanh": "relax.nn.gelu_tanh",
    "silu": "relax.nn.silu",
    "sigmoid": "relax.sigmoid",
    "tanh": "relax.tanh",
}


def _pattern(transposed_rhs: bool, bias: bool, activation: str | None, residual: bool):
    """(pattern, annotations) of ``act(x @ W[^T] + b) + r`` with the parts asked for."""
    lhs, rhs = wildcard(), wildcard()
    annotations = {"lhs": lhs, "rhs": rhs}
    out = is_op("relax.matmul")(lhs, is_op("relax.permute_dims")(rhs) if transposed_rhs else rhs)
    annotations["root"] = out
    if bias:
        annotations["bias"] = b = wildcard()
        out = is_op("relax.add")(out, b) | is_op("relax.add")(b, out)
    if activation:
        out = is_op(ACTIVATIONS[activation])(out)
    if residual:
        annotations["residual"] = r = wildcard()
        out = is_op("relax.add")(out, r) | is_op("relax.add")(r, out)
    return out, annotations


def _name(transposed_rhs: bool, bias: bool, activation: str | None, residual: bool) -> str:
    parts = ["matmul" + ("_transposed" if transposed_rhs else "")]
    parts += ["bias"] * bias + [activation] * bool(activation) + ["residual"] * residual
    return f"{PREFIX}." + "_".join(parts)


def pattern_table() -> list[tuple]:
    """``(name, pattern, annotations, check)`` of every evt pattern, simplest first: TVM gives
    later patterns priority, so the largest match wins."""
    table = []
    for residual, activation, bias, transposed in itertools.product(
        (False, True), (None, *ACTIVATIONS), (False, True), (False, True)
    ):
        pattern, annotations = _pattern(transposed, bias, activation, residual)
        table.append((_name(transposed, bias, activation, residual), pattern, annotations, pattern_check))
    table.sort(key=lambda entry: entry[0].count("_"))  # stable: fewer parts, lower priority
    return table


def register() -> None:
    """Add the evt patterns to TVM's pattern registry (once per process)."""
    table = pattern_table()
    if get_pattern(table[-1][0]) is None:
        register_patterns(table)


def partition_for_evt(mod: tvm.IRModule, annotate_codegen: bool = True) -> tvm.IRModule:
    """Partition `mod` into the evt patterns' subgraphs, each a ``Codegen="evt"`` function that
    ``relax.transform.RunCodegen()`` builds as a CUTLASS SM90 kernel (with `annotate_codegen`;
    without it, ``Composite`` functions as ``FuseOpsByPattern`` leaves them)."""
    register()
    patterns = get_patterns_with_prefix(PREFIX)
    return relax.transform.FuseOpsByPattern(patterns, bind_constants=False,
                                            annotate_codegen=annotate_codegen)(mod)

"""Helpers shared by the tests of module passes."""

from __future__ import annotations

import tvm
from tvm import relax


def assert_unchanged(module_pass, mod: tvm.IRModule) -> None:
    """`module_pass` leaves `mod` as it was (compared with a copy made first: a module pass may
    change its input)."""
    expected = tvm.IRModule(dict(mod.functions_items()))
    tvm.ir.assert_structural_equal(module_pass(mod), expected)


def affine_free_layer_norms(func: relax.Function) -> int:
    """How many ``layer_norm`` calls of `func` neither scale nor shift (FoldNormAffine's)."""
    return sum(1 for block in func.body.blocks for b in block.bindings
               if isinstance(b.value, relax.Call) and getattr(b.value.op, "name", "") == "relax.nn.layer_norm"
               and not b.value.attrs.scale and not b.value.attrs.center)


def flat_numpy(out) -> list:
    """A VM function's result (a tensor, or nested tuples of them) as a flat list of numpy arrays."""
    flat, stack = [], [out]
    while stack:
        x = stack.pop(0)
        if hasattr(x, "numpy"):
            flat.append(x.numpy())
        else:
            stack = list(x) + stack
    return flat

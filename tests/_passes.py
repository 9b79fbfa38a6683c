"""Helpers shared by the tests of module passes."""

from __future__ import annotations

import tvm


def assert_unchanged(module_pass, mod: tvm.IRModule) -> None:
    """`module_pass` leaves `mod` as it was (compared with a copy made first: a module pass may
    change its input)."""
    expected = tvm.IRModule(dict(mod.functions_items()))
    tvm.ir.assert_structural_equal(module_pass(mod), expected)

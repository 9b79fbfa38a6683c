"""DeduplicateEVTPartitions: one ``Codegen="evt"`` function per distinct partition.

The partitioner emits a function per cluster, so the same GEMM + epilogue appears once in
``main_adjoint`` and again in ``train_step``, and once per layer of a deep model; each would be
a separate CUTLASS build.  Partitions that are structurally equal apart from their symbol are
merged: calls go to the first (in name order), the others are dropped.
"""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from .._rewrite import mutate_relax_functions

CODEGEN = "evt"


def _is_partition(func) -> bool:
    return isinstance(func, relax.Function) and bool(func.attrs) and func.attrs.get("Codegen") == CODEGEN


def _canonical(func: relax.Function) -> relax.Function:
    return func.without_attr("global_symbol")


@mutator
class _Redirect(PyExprMutator):
    def __init__(self, mod, target: dict):
        super().__init__(mod)
        self.target = target

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if isinstance(call.op, tvm.ir.GlobalVar) and call.op in self.target:
            return relax.Call(self.target[call.op], call.args, call.attrs, call.ty_args)
        return call


def duplicates(mod: tvm.IRModule) -> dict:
    """{duplicate partition GlobalVar: the GlobalVar it equals}."""
    parts = sorted(
        ((gv, f) for gv, f in mod.functions_items() if _is_partition(f)), key=lambda p: p[0].name_hint
    )
    buckets: dict[int, list] = {}
    target = {}
    for gv, func in parts:
        canon = _canonical(func)
        bucket = buckets.setdefault(tvm_ffi.structural_hash(canon, map_free_vars=True), [])
        for first, first_canon in bucket:
            if tvm_ffi.structural_equal(canon, first_canon, map_free_vars=True):
                target[gv] = first
                break
        else:
            bucket.append((gv, canon))
    return target


@tvm.transform.module_pass(opt_level=0, name="DeduplicateEVTPartitions")
class DeduplicateEVTPartitions:
    """Merge structurally equal evt partitions (see the module docstring)."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        target = duplicates(mod)
        if not target:
            return mod
        mod = mutate_relax_functions(_Redirect(mod, target), mod)
        kept = {gv: f for gv, f in mod.functions_items() if gv not in target}
        return tvm.IRModule(kept, attrs=mod.attrs)

"""OffloadAttention: fused attention calls to flash-attention kernels (the CUDA route).

Each ``tvm_evt.attention`` / ``tvm_evt.attention_backward`` call the kernels can take
(``codegen.frontend.attention_call``: bf16/fp16, head dimension 64, ...) becomes a call of a
``Codegen="evt_attention"`` function holding just that call, which ``RunCodegen`` hands to
``relax.ext.evt_attention``; equal calls (the same shapes, flags and dropout site) share one
function.  A call the kernels cannot take is decomposed into plain Relax ops
(``attention_op.decompose_*``) here, before the partitioner, so its GEMMs still become EVT
partitions; the reason is kept in ``OffloadAttention.fallbacks``.

    lv = tvm_evt.attention(q, k, v, seed, 0.125, 0, 0.1, 3)
  ->
    lv = main_attention0(q, k, v, seed)       # Codegen="evt_attention", global_symbol
"""
from __future__ import annotations

import dataclasses

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from ..codegen.errors import Unsupported
from ..codegen.frontend.attention_call import (
    BACKWARD_OP,
    FORWARD_OP,
    SAVED_MASK_ATTR,
    TENSOR_ARGS,
    attention_of_call,
)
from . import attention_op

CODEGEN = "evt_attention"
OPS = {tvm.ir.Op.get(FORWARD_OP): FORWARD_OP, tvm.ir.Op.get(BACKWARD_OP): BACKWARD_OP}
DECOMPOSE = {FORWARD_OP: attention_op.decompose_attention, BACKWARD_OP: attention_op.decompose_attention_backward}


def _kernel_function(call: relax.Call, spec, mask: relax.Expr | None) -> tuple[relax.Function, list[relax.Expr]]:
    """fn(<tensor args in AttentionCall.inputs order>) { return op(params..., prims...) } and the
    call's arguments for those parameters.  With a saved mask (``spec.saved_mask``) the forward
    function also returns the keep bits (only its type matters: the kernel writes them), and the
    backward function takes ``mask``, the forward's third result, in place of the seed."""
    n = len(TENSOR_ARGS[call.op.name])
    positions = list(range(n)) + ([n] if spec.has_dropout else []) + ([len(call.args) - 1] if spec.has_bias else [])
    args = [call.args[i] for i in positions]
    if spec.saved_mask and spec.backward:
        args[n] = mask
    params = [relax.Var(name, arg.ty) for name, arg in zip(spec.inputs, args)]
    inner = list(call.args)
    for param, i, name in zip(params, positions, spec.inputs):
        if name != "mask":
            inner[i] = param
    bb = relax.BlockBuilder()
    with bb.function("attention", params):
        out = bb.emit(relax.Call(call.op, inner, call.attrs, call.ty_args))
        if spec.saved_mask and not spec.backward:
            bits = bb.emit(relax.op.zeros(relax.ShapeExpr(spec.mask_shape), "uint32"))
            out = bb.emit(relax.Tuple([relax.TupleGetItem(out, 0), relax.TupleGetItem(out, 1), bits]))
        bb.emit_func_output(out)
    func = bb.get()["attention"]
    if spec.saved_mask:
        func = func.with_attr(SAVED_MASK_ATTR, 1)
    return func, args


def _has_attention(func: relax.Function) -> bool:
    found = []
    relax.analysis.post_order_visit(
        func.body, lambda e: found.append(1) if isinstance(e, relax.Call) and e.op in OPS else None)
    return bool(found)


def _dropout_site(spec) -> tuple:
    """What pairs a forward call with its backward call: the dropout site and the shapes."""
    return (spec.site, spec.batch, spec.heads, spec.sq, spec.sk, spec.dtype)


@mutator
class _Offloader(PyExprMutator):
    def __init__(self, mod: tvm.IRModule, prefix: str, shared: dict, fallbacks: list, backward_sites: set):
        super().__init__(mod)
        self.prefix = prefix
        self.shared = shared  # AttentionCall -> GlobalVar
        self.fallbacks = fallbacks
        self.backward_sites = backward_sites  # forward calls whose keep bits a backward call reads
        self.masks: dict = {}  # dropout site -> the forward's saved keep bits

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        name = OPS.get(call.op) if isinstance(call.op, tvm.ir.Op) else None
        if name is None:
            return call
        try:
            spec = attention_of_call(call)
        except Unsupported as err:
            self.fallbacks.append(err.reason)
            return DECOMPOSE[name](self.builder_, call)
        site = _dropout_site(spec)
        if spec.has_dropout and (site in self.masks if spec.backward else site in self.backward_sites):
            spec = dataclasses.replace(spec, saved_mask=True)
        func, args = _kernel_function(call, spec, self.masks.get(site))
        gvar = self.shared.get(spec)
        if gvar is None:
            kind = "attention_backward" if spec.backward else "attention"
            symbol = f"{self.prefix}_{kind}{len(self.shared)}"
            gvar = self.builder_.add_func(func.with_attrs({"Codegen": CODEGEN, "global_symbol": symbol}), symbol)
            self.shared[spec] = gvar
        if not (spec.saved_mask and not spec.backward):
            return relax.Call(gvar, args)
        full = self.builder_.emit(relax.Call(gvar, args))
        self.masks[site] = self.builder_.emit(relax.TupleGetItem(full, 2))
        return relax.Tuple([relax.TupleGetItem(full, 0), relax.TupleGetItem(full, 1)])


def _backward_sites(func: relax.Function) -> set:
    sites = set()

    def visit(expr):
        if isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op) and expr.op.name == BACKWARD_OP:
            try:
                sites.add(_dropout_site(attention_of_call(expr)))
            except Unsupported:
                pass

    relax.analysis.post_order_visit(func.body, visit)
    return sites


@tvm.transform.module_pass(opt_level=0, name="OffloadAttention")
class OffloadAttention:
    """Fused attention calls -> ``Codegen="evt_attention"`` functions, or plain ops where the
    kernels cannot take them (``fallbacks`` lists why)."""

    def __init__(self):
        self.fallbacks: list[str] = []

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        targets = [(gv, f) for gv, f in mod.functions_items()
                   if isinstance(f, relax.Function) and not (f.attrs and "Codegen" in f.attrs)
                   and _has_attention(f)]
        if not targets:
            return mod
        shared: dict = {}
        for gv, func in targets:
            mutator_ = _Offloader(mod, gv.name_hint, shared, self.fallbacks, _backward_sites(func))
            new = mutator_.visit_expr(func)
            mutator_.builder_.update_func(gv, new)
            mod = mutator_.builder_.get()
        return relax.transform.DeadCodeElimination()(mod)

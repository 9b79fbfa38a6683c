"""OffloadAttention: fused attention calls to flash-attention kernels (the CUDA route).

Each ``tvm_evt.attention`` / ``tvm_evt.attention_backward`` call the kernels can take
(``codegen.frontend.attention_call``: bf16/fp16, head dimension 32, 64, 80, 96 or 128, ...) becomes a call of a
``Codegen="evt_attention"`` function holding just that call, which ``RunCodegen`` hands to
``relax.ext.evt_attention``; equal calls (the same shapes, flags and dropout site) share one
function.  A call the kernels cannot take is decomposed into plain Relax ops
(``attention_op.decompose_*``) here, before the partitioner, so its GEMMs still become EVT
partitions; the reason is kept in ``OffloadAttention.fallbacks``.

    lv = tvm_evt.attention(q, k, v, seed, 0.125, 0, 0.1, 3)
  ->
    lv = main_attention0(q, k, v, seed)       # Codegen="evt_attention", global_symbol

Two refinements of the calls' kernels:

* saved keep bits: a forward call with dropout whose backward call is in the same function (the
  same site and shapes) also returns dropout's keep bits (1 bit an element), which the backward
  kernel reads instead of drawing them again (``tvm_evt.saved_mask``);
* sequence-major heads: where q, k, v (and o, dO) are all ``permute_dims(x, [0, 2, 1, 3])`` of
  [B, S, H, D] tensors, as a linear layer's output split into heads is, the kernel reads the x's
  and writes O (dQ, dK, dV) as [B, S, H, D] (``tvm_evt.layout`` = "bshd"); the graph around gets
  [B, H, S, D] views of them, whose transposes `CancelTransposes` then removes against the
  graph's own.
"""
from __future__ import annotations

import dataclasses

import tvm
from tvm import relax
from tvm.relax import op as R
from tvm.relax.expr_functor import PyExprMutator, mutator

from ...codegen.errors import Unsupported
from ...codegen.frontend.attention_call import (
    BACKWARD_OP,
    FORWARD_OP,
    HEADS_SWAP,
    LAYOUT_ATTR,
    SAVED_MASK_ATTR,
    SEQUENCE_MAJOR,
    TENSOR_ARGS,
    attention_of_call,
    heads_transposed,
)
from ..ops import attention_op
from .._rewrite import has_call, op_name, sub_expressions
from ..training.cancel_transposes import CancelTransposes, bound_value

CODEGEN = "evt_attention"
OPS = {tvm.ir.Op.get(FORWARD_OP): FORWARD_OP, tvm.ir.Op.get(BACKWARD_OP): BACKWARD_OP}
DECOMPOSE = {FORWARD_OP: attention_op.decompose_attention, BACKWARD_OP: attention_op.decompose_attention_backward}


def _results(bb: relax.BlockBuilder, out: relax.Expr, spec, swap_heads: bool) -> list[relax.Expr]:
    """The tensor results of a call's value `out` (O, LSE; or dQ, dK, dV), with the heads axis of
    O (dQ, dK, dV) swapped with the sequence axis where `swap_heads`."""
    results = [relax.TupleGetItem(out, i) for i in range(3 if spec.backward else 2)]
    if not swap_heads:
        return results
    swapped = range(3) if spec.backward else range(1)
    return [bb.emit(R.permute_dims(bb.emit(r), list(HEADS_SWAP))) if i in swapped else r for i, r in enumerate(results)]


def _kernel_function(call: relax.Call, spec, mask: relax.Expr | None,
                     sources: dict | None) -> tuple[relax.Function, list[relax.Expr]]:
    """fn(<tensor args in AttentionCall.inputs order>) { return op(params..., prims...) } and the
    call's arguments for those parameters.  With a saved mask (``spec.saved_mask``) the forward
    function also returns the keep bits (only its type matters: the kernel writes them), and the
    backward function takes ``mask``, the forward's third result, in place of the seed.  With
    ``sources`` (``spec.layout == "bshd"``: name -> the [B, S, H, D] tensor an operand transposes)
    those are the parameters, transposed inside the function, and its tensor results are [B, S, H, D]."""
    n = len(TENSOR_ARGS[call.op.name])
    positions = list(range(n)) + ([n] if spec.has_dropout else []) + ([len(call.args) - 1] if spec.has_bias else [])
    args = [call.args[i] for i in positions]
    if spec.saved_mask and spec.backward:
        args[n] = mask
    if sources:
        args = [sources.get(name, arg) for name, arg in zip(spec.inputs, args)]
    params = [relax.Var(name, arg.ty) for name, arg in zip(spec.inputs, args)]
    bb = relax.BlockBuilder()
    with bb.function("attention", params):
        inner = list(call.args)
        inner[n] = attention_op.no_seed()  # unless a parameter: not read (no dropout, or the saved bits)
        for param, i, name in zip(params, positions, spec.inputs):
            if name == "mask":
                continue
            inner[i] = bb.emit(R.permute_dims(param, list(HEADS_SWAP))) if sources and name in sources else param
        out = bb.emit(relax.Call(call.op, inner, call.attrs, call.ty_args))
        results = _results(bb, out, spec, swap_heads=bool(sources))  # with sources: [B, S, H, D]
        if spec.saved_mask and not spec.backward:
            results.append(bb.emit(relax.op.zeros(relax.ShapeExpr(spec.mask_shape), "uint32")))
        if sources or (spec.saved_mask and not spec.backward):
            out = bb.emit(relax.Tuple(results))
        bb.emit_func_output(out)
    func = bb.get()["attention"]
    if spec.saved_mask:
        func = func.with_attr(SAVED_MASK_ATTR, 1)
    if sources:
        func = func.with_attr(LAYOUT_ATTR, spec.layout)
    return func, args


def _dropout_site(spec) -> tuple:
    """What pairs a forward call with its backward call: the dropout site and the shapes."""
    return (spec.site, spec.batch, spec.heads, spec.kv_heads, spec.sq, spec.sk, spec.dtype)


@mutator
class _Offloader(PyExprMutator):
    def __init__(self, mod: tvm.IRModule, prefix: str, shared: dict, fallbacks: list, backward_sites: set,
                 kernels: bool = True):
        super().__init__(mod)
        self.kernels = kernels
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
            if not self.kernels:
                raise Unsupported(f"{name}: the flash-attention kernels are switched off (TVM_EVT_DISABLE)")
            spec = attention_of_call(call)
        except Unsupported as err:
            self.fallbacks.append(err.reason)
            return DECOMPOSE[name](self.builder_, call)
        site = _dropout_site(spec)
        if spec.has_dropout and (site in self.masks if spec.backward else site in self.backward_sites):
            spec = dataclasses.replace(spec, saved_mask=True)
        sources = self.sequence_major(call, spec)
        if sources:
            spec = dataclasses.replace(spec, layout="bshd")
        func, args = _kernel_function(call, spec, self.masks.get(site), sources)
        gvar = self.shared.get(spec)
        if gvar is None:
            kind = "attention_backward" if spec.backward else "attention"
            symbol = f"{self.prefix}_{kind}{len(self.shared)}"
            gvar = self.builder_.add_func(func.with_attrs({"Codegen": CODEGEN, "global_symbol": symbol}), symbol)
            self.shared[spec] = gvar
        if not (spec.saved_mask and not spec.backward) and not sources:
            return relax.Call(gvar, args)
        full = self.builder_.emit(relax.Call(gvar, args))
        if spec.saved_mask and not spec.backward:
            self.masks[site] = self.builder_.emit(relax.TupleGetItem(full, 2))
        # the graph around keeps [B, H, S, D] (CancelTransposes meets its own transposes)
        return relax.Tuple(_results(self.builder_, full, spec, swap_heads=bool(sources)))

    def sequence_major(self, call: relax.Call, spec) -> dict | None:
        """name -> [B, S, H, D] source of every operand in ``SEQUENCE_MAJOR`` when all of them are
        transposed [B, S, H, D] tensors (a linear layer's output split into heads), else None."""
        tensors = TENSOR_ARGS[call.op.name]
        sources = {name: heads_transposed(bound_value(self, arg))
                   for name, arg in zip(tensors, call.args) if name in SEQUENCE_MAJOR}
        return sources if all(src is not None for src in sources.values()) else None


def _backward_sites(func: relax.Function) -> set:
    sites = set()
    for expr in sub_expressions(func.body):
        if op_name(expr) == BACKWARD_OP:
            try:
                sites.add(_dropout_site(attention_of_call(expr)))
            except Unsupported:
                pass
    return sites


@tvm.transform.module_pass(opt_level=0, name="OffloadAttention")
class OffloadAttention:
    """Fused attention calls -> ``Codegen="evt_attention"`` functions, or plain ops where the
    kernels cannot take them (``fallbacks`` lists why); `kernels` False: plain ops for every call
    (``TVM_EVT_DISABLE=flash_attention``)."""

    def __init__(self, kernels: bool = True):
        self.kernels = kernels
        self.fallbacks: list[str] = []

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        targets = [(gv, f) for gv, f in mod.functions_items()
                   if isinstance(f, relax.Function) and not (f.attrs and "Codegen" in f.attrs)
                   and has_call(f.body, OPS)]
        if not targets:
            return mod
        shared: dict = {}
        for gv, func in targets:
            mutator_ = _Offloader(mod, gv.name_hint, shared, self.fallbacks, _backward_sites(func), self.kernels)
            new = mutator_.visit_expr(func)
            mutator_.builder_.update_func(gv, new)
            mod = mutator_.builder_.get()
        # CanonicalizeBindings: items of the tuples built here read their fields directly, so the
        # transposes CancelTransposes leaves unused are dead
        mod = CancelTransposes()(mod)  # ends with dead-code elimination
        return relax.transform.DeadCodeElimination()(relax.transform.CanonicalizeBindings()(mod))

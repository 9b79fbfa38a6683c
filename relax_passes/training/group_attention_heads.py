"""GroupAttentionHeads: attention over key/value heads repeated for groups of query heads reads
the heads themselves (grouped-query and multi-query attention).

A model with fewer key/value heads than query heads repeats each one over a group of query heads
before the attention: transformers' ``repeat_kv`` (Llama, Mistral, Qwen2, ...), the form its SDPA
path takes wherever it does not pass ``enable_gqa``::

    x[:, :, None, :, :].expand(B, Hkv, G, S, D).reshape(B, Hkv * G, S, D)

which imports as ``reshape(broadcast_to(expand_dims(x, [2]), [B, Hkv, G, S, D]), [B, H, S, D])``.
``tvm_evt.attention`` takes [B, Hkv, S, D] keys and values itself (its grouped-query form; SDPA
with ``enable_gqa`` imports as that), so the repeat is dropped::

    k = reshape(broadcast_to(expand_dims(xk, [2]), [B, Hkv, G, S, D]), [B, H, S, D])
    v = (the same of xv, with the same G)
    o = tvm_evt.attention(q, k, v, ...)
  ->
    o = tvm_evt.attention(q, xk, xv, ...)

Its gradient then gives [B, Hkv, S, D] key/value gradients, summed over each group inside the
flash-attention kernel, where the repeat's gradient was a [B, H, S, D] gradient and a sum over the
group after it; and the forward neither writes nor keeps the repeated copies.  The unit axis may
also come from a reshape (``[B, Hkv, 1, S, D]``).  Runs before ``Gradient``; a repeat something
else reads stays for that reader.
"""
from __future__ import annotations

import tvm
from tvm import relax

from .._rewrite import bound_call, replace_bindings, static_shape
from ..ops import attention_op

ATTENTION = tvm.ir.Op.get(attention_op.FORWARD)
RESHAPE, BROADCAST_TO, EXPAND_DIMS = (tvm.ir.Op.get(f"relax.{n}") for n in ("reshape", "broadcast_to", "expand_dims"))


def repeated_heads(bound: dict, expr) -> tuple[relax.Expr, int] | None:
    """``(x, G)`` where `expr` [B, H, S, D] is `x` [B, H / G, S, D] with each head repeated G times in
    a row (a head of the result is ``x``'s head h // G), else None."""
    flat = bound_call(bound, expr, RESHAPE)
    wide = bound_call(bound, flat.args[0], BROADCAST_TO) if flat is not None else None
    if wide is None:
        return None
    unit = bound_call(bound, wide.args[0], EXPAND_DIMS)
    unit = bound_call(bound, wide.args[0], RESHAPE) if unit is None else unit
    if unit is None:
        return None
    if unit.op == EXPAND_DIMS and [int(a) % 5 for a in unit.attrs.axis] != [2]:
        return None
    x = unit.args[0]
    shape, out, full = static_shape(x), static_shape(expr), static_shape(flat.args[0])
    if shape is None or out is None or full is None or len(shape) != 4:
        return None
    b, hk, s, d = shape
    groups = full[2] if len(full) == 5 else 0
    if groups < 1 or full != (b, hk, groups, s, d) or out != (b, hk * groups, s, d) \
            or static_shape(unit) != (b, hk, 1, s, d):
        return None
    return x, groups


def _replacements(block: relax.DataflowBlock) -> dict:
    bound = {b.var: b.value for b in block.bindings if isinstance(b, relax.VarBinding)}

    def build(call, k, v):
        def make(visit):
            args = [visit(a) for a in call.args]
            args[1], args[2] = visit(k), visit(v)
            return relax.Call(call.op, args, call.attrs, call.ty_args)
        return make

    found = {}
    for var, value in bound.items():
        if not (isinstance(value, relax.Call) and value.op == ATTENTION):
            continue
        k, v = repeated_heads(bound, value.args[1]), repeated_heads(bound, value.args[2])
        if k is not None and v is not None and k[1] == v[1]:
            found[var] = build(value, k[0], v[0])
    return found


@tvm.transform.module_pass(opt_level=0, name="GroupAttentionHeads")
class GroupAttentionHeads:
    """``tvm_evt.attention`` calls whose keys and values are heads repeated over groups of query
    heads take the heads instead (see the module docstring)."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        return replace_bindings(mod, _replacements)

"""Read a ``Codegen="evt_attention"`` function (one ``tvm_evt.attention`` or
``tvm_evt.attention_backward`` call on its parameters) into an ``AttentionCall``; what the
flash-attention kernels cannot take raises ``Unsupported`` with the reason.

The ops' argument conventions are those of ``tvm_evt.relax_passes.ops.attention_op``:
``attention(q, k, v, seed, scale, causal, dropout, site[, bias])`` and
``attention_backward(q, k, v, o, lse, dout, seed, scale, causal, dropout, site[, bias])``.
"""
from __future__ import annotations

import dataclasses

import tvm
from tvm import relax

from ..backend.flash_attention import HEAD_DIMS, KEY_TILE
from ..errors import Unsupported
from ..ir.attention import AttentionCall
from .op_call import only_call

FORWARD_OP = "tvm_evt.attention"
BACKWARD_OP = "tvm_evt.attention_backward"
# op -> (tensor arguments before ``seed``, index of ``seed``)
TENSOR_ARGS = {FORWARD_OP: ("q", "k", "v"), BACKWARD_OP: ("q", "k", "v", "o", "lse", "dout")}
DTYPES = ("bfloat16", "float16")


def _prim(expr, what: str, op: str):
    if not isinstance(expr, (tvm.tirx.IntImm, tvm.tirx.FloatImm)):
        raise Unsupported(f"{op}: {what} must be a constant prim value, got {type(expr).__name__}")
    return expr.value


def _shape(expr) -> list[int]:
    try:
        return [int(s) for s in expr.ty.shape]
    except (TypeError, AttributeError) as err:
        raise Unsupported(f"attention operand {expr} has no static shape") from err


def attention_of_call(call: relax.Call, symbol: str = "attention") -> AttentionCall:
    """The ``AttentionCall`` of one op call (arguments may be any expressions)."""
    op = call.op.name if isinstance(call.op, tvm.ir.Op) else None
    if op not in TENSOR_ARGS:
        raise Unsupported(f"{op or call.op} is not a fused attention op")
    tensors = TENSOR_ARGS[op]
    n = len(tensors)
    if len(call.args) not in (n + 5, n + 6):
        raise Unsupported(f"{op}: expected {n + 5} or {n + 6} arguments, got {len(call.args)}")
    q = call.args[0]
    dtype = str(q.ty.dtype)
    if dtype not in DTYPES:
        raise Unsupported(f"{op}: dtype {dtype} (the kernels take {', '.join(DTYPES)})")
    for name, arg in zip(tensors, call.args[:n]):
        want = "float32" if name == "lse" else dtype
        if str(arg.ty.dtype) != want:
            raise Unsupported(f"{op}: {name} is {arg.ty.dtype}, expected {want}")
    batch, heads, sq, head_dim = _shape(q)
    kb, kh, sk, kd = _shape(call.args[1])
    if (kb, kd) != (batch, head_dim) or not 0 < kh <= heads or heads % kh or _shape(call.args[2]) != [kb, kh, sk, kd]:
        raise Unsupported(f"{op}: q {_shape(q)}, k {_shape(call.args[1])}, v {_shape(call.args[2])} do not agree")
    if head_dim not in HEAD_DIMS:
        raise Unsupported(f"{op}: head dimension {head_dim} (the kernels take {HEAD_DIMS})")
    tiles = -(-max(sq, sk) // KEY_TILE)  # a CTA per tile of a head (the kernels' 1-D grids)
    if batch * heads * tiles > 2**31 - 1:
        raise Unsupported(f"{op}: {batch * heads} heads of {tiles} tiles exceed a launch's 2^31 - 1 CTAs")
    scale, causal, dropout, site = (
        _prim(call.args[n + 1 + i], what, op) for i, what in enumerate(("scale", "causal", "dropout", "site"))
    )
    has_bias = len(call.args) == n + 6
    if has_bias and (_shape(call.args[-1]) != [sk] or str(call.args[-1].ty.dtype) != "float32"):
        raise Unsupported(f"{op}: bias must be float32 [{sk}], got {call.args[-1].ty}")
    if not 0.0 <= float(dropout) < 1.0:
        raise Unsupported(f"{op}: dropout rate {dropout} outside [0, 1)")
    return AttentionCall(
        symbol=symbol, backward=op == BACKWARD_OP, dtype=dtype, batch=batch, heads=heads, sq=sq, sk=sk,
        head_dim=head_dim, scale=float(scale), causal=bool(causal), dropout=float(dropout), site=int(site),
        has_bias=has_bias, kv_heads=kh,
    )


SAVED_MASK_ATTR = "tvm_evt.saved_mask"
LAYOUT_ATTR = "tvm_evt.layout"
SEQUENCE_MAJOR = ("q", "k", "v", "o", "dout")  # the parameters a "bshd" function takes as [B, S, H, D]
HEADS_SWAP = (0, 2, 1, 3)  # [B, H, S, D] <-> [B, S, H, D]


def heads_transposed(value) -> relax.Expr | None:
    """`x` where `value` is ``permute_dims(x, [0, 2, 1, 3])`` ([B, S, H, D] <-> [B, H, S, D]), else None."""
    if isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op) and value.op.name == "relax.permute_dims" \
            and value.attrs.axes is not None and tuple(int(a) for a in value.attrs.axes) == HEADS_SWAP:
        return value.args[0]
    return None


def attention_of_function(func: relax.Function) -> AttentionCall:
    """The ``AttentionCall`` of a partition function: one op call whose tensor arguments are the
    function's parameters in ``AttentionCall.inputs`` order (the DPS order the entry binds).

    With the function attribute ``tvm_evt.saved_mask`` the forward function returns dropout's
    keep bits as a third result and the backward function takes them as its ``mask`` parameter
    in place of the seed (its call's seed argument is then not read).  With ``tvm_evt.layout`` =
    "bshd" the parameters q, k, v, o and dout are [B, S, H, D], transposed inside the function
    before the call, and so are the tensor results (O; dQ, dK, dV)."""
    symbol, call, bound = only_call(func, TENSOR_ARGS, "attention")
    spec = attention_of_call(call, symbol)
    saved = bool(int(func.attrs[SAVED_MASK_ATTR])) if func.attrs and SAVED_MASK_ATTR in func.attrs else False
    if saved:
        if not spec.has_dropout:
            raise Unsupported(f"{symbol}: a saved mask without dropout")
        spec = dataclasses.replace(spec, saved_mask=True)
    layout = str(func.attrs[LAYOUT_ATTR]) if func.attrs and LAYOUT_ATTR in func.attrs else "bhsd"
    if layout not in ("bhsd", "bshd"):
        raise Unsupported(f"{symbol}: layout {layout!r}")
    spec = dataclasses.replace(spec, layout=layout)
    n = len(TENSOR_ARGS[BACKWARD_OP if spec.backward else FORWARD_OP])
    args = list(call.args[:n]) + ([call.args[n]] if spec.has_dropout else []) + ([call.args[-1]] if spec.has_bias else [])
    if len(func.params) != len(args):
        raise Unsupported(f"{symbol}: expected parameters {spec.inputs}, got {len(func.params)}")
    for name, arg, param in zip(spec.inputs, args, func.params):
        if name == "mask":
            if [int(d) for d in param.ty.shape] != spec.mask_shape or str(param.ty.dtype) != "uint32":
                raise Unsupported(f"{symbol}: mask parameter must be uint32 {spec.mask_shape}, got {param.ty}")
        elif layout == "bshd" and name in SEQUENCE_MAJOR:
            source = heads_transposed(bound.get(arg))
            if source is None or not source.same_as(param):
                raise Unsupported(f"{symbol}: {name} must be permute_dims({name}, [0, 2, 1, 3]) of its parameter")
        elif not arg.same_as(param):
            raise Unsupported(f"{symbol}: the call's tensor arguments must be the parameters {spec.inputs} in order")
    return spec

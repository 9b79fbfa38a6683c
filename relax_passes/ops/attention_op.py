"""Fused training attention as two Relax ops, ``tvm_evt.attention`` and ``tvm_evt.attention_backward``.

Registered (once) when this module is imported::

    (o, lse)      = tvm_evt.attention(q, k, v, seed, scale, causal, dropout, site[, bias])
    (dq, dk, dv)  = tvm_evt.attention_backward(q, k, v, o, lse, do, seed, scale, causal, dropout, site[, bias])

* ``q`` [B, H, Sq, D], ``k`` and ``v`` [B, Hkv, Sk, D]: one float dtype (float32, float16 or bfloat16);
  ``o`` and ``do`` [B, H, Sq, D] in that dtype; ``lse`` [B, H, Sq] float32.  Hkv divides H: grouped-query
  attention, each key/value head read by H / Hkv query heads in a row (transformers' ``repeat_kv``,
  SDPA's ``enable_gqa``), the values below as over K and V repeated so; dK and dV add up over each
  group (``repeat_heads``).
* ``seed``: the uint32 tensor of shape (2,) that `LowerDropout` makes the function's ``rng_seed``
  parameter (any (2,) uint32 tensor, e.g. zeros, when there is no dropout: it is then not read).
* ``scale``, ``dropout``: float32 prim values (``relax.prim_value(x, "float32")``); ``causal``,
  ``site``: int64 prim values.
* ``bias`` (optional): float32 [Sk], added to every row of the scaled scores (ViT's padded keys: -inf);
  a constant as far as differentiation goes (the gradient rule gives it none).

Forward, with ``S = scale · Q Kᵀ + bias`` and the key ``j > i`` of query ``i`` masked to -inf when
``causal``::

    lse = log Σ_j exp(S_ij)                      (natural log, float32)
    P   = exp(S - lse)                           (the softmax)
    O   = dropout(P) V,  dropout(P) = where(keep, P, 0) · float32(1 / (1 - p))

where ``keep`` is exactly LowerDropout's Philox mask of site ``site`` over the row-major
[B, H, Sq, Sk] index (`philox` documents the convention): ``keep_mask_function(bb, [B, H, Sq, Sk],
p)`` called on ``(seed, site)``.  ``lse`` is a saved statistic for the backward: the gradient rule
ignores any gradient that reaches it (nothing but the backward op reads it in a training graph).

Backward (FlashAttention-2's), recomputing ``P = exp(S - lse)`` and with ``D = rowsum(dO ∘ O)``::

    dV = dropout(P)ᵀ dO;   dPd = dO Vᵀ;   dP = where(keep, dPd, 0) / (1 - p)
    dS = P ∘ (dP - D);     dQ = scale · dS K;   dK = scale · dSᵀ Q

``decompose_attention`` / ``decompose_attention_backward`` write exactly this with plain Relax ops
(softmax statistics and ``dS`` in float32, GEMMs accumulated in float32 and rounded to the inputs'
dtype, ``P`` and ``dS`` rounded to it before their GEMMs as a flash-attention kernel does).  They
are the ops' ``FLegalize`` (the CPU reference path) and the CUDA route's fallback for calls the
kernels cannot take.  ``attention`` / ``attention_backward`` build calls from Python values.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import tvm
import tvm_ffi
from tvm import relax
from tvm.relax import op as R
from tvm.relax.op.grad import no_grad

from ..training.gradient_rules import register_op
from ..training.lower_dropout import keep_mask_function

FORWARD = "tvm_evt.attention"
BACKWARD = "tvm_evt.attention_backward"

# the tensor operands before ``seed``; the prim operands ``scale, causal, dropout, site`` follow it
TENSORS = {FORWARD: ("q", "k", "v"), BACKWARD: ("q", "k", "v", "o", "lse", "do")}
PRIMS = ("scale", "causal", "dropout", "site")
PRIM_DTYPES = {"scale": "float32", "causal": "int64", "dropout": "float32", "site": "int64"}
FLOATS = ("float32", "float16", "bfloat16")


class AttentionOpError(ValueError):
    """A ``tvm_evt.attention`` / ``tvm_evt.attention_backward`` call with malformed operands."""


@dataclasses.dataclass(frozen=True)
class AttentionAttrs:
    """The prim operands of a call, as Python values."""

    scale: float
    causal: bool
    dropout: float
    site: int

    def prims(self) -> list[relax.Expr]:
        return [relax.prim_value(float(self.scale), "float32"), relax.prim_value(int(self.causal), "int64"),
                relax.prim_value(float(self.dropout), "float32"), relax.prim_value(int(self.site), "int64")]


@dataclasses.dataclass(frozen=True)
class Operands:
    """The operands of a call by name (``bias`` None where not given)."""

    tensors: dict  # name -> expr, in TENSORS order
    seed: relax.Expr
    attrs: AttentionAttrs
    bias: relax.Expr | None


def _fail(name: str, why: str) -> AttentionOpError:
    return AttentionOpError(f"{name}: {why}")


def _prim(expr: relax.Expr, what: str, name: str):
    if not isinstance(expr, (tvm.tirx.IntImm, tvm.tirx.FloatImm)):
        raise _fail(name, f"{what} must be a constant prim value (relax.prim_value), got {expr}")
    return expr.value


def operands(call: relax.Call) -> Operands:
    """Split a call of either op into its operands (raises `AttentionOpError` on a wrong arity or
    non-constant prim operands)."""
    name = call.op.name
    tensors = TENSORS[name]
    n = len(tensors)
    if len(call.args) not in (n + 5, n + 6):
        raise _fail(name, f"expected {n + 5} arguments ({', '.join(tensors)}, seed, {', '.join(PRIMS)}) "
                          f"or {n + 6} (and bias), got {len(call.args)}")
    scale, causal, dropout, site = (_prim(call.args[n + 1 + i], what, name) for i, what in enumerate(PRIMS))
    attrs = AttentionAttrs(float(scale), bool(causal), float(dropout), int(site))
    bias = call.args[n + 5] if len(call.args) == n + 6 else None
    return Operands(dict(zip(tensors, call.args[:n])), call.args[n], attrs, bias)


# ------------------------------------------------------------------------------- constructors


def attention(q, k, v, seed, scale: float, causal: bool = False, dropout: float = 0.0, site: int = 0,
              bias=None) -> relax.Call:
    """A ``tvm_evt.attention`` call; its value is ``(O, LSE)``."""
    attrs = AttentionAttrs(scale, causal, dropout, site)
    return relax.Call(tvm.ir.Op.get(FORWARD), [q, k, v, seed, *attrs.prims(), *([bias] if bias is not None else [])])


def attention_backward(q, k, v, o, lse, do, seed, scale: float, causal: bool = False, dropout: float = 0.0,
                       site: int = 0, bias=None) -> relax.Call:
    """A ``tvm_evt.attention_backward`` call; its value is ``(dQ, dK, dV)``."""
    attrs = AttentionAttrs(scale, causal, dropout, site)
    args = [q, k, v, o, lse, do, seed, *attrs.prims(), *([bias] if bias is not None else [])]
    return relax.Call(tvm.ir.Op.get(BACKWARD), args)


MASKED_BELOW = -1e30  # an additive mask entry at or below this masks its score (torch.finfo(dtype).min does)


def mask_form(mask: np.ndarray, shape) -> tuple[bool, np.ndarray | None] | str:
    """What a constant attention mask over scores of `shape` [B, H, Sq, Sk] is in this op's terms:
    ``(causal, bias)`` with ``bias`` float32 [Sk] or None, when every (batch, head) sees one pattern
    that is a key mask (one row for all queries), the causal triangle (key j visible to query i iff
    j <= i), or both, and every query sees a key; else the reason it is not (a str).  A bool mask
    marks the visible scores; a float mask is added to them: entries at or below ``MASKED_BELOW``
    (-inf, torch.finfo(dtype).min) mask, any other value is a bias that must be the same for every
    query."""
    mask = np.asarray(mask)
    try:
        np.broadcast_shapes(mask.shape, tuple(shape))
    except ValueError:
        return f"mask {list(mask.shape)} does not broadcast to the scores {list(shape)}"
    if mask.ndim < 2:
        mask = mask.reshape((1,) * (2 - mask.ndim) + mask.shape)
    # compared over the mask's own leading extents: broadcast to [B, H, Sq, Sk] it would be the size
    # of the scores (GPT-2 medium at batch 52: 52 GB of bools)
    rows = mask.reshape(-1, *mask.shape[-2:])
    if not (rows == rows[:1]).all():
        return "the mask differs between batch rows or heads"
    pattern = np.broadcast_to(rows[0], tuple(shape[-2:]))
    if pattern.dtype == np.bool_:
        visible, added = pattern, np.zeros(pattern.shape, np.float32)
    elif np.issubdtype(pattern.dtype, np.floating):
        visible = pattern > MASKED_BELOW
        added = np.where(visible, pattern, 0).astype(np.float32)
    else:
        return f"a {pattern.dtype} mask"
    if not visible.any(-1).all():
        return "a query sees no key"
    sq, sk = shape[-2:]
    keys = visible[-1]  # under the causal triangle too, the last query sees every key any query sees
    for causal in (False, True):
        expected = np.broadcast_to(keys, (sq, sk)) & (np.tri(sq, sk, dtype=bool) if causal else True)
        if (visible == expected).all() and (added == added[-1]).all():
            unbiased = keys.all() and not added.any()
            return causal, None if unbiased else np.where(keys, added[-1], -np.inf).astype(np.float32)
    return "the mask is neither a key mask nor the causal triangle"


def no_seed() -> relax.Expr:
    """The seed operand of an attention without dropout (not read)."""
    return relax.const(np.zeros(2, "uint32"))


# ------------------------------------------------------------------------------- type inference


def _tensor_type(expr: relax.Expr, what: str, name: str) -> relax.TensorType:
    ty = expr.ty
    if not isinstance(ty, relax.TensorType) or ty.shape is None:
        raise _fail(name, f"{what} must be a tensor of known shape, got {ty}")
    return ty


def _dims(ty: relax.TensorType) -> list:
    return list(ty.shape.values)


def _same(a, b) -> bool:
    """Do two extents agree (structurally; static ones by value)?"""
    return bool(tvm_ffi.structural_equal(a, b))


def _check_operands(call: relax.Call) -> Operands:
    """The operands of `call`, their dtypes and shapes checked against the module docstring."""
    name = call.op.name
    ops = operands(call)
    types = {what: _tensor_type(e, what, name) for what, e in ops.tensors.items()}
    q = types["q"]
    dtype = str(q.dtype)
    if dtype not in FLOATS:
        raise _fail(name, f"q is {dtype}; expected one of {', '.join(FLOATS)}")
    if q.ndim != 4:
        raise _fail(name, f"q must be [B, H, Sq, D], got {q.shape}")
    b, h, sq, d = _dims(q)
    for what, ty in types.items():
        want = "float32" if what == "lse" else dtype
        if str(ty.dtype) != want:
            raise _fail(name, f"{what} is {ty.dtype}, expected {want}")
    k = types["k"]
    if k.ndim != 4 or not all(_same(x, y) for x, y in zip(_dims(k), [b, None, None, d]) if y is not None) \
            or not _groups(h, _dims(k)[1]):
        b_, h_, d_ = (x.value if isinstance(x, tvm.tirx.IntImm) else x for x in (b, h, d))
        raise _fail(name, f"k must be [B, Hkv, Sk, D] = [{b_}, Hkv, Sk, {d_}] with Hkv dividing {h_}, got {k.shape}")
    hk, sk = _dims(k)[1:3]
    expect = {"v": [b, hk, sk, d], "o": [b, h, sq, d], "do": [b, h, sq, d], "lse": [b, h, sq]}
    for what, shape in expect.items():
        if what in types and (types[what].ndim != len(shape)
                              or not all(_same(x, y) for x, y in zip(_dims(types[what]), shape))):
            raise _fail(name, f"{what} must have shape {shape}, got {types[what].shape}")
    seed = _tensor_type(ops.seed, "seed", name)
    if str(seed.dtype) != "uint32" or seed.ndim != 1 or not _same(_dims(seed)[0], tvm.tirx.IntImm("int64", 2)):
        raise _fail(name, f"seed must be a uint32 tensor of shape (2,), got {seed}")
    for what, arg in zip(PRIMS, call.args[len(types) + 1 : len(types) + 5]):
        if str(arg.ty.dtype) != PRIM_DTYPES[what]:
            raise _fail(name, f"{what} must be a {PRIM_DTYPES[what]} prim value, got {arg.ty.dtype}")
    if not 0.0 <= ops.attrs.dropout < 1.0:
        raise _fail(name, f"dropout rate {ops.attrs.dropout} outside [0, 1)")
    if ops.bias is not None:
        bias = _tensor_type(ops.bias, "bias", name)
        if str(bias.dtype) != "float32" or bias.ndim != 1 or not _same(_dims(bias)[0], sk):
            raise _fail(name, f"bias must be float32 [Sk] = [{sk}], got {bias}")
    return ops


def _groups(heads, kv_heads) -> int:
    """Query heads a key/value head (0 where `kv_heads` does not divide `heads`; symbolic extents
    group only when equal)."""
    if _same(heads, kv_heads):
        return 1
    if isinstance(heads, tvm.tirx.IntImm) and isinstance(kv_heads, tvm.tirx.IntImm) and kv_heads.value > 0 \
            and heads.value % kv_heads.value == 0:
        return heads.value // kv_heads.value
    return 0


def _infer_forward(call: relax.Call, _bb) -> relax.TupleType:
    q = _check_operands(call).tensors["q"].ty
    b, h, sq, _ = _dims(q)
    return relax.TupleType([relax.TensorType(q.shape, q.dtype), relax.TensorType([b, h, sq], "float32")])


def _infer_backward(call: relax.Call, _bb) -> relax.TupleType:
    tensors = _check_operands(call).tensors
    return relax.TupleType([relax.TensorType(tensors[w].ty.shape, tensors[w].ty.dtype) for w in ("q", "k", "v")])


# ------------------------------------------------------------------------------- decomposition


def _static(expr: relax.Expr, name: str) -> list[int]:
    try:
        return [int(s) for s in expr.ty.shape.values]
    except TypeError as err:
        raise _fail(name, f"decomposition needs static shapes, got {expr.ty.shape}") from err


def _gemm(bb, a, b, dtype: str):
    """``a @ b`` accumulated in float32, rounded to `dtype`."""
    out = bb.emit(R.matmul(a, b, out_dtype="float32"))
    return out if dtype == "float32" else bb.emit(R.astype(out, dtype))


def _cast(bb, x, dtype: str):
    return x if str(x.ty.dtype) == dtype else bb.emit(R.astype(x, dtype))


def _transpose(x):
    return R.permute_dims(x, [0, 1, 3, 2])


def _scores(bb, ops: Operands, name: str):
    """float32 ``scale · Q Kᵀ + bias``, masked causally: [B, H, Sq, Sk]."""
    q, k = ops.tensors["q"], ops.tensors["k"]
    s = bb.emit(R.multiply(bb.emit(R.matmul(q, _transpose(k), out_dtype="float32")),
                           relax.const(ops.attrs.scale, "float32")))
    if ops.bias is not None:
        s = bb.emit(R.add(s, ops.bias))
    if ops.attrs.causal:
        sq, sk = _static(q, name)[2], _static(k, name)[2]
        rows = R.expand_dims(R.arange(0, sq, 1, "int64"), [1])
        cols = R.expand_dims(R.arange(0, sk, 1, "int64"), [0])
        above = bb.emit(R.greater(cols, rows))  # key j > query i
        s = bb.emit(R.where(above, relax.const(-np.inf, "float32"), s))
    return s


def _keep(bb, ops: Operands, shape: list[int]):
    """LowerDropout's Philox keep mask of site ``ops.attrs.site`` over `shape`."""
    gvar = keep_mask_function(bb, shape, ops.attrs.dropout)
    site = relax.const(ops.attrs.site, "uint32")
    return bb.emit(relax.call_tir(gvar, [ops.seed, site], relax.TensorType(shape, "bool")))


def _dropped(bb, x, keep, rate: float):
    """where(keep, x, 0) · float32(1 / (1 - rate)) (LowerDropout's form)."""
    kept = bb.emit(R.where(keep, x, relax.const(0.0, "float32")))
    return bb.emit(R.multiply(kept, relax.const(1.0 / (1.0 - rate), "float32")))


def repeat_heads(bb, x: relax.Expr, heads: int) -> relax.Expr:
    """[B, Hkv, S, D] -> [B, heads, S, D], each key/value head read by heads / Hkv query heads in a
    row (`x` itself where Hkv = heads)."""
    b, hk, s, d = _static(x, "repeat_heads")
    if hk == heads:
        return x
    if heads % hk:
        raise _fail("repeat_heads", f"{heads} query heads over {hk} key/value heads")
    wide = bb.emit(R.broadcast_to(R.expand_dims(x, [2]), [b, hk, heads // hk, s, d]))
    return bb.emit(R.reshape(wide, [b, heads, s, d]))


def _sum_heads(bb, x: relax.Expr, kv_heads: int) -> relax.Expr:
    """[B, H, S, D] -> [B, kv_heads, S, D]: the sum over each group of H / kv_heads heads (the
    gradient of `repeat_heads`; the backward decomposition's)."""
    b, h, s, d = _static(x, BACKWARD)
    if h == kv_heads:
        return x
    return bb.emit(R.sum(bb.emit(R.reshape(x, [b, kv_heads, h // kv_heads, s, d])), axis=[2]))


def _grouped(bb, ops: Operands, name: str) -> Operands:
    """`ops` with k and v repeated over the query heads (grouped-query attention)."""
    if _groups(_dims(ops.tensors["q"].ty)[1], _dims(ops.tensors["k"].ty)[1]) == 1:
        return ops
    heads = _static(ops.tensors["q"], name)[1]
    tensors = dict(ops.tensors, k=repeat_heads(bb, ops.tensors["k"], heads), v=repeat_heads(bb, ops.tensors["v"], heads))
    return dataclasses.replace(ops, tensors=tensors)


def decompose_attention(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
    """``tvm_evt.attention`` in plain Relax ops, bound in `bb`: the ``(O, LSE)`` tuple."""
    ops = _grouped(bb, _check_operands(call), FORWARD)
    q, v = ops.tensors["q"], ops.tensors["v"]
    dtype = str(q.ty.dtype)
    s = _scores(bb, ops, FORWARD)
    row_max = bb.emit(R.max(s, axis=[-1], keepdims=True))
    e = bb.emit(R.exp(bb.emit(R.subtract(s, row_max))))
    total = bb.emit(R.sum(e, axis=[-1], keepdims=True))
    p = bb.emit(R.divide(e, total))
    lse = bb.emit(R.squeeze(bb.emit(R.add(bb.emit(R.log(total)), row_max)), axis=[-1]))
    if ops.attrs.dropout > 0.0:
        p = _dropped(bb, p, _keep(bb, ops, _static(s, FORWARD)), ops.attrs.dropout)
    o = _gemm(bb, _cast(bb, p, dtype), v, dtype)
    return relax.Tuple([o, lse])


def decompose_attention_backward(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
    """``tvm_evt.attention_backward`` in plain Relax ops, bound in `bb`: the ``(dQ, dK, dV)`` tuple."""
    checked = _check_operands(call)
    ops = _grouped(bb, checked, BACKWARD)
    q, k, v, o, lse, do = (ops.tensors[w] for w in TENSORS[BACKWARD])
    dtype = str(q.ty.dtype)
    s = _scores(bb, ops, BACKWARD)
    p = bb.emit(R.exp(bb.emit(R.subtract(s, R.expand_dims(lse, [-1])))))
    # D = rowsum(dO ∘ O) = rowsum(P ∘ dP): the softmax backward's row term without the S×S product
    d = bb.emit(R.sum(bb.emit(R.multiply(_cast(bb, do, "float32"), _cast(bb, o, "float32"))),
                      axis=[-1], keepdims=True))
    dpd = bb.emit(R.matmul(do, _transpose(v), out_dtype="float32"))  # the gradient of dropout(P)
    pd, dp = p, dpd
    if ops.attrs.dropout > 0.0:
        keep = _keep(bb, ops, _static(s, BACKWARD))
        pd = _dropped(bb, p, keep, ops.attrs.dropout)
        dp = _dropped(bb, dpd, keep, ops.attrs.dropout)
    dv = bb.emit(R.matmul(_transpose(_cast(bb, pd, dtype)), do, out_dtype="float32"))
    ds = bb.emit(R.multiply(p, bb.emit(R.subtract(dp, d))))
    ds_low = _cast(bb, ds, dtype)
    scale = relax.const(ops.attrs.scale, "float32")
    dq = bb.emit(R.multiply(bb.emit(R.matmul(ds_low, k, out_dtype="float32")), scale))
    dk = bb.emit(R.multiply(bb.emit(R.matmul(_transpose(ds_low), q, out_dtype="float32")), scale))
    # a group's dK and dV add up in float32 before they are rounded, as the kernels' registers do
    if ops is not checked:
        kv_heads = _static(checked.tensors["k"], BACKWARD)[1]
        dk, dv = (_sum_heads(bb, x, kv_heads) for x in (dk, dv))
    dk, dv = (_cast(bb, x, dtype) for x in (dk, dv))
    return relax.Tuple([_cast(bb, dq, dtype), dk, dv])


# ------------------------------------------------------------------------------- gradient


def attention_grad(orig_var, orig_call, output_grad, ctx):
    """``tvm_evt.attention_backward`` on the forward's own outputs: ``[dQ, dK, dV]`` and no gradient
    for the seed, the prim operands and the bias.

    Only ``O``'s adjoint (``output_grad[0]``; `Gradient` passes a var of tuple type, a ``Tuple``
    is taken as well) is read: ``LSE`` is a statistic saved for the backward, and a gradient
    reaching it is ignored."""
    ops = operands(orig_call)
    if isinstance(output_grad, relax.Tuple):
        do = output_grad.fields[0]
    else:
        do = ctx.emit(relax.TupleGetItem(output_grad, 0))
    o = ctx.emit(relax.TupleGetItem(orig_var, 0))
    lse = ctx.emit(relax.TupleGetItem(orig_var, 1))
    q, k, v = (ops.tensors[w] for w in TENSORS[FORWARD])
    a = ops.attrs
    grads = ctx.emit(attention_backward(q, k, v, o, lse, do, ops.seed, a.scale, a.causal, a.dropout, a.site,
                                        ops.bias))
    return [relax.TupleGetItem(grads, i) for i in range(3)] + [no_grad(arg) for arg in orig_call.args[3:]]


# ------------------------------------------------------------------------------- registration


register_op(FORWARD, "fused training attention: (O, LSE) of softmax(scale * Q K^T [+ bias] [causal]) with dropout",
            _infer_forward, decompose_attention, attention_grad)
register_op(BACKWARD, "gradient of tvm_evt.attention: (dQ, dK, dV)", _infer_backward, decompose_attention_backward)

"""PadAttentionKeys: attention over a key length that is not a multiple of 16, padded to one.

CUTLASS's SM90 main loops read and write through TMA, which needs 16-byte aligned row strides:
a key length that is not a multiple of 8 (197 tokens, say, as ViT-B/16 has) gives bf16 score rows
of 394 bytes, so all six attention GEMMs of such a layer
(scores, context, and their four gradients) fall back to TVM's DLight GEMM (1.9 ms of a
ViT-B/16 step on H100), and a bool dropout mask read by an epilogue needs rows of 16 bytes.
This pass pads the *key* axis to the next multiple of 16 (208 for 197), before
``Gradient``, so the backward follows by itself:

    scores = Q · Kᵀ                    scores = Q · concat(Kᵀ, 0)            [.., Sq, Sk']
    ... elementwise / reshape ...      ... the same ops at the padded width ...
    P = softmax(x)                     P = softmax(x + bias)    bias = (0, .., 0, -inf, ..)
    ... dropout ...                    ... dropout with a mask of the padded shape ...
    out = P · V                        out = P · concat(V, 0)               [.., Sq, d]

The padded keys get probability 0 (their bias is -inf) and meet zero rows of V, so ``out`` and
the gradients of Q, K and V are unchanged; the dropout mask is drawn at the padded shape (a
different mask with the same distribution).  The query axis needs no padding: it is a GEMM's M,
or a K whose remainder TMA's out-of-bounds fill covers.

A chain is rewritten only when every op between the two GEMMs is a step of ``CHAIN`` read by
nothing but the next op, every value keeps the key axis last, and exactly one softmax over the
key axis sits in it (``find_chains``).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np
import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from .._rewrite import bind_as, binding_uses, drop_unreferenced, flat_bindings, op_name, scalar_value, static_shape
from .lower_dropout import keep_mask_function
from .philox import KEEP_RATE_ATTR

ALIGN = 16  # elements: 16 bytes of the bool dropout mask (and 32 of bf16), what TMA needs of a row stride

MATMUL = tvm.ir.Op.get("relax.matmul")
SOFTMAX = tvm.ir.Op.get("relax.nn.softmax")
CALL_TIR = tvm.ir.Op.get("relax.call_tir")


@dataclasses.dataclass(frozen=True)
class Context:
    """What a step's check and rebuild may look at: the module and the function's bindings."""

    mod: tvm.IRModule
    bound: dict  # var -> bound value

    @staticmethod
    def of(func: relax.Function, mod: tvm.IRModule) -> Context:
        return Context(mod, {b.var: b.value for b in flat_bindings(func)[0]})


def _is_scalar(ctx: Context, expr: relax.Expr) -> bool:
    return scalar_value(ctx.bound, expr) is not None


def keep_rate(ctx: Context, keep: relax.Expr) -> float | None:
    """The rate of the Philox keep mask `keep` (``call_tir`` of a LowerDropout kernel), else None."""
    call = ctx.bound.get(keep)
    if not (isinstance(call, relax.Call) and call.op == CALL_TIR and call.args[0] in ctx.mod.get_global_vars()):
        return None
    attrs = ctx.mod[call.args[0]].attrs
    return float(attrs[KEEP_RATE_ATTR]) if attrs is not None and KEEP_RATE_ATTR in attrs else None


def _widened(call: relax.Call, keys: int) -> list[int]:
    return [*(int(s) for s in call.args[1].values[:-1]), keys]


@dataclasses.dataclass(frozen=True)
class Step:
    """One op kind a chain may hold: ``legal(call, x, ctx)`` says `call` is a step from `x`;
    ``rebuild(call, x, keys, builder, ctx, old)`` is the same op at key width `keys` reading the
    padded `x` in place of the chain's `old` value (`builder` binds any extra expression it needs)."""

    legal: Callable
    rebuild: Callable


def _reads_only(call, x, _ctx) -> bool:
    return call.args[0].same_as(x)


def _with_scalar(call, x, ctx) -> bool:
    a, b = call.args
    return (a.same_as(x) and _is_scalar(ctx, b)) or (b.same_as(x) and _is_scalar(ctx, a))


def _binary(call, x, keys, builder, ctx, old):
    return relax.Call(call.op, [x if a.same_as(old) else a for a in call.args], call.attrs)


def _softmax_over_keys(call, x, _ctx) -> bool:
    return call.args[0].same_as(x) and int(call.attrs.axis) in (-1, x.ty.ndim - 1)


def _masked_softmax(call, x, keys, builder, ctx, old):
    dtype = str(x.ty.dtype)
    real = int(old.ty.shape.values[-1])
    bias = np.zeros([keys], dtype="float32")
    bias[real:] = -np.inf  # the padded keys get probability 0
    return relax.op.nn.softmax(builder.emit(relax.op.add(x, relax.const(bias.astype(dtype), dtype))), axis=-1)


def _dropout_where(call, x, ctx) -> bool:  # LowerDropout's where(keep, x, 0)
    keep, a, b = call.args
    return a.same_as(x) and _is_scalar(ctx, b) and keep_rate(ctx, keep) is not None


def _padded_dropout(call, x, keys, builder, ctx, old):
    keep, _, zero = call.args
    shape = [int(s) for s in x.ty.shape.values]
    site_args = list(ctx.bound[keep].args[1].fields)
    gvar = keep_mask_function(builder, shape, keep_rate(ctx, keep))
    new_keep = builder.emit(relax.call_tir(gvar, site_args, relax.TensorType(shape, "bool")))
    return relax.op.where(new_keep, x, zero)


CHAIN = {
    "relax.reshape": Step(_reads_only, lambda c, x, k, b, ctx, o: relax.op.reshape(x, _widened(c, k))),
    "relax.broadcast_to": Step(_reads_only, lambda c, x, k, b, ctx, o: relax.op.broadcast_to(x, _widened(c, k))),
    "relax.astype": Step(_reads_only, lambda c, x, k, b, ctx, o: relax.op.astype(x, c.attrs.dtype)),
    "relax.multiply": Step(_with_scalar, _binary),
    "relax.divide": Step(_with_scalar, _binary),
    "relax.add": Step(_with_scalar, _binary),
    "relax.subtract": Step(_with_scalar, _binary),
    "relax.nn.softmax": Step(_softmax_over_keys, _masked_softmax),
    "relax.where": Step(_dropout_where, _padded_dropout),
}


@dataclasses.dataclass(frozen=True)
class Chain:
    scores: relax.VarBinding  # matmul(Q, Kᵀ), its last axis the keys
    steps: tuple  # the bindings between, in order
    out: relax.VarBinding  # matmul(P, V)
    keys: int  # the padded key length


def find_chains(func: relax.Function, mod: tvm.IRModule, ctx: Context | None = None) -> list[Chain]:
    """The attention chains of `func` whose key length is not a multiple of ``ALIGN`` (`ctx`:
    ``Context.of(func, mod)``, made here unless given)."""
    bindings = flat_bindings(func)[0]
    ctx = ctx or Context.of(func, mod)
    uses = binding_uses(func)
    chains = []
    for b in bindings:
        shape = static_shape(b.var)
        if not (isinstance(b.value, relax.Call) and b.value.op == MATMUL and shape and len(shape) >= 2
                and shape[-1] % ALIGN):
            continue
        keys, x, steps = shape[-1], b.var, []
        while True:
            readers = uses.get(x, [])
            if len(readers) != 1 or readers[0] >= len(bindings):
                break
            nxt = bindings[readers[0]]
            call = nxt.value
            if op_name(call) is None:
                break
            if call.op == MATMUL:
                if call.args[0].same_as(x) and not call.args[1].same_as(x) and \
                        sum(s.value.op == SOFTMAX for s in steps) == 1:
                    chains.append(Chain(b, tuple(steps), nxt, -(-keys // ALIGN) * ALIGN))
                break
            step = CHAIN.get(call.op.name)
            out_shape = static_shape(nxt.var)
            if step is None or not step.legal(call, x, ctx) or not out_shape or out_shape[-1] != keys:
                break
            steps.append(nxt)
            x = nxt.var
    return chains


def _zeros_like_padding(x: relax.Expr, axis: int, pad: int) -> relax.Expr:
    shape = [int(s) for s in x.ty.shape.values]
    shape[axis] = pad
    return relax.op.zeros(shape, str(x.ty.dtype))


@mutator
class _Padder(PyExprMutator):
    def __init__(self, mod: tvm.IRModule):
        super().__init__(mod)
        self.mod = mod
        self.roles: dict = {}  # var -> (chain, role)
        self.padded: dict = {}  # old chain var -> its padded replacement
        self.ctx: Context | None = None

    def prime(self, func: relax.Function) -> bool:
        self.ctx = Context.of(func, self.mod)
        chains = find_chains(func, self.mod, self.ctx)
        self.roles = {}
        for c in chains:
            self.roles[c.scores.var] = (c, "scores")
            for s in c.steps:
                self.roles[s.var] = (c, "step")
            self.roles[c.out.var] = (c, "out")
        return bool(chains)

    def _bind(self, old: relax.Var, expr: relax.Expr) -> relax.Var:
        new = bind_as(self.builder_, old, expr)
        self.set_var_remap(old, new)
        return new

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        role = self.roles.get(binding.var)
        if role is None:
            super().visit_var_binding_(binding)
            return
        chain, kind = role
        call = binding.value
        if kind == "scores":
            q, kt = (self.visit_expr(a) for a in call.args)
            real = int(kt.ty.shape.values[-1])
            kt = self.builder_.emit(relax.op.concat([kt, _zeros_like_padding(kt, -1, chain.keys - real)], axis=-1))
            self.padded[binding.var] = self._bind(binding.var, relax.Call(call.op, [q, kt], call.attrs))
        elif kind == "step":
            prev = next(a for a in call.args if a in self.padded)
            step = CHAIN[call.op.name]
            expr = step.rebuild(call, self.padded[prev], chain.keys, self.builder_, self.ctx, prev)
            self.padded[binding.var] = self._bind(binding.var, expr)
        else:
            p = self.padded[call.args[0]]
            v = self.visit_expr(call.args[1])
            real = int(v.ty.shape.values[-2])
            v = self.builder_.emit(relax.op.concat([v, _zeros_like_padding(v, -2, chain.keys - real)], axis=-2))
            self._bind(binding.var, relax.Call(call.op, [p, v], call.attrs))


@tvm.transform.module_pass(opt_level=0, name="PadAttentionKeys")
class PadAttentionKeys:
    """Pad the key axis of misaligned attention to a multiple of ``ALIGN`` (module docstring)."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        padder = _Padder(mod)
        changed = False
        for gv, func in mod.functions_items():
            if isinstance(func, relax.Function) and padder.prime(func):
                padder.builder_.update_func(gv, padder.visit_expr(func))
                changed = True
        if not changed:
            return mod
        # the keep masks drawn at the padded shapes replace the old ones
        out = relax.transform.DeadCodeElimination()(padder.builder_.get())
        return drop_unreferenced(out, lambda f: bool(f.attrs) and KEEP_RATE_ATTR in f.attrs)

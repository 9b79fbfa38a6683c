"""LowerDropout: training-mode ``relax.nn.dropout`` into a Philox mask multiply.

Each dropout site ``d = R.nn.dropout(x, rate)`` becomes

    keep = call_tir(dropout_keep_<shape>_<p>, (seed, site))   # bool, shaped like x
    d    = (where(keep, x, 0) * (1 / (1 - p)), keep)

where ``seed`` is a new trailing parameter ``rng_seed: R.Tensor((2,), "uint32")`` of the
function and ``site`` numbers the dropout ops in binding order.  The gradient of ``where`` routes
``grad`` through the very same ``keep`` mask and none into the RNG — see `philox` for the
counter convention.  A ``tvm_evt.attention`` call with dropout (SDPA's, as imported) takes the
same seed and the next site number as its ``seed`` and ``site`` operands: it draws its own mask,
by the same convention.  Functions without dropout are untouched.
"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from .._rewrite import add_function_once, has_call, sub_expressions
from .philox import dropout_keep_primfunc

SEED_PARAM = "rng_seed"


DROPOUT = tvm.ir.Op.get("relax.nn.dropout")
ATTENTION = "tvm_evt.attention"


def _attention_dropout(expr: relax.Expr) -> bool:
    """Is `expr` a ``tvm_evt.attention`` call with a dropout rate above 0?"""
    if not (isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op) and expr.op.name == ATTENTION):
        return False
    from ..ops import attention_op  # the op module imports this one

    return attention_op.operands(expr).attrs.dropout > 0.0


def _has_dropout(body: relax.Expr) -> bool:
    return any(_attention_dropout(e) for e in sub_expressions(body)) or has_call(body, DROPOUT)


def keep_mask_function(builder: relax.BlockBuilder, shape, rate: float) -> relax.GlobalVar:
    """The Philox keep-mask kernel for `shape` and `rate` in `builder`'s module (added once)."""
    shape = [int(s) for s in shape]
    tag = f"{rate:.6g}".replace(".", "p")
    return add_function_once(builder, f"dropout_keep_{'x'.join(map(str, shape))}_{tag}",
                             lambda: dropout_keep_primfunc(shape, rate))


@mutator
class _DropoutLowerer(PyExprMutator):
    def __init__(self, mod: tvm.IRModule, seed: relax.Var):
        super().__init__(mod)
        self.seed = seed
        self.sites = 0

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if _attention_dropout(call):
            return self._seed_attention(call)
        if call.op != DROPOUT:
            return call
        x = call.args[0]
        rate = float(call.attrs.rate)
        shape = [int(s) for s in x.ty.shape]
        dtype = str(x.ty.dtype)
        site = self.sites
        self.sites += 1
        if rate == 0.0:
            return relax.Tuple([x, relax.op.ones_like(x, "bool")])
        gvar = keep_mask_function(self.builder_, shape, rate)
        keep = self.builder_.emit(
            relax.call_tir(
                gvar, [self.seed, relax.const(site, "uint32")], relax.TensorType(shape, "bool")
            )
        )
        # where() treats its condition as non-differentiable: no gradient reaches the RNG
        kept = self.builder_.emit(relax.op.where(keep, x, relax.const(0, dtype)))
        out = self.builder_.emit(relax.op.multiply(kept, relax.const(1.0 / (1.0 - rate), dtype)))
        return relax.Tuple([out, keep])

    def _seed_attention(self, call: relax.Call) -> relax.Call:
        from ..ops import attention_op

        ops = attention_op.operands(call)
        attrs = ops.attrs
        site = self.sites
        self.sites += 1
        q, k, v = ops.tensors.values()
        return attention_op.attention(q, k, v, self.seed, attrs.scale, attrs.causal, attrs.dropout, site, ops.bias)


@tvm.transform.module_pass(opt_level=0, name="LowerDropout")
class LowerDropout:
    """Replace relax.nn.dropout with a Philox mask seeded by a new ``rng_seed`` parameter."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        targets = [
            (gv, f)
            for gv, f in mod.functions_items()
            if isinstance(f, relax.Function) and _has_dropout(f.body)
        ]
        if not targets:
            return mod
        for gv, func in targets:
            seed = relax.Var(SEED_PARAM, relax.TensorType((2,), "uint32"))
            lowerer = _DropoutLowerer(mod, seed)
            body = lowerer.visit_expr(func.body)
            new_func = relax.Function(
                list(func.params) + [seed], body, func.ret_ty, func.is_pure, func.attrs
            )
            lowerer.builder_.update_func(gv, new_func)
            mod = lowerer.builder_.get()
        return mod

"""AutoMixedPrecision: run a forward graph in bf16/fp16 against fp32 master weights.

Every op states the dtype it wants for its floating-point inputs, by a policy table:

* ``FP32``   — numerically sensitive ops (normalisations, softmax, losses, reductions,
  exp/log) compute in fp32;
* ``FOLLOW`` — layout and indexing ops keep whatever dtype arrives (no cast);
* everything else computes in the low-precision dtype.

Floating inputs whose dtype differs from what the op wants are cast on use, so fp32
parameters become bf16 at their first low-precision consumer and the gradient of that
``astype`` (TVM's own rule) hands fp32 gradients back to the master weights.  ``matmul``
and ``astype`` to fp32 are retargeted to the low dtype outside FP32 ops.  The function's
outputs keep their original dtypes (the loss stays fp32).
"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from ._rewrite import rewrite_function
from .append_optimizer import LOSS_SCALE_PARAM

FP32 = frozenset(
    {
        "relax.nn.softmax",
        "relax.nn.log_softmax",
        "relax.nn.layer_norm",
        "relax.nn.batch_norm",
        "relax.nn.rms_norm",
        "relax.nn.group_norm",
        "relax.nn.cross_entropy_with_logits",
        "relax.nn.nll_loss",
        "relax.sum",
        "relax.mean",
        "relax.variance",
        "relax.cumsum",
        "relax.exp",
        "relax.log",
        "relax.power",
        "relax.sqrt",
        "relax.rsqrt",
    }
)

FOLLOW = frozenset(
    {
        "relax.reshape",
        "relax.permute_dims",
        "relax.broadcast_to",
        "relax.expand_dims",
        "relax.squeeze",
        "relax.flatten",
        "relax.strided_slice",
        "relax.take",
        "relax.split",
        "relax.tile",
        "relax.repeat",
        "relax.astype",
        "relax.grad.no_grad",
        "relax.max",
        "relax.min",
        "relax.zeros_like",
        "relax.ones_like",
        "relax.full_like",
    }
)

_FLOATS = ("float16", "bfloat16", "float32")


def _conv(make, fields):
    def rebuild(call, args, want):
        kwargs = {f: getattr(call.attrs, f) for f in fields}
        return make(args[0], args[1], out_dtype=want, **kwargs)

    return rebuild


_CONV_FIELDS = ("strides", "padding", "dilation", "groups", "data_layout", "kernel_layout", "out_layout")

# ops whose importer-given out_dtype (fp32) would otherwise pin their output, and with it
# the dtype of the gradient their rule hands back to low-precision operands
RETARGET_OUT_DTYPE = {
    "relax.matmul": lambda call, args, want: relax.op.matmul(args[0], args[1], out_dtype=want),
    "relax.nn.conv1d": _conv(relax.op.nn.conv1d, _CONV_FIELDS),
    "relax.nn.conv2d": _conv(relax.op.nn.conv2d, _CONV_FIELDS),
}


def _dtype(expr) -> str | None:
    ty = expr.ty
    return str(ty.dtype) if isinstance(ty, relax.TensorType) else None


@mutator
class _Caster(PyExprMutator):
    def __init__(self, mod, low: str):
        super().__init__(mod)
        self.low = low

    def _cast(self, arg, want: str):
        dt = _dtype(arg)
        if dt in _FLOATS and dt != want:
            return self.builder_.emit(relax.op.astype(arg, want))
        return arg

    def _cast_operand(self, arg, want: str):
        """Cast a tensor operand, or each field of a tuple operand (concat, stack)."""
        if isinstance(arg.ty, relax.TupleType):
            fields = [
                self._cast(self.builder_.emit(relax.TupleGetItem(arg, i)) if not isinstance(arg, relax.Tuple)
                           else arg.fields[i], want)
                for i in range(len(arg.ty.fields))
            ]
            return relax.Tuple(fields)
        return self._cast(arg, want)

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        if not isinstance(call.op, tvm.ir.Op):
            return super().visit_call_(call)
        # visit the operands but build the call ourselves: mixed dtypes would not type-check
        args = [self.visit_expr(a) for a in call.args]
        name = call.op.name
        if name == "relax.astype":
            if str(call.attrs.dtype) == "float32" and _dtype(args[0]) != "float32":
                return relax.op.astype(args[0], self.low)
        elif name not in FOLLOW:
            want = "float32" if name in FP32 else self.low
            args = [self._cast_operand(a, want) for a in args]
            if name in RETARGET_OUT_DTYPE:
                return RETARGET_OUT_DTYPE[name](call, args, want)
        return relax.Call(call.op, args, call.attrs, call.ty_args)


@tvm.transform.module_pass(opt_level=0, name="AutoMixedPrecision")
class AutoMixedPrecision:
    """Cast the forward graph ``func_name`` to `dtype` ("bfloat16" or "float16")."""

    def __init__(self, dtype: str, func_name: str = "main"):
        if dtype not in ("bfloat16", "float16"):
            raise ValueError(f"mixed precision dtype must be bfloat16 or float16, got {dtype}")
        self.dtype, self.func_name = dtype, func_name

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        gv = mod.get_global_var(self.func_name)
        func = mod[gv]
        ret_ty = func.ret_ty
        originals = list(ret_ty.fields) if isinstance(func.body.body, relax.Tuple) else [ret_ty]

        def keep_dtype(bb, i, out):
            want = str(originals[i].dtype)
            return bb.emit(relax.op.astype(out, want)) if _dtype(out) != want else out

        caster = _Caster(mod, self.dtype)
        new_func = rewrite_function(caster, func, keep_dtype)
        new_mod = caster.builder_.get()
        new_mod[gv] = new_func
        return relax.transform.CanonicalizeBindings()(new_mod)


@mutator
class _Identity(PyExprMutator):
    pass


@tvm.transform.module_pass(opt_level=0, name="ScaleLoss")
class ScaleLoss:
    """Multiply the loss (output 0 of ``main``) by a new trailing ``loss_scale`` parameter,
    for fp16 dynamic loss scaling (`AppendOptimizer` unscales the gradients)."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        gv = mod.get_global_var("main")
        scale = relax.Var(LOSS_SCALE_PARAM, relax.TensorType((), "float32"))

        def scaled(bb, i, out):
            return bb.emit(relax.op.multiply(out, scale)) if i == 0 else out

        identity = _Identity(mod)
        new_func = rewrite_function(identity, mod[gv], scaled, [scale])
        new_mod = identity.builder_.get()
        new_mod[gv] = new_func
        return new_mod

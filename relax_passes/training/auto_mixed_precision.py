"""AutoMixedPrecision: run a forward graph in bf16/fp16 against fp32 master weights.

Every op states the dtype it wants for its floating-point inputs, by a policy table:

* ``FP32``   — numerically sensitive ops (normalisations, softmax, losses, reductions,
  exp/log) compute in fp32, and those TVM's CUDA route has no bf16 form of (atan2, isnan, ...);
* ``FOLLOW`` — layout and indexing ops keep whatever dtype arrives (no cast);
* arithmetic that normalises by a batch statistic (an fp32 ``sum``/``mean``/``variance``, or
  arithmetic on such statistics only: ``x - mean``, ``/ sqrt(var + eps)``), arithmetic whose
  operands are all fp32 (batch norm's affine after it, the running-statistics update), and the
  elementwise ops that only fp32 reductions read (a loss's ``(out - target)²``) compute in fp32,
  as autocast's fused batch norm and fp32 losses do;
* everything else computes in the low-precision dtype (the fused attention ops too, but their
  key bias and log-sum-exp operands stay fp32: ``LOW_BUT_FP32_ARGS``).

Measured on H100 (tiny batch-norm net, statistics over 512 positions): without the fp32 rules
the bf16 gradients were up to 1.4x (and 1.6x with fp32 accumulation alone) as far from fp32
as autocast's; with them 0.97-1.02x.  ResNet-50 conv3_x (NHWC) ran 24.71 ms per step with
them, 25.64 before them.

Floating inputs whose dtype differs from what the op wants are cast on use (one cast per
value and dtype in a block, so the gradients of its uses add up in that dtype), so fp32
parameters become bf16 at their first low-precision consumer and the gradient of that
``astype`` (TVM's own rule) hands fp32 gradients back to the master weights.  ``matmul``
and ``astype`` to fp32 are retargeted to the low dtype outside FP32 ops.  The function's
outputs keep their original dtypes (the loss stays fp32).
"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from .._rewrite import binding_uses, dtype_of, flat_bindings, op_name, rewrite_function
from ..lower.legalize_ops import FLOAT32_ONLY
from .append_optimizer import LOSS_SCALE_PARAM

FP32 = frozenset(
    {
        "relax.nn.softmax",
        "relax.nn.log_softmax",
        "relax.nn.layer_norm",
        "relax.nn.batch_norm",
        "relax.nn.rms_norm",
        "relax.nn.group_norm",
        "relax.nn.instance_norm",  # (TVM's legalisation has no bf16 instance norm either)
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
) | FLOAT32_ONLY  # no bfloat16 form on TVM's CUDA route (legalize_ops): the step computes them in float32

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

# ops computed in the low dtype whose operands at these positions stay float32: the fused
# attention's key bias and its saved log-sum-exp statistic (relax_passes/ops/attention_op.py)
LOW_BUT_FP32_ARGS = {
    "tvm_evt.attention": frozenset({8}),  # bias
    "tvm_evt.attention_backward": frozenset({4, 11}),  # lse, bias
}

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
    "relax.nn.conv2d_transpose": _conv(relax.op.nn.conv2d_transpose, _CONV_FIELDS + ("output_padding",)),
}


# reductions whose fp32 results are batch statistics, and the arithmetic that combines them
STATISTICS = frozenset({"relax.sum", "relax.mean", "relax.variance"})
STATISTIC_ARITH = frozenset({"relax.add", "relax.subtract", "relax.multiply", "relax.divide",
                             "relax.sqrt", "relax.rsqrt"})
# what may lie between a loss's first op and its fp32 mean: elementwise and layout ops (binary
# cross-entropy with logits imports as (1 - y) z - (min(0, z) - log(1 + exp(-|z|))))
ELEMENTWISE = frozenset({"relax.add", "relax.subtract", "relax.multiply", "relax.divide", "relax.negative",
                         "relax.abs", "relax.square", "relax.minimum", "relax.maximum", "relax.exp",
                         "relax.log", "relax.sigmoid", "relax.tanh", "relax.clip", "tvm_evt.hardtanh"})
LAYOUT = frozenset({"relax.reshape", "relax.permute_dims", "relax.expand_dims", "relax.squeeze", "relax.flatten"})


@mutator
class _Caster(PyExprMutator):
    def __init__(self, mod, low: str, loss_region: set):
        super().__init__(mod)
        self.low = low
        self.loss_region = loss_region  # original vars computed only for fp32 reductions
        self.stats: set = set()  # original vars holding an fp32 statistic (or one derived from them)
        self.casts: dict = {}  # (operand, dtype) -> its cast in the current block
        self.current = None  # the original var of the binding being visited

    def _is_stat(self, arg) -> bool:
        return isinstance(arg, relax.Var) and arg in self.stats

    def visit_var_binding_(self, binding) -> None:
        value = binding.value
        name = op_name(value)
        if name is not None:
            tensors = [a for a in value.args
                       if isinstance(a.ty, relax.TensorType) and not isinstance(a, tvm.ir.GenericConst)]
            if name in STATISTICS or (
                (name in STATISTIC_ARITH or name in FOLLOW) and tensors and all(self._is_stat(a) for a in tensors)
            ):
                self.stats.add(binding.var)
        self.current = binding.var
        super().visit_var_binding_(binding)

    def _cast(self, arg, want: str):
        dt = dtype_of(arg)
        if dt in _FLOATS and dt != want:
            if (arg, want) not in self.casts:
                self.casts[(arg, want)] = self.builder_.emit(relax.op.astype(arg, want))
            return self.casts[(arg, want)]
        return arg

    def visit_dataflow_block_(self, block):
        self.casts = {}  # a cast is shared by the uses in its block: their gradients add up in `want`
        return super().visit_dataflow_block_(block)

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
        name = op_name(call)
        if name is None:
            return super().visit_call_(call)
        # visit the operands but build the call ourselves: mixed dtypes would not type-check
        args = [self.visit_expr(a) for a in call.args]
        if name == "relax.astype":
            if str(call.attrs.dtype) == "float32" and dtype_of(args[0]) != "float32":
                return relax.op.astype(args[0], self.low)
        elif name not in FOLLOW:
            # normalising by a batch statistic (x - mean, / sigma) stays in fp32, as in a fused kernel
            by_stat = name in STATISTIC_ARITH and any(self._is_stat(a) for a in call.args)
            floats = [dtype_of(a) for a in args if dtype_of(a) in _FLOATS]
            all_fp32 = name in STATISTIC_ARITH and bool(floats) and all(d == "float32" for d in floats)
            fp32 = name in FP32 or by_stat or all_fp32 or self.current in self.loss_region
            want = "float32" if fp32 else self.low
            fp32_args = LOW_BUT_FP32_ARGS.get(name, frozenset())
            args = [self._cast_operand(a, "float32" if i in fp32_args else want) for i, a in enumerate(args)]
            if name in RETARGET_OUT_DTYPE:
                return RETARGET_OUT_DTYPE[name](call, args, want)
        return relax.Call(call.op, args, call.attrs, call.ty_args)


def _feeds_fp32_reductions(func: relax.Function) -> set:
    """Vars bound to elementwise (or layout) ops whose every reader is an fp32 reduction or another
    such op: a loss's (output - target)² before its mean (NHWC: and a transpose back to NCHW), or
    binary cross-entropy's terms, which autocast computes in fp32.  Left in bf16, the adjoints of
    those terms add up in bf16 where they nearly cancel (σ(z) - y): XML-CNN's output bias
    gradient was 2.5 % off fp32 (autocast's: 0.2 %)."""
    bindings = flat_bindings(func)[0]
    uses = binding_uses(func)  # var -> indices of its readers; len(bindings): the function's result
    op_of = [op_name(b.value) for b in bindings]
    region: set = set()  # indices of the bindings
    for i in reversed(range(len(bindings))):  # readers come later: one backward sweep
        users = uses.get(bindings[i].var, [])
        if op_of[i] in ELEMENTWISE | LAYOUT and users and all(
                u < len(bindings) and (u in region or op_of[u] in STATISTICS) for u in users):
            region.add(i)
    return {bindings[i].var for i in region}


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
            return bb.emit(relax.op.astype(out, want)) if dtype_of(out) != want else out

        caster = _Caster(mod, self.dtype, _feeds_fp32_reductions(func))
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

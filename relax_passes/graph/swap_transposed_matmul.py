"""SwapTransposedMatmul: the transpose of a matrix product is the product of the transposes,
swapped, so the transpose folds into the GEMM's operand layouts instead of being a kernel::

    c = matmul(a, b)               a, b matrices; c read by this transpose alone (or by one
    d = permute_dims(c, [1, 0])        cast, read by the transpose alone: d = permute_dims(astype(c)))
  ->
    d = matmul(permute_dims(b, [1, 0]), permute_dims(a, [1, 0]))   (astype(...) of it)

The weight gradient of a linear layer ``y = x W^T`` comes out of autodiff as ``(x^T dy)^T``: a
GEMM writing the float32 ``dW^T`` and a transpose kernel turning it into ``dW`` for the optimizer
(six on BERT-Large's layer, 0.11 ms a step; DLight's transpose does not coalesce).  After the
swap the GEMM writes ``dW = dy^T x`` itself; ``FoldLayoutIntoMatmul`` then cancels the operand
transposes against the ones already there (``x^T``'s).
"""
from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from .._rewrite import bind_as, binding_uses, flat_bindings, mutate_relax_functions, swaps_last_two

MATMUL = tvm.ir.Op.get("relax.matmul")
ASTYPE = tvm.ir.Op.get("relax.astype")


def _matrix(expr) -> bool:
    ty = getattr(expr, "ty", None)
    return isinstance(ty, relax.TensorType) and ty.ndim == 2


def _transpose(value) -> bool:
    """A permute_dims of a matrix that swaps its axes."""
    return swaps_last_two(value) and _matrix(value.args[0])


def plan(func: relax.Function) -> set:
    """The vars of the transposes to rewrite: of a matrix product of matrices, or of a cast of
    one (mixed precision's bf16 product widened for the optimizer), each read by the next alone."""
    bindings, _ = flat_bindings(func)
    uses = binding_uses(func)
    bound = {b.var: b.value for b in bindings}

    def only_reader(var) -> bool:
        return len(uses.get(var, [])) == 1

    out = set()
    for b in bindings:
        v = b.value
        if not _transpose(v):
            continue
        src = v.args[0]
        value = bound.get(src)
        if isinstance(value, relax.Call) and value.op == ASTYPE and only_reader(src):
            src = value.args[0]
            value = bound.get(src)
        if (isinstance(value, relax.Call) and value.op == MATMUL and all(_matrix(a) for a in value.args)
                and only_reader(src)):
            out.add(b.var)
    return out


@mutator
class _Swapper(PyExprMutator):
    def __init__(self, mod: tvm.IRModule):
        super().__init__(mod)
        self.targets: set = set()

    def prime(self, func: relax.Function) -> None:
        self.targets = plan(func)

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        if binding.var not in self.targets:
            super().visit_var_binding_(binding)
            return
        value = self.lookup_binding(self.visit_expr(binding.value.args[0]))
        cast = value if value.op == ASTYPE else None
        product = self.lookup_binding(value.args[0]) if cast is not None else value
        a, b = product.args
        swapped = relax.op.matmul(self.builder_.emit(relax.op.permute_dims(b, [1, 0])),
                                  self.builder_.emit(relax.op.permute_dims(a, [1, 0])),
                                  out_dtype=product.attrs.out_dtype)
        if cast is not None:
            swapped = relax.op.astype(self.builder_.emit(swapped), cast.attrs.dtype)
        self.set_var_remap(binding.var, bind_as(self.builder_, binding.var, swapped))  # an in-place step's dW


@tvm.transform.module_pass(opt_level=0, name="SwapTransposedMatmul")
class SwapTransposedMatmul:
    """Rewrite a transposed matrix product as the swapped product of the transposes."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        swapper = _Swapper(mod)  # the old product is left to dead-code elimination
        return mutate_relax_functions(swapper, mod, before_each=swapper.prime)

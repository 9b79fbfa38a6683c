"""EliminateSoftmaxBackwardReduction: the attention backward's row sum over the scores becomes a row
sum over the head dimension (FlashAttention's ``D = rowsum(dO ∘ O)``).

The gradient of ``P = softmax(S)`` is ``dS = P ∘ (dP - rowsum(P ∘ dP))``.  In attention, ``P``
reaches the second GEMM through a diagonal chain ``Pd = c ∘ P`` (dropout: a keep mask and a
``1/(1-p)`` scale, casts, reshapes) and ``O = Pd @ V``; the backward brings ``dPd = G @ Vᵀ`` back
through the adjoint chain ``dP = c ∘ dPd``.  Then, for each row ``i``::

    Σ_j P_ij dP_ij = Σ_j Pd_ij dPd_ij = Σ_j Pd_ij Σ_k G_ik V_jk = Σ_k G_ik O_ik

so ``rowsum(P ∘ dP)`` (``[.., S, S]``, a reduction no GEMM epilogue can finish: the row spans
several output tiles) equals ``rowsum(G ∘ O)`` over ``[.., S, d]``.  The rewrite is exact in
exact arithmetic for any ``G``; in floating point ``O`` carries the rounding of the forward GEMM's
output, as in FlashAttention.  With the reduction gone, ``dS`` is elementwise in the ``dPd``
GEMM's output plus a column broadcast and fuses behind it.

Matched (on the bindings of each Relax function; anything else is left alone)::

    t  = multiply(P, dP)                 # either operand order
    r  = sum(t, axis=[-1], keepdims=True)
    P  = softmax(S, axis=-1)
    dP = chain_b(dPd),  dPd = matmul(G, permute_dims(V, <last two swapped>))
    O  = matmul(Pd, V),  Pd = chain_f(P)

where ``chain_f`` and ``chain_b`` are sequences of ``astype``, ``reshape`` (row-major, last axis
kept), ``broadcast_to`` its own shape, ``multiply``/``divide`` by a scalar and ``where(mask, x, 0)``
that scale by the same factor (scalar products equal to bf16 rounding, the same masks).  ``r`` becomes
``reshape(sum(astype(G, f32) * astype(O, f32), axis=[-1], keepdims=True))``.
"""

from __future__ import annotations

import math
from collections import defaultdict

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from .._rewrite import bound_call, mutate_relax_functions, resolve_alias, scalar_value, static_shape as _shape

SUM = tvm.ir.Op.get("relax.sum")
MULTIPLY = tvm.ir.Op.get("relax.multiply")
DIVIDE = tvm.ir.Op.get("relax.divide")
SOFTMAX = tvm.ir.Op.get("relax.nn.softmax")
MATMUL = tvm.ir.Op.get("relax.matmul")
PERMUTE_DIMS = tvm.ir.Op.get("relax.permute_dims")
ASTYPE = tvm.ir.Op.get("relax.astype")
RESHAPE = tvm.ir.Op.get("relax.reshape")
WHERE = tvm.ir.Op.get("relax.where")
BROADCAST_TO = tvm.ir.Op.get("relax.broadcast_to")


def _bindings(func: relax.Function) -> dict:
    return {b.var: b.value for block in func.body.blocks for b in block.bindings
            if isinstance(b, relax.VarBinding)}


def _last_axis(shape: tuple[int, ...], axis) -> bool:
    return axis is not None and len(axis) == 1 and int(axis[0]) % len(shape) == len(shape) - 1


def _diagonal_chain(bound: dict, expr: relax.Expr):
    """Walk producers from `expr` through diagonal (elementwise linear) ops.  Returns the var the
    chain starts from, the product of its scalar factors and its masks."""
    scale, masks = 1.0, []
    last = _shape(expr)[-1] if _shape(expr) else None
    while isinstance(expr := resolve_alias(bound, expr), relax.Var) and isinstance(bound.get(expr), relax.Call):
        call = bound[expr]
        if call.op == BROADCAST_TO and _shape(call.args[0]) == _shape(call):
            expr = call.args[0]  # a broadcast to its own shape
        elif call.op in (ASTYPE, RESHAPE):
            src = _shape(call.args[0])
            if src is None or src[-1] != last:
                break  # a reshape that moves the reduced axis
            expr = call.args[0]
        elif call.op in (MULTIPLY, DIVIDE):
            k = scalar_value(bound, call.args[1])
            if k is None or k == 0.0:
                k = scalar_value(bound, call.args[0]) if call.op == MULTIPLY else None
                if k is None:
                    break
                expr = call.args[1]
            else:
                expr = call.args[0]
            scale *= k if call.op == MULTIPLY else 1.0 / k
        elif call.op == WHERE and scalar_value(bound, call.args[2]) == 0.0:
            masks.append(resolve_alias(bound, call.args[0]))
            expr = call.args[1]
        else:
            break
    return expr, scale, masks


def _same_factor(a, b) -> bool:
    (_, sa, ma), (_, sb, mb) = a, b
    return math.isclose(sa, sb, rel_tol=1e-2) and len(ma) == len(mb) and all(
        any(x.same_as(y) for y in mb) for x in ma)


def _transposed(bound: dict, expr: relax.Expr) -> relax.Expr | None:
    """``v`` for ``expr = permute_dims(v, axes)`` swapping exactly the last two axes."""
    call = bound_call(bound, expr, PERMUTE_DIMS)
    if call is None or call.attrs.axes is None:
        return None
    axes = [int(a) for a in call.attrs.axes]
    n = len(axes)
    return call.args[0] if n >= 2 and axes == [*range(n - 2), n - 1, n - 2] else None


def find_rewrites(func: relax.Function) -> dict:
    """``{t: (G, O)}``: the ``t`` of each matched ``sum(t)`` (module docstring) and its factors."""
    bound = _bindings(func)
    by_rhs = defaultdict(list)
    for var, value in bound.items():
        if isinstance(value, relax.Call) and value.op == MATMUL:
            by_rhs[resolve_alias(bound, value.args[1])].append(var)
    found = {}
    for r, value in bound.items():
        if not (isinstance(value, relax.Call) and value.op == SUM and value.attrs.keepdims):
            continue
        t = value.args[0]
        tshape = _shape(t)
        prod = bound_call(bound, t, MULTIPLY)
        if prod is None or tshape is None or not _last_axis(tshape, value.attrs.axis):
            continue
        for p, dp in (prod.args, prod.args[::-1]):
            sm = bound_call(bound, p, SOFTMAX)
            if sm is None or _shape(dp) != tshape or not _last_axis(tshape, [sm.attrs.axis]):
                continue
            back = _diagonal_chain(bound, dp)
            dpd = bound_call(bound, back[0], MATMUL)
            v = None if dpd is None else resolve_alias(bound, _transposed(bound, dpd.args[1]))
            if v is None:
                continue
            g = dpd.args[0]
            for o in by_rhs.get(v, ()):
                fwd = _diagonal_chain(bound, bound[o].args[0])
                oshape, gshape = _shape(o), _shape(g)
                if (fwd[0].same_as(resolve_alias(bound, p)) and _same_factor(fwd, back) and oshape is not None
                        and oshape == gshape and math.prod(oshape[:-1]) == math.prod(tshape[:-1])):
                    found[t] = (g, o)
                    break
            if t in found:
                break
    return found


@mutator
class _Rewriter(PyExprMutator):
    def prime(self, func: relax.Function) -> None:
        self.rewrites = find_rewrites(func)

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        if call.op == SUM and call.args[0] in self.rewrites:
            g, o = (self.visit_expr(x) for x in self.rewrites[call.args[0]])
            out_shape, dtype = _shape(call), str(call.ty.dtype)
            wide = [self.builder_.emit(relax.op.astype(x, "float32")) if str(x.ty.dtype) != "float32" else x
                    for x in (g, o)]
            prod = self.builder_.emit(relax.op.multiply(*wide))
            rows = relax.op.sum(prod, axis=[-1], keepdims=True)
            if dtype != "float32":
                rows = relax.op.astype(self.builder_.emit(rows), dtype)
            if _shape(self.builder_.normalize(rows)) != out_shape:
                rows = relax.op.reshape(self.builder_.emit(rows), out_shape)
            return rows
        return super().visit_call_(call)


@tvm.transform.module_pass(opt_level=0, name="EliminateSoftmaxBackwardReduction")
class EliminateSoftmaxBackwardReduction:
    """Rewrite attention's ``rowsum(P ∘ dP)`` as ``rowsum(G ∘ O)`` (see the module docstring)."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        rewriter = _Rewriter(mod)
        return mutate_relax_functions(rewriter, mod, before_each=rewriter.prime)

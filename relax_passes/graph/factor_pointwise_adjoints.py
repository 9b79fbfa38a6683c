"""FactorPointwiseAdjoints: the gradient through a pointwise chain as ``dy * J``, with ``J`` computed
from forward values only.

A pointwise function written out as ops — a SiLU gate ``g * sigmoid(g) * up`` (transformers'
Llama), GPT-2's GELU ``0.5 x (1 + tanh(0.798 (x + 0.0447 x^3)))`` — gets from autodiff a backward
that multiplies the incoming gradient ``dy`` by each intermediate in turn (``sigmoid(g)``,
``1 - sigmoid(g)``, ``g``, ``up``), so each is kept for the backward: a tensor as large as ``g``
that the forward GEMM's epilogue stores and a backward epilogue loads (Llama's gate GEMM stored
four [8192, 11008] tensors, its down projection's dX loaded five).  But
that backward is linear in ``dy``: its result is ``dy * J`` where ``J``, the chain's derivative,
is the same ops with ``dy`` set to 1 — a pointwise function of forward values the forward's
epilogue computes and stores as one tensor.

A backward value ``g`` is rewritten when

* ``g`` ends a region of pointwise ops (``POINTWISE``: the code generator's elementwise ops and
  ``where``) bound after the loss (something other than a pointwise op reads it, or the function
  returns it);
* the region reads one backward tensor ``dy`` (else forward values — bound up to the loss, or
  parameters — and constants) and is linear in it: ``dy`` reaches ``g`` only through sums of
  linear terms, products and quotients with a ``dy``-free factor, negation, and ``where`` with a
  ``dy``-free condition and linear or zero branches;
* ``dy``, ``g`` and every value of the region have one dtype (``J`` then rounds as the region
  did), the region has at most ``MAX_OPS`` ops (``J`` is that many epilogue nodes), and
* the forward tensors of ``g``'s size that the region reads take more bytes than ``J`` (one
  tensor kept instead of several; not two boolean masks, a ReLU's and a dropout's, for a float
  ``J``).

``J``, a copy of the region with a constant 1 for ``dy``, is bound in the forward right after the
last forward value it reads, and ``g`` becomes ``dy * J``: the backward reads ``J`` instead of the
values it is made of, and the partitioner computes it in the epilogue that makes them.  The factored form rounds
differently from the original (a product's order changes), not by more than one rounding a term.
Runs after the graph passes' common-subexpression elimination.
"""

from __future__ import annotations

from typing import NamedTuple

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from .._rewrite import POINTWISE, binding_uses, dtype_of, elements, flat_bindings, op_name, scalar_value
from ..partition.evt_cost import tensor_bytes
from ..partition.rematerialize import loss_var

LINEAR_SUM = frozenset({"relax.add", "relax.subtract"})

CONST, LINEAR, ZERO = "const", "linear", "zero"  # how a region's value depends on dy
# the most ops a J may take: each is a node of the forward epilogue that computes it, and a long
# tree of 16-bit nodes runs slowly there (H200, bf16, 2026-11-28: Llama's SiLU gate, J of 7 ops,
# 95.78 -> 90.98 ms a step; GPT-2 medium's tanh GELU, J of 15 ops: its FFN1 epilogue went from
# 0.59 to 0.98 ms a call, the FFN2 dX from 0.40 to 0.19, the step 116.66 -> 118.67 ms)
MAX_OPS = 8


def _is_zero(expr) -> bool:
    return isinstance(expr, tvm.ir.GenericConst) and not expr.value.numpy().any()


class _Region:
    """The pointwise region ending at one backward value, and how it depends on its one `dy`."""

    def __init__(self, bound: dict, forward: set, root: relax.Var):
        self.bound, self.forward = bound, forward
        self.dtype = dtype_of(root)
        self.size = elements(root)
        self.dy = None
        self.reads: set = set()  # every forward value read
        self.ops = 0  # the region's pointwise bindings: J's ops
        self.kinds: dict = {}

    def kind(self, expr) -> str | None:
        """CONST, LINEAR or ZERO for `expr` in the region, None where the rewrite does not apply.

        Walked with a stack, operands left to right before their op (the region's first backward
        value met is its `dy`): an unrolled recurrence (an LSTM over 256 steps) chains thousands
        of pointwise ops, past Python's recursion limit."""
        pending = [(expr, False)]
        while pending:
            e, operands_done = pending.pop()
            if operands_done:
                self.kinds[e] = self._call(self.bound[e])
                continue
            if not isinstance(e, relax.Var) or e in self.kinds or e in self.forward or e not in self.bound:
                continue
            if op_name(self.bound[e]) in POINTWISE and dtype_of(e) == self.dtype:
                self.ops += 1
                pending.append((e, True))
                pending.extend((a, False) for a in reversed(self.bound[e].args))
            elif self.dy is None or self.dy.same_as(e):  # the region's one backward input
                self.dy, self.kinds[e] = e, (LINEAR if dtype_of(e) == self.dtype else None)
            else:
                self.kinds[e] = None
        return self._known(expr)

    def _known(self, expr) -> str | None:
        """`expr`'s kind once its operands are walked: a constant's, a forward value's (CONST, and
        read), or the one ``kind`` found."""
        if isinstance(expr, tvm.ir.GenericConst):
            return ZERO if _is_zero(expr) else CONST
        if not isinstance(expr, relax.Var):
            return None
        if expr in self.kinds:
            return self.kinds[expr]
        self.reads.add(expr)  # a forward value or a parameter
        return CONST

    def _call(self, call: relax.Call) -> str | None:
        kinds = [self._known(a) for a in call.args]
        if None in kinds:
            return None
        name = op_name(call)
        free = all(k in (CONST, ZERO) for k in kinds)
        if free:
            return CONST
        if name in LINEAR_SUM:
            return LINEAR if all(k in (LINEAR, ZERO) for k in kinds) else None
        if name == "relax.multiply":
            return ZERO if ZERO in kinds else LINEAR if kinds.count(LINEAR) == 1 else None
        if name == "relax.divide":
            return LINEAR if kinds[0] == LINEAR and kinds[1] == CONST else None
        if name == "relax.negative":
            return LINEAR
        if name == "relax.where":
            return LINEAR if kinds[0] != LINEAR and all(k in (LINEAR, ZERO) for k in kinds[1:]) else None
        return None  # a nonlinear op of dy

    def forward_bytes(self) -> int:
        """What the forward tensors of the root's size that the region reads keep."""
        return sum(tensor_bytes(v) for v in self.reads if elements(v) == self.size)


def _is_one(expr) -> bool:
    return isinstance(expr, tvm.ir.GenericConst) and scalar_value({}, expr) == 1


def _identity(name: str, args: list):
    """The operand a product by 1 (or a quotient by 1) is, else None: J's copy would otherwise
    store ``1 * g``, a second copy of ``g``."""
    if name == "relax.multiply":
        if _is_one(args[0]):
            return args[1]
        if _is_one(args[1]):
            return args[0]
    if name == "relax.divide" and _is_one(args[1]):
        return args[0]
    return None


class Factoring(NamedTuple):
    """What `factor_roots` found in one function."""

    roots: dict  # g -> its region's dy
    bound: dict  # var -> its bound value
    forward: set  # the vars bound up to the loss
    ready: dict  # forward var -> the roots whose J can be bound right after it


@mutator
class _Factor(PyExprMutator):
    def __init__(self, mod: tvm.IRModule, plan: Factoring):
        super().__init__(mod)
        self.plan = plan
        self.factors: dict = {}  # root -> J

    def _copy(self, expr, dy, memo: dict):
        """`expr` with dy as 1, its region's bindings emitted again (forward values as they are)."""
        bound = self.plan.bound
        if isinstance(expr, relax.Var) and expr.same_as(dy):
            return relax.const(1, dtype_of(dy))
        if not isinstance(expr, relax.Var) or expr not in bound or op_name(bound[expr]) not in POINTWISE \
                or expr in self.plan.forward:
            return self.visit_expr(expr)
        if expr not in memo:
            call = bound[expr]
            args = [self._copy(a, dy, memo) for a in call.args]
            kept = _identity(op_name(call), args)
            memo[expr] = kept if kept is not None else self.builder_.emit(
                relax.Call(call.op, args, call.attrs, call.ty_args), name_hint=f"{expr.name}_d")
        return memo[expr]

    def _bind_factor(self, root: relax.Var) -> None:
        self.factors[root] = self._copy(root, self.plan.roots[root], {})

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        g = binding.var
        if g in self.plan.roots:
            if g not in self.factors:  # its last operand was not a var binding (a match_cast)
                self._bind_factor(g)
            value = relax.op.multiply(self.visit_expr(self.plan.roots[g]), self.factors[g])
            self.builder_.emit_normalized(relax.VarBinding(g, self.builder_.normalize(value)))
        else:
            super().visit_var_binding_(binding)
        for root in self.plan.ready.get(g, ()):  # J in the forward, once its operands exist
            self._bind_factor(root)


def factor_roots(func: relax.Function) -> Factoring:
    """The backward values of `func` to rewrite (module docstring), each with its dy."""
    bindings, _ = flat_bindings(func)
    nothing = Factoring({}, {}, set(), {})
    try:
        loss = loss_var(func, bindings)
    except ValueError:
        return nothing
    index = {b.var: i for i, b in enumerate(bindings)}
    if loss not in index:
        return nothing
    boundary = index[loss]
    forward = {b.var for b in bindings[: boundary + 1]}
    bound = {b.var: b.value for b in bindings}
    uses = binding_uses(func)
    returned = set(relax.analysis.free_vars(func.body.body))
    roots, ready = {}, {}
    for b in bindings[boundary + 1:]:
        if op_name(b.value) not in POINTWISE or elements(b.var) is None:
            continue
        readers = [bindings[i].value if i < len(bindings) else None for i in uses.get(b.var, ())]
        if b.var not in returned and readers and all(op_name(r) in POINTWISE for r in readers):
            continue  # not the end of its region
        region = _Region(bound, forward, b.var)
        if region.kind(b.var) == LINEAR and region.dy is not None and region.ops <= MAX_OPS \
                and region.forward_bytes() > tensor_bytes(b.var):
            roots[b.var] = region.dy
            last = max((v for v in region.reads if v in index), key=index.get, default=loss)
            ready.setdefault(last, []).append(b.var)
    return Factoring(roots, bound, forward, ready)


@tvm.transform.module_pass(opt_level=0, name="FactorPointwiseAdjoints")
class FactorPointwiseAdjoints:
    """Rewrite each linear pointwise backward region as ``dy * J`` (module docstring)."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        updates = {}
        for gv, func in mod.functions_items():
            if not isinstance(func, relax.Function):
                continue
            plan = factor_roots(func)
            if plan.roots:
                updates[gv] = _Factor(mod, plan).visit_expr(func)
        for gv, func in updates.items():
            mod[gv] = func
        return relax.transform.DeadCodeElimination()(mod) if updates else mod

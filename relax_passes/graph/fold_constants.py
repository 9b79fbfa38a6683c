"""FoldConstants: TVM's ``FoldConstant``, legalizing only the calls that can fold.

``relax.transform.FoldConstant`` legalizes every operator call to TIR (``call_te``) to see whether
its arguments are constants, folds those that are, puts the constant in place of each dataflow
var bound to one, and drops the bindings nobody reads (``remove_all_unused``).  A training graph's
calls read its parameters and activations: ResNet-50's bf16 step had it legalize 8075 calls to
fold two (the cross-entropy's ``arange(0, 1000)`` and a cast of 0.0), 9.5-14 s of this 2-core
machine's CPU (issue #40).

Only a binding whose value reads no variable but those of such bindings can fold (the constant
cone).  This pass runs ``FoldConstant`` on a function made of each dataflow block's cone alone,
which returns the cone's vars, and then does to the function what ``FoldConstant`` does with
what folded: each folded var bound to its constant, each dataflow var bound to a constant
replaced by it at its uses, unused bindings removed.  The result equals ``FoldConstant``'s
(tests/test_fold_constants.py).  A function whose bindings outside dataflow blocks might fold
(impure ones cannot go into a dataflow function: an offloaded attention's ``zeros``) gets TVM's
pass, on it alone: run on the whole module, that took BERT-Large's 7.2 of its 7.2 s.
"""
from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from .._rewrite import sub_expressions

_VALUES = (relax.Call, relax.Tuple, relax.TupleGetItem, tvm.ir.expr.Constant)


def _reads(value) -> list:
    return [e for e in sub_expressions(value) if isinstance(e, relax.Var)]


def constant_cone(func: relax.Function) -> tuple[list, bool]:
    """(the dataflow bindings of `func` whose value reads only vars of earlier such bindings, in
    order; whether a binding outside a dataflow block does)."""
    cone, bound, outside = [], set(), False
    for seq in sub_expressions(func.body):
        if not isinstance(seq, relax.SeqExpr):
            continue
        for block in seq.blocks:
            for b in block.bindings:
                if not isinstance(b, relax.VarBinding) or not isinstance(b.value, _VALUES):
                    continue
                if all(v in bound for v in _reads(b.value)):
                    if isinstance(block, relax.DataflowBlock):
                        cone.append(b)
                        bound.add(b.var)
                    else:
                        outside = True
    return cone, outside


def _with_callees(mod: tvm.IRModule, gv: tvm.ir.GlobalVar, func: relax.Function) -> tvm.IRModule:
    """A module of `func` (as `gv`) and the functions of `mod` it calls."""
    callees = {e for e in sub_expressions(func.body) if isinstance(e, tvm.ir.GlobalVar) and e != gv}
    return tvm.IRModule({**{c: mod[c] for c in callees}, gv: func})


def _fold_cone(mod: tvm.IRModule, cone: list) -> dict:
    """{cone var: the constant FoldConstant folds it to} (vars it leaves unfolded are absent)."""
    cone_vars = [b.var for b in cone]
    body = relax.SeqExpr([relax.DataflowBlock(list(cone))], relax.Tuple(cone_vars))
    func = relax.Function([], body, relax.TupleType([v.ty for v in cone_vars]), is_pure=True)
    gv = tvm.ir.GlobalVar("constant_cone")
    folded = relax.transform.FoldConstant()(_with_callees(mod, gv, func))[gv]
    # a dataflow var folded is replaced by its constant in the returned tuple (its binding dropped);
    # a var that is not is left there, and its binding holds what it folded to
    kept = {b.var: b.value for block in folded.body.blocks for b in block.bindings}
    values = {v: c if isinstance(v, relax.DataflowVar) else kept.get(v)
              for v, c in zip(cone_vars, folded.body.body.fields)}
    return {v: c for v, c in values.items() if isinstance(c, tvm.ir.expr.Constant)}


@mutator
class _Substitute(PyExprMutator):
    """Folded vars bound to their constants; dataflow vars bound to constants replaced at uses."""

    def __init__(self, folded: dict):
        super().__init__()
        self.folded = folded

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        if binding.var in self.folded:
            self.builder_.emit_normalized(relax.VarBinding(binding.var, self.folded[binding.var]))
            return
        super().visit_var_binding_(binding)

    def visit_dataflow_var_(self, var: relax.DataflowVar) -> relax.Expr:
        if var in self.folded:
            return self.folded[var]
        return super().visit_dataflow_var_(var)


@tvm.transform.module_pass(opt_level=0, name="FoldConstants")
class FoldConstants:
    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        out = {}
        for gv, func in mod.functions_items():
            if not isinstance(func, relax.Function):
                continue
            cone, outside = constant_cone(func)
            if outside:  # TVM's pass on this function alone (it folds each function by itself)
                out[gv] = relax.transform.FoldConstant()(_with_callees(mod, gv, func))[gv]
                continue
            folded = _fold_cone(mod, cone) if cone else {}
            if folded:
                func = _Substitute(folded).visit_expr(func)
            out[gv] = relax.analysis.remove_all_unused(func)
        return tvm.IRModule({gv: out.get(gv, f) for gv, f in mod.functions_items()}, attrs=mod.attrs,
                            global_infos=mod.global_infos)

"""Helpers shared by the passes: static shapes, scalar constants, the expressions of a function and
who reads each var, adding a generated function once, mutating every Relax function of a module,
and rewriting a function's bindings and then its returned fields."""

from __future__ import annotations

import functools
import math
import operator
from typing import Callable, Sequence

import tvm
from tvm import relax, tirx
from tvm.relax.expr_functor import PyExprMutator, mutator

from ..codegen.frontend.relax_partition import BINARY_OPS, UNARY_OPS

OPAQUE = 8  # tvm::relax::OpPatternKind::kOpaque: FuseOps fuses nothing into the PrimFunc
VIEWS = frozenset({"relax.reshape", "relax.memory.view"})  # results that share their operand's memory
# the code generator's elementwise ops (an epilogue can compute them) and where
POINTWISE = frozenset(BINARY_OPS) | frozenset(UNARY_OPS) | {"relax.where"}
# the reductions over given axes, each op with the builder of a call of it: (x, axis, keepdims)
REDUCTIONS = {tvm.ir.Op.get(f"relax.{name}"): getattr(relax.op, name) for name in ("sum", "mean", "max", "min", "prod")}
# a gradient mask's ops (ReLU's y > 0; ReLU6's, hardtanh's and a clamp's (y > lo) & (y < hi)):
# comparisons of a tensor with a constant, and connectives of them, each as what it computes on
# values (TIR expressions) where a kernel of ours applies the mask itself
MASK_COMPARISONS = {"greater": operator.gt, "less": operator.lt, "greater_equal": operator.ge, "less_equal": operator.le}
MASK_CONNECTIVES = {"logical_and": lambda a, b: tirx.all(a, b), "logical_or": lambda a, b: tirx.any(a, b)}
# the name of a forward value's copy recomputed in the backward ends so (Rematerialize and
# RecomputeActivationsInBackward make them, PartitionEVT keeps them out of forward epilogues,
# SinkRecomputedValues finds them)
COPY_SUFFIX = "_remat"


def is_copy(var: relax.Var) -> bool:
    """Is `var` a forward value's copy recomputed in the backward (named with ``COPY_SUFFIX``)?"""
    return var.name.endswith(COPY_SUFFIX)


def resolve_alias(bound: dict, expr: relax.Expr) -> relax.Expr:
    """`expr` through var-to-var bindings (``lv35 = lv_1``) of `bound` (var -> bound value)."""
    while isinstance(expr, relax.Var) and isinstance(bound.get(expr), relax.Var):
        expr = bound[expr]
    return expr


def bound_call(bound: dict, expr: relax.Expr, op: tvm.ir.Op) -> relax.Call | None:
    """The call to `op` that `expr` is (or is bound to in `bound`, through aliases), else None."""
    expr = resolve_alias(bound, expr)
    value = bound.get(expr) if isinstance(expr, relax.Var) else expr
    return value if isinstance(value, relax.Call) and value.op == op else None


def op_name(value) -> str | None:
    """The operator name of a call to a Relax operator (``"relax.add"``), else None."""
    if isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op):
        return value.op.name
    return None


_CHILDREN = {  # the sub-expressions ``relax.analysis.post_order_visit`` visits before a node, in order
    relax.Call: lambda e: (e.op, *e.args),
    relax.Tuple: lambda e: tuple(e.fields),
    relax.TupleGetItem: lambda e: (e.tuple_value,),
    relax.SeqExpr: lambda e: (*(b.value for block in e.blocks for b in block.bindings), e.body),
    relax.Function: lambda e: (e.body,),
    relax.If: lambda e: (e.cond, e.true_branch, e.false_branch),
}


@functools.lru_cache(maxsize=None)
def _children_of(kind: type):
    return next((_CHILDREN[cls] for cls in kind.__mro__ if cls in _CHILDREN), None)


def sub_expressions(expr: relax.Expr) -> list:
    """The Relax expressions in `expr` (itself last) in ``relax.analysis.post_order_visit``'s order:
    a call's operator and arguments, tuple fields, a tuple item's tuple, a sequence's bound values
    and result, a function's body, an ``If``'s condition and branches.  Unlike post_order_visit,
    not the expressions inside type annotations (shapes), nor the PrimExprs of a shape: that one
    visits every field's shape of a tuple-typed var at each reference to it, so a function reading
    the N items of an N-tuple (an optimizer step's outputs) cost it N^2 Python calls."""
    out, stack = [], [(expr, False)]
    while stack:
        e, expanded = stack.pop()
        if expanded:
            out.append(e)
            continue
        stack.append((e, True))
        children = _children_of(type(e))
        if children is not None:
            stack.extend((c, False) for c in reversed(children(e)))
    return out


def static_shape(expr: relax.Expr) -> tuple[int, ...] | None:
    """The static shape of a tensor-typed expression, else None (tuple, symbolic extent)."""
    ty = expr.ty
    if not isinstance(ty, relax.TensorType) or not isinstance(ty.shape, relax.ShapeExpr):
        return None
    try:
        return tuple(int(s) for s in ty.shape.values)
    except TypeError:  # symbolic extent
        return None


def elements(expr: relax.Expr) -> int | None:
    """The element count of a tensor of static shape, else None."""
    shape = static_shape(expr)
    return None if shape is None else math.prod(shape)


def group_norm_view(shape: list[int], channel: int, groups: int, axes: list[int]) -> tuple[list[int], list[int]]:
    """A group norm's input seen with its channel axis split into (groups, channels of a group),
    and the axes it normalizes on that view, sorted: a group's channels and `axes` (non-negative,
    the channel axis not among them)."""
    view = shape[:channel] + [groups, shape[channel] // groups] + shape[channel + 1:]
    return view, sorted([channel + 1] + [a + 1 if a > channel else a for a in axes])


def replace_functions(mod: tvm.IRModule, updates: dict) -> tvm.IRModule:
    """`mod` with the functions of `updates` ({GlobalVar: function}) in their places; `mod`
    itself when there are none."""
    if not updates:
        return mod
    mod = tvm.IRModule(dict(mod.functions_items()), attrs=mod.attrs)
    for gv, func in updates.items():
        mod[gv] = func
    return mod


def dtype_of(expr: relax.Expr) -> str | None:
    """The dtype of a tensor-typed expression, else None."""
    ty = getattr(expr, "ty", None)
    return str(ty.dtype) if isinstance(ty, relax.TensorType) else None


def permute_axes(call: relax.Call) -> list[int]:
    """The axes of a ``permute_dims`` call, non-negative (``None``: all of them reversed)."""
    ndim = call.args[0].ty.ndim
    axes = call.attrs.axes
    return list(range(ndim))[::-1] if axes is None else [int(a) % ndim for a in axes]


def swaps_last_two(value) -> bool:
    """Is `value` a ``permute_dims`` that swaps the last two axes only (a matmul operand's layout)?"""
    if not (isinstance(value, relax.Call) and value.op == tvm.ir.Op.get("relax.permute_dims")):
        return False
    ndim = value.args[0].ty.ndim
    return ndim >= 2 and permute_axes(value) == list(range(ndim - 2)) + [ndim - 1, ndim - 2]


def substitute(expr: relax.Expr, vmap: dict) -> relax.Expr:
    """`expr` (a var, tuple, tuple item or call, as a binding's value) with the vars in `vmap`
    replaced, one level of calls deep (what a binding of a flat dataflow block holds)."""
    if isinstance(expr, relax.Var):
        return vmap.get(expr, expr)
    if isinstance(expr, relax.Tuple):
        return relax.Tuple([substitute(f, vmap) for f in expr.fields])
    if isinstance(expr, relax.TupleGetItem):
        return relax.TupleGetItem(substitute(expr.tuple_value, vmap), expr.index)
    if isinstance(expr, relax.Call):
        return relax.Call(expr.op, [substitute(a, vmap) for a in expr.args], expr.attrs, expr.ty_args)
    return expr


def flat_bindings(func: relax.Function) -> tuple[list, dict]:
    """(the var bindings of `func` in order, var -> index of its dataflow block or None)."""
    bindings, block_of = [], {}
    for bi, block in enumerate(func.body.blocks):
        for b in block.bindings:
            if isinstance(b, relax.VarBinding):
                block_of[b.var] = bi if isinstance(block, relax.DataflowBlock) else None
                bindings.append(b)
    return bindings, block_of


def local_composite(outer: relax.Function):
    """(binding of the local Composite function, binding of its call) in a partition function
    (what ``FuseOpsByPattern(annotate_codegen=True)`` and PartitionEVT make), else None."""
    local, call = None, None
    for b in flat_bindings(outer)[0]:
        if isinstance(b.value, relax.Function):
            local = b
        elif isinstance(b.value, relax.Call) and local is not None and b.value.op.same_as(local.var):
            call = b
    return (local, call) if local is not None and call is not None else None


_RESHAPE = tvm.ir.Op.get("relax.reshape")
_KERNEL_CALLS = tuple(tvm.ir.Op.get(f"relax.{name}") for name in ("call_tir", "call_dps_packed"))


def kernel_inputs(bindings) -> frozenset:
    """The vars some ``call_tir`` / ``call_dps_packed`` of `bindings` reads: values a kernel of its
    own reads, which ``FuseOps`` cannot fuse into it, so they are written to memory."""
    return frozenset(e for b in bindings if isinstance(b.value, relax.Call) and b.value.op in _KERNEL_CALLS
                     for e in sub_expressions(b.value) if isinstance(e, relax.Var))


def stored(bound: dict, var, kernel_read: frozenset = frozenset()) -> bool:
    """Is `var` (with `bound`: var -> its bound value) in memory anyway, not a value only a fused
    kernel would compute: a parameter, a kernel's output, a value a kernel reads (`kernel_read`:
    ``kernel_inputs``), or a reshape of one of these?"""
    value = bound.get(var)
    while var not in kernel_read and isinstance(value, relax.Call) and value.op == _RESHAPE \
            and isinstance(value.args[0], relax.Var):
        var, value = value.args[0], bound.get(value.args[0])
    return var in kernel_read or value is None or isinstance(value, relax.TupleGetItem) or (
        isinstance(value, relax.Call) and value.op in _KERNEL_CALLS)


def binding_uses(func: relax.Function) -> dict:
    """var -> indices of the bindings (and len(bindings) for the function's result) that read it,
    the bindings counted as in `flat_bindings`."""
    uses: dict = {}
    bindings = flat_bindings(func)[0]
    for i, b in enumerate([*bindings, None]):
        for e in sub_expressions(func.body.body if b is None else b.value):
            if isinstance(e, relax.Var):
                uses.setdefault(e, []).append(i)
    return uses


def bind_as(builder: relax.BlockBuilder, old: relax.Var, value: relax.Expr) -> relax.Var:
    """A var holding `value` to remap `old` to: a dataflow var where `old` is one, else a block
    output.  An in-place step's block hands its gradients to the update after it; remapped to a
    dataflow var, such an output would be read outside its block (ill-formed: the partitioner
    then sees a value nothing reads)."""
    if isinstance(old, relax.DataflowVar) or not builder.current_block_is_dataflow():
        return value if isinstance(value, relax.Var) else builder.emit(value)
    return builder.emit_output(value)


def _outputs(builder: relax.BlockBuilder, call: relax.Call, count: int) -> list:
    """The vars of `call`'s `count` outputs: the call's own var when it has one, else one a field."""
    var = builder.emit(call)
    return [var] if count == 1 else [builder.emit(relax.TupleGetItem(var, i)) for i in range(count)]


def emit_call_tir(builder: relax.BlockBuilder, gvar: relax.GlobalVar, args: list, types: list) -> list:
    """Emit ``call_tir(gvar, args)`` with outputs of `types`; the output vars, one per type."""
    return _outputs(builder, relax.call_tir(gvar, args, types if len(types) > 1 else types[0]), len(types))


def emit_call_tir_inplace(builder: relax.BlockBuilder, gvar: relax.GlobalVar, args: list, indices: list[int],
                          types: list) -> list:
    """Emit ``call_tir_inplace(gvar, args)`` whose outputs of `types` are the arguments at
    `indices`, written over; the output vars, one per type."""
    one = len(types) == 1
    call = relax.op.call_tir_inplace(gvar, args, indices[0] if one else indices, types[0] if one else types)
    return _outputs(builder, call, len(types))


def has_call(expr: relax.Expr, op) -> bool:
    """Does `expr` (a function body, say) call `op` (an ``Op``, or any of a collection of them)
    anywhere?"""
    ops = [op] if isinstance(op, tvm.ir.Op) else list(op)
    return any(isinstance(e, relax.Call) and isinstance(e.op, tvm.ir.Op) and any(e.op.same_as(o) for o in ops)
               for e in sub_expressions(expr))


def producer(mutator, expr: relax.Expr, op: tvm.ir.Op) -> relax.Call | None:
    """The call to `op` bound to `expr` in the function `mutator` is visiting, else None."""
    if isinstance(expr, relax.Var):
        bound = mutator.lookup_binding(expr)
        if isinstance(bound, relax.Call) and bound.op == op:
            return bound
    return None


def scalar_value(bound: dict, expr: relax.Expr) -> float | None:
    """The value of a one-element constant, seen through `bound` (var -> bound value) and
    ``astype``, else None."""
    astype = tvm.ir.Op.get("relax.astype")
    while True:
        if isinstance(expr, relax.Var) and expr in bound:
            expr = bound[expr]
        elif isinstance(expr, relax.Call) and expr.op == astype:
            expr = expr.args[0]
        else:
            break
    if not isinstance(expr, tvm.ir.GenericConst):
        return None
    value = expr.value.numpy()
    return float(value.reshape(-1)[0]) if value.size == 1 else None


def add_function_once(builder: relax.BlockBuilder, name: str,
                      make: Callable[[], tvm.ir.BaseFunc]) -> relax.GlobalVar:
    """The global var of function `name` in `builder`'s module, adding ``make()`` (with that
    global symbol) the first time."""
    for gv in builder.get().get_global_vars():
        if gv.name_hint == name:
            return gv
    return builder.add_func(make().with_attr("global_symbol", name), name)


def drop_unreferenced(mod: tvm.IRModule, droppable: Callable[[tvm.ir.BaseFunc], bool]) -> tvm.IRModule:
    """`mod` without the functions `droppable` accepts that no other Relax function refers to
    (calls them, or passes them to ``call_tir``).

    ``DeadCodeElimination`` keeps functions that carry a global symbol, as evt partitions and
    generated kernels do: ``RunCodegen`` would leave an uncalled partition to the VM lowering
    (with its local Composite function it stops the build there), and an unused kernel would be
    compiled for nothing."""
    referenced = {e for _, func in mod.functions_items() if isinstance(func, relax.Function) and not droppable(func)
                  for e in sub_expressions(func.body) if isinstance(e, tvm.ir.GlobalVar)}
    dead = [gv for gv, func in mod.functions_items() if droppable(func) and gv not in referenced]
    if not dead:
        return mod
    return tvm.IRModule({gv: f for gv, f in mod.functions_items() if gv not in dead}, attrs=mod.attrs)


def drop_uncalled(mod: tvm.IRModule, codegen: str) -> tvm.IRModule:
    """`mod` without its ``Codegen=codegen`` functions that no other function calls."""
    return drop_unreferenced(mod, lambda f: isinstance(f, relax.Function) and bool(f.attrs)
                             and f.attrs.get("Codegen") == codegen)


def mutate_relax_functions(mutator, mod: tvm.IRModule, before_each=None) -> tvm.IRModule:
    """Run `mutator` (a PyExprMutator built on `mod`) over every Relax function of `mod`;
    `before_each(func)` may prime the mutator with per-function facts first.  Dataflow vars the
    mutation left read outside their block become block outputs (`expose_escaping_vars`)."""
    for gv, func in mod.functions_items():
        if isinstance(func, relax.Function):
            if before_each is not None:
                before_each(func)
            mutator.builder_.update_func(gv, expose_escaping_vars(mutator.visit_expr(func)))
    return mutator.builder_.get()


PARTITION_ATTRS = ("Codegen", "Composite", "Primitive")  # a function with one is a partition or kernel


def mutate_step_functions(mutator, mod: tvm.IRModule, functions: tuple[str, ...] | None = None,
                          before_each=None) -> tvm.IRModule:
    """Run `mutator` (a PyExprMutator built on `mod`) over the Relax functions of `mod` that are
    not partitions or kernels (``PARTITION_ATTRS``), or over those named in `functions`;
    `before_each(func)` may prime it first.  A function the mutator changed loses its unused
    bindings; `mod` itself is returned when none changed."""
    changed = []
    for gv, func in mod.functions_items():
        if not isinstance(func, relax.Function) or (functions is not None and gv.name_hint not in functions):
            continue
        if func.attrs is not None and any(k in func.attrs for k in PARTITION_ATTRS):
            continue
        if before_each is not None:
            before_each(func)
        new = mutator.visit_expr(func)
        if not new.same_as(func):
            changed.append((gv, relax.analysis.remove_all_unused(new)))
    if not changed:
        return mod
    for gv, func in changed:
        mutator.builder_.update_func(gv, func)
    return mutator.builder_.get()


@mutator
class _BindingReplacer(PyExprMutator):
    def __init__(self, mod: tvm.IRModule, find: Callable):
        super().__init__(mod)
        self.find = find
        self.replace: dict = {}
        self.replaced = 0

    def visit_dataflow_block_(self, block: relax.DataflowBlock) -> relax.DataflowBlock:
        self.replace = self.find(block)
        return super().visit_dataflow_block_(block)

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        build = self.replace.get(binding.var)
        if build is None:
            return super().visit_var_binding_(binding)
        self.replaced += 1
        value = self.builder_.normalize(build(self.visit_expr))
        self.set_var_remap(binding.var, bind_as(self.builder_, binding.var, value))


def replace_bindings(mod: tvm.IRModule, find: Callable) -> tvm.IRModule:
    """Each Relax function of `mod` with the values of its dataflow blocks' bindings replaced:
    `find(block)` gives ``{var: build}``, ``build(visit)`` the new value from the operands it
    passes through `visit` (the mutator's ``visit_expr``).  The intermediates nothing reads any
    more are dropped from the functions that changed."""
    replacer = _BindingReplacer(mod, find)
    for gv, func in mod.functions_items():
        if isinstance(func, relax.Function):
            replacer.replaced = 0
            new = replacer.visit_expr(func)
            if replacer.replaced:
                replacer.builder_.update_func(gv, relax.analysis.remove_all_unused(new))
    return replacer.builder_.get()


def escaping_vars(func: relax.Function) -> frozenset:
    """The dataflow vars `func` reads outside the dataflow block that binds them: in its result or
    a plain binding block (ill-formed; the partitioner takes them for values nothing reads)."""
    body = func.body
    if not isinstance(body, relax.SeqExpr):
        return frozenset()
    outside = [body.body] + [b.value for block in body.blocks if not isinstance(block, relax.DataflowBlock)
                             for b in block.bindings]
    return frozenset(v for e in outside for v in relax.analysis.free_vars(e) if isinstance(v, relax.DataflowVar))


@mutator
class _Exposer(PyExprMutator):
    def __init__(self, escaping: frozenset):
        super().__init__()
        self.escaping = escaping

    def visit_dataflow_var_def_(self, var: relax.DataflowVar) -> relax.Var:
        return relax.Var(var.name, var.ty) if var in self.escaping else var


def expose_escaping_vars(func: relax.Function) -> relax.Function:
    """`func` with the dataflow vars it reads outside their block (`escaping_vars`) bound as
    block outputs instead.  A rewrite that remaps a block's output to a value it emits (a dataflow
    var) leaves such a read: where a training step is cut into functions (data parallel's
    segments), every value crossing a cut is an output, and any of them may be rewritten."""
    escaping = escaping_vars(func)
    return _Exposer(escaping).visit_expr(func) if escaping else func


def rewrite_function(
    mutator,
    func: relax.Function,
    fix_output: Callable[[relax.BlockBuilder, int, relax.Expr], relax.Expr],
    extra_params: Sequence[relax.Var] = (),
) -> relax.Function:
    """Run `mutator` over the bindings of `func`, then map each returned field through
    `fix_output(builder, index, field)` in a trailing dataflow block.  The result keeps the
    parameters (plus `extra_params`), attributes and purity of `func`."""
    body = func.body
    blocks = [mutator.visit_binding_block(b) for b in body.blocks]
    ret = body.body
    is_tuple = isinstance(ret, relax.Tuple)
    fields = list(ret.fields) if is_tuple else [ret]
    bb = mutator.builder_
    bb._begin_dataflow_block()
    outs = [bb.emit_output(fix_output(bb, i, mutator.visit_expr(f))) for i, f in enumerate(fields)]
    blocks.append(bb._end_block())
    new_ret = relax.Tuple(outs) if is_tuple else outs[0]
    return relax.Function(
        list(func.params) + list(extra_params),
        bb.normalize(relax.SeqExpr(blocks, new_ret)),
        None,
        func.is_pure,
        func.attrs,
    )

"""Rematerialize: keep fewer forward values for the backward, recomputing the rest there, so the
training step fits a memory budget.

``compile_training(..., memory_budget=B)`` marks ``train_step`` with ``BUDGET_ATTR``; this pass
runs after the partitioner (its units are the partitioned step's calls: a GEMM partition with its
epilogue, an attention call, a TVM op) and nothing after it eliminates common subexpressions, so
the copies it makes stay copies.  A function without the attribute is left as it is.

The step is one graph: bindings up to the loss's are the forward, the rest the backward and the
update.  A forward value read after the loss is *saved*: it stays alive from where it is computed
to its last reader, and at the loss all saved values are alive at once — the activations that make
a training step's peak.  Each forward value ``u`` gets two 0/1 choices, ``keep[u]`` (alive at the
loss) and ``recompute[u]`` (computed again in the backward, just before its first backward reader,
from kept or recomputed operands), and the integer program (Checkmate, MLSys'20, with its peak
constraint taken at the loss only) is

    minimise   sum_u recompute[u] * cost(u)
    subject to keep[u] + recompute[u] >= 1                 for every saved u
               keep[a] + recompute[a] >= recompute[u]      for every forward operand a of u
               sum_u keep[u] * bytes(u) <= B_saved

with ``cost`` from the roofline of what the call does (GEMM and attention FLOPs, else bytes moved;
``recompute_seconds``) and ``bytes`` its output's size (a tuple's: all its tensors, which a kept
tuple keeps).  A call that is impure, or whose value is not a call, a tuple or a projection of one,
is never recomputed.

``B_saved`` starts as the saved bytes less the overshoot of the estimated peak over the budget.
Every plan is validated on the rewritten function by ``estimate_peak`` (each tensor alive from its
binding to its last reader, the arguments all the step), and ``B_saved`` is lowered by what is
still over until the estimate fits.  Each round also makes a greedy plan (cheapest recompute
seconds per byte first, operands recomputed with what needs them), with its own correction, and of
the plans that fit the one recomputing the fewest seconds wins: the program's model of the live
bytes is not the estimate's, and the program has a time limit (``TIME_LIMIT``).  Values of at most
``SMALL_SHARE`` of the saved bytes are kept, not variables (BERT-Large, 24 layers: 1512 variables,
solved in about a second).  A budget no plan found meets raises ``MemoryBudgetError`` naming the
smallest budget the search met (``_smallest_met``: budgets stepping down from the step's own peak).
That is what this search meets, not a bound (BERT-Large at batch 187, 72 GB: the greedy plan's order
decides whether it is met).

The estimate counts every Relax tensor as allocated; the build's fused kernels keep fewer
intermediates (``TrainingStep.memory_report`` reads the real plan), so the estimate errs high.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import time

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from ...errors import MemoryBudgetError
from .._rewrite import COPY_SUFFIX, VIEWS, flat_bindings, op_name, resolve_alias, sub_expressions
from ..ops.attention_op import FORWARD as ATTENTION
from .evt_cost import type_bytes, static_shape, tensor_bytes
from .partition_evt import ILP_SOLVER

BUDGET_ATTR = "tvm_evt.memory_budget"  # bytes, set on train_step by compile_training
REPORT_ATTR = "tvm_evt.rematerialized"  # JSON: what this pass decided (TrainingStep.memory_report)
TIME_LIMIT = 20.0  # seconds for one integer program
MAX_ROUNDS = 8  # plans validated against the estimate before giving up
SMALL_SHARE = 1e-4  # of the saved bytes: a forward value this small is kept, not an integer program's variable

# a roofline good enough to rank recomputations (H100 SXM, dense bf16 / HBM3)
FLOPS_PER_S = 6.0e14
BYTES_PER_S = 3.0e12
LAUNCH_S = 4e-6  # a kernel launch and its gap: what a recomputed cheap op still costs
GEMM_OPS = frozenset({"relax.matmul"})
ATTENTION_OPS = frozenset({ATTENTION})  # q [B, H, Sq, D], k [B, H, Sk, D]


# ------------------------------------------------------------------------------ the step's graph


@dataclasses.dataclass
class _Node:
    """A forward binding."""

    var: relax.Var
    value: relax.Expr
    index: int
    bytes: int  # kept: what stays alive (a projection of a call's tuple: its one tensor)
    copy_bytes: int  # recomputed: what its copy allocates (a projection: nothing, its tuple's copy does)
    seconds: float  # to recompute it
    operands: list  # forward vars it reads
    recomputable: bool


@dataclasses.dataclass
class StepGraph:
    """`func`'s forward bindings and which of them the backward reads."""

    func: relax.Function
    boundary: int  # index of the loss's binding
    nodes: dict  # var -> _Node, the forward bindings of the loss's block
    saved: list  # forward vars read after the boundary, in binding order
    pinned: set  # saved vars some reader outside the loss's block needs as they are
    first_read: dict  # saved var -> index of its first reader after the boundary
    last_read: dict  # saved var -> index of its last reader (the result: len(bindings))

    @property
    def saved_bytes(self) -> int:
        return sum(self.nodes[v].bytes for v in self.saved)

    def seconds(self, plan: set) -> float:
        """What recomputing the vars of `plan` costs (``recompute_seconds`` summed)."""
        return sum(self.nodes[v].seconds for v in plan)

    @functools.cached_property
    def live(self) -> list:
        """`live_bytes` of the step as it is."""
        return live_bytes(self.func)

    @functools.cached_property
    def need(self) -> tuple[dict, dict]:
        """`_need` of the step."""
        return _need(self)


def budgeted(func) -> bool:
    """Is `func` a Relax function with a memory budget (``BUDGET_ATTR``)?"""
    return isinstance(func, relax.Function) and bool(func.attrs) and BUDGET_ATTR in func.attrs


def loss_var(func: relax.Function, bindings: list) -> relax.Var:
    """The step's loss: the first field of the tuple ``train_step`` returns (its first leaf)."""
    bound = {b.var: b.value for b in bindings}
    result = resolve_alias(bound, func.body.body)
    result = bound.get(result, result) if isinstance(result, relax.Var) else result
    while isinstance(result, relax.Tuple) and result.fields and isinstance(result.fields[0], relax.Tuple):
        result = result.fields[0]  # main_adjoint: ((loss,), (gradients...))
    if not isinstance(result, relax.Tuple) or not result.fields or not isinstance(result.fields[0], relax.Var):
        raise ValueError("Rematerialize: train_step must return a tuple whose first field is the loss")
    return result.fields[0]


def _function_flops(func: relax.Function) -> float:
    return sum(_call_flops(e) for e in sub_expressions(func.body))


def _call_flops(call) -> float:
    """FLOPs of a GEMM or an attention call (0 for anything else)."""
    name = op_name(call)
    if name in GEMM_OPS:
        a = static_shape(call.args[0])
        out = static_shape(call)
        return 2.0 * math.prod(out) * a[-1] if a and out else 0.0
    if name in ATTENTION_OPS:
        q, k = static_shape(call.args[0]), static_shape(call.args[1])
        if q and k:  # Q K^T and P V: two GEMMs of B*H*Sq*Sk*D multiply-adds
            return 4.0 * math.prod(q) * k[-2]
    return 0.0


def recompute_seconds(mod: tvm.IRModule, value: relax.Expr) -> float:
    """What computing `value` again costs: its FLOPs at ``FLOPS_PER_S`` or its bytes at
    ``BYTES_PER_S``, whichever is longer, plus a launch; a projection, view or tuple costs nothing."""
    if not isinstance(value, relax.Call) or op_name(value) in VIEWS:
        return 0.0
    moved = tensor_bytes(value) + sum(tensor_bytes(a) for a in tensor_args(value))
    flops = _call_flops(value)
    if isinstance(value.op, relax.GlobalVar) and isinstance(mod[value.op], relax.Function):
        flops += _function_flops(mod[value.op])
    return LAUNCH_S + max(flops / FLOPS_PER_S, moved / BYTES_PER_S)


def tensor_args(call: relax.Call) -> list:
    out = []
    for a in call.args:
        out.extend(a.fields if isinstance(a, relax.Tuple) else [a])
    return [a for a in out if isinstance(a, relax.Var)]


def _recomputable(value: relax.Expr) -> bool:
    if isinstance(value, (relax.TupleGetItem, relax.Tuple, relax.Var, tvm.ir.expr.Constant)):
        return True
    return isinstance(value, relax.Call) and not relax.analysis.contains_impure_call(value)


def step_graph(mod: tvm.IRModule, func: relax.Function) -> StepGraph:
    bindings, block_of = flat_bindings(func)
    loss = loss_var(func, bindings)
    index = {b.var: i for i, b in enumerate(bindings)}
    if loss not in index:
        raise ValueError("Rematerialize: the loss is not bound in train_step")
    boundary, block = index[loss], block_of.get(loss)
    nodes = {}
    for i, b in enumerate(bindings[: boundary + 1]):
        if block_of.get(b.var) != block:
            continue
        operands = [v for v in relax.analysis.free_vars(b.value) if v in index and index[v] <= boundary]
        own = tensor_bytes(b.var) if op_name(b.value) not in VIEWS else 0
        projection = isinstance(b.value, (relax.TupleGetItem, relax.Tuple, relax.Var))
        nodes[b.var] = _Node(b.var, b.value, i, own, 0 if projection else own,
                             recompute_seconds(mod, b.value), operands,
                             _recomputable(b.value) and all(v in nodes for v in operands))
    saved, pinned, first_read, last_read = [], {loss}, {}, {}
    readers_after = {}
    for i, b in enumerate(bindings[boundary + 1:], boundary + 1):
        for v in relax.analysis.free_vars(b.value):
            if v in index and index[v] <= boundary:
                readers_after.setdefault(v, []).append(block_of.get(b.var) == block and block is not None)
                first_read.setdefault(v, i)
                last_read[v] = i
    for v in relax.analysis.free_vars(func.body.body):  # the result, if not bound in the block
        if v in index and index[v] <= boundary:
            readers_after.setdefault(v, []).append(False)
            first_read.setdefault(v, len(bindings))
            last_read[v] = len(bindings)
    for v in [b.var for b in bindings[: boundary + 1]]:
        if v in readers_after:
            if v not in nodes:
                continue  # bound in another block: kept, outside the plan
            saved.append(v)
            if not all(readers_after[v]):
                pinned.add(v)
    return StepGraph(func, boundary, nodes, saved, pinned, first_read, last_read)


def step_graphs(mod: tvm.IRModule, skip=None):
    """(GlobalVar, `step_graph`) of each training function of `mod` (a Relax function that returns
    its loss first), but those `skip(func)` is true of."""
    for gv, func in mod.functions_items():
        if not isinstance(func, relax.Function) or (skip is not None and skip(func)):
            continue
        try:
            graph = step_graph(mod, func)
        except ValueError:  # no loss returned first: not a training function
            continue
        yield gv, graph


# ------------------------------------------------------------------------------ the estimate


def estimate_peak(func: relax.Function) -> int:
    """Most bytes alive at once in `func` (`live_bytes`)."""
    return max(live_bytes(func))


def live_bytes(func: relax.Function) -> list:
    """Bytes alive at each binding of `func` (and at its result): its arguments throughout, every
    other tensor from its binding to its last reader (views and projections share their operand's
    memory).  A call that returns a tuple allocates each field apart, as the build does (one output
    buffer each): a field lives until the last read of a projection of it, or of the whole tuple.
    A tuple built of existing tensors allocates nothing, and reading it reads them."""
    bindings, _ = flat_bindings(func)
    args = sum(tensor_bytes(p) for p in func.params)
    index = {b.var: i for i, b in enumerate(bindings)}
    end = len(bindings)
    # the memory each var reads: (allocating var, field or None for all of it) pairs
    holds: dict = {}
    made = {}  # allocating var -> the bytes of each of its fields (one entry for a tensor)
    for b in bindings:
        v, value = b.var, b.value
        if isinstance(value, relax.TupleGetItem) and isinstance(value.tuple_value, relax.Var):
            whole = holds.get(value.tuple_value, ())
            fields = [(o, value.index) for o, f in whole if f is None and len(made.get(o, ())) > 1]
            holds[v] = tuple(fields) if len(fields) == len(whole) and fields else whole
        elif isinstance(value, relax.Var) or op_name(value) in VIEWS and isinstance(value.args[0], relax.Var):
            holds[v] = holds.get(value if isinstance(value, relax.Var) else value.args[0], ())
        elif isinstance(value, relax.Tuple):
            holds[v] = tuple(h for f in value.fields if isinstance(f, relax.Var) for h in holds.get(f, ()))
        else:
            ty = getattr(v, "ty", None)
            made[v] = [type_bytes(f) for f in ty.fields] if isinstance(ty, relax.TupleType) else [tensor_bytes(v)]
            holds[v] = ((v, None),)
    until: dict = {}  # (allocating var, field) -> last index its memory is read
    for v in made:
        for k in range(len(made[v])):
            until[(v, k)] = index[v]

    def read(var, i: int) -> None:
        for o, field in holds.get(var, ()):
            for k in (range(len(made[o])) if field is None else (field,)):
                until[(o, k)] = max(until[(o, k)], i)

    for i, b in enumerate(bindings):
        if isinstance(b.value, relax.TupleGetItem) and isinstance(b.value.tuple_value, relax.Var):
            read(b.var, i)  # a projection reads its field, not the whole tuple
            continue
        for v in relax.analysis.free_vars(b.value):
            read(v, i)
    for v in relax.analysis.free_vars(func.body.body):
        read(v, end)
    delta = [0] * (end + 2)
    for (v, k), stop in until.items():
        n = made[v][k]
        delta[index[v]] += n
        delta[stop + 1] -= n
    profile, live = [], args
    for d in delta[: end + 1]:
        live += d
        profile.append(live)
    return profile


# ------------------------------------------------------------------------------ the plan


def _closure_seconds(graph: StepGraph, v, recompute: set, keep: set, extra: dict) -> None:
    """Add to `extra` what recomputing `v` needs that is neither kept nor recomputed yet."""
    stack = [v]
    while stack:
        u = stack.pop()
        if u in recompute or u in extra:
            continue
        extra[u] = graph.nodes[u].seconds
        for a in graph.nodes[u].operands:
            if a not in keep and a not in recompute:
                stack.append(a)


def greedy_plan(graph: StepGraph, saved_budget: int) -> set | None:
    """Recompute saved values, cheapest seconds per byte first, until what stays fits."""
    recompute: set = set()
    keep = set(graph.saved)
    kept = graph.saved_bytes
    order = []
    for v in graph.saved:
        node = graph.nodes[v]
        if v in graph.pinned or not node.recomputable or node.bytes == 0:
            continue
        extra: dict = {}
        _closure_seconds(graph, v, recompute, keep - {v}, extra)
        if all(graph.nodes[u].recomputable for u in extra):
            order.append((sum(extra.values()) / node.bytes, node.index, v))
    for _, _, v in sorted(order, key=lambda t: (t[0], t[1])):
        if kept <= saved_budget:
            break
        extra = {}
        _closure_seconds(graph, v, recompute, keep - {v}, extra)
        if not all(graph.nodes[u].recomputable for u in extra):
            continue
        recompute |= set(extra)
        keep.discard(v)
        kept -= graph.nodes[v].bytes
    return recompute if kept <= saved_budget else None


MAX_POINTS = 48  # points after the loss the integer program bounds the live bytes at, besides the loss's


def _need(graph: StepGraph) -> tuple[dict, dict]:
    """(var -> first index after the loss a copy of it may be needed at, var -> last index it is
    needed at) for every forward var: its own readers after the loss, and through a forward reader
    it feeds, the point that reader's copy is made at, once (a value that is not saved is only
    ever recomputed, so its need is its readers'; a saved reader is recomputed at its own first
    reader).  Counting such a value alive to the reader's last use instead made BERT-Large's
    program at batch 187 infeasible where the greedy plan fits."""
    end = max(graph.last_read.values(), default=graph.boundary)
    start_of, end_of = {}, {}
    readers: dict = {}
    for node in graph.nodes.values():
        for a in node.operands:
            readers.setdefault(a, []).append(node.var)
    for node in sorted(graph.nodes.values(), key=lambda n: -n.index):  # readers first
        v = node.var
        first, last = graph.first_read.get(v, end + 1), graph.last_read.get(v, graph.boundary)
        for w in readers.get(v, ()):
            if w in graph.pinned or not graph.nodes[w].recomputable:
                continue  # never recomputed: it needs v only where it is computed, in the forward
            first = min(first, graph.first_read[w] if w in graph.first_read else start_of[w])
            last = max(last, start_of[w])  # w's copy is made once, there: v is not read after
        start_of[v], end_of[v] = first, last
    return start_of, end_of


def ilp_plan(graph: StepGraph, room: dict, time_limit: float = TIME_LIMIT, lowest_peak: bool = False) -> set | None:
    """The integer program of the module docstring, the live bytes bounded at each point of `room`
    ({binding index: bytes the forward values may take there}): the recomputed vars, or None
    (infeasible, or no solution in `time_limit`).  `lowest_peak`: minimise the largest overshoot
    of `room` instead (the plan that needs the smallest budget), recompute time second."""
    import mip

    nodes = list(graph.nodes.values())
    start_of, end_of = graph.need
    m = mip.Model(sense=mip.MINIMIZE, solver_name=ILP_SOLVER)
    m.verbose, m.threads, m.seed = 0, 1, 0
    # a value of at most SMALL_SHARE of the saved bytes is kept, not decided: a 24-layer model's
    # thousands of statistics, views and scalars would otherwise be most of the program's variables
    small = SMALL_SHARE * graph.saved_bytes
    decided = [n for n in nodes if max(n.bytes, n.copy_bytes) > small or not n.recomputable]
    variables = {n.var for n in decided}
    keep = {n.var: 1 for n in nodes} | {n.var: m.add_var(var_type=mip.BINARY) for n in decided}
    rec = {n.var: 0 for n in nodes} | {n.var: m.add_var(var_type=mip.BINARY, ub=1 if n.recomputable else 0)
                                       for n in decided}
    seconds = mip.xsum((n.seconds * 1e6 + 1e-3) * rec[n.var] for n in decided)
    over = m.add_var(lb=0.0) if lowest_peak else 0
    m.objective = mip.minimize(over * 1e3 + seconds if lowest_peak else seconds)  # a byte over > a microsecond
    saved = set(graph.saved)
    for n in decided:
        if n.var in saved:
            m += keep[n.var] + rec[n.var] >= 1
            if n.var in graph.pinned:
                m += keep[n.var] >= 1
        for a in n.operands:
            if a in variables:  # (a small operand is kept: always there)
                m += keep[a] + rec[a] >= rec[n.var]
    for p, bytes_left in room.items():
        alive = [n.bytes * keep[n.var] for n in nodes if n.bytes and p <= end_of[n.var]]
        alive += [n.copy_bytes * rec[n.var] for n in decided if n.copy_bytes and start_of[n.var] <= p <= end_of[n.var]]
        m += mip.xsum(alive) <= bytes_left + over
    status = m.optimize(max_seconds=time_limit)
    if status not in (mip.OptimizationStatus.OPTIMAL, mip.OptimizationStatus.FEASIBLE):
        return None
    return {n.var for n in decided if rec[n.var].x is not None and rec[n.var].x > 0.5}


def room_at(graph: StepGraph, budget: int, slack: int) -> dict:
    """{point: bytes the forward values kept or recomputed may take there}: the budget, less what
    else is alive there in the step as it is (arguments, gradients, backward temporaries) and
    `slack`; at the loss, where each saved value's need starts, and at the ``MAX_POINTS`` other
    points after the loss with the least room."""
    live = graph.live
    start_of, _ = graph.need
    by_end = {}
    for v in graph.saved:
        by_end[graph.last_read[v]] = by_end.get(graph.last_read[v], 0) + graph.nodes[v].bytes
    room, saved_alive = {}, graph.saved_bytes
    for p in range(graph.boundary, len(live)):
        room[p] = budget - (live[p] - saved_alive) - slack
        saved_alive -= by_end.get(p, 0)  # dead after its last reader
    starts = {graph.boundary} | {start_of[v] for v in graph.saved if start_of[v] in room}
    tight = sorted(set(room) - starts, key=lambda p: (room[p], p))[:MAX_POINTS]
    return {p: room[p] for p in sorted(starts | set(tight))}


# ------------------------------------------------------------------------------ the rewrite


@mutator
class _Rematerializer(PyExprMutator):
    """Bind a copy of each recomputed value just before its first reader after the loss."""

    def __init__(self, mod: tvm.IRModule, graph: StepGraph, recompute: set):
        super().__init__(mod)
        self.graph, self.recompute = graph, recompute
        self.position = 0
        self.copies: dict = {}

    def _copy(self, v: relax.Var) -> None:
        if v in self.copies:
            return
        for a in self.graph.nodes[v].operands:
            if a in self.recompute:
                self._copy(a)
        value = self.visit_expr(self.graph.nodes[v].value)  # its operands already remapped to copies
        copy = self.builder_.emit(value, name_hint=f"{v.name}{COPY_SUFFIX}")
        self.copies[v] = copy
        self.set_var_remap(v, copy)

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        position, self.position = self.position, self.position + 1
        if position > self.graph.boundary:
            for v in relax.analysis.free_vars(binding.value):
                if v in self.recompute and v not in self.copies:
                    self._copy(v)
        super().visit_var_binding_(binding)


def rewrite(mod: tvm.IRModule, graph: StepGraph, recompute: set) -> relax.Function:
    return _Rematerializer(mod, graph, recompute).visit_expr(graph.func)


# ------------------------------------------------------------------------------ the pass


def _search(mod: tvm.IRModule, graph: StepGraph, budget: int, deadline: float) -> tuple:
    """(estimated peak, plan, method, rounds) of the first plan that fits `budget`, else of the
    plan with the lowest estimated peak of those tried (the step as it is among them)."""
    best = (max(graph.live), set(), "none", 0)
    slack = {"ilp": 0, "greedy": 0}  # each method's own correction: what its last plan was over
    for rounds in range(1, MAX_ROUNDS + 1):
        # both plans, each validated: the program's model of the live bytes is not the estimate's, and
        # where its plan needs slack to fit, the greedy one can fit with less recomputed
        plans = [(plan, method) for plan, method in
                 ((ilp_plan(graph, room_at(graph, budget, slack["ilp"]), max(0.5, deadline - time.perf_counter())),
                   "ilp"),
                  (greedy_plan(graph, room_at(graph, budget, slack["greedy"])[graph.boundary]), "greedy"))
                 if plan is not None]
        if not plans:
            break
        tried = [(estimate_peak(rewrite(mod, graph, plan)), plan, method, rounds) for plan, method in plans]
        best = min([best, *tried], key=lambda t: t[0])
        fitting = [t for t in tried if t[0] <= budget]
        if fitting:
            return min(fitting, key=lambda t: graph.seconds(t[1]))
        for peak, _, method, _ in tried:
            slack[method] += peak - budget
    plan = ilp_plan(graph, room_at(graph, 0, 0), max(0.5, deadline - time.perf_counter()), lowest_peak=True)
    if plan is not None:
        best = min(best, (estimate_peak(rewrite(mod, graph, plan)), plan, "ilp_lowest_peak", MAX_ROUNDS),
                   key=lambda t: t[0])
    return best


LADDER = 10  # budgets tried between the step's own peak and a budget missed, to name the smallest met


def _smallest_met(mod: tvm.IRModule, graph: StepGraph, missed: int, before: int, time_limit: float) -> int:
    """The smallest of ``LADDER`` budgets stepping down from `before` (which recomputing nothing
    meets) towards `missed` that the search meets, stopping at the first it misses."""
    met = before
    for k in range(1, LADDER):
        budget = before - (before - missed) * k // LADDER
        if _search(mod, graph, budget, time.perf_counter() + time_limit)[0] > budget:
            break
        met = budget
    return met


def rematerialize(mod: tvm.IRModule, func: relax.Function, budget: int,
                  time_limit: float = TIME_LIMIT) -> tuple[relax.Function, dict]:
    """(`func` recomputing enough of its saved values that `estimate_peak` fits `budget`, the
    report of what was decided)."""
    start = time.perf_counter()
    graph = step_graph(mod, func)
    before = max(graph.live)
    report = {"budget_bytes": budget, "estimated_peak_before": before, "saved_bytes_before": graph.saved_bytes,
              "recomputed": [], "method": "none", "rounds": 0}
    if before <= budget:
        report.update(estimated_peak=before, solve_s=round(time.perf_counter() - start, 3))
        return func, report
    peak, plan, method, rounds = _search(mod, graph, budget, start + time_limit)
    if peak > budget:
        raise MemoryBudgetError.of(budget, _smallest_met(mod, graph, budget, before, time_limit))
    kept = [v for v in graph.saved if v not in plan]
    report.update(method=method, rounds=rounds, estimated_peak=peak, solve_s=round(time.perf_counter() - start, 3),
                  saved_bytes_after=sum(graph.nodes[v].bytes for v in kept),
                  recompute_seconds=graph.seconds(plan), recomputed=_listed(graph, plan))
    return rewrite(mod, graph, plan), report


def _listed(graph: StepGraph, plan: set) -> list:
    return [{"name": v.name, "op": _describe(graph.nodes[v].value), "bytes": graph.nodes[v].bytes}
            for v in sorted(plan, key=lambda v: graph.nodes[v].index)]


def _describe(value: relax.Expr) -> str:
    if isinstance(value, relax.Call):
        return value.op.name_hint if isinstance(value.op, relax.GlobalVar) else str(getattr(value.op, "name", value.op))
    return type(value).__name__


@tvm.transform.module_pass(opt_level=0, name="Rematerialize")
class Rematerialize:
    """Recompute forward values in the backward where a function's ``BUDGET_ATTR`` asks for it
    (module docstring); the decision is left on the function as ``REPORT_ATTR``."""

    def __init__(self, time_limit: float = TIME_LIMIT):
        self.time_limit = time_limit

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        updates = {}
        for gv, func in mod.functions_items():
            if not budgeted(func):
                continue
            new, report = rematerialize(mod, func, int(func.attrs[BUDGET_ATTR]), self.time_limit)
            new = new.with_attr(REPORT_ATTR, json.dumps(report))
            updates[gv] = new
        for gv, func in updates.items():
            mod[gv] = func
        return mod

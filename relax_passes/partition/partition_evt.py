"""Partition a training graph into GEMM + EVT-epilogue kernels by integer linear programming.

``PartitionEVT`` works on each dataflow block of each Relax function:

1. **Candidate graph.**  Every ``relax.matmul`` seeds a cluster.  Its *core* is the matmul plus
   the ``permute_dims``/``reshape`` views of its operands the main loop can fold (the codegen's
   ``legality`` decides: views folded, else plain operands).  Its *candidates* are the ops
   downstream of the matmul that an epilogue can compute on the M x N tile (elementwise ops,
   broadcasts along M or N, row/column/scalar reductions as terminal stores); each candidate is
   checked with ``tvm_evt.codegen.legality`` together with the candidates it depends on.
2. **ILP** (python-mip, HiGHS).  Binary ``x[v, c]``: op ``v`` joins cluster ``c``.  An op joins at
   most one cluster; it joins only with every input that depends on the seed (no value leaves and
   re-enters a kernel); ``store``/``read`` variables linearise the bytes a cluster writes and
   reads; objective = bytes removed - epilogue costs (``evt_cost``).  The cluster graph must be
   acyclic: cycles found in a solution are cut (``x`` of the ops that close the cycle cannot all
   be 1) and the model is solved again, which is exact (a cycle through the same memberships
   exists whatever else is chosen).
3. **Components** of clusters that share no candidate are solved separately; a component's
   model, canonically numbered, is hashed, so the 24 identical layers of BERT-Large are solved
   once, and solutions are cached on disk (``$XDG_CACHE_HOME/tvm_evt``).  A whole-graph cache keyed
   by the block's canonical hash skips candidate generation altogether.
4. **Validation.**  Every solution (ILP, cached, or the greedy fallback used after a time limit)
   is checked to be feasible and acyclic, and each partition is rebuilt and given to ``legality``;
   ops of an illegal partition are dropped from its end until it is legal (a lone matmul at worst).
5. **Rewrite.**  Each cluster becomes a function ``Codegen="evt"`` wrapping a ``Composite``
   function (the form ``FuseOpsByPattern(annotate_codegen=True)`` makes and ``RunCodegen``
   expects); everything else is left to TVM.  Matmuls the codegen refuses are recorded with the
   reason in the module attribute ``evt_partition_report``.
"""
from __future__ import annotations

import hashlib
import heapq
import json
import os
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import tvm
import tvm_ffi
from tvm import relax

from . import evt_cost
from .._rewrite import dtype_of, is_copy, op_name
from .evt_cost import static_shape, tensor_bytes

COMPOSITE_NAME = "evt.gemm_epilogue"
CODEGEN = "evt"
REPORT_ATTR = "evt_partition_report"
MAX_CANDIDATES = 48  # epilogue candidates per cluster (breadth-first from the matmul)
DEFAULT_TIME_LIMIT = 60.0  # seconds for the whole function; then the greedy fallback
CACHE_VERSION = 2
ILP_SOLVER = "HiGHS"  # python-mip's solver for every integer program here (highspy is a dependency; CBC needs cbcbox)


# =============================================================================== codegen queries
def _codegen():
    """The codegen's legality API and op tables (imported lazily: codegen is heavy)."""
    import importlib

    legality_mod = importlib.import_module("tvm_evt.codegen.legality")
    rp = importlib.import_module("tvm_evt.codegen.frontend.relax_partition")

    return legality_mod, rp


def _capability_key() -> str:
    legality_mod, _ = _codegen()
    return hashlib.sha256(repr(legality_mod.CAPABILITIES).encode()).hexdigest()[:16]


# ================================================================================== the op graph
@dataclass
class OpNode:
    index: int
    var: relax.Var
    value: relax.Expr
    op: str | None  # "relax.add", the extern symbol of a call_pure_packed, None for non-calls
    inputs: tuple[int, ...]  # producer bindings in this block (distinct, in argument order)
    ext_inputs: tuple[tuple[str, int], ...]  # (key, bytes) of tensors from outside the block
    nbytes: int
    shape: tuple[int, ...] | None
    dtype: str | None
    is_output: bool  # the value leaves the block
    users: list[int] = field(default_factory=list)
    absorbed: bool = False  # a later kernel computes it in passing (a layer norm gradient's row kernel)
    # a forward value recomputed in the backward (named with COPY_SUFFIX): it joins no epilogue, whose
    # GEMMs of its operands run in the forward and would store it there again
    copy: bool = False

    @property
    def traffic(self) -> int:
        """Bytes this op moves as a kernel of its own (a reshape is a free view; an absorbed op is
        no kernel of its own: its reader's kernel reads its inputs instead)."""
        if self.op is None or self.op == "relax.reshape" or self.absorbed:
            return 0
        return self.input_bytes + self.nbytes

    input_bytes: int = 0


def _op_name(value) -> str | None:
    name = op_name(value)
    if name == "relax.call_pure_packed" and isinstance(value.args[0], relax.ExternFunc):
        return str(value.args[0].global_symbol)
    return name


def _leaf_args(expr):
    """Vars and constants directly used by a binding's value (through tuples)."""
    if isinstance(expr, relax.Call):
        for a in expr.args:
            yield from _leaf_args(a)
    elif isinstance(expr, relax.Tuple):
        for f in expr.fields:
            yield from _leaf_args(f)
    elif isinstance(expr, relax.TupleGetItem):
        yield from _leaf_args(expr.tuple_value)
    elif isinstance(expr, (relax.Var, tvm.ir.expr.Constant)):
        yield expr


class OpGraph:
    """The bindings of one dataflow block as a DAG, with bytes and users; the vars in `absorbed`
    are ops a later kernel computes in passing (``OpNode.absorbed``)."""

    def __init__(self, block: relax.DataflowBlock, absorbed: frozenset = frozenset()):
        self.block = block
        self.nodes: list[OpNode] = []
        self.index_of: dict = {}
        ext_keys: dict = {}
        ext_bytes: dict = {}
        for i, b in enumerate(block.bindings):
            value = getattr(b, "value", None)
            inputs, ext = [], []
            for leaf in _leaf_args(value) if value is not None else ():
                if isinstance(leaf, relax.Var) and leaf in self.index_of:
                    j = self.index_of[leaf]
                    if j not in inputs:
                        inputs.append(j)
                else:
                    if leaf not in ext_keys:
                        ext_keys[leaf] = f"x{len(ext_keys)}"
                        ext_bytes[leaf] = tensor_bytes(leaf)
                    key = ext_keys[leaf]
                    if key not in [k for k, _ in ext]:
                        ext.append((key, ext_bytes[leaf]))
            shape, dtype = static_shape(b.var), dtype_of(b.var)
            nbytes = _elems(shape) * evt_cost.dtype_bytes(dtype) if shape is not None else tensor_bytes(b.var)
            node = OpNode(
                index=i, var=b.var, value=value, op=_op_name(value) if value is not None else None,
                inputs=tuple(inputs), ext_inputs=tuple(ext), nbytes=nbytes,
                shape=shape, dtype=dtype,
                is_output=not isinstance(b.var, relax.DataflowVar), absorbed=b.var in absorbed,
                copy=is_copy(b.var),
            )
            node.input_bytes = sum(self.nodes[j].nbytes for j in inputs) + sum(n for _, n in ext)
            self.nodes.append(node)
            self.index_of[b.var] = i
            for j in inputs:
                self.nodes[j].users.append(i)
        self.ext_keys = ext_keys

    def descendants(self, i: int) -> set[int]:
        seen, stack = set(), [i]
        while stack:
            for u in self.nodes[stack.pop()].users:
                if u not in seen:
                    seen.add(u)
                    stack.append(u)
        return seen

    def canonical_hash(self) -> str:
        """A hash of the block's ops, attributes, types and edges (names ignored, but for whether a binding
        is a backward copy: ``OpNode.copy``)."""
        h = hashlib.sha256()
        keys = {}
        for node in self.nodes:
            args = []
            for leaf in _leaf_args(node.value) if node.value is not None else ():
                if isinstance(leaf, relax.Var) and leaf in self.index_of:
                    args.append(f"n{self.index_of[leaf]}")
                elif isinstance(leaf, tvm.ir.expr.Constant):
                    data = leaf.value.numpy() if hasattr(leaf.value, "numpy") else __import__("numpy").asarray(leaf.value)
                    args.append(f"c{data.dtype}{data.shape}{hashlib.sha1(data.tobytes()).hexdigest()[:12]}")
                else:
                    args.append(keys.setdefault(leaf, f"p{len(keys)}:{leaf.ty}"))
            attrs = str(node.value.attrs) if isinstance(node.value, relax.Call) and node.value.attrs is not None else ""
            kind = type(node.value).__name__
            ty = (node.shape, node.dtype) if node.shape is not None else str(node.var.ty)
            copy = "|copy" if node.copy else ""  # (absent otherwise: the keys made before it stay valid)
            h.update(f"{node.index}|{kind}|{node.op}|{attrs}|{args}|{ty}|{node.is_output}|{node.absorbed}{copy}\n".encode())
        return h.hexdigest()


def _elems(shape) -> int:
    n = 1
    for d in shape or ():
        n *= d
    return n


# ===================================================================== building partition funcs
def _substitute(expr, vmap):
    if isinstance(expr, relax.Var):
        return vmap.get(expr, expr)
    if isinstance(expr, relax.Tuple):
        return relax.Tuple([_substitute(f, vmap) for f in expr.fields])
    if isinstance(expr, relax.Call):
        return relax.Call(expr.op, [_substitute(a, vmap) for a in expr.args], expr.attrs, expr.ty_args)
    return expr


def partition_io(graph: OpGraph, members: list[int], owned: set[int] | None = None):
    """(params, outputs) of the partition ``members`` (sorted binding indices).

    Params are the outside vars the members use, in order of first use; outputs are the members
    used outside (or leaving the block), in binding order.  ``owned`` (default: all members) are
    the ones the partition replaces; the others (duplicated views) never count as outputs."""
    owned = set(members) if owned is None else owned
    mset = set(members)
    params, seen = [], set()
    for i in members:
        for leaf in _leaf_args(graph.nodes[i].value):
            if isinstance(leaf, relax.Var) and graph.index_of.get(leaf) not in mset and leaf not in seen:
                seen.add(leaf)
                params.append(leaf)
    outputs = [
        i for i in members
        if i in owned and (graph.nodes[i].is_output or any(u not in mset for u in graph.nodes[i].users))
    ]
    return params, outputs


def build_partition_function(graph: OpGraph, members: list[int], outputs: list[int], params,
                             symbol: str) -> relax.Function:
    """``Codegen="evt"`` function wrapping a ``Composite`` function of ``members``."""
    bb = relax.BlockBuilder()
    inner_params = [relax.Var(p.name, p.ty) for p in params]
    vmap = dict(zip(params, inner_params))
    with bb.function("composite", inner_params, attrs={"Composite": COMPOSITE_NAME}):
        with bb.dataflow():
            for i in members:
                node = graph.nodes[i]
                value = _substitute(node.value, vmap)
                if i in outputs:
                    vmap[node.var] = bb.emit_output(value, name_hint=node.var.name)
                else:
                    vmap[node.var] = bb.emit(value, name_hint=node.var.name)
        outs = [vmap[graph.nodes[i].var] for i in outputs]
        bb.emit_func_output(outs[0] if len(outs) == 1 else relax.Tuple(outs))
    inner = bb.get()["composite"].without_attr("global_symbol")
    outer_params = [relax.Var(p.name, p.ty) for p in params]
    bb2 = relax.BlockBuilder()
    with bb2.function(symbol, outer_params, attrs={"Codegen": CODEGEN}):
        out = bb2.emit(relax.Call(inner, outer_params), name_hint="output")
        bb2.emit_func_output(out)
    return bb2.get()[symbol]


# ================================================================================= the problem
@dataclass
class Cluster:
    seed: int  # the matmul's binding index
    views: tuple[int, ...]  # operand views folded into the main loop (duplicated, not owned)
    candidates: list[int]  # epilogue candidates, in binding order
    seed_deps: dict  # candidate -> its inputs that depend on the seed (all candidates or the seed)
    core_reads: frozenset  # tensor keys the core reads (free for the epilogue)
    shape: tuple[int, ...]


@dataclass
class Problem:
    graph: OpGraph
    clusters: list[Cluster]
    refused: dict  # matmul index -> reason the codegen gave


def _is_view(node: OpNode) -> bool:
    return node.op in ("relax.permute_dims", "relax.reshape")


def _node_inputs(graph: OpGraph, node: OpNode):
    """(key, bytes) of every tensor a node reads: block producers as 'n<i>', others as given."""
    return [(f"n{j}", graph.nodes[j].nbytes) for j in node.inputs] + list(node.ext_inputs)


class _Legality:
    """``legality`` of partitions built from the graph, memoised by structure."""

    def __init__(self, graph: OpGraph):
        self.graph = graph
        self.memo: dict = {}
        self.built: dict = {}
        self.calls = 0

    def build(self, members: list[int], owned: set[int]):
        """(function, params, outputs) of a partition, built once per graph."""
        members = sorted(set(members))
        key = (id(self.graph), tuple(members), tuple(sorted(owned)))
        if key not in self.built:
            params, outputs = partition_io(self.graph, members, owned)
            func = build_partition_function(self.graph, members, outputs, params, "evt_check") if outputs else None
            self.built[key] = (func, params, outputs)
        return self.built[key]

    def __call__(self, members: list[int], owned: set[int]):
        func, _, _ = self.build(members, owned)
        if func is None:
            return evt_legality_false("the partition has no output")
        return self.function(func)

    def function(self, func: relax.Function):
        key = tvm_ffi.structural_hash(func, map_free_vars=True)
        if key not in self.memo:
            legality_mod, _ = _codegen()
            self.calls += 1
            self.memo[key] = legality_mod.legality(func)
        return self.memo[key]


def evt_legality_false(reason: str):
    legality_mod, _ = _codegen()
    return legality_mod.Legality(False, reason)


def _view_chain(graph: OpGraph, i: int) -> list[int]:
    """The permute/reshape bindings producing operand ``i`` (innermost first)."""
    chain = []
    while _is_view(graph.nodes[i]):
        chain.append(i)
        producers = graph.nodes[i].inputs
        if not producers:
            break
        i = producers[0]
    return chain[::-1]


def _operand_index(graph: OpGraph, arg):
    return graph.index_of.get(arg) if isinstance(arg, relax.Var) else None


def _choose_core(graph: OpGraph, check, seed: int):
    """(views folded into the main loop, None) or (None, reason): per operand, the longest
    suffix of its view chain the codegen accepts (more folding, fewer materialised copies)."""
    import itertools

    chains = []
    for arg in graph.nodes[seed].value.args:
        j = _operand_index(graph, arg)
        chains.append(_view_chain(graph, j) if j is not None else [])
    options = sorted(itertools.product(*[range(len(c), -1, -1) for c in chains]), key=lambda o: -sum(o))
    reason = ""
    for depth in options:
        views = sorted({v for chain, d in zip(chains, depth) for v in chain[len(chain) - d:]})
        result = check(views + [seed], {seed})
        if result.ok:
            return tuple(views), ""
        reason = reason or result.reason
    return None, reason


def same_tile(shape: tuple | None, gemm: tuple) -> bool:
    """The codegen's ``same_tile``: is ``shape`` the GEMM output ``gemm`` element for element
    ([B*S, N] and [B, S, N]; [B*H, S, S] and [B, H, S, S])?"""
    _, rp = _codegen()
    return gemm is not None and rp.same_tile(shape, gemm)


def _cast_for_consumer(graph: OpGraph, node: OpNode) -> bool:
    """A widening ``astype`` read only by ops whose kernels take the narrow input and widen it
    themselves (``evt_cost.WIDENING_CONSUMERS``), or read by a reduction that stays out of
    epilogues (a batch norm's statistics and its gradient's sums, whose kernels read it anyway),
    or whose narrow input a kernel of its own reads (a ``call_tir``: `column_moments`): fused
    into the epilogue it would only double the bytes the GEMM stores and the consumers read."""
    if node.op != "relax.astype" or not node.users or len(node.inputs) != 1:
        return False
    src = graph.nodes[node.inputs[0]].dtype
    if src is None or node.dtype is None or evt_cost.dtype_bytes(node.dtype) <= evt_cost.dtype_bytes(src):
        return False
    users = [graph.nodes[u].op for u in node.users]
    narrow_readers = [graph.nodes[u].op for u in graph.nodes[node.inputs[0]].users]
    return (all(op in evt_cost.WIDENING_CONSUMERS for op in users)
            or (not evt_cost.FUSE_REDUCTIONS and any(op in evt_cost.TVM_REDUCTION_OPS for op in users))
            or "relax.call_tir" in narrow_readers)


def _feeds_only_reductions(graph: OpGraph, elementwise: set, fusable: set) -> set[int]:
    """The elementwise ops whose values only reductions that stay out of epilogues read, directly
    or through other such ops (batch norm's ``x*x`` before ``mean``, the widening ``astype``
    before ``sum``).  Fused into an epilogue, such an op's value would be stored only for the
    reduction kernel to read back; left out, FuseOps computes it inside that reduction kernel
    from the GEMM's own output."""
    found: set[int] = set()
    for node in reversed(graph.nodes):
        if node.op not in elementwise or node.is_output or not node.users:
            continue
        if all(u in found or (graph.nodes[u].op in evt_cost.TVM_REDUCTION_OPS
                              and graph.nodes[u].op not in fusable) for u in node.users):
            found.add(node.index)
    return found


def build_problem(graph: OpGraph, check: _Legality | None = None) -> Problem:
    """Seeds, cores and legal epilogue candidates of every matmul in the block."""
    check = check or _Legality(graph)
    _, rp = _codegen()
    elementwise = (set(rp.BINARY_OPS) | set(rp.UNARY_OPS) | {"relax.where", "relax.astype"}
                   | set(rp.SUPPORTED_EXTERNS))
    reductions = set(rp.REDUCE_OPS)
    reduction_fed = _feeds_only_reductions(graph, elementwise, reductions if evt_cost.FUSE_REDUCTIONS else set())
    epilogue_dtypes = rp.EPILOGUE_DTYPES
    clusters, refused, cores = [], {}, {}
    for seed in (n.index for n in graph.nodes if n.op == "relax.matmul"):
        node = graph.nodes[seed]
        if not node.users and not node.is_output:
            continue  # dead code: dead-code elimination's business
        core, reason = _choose_core(graph, check, seed)
        if core is None:
            refused[seed] = reason
        else:
            cores[seed] = core
    operand_views = {v for core in cores.values() for v in core}  # folded into some main loop
    for seed, core in cores.items():
        node = graph.nodes[seed]
        core_reads = set()
        for i in list(core) + [seed]:
            for key, _ in _node_inputs(graph, graph.nodes[i]):
                core_reads.add(key)
        cands, deps = [], {}
        shape = node.shape
        members_base = list(core) + [seed]
        downstream = {seed}
        horizon = max(node.users, default=seed)  # past it, no op reads the seed or a candidate
        v = seed
        while v < horizon and len(cands) < MAX_CANDIDATES:
            v += 1
            cand = graph.nodes[v]
            dep = tuple(j for j in cand.inputs if j in downstream)
            if not dep:
                continue
            downstream.add(v)
            if any(j != seed and j not in deps for j in dep):
                continue  # an input on the seed's side cannot join: neither can this op
            if any(graph.nodes[j].op in reductions for j in dep if j != seed):
                continue  # reductions are terminal
            if _cast_for_consumer(graph, cand):
                continue  # its consumer's kernel reads the narrow value and widens it itself
            if cand.copy:
                continue  # recomputed in the backward to be kept out of the forward: a kernel of its own
            if v in reduction_fed:
                continue  # the reduction's kernel computes it from what the epilogue stores anyway
            if cand.op in elementwise:
                ok_shape = same_tile(cand.shape, shape) and cand.dtype in epilogue_dtypes
            elif cand.op == "relax.reshape":  # [M, N] <-> [B, S, N]: the same tile, a free view
                ok_shape = same_tile(cand.shape, shape) and v not in operand_views
            elif cand.op in reductions:
                ok_shape = evt_cost.FUSE_REDUCTIONS and same_tile(graph.nodes[dep[0]].shape, shape)
            else:
                ok_shape = False
            if not ok_shape:
                continue
            closure = _closure(v, {**deps, v: dep})
            result = check(members_base + sorted(closure), {seed} | closure)
            if result.ok:
                cands.append(v)
                deps[v] = dep
                horizon = max(horizon, max(cand.users, default=v))
        clusters.append(Cluster(seed, tuple(core), cands, deps, frozenset(core_reads), shape))
    return Problem(graph, clusters, refused)


def _swap_last(ndim: int) -> list[int]:
    return list(range(ndim - 2)) + [ndim - 1, ndim - 2]


def _transposed_core_legal(call: relax.Call, flips: tuple[bool, bool], check: _Legality):
    """Would ``matmul`` be legal with the flipped operands stored transposed (a view inside)?"""
    bb = relax.BlockBuilder()
    params, args = [], []
    for k, (arg, flip) in enumerate(zip(call.args, flips)):
        shape = list(static_shape(arg) or ())
        if flip and len(shape) < 2:
            return False
        stored = shape[:-2] + shape[-2:][::-1] if flip else shape
        params.append(relax.Var(f"in{k}", relax.TensorType(stored, dtype_of(arg))))
    with bb.function("evt_check", params, attrs={"Composite": COMPOSITE_NAME}):
        with bb.dataflow():
            for p, flip in zip(params, flips):
                args.append(bb.emit(relax.op.permute_dims(p, _swap_last(len(p.ty.shape.values)))) if flip else p)
            out = bb.emit_output(relax.Call(call.op, args, call.attrs, call.ty_args))
        bb.emit_func_output(out)
    return check.function(bb.get()["evt_check"])


def _find_transposes(graph: OpGraph, refused: dict, check: _Legality):
    """({matmul: (flip A, flip B)} for the refused matmuls a transposed operand copy makes legal,
    {matmul var: why the copies do not help either})."""
    rewrites, reasons = {}, {}
    for seed in sorted(refused):
        call = graph.nodes[seed].value
        for flips in ((False, True), (True, False), (True, True)):
            result = _transposed_core_legal(call, flips, check)
            if result:
                rewrites[seed] = flips
                break
            reasons.setdefault(graph.nodes[seed].var, set()).add(result.reason)
    return rewrites, {v: r for v, r in reasons.items() if graph.index_of[v] not in rewrites}


def _apply_transposes(graph: OpGraph, rewrites: dict) -> relax.DataflowBlock:
    """The block where each matmul in ``rewrites`` reads ``permute_dims(copy)`` of its flipped
    operands (TVM materialises ``copy``; the view folds into the main loop)."""
    bindings = []
    for node, binding in zip(graph.nodes, graph.block.bindings):
        if node.index not in rewrites:
            bindings.append(binding)
            continue
        args = []
        for k, (arg, flip) in enumerate(zip(node.value.args, rewrites[node.index])):
            if not flip:
                args.append(arg)
                continue
            axes = _swap_last(len(static_shape(arg)))
            copy = relax.op.permute_dims(arg, axes)
            copied = relax.BlockBuilder().normalize(copy)
            copy_var = relax.DataflowVar(f"{node.var.name}_t{k}", copied.ty)
            bindings.append(relax.VarBinding(copy_var, copied))
            view = relax.BlockBuilder().normalize(relax.op.permute_dims(copy_var, axes))
            view_var = relax.DataflowVar(f"{node.var.name}_v{k}", view.ty)
            bindings.append(relax.VarBinding(view_var, view))
            args.append(view_var)
        value = relax.Call(node.value.op, args, node.value.attrs, node.value.ty_args)
        bindings.append(relax.VarBinding(node.var, relax.BlockBuilder().normalize(value)))
    return relax.DataflowBlock(bindings)


def _closure(v: int, deps: dict) -> set[int]:
    out, stack = {v}, [v]
    while stack:
        for j in deps.get(stack.pop(), ()):
            if j in deps and j not in out:
                out.add(j)
                stack.append(j)
    return out


# ============================================================================ objective (direct)
def cluster_gain(problem: Problem, c: int, members: set[int]) -> float:
    """Bytes removed minus epilogue costs for cluster ``c`` with epilogue ``members`` (direct
    evaluation of the byte model; the ILP's linearisation must agree with it)."""
    graph, cl = problem.graph, problem.clusters[c]
    owned = set(members) | {cl.seed}
    everything = owned | set(cl.views)
    unfused = sum(graph.nodes[i].traffic for i in everything)
    reads = {}
    for i in everything:
        for key, nbytes in _node_inputs(graph, graph.nodes[i]):
            if not (key.startswith("n") and int(key[1:]) in everything):
                reads[key] = nbytes
    stores = [i for i in sorted(owned)
              if graph.nodes[i].is_output or any(u not in owned for u in graph.nodes[i].users)]
    fused = sum(reads.values()) + sum(graph.nodes[i].nbytes for i in stores)
    mn = _elems(cl.shape)
    cost = sum(evt_cost.node_cost(mn, graph.nodes[i].op) for i in members)
    cost += sum(evt_cost.aux_store_cost(_elems(graph.nodes[i].shape)) for i in stores)
    cost -= evt_cost.aux_store_cost(mn)  # one store is the GEMM's output D, not an aux store
    return unfused - fused - cost


def assignment_feasible(problem: Problem, assign: dict[int, int]) -> str | None:
    """None when ``assign`` {op: cluster} is a valid partitioning, else the reason."""
    graph = problem.graph
    members = defaultdict(set)
    for v, c in assign.items():
        if v not in problem.clusters[c].seed_deps:
            return f"op {v} is no candidate of cluster {c}"
        members[c].add(v)
    for c, ms in members.items():
        cl = problem.clusters[c]
        for v in ms:
            if any(j != cl.seed and j not in ms for j in cl.seed_deps[v]):
                return f"op {v} in cluster {c} without its input on the seed's side"
    for c, cl in enumerate(problem.clusters):
        owned = members[c] | {cl.seed}
        stores = [i for i in owned if graph.nodes[i].is_output or any(u not in owned for u in graph.nodes[i].users)]
        if not any(same_tile(graph.nodes[i].shape, cl.shape) for i in stores):
            return f"cluster {c} stores no M x N tensor"
    if find_cycle(problem, assign) is not None:
        return "the cluster graph has a cycle"
    return None


def _unit_of(problem: Problem, assign: dict[int, int]) -> list:
    """The kernel (cluster id or ('op', index)) each binding belongs to."""
    unit = [("op", i) for i in range(len(problem.graph.nodes))]
    for c, cl in enumerate(problem.clusters):
        unit[cl.seed] = c
    for v, c in assign.items():
        unit[v] = c
    return unit


def _unit_edges(problem: Problem, assign: dict[int, int]):
    graph = problem.graph
    unit = _unit_of(problem, assign)
    edges = defaultdict(dict)  # unit -> {succ unit: (from node, to node)}
    for node in graph.nodes:
        for j in node.inputs:
            a, b = unit[j], unit[node.index]
            if a != b and b not in edges[a]:
                edges[a][b] = (j, node.index)
    # a folded view is read by its cluster: the view's inputs feed the cluster
    for c, cl in enumerate(problem.clusters):
        for v in cl.views:
            for j in graph.nodes[v].inputs:
                a = unit[j]
                if a != c and c not in edges[a]:
                    edges[a][c] = (j, cl.seed)
    return unit, edges


def find_cycle(problem: Problem, assign: dict[int, int]):
    """A cycle of the cluster graph as [(unit, entering node, leaving node)], or None."""
    unit, edges = _unit_edges(problem, assign)
    color, parent = {}, {}
    order = sorted(set(unit), key=lambda u: (isinstance(u, tuple), u if isinstance(u, int) else u[1]))
    for root in order:
        if root in color:
            continue
        stack = [(root, iter(sorted(edges[root], key=str)))]
        color[root] = 1
        while stack:
            u, it = stack[-1]
            nxt = next(it, None)
            if nxt is None:
                color[u] = 2
                stack.pop()
                continue
            if color.get(nxt) == 1:  # back edge u -> nxt closes a cycle
                cyc = [u]
                while cyc[-1] != nxt:
                    cyc.append(parent[cyc[-1]])
                cyc = cyc[::-1]  # nxt ... u
                path = []
                for k, w in enumerate(cyc):
                    prev = cyc[k - 1]
                    enter = edges[prev][w][1]
                    leave = edges[w][cyc[(k + 1) % len(cyc)]][0]
                    path.append((w, enter, leave))
                return path
            if nxt not in color:
                color[nxt] = 1
                parent[nxt] = u
                stack.append((nxt, iter(sorted(edges[nxt], key=str))))
    return None


# ========================================================================================= ILP
@dataclass
class _Model:
    """A component's ILP as plain data (canonically numbered: hashable, cacheable)."""

    clusters: list[int]
    xvars: list[tuple[int, int]]  # (op, cluster) per x variable
    data: dict

    def key(self) -> str:
        blob = json.dumps(self.data, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()


def _component_model(problem: Problem, comp: list[int], cuts: list) -> _Model:
    """Variables: x (membership), s (store), r (read).  Rows: (coefs {var: a}, sense, rhs)."""
    graph = problem.graph
    xvars, names, obj, rows = [], {}, [], []

    def var(name, coef):
        if name not in names:
            names[name] = len(obj)
            obj.append(0.0)
        obj[names[name]] += coef
        return names[name]

    for c in comp:
        cl = problem.clusters[c]
        mn = _elems(cl.shape)
        for v in cl.candidates:
            var(("x", v, c), graph.nodes[v].traffic - evt_cost.node_cost(mn, graph.nodes[v].op))
        # the constant part: the core's traffic, minus its reads, plus the D add-back
        const = sum(graph.nodes[i].traffic for i in list(cl.views) + [cl.seed])
        reads = {}
        for i in list(cl.views) + [cl.seed]:
            for key, nbytes in _node_inputs(graph, graph.nodes[i]):
                if not (key.startswith("n") and int(key[1:]) in set(cl.views)):
                    reads[key] = nbytes
        const -= sum(reads.values())
        const += evt_cost.aux_store_cost(mn)
        var(("const", c), const)
        rows.append(({names[("const", c)]: 1}, "==", 1))
        # closure: an op joins only with its inputs on the seed's side
        for v in cl.candidates:
            for j in cl.seed_deps[v]:
                if j != cl.seed:
                    rows.append(({names[("x", v, c)]: 1, names[("x", j, c)]: -1}, "<=", 0))
        # stores: s >= x(v) - x(w) for a candidate user w, s >= x(v) for any other user
        mn_stores = []
        cset = set(cl.candidates)
        for v in [cl.seed] + cl.candidates:
            node = graph.nodes[v]
            si = var(("s", v, c), -(node.nbytes + evt_cost.aux_store_cost(_elems(node.shape))))
            if same_tile(node.shape, cl.shape):
                mn_stores.append(si)
            xv = {} if v == cl.seed else {names[("x", v, c)]: -1}
            const_rhs = 1 if v == cl.seed else 0
            if node.is_output or any(u not in cset for u in node.users):
                rows.append(({si: 1, **xv}, ">=", const_rhs))
            for u in node.users:
                if u in cset:
                    rows.append(({si: 1, **xv, names[("x", u, c)]: 1}, ">=", const_rhs))
        rows.append(({si: 1 for si in mn_stores}, ">=", 1))
        # reads of tensors from outside the cluster by the epilogue
        readers = defaultdict(list)
        for v in cl.candidates:
            for key, nbytes in _node_inputs(graph, graph.nodes[v]):
                if key in cl.core_reads:
                    continue
                if key.startswith("n") and (int(key[1:]) in cset or int(key[1:]) == cl.seed):
                    continue
                readers[(key, nbytes)].append(v)
        for (key, nbytes), vs in readers.items():
            ri = var(("r", key, c), -nbytes)
            for v in vs:
                rows.append(({ri: 1, names[("x", v, c)]: -1}, ">=", 0))
        # each op joins at most one cluster
    shared = defaultdict(list)
    for c in comp:
        for v in problem.clusters[c].candidates:
            shared[v].append(names[("x", v, c)])
    for v, xs in sorted(shared.items()):
        if len(xs) > 1:
            rows.append(({x: 1 for x in xs}, "<=", 1))
    for cut in cuts:
        xs = [names[("x", v, c)] for v, c in cut]
        rows.append(({x: 1 for x in xs}, "<=", len(xs) - 1))
    kinds = [k[0] for k in names]
    data = {
        "obj": [round(o, 6) for o in obj],
        "kinds": kinds,
        "rows": [[sorted(r.items()), s, b] for r, s, b in rows],
    }
    xvars = [(v, c) for (k, *rest) in names if k == "x" for v, c in [tuple(rest)]]
    model = _Model(list(comp), xvars, data)
    model.index = {name: i for name, i in names.items()}  # type: ignore[attr-defined]
    return model


def _solve_model(model: _Model, time_limit: float, solver: str):
    """0/1 values of the x variables, or None when no optimal solution came in time."""
    import mip

    m = mip.Model(sense=mip.MAXIMIZE, solver_name=solver)
    m.verbose = 0
    m.threads = 1
    m.seed = 0
    kinds = model.data["kinds"]
    vs = [m.add_var(var_type=mip.BINARY if k == "x" else mip.CONTINUOUS, lb=0.0, ub=1.0)
          for k in kinds]
    m.objective = mip.maximize(mip.xsum(o * v for o, v in zip(model.data["obj"], vs)))
    for coefs, sense, rhs in model.data["rows"]:
        expr = mip.xsum(a * vs[i] for i, a in coefs)
        if sense == "<=":
            m += expr <= rhs
        elif sense == ">=":
            m += expr >= rhs
        else:
            m += expr == rhs
    status = m.optimize(max_seconds=max(time_limit, 0.1))
    if status != mip.OptimizationStatus.OPTIMAL:
        return None
    return [int(round(vs[i].x)) for i, k in enumerate(kinds) if k == "x"]


# ====================================================================================== caching
def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "tvm_evt" / f"partition-v{CACHE_VERSION}"


def _cache_read(key: str):
    path = cache_dir() / f"{key}.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _cache_write(key: str, value) -> None:
    directory = cache_dir()
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=directory, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(value, f)
        os.replace(tmp, directory / f"{key}.json")  # atomic
    except OSError:
        pass  # a read-only cache is not an error


# ====================================================================================== solving
@dataclass
class Solution:
    assign: dict  # op -> cluster
    objective: float
    seconds: float
    method: str  # "ilp", "cache", "greedy", "mixed"
    ilp_calls: int = 0


def _components(problem: Problem) -> list[list[int]]:
    parent = list(range(len(problem.clusters)))

    def find(a):
        while parent[a] != a:
            parent[a] = parent[parent[a]]
            a = parent[a]
        return a

    owner = {}
    for c, cl in enumerate(problem.clusters):
        for v in cl.candidates:
            if v in owner:
                parent[find(c)] = find(owner[v])
            else:
                owner[v] = c
    comps = defaultdict(list)
    for c in range(len(problem.clusters)):
        comps[find(c)].append(c)
    return sorted(comps.values())


def greedy(problem: Problem, comp: list[int], cuts: list) -> dict:
    """A valid assignment by adding, cluster by cluster, each candidate whose closure is in and
    whose addition raises the gain; cuts are respected, cycles broken by emptying a cluster."""
    assign = {}
    for c in comp:
        cl = problem.clusters[c]
        members: set[int] = set()
        for v in cl.candidates:
            if v in assign or any(j != cl.seed and j not in members for j in cl.seed_deps[v]):
                continue
            trial = members | {v}
            if cluster_gain(problem, c, trial) >= cluster_gain(problem, c, members):
                trial_assign = {**assign, **{u: c for u in trial}}
                if any(all(trial_assign.get(u) == k for u, k in cut) for cut in cuts):
                    continue
                if assignment_feasible(problem, {u: k for u, k in trial_assign.items()}) is None:
                    members = trial
        for v in members:
            assign[v] = c
    return assign


def solve(problem: Problem, time_limit: float = DEFAULT_TIME_LIMIT, solver: str = ILP_SOLVER,
          use_cache: bool = True) -> Solution:
    """Optimal assignment of epilogue ops to clusters (see the module docstring)."""
    start = time.perf_counter()
    comps = _components(problem)
    cuts: dict = defaultdict(list)  # component (tuple) -> cuts
    solved: dict = {}
    methods = set()
    memo: dict = {}
    calls = 0
    while True:
        assign = {}
        for comp in comps:
            key_comp = tuple(comp)
            if key_comp not in solved:
                model = _component_model(problem, comp, cuts[key_comp])
                if not model.xvars:
                    solved[key_comp] = {}
                    continue
                key = model.key()
                values = memo.get(key)
                if values is None and use_cache:
                    cached = _cache_read(key)
                    values = cached["x"] if cached else None
                    if values is not None:
                        methods.add("cache")
                if values is None:
                    left = time_limit - (time.perf_counter() - start)
                    values = _solve_model(model, left, solver) if left > 0 else None
                    calls += 1
                    if values is not None:
                        methods.add("ilp")
                        if use_cache:
                            _cache_write(key, {"x": values})
                if values is None:
                    methods.add("greedy")
                    part = greedy(problem, comp, cuts[key_comp])
                else:
                    memo[key] = values
                    part = {v: c for (v, c), on in zip(model.xvars, values) if on}
                solved[key_comp] = part
            assign.update(solved[key_comp])
        cycle = find_cycle(problem, assign)
        if cycle is None:
            break
        cut = sorted({(n, u) for u, enter, leave in cycle if isinstance(u, int)
                      for n in (enter, leave) if n != problem.clusters[u].seed and n in assign})
        involved = {u for u, _, _ in cycle if isinstance(u, int)}
        merged = sorted(c for comp in comps if involved & set(comp) for c in comp)
        old = [tuple(comp) for comp in comps if involved & set(comp)]
        new_cuts = [k for o in old for k in cuts[o]] + [cut]
        for o in old:
            solved.pop(o, None)
        comps = sorted([comp for comp in comps if not (involved & set(comp))] + [merged])
        cuts[tuple(merged)] = new_cuts
        if not cut or time.perf_counter() - start > time_limit:
            for comp in comps:  # give up on optimality: greedy everywhere is valid
                solved[tuple(comp)] = {}
            assign = greedy(problem, sorted(c for comp in comps for c in comp), [])
            methods.add("greedy")
            break
    objective = sum(cluster_gain(problem, c, {v for v, k in assign.items() if k == c})
                    for c in range(len(problem.clusters)))
    method = methods.pop() if len(methods) == 1 else ("mixed" if methods else "ilp")
    return Solution(assign, objective, time.perf_counter() - start, method, calls)


# ===================================================================================== rewrite
@dataclass
class PartitionInfo:
    symbol: str
    ops: list[str]
    bytes_saved: int
    gain: float
    seed: str


def _bytes_saved(problem: Problem, c: int, members: set[int]) -> int:
    graph, cl = problem.graph, problem.clusters[c]
    mn = _elems(cl.shape)
    costs = sum(evt_cost.node_cost(mn, graph.nodes[i].op) for i in members)
    owned = members | {cl.seed}
    stores = [i for i in owned if graph.nodes[i].is_output or any(u not in owned for u in graph.nodes[i].users)]
    costs += sum(evt_cost.aux_store_cost(_elems(graph.nodes[i].shape)) for i in stores) - evt_cost.aux_store_cost(mn)
    return int(round(cluster_gain(problem, c, members) + costs))


def _legalize_solution(problem: Problem, assign: dict, check: _Legality) -> dict:
    """Drop ops from the end of any illegal partition until it is legal."""
    graph = problem.graph
    assign = dict(assign)
    by_cluster = defaultdict(list)
    for v, c in sorted(assign.items()):
        by_cluster[c].append(v)
    for c, cl in enumerate(problem.clusters):
        members = by_cluster[c]
        while members:
            result = check(list(cl.views) + [cl.seed] + members, {cl.seed, *members})
            if result.ok:
                break
            # drop the last op no other member depends on
            last = max(v for v in members if not any(u in members for u in graph.nodes[v].users))
            members.remove(last)
            del assign[last]
    return assign


def _rewrite_block(bb: relax.BlockBuilder, problem: Problem, assign: dict, prefix: str,
                   infos: list[PartitionInfo], check: _Legality) -> relax.DataflowBlock:
    graph = problem.graph
    members = defaultdict(set)
    for v, c in assign.items():
        members[c].add(v)
    unit, edges = _unit_edges(problem, assign)
    # kernels in a topological order of the cluster graph, earliest binding first
    first = {}
    for i, u in enumerate(unit):
        first.setdefault(u, i)
    indeg = defaultdict(int)
    for a in edges:
        for b in edges[a]:
            indeg[b] += 1
    units = list(first)
    heap = [(first[u], k) for k, u in enumerate(units) if indeg[u] == 0]
    pos = {u: k for k, u in enumerate(units)}
    heapq.heapify(heap)
    order = []
    while heap:
        _, k = heapq.heappop(heap)
        u = units[k]
        order.append(u)
        for b in edges[u]:
            indeg[b] -= 1
            if indeg[b] == 0:
                heapq.heappush(heap, (first[b], pos[b]))
    assert len(order) == len(units), "cluster graph has a cycle"
    # folded views needed outside their clusters
    folded = defaultdict(set)
    for c, cl in enumerate(problem.clusters):
        for v in cl.views:
            folded[v].add(c)
    needed = {}
    for i in reversed(range(len(graph.nodes))):
        node = graph.nodes[i]
        if i in folded and unit[i] == ("op", i):
            needed[i] = node.is_output or any(
                (unit[u] == ("op", u) and needed.get(u, True)) or (isinstance(unit[u], int) and unit[u] not in folded[i])
                for u in node.users)
    bindings = []
    for u in order:
        if isinstance(u, tuple):
            i = u[1]
            if needed.get(i, True):
                bindings.append(graph.block.bindings[i])
            continue
        cl = problem.clusters[u]
        owned = members[u] | {cl.seed}
        mlist = sorted(owned | set(cl.views))
        func, params, outputs = check.build(mlist, owned)
        symbol = f"{prefix}_{len(infos)}"
        gv = bb.add_func(func.with_attr("global_symbol", symbol), symbol)
        call = bb.normalize(relax.Call(gv, params))
        if len(outputs) == 1:
            bindings.append(relax.VarBinding(graph.nodes[outputs[0]].var, call))
        else:
            tvar = relax.DataflowVar(f"{symbol}_out", call.ty)
            bindings.append(relax.VarBinding(tvar, call))
            for k, i in enumerate(outputs):
                bindings.append(relax.VarBinding(graph.nodes[i].var, bb.normalize(relax.TupleGetItem(tvar, k))))
        infos.append(PartitionInfo(
            symbol=symbol,
            ops=[graph.nodes[i].op for i in mlist],
            bytes_saved=_bytes_saved(problem, u, members[u]),
            gain=cluster_gain(problem, u, members[u]),
            seed=graph.nodes[cl.seed].var.name,
        ))
    return relax.DataflowBlock(bindings)


@dataclass
class FunctionReport:
    partitions: list[PartitionInfo]
    unfused_matmuls: list[dict]
    solve_seconds: float
    legality_calls: int
    method: str
    objective: float


def partition_function(bb: relax.BlockBuilder, name: str, func: relax.Function,
                       time_limit: float = DEFAULT_TIME_LIMIT, use_cache: bool = True,
                       transpose_operands: bool = True, absorbed: frozenset = frozenset()):
    """(new function, FunctionReport); `absorbed`: vars later kernels compute in passing."""
    if not isinstance(func.body, relax.SeqExpr):
        return func, FunctionReport([], [], 0.0, 0, "none", 0.0)
    blocks, infos, unfused = [], [], []
    seconds, calls, methods, objective = 0.0, 0, set(), 0.0
    for k, block in enumerate(func.body.blocks):
        if not isinstance(block, relax.DataflowBlock):
            blocks.append(block)
            continue
        start = time.perf_counter()
        graph = OpGraph(block, absorbed)
        check = _Legality(graph)
        graph_key = "g" + hashlib.sha256(
            f"{graph.canonical_hash()}|{_capability_key()}|{evt_cost.COST_MODEL_VERSION}|{MAX_CANDIDATES}"
            f"|{transpose_operands}".encode()
        ).hexdigest()
        cached = _cache_read(graph_key) if use_cache else None
        problem = solution = None
        if cached is not None:
            rewrites = {int(k): tuple(v) for k, v in cached["transposes"]}
            if rewrites:
                graph = OpGraph(_apply_transposes(graph, rewrites), absorbed)
                check.graph = graph
            problem = _problem_from_cache(graph, cached)
            assign = {int(v): c for v, c in cached["assign"]}
            if assignment_feasible(problem, assign) is None:
                solution = Solution(assign, 0.0, 0.0, "cache")
        if solution is None:
            problem = build_problem(graph, check)
            rewrites, also = {}, {}
            if problem.refused and transpose_operands:
                rewrites, also = _find_transposes(graph, problem.refused, check)
            if rewrites:  # the cache key stays the one of the original block
                graph = OpGraph(_apply_transposes(graph, rewrites), absorbed)
                check.graph = graph
                problem = build_problem(graph, check)
            for i in problem.refused:
                more = sorted(also.get(graph.nodes[i].var, ()))
                if more:
                    problem.refused[i] += "; with transposed operand copies: " + "; ".join(more)
            solution = solve(problem, time_limit - seconds, use_cache=use_cache)
        assign = _legalize_solution(problem, solution.assign, check)
        reason = assignment_feasible(problem, assign)
        if reason is not None:  # cannot happen for a checked solution; stay safe: no epilogues
            assign = {}
        if use_cache and cached is None:
            _cache_write(graph_key, dict(_problem_to_cache(problem, assign),
                                         transposes=[[k, list(v)] for k, v in sorted(rewrites.items())]))
        seconds += time.perf_counter() - start
        calls += check.calls
        methods.add(solution.method)
        objective += sum(cluster_gain(problem, c, {v for v, k in assign.items() if k == c})
                         for c in range(len(problem.clusters)))
        for i, reason in sorted(problem.refused.items()):
            unfused.append({"var": graph.nodes[i].var.name, "shape": list(graph.nodes[i].shape or ()),
                            "dtype": graph.nodes[i].dtype, "reason": reason})
        blocks.append(_rewrite_block(bb, problem, assign, f"{name}_evt{k}", infos, check))
    body = relax.SeqExpr(blocks, func.body.body)
    new = relax.Function(func.params, body, func.ret_ty, func.is_pure, func.attrs)
    method = methods.pop() if len(methods) == 1 else ("mixed" if methods else "none")
    return new, FunctionReport(infos, unfused, seconds, calls, method, objective)


def _problem_to_cache(problem: Problem, assign: dict) -> dict:
    return {
        "clusters": [
            {"seed": cl.seed, "views": list(cl.views), "candidates": cl.candidates,
             "deps": [[v, list(d)] for v, d in cl.seed_deps.items()], "reads": sorted(cl.core_reads)}
            for cl in problem.clusters
        ],
        "refused": [[i, r] for i, r in sorted(problem.refused.items())],
        "assign": sorted([v, c] for v, c in assign.items()),
    }


def _problem_from_cache(graph: OpGraph, data: dict) -> Problem:
    clusters = [
        Cluster(d["seed"], tuple(d["views"]), list(d["candidates"]), {v: tuple(x) for v, x in d["deps"]},
                frozenset(d["reads"]), graph.nodes[d["seed"]].shape)
        for d in data["clusters"]
    ]
    return Problem(graph, clusters, {i: r for i, r in data["refused"]})


# ========================================================================================= pass
@tvm.transform.module_pass(opt_level=0, name="PartitionEVT")
class PartitionEVT:
    """Partition every Relax function into EVT kernels (see the module docstring).

    The report (``partition_report(mod)``) is kept in the module attribute ``evt_partition_report``
    as JSON."""

    def __init__(self, time_limit: float = DEFAULT_TIME_LIMIT, use_cache: bool = True,
                 functions: tuple[str, ...] | None = None, transpose_operands: bool = True,
                 row_kernels: bool = False, row_kernel_epilogue: bool = False):
        self.transpose_operands = transpose_operands
        # FuseLayerNormBackward runs after the partitioner (CUDA route): the ops its row kernels
        # compute in passing (a layer norm gradient's dy * gamma and means; with the epilogue, the
        # elementwise ops after it) cost no kernel of their own, so an epilogue that took them
        # would only add a store (BERT-Large: dy * gamma, 67 MB of float32, beside dy)
        self.row_kernels, self.row_kernel_epilogue = row_kernels, row_kernel_epilogue
        self.time_limit = time_limit
        self.use_cache = use_cache
        self.functions = functions

    def _absorbed(self, func: relax.Function) -> frozenset:
        if not self.row_kernels:
            return frozenset()
        from ..lower.fuse_layer_norm_backward import find_chains

        chains = find_chains(func, self.row_kernel_epilogue).values()
        return frozenset().union(*(c.absorbed for c in chains))

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        bb = relax.BlockBuilder(mod)
        reports = {}
        for gv, func in mod.functions_items():
            if not isinstance(func, relax.Function) or (func.attrs and "Codegen" in func.attrs):
                continue
            if self.functions is not None and gv.name_hint not in self.functions:
                continue
            new, report = partition_function(bb, gv.name_hint, func, self.time_limit, self.use_cache,
                                             self.transpose_operands, self._absorbed(func))
            bb.update_func(gv, new)
            reports[gv.name_hint] = report
        out = relax.transform.Normalize()(bb.get())  # types of the rebuilt bodies
        data = {name: _report_dict(r) for name, r in reports.items()}
        return out.with_attr(REPORT_ATTR, json.dumps(data))


def _report_dict(r: FunctionReport) -> dict:
    return {
        "partitions": [
            {"symbol": p.symbol, "ops": p.ops, "bytes_saved": p.bytes_saved, "gain": p.gain, "matmul": p.seed}
            for p in r.partitions
        ],
        "unfused_matmuls": r.unfused_matmuls,
        "solve_seconds": r.solve_seconds,
        "legality_calls": r.legality_calls,
        "method": r.method,
        "objective": r.objective,
    }


def partition_report(mod: tvm.IRModule) -> dict:
    """{function name: report dict} written by ``PartitionEVT`` ({} when it did not run)."""
    attrs = mod.attrs
    if attrs is None or REPORT_ATTR not in attrs:
        return {}
    return json.loads(str(attrs[REPORT_ATTR]))

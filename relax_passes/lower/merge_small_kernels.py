"""MergeSmallKernels: the small elementwise kernels of a dataflow block (per-channel statistics,
step counters) merged into one kernel per group that can run as one.

After ``FuseOps`` a batch norm leaves about ten kernels of C elements a step: the mean and variance
from its column sums, the square root, the running mean and variance, the reciprocal its gradient
reads, that gradient's scaled column sum, and the (C,) views of dgamma and dbeta the step returns.
FuseOps keeps each apart because its result has readers in several kernels (the normalisation, the
gradient pass, the running statistics), and TVM's ``RewriteDataflowReshape`` leaves a reshape that a
block returns as a copy.  Each such kernel moves a few kilobytes and costs a launch and the gap
around it: 630 of the 1039 kernels of a MobileNetV2 replica's step (52 batch norms; on H200 at
batch 128, torchvision's MobileNetV2 ran 788 kernels under 4 us a step, 1.09 ms, where
torch.compile ran 419).  Merged, the replica's step runs 581 (``tuning.kernel_traffic``: 932 TVM
kernels -> 474, 107 GEMM partitions), moving the same bytes.

A kernel is *small* when it is a ``call_tir`` of an unscheduled PrimFunc of TVM's legalisation (not
one of ours: opaque to FuseOps or tagged ``tvm_evt.*``) whose blocks are all spatial (elementwise,
broadcast, injective), whose output and operands have at most
``MAX_ELEMENTS`` elements each and static shapes.  A pure reshape bound to a dataflow var is left
alone (it becomes a view).  In binding order, a small kernel joins a group of kernels with as many
output elements

* whose member wrote one of its operands, or
* whose member read an operand it reads (projections of one call count as one operand), or
* when all its operands are the function's parameters or constants, the group of such kernels,

provided the group stays *convex*: no path leaves the group and comes back into it (through a
kernel outside it), which merging would turn into a cycle.  ``_Grouping`` keeps, for each var, the
groups that reach it through a kernel outside them.

Each group of two or more becomes one PrimFunc (TVM's ``FuseTIR`` of the members): the blocks
writing values only the group reads are inlined, the others fused to one loop of the group's
element count each, and those loops merged into one (``Schedule.merge``), tagged ``MERGED_ATTR``;
``ScheduleTIRForGPU`` binds that loop to ``THREADS`` threads a block (``gpu_variant``).  A member
that reads another's result must read, in each iteration, the element that iteration wrote (a
row-major reshape or an elementwise op does; a transpose does not): ``_reads_what_it_wrote``
checks it on the merged loop, and a group that fails any step is left as it was.  Groups of one
shape (a network's repeated blocks) share one merged PrimFunc.  The block is then
reordered (Kahn's algorithm, by first binding) so that the merged call comes after its last operand
and before its first reader.

CUDA route, after ``FuseTIR`` and ``SinkRecomputedValues``, before ``ScheduleTIRForGPU``.
"""

from __future__ import annotations

import heapq

import tvm
import tvm_ffi
from tvm import relax, s_tir, sym, tirx

from .._rewrite import OPAQUE, PARTITION_ATTRS, elements

MAX_ELEMENTS = 1 << 14  # per-channel values of the widest layers (2048 channels) and scalars
THREADS = 128
MERGED_ATTR = "tvm_evt.merged_loop"  # a merged kernel: one serial loop, bound by ``gpu_variant``
_CALL_TIR = tvm.ir.Op.get("relax.call_tir")


def _spatial(func: tirx.PrimFunc) -> bool:
    """Is `func` TVM's legalisation of ops (not one of our kernels: opaque to FuseOps, or with a GPU
    form of its own), unscheduled, without launches, and are all its blocks (but the root) spatial?"""
    # (ScheduleTIRForGPU imports this module for gpu_variant: its checks are imported here, late)
    from .schedule_tir_for_gpu import _scheduled, launches_threads

    attrs = func.attrs or {}
    if _scheduled(func) or launches_threads(func) or int(attrs.get("op_pattern", 0)) == OPAQUE \
            or any(str(k).startswith("tvm_evt.") for k in attrs.keys()):  # (ours carry such a tag)
        return False
    ok = True

    def block(b) -> None:
        nonlocal ok
        ok = ok and all(int(iv.iter_type) == tirx.IterVar.DataPar for iv in b.iter_vars)

    tvm_ffi.structural_walk(func.body, (s_tir.SBlock, block), order="post")
    return ok


def small_kernel(mod: tvm.IRModule, binding, spatial: dict | None = None) -> int | None:
    """The element count of `binding`'s output if it is a small kernel (module docstring), else None;
    `spatial` keeps ``_spatial``'s answer per PrimFunc across calls."""
    if not isinstance(binding, relax.VarBinding):
        return None
    call = binding.value
    if not (isinstance(call, relax.Call) and call.op == _CALL_TIR and len(call.args) == 2
            and isinstance(call.args[0], tvm.ir.GlobalVar) and isinstance(call.args[1], relax.Tuple)):
        return None
    gv = call.args[0]
    n = elements(binding.var)
    if n is None or n > MAX_ELEMENTS or not isinstance(mod[gv], tirx.PrimFunc):
        return None
    spatial = {} if spatial is None else spatial
    if gv not in spatial:
        spatial[gv] = _spatial(mod[gv])
    if not spatial[gv]:
        return None
    for arg in call.args[1].fields:
        if not isinstance(arg, (relax.Var, tvm.ir.expr.Constant)):
            return None
        m = elements(arg)
        if m is None or m > MAX_ELEMENTS:
            return None
    if isinstance(binding.var, relax.DataflowVar) and relax.analysis.has_reshape_pattern(mod[gv]):
        return None  # RewriteDataflowReshape makes it a view
    return n


class _Grouping:
    """Groups of small kernels of one dataflow block (module docstring): ``groups`` lists the
    binding indices of each, in order."""

    def __init__(self, mod: tvm.IRModule, block: relax.DataflowBlock, spatial: dict | None = None):
        self.groups: list[list[int]] = []
        counts: list[int] = []  # each group's element count
        member_of: dict = {}  # var -> group whose member binds it
        reach: dict = {}  # var -> groups with a path to it through a kernel outside them
        readers: dict = {}  # operand key -> groups with a member reading it
        roots: dict = {}  # element count -> group of kernels reading only parameters and constants
        sources = {b.var: (b.value.tuple_value if isinstance(b.value, relax.TupleGetItem) else b.var)
                   for b in block.bindings if isinstance(b, relax.VarBinding)}  # (the vars bound here)
        for i, b in enumerate(block.bindings):
            operands = list(relax.analysis.free_vars(b.value))
            through = frozenset().union(*(reach.get(v, frozenset()) for v in operands))
            n = small_kernel(mod, b, spatial)
            if n is None:
                reach[b.var] = through | {member_of[v] for v in operands if v in member_of}
                continue
            keys = [sources.get(v, v) for v in operands if v not in member_of and v in sources]
            linked = [member_of[v] for v in operands if v in member_of]
            linked += [g for k in keys for g in readers.get(k, ())]
            if not keys and not linked:
                linked = [roots[n]] if n in roots else []
            group = next((g for g in linked if counts[g] == n and g not in through), None)
            if group is None:
                group = len(self.groups)
                self.groups.append([])
                counts.append(n)
                if not keys and not any(v in member_of for v in operands):
                    roots.setdefault(n, group)
            self.groups[group].append(i)
            member_of[b.var] = group
            for k in keys:
                readers.setdefault(k, []).append(group)
            reach[b.var] = through | {member_of[v] for v in operands if v in member_of and member_of[v] != group}
        self.groups = [g for g in self.groups if len(g) > 1]


def _flat(indices, shape) -> tirx.PrimExpr:
    offset = tirx.const(0, "int64")
    for i, s in zip(indices, shape):
        offset = offset * tirx.const(int(s), "int64") + tirx.Cast("int64", i)
    return offset


def _reads_what_it_wrote(loop: tirx.For) -> bool:
    """Does every block under the merged `loop` that reads a buffer an earlier block under it
    writes read the element written in the same iteration (and no block read one a later block
    writes)?"""
    analyzer = sym.Analyzer()
    analyzer.bind(loop.loop_var, tvm.ir.Range.from_min_extent(loop.min, loop.extent))
    written: dict = {}  # buffer -> flat index written, in terms of the loop var
    realizes = []
    tvm_ffi.structural_walk(loop.body, (s_tir.SBlockRealize, realizes.append), order="pre")
    writers = {w.source for r in realizes for w in r.block.writes}

    def at(region):  # the flat index of a one-element region, in terms of the loop var
        if not all(analyzer.can_prove_equal(r.extent, 1) for r in region.region):
            return None
        return analyzer.simplify(_flat([r.min for r in region.region], region.source.shape))

    for realize in realizes:
        block = realize.block
        for iv, value in zip(block.iter_vars, realize.iter_values):
            analyzer.bind(iv.var, value)  # (each block's vars are its own)
        for read in block.reads:
            if read.source not in writers:
                continue
            if read.source not in written:
                return False  # read before (or without) its write in the iteration
            index = at(read)
            if index is None or not analyzer.can_prove_equal(index, written[read.source]):
                return False
        for write in block.writes:
            index = at(write)
            if index is None:
                return False
            written[write.source] = index
    return True


def merge_loops(func: tirx.PrimFunc, outputs: int, n: int) -> tirx.PrimFunc | None:
    """The fused PrimFunc `func` (its last `outputs` parameters written) as one loop of `n`
    iterations over every output block, the intermediates inlined, tagged ``MERGED_ATTR``; None
    where that does not hold or schedule."""
    out_buffers = set(list(func.params)[-outputs:])  # (a PrimFunc's parameters are its buffers)
    try:
        sch = s_tir.Schedule(func)
        root = sch.get_sblock("root")
        for block in sch.get_child_blocks(root):
            if not any(w.source in out_buffers for w in sch.get(block).writes):
                sch.compute_inline(block)
        loops = []
        for block in sch.get_child_blocks(root):
            found = sch.get_loops(block)
            loop = sch.add_unit_loop(block) if not found else sch.fuse(*found) if len(found) > 1 else found[0]
            if int(sch.get(loop).extent) != n:
                return None
            loops.append(loop)
        loop = sch.merge(*loops) if len(loops) > 1 else loops[0]
    except Exception:  # noqa: BLE001 - a group that does not schedule so stays as it was
        return None
    if not _reads_what_it_wrote(sch.get(loop)):
        return None
    return sch.mod["main"].with_attr(MERGED_ATTR, n).with_attr("op_pattern", OPAQUE)


def gpu_variant(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """A merged kernel (``MERGED_ATTR``) with its loop bound to ``THREADS`` threads a block
    (``ScheduleTIRForGPU``)."""
    n = int(func.attrs[MERGED_ATTR])
    sch = s_tir.Schedule(func)
    loop = sch.get_loops(sch.get_child_blocks(sch.get_sblock("root"))[0])[0]  # (every block's one loop)
    bx, tx = sch.split(loop, [None, min(THREADS, n)])
    sch.bind(bx, "blockIdx.x")
    sch.bind(tx, "threadIdx.x")
    return sch.mod["main"].with_attr("tirx.is_scheduled", True)


def _merged_func(mod: tvm.IRModule, members: list, params: list, outputs: list) -> tirx.PrimFunc:
    """The members' call_tirs (bindings) as one PrimFunc reading `params` and writing `outputs`
    (member vars), by TVM's ``FuseTIR``."""
    bb = relax.BlockBuilder()
    funcs = {}
    for b in members:
        gv = b.value.args[0]
        if gv.name_hint not in funcs:
            funcs[gv.name_hint] = bb.add_func(mod[gv], gv.name_hint)
    inner = [relax.Var(f"p{i}", p.ty) for i, p in enumerate(params)]
    vmap = dict(zip(params, inner))
    with bb.function("merged", inner, {"Primitive": True}, private=True):
        with bb.dataflow():
            for b in members:
                args = [vmap.get(a, a) for a in b.value.args[1].fields]
                vmap[b.var] = bb.emit(relax.call_tir(funcs[b.value.args[0].name_hint], args, b.var.ty))
            result = bb.emit_output(relax.Tuple([vmap[v] for v in outputs]))
        bb.emit_func_output(result)
    merged = bb.get().get_global_var("merged")
    outer = [relax.Var(f"a{i}", p.ty) for i, p in enumerate(params)]
    with bb.function("main", outer):
        with bb.dataflow():
            result = bb.emit_output(relax.Call(merged, outer))
        bb.emit_func_output(result)
    fused = relax.transform.FuseTIR()(bb.get())
    call = fused["main"].body.blocks[0].bindings[0].value
    return fused[call.args[0]]


def _topological(bindings: list, replace: dict) -> list:
    """`bindings` with each group's members replaced by its new bindings (`replace`: first member
    index -> (member indices, new bindings)), in an order where every var is bound before it is
    read: Kahn's algorithm, earliest original position first."""
    nodes, member = [], {}
    for first, (indices, _) in replace.items():
        for i in indices:
            member[i] = first
    for i, b in enumerate(bindings):
        if i not in member:
            nodes.append((i, [b]))
        elif member[i] == i:
            nodes.append((i, replace[i][1]))
    binder = {b.var: key for key, group in nodes for b in group}
    needs = {key: {binder[v] for b in group for v in relax.analysis.free_vars(b.value)
                   if v in binder and binder[v] != key} for key, group in nodes}
    waiting = {key: len(deps) for key, deps in needs.items()}
    users: dict = {}
    for key, deps in needs.items():
        for d in deps:
            users.setdefault(d, []).append(key)
    ready = [key for key, count in waiting.items() if count == 0]
    heapq.heapify(ready)
    group_of = dict(nodes)
    order = []
    while ready:
        key = heapq.heappop(ready)
        order.extend(group_of[key])
        for u in users.get(key, ()):
            waiting[u] -= 1
            if waiting[u] == 0:
                heapq.heappush(ready, u)
    if len(order) != sum(len(g) for _, g in nodes):
        raise RuntimeError("MergeSmallKernels: the merged groups left a cycle in a dataflow block")
    return order


def group_signature(readers: dict, bi: int, block: relax.DataflowBlock, indices: list) -> tuple:
    """(members, params, outputs, shape) of the group of `block` (index `bi`) at binding `indices`:
    its bindings; the operands it reads from outside, once each; the member vars read outside it
    (`readers`: ``_readers``) or bound as block outputs; and its shape, the member PrimFuncs with
    what each reads (a member's result, or a param by position) and which members are outputs."""
    members = [block.bindings[i] for i in indices]
    position = {b.var: k for k, b in enumerate(members)}
    params: list = []
    wiring = []
    for b in members:
        wires = []
        for a in b.value.args[1].fields:
            if a in position:
                wires.append(("member", position[a]))
                continue
            at = next((j for j, p in enumerate(params) if a.same_as(p)), None)
            if at is None:
                at = len(params)
                params.append(a)
            wires.append(("param", at))
        wiring.append((b.value.args[0], tuple(wires)))
    inside = {(bi, i) for i in indices}
    outputs = [b.var for b in members if readers.get(b.var, set()) - inside or not isinstance(b.var, relax.DataflowVar)]
    return members, params, outputs, (tuple(wiring), tuple(position[v] for v in outputs))


def _readers(func: relax.Function) -> dict:
    """var -> the places that read it: (block index, binding index), or None for the result."""
    readers: dict = {}
    for v in relax.analysis.free_vars(func.body.body):
        readers.setdefault(v, set()).add(None)
    for bi, block in enumerate(func.body.blocks):
        for i, b in enumerate(block.bindings):
            for v in relax.analysis.free_vars(b.value):
                readers.setdefault(v, set()).add((bi, i))
    return readers


@tvm.transform.module_pass(opt_level=0, name="MergeSmallKernels")
class MergeSmallKernels:
    """Merge the small elementwise kernels of each dataflow block into one kernel per convex group
    (module docstring)."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        updates, builder = {}, relax.BlockBuilder(mod)
        made: dict = {}  # a group's shape (`group_signature`) -> its merged PrimFunc's global var, or None
        spatial: dict = {}  # PrimFunc global var -> `_spatial`
        for gv, func in mod.functions_items():
            if not isinstance(func, relax.Function) or not isinstance(func.body, relax.SeqExpr) or (
                    func.attrs and any(k in func.attrs for k in PARTITION_ATTRS)):
                continue
            blocks, readers = list(func.body.blocks), _readers(func)
            changed = False
            for bi, block in enumerate(blocks):
                if not isinstance(block, relax.DataflowBlock):
                    continue
                replace = {}
                for indices in _Grouping(mod, block, spatial).groups:
                    new = self._merge(mod, readers, bi, block, indices, builder, made)
                    if new is not None:
                        replace[indices[0]] = (indices, new)
                if replace:
                    blocks[bi] = relax.DataflowBlock(_topological(list(block.bindings), replace))
                    changed = True
            if changed:
                updates[gv] = relax.Function(func.params, relax.SeqExpr(blocks, func.body.body), func.ret_ty,
                                             func.is_pure, func.attrs, func.span)
        if not updates:
            return mod
        out = builder.get()
        for gv, func in updates.items():
            out[gv] = func
        return relax.transform.Normalize()(out)

    @staticmethod
    def _merge(mod, readers, bi, block, indices, builder, made) -> list | None:
        """The bindings that replace the group of `block`'s bindings at `indices`, or None.  Groups
        of one shape (``group_signature``: a network's repeated blocks) share one merged PrimFunc,
        made once (`made`)."""
        members, params, outputs, shape = group_signature(readers, bi, block, indices)
        if not outputs:
            return None
        if shape not in made:
            made[shape] = None
            try:
                fused = _merged_func(mod, members, params, outputs)
            except Exception:  # noqa: BLE001 - a group FuseTIR does not take stays as it was
                fused = None
            prim = None if fused is None else merge_loops(fused, len(outputs), elements(members[0].var))
            if prim is not None:
                made[shape] = builder.add_func(prim, f"merged_{members[0].value.args[0].name_hint}")
        gv = made[shape]
        if gv is None:
            return None
        types = [v.ty for v in outputs]
        if len(outputs) == 1:
            return [relax.VarBinding(outputs[0], relax.call_tir(gv, params, types[0]))]
        whole = relax.DataflowVar(f"{outputs[0].name}_merged", relax.TupleType(types))
        return [relax.VarBinding(whole, relax.call_tir(gv, params, types))] + [
            relax.VarBinding(v, relax.TupleGetItem(whole, k)) for k, v in enumerate(outputs)]

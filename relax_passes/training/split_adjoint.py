"""SplitAdjoint: ``main_adjoint`` cut into segments, one per gradient bucket, for data parallel.

Data-parallel training (``tvm_evt.distributed``) averages the gradients across ranks in buckets
and launches each bucket's all-reduce as soon as its gradients exist, so the communication of
the early buckets overlaps the rest of the backward.  A Relax function returns only when all of
it has run, so ``main_adjoint`` is cut here into functions ``adjoint_part0``, ``adjoint_part1``,
... that the runtime calls one after the other, launching a bucket's collective between them.

The cut:

* a gradient is *ready* at the binding that computes it (aliases such as Gradient's
  ``w_adjoint_out = w_adjoint`` followed back to it); parameters are ordered by readiness, the
  backward's order (the last layer's first), and packed into buckets of about ``bucket_bytes``;
* segment i holds the bindings that bucket i's gradients depend on (their transitive closure)
  and no earlier segment holds, in their original order, so every binding still follows the
  ones it reads; a last segment holds what the loss and the new buffers still need.  A bucket
  whose gradients an earlier segment already computed gets no segment of its own;
* a segment's arguments are the ``main_adjoint`` parameters and earlier segments' values it
  reads; its results are the values it defines that a later segment reads or that are results
  of ``main_adjoint`` (loss, new buffers, gradients).  ``SegmentPlan`` names each argument and
  result by a key (``"arg3"``: main_adjoint's parameter 3, ``"b17"``: its binding 17), so the
  runtime passes values from segment to segment by key.

What this costs: the graph passes and fusion run per segment, so a fusion across a cut (an
epilogue that would read values from two segments) is lost, and the values crossing a cut stay
alive as the segment's results (they would have been alive anyway: a later binding reads them).
The forward is entirely in segment 0 (the first gradient needs the loss, so it needs all of it).
That loss is large on transformers: a forward value a later segment reads is a segment result,
so the lowering passes that keep values in dataflow vars (a layer norm's statistics in one
kernel, a cast or a loss's ``x - max`` recomputed in each reader) leave it written and read back.
Modelled on BertForMaskedLM (two BERT-Large layers, 32 x 512, five segments): 40.6 GB a step
against 34.8 GB in one segment (33.2 GB for the single-GPU step); BERT-Large's 2-rank step, cut
into 38 segments, took 121 ms on H200s where one GPU's uncut step takes 89 ms.  ``cut=False``
therefore keeps the adjoint in one segment and only plans the buckets (``tvm_evt.distributed``'s
default).
"""

from __future__ import annotations

import dataclasses
import math

import tvm
from tvm import relax

from .._rewrite import substitute

SEGMENT_NAME = "adjoint_part{}"


@dataclasses.dataclass(frozen=True)
class Segment:
    """One function of the cut adjoint: its name and the keys of its arguments and results."""

    name: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class SegmentPlan:
    """How to run the cut adjoint and where its results are.

    ``buckets``: parameter indices per bucket, in the order the gradients become ready;
    ``ready_after[b]``: the index of the segment after which bucket b's gradients all exist;
    ``loss``, ``new_buffers``, ``grads`` (by parameter index): the keys of main_adjoint's results.
    """

    segments: tuple[Segment, ...]
    buckets: tuple[tuple[int, ...], ...]
    ready_after: tuple[int, ...]
    loss: str
    new_buffers: tuple[str, ...]
    grads: tuple[str, ...]
    num_args: int


def _leaves(expr, bound: dict) -> list:
    """The fields of a returned tuple, looking through vars bound to tuples."""
    while isinstance(expr, relax.Var) and isinstance(bound.get(expr), relax.Tuple):
        expr = bound[expr]
    if not isinstance(expr, relax.Tuple):
        raise ValueError(f"SplitAdjoint: main_adjoint must return ((loss, *new_buffers), (*grads,)), got {expr}")
    return list(expr.fields)


def make_buckets(order: list[int], nbytes: list[int], bucket_bytes: float) -> list[list[int]]:
    """Parameters `order`ed by readiness packed into consecutive buckets: a bucket is closed once it
    holds at least `bucket_bytes` (so a parameter larger than that is a bucket of its own)."""
    buckets, current, size = [], [], 0
    for p in order:
        current.append(p)
        size += nbytes[p]
        if size >= bucket_bytes:
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    return buckets


@tvm.transform.module_pass(opt_level=0, name="SplitAdjoint")
class SplitAdjoint:
    """Add ``adjoint_part{i}``: ``main_adjoint`` cut after each gradient bucket (see the module
    docstring); `num_params` gradients, buckets of about `bucket_bytes`; `cut=False`: one segment,
    the whole adjoint, after which every bucket is ready.  Sets ``self.plan``."""

    def __init__(self, num_params: int, bucket_bytes: float, cut: bool = True):
        self.num_params = num_params
        self.bucket_bytes = bucket_bytes
        self.cut = cut
        self.plan: SegmentPlan | None = None

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        adj = mod["main_adjoint"]
        args = list(adj.params)
        bindings = [b for block in adj.body.blocks for b in block.bindings]
        for b in bindings:
            if not isinstance(b, relax.VarBinding):
                raise ValueError(f"SplitAdjoint: main_adjoint has a binding it cannot move: {b}")
        index = {b.var: i for i, b in enumerate(bindings)}
        key = {v: f"arg{i}" for i, v in enumerate(args)}
        key.update({b.var: f"b{i}" for i, b in enumerate(bindings)})
        uses = [[u for u in relax.analysis.free_vars(b.value) if u in index or u in key] for b in bindings]
        bound = {b.var: b.value for b in bindings}

        outs, grads = _leaves(adj.body.body, bound)
        outs, grads = _leaves(outs, bound), _leaves(grads, bound)
        if len(grads) != self.num_params or any(not isinstance(v, relax.Var) for v in outs + grads):
            raise ValueError(f"SplitAdjoint: expected {self.num_params} gradients as vars, got {outs} / {grads}")

        def ready(v) -> int:  # the binding that computes v (-1: a parameter of main_adjoint)
            while v in bound and isinstance(bound[v], relax.Var):
                v = bound[v]
            return index.get(v, -1)

        nbytes = [math.prod(int(d) for d in g.ty.shape.values) * tvm.DataType(g.ty.dtype).bits // 8 for g in grads]
        order = sorted(range(self.num_params), key=lambda p: (ready(grads[p]), p))
        buckets = make_buckets(order, nbytes, self.bucket_bytes)

        # segment per bucket: the closure of its gradients not computed yet; then the loss's rest
        owner = {}  # binding index -> segment
        groups, ready_after = [], []
        for targets in [[grads[p] for p in bucket] for bucket in buckets] + [outs]:
            stack = [index[v] for v in targets if v in index and index[v] not in owner]
            members = set()
            while stack:
                i = stack.pop()
                if i in members or i in owner:
                    continue
                members.add(i)
                stack.extend(index[u] for u in uses[i] if u in index)
            if members:
                for i in members:
                    owner[i] = len(groups)
                groups.append(sorted(members))
            ready_after.append(len(groups) - 1)
        ready_after = ready_after[:-1]  # the last entry was the loss's
        if not self.cut:  # one segment: every bucket is ready after it
            groups, ready_after = [sorted(owner)], [0] * len(buckets)
            owner = dict.fromkeys(owner, 0)

        results = {v for v in outs + grads}
        read_later = {}  # binding index -> the last segment that reads it
        for i in owner:
            for u in uses[i]:
                if u in index and owner[index[u]] != owner[i]:
                    read_later[index[u]] = max(read_later.get(index[u], -1), owner[i])

        segments = []
        for s, members in enumerate(groups):
            inputs = []
            for i in members:
                for u in uses[i]:
                    if (u not in index or owner[index[u]] != s) and u not in inputs:
                        inputs.append(u)
            inputs.sort(key=lambda u: (u in index, index[u] if u in index else args.index(u)))
            outputs = [bindings[i].var for i in members if bindings[i].var in results or i in read_later]
            name = SEGMENT_NAME.format(s)
            mod[name] = self._function(name, inputs, [bindings[i] for i in members], outputs)
            segments.append(Segment(name, tuple(key[u] for u in inputs), tuple(key[v] for v in outputs)))
        self.plan = SegmentPlan(
            segments=tuple(segments),
            buckets=tuple(tuple(b) for b in buckets),
            ready_after=tuple(ready_after),
            loss=key[outs[0]],
            new_buffers=tuple(key[v] for v in outs[1:]),
            grads=tuple(key[g] for g in grads),
            num_args=len(args),
        )
        return mod

    @staticmethod
    def _function(name: str, inputs: list, bindings: list, outputs: list) -> relax.Function:
        """A function of `inputs` running `bindings` (fresh vars) and returning `outputs`."""
        vmap = {u: relax.Var(u.name, u.ty) for u in inputs}
        params = [vmap[u] for u in inputs]
        bb = relax.BlockBuilder()
        with bb.function(name, params, attrs={"num_input": len(params)}):
            with bb.dataflow():
                for b in bindings:
                    value = substitute(b.value, vmap)
                    emit = bb.emit_output if b.var in outputs else bb.emit
                    vmap[b.var] = emit(value, name_hint=b.var.name)
            bb.emit_func_output(relax.Tuple([vmap[v] for v in outputs]))
        return bb.get()[name]

"""What the row-kernel fusions share (FuseSoftmaxDropout, FuseLayerNorm, FuseLayerNormBackward):
the one-thread-block-per-row CUDA schedule of a TE kernel whose outputs need row reductions, and
the mutator that replaces a matched chain of bindings with one fused call."""

from __future__ import annotations

import math
from typing import Callable

import tvm
from tvm import relax, tirx
from tvm.relax.expr_functor import PyExprMutator, mutator

from .._rewrite import OPAQUE, mutate_relax_functions

LOW = ("bfloat16", "float16")


def threads_per_row(n: int) -> int:
    """Threads per row: a warp multiple covering the row in at most 8 elements a thread."""
    return min(1024, max(32, 32 * math.ceil(math.ceil(n / 8) / 32)))


def block_names(name: str, outputs: int) -> list[str]:
    """The blocks of a te.compute named `name`: one per output (``name_v0``, ...) under one loop
    nest when it has several."""
    return [f"{name}_v{i}" for i in range(outputs)] if outputs > 1 else [name]


def schedule_rows(sch: tvm.s_tir.Schedule, outputs: list[str], reductions: list[str], n: int,
                  stage: bool) -> None:
    """One thread block per row of the loop nest of the `outputs` blocks (one nest).  The
    `reductions` (row-shaped blocks, producers first) are computed per row in shared memory as
    cross-thread reductions; with `stage`, the first reduction's input row is first copied into
    shared memory, read from there by the reductions and the `outputs`.  Every loop over the row
    is split across the block's threads."""
    threads = threads_per_row(n)
    outs = [sch.get_sblock(o) for o in outputs]
    reds = [sch.get_sblock(r) for r in reductions]
    *lead, col = sch.get_loops(outs[0])
    row = sch.fuse(*lead) if len(lead) > 1 else lead[0]
    for block in reversed(reds):  # consumers first: each lands before what reads it
        sch.compute_at(block, row)
    for block in reds:
        sch.set_scope(block, 0, "shared")
    row_blocks = list(reds)
    if stage:
        staged = sch.cache_read(reds[0], 0, "shared", consumer_blocks=[*reds, *outs])
        sch.compute_at(staged, row)
        row_blocks.insert(0, staged)
    sch.bind(row, "blockIdx.x")
    for loop in (sch.get_loops(b)[-1] for b in row_blocks):
        sch.bind(sch.split(loop, [None, threads])[1], "threadIdx.x")
    sch.bind(sch.split(col, [None, threads])[1], "threadIdx.x")


def scheduled(sch: tvm.s_tir.Schedule) -> tirx.PrimFunc:
    """The schedule's function, marked scheduled (DLight skips it) and opaque (FuseOps too)."""
    return sch.mod["main"].with_attr("tirx.is_scheduled", True).with_attr("op_pattern", OPAQUE)


@mutator
class _ChainFuser(PyExprMutator):
    def __init__(self, mod: tvm.IRModule, find: Callable, fuse: Callable):
        super().__init__(mod)
        self.find, self.fuse = find, fuse

    def prime(self, func: relax.Function) -> None:
        self.chains = self.find(func)
        self.absorbed = set().union(*(c.absorbed for c in self.chains.values())) if self.chains else set()

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        if binding.var in self.absorbed:
            return  # computed by the fused call
        chain = self.chains.get(binding.var)
        if chain is None:
            return super().visit_var_binding_(binding)
        for var, out in self.fuse(self, binding, chain):
            self.set_var_remap(var, out)


def fuse_chains(mod: tvm.IRModule, find: Callable, fuse: Callable) -> tvm.IRModule:
    """Rewrite every Relax function of `mod`: ``find(func)`` maps the var of each match's last
    binding to the match (an object with ``absorbed``: the other bindings the fused call replaces),
    and at that binding ``fuse(mutator, binding, match)`` emits the fused call through
    ``mutator.builder_`` and returns the (old var, new var) pairs to remap.  Bindings left unused
    are removed."""
    fuser = _ChainFuser(mod, find, fuse)
    mod = mutate_relax_functions(fuser, mod, before_each=fuser.prime)
    return relax.transform.DeadCodeElimination()(mod)

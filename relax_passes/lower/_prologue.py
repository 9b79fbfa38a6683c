"""Elementwise producers a row kernel computes from their operands instead of reading them.

A row kernel (FuseLayerNormBackward's, say) reads whole ``[..., n]`` float32 blocks.  When such a
block is itself an elementwise function of cheaper tensors -- a layer norm's ``xhat`` is
``(astype(x16, float32) - mean) * rstd``, two bytes an element instead of four -- reading those
and recomputing costs less than the kernel that writes the block and the read back.  A
`Prologue` is that function: the bindings it inlines (operands first) and the leaves it reads.

`inline_prologue` descends from a kernel input through the bindings of ``ELEMENTWISE`` calls with
float32 results whose operands broadcast to the kernel's shape, as long as each such value is
read by nothing else (then nothing writes it) or recomputing it pays (``recompute_pays``, the rule
``RecomputeElementwise`` applies between TVM's kernels, this kernel one of its readers).
`prologue_compute` gives the TE expression of a prologue at an index of the kernel's shape.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Callable

from tvm import relax, te, tirx

from .._rewrite import op_name, scalar_value, static_shape
from .recompute_elementwise import FUSABLE, recompute_pays


# op name -> TE of the operands (a cast reads its operand at any dtype; the rest are float32)
ELEMENTWISE: dict[str, Callable] = {
    "relax.astype": lambda args, attrs: args[0].astype(str(attrs.dtype)),
    "relax.add": lambda args, _attrs: args[0] + args[1],
    "relax.subtract": lambda args, _attrs: args[0] - args[1],
    "relax.multiply": lambda args, _attrs: args[0] * args[1],
    "relax.divide": lambda args, _attrs: args[0] / args[1],
    "relax.negative": lambda args, _attrs: -args[0],
    # read only by `epilogue_chain` (`_inlinable` takes float32 operands, never a mask)
    "relax.where": lambda args, _attrs: tirx.Select(args[0], args[1], args[2]),
}
MAX_OPS = 16  # ops one prologue inlines


def scalar_constant(expr) -> float | None:
    """The value of a one-element constant operand, else None."""
    return scalar_value({}, expr)


def broadcasts_to(shape: tuple[int, ...] | None, to: tuple[int, ...]) -> bool:
    """Does a tensor of `shape` broadcast (numpy rules, right-aligned) to `to` without growing it?"""
    return shape is not None and len(shape) <= len(to) and all(
        s in (1, t) for s, t in zip(reversed(shape), reversed(to)))


@dataclass(frozen=True)
class Prologue:
    """``root`` as the kernel computes it: the `calls` (var, bound call; operands first) over the
    `leaves` the kernel reads (tensors broadcasting to its shape)."""

    root: relax.Expr
    calls: tuple = ()
    leaves: tuple = ()

    @property
    def vars(self) -> frozenset:
        return frozenset(v for v, _ in self.calls)

    def key(self, leaf_index: Callable[[relax.Expr], int]) -> str:
        """The prologue's structure, leaves by their parameter index: equal keys, equal TE."""
        names = {v: f"v{i}" for i, (v, _) in enumerate(self.calls)}

        leaves = set(self.leaves)

        def arg(a) -> str:
            if a in names:
                return names[a]
            c = scalar_constant(a)
            if c is not None:
                return repr(c)
            return f"p{leaf_index(a)}" if a in leaves else "given"  # an epilogue's start

        parts = [f"{names[v]}={op_name(c)}({','.join(arg(a) for a in c.args)}"
                 + (f";{c.attrs.dtype}" if op_name(c) == "relax.astype" else "") + ")" for v, c in self.calls]
        return "|".join(parts) + f"->{arg(self.root)}"


def inline_prologue(root: relax.Expr, bound: dict, readers: Callable[[relax.Var], list],
                    inside: set, shape: tuple[int, ...]) -> Prologue:
    """The prologue of `root` for a kernel of `shape` whose own bindings are `inside`
    (``readers(var)``: the vars of the bindings reading `var`, None for the function's result)."""
    calls: list = []
    leaves: list = []
    seen: set = set()  # inlined or leaves
    taken: set = set(inside)
    ops = [0]

    def _pays(var, value) -> bool:  # RecomputeElementwise's rule, this kernel one of the readers
        others = [r for r in readers(var) if r not in taken]
        fusable = [r for r in others if r is not None and op_name(bound.get(r)) in FUSABLE]
        return recompute_pays(value, var, len(fusable) + 1, len(fusable) < len(others))

    def visit(e) -> None:
        if e in seen or scalar_constant(e) is not None:
            return
        seen.add(e)
        value = bound.get(e) if isinstance(e, relax.DataflowVar) else None
        if not _inlinable(e, value, shape) or ops[0] >= MAX_OPS or not (
                all(r in taken for r in readers(e)) or _pays(e, value)):
            leaves.append(e)
            return
        ops[0] += 1
        taken.add(e)
        for a in value.args:
            visit(a)
        calls.append((e, value))

    visit(root)
    return Prologue(root, tuple(calls), tuple(leaves))


def _inlinable(var, value, shape) -> bool:
    if op_name(value) not in ELEMENTWISE or str(var.ty.dtype) != "float32" or not broadcasts_to(static_shape(var), shape):
        return False
    if op_name(value) == "relax.astype":
        return broadcasts_to(static_shape(value.args[0]), shape)
    return all(scalar_constant(a) is not None or (broadcasts_to(static_shape(a), shape)
                                                  and str(a.ty.dtype) == "float32") for a in value.args)


def leaf_index(leaves: list) -> Callable[[relax.Expr], int]:
    def index(e) -> int:
        return next(i for i, leaf in enumerate(leaves) if leaf.same_as(e))

    return index


def unique_leaves(*prologues: Prologue, extra: tuple = ()) -> list:
    """The leaves of `prologues`, then the `extra` inputs, each once (first occurrence order)."""
    out: list = []
    for e in [leaf for p in prologues for leaf in p.leaves] + list(extra):
        if not any(e.same_as(o) for o in out):
            out.append(e)
    return out


def placeholders(leaves: list) -> list:
    return [te.placeholder(static_shape(e), str(e.ty.dtype), name=f"in{i}") for i, e in enumerate(leaves)]


def at(t: te.Tensor, idx: tuple) -> tirx.PrimExpr:
    """``t`` read at `idx` of the kernel's shape, broadcast along its size-1 and missing axes."""
    shape = [int(s) for s in t.shape]
    off = len(idx) - len(shape)
    return t[tuple(0 if s == 1 else idx[off + i] for i, s in enumerate(shape))]


def prologue_compute(p: Prologue, leaves: list, tensors: list) -> Callable[..., tirx.PrimExpr]:
    """(idx, given) -> the TE value of ``p.root`` at `idx`, the `leaves` read from `tensors` (same
    order) and the vars in `given` (var -> TE value at `idx`) as given."""
    index = leaf_index(leaves)

    def compute(idx, given: dict | None = None):
        values: dict = dict(given or {})

        def arg(a):
            if a in values:
                return values[a]
            c = scalar_constant(a)
            if c is not None:
                return tirx.const(c, str(a.ty.dtype))
            return at(tensors[index(a)], idx)

        for v, call in p.calls:
            values[v] = ELEMENTWISE[op_name(call)]([arg(a) for a in call.args], call.attrs)
        return arg(p.root)

    return compute


def prologue_tag(prologues: list, leaves: list) -> str:
    """A short name suffix for kernels with non-trivial prologues ('' when none inlines a call)."""
    if not any(p.calls for p in prologues):
        return ""
    index = leaf_index(leaves)
    text = ";".join(p.key(index) for p in prologues) + ";" + ",".join(
        f"{static_shape(e)}:{e.ty.dtype}" for e in leaves)
    return "_p" + hashlib.sha256(text.encode()).hexdigest()[:8]


def epilogue_chain(start: relax.Var, bound: dict, readers: Callable[[relax.Var], list], skip: set,
                   shape: tuple[int, ...], same_block: Callable[[relax.Var], bool]) -> Prologue | None:
    """The elementwise ops a row kernel can apply to its result `start` before writing it: each
    the only reader of the value before it (`start`'s readers in `skip` aside: they read it
    otherwise), of `shape`, with its other operands broadcasting to it (a residual gradient, a
    dropout mask, scalars).  The last one is what the kernel writes; None when there is none."""
    calls: list = []
    leaves: list = []
    v = start
    while True:
        rs = [r for r in readers(v) if not (v is start and r in skip)]
        if len(rs) != 1 or rs[0] is None or not isinstance(rs[0], relax.DataflowVar) or not same_block(rs[0]):
            break
        value = bound.get(rs[0])
        if op_name(value) not in ELEMENTWISE or static_shape(rs[0]) != tuple(shape) \
                or sum(1 for a in value.args if a.same_as(v)) != 1:
            break
        others = [a for a in value.args if not a.same_as(v)]
        if not all(scalar_constant(a) is not None or broadcasts_to(static_shape(a), shape) for a in others):
            break
        for a in others:
            if scalar_constant(a) is None and not any(a.same_as(leaf) for leaf in leaves):
                leaves.append(a)
        calls.append((rs[0], value))
        v = rs[0]
    return Prologue(v, tuple(calls), tuple(leaves)) if calls else None

"""NarrowBeforeLayout: a narrowing cast after layout ops moves in front of them.

Mixed precision casts a float32 input to bf16 where a GEMM reads it, after the layout ops that
bring it there.  ResNet-50's stage takes its NCHW float32 input and reads it NHWC twice (the first
1×1 convolution, and the stride-2 shortcut's slice), so the transpose was written in float32
(822 MB moved, 0.59 ms on H100) and each reader cast its part again.  Layout ops only move
values, so casting first gives the same numbers while every copy moves half the bytes::

    p = L(x)                    x float32, made by no layout op; L a permute or reshape (``HEADS``:
                                    a slice would cast more than it reads)
    a = astype(p, low)          every reader of p is such a cast to one dtype ``low``,
    q = L2(p); b = astype(q, low)   or a chain of layout ops, each read by the next alone,
                                    ending in such a cast
  ->
    xl = astype(x, low); p = L(xl); a = p; q = L2(p); b = q

All of it in one dataflow block; the casts' values are replaced by the narrow layout values.
A chain may also start at a slice of ``x`` where ``x`` is cast whole to ``low`` anyway (by a
reader, or for another chain): the slice then reads that narrow copy, not ``x`` again.  In
ResNet-50's channels-last stage the stride-2 shortcut's slice read the float32 input a second time
(462 MB of modelled traffic; 103 MB when it slices the bf16 copy).  Every chain and reader that
casts ``x`` to ``low`` shares one cast.
Left alone: a permute read by one cast directly, unless the permute swaps the last two axes and
only matmuls read the cast (directly, or through such a transpose: the backward's ``dy W``).  FuseOps fuses such a pair into one kernel anyway, and the moved
cast would put the transpose into the cast's readers' kernel, where it breaks their vector loads
(resnet_basic's first im2col gather).  A matmul instead reads the transposed operand as a layout
(the EVT codegen's K-major B), so the transpose disappears: a linear layer's float32 weight
``W [out, in]`` is cast as it is, where the cast kernel wrote bf16 ``W^T`` at a quarter of the
bandwidth (DLight's transpose schedule does not coalesce: 0.11 ms a step on BERT-Large's six).
The same holds for a slice of a weight (``SplitFusedProjection``'s pieces of GPT-2's QKV weight):
``astype(slice(W))`` is cast first and its transpose left to the matmul; other chains that start
below a slice stay as they are.
"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from .._rewrite import binding_uses, flat_bindings, mutate_relax_functions, swaps_last_two

ASTYPE = tvm.ir.Op.get("relax.astype")
LAYOUT = frozenset(tvm.ir.Op.get(f"relax.{n}") for n in ("permute_dims", "reshape", "strided_slice"))
HEADS = frozenset(tvm.ir.Op.get(f"relax.{n}") for n in ("permute_dims", "reshape"))  # same size as their input
NARROW = ("bfloat16", "float16")
PERMUTE = tvm.ir.Op.get("relax.permute_dims")
SLICE = tvm.ir.Op.get("relax.strided_slice")
MATMUL = tvm.ir.Op.get("relax.matmul")


def _call(value, ops) -> bool:
    return isinstance(value, relax.Call) and value.op in ops


def plan(func: relax.Function) -> tuple[dict, dict, dict]:
    """(var of a layout op -> the cast ``(x, dtype, block)`` of its input x it reads instead; cast
    var -> the var whose narrow value replaces it; var of a reader's cast of such an x -> that
    cast, which it becomes)."""
    bindings, block_of = flat_bindings(func)
    uses = binding_uses(func)
    at = {i: b for i, b in enumerate(bindings)}

    def readers(v):
        return [at.get(i) for i in uses.get(v, [])]

    def operand_of_matmuls(v, through_transpose=True) -> bool:  # only matmuls read v (or its transposes)
        rs = readers(v)
        return bool(rs) and all(r is not None and (_call(r.value, {MATMUL}) or (
            through_transpose and swaps_last_two(r.value) and operand_of_matmuls(r.var, False))) for r in rs)

    def cast_to(b):
        return str(b.value.attrs.dtype) if b is not None and _call(b.value, {ASTYPE}) else None

    def chain_ends(head, chain=None) -> list:
        """(cast, the layout var it reads) ending each chain of layout ops from `head` (each read
        by the next alone); [] unless every reader of `head` starts such a chain."""
        ends = []
        for r in readers(head):
            src = head
            while r is not None and cast_to(r) is None and _call(r.value, LAYOUT) and len(readers(r.var)) == 1:
                src, r = r.var, readers(r.var)[0]
                if chain is not None:
                    chain.add(src)
            if cast_to(r) is None:
                return []
            ends.append((r, src))
        return ends

    bound = {b.var: b.value for b in bindings}
    first, replaced, inner = {}, {}, set()
    for b in bindings:
        if not _call(b.value, HEADS) or str(b.value.args[0].ty.dtype) != "float32" or block_of[b.var] is None \
                or b.var in inner:
            continue
        made_by = bound.get(b.value.args[0])
        if _call(made_by, HEADS):
            continue  # chains start at a permute / reshape of a value no permute / reshape made
        chain = set()
        ends = chain_ends(b.var, chain)
        low = {cast_to(c) for c, _ in ends}
        direct = len(ends) == 1 and ends[0][1].same_as(b.var)
        operand = direct and swaps_last_two(b.value) and operand_of_matmuls(ends[0][0].var)
        if _call(made_by, {SLICE}) and not operand:
            continue  # of a slice's layout chains, only a matmul operand's transpose (a split weight's)
        if not ends or (direct and b.value.op == PERMUTE and not operand) or len(low) != 1 \
                or next(iter(low)) not in NARROW \
                or any(block_of[c.var] != block_of[b.var] for c, _ in ends):
            continue
        first[b.var] = (b.value.args[0], next(iter(low)), block_of[b.var])
        replaced.update({c.var: src for c, src in ends})
        inner |= chain  # narrow already: their own casts are not moved again
    # slices of a value cast whole to the same dtype anyway in their block (by a reader of it, or
    # for a chain above)
    casts = {b.var: key for b in bindings if (key := shared_cast(b, block_of))}  # readers' casts
    whole = set(casts.values()) | set(first.values())
    for b in bindings:
        if not _call(b.value, {SLICE}) or block_of[b.var] is None or b.var in inner:
            continue
        ends = chain_ends(b.var)
        lows = {cast_to(c) for c, _ in ends}
        key = (b.value.args[0], next(iter(lows), None), block_of[b.var])
        if not ends or len(lows) != 1 or key not in whole \
                or any(block_of[c.var] != block_of[b.var] for c, _ in ends):
            continue
        first[b.var] = key
        replaced.update({c.var: src for c, src in ends})
    moved = set(first.values())
    return first, replaced, {v: key for v, key in casts.items() if key in moved}


def shared_cast(binding: relax.VarBinding, block_of: dict) -> tuple | None:
    """(x, dtype, block) of a narrowing cast of x bound to a dataflow var, which the moved casts
    of x to that dtype in that block may share; else None."""
    value = binding.value
    if not (_call(value, {ASTYPE}) and isinstance(binding.var, relax.DataflowVar)
            and str(value.attrs.dtype) in NARROW):
        return None
    return value.args[0], str(value.attrs.dtype), block_of[binding.var]


@mutator
class _Narrower(PyExprMutator):
    def __init__(self, mod: tvm.IRModule):
        super().__init__(mod)
        self.first: dict = {}
        self.replaced: dict = {}
        self.shared: dict = {}
        self.narrow: dict = {}  # (x, low, block) -> the one cast of x to low there, once emitted

    def prime(self, func: relax.Function) -> None:
        self.first, self.replaced, self.shared = plan(func)
        self.narrow = {}

    def _cast(self, key: tuple):
        if key not in self.narrow:
            x, low, _ = key
            self.narrow[key] = self.builder_.emit(relax.op.astype(self.visit_expr(x), low))
        return self.narrow[key]

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        v, value = binding.var, binding.value
        if v in self.first:
            args = [self._cast(self.first[v]), *(self.visit_expr(a) for a in value.args[1:])]
            self.set_var_remap(v, self.builder_.emit(relax.Call(value.op, args, value.attrs, value.ty_args)))
        elif v in self.replaced:
            self.set_var_remap(v, self.visit_expr(self.replaced[v]))
        elif v in self.shared:
            self.set_var_remap(v, self._cast(self.shared[v]))  # a reader's cast, shared
        else:
            super().visit_var_binding_(binding)


@tvm.transform.module_pass(opt_level=0, name="NarrowBeforeLayout")
class NarrowBeforeLayout:
    """Move narrowing casts in front of the layout ops they follow (module docstring)."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        narrower = _Narrower(mod)
        return mutate_relax_functions(narrower, mod, before_each=narrower.prime)

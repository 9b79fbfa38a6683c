"""FuseAttention: the attention core of an imported model as one ``tvm_evt.attention`` call.

Runs before ``Gradient`` on the float32 graph as the torch importer and `LowerDropout` write it
(after ``CanonicalizeBindings``: no var-to-var or tuple round-trip bindings in the chain)::

    S  = reshape(matmul(reshape(broadcast_to(q)), reshape(broadcast_to(permute_dims(k, [0, 1, 3, 2])))))
    x  = S / c   (or S * c; c a positive scalar constant; several such steps multiply)
    x  = where(M, -inf, x)      optional: M evaluates at compile time to the strict upper triangle
    x  = x + bias               optional: bias computed from constants only, after the scaling: a key
                                bias [Sk], or a mask that ``attention_op.mask_form`` reads as the
                                causal triangle and/or a key mask (transformers' eager attention)
    P  = softmax(x, axis=-1)
    Pd = where(keep, P, 0) * float32(1 / (1 - p))     optional: keep = call_tir(dropout_keep_.., (seed, site))
    O  = reshape(matmul(reshape(broadcast_to(Pd)), reshape(broadcast_to(v))))
  ->
    A  = tvm_evt.attention(q, k, v, seed, 1 / c, causal, p, site[, bias])
    O  = A[0]

q, k, v are the [B, H, S, D] tensors (the head split's ``permute_dims``); the broadcasts (which
must not change the shape) and the 3-D reshapes may be absent (a 4-D ``matmul``).  ``M`` may be
any subgraph computed from constants only (GPT-2's ``bitwise_not(logical_and(less_equal(
subtract(arange, arange), 0), full(True)))``): it is legalised and constant-folded here and fused
only when it equals ``np.triu(ones((Sq, Sk)), 1)`` (``where(M, x, -inf)`` with ``M`` its complement,
the lower triangle, is taken as well).  The rate of the dropout comes from the keep-mask kernel's
``KEEP_RATE_ATTR``, the site from its constant argument; ``keep`` must have the scores' shape.
The bias must be a compile-time constant (PadAttentionKeys' -inf columns), since
``tvm_evt.attention`` gives its bias no gradient: a learned bias stays unfused.

Every value from ``S`` to ``O`` (the reshapes and broadcasts of the scores and of ``Pd``, the
matmuls, the scaled/masked/biased scores, ``P``, ``keep``, the dropped ``P``) must be read by the
next step only; otherwise the chain is left alone.  The keep-mask call, the causal mask's
subgraph and kernels left without a caller are removed afterwards.  Whether a kernel can take a
fused call is decided later, on the CUDA route (``OffloadAttention``); ``head_dims`` restricts the
fusion to what they can take.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import tvm
import tvm_ffi
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from ..ops import attention_op
from .._rewrite import (bind_as, binding_uses, drop_unreferenced, flat_bindings, scalar_value, static_shape,
                        sub_expressions, substitute)
from .philox import KEEP_RATE_ATTR

MATMUL = tvm.ir.Op.get("relax.matmul")
RESHAPE = tvm.ir.Op.get("relax.reshape")
BROADCAST_TO = tvm.ir.Op.get("relax.broadcast_to")
PERMUTE_DIMS = tvm.ir.Op.get("relax.permute_dims")
MULTIPLY = tvm.ir.Op.get("relax.multiply")
DIVIDE = tvm.ir.Op.get("relax.divide")
ADD = tvm.ir.Op.get("relax.add")
WHERE = tvm.ir.Op.get("relax.where")
SOFTMAX = tvm.ir.Op.get("relax.nn.softmax")
CALL_TIR = tvm.ir.Op.get("relax.call_tir")


@dataclasses.dataclass(frozen=True)
class Match:
    """One attention chain: its operands, and the bindings it replaces."""

    q: relax.Expr
    k: relax.Expr
    v: relax.Expr
    seed: relax.Expr | None  # None: no dropout
    scale: float
    causal: bool
    dropout: float
    site: int
    bias: relax.Expr | None
    out: relax.Var  # bound to the [B, H, Sq, D] output, becomes A[0]
    inner: tuple  # the vars of the bindings between, removed

    def call(self) -> relax.Call:
        seed = self.seed if self.seed is not None else attention_op.no_seed()
        return attention_op.attention(self.q, self.k, self.v, seed, self.scale, self.causal, self.dropout,
                                      self.site, self.bias)


class _Graph:
    """A function's bindings: what each var is bound to and who reads it."""

    def __init__(self, func: relax.Function, mod: tvm.IRModule, masks: dict):
        bindings, self.block_of = flat_bindings(func)
        self.bound = {b.var: b.value for b in bindings}
        self.order = {b.var: i for i, b in enumerate(bindings)}
        self.bindings = bindings
        self.uses = binding_uses(func)
        self.mod = mod
        self.masks = masks  # structural hash -> [(mask function, folded value)], across functions

    def call(self, expr, op: tvm.ir.Op) -> relax.Call | None:
        value = self.bound.get(expr) if isinstance(expr, relax.Var) else None
        return value if isinstance(value, relax.Call) and value.op == op else None

    def only_reader(self, var: relax.Var) -> relax.VarBinding | None:
        """The binding that alone reads `var` (in `var`'s dataflow block), else None."""
        readers = self.uses.get(var, [])
        if len(readers) != 1 or readers[0] >= len(self.bindings):
            return None
        reader = self.bindings[readers[0]]
        same_block = self.block_of.get(reader.var) is not None and self.block_of[reader.var] == self.block_of.get(var)
        return reader if same_block else None

    def scalar(self, expr) -> float | None:
        return scalar_value(self.bound, expr)

    # -- the [B, H, S, D] tensor a batched GEMM operand was made from
    def unbatched(self, expr: relax.Expr) -> relax.Expr | None:
        """`expr` seen through ``reshape([B*H, ..])`` and a shape-preserving ``broadcast_to``: the
        4-D tensor, else None."""
        shape = static_shape(expr)
        if shape is None:
            return None
        if len(shape) == 4:
            return expr
        reshape = self.call(expr, RESHAPE)
        if len(shape) != 3 or reshape is None:
            return None
        x = reshape.args[0]
        bcast = self.call(x, BROADCAST_TO)
        if bcast is not None and static_shape(bcast.args[0]) == static_shape(x):
            x = bcast.args[0]
        x_shape = static_shape(x)
        if x_shape is None or len(x_shape) != 4 or [x_shape[0] * x_shape[1], *x_shape[2:]] != list(shape):
            return None
        return x

    def causal_mask(self, where: relax.Call, x: relax.Expr, shape: tuple) -> bool:
        """Is `where` ``where(M, -inf, x)`` with M the strict upper triangle (or ``where(M, x,
        -inf)`` with M the lower one) of the [Sq, Sk] scores?"""
        cond, a, b = where.args
        if a.same_as(x) and self.scalar(b) == -np.inf:
            k = 0  # kept where M: the lower triangle
        elif b.same_as(x) and self.scalar(a) == -np.inf:
            k = 1  # masked where M: the strict upper triangle
        else:
            return False
        mask = self.fold(cond)
        sq, sk = shape[-2:]
        if mask is None or mask.dtype != np.bool_ or mask.ndim < 2 or mask.shape[-2:] != (sq, sk) \
                or any(d != 1 for d in mask.shape[:-2]):
            return False
        want = np.triu(np.ones((sq, sk), bool), 1)
        return bool(np.array_equal(mask.reshape(sq, sk), want if k else ~want))

    def fold(self, expr: relax.Expr) -> np.ndarray | None:
        """The value of `expr` when it depends on constants only (legalised and folded), else None."""
        if isinstance(expr, tvm.ir.GenericConst):
            return expr.value.numpy()
        needed, stack, outside = set(), [expr], []
        while stack:
            e = stack.pop()
            if not isinstance(e, relax.Var) or e in needed:
                continue
            if e not in self.bound or isinstance(self.bound[e], relax.Function):
                return None  # a parameter
            needed.add(e)
            for n in sub_expressions(self.bound[e]):
                if isinstance(n, relax.Var):
                    stack.append(n)
                elif isinstance(n, tvm.ir.GlobalVar):
                    outside.append(n)
        if outside:
            return None  # calls into the module
        bb = relax.BlockBuilder()
        with bb.function("mask", []):
            with bb.dataflow():
                vmap = {}
                for var in sorted(needed, key=self.order.get):
                    vmap[var] = bb.emit(substitute(self.bound[var], vmap))
                out = bb.emit_output(vmap[expr])
            bb.emit_func_output(out)
        func = bb.get()["mask"]
        key = tvm_ffi.structural_hash(func)
        for seen, value in self.masks.get(key, []):
            if tvm_ffi.structural_equal(seen, func):
                return value
        # evaluated on the CPU (FoldConstant leaves tensors of 64 x 64 and more unfolded)
        vm = relax.VirtualMachine(tvm.compile(tvm.IRModule({"mask": func}), target="llvm"), tvm.cpu())
        result = vm["mask"]()
        value = result.numpy() if isinstance(result, tvm.runtime.Tensor) else None
        self.masks.setdefault(key, []).append((func, value))
        return value


def _scores_chain(g: _Graph, x: relax.Var, shape: tuple, inner: list):
    """Walk back from the softmax input `x` through scale, causal mask and bias to ``Q Kᵀ``:
    (q, k, scale, causal, bias) or None."""
    scale, causal, bias = 1.0, False, None
    seen_scale = False
    while True:
        value = g.bound.get(x)
        if not isinstance(value, relax.Call) or static_shape(x) != shape:
            return None
        if value.op in (MULTIPLY, DIVIDE):
            a, b = value.args
            if a.same_as(b):
                return None
            y, c = (a, g.scalar(b)) if g.scalar(b) is not None else (b, g.scalar(a))
            if c is None or c <= 0 or (value.op == DIVIDE and not value.args[0].same_as(y)):
                return None
            scale = scale * c if value.op == MULTIPLY else scale / c
            seen_scale = True
        elif value.op == WHERE and not causal:
            y = value.args[2] if g.scalar(value.args[1]) == -np.inf else value.args[1]
            if not g.causal_mask(value, y, shape):
                return None
            causal = True
        elif value.op == ADD and bias is None and not causal and not seen_scale:
            # an additive mask or bias computed from constants (the op hands its bias no gradient):
            # a key bias [Sk], or a [.., Sq, Sk] mask that attention_op.mask_form reads as the
            # causal triangle and/or a key mask (transformers' eager attention adds one)
            a, b = value.args
            y, addend = (a, b) if static_shape(a) == shape and g.fold(a) is None else (b, a)
            folded = g.fold(addend) if static_shape(y) == shape else None
            form = attention_op.mask_form(folded, shape) if folded is not None else "not a constant"
            if isinstance(form, str):
                return None
            causal, key_bias = form
            bias = relax.const(key_bias) if key_bias is not None else None
        else:
            break
        if g.only_reader(y) is None or not isinstance(y, relax.Var):
            return None
        inner.append(y)
        x = y
    # x: the scores [B, H, Sq, Sk], reshaped from a batched GEMM or a 4-D one
    reshape = g.call(x, RESHAPE)
    gemm_var = reshape.args[0] if reshape is not None else x
    gemm = g.call(gemm_var, MATMUL)
    if gemm is None:
        return None
    if reshape is not None:
        if g.only_reader(gemm_var) is None:
            return None
        inner.append(gemm_var)
    q = g.unbatched(gemm.args[0])
    kt = g.unbatched(gemm.args[1])
    transpose = g.call(kt, PERMUTE_DIMS) if kt is not None else None
    if q is None or transpose is None or [int(a) for a in transpose.attrs.axes] != [0, 1, 3, 2]:
        return None
    return q, transpose.args[0], scale, causal, bias


def _dropout(g: _Graph, p: relax.Var, inner: list):
    """``Pd = where(keep, P, 0) * float32(1 / (1 - rate))`` after `p`: (Pd, seed, rate, site), or
    (p, None, 0.0, 0) when `p` is not dropped, or None for a dropout of another form."""
    reader = g.only_reader(p)
    where = reader.value if reader is not None else None
    if not (isinstance(where, relax.Call) and where.op == WHERE):
        return p, None, 0.0, 0
    keep, a, zero = where.args
    if not a.same_as(p) or g.scalar(zero) != 0.0 or static_shape(keep) != static_shape(p):
        return None
    kernel = g.call(keep, CALL_TIR)
    if kernel is None or g.only_reader(keep) is None or not isinstance(kernel.args[1], relax.Tuple):
        return None
    func = g.mod[kernel.args[0]] if kernel.args[0] in g.mod.get_global_vars() else None
    if func is None or not func.attrs or KEEP_RATE_ATTR not in func.attrs:
        return None
    rate = float(func.attrs[KEEP_RATE_ATTR])
    seed, site = kernel.args[1].fields
    site = g.scalar(site)
    scaled = g.only_reader(reader.var)
    mul = scaled.value if scaled is not None else None
    if site is None or not (isinstance(mul, relax.Call) and mul.op == MULTIPLY and mul.args[0].same_as(reader.var)):
        return None
    if g.scalar(mul.args[1]) is None or np.float32(g.scalar(mul.args[1])) != np.float32(1.0 / (1.0 - rate)):
        return None
    inner += [keep, reader.var]
    return scaled.var, seed, rate, int(site)


def _context_chain(g: _Graph, pd: relax.Var, shape: tuple, inner: list):
    """``O = reshape(matmul(reshape(broadcast_to(Pd)), reshape(broadcast_to(v))))`` (or a 4-D matmul)
    after `pd`: (v, the output var) or None."""
    x = pd
    while True:
        reader = g.only_reader(x)
        call = reader.value if reader is not None else None
        if not isinstance(call, relax.Call) or not call.args[0].same_as(x):
            return None
        if call.op == MATMUL:
            break
        if call.op not in (RESHAPE, BROADCAST_TO) or (call.op == BROADCAST_TO and not x.same_as(pd)):
            return None
        inner.append(x)
        x = reader.var
    if not x.same_as(pd):
        unbatched = g.unbatched(x)
        if unbatched is None or not unbatched.same_as(pd):
            return None
        inner.append(x)
    v = g.unbatched(call.args[1])
    out = reader.var
    if static_shape(out) is not None and len(static_shape(out)) == 3:
        after = g.only_reader(out)
        if after is None or not (isinstance(after.value, relax.Call) and after.value.op == RESHAPE):
            return None
        inner.append(out)
        out = after.var
    b, h, sq, _ = shape
    if v is None or static_shape(v) is None or static_shape(out) != (b, h, sq, static_shape(v)[3]):
        return None
    return v, out


def find_attention(func: relax.Function, mod: tvm.IRModule, masks: dict | None = None) -> list[Match]:
    """The attention chains of `func` (module docstring) that FuseAttention replaces."""
    g = _Graph(func, mod, {} if masks is None else masks)
    found = []
    for b in g.bindings:
        sm = b.value
        shape = static_shape(b.var)
        if not (isinstance(sm, relax.Call) and sm.op == SOFTMAX and shape and len(shape) == 4
                and int(sm.attrs.axis) in (-1, 3)):
            continue
        inner: list = []
        scores = _scores_chain(g, sm.args[0], shape, inner)
        if scores is None or not isinstance(sm.args[0], relax.Var) or g.only_reader(sm.args[0]) is None:
            continue
        inner.append(sm.args[0])
        q, k, scale, causal, bias = scores
        dropped = _dropout(g, b.var, inner)
        if dropped is None:
            continue
        pd, seed, rate, site = dropped
        inner.append(b.var)
        context = _context_chain(g, pd, shape, inner)
        if context is None:
            continue
        v, out = context
        if not pd.same_as(b.var):
            inner.append(pd)
        qs, ks, vs = static_shape(q), static_shape(k), static_shape(v)
        batch, heads, sq, sk = shape
        dtype = str(q.ty.dtype)
        if (qs is None or ks is None or vs is None or qs[:3] != (batch, heads, sq) or ks[:3] != (batch, heads, sk)
                or vs[:3] != (batch, heads, sk) or not qs[3] == ks[3] == vs[3] or dtype not in attention_op.FLOATS
                or {str(k.ty.dtype), str(v.ty.dtype), str(out.ty.dtype)} != {dtype}):
            continue
        found.append(Match(q, k, v, seed, scale, causal, rate, site, bias, out, tuple(inner)))
    return found


@mutator
class _Fuser(PyExprMutator):
    def __init__(self, mod: tvm.IRModule):
        super().__init__(mod)
        self.out: dict = {}  # output var -> Match
        self.dropped: set = set()

    def prime(self, matches: list[Match]) -> None:
        self.out = {m.out: m for m in matches}
        self.dropped = {v for m in matches for v in m.inner}

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        if binding.var in self.dropped:
            return
        match = self.out.get(binding.var)
        if match is None:
            super().visit_var_binding_(binding)
            return
        call = self.visit_expr(match.call())
        fused = self.builder_.emit(call, "attention")
        self.set_var_remap(binding.var, bind_as(self.builder_, binding.var, relax.TupleGetItem(fused, 0)))


@tvm.transform.module_pass(opt_level=0, name="FuseAttention")
class FuseAttention:
    """Replace each attention core (module docstring) by ``tvm_evt.attention``; ``fused`` counts them.

    `head_dims`: fuse only attention over these head dimensions (None: any); the training pipeline
    passes the flash-attention kernels' (``codegen.backend.flash_attention.HEAD_DIMS``), since a call
    the kernels refuse is decomposed again on CUDA, where the unfused graph would have had its keys
    padded for CUTLASS (PadAttentionKeys)."""

    def __init__(self, head_dims: tuple[int, ...] | None = None):
        self.fused = 0
        self.head_dims = head_dims

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        fuser = _Fuser(mod)
        masks: dict = {}
        changed = False
        for gv, func in mod.functions_items():
            if not isinstance(func, relax.Function) or (func.attrs and "Codegen" in func.attrs):
                continue
            matches = [m for m in find_attention(func, mod, masks)
                       if self.head_dims is None or static_shape(m.q)[3] in self.head_dims]
            if matches:
                fuser.prime(matches)
                fuser.builder_.update_func(gv, fuser.visit_expr(func))
                self.fused += len(matches)
                changed = True
        if not changed:
            return mod
        out = relax.transform.DeadCodeElimination()(fuser.builder_.get())
        return drop_unreferenced(out, lambda f: bool(f.attrs) and KEEP_RATE_ATTR in f.attrs)

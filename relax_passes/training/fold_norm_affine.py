"""FoldNormAffine: a layer norm's scale and shift moved into the weights of the linear layers it feeds.

A training step keeps two [tokens, H] tensors per layer norm ``y = xhat * gamma + beta`` across the
forward: ``x`` (its gradient recomputes ``xhat`` from it) and ``y`` (the weight gradient of each
linear layer ``y @ W`` reads it).  Tempo (NeurIPS'22) keeps ``y`` alone and derives
``xhat = (y - beta) / gamma``, which is wrong where an element of ``gamma`` is zero.  This pass keeps
``xhat`` alone, exactly: over the last axis, with ``W`` [H, N] (or a ``[N, H]`` weight read through
``permute_dims``)::

    y @ W  =  xhat @ (gamma[:, None] * W)  +  sum(beta[:, None] * W, axis=0)

so the layer norm becomes affine-free (``xhat`` is its output, and its gradient reads that output
instead of recomputing it from ``x``: ``gradient_rules.layer_norm_grad``), each matmul that reads
``y`` (directly or through reshapes that keep the last axis) reads ``xhat`` with a scaled weight, and
the weight's gradient, ``gamma``'s and ``beta``'s come out of ``Gradient`` through the weight-sized
ops (``gamma * dW' + beta (x) db``; ``dgamma = sum(W * dW')``).  Under mixed precision the
GEMM reads ``xhat`` rounded to bf16, and `SaveNormalizedLowPrecision` makes the layer norm's gradient
read that copy, so the step keeps it alone (plus ``rstd``) where it kept ``x`` and ``y``.

Only layer norms that matmuls alone read are folded (a pre-LN block: GPT-2, ViT), and only where
each weight is no larger than the normalized tensor: the fold trades that saved tensor for
weight-sized work each step.  A post-LN block's layer norm (BERT) also feeds the residual, so its
forward would write ``xhat`` besides ``y``; on the zoo's BERT-Large layer (16 x 512) that, with the
weight-sized ops, modelled 406 MB more traffic a step (+14 %), so it is left alone.  A constant scale
of ones and shift of zeros (``elementwise_affine=False``) cost nothing to fold.

Off by default (``TVM_EVT_ENABLE=fold_norm``, ``pipeline.OPTIONAL``): on an H200 the zoo's GPT-2 medium
block (bf16, 8 x 1024) kept 16.8 MB less at its peak but took 1.814 against 1.738 ms a step; the
weight-sized kernels (12 more launches) cost more than the bytes saved at that size.  CPU memory plan
of transformers' 24-layer GPT-2 medium at batch 66: 75.5 -> 68.9 GB.
"""
from __future__ import annotations

import numpy as np
import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from .._rewrite import binding_uses, flat_bindings, mutate_relax_functions, static_shape, swaps_last_two

LAYER_NORM = tvm.ir.Op.get("relax.nn.layer_norm")
MATMUL = tvm.ir.Op.get("relax.matmul")
RESHAPE = tvm.ir.Op.get("relax.reshape")
PERMUTE = tvm.ir.Op.get("relax.permute_dims")
ADD = tvm.ir.Op.get("relax.add")


def _last_axis_only(call: relax.Call) -> bool:
    ndim = call.args[0].ty.ndim
    return ndim >= 1 and [int(a) % ndim for a in call.attrs.axes] == [ndim - 1]


def _reads_as_lhs(value, var, width: int) -> bool:
    """Is `value` ``matmul(var, W)`` with a 2-D ``W`` whose first axis has extent `width`?"""
    if not (isinstance(value, relax.Call) and value.op == MATMUL and value.args[0].same_as(var)
            and not value.args[1].same_as(var)):
        return False
    shape = static_shape(value.args[1])
    return shape is not None and len(shape) == 2 and shape[0] == width


def linear_readers(func: relax.Function) -> dict:
    """``{y: (matmuls, reshapes, biased)}`` for each affine layer norm ``y`` of `func` over its last
    axis that only matmuls read, as their left operand (directly, or through reshapes that keep the
    last axis and that only such matmuls read): the matmul bindings' vars, the reshape vars, and
    ``{matmul var: add var}`` for the matmuls whose one reader adds a vector of their output's width
    to them (a linear layer's bias, which then takes the shift)."""
    bindings, _ = flat_bindings(func)
    uses = binding_uses(func)
    bindings_by_var = {b.var: b.value for b in bindings}
    found = {}
    for b in bindings:
        v = b.value
        if not (isinstance(v, relax.Call) and v.op == LAYER_NORM and (v.attrs.scale or v.attrs.center)
                and _last_axis_only(v) and static_shape(b.var) is not None):
            continue
        width = static_shape(b.var)[-1]
        matmuls, reshapes, others = [], [], False  # others: a reader that is not such a matmul
        for i in uses.get(b.var, []):
            reader = bindings[i] if i < len(bindings) else None
            if reader is not None and _reads_as_lhs(reader.value, b.var, width):
                matmuls.append(reader.var)
                continue
            if (reader is not None and isinstance(reader.value, relax.Call) and reader.value.op == RESHAPE
                    and (static_shape(reader.var) or (None,))[-1] == width):
                readers = [bindings[j] if j < len(bindings) else None for j in uses.get(reader.var, [])]
                if readers and all(r is not None and _reads_as_lhs(r.value, reader.var, width) for r in readers):
                    reshapes.append(reader.var)
                    matmuls.extend(r.var for r in readers)
                    continue
            others = True
        # the fold trades the saved [tokens, H] tensor for weight-sized work each step (the scaled
        # weight, the shift, their gradients): only where every weight is no larger than that tensor
        # (not a 30k-word vocabulary head at a few thousand tokens)
        size = _elements(b.var)
        if matmuls and not others and all(_elements(bindings_by_var[m].args[1]) <= size for m in matmuls):
            found[b.var] = (matmuls, reshapes, _bias_adds(bindings, uses, matmuls))
    return found


def _elements(expr) -> int:
    shape = static_shape(expr)
    return int(np.prod(shape)) if shape is not None else 1 << 62


@mutator
class _Folder(PyExprMutator):
    def prime(self, found: dict) -> None:
        """`found`: the function's `linear_readers`."""
        self.found = found
        self.norm = {}  # reshape var or layer-norm var -> (xhat-side value, the layer norm's call)
        self.folded = {m for matmuls, _, _ in found.values() for m in matmuls}
        self.reshapes = {r for _, reshapes, _ in found.values() for r in reshapes}
        self.biased = {m: add for _, _, biased in found.values() for m, add in biased.items()}
        self.shifts = {}  # add var -> the shift its bias takes on

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        var, value = binding.var, binding.value
        if var in self.found:
            self._normalize(var, value)
        elif var in self.reshapes:
            y = value.args[0]
            xhat, ln = self.norm[y]
            self.norm[var] = (self.builder_.emit(relax.op.reshape(xhat, value.args[1])), ln)
        elif var in self.folded:
            out, shift = self._fold(value)
            if var in self.biased and shift is not None:  # the bias takes the shift: add(b + shift, mm)
                self.shifts[self.biased[var]] = shift
            elif shift is not None:
                out = relax.op.add(shift, self.builder_.emit(out))
            self.set_var_remap(var, self.builder_.emit(out))
        elif var in self.shifts:
            a, b = (self.visit_expr(arg) for arg in value.args)
            if a.ty.ndim == 1:
                a = self.builder_.emit(relax.op.add(a, self.shifts[var]))
            else:
                b = self.builder_.emit(relax.op.add(b, self.shifts[var]))
            self.set_var_remap(var, self.builder_.emit(relax.op.add(a, b)))
        else:
            super().visit_var_binding_(binding)

    def _normalize(self, var, ln: relax.Call) -> None:
        x, gamma = self.visit_expr(ln.args[0]), ln.args[1]
        attrs = ln.attrs
        # ones and zeros as its scale and shift: TVM's own legalization of layer_norm applies them
        # whatever ``scale`` / ``center`` say (DecomposeLayerNorm and the gradient honour the flags)
        width, dtype = static_shape(gamma)[0], str(gamma.ty.dtype)
        ones, zeros = (relax.const(np.full([width], v, dtype), dtype) for v in (1, 0))
        xhat = self.builder_.emit(relax.op.nn.layer_norm(x, ones, zeros, attrs.axes, attrs.epsilon,
                                                         center=False, scale=False))
        self.norm[var] = (xhat, ln)

    def _fold(self, matmul: relax.Call) -> tuple:
        """(``xhat @ (gamma * W)``, the shift ``sum(beta * W)`` in the matmul's dtype or None)."""
        xhat, ln = self.norm[matmul.args[0]]
        gamma, beta = (self.visit_expr(a) for a in ln.args[1:])
        weight = self.visit_expr(matmul.args[1])
        emit = self.builder_.emit
        permute = self.lookup_binding(matmul.args[1]) if isinstance(matmul.args[1], relax.Var) else None
        h = static_shape(matmul.args[1])[0]
        if isinstance(permute, relax.Call) and permute.op == PERMUTE and swaps_last_two(permute):
            # W [N, H] read transposed (torch.nn.Linear): scale its columns, keep the transpose outermost
            w, along, width = self.visit_expr(permute.args[0]), [1, h], 1
        else:
            w, along, width = weight, [h, 1], 0
        scale, center = _affine(ln)
        scaled = emit(relax.op.multiply(w, emit(relax.op.reshape(gamma, along)))) if scale else w
        if w is not weight:
            scaled = emit(relax.op.permute_dims(scaled, [1, 0]))
        out = relax.op.matmul(xhat, scaled, out_dtype=matmul.attrs.out_dtype)
        if not center:
            return out, None
        shift = emit(relax.op.sum(emit(relax.op.multiply(w, emit(relax.op.reshape(beta, along)))), [width]))
        if str(shift.ty.dtype) != str(matmul.ty.dtype):
            shift = emit(relax.op.astype(shift, matmul.ty.dtype))
        return out, shift


def _affine(ln: relax.Call) -> tuple[bool, bool]:
    """Does the layer norm scale, and shift?  A constant scale of ones (shift of zeros), as torch's
    ``elementwise_affine=False`` imports, does neither."""
    gamma, beta = ln.args[1:]
    trivial = lambda e, v: isinstance(e, tvm.ir.GenericConst) and bool(np.all(e.value.numpy() == v))
    return bool(ln.attrs.scale) and not trivial(gamma, 1), bool(ln.attrs.center) and not trivial(beta, 0)


def _bias_adds(bindings: list, uses: dict, matmuls: list) -> dict:
    """``{matmul var: add var}`` for the matmuls of `matmuls` whose one reader adds a vector of
    their output's width to them (`bindings`, `uses`: `flat_bindings`, `binding_uses`)."""
    found = {}
    for m in matmuls:
        readers = uses.get(m, [])
        if len(readers) != 1 or readers[0] >= len(bindings):
            continue
        add = bindings[readers[0]]
        if not (isinstance(add.value, relax.Call) and add.value.op == ADD):
            continue
        other = [a for a in add.value.args if not a.same_as(m)]
        width = (static_shape(m) or (None,))[-1]
        if len(other) == 1 and static_shape(other[0]) == (width,) and str(other[0].ty.dtype) == str(m.ty.dtype):
            found[m] = add.var
    return found


@tvm.transform.module_pass(opt_level=0, name="FoldNormAffine")
class FoldNormAffine:
    """Move the scale and shift of every layer norm that feeds matmuls into those matmuls' weights."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        found = {gv: linear_readers(f) for gv, f in mod.functions_items() if isinstance(f, relax.Function)}
        if not any(found.values()):
            return mod
        by_func = {mod[gv]: readers for gv, readers in found.items()}
        folder = _Folder(mod)
        mod = mutate_relax_functions(folder, mod, before_each=lambda f: folder.prime(by_func[f]))
        return relax.transform.DeadCodeElimination()(relax.transform.CanonicalizeBindings()(mod))

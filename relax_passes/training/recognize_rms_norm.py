"""RecognizeRMSNorm: an RMS norm a model writes out as elementwise ops and a mean becomes the op.

transformers' ``LlamaRMSNorm`` (and Mistral's, Qwen2's, Gemma's, T5's layer norm) writes
``w * (x * rsqrt(mean(x * x, -1) + eps))``.  Differentiated as written, the backward is the
product rule through each op: on the CUDA route four or five kernels a norm over [tokens, hidden]
float32 blocks (Llama 4 × 4096 at 8192 tokens: about 1.3 GB of modelled traffic a norm, nine
norms).  As ``relax.nn.rms_norm(x, w)`` the gradient is `gradient_rules.rms_norm_grad`'s, which
``DecomposeLayerNorm`` and ``FuseLayerNormBackward`` make one row kernel, as they do a layer norm's.

Matched by structure, over one dataflow block, with every intermediate read only inside the
pattern (``ExpandSmallPower`` has made ``power(x, 2)`` a product first)::

    s = x * x;  m = mean(s, axis=[-1], keepdims=True);  v = m + eps   (eps a scalar constant)
    r = rsqrt(v);  n = x * r;  y = w * n                              (w a vector over the last axis)
  ->
    y = rms_norm(x, w, axes=[-1], epsilon=eps)

A norm without a weight (``n`` read by something other than such a product) becomes
``rms_norm(x, ones)``.  Operand order does not matter; aliases (``lv35 = lv_1``) are seen
through.  Runs before ``Gradient``, on imported graphs.
"""
from __future__ import annotations

import numpy as np
import tvm
from tvm import relax

from .._rewrite import bound_call, replace_bindings, resolve_alias, scalar_value, static_shape

MULTIPLY, MEAN, ADD, RSQRT = (tvm.ir.Op.get(f"relax.{name}") for name in ("multiply", "mean", "add", "rsqrt"))


class _Block:
    """The RMS norms of one dataflow block: ``{var replaced: (x, w or None, eps)}``."""

    def __init__(self, block: relax.DataflowBlock):
        bindings = [b for b in block.bindings if isinstance(b, relax.VarBinding)]
        self.bound = {b.var: b.value for b in bindings}
        self.readers: dict = {}
        for b in bindings:
            for arg in relax.analysis.free_vars(b.value):
                self.readers.setdefault(arg, []).append(b.var)

    def resolve(self, expr):
        """`expr` seen through aliases (``a = b``)."""
        return resolve_alias(self.bound, expr)

    def call(self, var, op):
        return bound_call(self.bound, var, op)

    def only_reader(self, var, reader) -> bool:
        """`var` (and its aliases) is read by `reader` alone."""
        pending, seen = [var], set()
        while pending:
            v = pending.pop()
            for r in self.readers.get(v, []):
                if r.same_as(reader):
                    continue
                if isinstance(self.bound.get(r), relax.Var):  # an alias: its readers count
                    if r not in seen:
                        seen.add(r)
                        pending.append(r)
                    continue
                return False
        return True

    def matches(self) -> dict:
        found = {}
        for r, value in self.bound.items():
            if not (isinstance(value, relax.Call) and value.op == RSQRT):
                continue
            add = self.call(value.args[0], ADD)
            if add is None:
                continue
            m, eps = add.args if scalar_value({}, add.args[1]) is not None else add.args[::-1]
            mean, eps_value = self.call(m, MEAN), scalar_value({}, eps)
            if mean is None or eps_value is None or not mean.attrs.keepdims:
                continue
            square = self.call(mean.args[0], MULTIPLY)
            if square is None:
                continue
            x = self.resolve(square.args[0])
            shape = static_shape(x)
            if not x.same_as(self.resolve(square.args[1])) or shape is None or static_shape(r) != (*shape[:-1], 1):
                continue
            axes = [int(a) for a in mean.attrs.axis] if mean.attrs.axis is not None else []
            if [a % len(shape) for a in axes] != [len(shape) - 1]:
                continue
            # the normalized value: the one reader of r, x * r
            readers = self.readers.get(r, [])
            if len(readers) != 1:
                continue
            n = readers[0]
            norm = self.call(n, MULTIPLY)
            if norm is None or {self.resolve(a) for a in norm.args} != {x, r}:
                continue
            v, m, s = self.resolve(value.args[0]), self.resolve(m), self.resolve(mean.args[0])
            if not (self.only_reader(v, r) and self.only_reader(m, v) and self.only_reader(s, m)):
                continue  # an intermediate read outside the pattern
            weight, y = None, n
            n_readers = self.readers.get(n, [])
            scaled = self.call(n_readers[0], MULTIPLY) if len(n_readers) == 1 else None
            if scaled is not None:
                other = [a for a in scaled.args if not self.resolve(a).same_as(n)]
                if len(other) == 1 and static_shape(other[0]) == (shape[-1],) \
                        and str(other[0].ty.dtype) == str(x.ty.dtype):
                    weight, y = other[0], n_readers[0]
            found[y] = (x, weight, float(eps_value))
        return found


def _replacements(block: relax.DataflowBlock) -> dict:
    def build(x, weight, eps):
        def make(visit):
            data = visit(x)
            dtype = str(data.ty.dtype)
            w = relax.const(np.ones(static_shape(data)[-1], dtype=dtype), dtype) if weight is None else visit(weight)
            return relax.op.nn.rms_norm(data, w, axes=[-1], epsilon=eps)
        return make

    return {var: build(*match) for var, match in _Block(block).matches().items()}


@tvm.transform.module_pass(opt_level=0, name="RecognizeRMSNorm")
class RecognizeRMSNorm:
    """Replace written-out RMS norms by ``relax.nn.rms_norm`` in every Relax function and drop the
    intermediates nothing else reads (see the module docstring)."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        return replace_bindings(mod, _replacements)

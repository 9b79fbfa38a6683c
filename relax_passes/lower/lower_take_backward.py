"""LowerTakeBackward: the embedding gradient as a parallel scatter-add for CUDA.

``relax.grad.take_backward(g, x, indices, axis)`` (what ``take``'s gradient rule emits: the
gradient of an embedding lookup) legalizes in TVM 0.27 to one opaque serial loop that no DLight
rule can schedule, so it ran on a single GPU thread: for XML-CNN's 16,000 tokens x 300 features
that is 4.8 M dependent read-modify-writes per step.  Here it becomes a two-kernel PrimFunc,
already scheduled: a float32 buffer is zeroed, then one thread per gradient element adds it into
row ``indices[t]`` with ``atomicAdd``; a cast back to ``x``'s dtype follows when that is not
float32, so 16-bit gradients accumulate in float32.  Out-of-range indices add nothing (TVM's
``take`` in fast mode assumes them in range; the gradient never writes outside the table).

The order of the float32 additions varies from run to run (atomics), like PyTorch's CUDA
``embedding_dense_backward`` outside deterministic mode.  CUDA only: the pass is part of the
evt pipeline's CUDA phase; on CPUs TVM's serial kernel is fine.
"""

from __future__ import annotations

import math

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator
from tvm.script import tirx as T

from .._rewrite import add_function_once, mutate_relax_functions, static_shape

TAKE_BACKWARD = tvm.ir.Op.get("relax.grad.take_backward")
THREADS = 256
ACC_DTYPE = "float32"


def scatter_add_primfunc(outer: int, rows: int, inner: int, n: int, grad_dtype: str, index_dtype: str):
    """``out (outer, rows, inner) float32 = 0; out[o, indices[t], i] += grad[o, t, i]``, as two
    CUDA kernels (zero fill; one atomic add per gradient element)."""
    out_numel, grad_numel = outer * rows * inner, outer * n * inner
    idx = "int64" if max(out_numel, grad_numel) >= 2**31 - THREADS else "int32"

    def blocks(numel: int) -> int:
        return math.ceil(numel / THREADS)

    @T.prim_func(private=True)
    def scatter_add(grad: T.Buffer((outer, n, inner), grad_dtype), indices: T.Buffer((n,), index_dtype),
                    out: T.Buffer((outer, rows, inner), ACC_DTYPE)):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True})
        for bx in T.thread_binding(T.Cast(idx, blocks(out_numel)), thread="blockIdx.x"):
            for tx in T.thread_binding(T.Cast(idx, THREADS), thread="threadIdx.x"):
                e = bx * THREADS + tx
                if e < out_numel:
                    out[e // (rows * inner), e // inner % rows, e % inner] = T.float32(0)
        for bx in T.thread_binding(T.Cast(idx, blocks(grad_numel)), thread="blockIdx.x"):
            for tx in T.thread_binding(T.Cast(idx, THREADS), thread="threadIdx.x"):
                e = bx * THREADS + tx
                if e < grad_numel:
                    row = indices[e // inner % n]
                    if 0 <= row and row < rows:
                        T.evaluate(T.call_intrin(
                            "float32", "tirx.cuda.atomic_add",
                            T.address_of(out[e // (n * inner), row, e % inner]),
                            T.Cast("float32", grad[e // (n * inner), e // inner % n, e % inner])))

    return scatter_add


@mutator
class _Lowerer(PyExprMutator):
    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if call.op != TAKE_BACKWARD:
            return call
        grad, x, indices = call.args[:3]
        gshape, xshape, ishape = static_shape(grad), static_shape(x), static_shape(indices)
        if gshape is None or xshape is None or ishape is None or len(ishape) != 1:
            return call  # symbolic or N-d indices: TVM's kernel
        axis = int(call.attrs.axis) % len(xshape)
        outer, inner = math.prod(xshape[:axis]), math.prod(xshape[axis + 1:])
        rows, n = xshape[axis], ishape[0]
        gdtype, idtype, dtype = str(grad.ty.dtype), str(indices.ty.dtype), str(x.ty.dtype)
        name = f"scatter_add_{outer}x{rows}x{inner}_n{n}_{gdtype}_{idtype}"
        gvar = add_function_once(self.builder_, name,
                                 lambda: scatter_add_primfunc(outer, rows, inner, n, gdtype, idtype))
        flat = self.builder_.emit(relax.op.reshape(grad, (outer, n, inner)))
        summed = self.builder_.emit(
            relax.call_tir(gvar, [flat, indices], relax.TensorType((outer, rows, inner), "float32")))
        out = self.builder_.emit(relax.op.reshape(summed, xshape))
        return out if dtype == "float32" else relax.op.astype(out, dtype)



@tvm.transform.module_pass(opt_level=0, name="LowerTakeBackward")
class LowerTakeBackward:
    """Rewrite static-shape ``take_backward`` calls into the atomic scatter-add (CUDA targets)."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        return mutate_relax_functions(_Lowerer(mod), mod)

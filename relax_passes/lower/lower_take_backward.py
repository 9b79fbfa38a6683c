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


def scatter_add_primfunc(outer: int, rows: int, inner: int, n: int, grad_dtype: str, index_dtype: str,
                         out_shape: tuple | None = None):
    """``out (outer, rows, inner) float32 = 0; out[o, indices[t], i] += grad[o, t, i]``, as two
    CUDA kernels (zero fill; one atomic add per gradient element).  `out_shape`: the output's
    shape (the table's, by default ``(outer, rows, inner)``), addressed as that flat row-major
    layout: the gradient comes out in its parameter's shape, with no reshape after it (a step's
    gradients are block outputs, where a reshape is a copy: Llama's 32000 x 4096 float32 table,
    1.05 GB of traffic a step)."""
    out_numel, grad_numel = outer * rows * inner, outer * n * inner
    out_shape = tuple(out_shape) if out_shape is not None else (outer, rows, inner)
    if math.prod(out_shape) != out_numel:
        raise ValueError(f"scatter_add: out_shape {list(out_shape)} does not hold {outer} x {rows} x {inner} elements")
    idx = "int64" if max(out_numel, grad_numel) >= 2**31 - THREADS else "int32"

    def blocks(numel: int) -> int:
        return math.ceil(numel / THREADS)

    @T.prim_func(private=True)
    def scatter_add(grad: T.Buffer((outer, n, inner), grad_dtype), indices: T.Buffer((n,), index_dtype),
                    out: T.Buffer(out_shape, ACC_DTYPE)):
        T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True})
        flat = T.decl_buffer((out_numel,), ACC_DTYPE, data=out.data)
        for bx in T.thread_binding(T.Cast(idx, blocks(out_numel)), thread="blockIdx.x"):
            for tx in T.thread_binding(T.Cast(idx, THREADS), thread="threadIdx.x"):
                e = bx * THREADS + tx
                if e < out_numel:
                    flat[e] = T.float32(0)
        for bx in T.thread_binding(T.Cast(idx, blocks(grad_numel)), thread="blockIdx.x"):
            for tx in T.thread_binding(T.Cast(idx, THREADS), thread="threadIdx.x"):
                e = bx * THREADS + tx
                if e < grad_numel:
                    row = indices[e // inner % n]
                    if 0 <= row and row < rows:
                        T.evaluate(T.call_intrin(
                            "float32", "tirx.cuda.atomic_add",
                            T.address_of(flat[(e // (n * inner) * rows + row) * inner + e % inner]),
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
        name = f"scatter_add_{'x'.join(map(str, xshape))}_axis{axis}_n{n}_{gdtype}_{idtype}"
        gvar = add_function_once(self.builder_, name,
                                 lambda: scatter_add_primfunc(outer, rows, inner, n, gdtype, idtype, xshape))
        flat = self.builder_.emit(relax.op.reshape(grad, (outer, n, inner)))
        summed = relax.call_tir(gvar, [flat, indices], relax.TensorType(list(xshape), "float32"))
        return summed if dtype == "float32" else relax.op.astype(self.builder_.emit(summed), dtype)



@tvm.transform.module_pass(opt_level=0, name="LowerTakeBackward")
class LowerTakeBackward:
    """Rewrite static-shape ``take_backward`` calls into the atomic scatter-add (CUDA targets)."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        return mutate_relax_functions(_Lowerer(mod), mod)

"""SplitMatmulReduction: a GEMM with a long reduction and few output tiles as a batch of K slices.

A weight gradient reduces over every row of a batch (``dW = dYᵀ X``: ResNet-50's 1x1 convolutions
over 128·56·56 = 401408 pixels into a 64 x 256 output).  One GEMM has a handful of output tiles
for 132 SMs; CUTLASS's stream-K and split-K share each tile between CTAs but pass the partial
tiles through a workspace under one lock per tile, so the CTAs of a tile queue for it, and the
GEMM moved its operands at 1.7 TB/s where cuBLAS reached 3.4 (H200, 2026-12-01).  Here, on the
CUDA route before the partitioner, such a matmul becomes

    y = A[M, K] @ B[K, N]   ->   P = A_s[S, M, K/S] @ B_s[S, K/S, N]  (float32)
                                 y = sum(P, axis=0)  (cast to y's dtype)

with ``A_s``, ``B_s`` views of the stored operands (a reshape of K into S contiguous slices, under
the operand's transposes), so the S x tiles CTAs of one batched GEMM each write their own float32
partial tile and a TVM reduction sums the S partials (a thread per output element: 1-5 us in
ResNet-50's step).  The slices count and the batch's tile are the codegen's choice
(``codegen.select.k_slices`` and ``slice_tile``: K at least 4096 over output tiles that fill at
most half a wave, slices of at least 2048 that with the tiles fill at most one wave).  The sum is in float32
whatever the GEMM's output dtype; the result is cast to that dtype, as the GEMM rounds its own,
except where it is only ever widened to float32 again, in its block (a bf16 weight gradient for
float32 master weights): those readers get the float32 sum, unrounded.  (TVM fuses no elementwise reader into a
reduction, so the round trip would cost a kernel of its own.)

A matmul is split only when the codegen takes the sliced one as a lone GEMM (views folded): one
it would refuse is left whole.
"""
from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from .._rewrite import bind_as, binding_uses, dtype_of, flat_bindings, mutate_step_functions, static_shape
from .pad_unaligned_matmuls import MATMUL, lone_gemm, view_of

ASTYPE = tvm.ir.Op.get("relax.astype")


def _slices_of_a(stored: relax.Expr, axes: list[int] | None, m: int, k: int, s: int) -> relax.Expr:
    """A[M, K] as [S, M, K/S]: from A itself (K contiguous) or from the stored Aᵀ[K, M]."""
    if axes is None:
        return relax.op.permute_dims(relax.op.reshape(stored, (m, s, k // s)), [1, 0, 2])
    return relax.op.permute_dims(relax.op.reshape(stored, (s, k // s, m)), [0, 2, 1])


def _slices_of_b(stored: relax.Expr, axes: list[int] | None, k: int, n: int, s: int) -> relax.Expr:
    """B[K, N] as [S, K/S, N]: from B itself or from the stored Bᵀ[N, K]."""
    if axes is None:
        return relax.op.reshape(stored, (s, k // s, n))
    return relax.op.permute_dims(relax.op.reshape(stored, (n, s, k // s)), [1, 2, 0])


def _sliced(a: tuple, b: tuple, m: int, n: int, k: int, s: int) -> relax.Expr:
    """The batched matmul of the slices of `a` and `b` ((stored, axes) each), float32 out."""
    return relax.op.matmul(_slices_of_a(*a, m, k, s), _slices_of_b(*b, k, n, s), out_dtype="float32")


def _legal(a: tuple, b: tuple, m: int, n: int, k: int, s: int) -> bool:
    """Does the codegen take the sliced matmul, its views folded, as a lone GEMM?"""
    from ...codegen.legality import legality

    types = [relax.TensorType(static_shape(stored), dtype_of(stored)) for stored, _ in (a, b)]
    return legality(lone_gemm(types, lambda _bb, p: _sliced((p[0], a[1]), (p[1], b[1]), m, n, k, s))).ok


def plan(call: relax.Call, bound: dict, num_sms: int) -> tuple | None:
    """(slices, A view, B view) for matmul `call`, or None to keep it one GEMM."""
    from ...codegen import select

    a, b = call.args
    a_shape, b_shape = static_shape(a), static_shape(b)
    if a_shape is None or b_shape is None or len(a_shape) != 2 or len(b_shape) != 2:
        return None
    if dtype_of(a) != dtype_of(b):
        return None
    (m, k), n = a_shape, b_shape[1]
    slices = select.k_slices(m, n, k, dtype_of(a), num_sms)
    if slices == 1:
        return None
    a_view, b_view = view_of(bound, a), view_of(bound, b)
    if any(axes not in (None, [1, 0]) for _, axes in (a_view, b_view)):
        return None
    if not _legal(a_view, b_view, m, n, k, slices):
        return None
    return slices, a_view, b_view


def _is_cast_to_float32(value) -> bool:
    return isinstance(value, relax.Call) and value.op == ASTYPE and str(value.attrs.dtype) == "float32"


@mutator
class _Splitter(PyExprMutator):
    def __init__(self, mod: tvm.IRModule, num_sms: int):
        super().__init__(mod)
        self.num_sms = num_sms
        self.bound: dict = {}
        self.widened: set = set()  # vars only ever cast to float32, in their own dataflow block
        self.sums: dict = {}  # such a split matmul's var -> the float32 sum of its slices (var or call)

    def prime(self, func: relax.Function) -> None:
        bindings, block_of = flat_bindings(func)
        self.bound = {b.var: b.value for b in bindings}
        self.widened = {
            var for var, uses in binding_uses(func).items() if block_of.get(var) is not None and all(
                i < len(bindings) and _is_cast_to_float32(bindings[i].value) and block_of[bindings[i].var] == block_of[var]
                for i in uses)}

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        call = binding.value
        if _is_cast_to_float32(call) and call.args[0] in self.sums:
            # the GEMM's output only widened (a weight gradient for float32 master weights): the
            # float32 sum itself, without the round trip through the GEMM's dtype
            total = self.sums[call.args[0]] = bind_as(self.builder_, binding.var, self.sums[call.args[0]])
            self.set_var_remap(binding.var, total)
            return
        found = plan(call, self.bound, self.num_sms) if isinstance(call, relax.Call) and call.op == MATMUL else None
        if found is None:
            super().visit_var_binding_(binding)
            return
        slices, (a, a_axes), (b, b_axes) = found
        (m, k), n = static_shape(call.args[0]), static_shape(call.args[1])[1]
        partials = self.builder_.emit(_sliced((self.visit_expr(a), a_axes), (self.visit_expr(b), b_axes),
                                              m, n, k, slices))
        total = relax.op.sum(partials, axis=[0])
        if dtype_of(binding.var) != "float32" and binding.var in self.widened:
            self.sums[binding.var] = total  # bound by the first cast that reads it
            return
        if dtype_of(binding.var) != "float32":
            total = relax.op.astype(self.builder_.emit(total), dtype_of(binding.var))
        self.set_var_remap(binding.var, bind_as(self.builder_, binding.var, total))


@tvm.transform.module_pass(opt_level=0, name="SplitMatmulReduction")
class SplitMatmulReduction:
    """Long-K matmuls over few output tiles as a batch of K slices and a sum (module docstring);
    `functions`: the Relax functions to rewrite (default: every one that is not a partition or kernel)."""

    def __init__(self, functions: tuple[str, ...] | None = None, num_sms: int | None = None):
        from ...codegen import select

        self.functions = functions
        self.num_sms = num_sms or select.H100_SMS

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        splitter = _Splitter(mod, self.num_sms)
        return mutate_step_functions(splitter, mod, self.functions, splitter.prime)

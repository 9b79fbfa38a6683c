"""PadUnalignedMatmuls: matmuls whose row strides TMA cannot take, zero-padded so CUTLASS runs them.

The SM90 kernels load A and B and store D through TMA, which needs every global stride to be a
multiple of 16 bytes: the contiguous extent of A, of B and of the output must be a multiple of 8
bf16/fp16 elements (4 float32).  A vocabulary of 50257 (logits [T, 50257] and the two gradient
GEMMs reading them), 30522 (a multiple of 2 only), 100 classes or an im2col contraction of
3·7·7 = 147 otherwise leave the largest GEMMs of a step to TVM's generic kernels.  Before the
partitioner, on the CUDA route, this pass pads the offending extent of each such ``relax.matmul``
(views of the output as ``A[.., M, K] @ B[.., K, N]``) to the next multiple of 16 bytes:

    contraction K, contiguous in A or B    A' = pad(A, K), B' = pad(B, K)      matmul(A', B')
    N (the output's row; B's if N-major)   B' = pad(B, N)                      matmul(A, B')[.., :N]
    M of an M-major A (A = Xᵀ)             A' = pad(A, M)                      matmul(A', B)[.., :M, :]

with zeros: the padded products add 0 to K's sums, and the padded rows and columns of the output
are sliced away (``strided_slice``), so the result is the same tensor.  A ``permute_dims`` operand
(a K-major weight ``Wᵀ``, the ``dYᵀ`` of a weight gradient, through a chain of them) is padded on
its underlying tensor, on the axis the view's axis comes from, and viewed again: the main loop
still folds the transpose into its strides.  A tensor is padded once per axis (or set of axes)
and block, however many matmuls read it (a language-model head's output gradient feeds both its
input's and its weight's gradient; its weight, the forward and the input gradient).

The pads are copies of their operand, cheap where TVM's FuseOps fuses them into an elementwise
producer (a cast, the loss gradient's subtraction): the producer then writes the padded tensor
instead.  The extent is padded to 16 bytes and no further: TMA zero-fills the out-of-bounds part
of a CTA tile by itself, so padding to the tile (64 or 128) would only add bytes.

A matmul is padded only when the codegen (``tvm_evt.codegen.legality``) refuses it as a lone
GEMM with its operand views folded, and accepts the padded one: one refused for another reason
(a 1-D operand, an M-major float32 A, a dtype pair CUTLASS lacks, symbolic shapes) is left as it
is, and the partitioner lists it with its reason in ``report()["unfused_matmuls"]``.  A padded
output's consumers read the slice, so they stay out of the GEMM's epilogue (TVM fuses the slice
into them).  Where the partitioner could run the GEMM unpadded through a transposed copy of the
operand (an M-major A: the weight gradient ``dYᵀ X``), the pad is taken only where that operand
is larger than the output (more tokens than features): the copy would move more bytes than the
epilogue saves.
"""
from __future__ import annotations

import itertools
import math

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from .._rewrite import bind_as, dtype_of, flat_bindings, mutate_step_functions, permute_axes, static_shape
from .partition_evt import COMPOSITE_NAME

ALIGN_BYTES = 16  # what TMA needs of every global stride
MATMUL = tvm.ir.Op.get("relax.matmul")
PERMUTE = tvm.ir.Op.get("relax.permute_dims")


def alignment(dtype: str) -> int:
    """Elements of `dtype` in ``ALIGN_BYTES``."""
    return ALIGN_BYTES * 8 // tvm.DataType(dtype).bits


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def view_of(bound: dict, expr: relax.Expr) -> tuple[relax.Expr, list[int] | None]:
    """(stored tensor, axes) with ``expr == permute_dims(stored, axes)`` through the chain of
    ``permute_dims`` bindings (`bound`: var -> value) that makes `expr`; axes None: `expr` itself."""
    axes = None
    while isinstance(expr, relax.Var) and isinstance(bound.get(expr), relax.Call) and bound[expr].op == PERMUTE:
        call = bound[expr]
        inner = permute_axes(call)
        axes = inner if axes is None else [inner[a] for a in axes]  # view axis i = stored axis inner[axes[i]]
        expr = call.args[0]
    if axes is not None and axes == list(range(len(axes))):
        axes = None
    return expr, axes


def _contiguous_axis(axes: list[int] | None, ndim: int) -> int:
    """The view axis that is contiguous in memory (the one the stored tensor's last axis became)."""
    return ndim - 1 if axes is None else axes.index(ndim - 1)


def _swap_last(ndim: int) -> list[int]:
    return list(range(ndim - 2)) + [ndim - 1, ndim - 2]


def _forms(view: list[int], stored: list[int], axes: list[int] | None, copies: bool) -> list:
    """How the partitioner may give the codegen an operand of shape `view`, stored as `stored`
    viewed through `axes`: ((param shape, axes of the view inside) ...), its views folded first;
    with `copies`, also materialised by TVM, and copied transposed (``_find_transposes``)."""
    forms = [(stored, axes)]
    if copies:
        swap = _swap_last(len(view))
        forms += [(view, None), ([view[a] for a in swap], swap)]
    return forms


def lone_gemm(param_types: list, build) -> relax.Function:
    """A partition function as the partitioner would hand one GEMM to the codegen: parameters of
    `param_types`, body ``build(bb, params)`` (the GEMM over views of them) as its output; ask
    ``codegen.legality`` whether the codegen takes it."""
    bb = relax.BlockBuilder()
    params = [relax.Var(f"in{k}", ty) for k, ty in enumerate(param_types)]
    with bb.function("evt_check", params, attrs={"Composite": COMPOSITE_NAME}):
        with bb.dataflow():
            out = bb.emit_output(build(bb, params))
        bb.emit_func_output(out)
    return bb.get()["evt_check"]


def _gemm_legal(call: relax.Call, operands: list, out_dtype: str) -> bool:
    """Does the codegen take ``call`` as a lone GEMM reading one of the forms of each operand
    (`operands`: a list of ``_forms`` each)?"""
    from ...codegen.legality import legality

    def build(bb, params, forms):
        args = [bb.emit(relax.op.permute_dims(p, axes)) if axes is not None else p
                for p, (_, axes) in zip(params, forms)]
        return relax.Call(call.op, args, call.attrs, call.ty_args)

    for forms in itertools.product(*operands):
        types = [relax.TensorType(stored, dtype_of(call.args[k])) for k, (stored, _) in enumerate(forms)]
        func = lone_gemm(types, lambda bb, params: build(bb, params, forms))
        if str(func.ret_ty.dtype) == out_dtype and legality(func).ok:
            return True
    return False


class _Plan:
    """What to pad of one matmul: {view axis: padded extent} per operand, and the output's
    real extents on the axes it was padded ({output axis: extent})."""

    def __init__(self, a_pads: dict, b_pads: dict, out_slice: dict):
        self.a_pads, self.b_pads, self.out_slice = a_pads, b_pads, out_slice


def _bytes(shape, dtype: str) -> int:
    return math.prod(shape) * tvm.DataType(dtype).bits // 8


def plan(call: relax.Call, out: relax.Expr, bound: dict) -> _Plan | None:
    """The padding that makes matmul `call` (bound to `out`) a GEMM the codegen takes, else None
    (aligned already, refused for another reason, or better copied by the partitioner)."""
    a, b = call.args
    shapes = [static_shape(a), static_shape(b), static_shape(out)]
    if any(s is None or len(s) < 2 for s in shapes):
        return None
    (a_shape, b_shape, out_shape), out_dtype = shapes, dtype_of(out)
    (_, a_axes), (_, b_axes) = view_of(bound, a), view_of(bound, b)
    a_contig = _contiguous_axis(a_axes, len(a_shape)) - len(a_shape)  # -1: K-major, -2: M-major
    b_contig = _contiguous_axis(b_axes, len(b_shape)) - len(b_shape)  # -2: K-major, -1: N-major
    align = max(alignment(dtype_of(a)), alignment(dtype_of(b)), alignment(out_dtype))
    m, k, n = a_shape[-2], a_shape[-1], b_shape[-1]
    a_pads, b_pads, out_slice = {}, {}, {}
    if k % alignment(dtype_of(a)) and a_contig == -1 or k % alignment(dtype_of(b)) and b_contig == -2:
        a_pads[-1] = b_pads[-2] = _round_up(k, align)
    if n % alignment(out_dtype) or n % alignment(dtype_of(b)) and b_contig == -1:
        b_pads[-1] = _round_up(n, align)
        out_slice[-1] = n
    if m % alignment(dtype_of(a)) and a_contig == -2:
        a_pads[-2] = _round_up(m, align)
        out_slice[-2] = m
    if not (a_pads or b_pads):
        return None

    def forms(shape, axes, pads, copies=False):
        view = list(shape)
        for axis, extent in pads.items():
            view[axis] = extent
        stored = view if axes is None else [view[axes.index(i)] for i in range(len(view))]
        return _forms(view, stored, axes, copies)

    padded = [forms(a_shape, a_axes, a_pads), forms(b_shape, b_axes, b_pads)]
    if _gemm_legal(call, [forms(a_shape, a_axes, {}), forms(b_shape, b_axes, {})], out_dtype) \
            or not _gemm_legal(call, padded, out_dtype):
        return None
    if out_slice:
        # its consumers read the slice, outside this GEMM's epilogue: where the partitioner can
        # copy the operand instead (transposed), pad only when that copy moves more bytes
        copied = (_bytes(a_shape, dtype_of(a)) if -2 in a_pads else 0) + (_bytes(b_shape, dtype_of(b)) if -1 in b_pads else 0)
        unpadded = [forms(a_shape, a_axes, {}, copies=True), forms(b_shape, b_axes, {}, copies=True)]
        if copied <= _bytes(out_shape, out_dtype) and _gemm_legal(call, unpadded, out_dtype):
            return None
    return _Plan(a_pads, b_pads, out_slice)


@mutator
class _Padder(PyExprMutator):
    def __init__(self, mod: tvm.IRModule):
        super().__init__(mod)
        self.bound: dict = {}  # var -> value, of the function being visited
        self.pads: dict = {}  # (stored tensor, ((axis, extent), ...)) -> its padded var, this block's
        self.views: dict = {}  # (padded var, axes) -> permute_dims of it, this block's

    def prime(self, func: relax.Function) -> None:
        self.bound = {b.var: b.value for b in flat_bindings(func)[0]}

    def visit_binding_block_(self, block):
        self.pads, self.views = {}, {}  # a dataflow var lives in its block only
        return super().visit_binding_block_(block)

    def visit_dataflow_block_(self, block):
        self.pads, self.views = {}, {}
        return super().visit_dataflow_block_(block)

    def _operand(self, expr: relax.Expr, pads: dict) -> relax.Expr:
        """`expr` (a matmul operand) with its view axes `pads` ({axis: extent}) zero-padded: its
        stored tensor padded on the axes they come from (memoised), viewed as `expr` views it."""
        if not pads:
            return self.visit_expr(expr)
        stored, axes = view_of(self.bound, expr)
        ndim = len(static_shape(expr))
        widths = tuple(sorted(((axes[a % ndim] if axes else a % ndim), e) for a, e in pads.items()))
        if (stored, widths) not in self.pads:
            value = self.visit_expr(stored)
            shape = static_shape(value)
            width = [0] * (2 * ndim)
            for axis, extent in widths:
                width[2 * axis + 1] = extent - shape[axis]
            self.pads[(stored, widths)] = self.builder_.emit(relax.op.nn.pad(value, width))
        value = self.pads[(stored, widths)]
        if axes is None:
            return value
        if (value, tuple(axes)) not in self.views:
            self.views[(value, tuple(axes))] = self.builder_.emit(relax.op.permute_dims(value, axes))
        return self.views[(value, tuple(axes))]

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        call = binding.value
        found = plan(call, binding.var, self.bound) if isinstance(call, relax.Call) and call.op == MATMUL else None
        if found is None:
            super().visit_var_binding_(binding)
            return
        a = self._operand(call.args[0], found.a_pads)
        b = self._operand(call.args[1], found.b_pads)
        result = relax.Call(call.op, [a, b], call.attrs, call.ty_args)
        if found.out_slice:
            ndim = len(static_shape(binding.var))
            axes = sorted(a % ndim for a in found.out_slice)
            result = relax.op.strided_slice(self.builder_.emit(result), axes, [0] * len(axes),
                                            [found.out_slice[a - ndim] for a in axes])
        self.set_var_remap(binding.var, bind_as(self.builder_, binding.var, result))


@tvm.transform.module_pass(opt_level=0, name="PadUnalignedMatmuls")
class PadUnalignedMatmuls:
    """Zero-pad the extents of matmuls that TMA cannot stride over (module docstring); `functions`:
    the Relax functions to rewrite (default: every one that is not a partition or kernel)."""

    def __init__(self, functions: tuple[str, ...] | None = None):
        self.functions = functions

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        padder = _Padder(mod)
        return mutate_step_functions(padder, mod, self.functions, padder.prime)

"""ScheduleTIRForGPU: DLight's default GPU schedules, applied rule by rule per function.

Functions that bring their own GPU form (``OWN_GPU_FORMS``: the dropout masks, one thread per
Philox draw; the optimizer update, one kernel for every parameter; a batch norm's column moments,
one pass over its input; an in-place step's write-back of its small state, one kernel; a depthwise
convolution's direct kernels) take it.  With ``vectorize``, injective kernels with a contiguous innermost
axis go to our ``VectorizedElementwise`` rule first (16-byte vectors; DLight's Fallback maps one
element to a thread), those that read an operand transposed to ``TiledTranspose`` (through
shared-memory tiles), column sums, maxima and minima to ``ColumnReduction`` (a vector of columns a
thread) and row ones to ``RowReduction`` (a block a row, vector loads; DLight's rules take no max,
which ``Fallback`` gave one thread a row).  ``dl.ApplyDefaultSchedule(Matmul, GEMV, Reduction, GeneralReduction,
Fallback)`` stops the whole build when a rule raises on one function (TVM 0.27's Reduction rule
trips an rfactor check on some fused reductions of training graphs).  Here every unscheduled
PrimFunc is tried with each rule in that order, alone; a rule that raises or declines hands the
function to the next one, and ``Fallback`` schedules anything left that has block iterators.  A
schedule with a reduction that TVM's ``LowerCrossThreadReduction`` would refuse at build time
(``cross_thread_reduction_lowers``: DLight's Reduction rule on a grouped convolution) is passed
over the same way.  A function that launches its own threads (TVM's CUDA scatter) is kept as written.  A
function without a reduction block skips the rules that need one (``_reduction_rules``), which
would each analyse it only to decline (ResNet-50's step: 13.8 -> 7.9 s, the same schedules).
What even ``Fallback`` cannot take — TVM's own opaque serial kernels such as ``take_backward``
(which the evt pipeline replaces beforehand: ``LowerTakeBackward``) — runs as written on a
single GPU thread: correct, slow, and reported with a warning.

Whatever rule schedules a function, its vectorized loops that read or write bool buffers are
unrolled instead (``scalar_bool_access``): TVM 0.27's CUDA codegen has no ``boolxN`` type and
loads two bools as a ``ushort2``, four bytes, so a vectorized read of a bool mask takes the wrong
bytes and, at an odd pair, faults (cudaErrorMisalignedAddress).  DLight's Matmul rule vectorizes
the epilogue of a GEMM fused with a ReLU mask's ``where`` that way (XML-CNN's backward, under the
``tvm_default`` baseline).  A schedule whose loops cannot be so rewritten is passed over like a
rule that raises.  Functions scheduled before this pass (a tuned build's MetaSchedule database)
are rewritten the same way, or the build stops with their name.
"""

from __future__ import annotations

import warnings

import tvm
import tvm_ffi
from tvm import s_tir, tirx

from .._rewrite import replace_functions
from ..ops import depthwise_conv_op, max_pool_op
from ..training import optimizer_update, philox, write_back
from . import column_sums, merge_small_kernels

# Kernels that bring their own GPU form: (the attribute that marks the functions, the hook that
# builds their GPU form from them; the function keeps its symbol).
OWN_GPU_FORMS = ((philox.KEEP_RATE_ATTR, philox.gpu_variant),
                 (optimizer_update.OPTIMIZER_ATTR, optimizer_update.gpu_variant),
                 (column_sums.SUMS_ATTR, column_sums.gpu_variant),
                 (write_back.WRITE_BACK_ATTR, write_back.gpu_variant),
                 (depthwise_conv_op.DEPTHWISE_ATTR, depthwise_conv_op.gpu_variant),
                 (max_pool_op.GATHER_ATTR, max_pool_op.gpu_variant),
                 (merge_small_kernels.MERGED_ATTR, merge_small_kernels.gpu_variant))


def _own_gpu_form_hook(func):
    return next((hook for attr, hook in OWN_GPU_FORMS if func.attrs and attr in func.attrs), None)


def has_own_gpu_form(func) -> bool:
    """Does ``ScheduleTIRForGPU`` swap in a form of its own for `func` (so there is nothing to tune)?"""
    return _own_gpu_form_hook(func) is not None


def _rules(vectorize: bool = False, column_rows: int | None = None):
    from tvm.s_tir import dlight as dl

    from .column_reduction import TY, ColumnReduction
    from .row_reduction import RowReduction
    from .tiled_transpose import TiledTranspose
    from .vectorized_elementwise import VectorizedElementwise

    columns = ColumnReduction(column_rows or TY)
    return ((VectorizedElementwise(), TiledTranspose(), columns, RowReduction()) if vectorize else ()) + (
        dl.gpu.Matmul(), dl.gpu.GEMV(), dl.gpu.Reduction(), dl.gpu.GeneralReduction(), dl.gpu.Fallback())


def _reduction_rules() -> tuple[type, ...]:
    """The rules that schedule a function only around a reduction block (each declines one without:
    DLight's Matmul, GEMV and Reduction look for one, GeneralReduction asserts a trailing reduction
    axis; ours take a single reduction block)."""
    from tvm.s_tir import dlight as dl

    from .column_reduction import ColumnReduction
    from .row_reduction import RowReduction

    return (ColumnReduction, RowReduction, dl.gpu.Matmul, dl.gpu.GEMV, dl.gpu.Reduction, dl.gpu.GeneralReduction)


def has_reduction_block(func: tirx.PrimFunc) -> bool:
    """Does a block of `func` have a reduction iterator?"""
    found = False

    def block(b) -> None:
        nonlocal found
        found = found or any(int(iv.iter_type) == tirx.IterVar.CommReduce for iv in b.iter_vars)

    tvm_ffi.structural_walk(func.body, (s_tir.SBlock, block), order="post")
    return found


def _scheduled(func) -> bool:
    return bool(func.attrs) and "tirx.is_scheduled" in func.attrs and int(func.attrs["tirx.is_scheduled"]) == 1


def launches_threads(func: tirx.PrimFunc) -> bool:
    """Does `func` launch its own GPU threads (``T.launch_thread``)?  TVM's CUDA legalisation of
    ``scatter_elements`` writes its kernel so (DeBERTa-v2's relative-position gradient); wrapped in
    the one-thread launch, its inner launches of other extents failed the build ("All loops that
    are bound to `blockIdx.x` should have the same extent")."""
    found = []
    tvm_ffi.structural_walk(func.body, (tirx.AttrStmt, lambda a: found.append(a) if a.attr_key == "thread_extent"
                                        else None), order="post")
    return bool(found)


def cross_thread_reduction_lowers(gv, func: tirx.PrimFunc) -> bool:
    """Does TVM's ``LowerCrossThreadReduction`` take `func`'s schedule?  DLight's Reduction rule
    binds a grouped convolution's reduction to threads with a spatial loop inside it (torchvision's
    ResNeXt and ShuffleNet, in bf16), which that pass refuses only when the step is built."""
    try:
        s_tir.transform.LowerCrossThreadReduction()(tvm.IRModule({gv: func}))
    except Exception:  # noqa: BLE001 - the schedule is passed over like a rule that raises
        return False
    return True


def single_thread(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """`func` as written, launched as one block of one thread: the producers that can be inlined
    into their readers are, and the buffers the function allocates are that thread's (local; a
    global buffer allocated inside a kernel fails the build: "used before its definition")."""
    root = func.body.block if isinstance(func.body, s_tir.SBlockRealize) else None
    if root is not None and root.alloc_buffers:
        sch = s_tir.Schedule(func)
        for block in sch.get_child_blocks(sch.get_sblock("root")):
            try:
                sch.compute_inline(block)
            except Exception:  # noqa: BLE001 - a block that cannot be inlined stays
                pass
        allocated = sch.get(sch.get_sblock("root")).alloc_buffers
        for block in sch.get_child_blocks(sch.get_sblock("root")):
            for i, region in enumerate(sch.get(block).writes):
                if any(region.source.same_as(b) for b in allocated):
                    sch.set_scope(block, i, "local")
        func = sch.mod["main"]
    body = func.body
    for tag in ("threadIdx.x", "blockIdx.x"):
        axis = tirx.IterVar(tvm.ir.Range(0, 1), tirx.Var(tag, "int32"), tirx.IterVar.ThreadIndex, tag)
        body = tirx.AttrStmt(axis, "thread_extent", tirx.const(1, "int32"), body)
    return func.with_body(body).with_attr("tirx.is_scheduled", True)


def vectorized_bool_blocks(func: tirx.PrimFunc) -> list[str]:
    """The blocks of `func` that read or write a bool buffer inside a vectorized loop."""
    names = []

    def block(b) -> None:
        if any(str(r.source.dtype) == "bool" for r in [*b.reads, *b.writes]) and b.name_hint not in names:
            names.append(b.name_hint)

    def loop(node) -> None:
        if node.kind == tirx.ForKind.VECTORIZED:
            tvm_ffi.structural_walk(node.body, (s_tir.SBlock, block), order="post")

    tvm_ffi.structural_walk(func.body, (tirx.For, loop), order="post")
    return names


def scalar_bool_access(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """`func` (scheduled) with the vectorized loops around each block that reads or writes a bool
    buffer unrolled: element by element, the bools are read and written a byte each."""
    names = vectorized_bool_blocks(func)
    if not names:
        return func
    sch = s_tir.Schedule(func)
    for name in names:
        for loop in sch.get_loops(sch.get_sblock(name)):
            if sch.get(loop).kind == tirx.ForKind.VECTORIZED:
                sch.unroll(loop)
    return sch.mod["main"]


def _made_safe(gv, func: tirx.PrimFunc) -> tirx.PrimFunc:
    """`scalar_bool_access` of a function scheduled before this pass, or an error naming it."""
    try:
        return scalar_bool_access(func)
    except Exception as err:  # noqa: BLE001 - reported with the function's name
        raise RuntimeError(
            f"ScheduleTIRForGPU: {gv.name_hint} reads or writes bool data in a vectorized loop, which "
            f"TVM 0.27's CUDA codegen gets wrong (a ushort2 a pair), and its schedule cannot be "
            f"rewritten: {str(err).splitlines()[-1] if str(err) else type(err).__name__}") from err


@tvm.transform.module_pass(opt_level=0, name="ScheduleTIRForGPU")
class ScheduleTIRForGPU:
    """Schedule every unscheduled PrimFunc with the first DLight rule that succeeds on it
    (`vectorize`: try ``VectorizedElementwise``, ``TiledTranspose``, ``ColumnReduction`` and
    ``RowReduction`` first; `column_rows`: ``ColumnReduction``'s row groups, its default if None)."""

    def __init__(self, vectorize: bool = False, column_rows: int | None = None):
        self.vectorize = vectorize
        self.column_rows = column_rows

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        from tvm.s_tir import dlight as dl

        rules = _rules(self.vectorize, self.column_rows)
        # a function without a reduction goes straight to the rules that may take it: each of the
        # others analyses it and declines (0.8 s each for ResNet's 65-block stem im2col)
        injective_rules = tuple(r for r in rules if not isinstance(r, _reduction_rules()))
        updates, serial = {}, []
        for gv, func in mod.functions_items():
            if not isinstance(func, tirx.PrimFunc):
                continue
            if _scheduled(func):  # by MetaSchedule's database (tuned builds): made safe, kept
                safe = _made_safe(gv, func)
                if not safe.same_as(func):
                    updates[gv] = safe
                continue
            if launches_threads(func):  # TVM's own GPU form (its CUDA scatter): kept as written
                updates[gv] = func.with_attr("tirx.is_scheduled", True)
                continue
            hook = _own_gpu_form_hook(func)
            if hook is not None:
                out = hook(func)
                updates[gv] = out.with_attr("global_symbol", func.attrs["global_symbol"]) \
                    if "global_symbol" in func.attrs else out
                continue
            single = tvm.IRModule({gv: func})
            reduces = has_reduction_block(func)
            for rule in rules if reduces else injective_rules:
                try:  # (an output the rule left unscheduled has no vectorized loops to unroll)
                    out = scalar_bool_access(dl.ApplyDefaultSchedule(rule)(single)[gv])
                except Exception:  # noqa: BLE001 - a failing rule passes the function on
                    continue
                if _scheduled(out) and (not reduces or cross_thread_reduction_lowers(gv, out)):
                    updates[gv] = out
                    break
            else:
                serial.append(gv.name_hint)
                updates[gv] = single_thread(func)
        if serial:
            warnings.warn(
                f"no DLight rule schedules {', '.join(sorted(serial))}: run on one GPU thread",
                stacklevel=2,
            )
        return replace_functions(mod, updates)

"""OffloadConv: ``tvm_evt.conv2d*`` calls to implicit-GEMM kernels (the CUDA route).

Each ``tvm_evt.conv2d`` / ``conv2d_dgrad`` / ``conv2d_wgrad`` call (`conv_op`) the kernels can take
(``codegen.frontend.conv_call``: bf16/fp16, channels a multiple of 8, what CUTLASS's SM90
implicit GEMM implements) becomes a call of a ``Codegen="evt_conv"`` function holding just that
call, which ``RunCodegen`` hands to ``relax.ext.evt_conv``; equal calls (the same shapes, geometry
and dtype) share one function.  A call the kernels cannot take is decomposed into the im2col gather
and a matmul (`conv_op.DECOMPOSE`) here, before the partitioner, so its GEMM still becomes an EVT
partition; the reason is kept in ``OffloadConv.fallbacks``.  A strided dgrad, which the kernels do
not take, runs as the unit-stride dgrads of its stride phases (`conv_op.split_strided_dgrad`) where
the kernels take every phase.

So is a call the kernel would run on too few CTAs (`too_few_tiles`): CUTLASS 4.2's SM90
convolutions have no persistent schedules, so no stream-K or split-K, and a weight gradient's
output is small while its reduction is long.  ResNet-50 conv3_x's 3x3 weight gradient is 9 tiles
of 128x128 with K = 100352; the kernel splits it over the batch (``conv.splits``: 13 launches on
side streams, 117 CTAs); one it cannot split enough goes to im2col + GEMM and the GEMM's stream-K.

    lv = tvm_evt.conv2d(x, w, R.shape([1, 1, 1, 1, 1, 1, 1, 1]))
  ->
    lv = main_conv0(x, w)       # Codegen="evt_conv", global_symbol "main_conv0"
"""
from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from ...codegen.errors import Unsupported
from ...codegen.backend import conv
from ...codegen.frontend.conv_call import conv_of_call
from ..ops import conv_op
from .._rewrite import has_call

CODEGEN = "evt_conv"
OPS = {tvm.ir.Op.get(name): name for name in conv_op.DECOMPOSE}
KIND = {conv_op.FPROP: "conv", conv_op.DGRAD: "conv_dgrad", conv_op.WGRAD: "conv_wgrad"}


def too_few_tiles(spec) -> str | None:
    """Why the kernel would leave most SMs idle for long (fewer than ``conv.MIN_CTAS`` CTAs, even
    with a weight gradient split over the batch, each a reduction of more than ``conv.LONG_K``),
    else None."""
    ctas = conv.tiles(spec) * conv.splits(spec)
    if ctas >= conv.MIN_CTAS or spec.gemm[2] <= conv.LONG_K:
        return None
    return (f"{spec.kind} would run {ctas} CTAs, each a reduction of {spec.gemm[2]} (the SM90 convolution "
            f"kernels have no split-K or stream-K)")


def kernel_spec(call: relax.Call) -> tuple:
    """(the call's ``ConvCall``, None) where a kernel runs it, else (its ``ConvCall`` or None, why
    not): the one decision of `OffloadConv` and of the training report."""
    try:
        spec = conv_of_call(call, symbol="")  # raises (naming the op) where the kernels cannot take the call
    except Unsupported as err:
        return None, err.reason
    few = too_few_tiles(spec)
    return spec, few and f"{call.op.name}: {few}"


def stride_phases(call: relax.Call) -> list[relax.Call] | None:
    """The unit-stride dgrads `OffloadConv` runs for a strided ``conv2d_dgrad`` (None for any other
    call): what the training report lists in its place."""
    if call.op.name != conv_op.DGRAD:
        return None
    phases: list[relax.Call] = []
    bb = relax.BlockBuilder()
    with bb.function("phases", []):  # a scratch scope to emit the split into
        split = conv_op.split_strided_dgrad(bb.emit, call, lambda phase: phases.append(phase) or bb.emit(phase))
        bb.emit_func_output(split if split is not None else relax.Tuple([]))
    return None if split is None else phases


def _kernel_function(call: relax.Call) -> relax.Function:
    """fn(a, b) { return op(a, b, <the call's constant shapes>) }: the two tensor operands as
    parameters, in the op's order."""
    params = [relax.Var(name, arg.ty) for name, arg in zip("ab", call.args[:2])]
    bb = relax.BlockBuilder()
    with bb.function("conv", params):
        out = bb.emit(relax.Call(call.op, [*params, *call.args[2:]]))
        bb.emit_func_output(out)
    return bb.get()["conv"]


@mutator
class _Offloader(PyExprMutator):
    def __init__(self, mod: tvm.IRModule, prefix: str, shared: dict, fallbacks: list):
        super().__init__(mod)
        self.prefix = prefix
        self.shared = shared  # ConvCall (symbol blank) -> GlobalVar
        self.fallbacks = fallbacks

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        name = OPS.get(call.op) if isinstance(call.op, tvm.ir.Op) else None
        if name is None:
            return call
        phases = stride_phases(call)
        # a strided dgrad as the unit-stride dgrads of its stride phases, where kernels run them
        # all (else im2col + GEMM for the whole call: one col2im instead of one a phase)
        if phases and all(kernel_spec(phase)[1] is None for phase in phases):
            return conv_op.split_strided_dgrad(self.builder_.emit, call, lambda phase: self._lower(phase, name))
        return self._lower(call, name)

    def _lower(self, call: relax.Call, name: str) -> relax.Expr:
        """`call` as a call of its kernel function, or decomposed where no kernel takes it."""
        spec, reason = kernel_spec(call)
        if reason is not None:
            self.fallbacks.append(reason)
            return conv_op.DECOMPOSE[name](self.builder_, call)
        gvar = self.shared.get(spec)
        if gvar is None:
            symbol = f"{self.prefix}_{KIND[name]}{len(self.shared)}"
            func = _kernel_function(call).with_attrs({"Codegen": CODEGEN, "global_symbol": symbol})
            gvar = self.builder_.add_func(func, symbol)
            self.shared[spec] = gvar
        return relax.Call(gvar, list(call.args[:2]))


@tvm.transform.module_pass(opt_level=0, name="OffloadConv")
class OffloadConv:
    """``tvm_evt.conv2d*`` calls -> ``Codegen="evt_conv"`` functions, or the im2col gather and a
    matmul where the kernels cannot take them (``fallbacks`` lists why)."""

    def __init__(self):
        self.fallbacks: list[str] = []

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        targets = [(gv, f) for gv, f in mod.functions_items()
                   if isinstance(f, relax.Function) and not (f.attrs and "Codegen" in f.attrs) and has_call(f.body, OPS)]
        shared: dict = {}
        for gv, func in targets:
            offloader = _Offloader(mod, gv.name_hint, shared, self.fallbacks)
            offloader.builder_.update_func(gv, offloader.visit_expr(func))
            mod = offloader.builder_.get()
        return mod

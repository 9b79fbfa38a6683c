"""The step's build without nvcc: what ``RunCodegen`` would leave for TVM, with the kernels of its
three code generators left unbuilt (``OpaqueEVTCalls``), for what needs the lowered step but no
kernel (its memory plan, the TVM kernels' schedules)."""
from __future__ import annotations

import tvm
from tvm import relax


def evt_functions(mod: tvm.IRModule, codegen: str | None = None) -> dict:
    """{GlobalVar: function} of the ``Codegen="evt"`` partitions (or of `codegen`'s functions)."""
    from .relax_passes.partition.partition_evt import CODEGEN

    codegen = codegen or CODEGEN
    return {gv: f for gv, f in mod.functions_items()
            if isinstance(f, relax.Function) and f.attrs and f.attrs.get("Codegen") == codegen}


def _external_functions(mod: tvm.IRModule) -> dict:
    """{GlobalVar: kind} of the functions ``RunCodegen`` builds: evt partitions ("cutlass"),
    flash-attention calls ("flash") and implicit-GEMM convolutions ("conv")."""
    from .relax_passes.lower.offload_attention import CODEGEN as ATTENTION
    from .relax_passes.lower.offload_conv import CODEGEN as CONV

    kinds = {gv: "cutlass" for gv in evt_functions(mod)}
    return {**kinds, **{gv: "flash" for gv in evt_functions(mod, ATTENTION)},
            **{gv: "conv" for gv in evt_functions(mod, CONV)}}


@tvm.transform.module_pass(opt_level=0, name="OpaqueEVTCalls")
class OpaqueEVTCalls:
    """Replace each call of an evt partition (or flash-attention or convolution function) by a
    ``call_dps_packed`` of its symbol and drop the functions: what ``RunCodegen`` leaves for TVM,
    without building the kernels.  ``kinds`` maps each symbol replaced to "cutlass", "flash" or
    "conv"."""

    def __init__(self):
        self.kinds: dict[str, str] = {}

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        parts = _external_functions(mod)
        self.kinds.update({gv.name_hint: kind for gv, kind in parts.items()})
        if not parts:
            return mod

        @relax.expr_functor.mutator
        class _Mutator(relax.PyExprMutator):
            def visit_call_(self, call):
                call = super().visit_call_(call)
                if call.op in parts:
                    ty = call.ty
                    out = list(ty.fields) if isinstance(ty, relax.TupleType) else ty
                    return relax.call_dps_packed(call.op.name_hint, relax.Tuple(list(call.args)), out)
                return call

        mutator = _Mutator(mod)
        for gv, func in mod.functions_items():
            if isinstance(func, relax.Function) and gv not in parts:
                mutator.builder_.update_func(gv, mutator.visit_expr(func))
        out = mutator.builder_.get()
        return tvm.IRModule({g: f for g, f in out.functions_items() if g not in parts}, attrs=out.attrs)


def without_builds(passes: list, opaque: "OpaqueEVTCalls | None" = None) -> list:
    """``passes`` without nvcc: ``RunCodegen`` replaced by ``opaque`` (a fresh ``OpaqueEVTCalls``
    by default) and ``PrebuildKernels`` dropped."""
    opaque = opaque or OpaqueEVTCalls()
    return [opaque if name == "RunCodegen" else p for p, name in zip(passes, [p.info.name for p in passes])
            if name != "PrebuildKernels"]

"""NonFiniteBF16AsBits: bfloat16 infinities and NaNs in TIR kernels written as their bit patterns.

TVM 0.27's CUDA codegen prints a bfloat16 constant as ``__float2bfloat16_rn(<hexfloat>f)``; for a
non-finite value that is ``__float2bfloat16_rn(inff)`` (or ``-inff``, ``nanf``), which no CUDA
compiler takes ("identifier "inff" is undefined"), where its float16 and float32 constants print
``CUDART_INF_F``.  Such constants come from ops with an open bound: ``torch.clamp(x, min=0)``
(MobileNetV3's hardsigmoid decomposes into one) imports as ``clip(x, 0, inf)``, whose legalisation
and gradient mask compare with ``inf`` in the step's bfloat16.

Every kernel's bfloat16 ``FloatImm`` that is not finite becomes ``reinterpret(uint16 bits)``, the
same value: +inf 0x7F80, -inf 0xFF80, NaN 0x7FC0.  TVM's simplifier folds a cast of a float32
constant back into a bfloat16 ``FloatImm``, but leaves a reinterpretation alone; the codegen writes
it as a ``ushort`` local read as ``nv_bfloat16``.  Runs after the kernels are scheduled (the last
pass that makes constants).
"""

from __future__ import annotations

import math

import tvm
import tvm_ffi
from tvm import tirx

from .._rewrite import replace_functions

BITS = {"bfloat16": ("uint16", {"inf": 0x7F80, "-inf": 0xFF80, "nan": 0x7FC0})}


def _as_bits(imm: tirx.FloatImm):
    dtype = str(imm.ty.dtype)
    if dtype not in BITS or math.isfinite(imm.value):
        return imm
    carrier, patterns = BITS[dtype]
    name = "nan" if math.isnan(imm.value) else "-inf" if imm.value < 0 else "inf"
    return tirx.call_intrin(dtype, "tirx.reinterpret", tirx.IntImm(carrier, patterns[name]))


@tvm.transform.module_pass(opt_level=0, name="NonFiniteBF16AsBits")
class NonFiniteBF16AsBits:
    """Every PrimFunc's non-finite bfloat16 constants as reinterpreted bit patterns."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        updates = {}
        for gv, func in mod.functions_items():
            if isinstance(func, tirx.PrimFunc):
                out = tvm_ffi.structural_map(func, (tirx.FloatImm, _as_bits))  # `func` itself where none is
                if not out.same_as(func):
                    updates[gv] = out
        return replace_functions(mod, updates)

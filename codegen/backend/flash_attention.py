"""Emit the flash-attention kernels' C++ for an ``AttentionCall`` (one TVM FFI entry per call).

The kernels (``flash_templates.KERNELS``) are templates on the dtype, the causal / bias /
dropout flags and whether the keys leave their last tile part-filled (``ragged``); the entry bakes
in the shapes, scale and dropout constants, checks every argument against them, and launches
forward, or delta + dK/dV + dQ for the backward.
"""
from __future__ import annotations

import math
import re

from ..errors import Unsupported
from ..ir.attention import AttentionCall
from ..philox import dropout_scale, keep_threshold
from .flash_templates import BACKWARD_ENTRY, FORWARD_ENTRY, HEADER, KERNELS
from .sm90_emitter import CODEGEN_VERSION

DL_CODE = {"bfloat16": ("kDLBfloat", 16), "float16": ("kDLFloat", 16)}
KEY_TILE = 64  # the kernels' kBlock: keys a streamed tile
# head dimensions the kernels take: multiples of 16 (their MMAs' k-step) held in one or two 64-column
# panels, D = 32 in the kernels of 64 and D = 80, 96 in those of 128 (flash_templates' docstring)
HEAD_DIMS = (32, 64, 80, 96, 128)


def _float(x: float) -> str:
    """A C++ float literal that round-trips ``x`` as float32 (``repr`` of a Python float)."""
    text = repr(float(x))
    return text if any(c in text for c in ".e") else text + ".0"


def _shapes(call: AttentionCall) -> dict[str, tuple[list[int], str, int]]:
    """name -> (shape, DLPack type code, bits) of every DPS argument."""
    code, bits = DL_CODE[call.dtype]
    qshape, kshape = call.shape(call.sq), call.shape(call.sk, call.kv_heads)
    lse = ([call.batch, call.heads, call.sq], "kDLFloat", 32)
    table = {
        "q": (qshape, code, bits), "k": (kshape, code, bits), "v": (kshape, code, bits),
        "o": (qshape, code, bits), "out": (qshape, code, bits), "dout": (qshape, code, bits),
        "lse": lse, "seed": ([2], "kDLUInt", 32), "bias": ([call.sk], "kDLFloat", 32),
        "dq": (qshape, code, bits), "dk": (kshape, code, bits), "dv": (kshape, code, bits),
        "mask": (call.mask_shape, "kDLUInt", 32),
    }
    return {name: table[name] for name in call.inputs + call.outputs}


def emit_attention(call: AttentionCall) -> str:
    if call.dtype not in DL_CODE:
        raise Unsupported(f"{call.symbol}: dtype {call.dtype}")
    if call.head_dim not in HEAD_DIMS:
        raise Unsupported(f"{call.symbol}: head dimension {call.head_dim} (the kernels take {HEAD_DIMS})")
    if call.kv_heads < 1 or call.heads % call.kv_heads:
        raise Unsupported(f"{call.symbol}: {call.heads} query heads over {call.kv_heads} key/value heads")
    if call.layout not in ("bhsd", "bshd"):
        raise Unsupported(f"{call.symbol}: layout {call.layout!r} (the kernels take bhsd, bshd)")
    if not call.scale > 0:  # the forward takes a row's max before scaling its scores
        raise Unsupported(f"{call.symbol}: scale {call.scale} (the kernels take a positive one)")
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", call.symbol):
        raise Unsupported(f"{call.symbol!r} is not a C identifier")
    shapes = _shapes(call)
    names = call.inputs + call.outputs
    bind = "\n".join(f"  DLTensor* {name} = tensors[{i}];" for i, name in enumerate(names))
    checks = "\n".join(
        f"  if (check({name}, kKernel, \"{name}\", {{{', '.join(map(str, shape))}}}, {code}, {bits}, device)) return -1;"
        for name, (shape, code, bits) in shapes.items()
    )
    optional = []
    if "seed" in call.inputs:
        optional.append("  p.seed = data_of<const uint32_t>(seed);")
    if "mask" in call.outputs:
        optional.append("  p.mask_out = data_of<uint32_t>(mask);")
    if "mask" in call.inputs:
        optional.append("  p.mask_in = data_of<const uint32_t>(mask);")
    if call.has_bias:
        optional.append("  p.bias = data_of<const float>(bias);")
    template = BACKWARD_ENTRY if call.backward else FORWARD_ENTRY
    header = HEADER.substitute(
        version=CODEGEN_VERSION, symbol=call.symbol, kind="backward" if call.backward else "forward",
        batch=call.batch, heads=call.heads, kv_heads=call.kv_heads, sq=call.sq, sk=call.sk, head_dim=call.head_dim, dtype=call.dtype,
        scale=_float(call.scale), causal=int(call.causal), has_bias=int(call.has_bias), dropout=_float(call.dropout),
        site=call.site, layout=call.layout,
    )
    flags = dict(
        sq=call.sq, sk=call.sk, head_dim=call.head_dim, batch_heads=call.batch * call.heads,
        batch_kv_heads=call.batch * call.kv_heads, bf16="true" if call.dtype == "bfloat16" else "false",
        causal=str(call.causal).lower(), has_bias=str(call.has_bias).lower(), has_dropout=str(call.has_dropout).lower(),
        # keys that do not fill their last tile: only then (or causal) does a row see part of a tile
        ragged=str(call.sk % KEY_TILE != 0).lower(),
    )
    entry = template.substitute(
        namespace=f"tvm_evt_{call.symbol}", symbol=call.symbol, num_args=len(names), bind=bind, checks=checks,
        optional="\n".join(optional), heads=call.heads, kv_heads=call.kv_heads, bshd=int(call.layout == "bshd"),
        scale=_float(call.scale), scale_log2=_float(call.scale * math.log2(math.e)),
        drop_scale=_float(dropout_scale(call.dropout) if call.has_dropout else 1.0),
        threshold=keep_threshold(call.dropout) if call.has_dropout else 0, site=call.site,
        **flags,
    )
    return header + KERNELS + entry

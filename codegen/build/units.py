"""Kernels of one CUTLASS type compiled as one translation unit.

An emitted kernel is a CUTLASS type (``GemmUniversal`` or ``ConvUniversal`` with its tile,
schedule and epilogue visitor tree) and a small entry that bakes in its problem's shapes and
launches it.  nvcc spends its ~30 s (one core) on the type; the entry costs little.  A ResNet's
layers differ in shapes, rarely in types: ResNet-50's 81 kernels (30 convolutions, 51 GEMMs) are
24 types.  Each emitter tags its source with a hash of the text that defines the type
(``backend.kernel_type.type_line``); ``translation_units`` concatenates the sources of a tag into
one unit, in which nvcc instantiates the type once and every entry launches it.  Each source stays self-contained
(its includes, its preludes behind include guards, its entry in a namespace of its own), so a
unit holding one source is that source, and the kernels run exactly as when built alone.
"""
from __future__ import annotations

from ..backend.kernel_type import kernel_type


def translation_units(sources: dict[str, str]) -> list[tuple[list[str], str]]:
    """[(names, source)]: the sources of one type concatenated in name order (one unit), each
    untagged source (and each source equal to an earlier one's) alone, in the order first met."""
    groups: dict[str, list[str]] = {}
    for name, source in sources.items():
        tag = kernel_type(source)
        groups.setdefault(tag if tag is not None else f"source:{name}", []).append(name)
    units = []
    for names in groups.values():
        names = sorted(names) if len(names) > 1 else names
        texts = list(dict.fromkeys(sources[n] for n in names))  # equal sources compiled once
        units.append((names, "".join(texts)))
    return units

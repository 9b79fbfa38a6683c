"""The type tag of an emitted kernel: kernels with the same tag are one CUTLASS type, which
``codegen.build.units`` compiles once for all of them (one translation unit)."""
from __future__ import annotations

import hashlib
import re

TAG = "// Kernel type "
_TAG_LINE = re.compile(r"^// Kernel type ([0-9a-f]{16}):", re.M)


def type_line(type_text: str) -> str:
    """The header line naming the type `type_text` defines (everything of the source the kernel's
    compiled code depends on, with the entry's namespace written the same for every kernel)."""
    digest = hashlib.sha256(type_text.encode()).hexdigest()[:16]
    return f"{TAG}{digest}: built in one translation unit with the other kernels of this type."


def kernel_type(source: str) -> str | None:
    """The type tag of an emitted source, None for a source without one (built alone)."""
    match = _TAG_LINE.search(source)
    return match.group(1) if match else None

"""A 2-D convolution of a training step as an implicit-GEMM kernel needs it (no Relax, no C++).

Channels-last throughout, as ``relax.transform.ConvertLayout`` leaves a CNN (``nhwc``):
activation ``x`` [N, H, W, C], filter ``w`` [K, R, S, C] (OHWI), output ``y`` [N, P, Q, K], with
cross-correlation ``y[n, p, q, k] = Σ_{r, s, c} x[n, p·sh - pt + r·dh, q·sw - pl + s·dw, c] ·
w[k, r, s, c]`` (zero outside ``x``).  The three GEMM-shaped problems of a training step:

``fprop``  y  = conv(x, w)            M = N·P·Q, N = K, K = R·S·C
``dgrad``  dx = conv_dgrad(dy, w)     M = N·H·W, N = C, K = R·S·K
``wgrad``  dw = conv_wgrad(x, dy)     M = K,     N = R·S·C, K = N·P·Q

Operands in ``dtype`` (bfloat16 / float16), accumulated in float32, the result in ``dtype``.
"""
from __future__ import annotations

from dataclasses import dataclass

KINDS = ("fprop", "dgrad", "wgrad")
# kind -> (tensor parameters in order, result): the DPS arguments of the kernel's entry
OPERANDS = {"fprop": (("x", "w"), "y"), "dgrad": (("dy", "w"), "dx"), "wgrad": (("x", "dy"), "dw")}


@dataclass(frozen=True)
class ConvCall:
    symbol: str
    kind: str  # one of KINDS
    dtype: str  # "bfloat16" | "float16"
    x: tuple[int, int, int, int]  # N, H, W, C
    w: tuple[int, int, int, int]  # K, R, S, C
    y: tuple[int, int, int, int]  # N, P, Q, K
    pad: tuple[int, int, int, int]  # top, left, bottom, right
    stride: tuple[int, int]
    dilation: tuple[int, int]

    @property
    def inputs(self) -> tuple[str, ...]:
        return OPERANDS[self.kind][0]

    @property
    def outputs(self) -> tuple[str, ...]:
        return (OPERANDS[self.kind][1],)

    def shape(self, name: str) -> tuple[int, int, int, int]:
        """The shape of operand `name` (x/dx, w/dw, y/dy)."""
        return {"x": self.x, "dx": self.x, "w": self.w, "dw": self.w, "y": self.y, "dy": self.y}[name]

    @property
    def gemm(self) -> tuple[int, int, int]:
        """(M, N, K) of the implicit GEMM."""
        (n, h, wd, c), (k, r, s, _), (_, p, q, _) = self.x, self.w, self.y
        return {"fprop": (n * p * q, k, r * s * c), "dgrad": (n * h * wd, c, r * s * k),
                "wgrad": (k, r * s * c, n * p * q)}[self.kind]

"""A fused training attention call, as the flash-attention emitter needs it (no Relax, no C++).

``forward``:  O, LSE = softmax(scale * Q Kᵀ + bias, causal mask) -> dropout -> @ V
``backward``: dQ, dK, dV from Q, K, V, O, LSE and dO (FlashAttention-2's backward).
Q, O, dQ, dO are [batch, heads, sq, head_dim]; K, V, dK, dV [batch, heads, sk, head_dim]; LSE
[batch, heads, sq] float32; bias (optional) [sk] float32; the dropout mask follows
``codegen/philox.py`` over the row-major [batch, heads, sq, sk] index with the given ``site``.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AttentionCall:
    symbol: str
    backward: bool
    dtype: str  # "bfloat16" | "float16"
    batch: int
    heads: int
    sq: int
    sk: int
    head_dim: int
    scale: float
    causal: bool
    dropout: float
    site: int
    has_bias: bool

    @property
    def has_dropout(self) -> bool:
        return self.dropout > 0.0

    @property
    def inputs(self) -> tuple[str, ...]:
        """The partition's tensor parameters, in order (the DPS arguments before the outputs)."""
        names = ("q", "k", "v", "o", "lse", "dout") if self.backward else ("q", "k", "v")
        return names + (("seed",) if self.has_dropout else ()) + (("bias",) if self.has_bias else ())

    @property
    def outputs(self) -> tuple[str, ...]:
        return ("dq", "dk", "dv") if self.backward else ("out", "lse")

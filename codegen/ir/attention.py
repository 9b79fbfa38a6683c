"""A fused training attention call, as the flash-attention emitter needs it (no Relax, no C++).

``forward``:  O, LSE = softmax(scale * Q Kᵀ + bias, causal mask) -> dropout -> @ V
``backward``: dQ, dK, dV from Q, K, V, O, LSE and dO (FlashAttention-2's backward).
Q, O, dQ, dO are [batch, heads, sq, head_dim]; K, V, dK, dV [batch, kv_heads, sk, head_dim] (or [batch, seq,
heads, head_dim] all of them: ``layout``), each key/value head read by heads / kv_heads query heads in a row
(grouped-query attention; kv_heads = heads without it); LSE
[batch, heads, sq] float32; bias (optional) [sk] float32; the dropout mask follows
``codegen/philox.py`` over the row-major [batch, heads, sq, sk] index with the given ``site``
(``saved_mask``: the forward pass also returns it as bits, which the backward pass takes).
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
    # dropout's keep bits: the forward pass writes them (an extra output, ``mask``) and the
    # backward pass reads them (an input in place of the seed) instead of drawing them again
    saved_mask: bool = False
    # "bhsd": q, k, v, o, dout, out, dq, dk, dv are [batch, heads, seq, head_dim]; "bshd": [batch,
    # seq, heads, head_dim], as a linear layer's output splits into heads (no transposes around
    # the kernels).  LSE, bias and mask are the same either way.
    layout: str = "bhsd"
    # key/value heads (0: as many as ``heads``), a divisor of ``heads``
    kv_heads: int = 0

    def __post_init__(self):
        if not self.kv_heads:
            object.__setattr__(self, "kv_heads", self.heads)

    @property
    def has_dropout(self) -> bool:
        return self.dropout > 0.0

    @property
    def inputs(self) -> tuple[str, ...]:
        """The partition's tensor parameters, in order (the DPS arguments before the outputs)."""
        names = ("q", "k", "v", "o", "lse", "dout") if self.backward else ("q", "k", "v")
        if self.has_dropout:
            names += ("mask",) if self.backward and self.saved_mask else ("seed",)
        return names + (("bias",) if self.has_bias else ())

    @property
    def outputs(self) -> tuple[str, ...]:
        if self.backward:
            return ("dq", "dk", "dv")
        return ("out", "lse") + (("mask",) if self.has_dropout and self.saved_mask else ())

    def shape(self, rows: int, heads: int | None = None) -> list[int]:
        """The shape of a q-like (``rows`` = sq) or, with ``heads`` = kv_heads, a k-like (``rows`` = sk)
        tensor in ``layout``."""
        heads = self.heads if heads is None else heads
        if self.layout == "bshd":
            return [self.batch, rows, heads, self.head_dim]
        return [self.batch, heads, rows, self.head_dim]

    @property
    def mask_shape(self) -> list[int]:
        """The saved keep bits: 128 words per 64 x 64 tile of every (batch, head)."""
        return [self.batch, self.heads, -(-self.sq // 64), -(-self.sk // 64), 128]

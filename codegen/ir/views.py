"""Strided views of a parameter: how Permute/Reshape chains become (M, N, L) element strides."""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import Unsupported


def packed_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= s
    return tuple(reversed(strides))


@dataclass(frozen=True)
class View:
    shape: tuple[int, ...]
    strides: tuple[int, ...]

    @staticmethod
    def of(shape: tuple[int, ...]) -> "View":
        return View(tuple(shape), packed_strides(tuple(shape)))

    def permute(self, axes: tuple[int, ...]) -> "View":
        return View(tuple(self.shape[a] for a in axes), tuple(self.strides[a] for a in axes))

    def reshape(self, new_shape: tuple[int, ...]) -> "View":
        if math.prod(new_shape) != math.prod(self.shape):
            raise Unsupported(f"reshape {self.shape} -> {new_shape} changes the element count")
        squeezed = [(d, s) for d, s in zip(self.shape, self.strides) if d != 1]
        if [d for d in new_shape if d != 1] == [d for d, _ in squeezed]:
            # only size-1 dims inserted or removed: keep strides
            it = iter(s for _, s in squeezed)
            return View(tuple(new_shape), tuple(0 if d == 1 else next(it) for d in new_shape))
        if all(s == p for (d, s), p in zip(zip(self.shape, self.strides), packed_strides(self.shape)) if d != 1):
            return View.of(tuple(new_shape))
        raise Unsupported(f"reshape {self.shape} -> {new_shape} of a non-contiguous view")

    def align(self, out_shape: tuple[int, ...], what: str) -> tuple[int, ...]:
        """Per-dimension strides of this view broadcast (numpy rules) to ``out_shape``."""
        if len(self.shape) > len(out_shape):
            raise Unsupported(f"{what} of rank {len(self.shape)} exceeds output rank {len(out_shape)}")
        pad = len(out_shape) - len(self.shape)
        strides = []
        for i, full in enumerate(out_shape):
            if i < pad or self.shape[i - pad] == 1:
                strides.append(0)
            elif self.shape[i - pad] == full:
                strides.append(self.strides[i - pad])
            else:
                raise Unsupported(f"{what} of shape {self.shape} does not broadcast to {out_shape}")
        return tuple(strides)


def collapse_batch(sizes: tuple[int, ...], strides: tuple[int, ...], what: str) -> int:
    """Stride of the flattened batch mode L over leading dims ``sizes`` (0 = broadcast)."""
    live = [(d, s) for d, s in zip(sizes, strides) if d != 1]
    if not live:
        return 0
    if all(s == 0 for _, s in live):
        return 0
    if any(s == 0 for _, s in live):
        raise Unsupported(f"{what} broadcasts over part of the batch dims only")
    for (d0, s0), (d1, s1) in zip(live, live[1:]):
        if s0 != s1 * d1:
            raise Unsupported(f"{what} batch dims are not uniformly strided")
    return live[-1][1]


def mnl_strides(view: View, batch_shape: tuple[int, ...], m: int, n: int, what: str):
    """(stride_m, stride_n, stride_l) of ``view`` broadcast to ``batch_shape + (m, n)``."""
    per_dim = view.align(tuple(batch_shape) + (m, n), what)
    sl = collapse_batch(tuple(batch_shape), per_dim[:-2], what)
    return (per_dim[-2], per_dim[-1], sl)

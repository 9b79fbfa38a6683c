"""GELU's normal CDF for the epilogue functors, without an erf.

GELU and its derivative need 2Φ(x) = 1 + erf(x/√2) and the normal density's e^{-x²/2}:

    gelu(x)  = x/2 · 2Φ(x)
    gelu'(x) = 1/2 · 2Φ(x) + x · e^{-x²/2} / √(2π)

With z = |x|/√2, 2Φ(x) is erfc(z) for x < 0 and 2 - erfc(z) for x >= 0, and

    erfc(z) = t · P(t) · e^{-z²},   t = 1 / (1 + p·z)

(the form of Abramowitz & Stegun 7.1.26, refitted: P of degree 7, fitted for *relative* error over
z in [0, 10], so GELU's negative tail keeps its relative accuracy where 1 + erff(·) cancels).
e^{-z²} = e^{-x²/2} is the density term gelu' needs anyway (``gelu_pdf_term``), so a forward
epilogue storing gelu and gelu' pays one approximate reciprocal, one ex2.approx and a dozen FMAs for both.
CUDA 13's erff costs 7 selects, 8 FMAs, a branch and an ex2 of its own on top of the density's:
the epilogue of a GEMM storing gelu(x) and gelu'(x) is ALU-bound behind the cooperative main
loop (``codegen/passes/fold_activation_gradient.py``), so those instructions are its time.

Accuracy (``tests/test_gelu_cdf.py``, float32 evaluation as the device does it, against
``math.erfc``): absolute error below 5e-7 (4 ulp of 1.0; float32's rounding of 1 + erff(·) alone
leaves up to 6e-8), and relative error below 5e-7·(1 + x²) (the x² from e^{-x²/2} of the rounded x·x)
where 1 + erff(·) has none left (10 % at x = -5): far below the bf16 or fp16 rounding of the result.
"""
from __future__ import annotations

import math

import numpy as np

P = 0.43
"""t = 1 / (1 + P·z), z = |x|/√2."""
COEFFS = (0.24251980775117454, 0.2442940604581625, 0.20547039159160807, 0.24508976237394903,
          -0.08232529740136584, 0.3799139014879791, -0.3081130573057151, 0.07315041846537822)
"""erfc(z)·e^{z²} ≈ Σ COEFFS[i]·t^(i+1), from ``fit()``: relative error 9.9e-8 in exact arithmetic."""
Z_MAX = 10.0  # e^{-z²} is below float32's normal range from z ≈ 9.35 on
_P_X = P / math.sqrt(2.0)  # t = 1 / (1 + _P_X·|x|)
_DENSITY = -0.5 * math.log2(math.e)  # e^{-x²/2} = 2^(_DENSITY·x·x)


def _target(z: np.ndarray) -> np.ndarray:
    return np.array([math.erfc(v) * math.exp(v * v) for v in z])  # erfcx(z)


def fit(degree: int = len(COEFFS), p: float = P, points: int = 20001, iterations: int = 60) -> tuple[float, ...]:
    """Coefficients of t^1..t^degree for erfc(z)·e^{z²} over z in [0, Z_MAX], near-minimax in
    relative error (least squares reweighted towards the worst points, Lawson's iteration)."""
    z = np.linspace(0.0, Z_MAX, points)
    target = _target(z)
    t = 1.0 / (1.0 + p * z)
    basis = np.stack([t ** k for k in range(1, degree + 1)], axis=1) / target[:, None]
    weight = np.ones_like(z)
    for _ in range(iterations):
        coeffs, *_ = np.linalg.lstsq(basis * weight[:, None], weight, rcond=None)
        error = np.abs(basis @ coeffs - 1.0)
        weight *= 1.0 + 50.0 * error / error.max()
    return tuple(float(c) for c in coeffs)


def _f32(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float32)


def _fma(a, b, c) -> np.ndarray:  # float32 fused multiply-add: one rounding of the exact a·b + c
    return _f32(np.float64(a) * np.float64(b) + np.float64(c))


def evaluate_float32(x) -> np.ndarray:
    """2Φ(x) as ``SOURCE`` computes it, in float32 (the reciprocal and the exp2 correctly rounded
    where the device's approximations are within 2 ulp)."""
    x = _f32(x)
    t = _f32(np.float32(1.0) / _fma(np.float32(_P_X), np.abs(x), np.float32(1.0)))
    r = _f32(COEFFS[-1])
    for c in reversed(COEFFS[:-1]):
        r = _fma(r, t, np.float32(c))
    with np.errstate(over="ignore"):  # x·x of a huge x: e^{-inf} = 0, as on the device
        density = _f32(np.exp2(_f32(np.float32(_DENSITY) * x) * x))
    tail = _f32(_f32(r * t) * density)
    return np.where(x >= 0, _f32(np.float32(2.0) - tail), tail)


def _literal(v: float) -> str:
    return f"{float(np.float32(v))!r}f"


def _source() -> str:
    horner = "".join(f"\n  r = fmaf(r, t, {_literal(c)});" for c in reversed(COEFFS[:-1]))
    return f"""\
// exp(-x^2 / 2), through one ex2.approx
CUTLASS_HOST_DEVICE float gelu_pdf_term(float x) {{ return exp2f({_literal(_DENSITY)} * x * x); }}
// 2 Phi(x) = 1 + erf(x / sqrt 2) without an erf (codegen/backend/gelu_cdf.py): erfc(|x| / sqrt 2) =
// t P(t) exp(-x^2 / 2), t = 1 / (1 + p |x| / sqrt 2), sharing gelu_pdf_term with gelu's derivative
CUTLASS_HOST_DEVICE float gelu_cdf_term(float x) {{
  const float d = fmaf({_literal(_P_X)}, fabsf(x), 1.0f);
#if defined(__CUDA_ARCH__)
  const float t = __fdividef(1.0f, d);  // div.approx: one MUFU.RCP, and nvcc merges two calls' (inline asm it would not)
#else
  const float t = 1.0f / d;
#endif
  float r = {_literal(COEFFS[-1])};{horner}
  const float tail = r * t * gelu_pdf_term(x);
  return x >= 0.0f ? 2.0f - tail : tail;
}}
"""


SOURCE = _source()
"""``gelu_pdf_term`` and ``gelu_cdf_term``, C++ for ``templates.PRELUDE``."""

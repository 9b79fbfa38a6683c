"""GELU's CDF term without an erf (``codegen/backend/gelu_cdf.py``): its constants' accuracy,
evaluated in float32 as the device evaluates them, against ``math.erfc``."""
import math

import numpy as np
import pytest

from tvm_evt.codegen.backend import gelu_cdf


def _exact(x: np.ndarray) -> np.ndarray:  # 2 Phi(x) = erfc(-x / sqrt 2), in float64
    return np.array([math.erfc(-float(v) / math.sqrt(2.0)) for v in x])


def _grid() -> np.ndarray:  # float32 inputs, dense near 0 and across both tails
    x = np.concatenate([np.linspace(-13.0, 13.0, 200001), np.geomspace(1e-30, 1.0, 2001)])
    return np.unique(np.concatenate([x, -x]).astype(np.float32))


def test_float32_evaluation_is_within_a_few_ulp_of_one_plus_erf():
    x = _grid()
    got, exact = gelu_cdf.evaluate_float32(x).astype(np.float64), _exact(x)
    assert np.abs(got - exact).max() < 5e-7  # 4 ulp at 1.0
    # relative: e^{-x^2/2} of a float32 x is good to ~x^2 ulp, the rest to a few ulp
    normal = x >= -12.0
    x64 = x.astype(np.float64)
    assert (np.abs(got - exact) / exact / (1.0 + x64 * x64))[normal].max() < 5e-7


def test_negative_tail_keeps_its_relative_accuracy_where_float32_one_plus_erf_cancels():
    x = np.linspace(-6.0, -3.0, 3001).astype(np.float32)
    exact = _exact(x)
    ours = np.abs(gelu_cdf.evaluate_float32(x) - exact) / exact
    # 1 + erf(z) in float32 from a correctly rounded erf(z): the form erff-based GELU evaluates
    cancelled = np.float32(1.0) + np.array([math.erf(float(v) / math.sqrt(2.0)) for v in x], np.float32)
    theirs = np.abs(cancelled - exact) / exact
    assert ours.max() < 2e-5 and theirs.max() > 0.1


@pytest.mark.parametrize("x", [0.0, -0.0, 1e-30, -1e-30])
def test_center_is_one(x):
    assert gelu_cdf.evaluate_float32(np.array([x]))[0] == pytest.approx(1.0, abs=5e-7)


def test_far_tails_are_exact_limits():
    got = gelu_cdf.evaluate_float32(np.array([-20.0, -1e30, 20.0, 1e30, np.inf], np.float32))
    np.testing.assert_array_equal(got, [0.0, 0.0, 2.0, 2.0, 2.0])
    assert np.isnan(gelu_cdf.evaluate_float32(np.array([np.nan], np.float32))[0])


def test_fit_reproduces_constants_as_accurate_as_the_stored_ones():
    z = np.linspace(0.0, gelu_cdf.Z_MAX, 4001)
    target = np.array([math.erfc(v) * math.exp(v * v) for v in z])
    t = 1.0 / (1.0 + gelu_cdf.P * z)

    def rel(coeffs):
        return np.abs(sum(c * t ** (k + 1) for k, c in enumerate(coeffs)) / target - 1.0).max()

    assert rel(gelu_cdf.COEFFS) < 1.1e-7
    assert rel(gelu_cdf.fit()) < 1.1e-7
    assert rel(gelu_cdf.fit(degree=5)) > 1e-6  # fewer terms would not be float32-accurate


def test_source_spells_the_constants_and_the_shared_density():
    src = gelu_cdf.SOURCE
    assert src.count("fmaf(r, t, ") == len(gelu_cdf.COEFFS) - 1
    assert "__fdividef(1.0f, d)" in src and "erff" not in src
    assert "gelu_pdf_term(x)" in src.split("gelu_cdf_term")[1]

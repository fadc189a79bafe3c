"""estimator_service.tails against scipy.stats, which it replaces on the estimators' import path."""

from __future__ import annotations

import numpy as np
import scipy.stats

from estimator_service import tails


def test_tail_quantiles_are_scipy_stats_bit_for_bit() -> None:
    """The gates' and consistency bounds' quantiles (every degree of freedom a window tabulates, the tails the
    backends use) equal scipy.stats' to the last bit, nan for k = 0 included; a scalar in gives a float out."""
    k = np.arange(0, 3000, dtype=float)
    for p in (1e-4, 0.025, 0.975, 1 - 1e-4, 2 * scipy.stats.norm.sf(5.0)):
        assert np.array_equal(tails.chi2_ppf(p, k), scipy.stats.chi2.ppf(p, k), equal_nan=True)
        assert np.array_equal(tails.chi2_isf(p, k), scipy.stats.chi2.isf(p, k), equal_nan=True)
        for kk in (1, 2, 3.0):
            got = tails.chi2_ppf(p, kk)
            assert isinstance(got, float) and got == scipy.stats.chi2.ppf(p, kk)
            assert tails.chi2_isf(p, kk) == scipy.stats.chi2.isf(p, kk)
    for x in (0.0, 3.0, 5.0, 7.5, -2.0):
        assert tails.norm_sf(x) == scipy.stats.norm.sf(x)
    for p in (0.5, 0.99, 1 - 1e-6, 1e-3):
        assert tails.norm_ppf(p) == scipy.stats.norm.ppf(p)

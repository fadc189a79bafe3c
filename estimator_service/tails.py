"""Tail quantiles of the χ² and normal distributions, the gates' and consistency checks' one home for them.

The same special functions scipy.stats evaluates (``chi2.ppf`` is 2·gammaincinv(k/2, p), ``chi2.isf`` is chdtri,
``norm`` is ndtr / ndtri), called directly: importing scipy.stats costs ~0.8 s of CPU, paid by every process that
builds a backend (a daemon, a test's subprocess), for four one-line formulas.  Degrees of freedom k ≤ 0 give nan,
as scipy.stats does."""

from __future__ import annotations

import numpy as np
from scipy import special


def chi2_ppf(p: float | np.ndarray, k: float | np.ndarray) -> float | np.ndarray:
    """x with P(χ²_k ≤ x) = p."""
    k = np.asarray(k, dtype=float)
    return np.where(k > 0, 2.0 * special.gammaincinv(np.maximum(k, 1e-300) / 2.0, p), np.nan)[()]


def chi2_isf(p: float | np.ndarray, k: float | np.ndarray) -> float | np.ndarray:
    """x with P(χ²_k > x) = p."""
    k = np.asarray(k, dtype=float)
    return np.where(k > 0, special.chdtri(np.maximum(k, 1e-300), p), np.nan)[()]


def norm_sf(x: float | np.ndarray) -> float | np.ndarray:
    """P(N(0, 1) > x)."""
    return special.ndtr(-np.asarray(x, dtype=float))[()]


def norm_ppf(p: float | np.ndarray) -> float | np.ndarray:
    """x with P(N(0, 1) ≤ x) = p."""
    return special.ndtri(p)

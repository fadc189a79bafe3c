"""The consistency monitor (backends/consistency.py): windowed NIS and innovation-mean tests, bounds, rewind."""

from __future__ import annotations

import numpy as np
import pytest

from estimator_service.backends.consistency import BOUNDS_TABLE, ConsistencyMonitor

RATE = 100.0  # samples per second of the simulated sensor


def feed(mon: ConsistencyMonitor, z: np.ndarray, t0: float = 0.0) -> list[str]:
    """Feed standardised innovations z (samples × rows) as one sensor's samples (S = I); the quality after each."""
    out = []
    for k, zk in enumerate(z):
        mon.add(t0 + k / RATE, 0, float(zk @ zk), zk.size, zk)
        out.append(mon.quality())
    return out


def test_white_innovations_are_rarely_flagged() -> None:
    """Consistent (white, unit-variance) innovations, 3 rows, 200 s: flagged only about as often as chance."""
    mon = ConsistencyMonitor(["imu.gyr"], window_s=0.5)
    q = feed(mon, np.random.default_rng(3).standard_normal((20000, 3)))
    assert q.count("inconsistent") / len(q) < 0.005


def test_a_steady_offset_is_flagged_by_the_mean_before_the_squares() -> None:
    """A 0.8 σ offset on one row: the NIS per row (≈ 1.2) stays inside its χ² bound (1.40), but the windowed
    mean leaves its normal bound (0.8 √50 ≈ 5.7 against 4.05) within the half-second window."""
    mon = ConsistencyMonitor(["imu.gyr"], window_s=0.5)
    z = np.random.default_rng(4).standard_normal((50, 3))
    z[:, 1] += 0.8
    q = feed(mon, z)
    stats = mon.stats()["sensors"]["imu.gyr"]
    assert stats["nis_per_row"] < stats["upper_per_row"]
    assert stats["mean_z"] > stats["mean_bound"] > 4.0
    assert q[-1] == "inconsistent"


def test_the_window_forgets_and_rewind_drops_later_samples() -> None:
    """Samples older than the window leave both sums; rewind(t) removes the samples after t."""
    mon = ConsistencyMonitor(["imu.gyr"], window_s=0.5)
    feed(mon, np.full((50, 1), 1.0))  # a mean of 1 σ: flagged
    assert mon.quality() == "inconsistent"
    feed(mon, np.zeros((60, 1)), t0=0.5)  # the window now holds only zeros
    assert mon.mean_z(0) == 0.0 and mon.quality() == "ok"
    assert feed(mon, np.full((10, 1), 3.0), t0=1.1)[-1] == "inconsistent"
    mon.rewind(1.1 - 1e-6)
    assert mon.mean_z(0) == 0.0 and mon.stats()["sensors"]["imu.gyr"]["nis_per_row"] == 0.0
    assert mon.quality() == "ok"


def test_bounds_are_the_chi2_quantiles_at_any_degrees_of_freedom() -> None:
    """The tabulated bounds (no scipy call inside a step) are χ²'s quantiles, also past the table's first size."""
    from scipy.stats import chi2

    mon = ConsistencyMonitor(["s"], alpha=1e-3)
    for dof in (1, 2, 7, 100, BOUNDS_TABLE - 1, BOUNDS_TABLE, 3 * BOUNDS_TABLE + 5, 5):
        lo, hi = mon.bounds(dof)
        assert lo == pytest.approx(chi2.ppf(1e-3, dof), rel=1e-12) and hi == pytest.approx(chi2.ppf(1 - 1e-3, dof), rel=1e-12)

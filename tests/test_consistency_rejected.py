"""The consistency window counts the samples the outlier gate rejects: a sensor being ignored is flagged."""

from __future__ import annotations

import numpy as np

from estimator_service.backends.consistency import REJECTED_MIN, REJECTED_SHARE, ConsistencyMonitor


def _fill(mon: ConsistencyMonitor, t0: float, n: int, rate_hz: float = 100.0) -> float:
    """n consistent one-row samples of sensor 0 (NIS 1, z 0); returns the time of the last."""
    t = t0
    for i in range(n):
        t = t0 + i / rate_hz
        mon.add(t, 0, 1.0, 1, np.zeros(1))
    return t


def test_every_sample_rejected_is_inconsistent():
    mon = ConsistencyMonitor(["shaft.gyr"], window_s=0.5)
    for i in range(REJECTED_MIN):
        assert mon.quality() == "ok"
        mon.reject(i * 0.01, 0)
    assert mon.inconsistent() == ("shaft.gyr",)
    assert mon.stats()["sensors"]["shaft.gyr"]["gated"] == REJECTED_MIN


def test_an_isolated_outlier_is_not_a_disagreement():
    mon = ConsistencyMonitor(["shaft.gyr"], window_s=0.5)
    t = _fill(mon, 0.0, 40)
    for k in range(REJECTED_MIN - 1):  # fewer than REJECTED_MIN in a window: not flagged, however many samples
        mon.reject(t + 0.001 * (k + 1), 0)
    assert mon.quality() == "ok"


def test_the_share_of_rejected_samples_in_the_window_decides_and_old_ones_leave():
    mon = ConsistencyMonitor(["shaft.gyr"], window_s=0.5)
    t = _fill(mon, 0.0, 50)  # 50 kept samples in the last 0.5 s
    n_flag = int(np.floor(REJECTED_SHARE * 50 / (1 - REJECTED_SHARE))) + 1  # just above the share
    for k in range(n_flag - 1):
        mon.reject(t + 1e-4 * (k + 1), 0)
    assert mon.quality() == "ok"
    mon.reject(t + 1e-4 * n_flag, 0)
    assert mon.quality() == "inconsistent"
    _fill(mon, t + 0.01, 60)  # 0.6 s of agreement later the rejections have left the window
    assert mon.quality() == "ok"


def test_rewind_forgets_rejections_after_the_time_and_their_count():
    mon = ConsistencyMonitor(["a.gyr"], window_s=0.5)
    for k in range(5):
        mon.reject(0.1 + 0.01 * k, 0)
    assert mon.inconsistent() == ("a.gyr",)
    mon.rewind(0.105)  # a filter re-runs from 0.105 s: the four later rejections are counted again then
    assert mon.gated == [1] and mon.quality() == "ok"

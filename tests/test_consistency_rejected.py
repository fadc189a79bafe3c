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


def test_a_sensor_far_noisier_than_configured_gets_its_real_noise_and_is_flagged():
    """Covariance matching (consistency.py): a gyro configured at 0.5°/s that vibrates at 18°/s (NIS per row ~1300,
    rejected or not) has its variance scaled up until its samples are consistent again, and is flagged while
    the scale says its configured σ is wrong; a consistent sensor keeps scale 1."""
    from estimator_service.backends.consistency import ADAPT_FLAG, ADAPT_WINDOW_S

    mon = ConsistencyMonitor(["shaft.gyr", "other.gyr"], window_s=0.5)
    rng = np.random.default_rng(1)
    true_var = 36.0**2  # the vibration's variance in units of the configured one
    t = 0.0
    for k in range(int(20 * ADAPT_WINDOW_S * 100)):
        t = k * 0.01
        nis = float(rng.chisquare(1) * true_var / mon.noise_scale[0])
        if nis > 30:  # the gate
            mon.reject(t, 0, nis, 1)
        else:
            mon.add(t, 0, nis, 1, np.array([np.sqrt(nis)]))
        mon.add(t, 1, float(rng.chisquare(1)), 1, np.array([rng.normal()]))
    assert mon.scale_changed
    assert mon.noise_scale[1] == 1.0
    assert true_var / 4 < mon.noise_scale[0] < true_var * 4  # matched within a factor 2 in σ
    outliers = ConsistencyMonitor(["a.gyr"], window_s=0.5)
    for k in range(int(4 * ADAPT_WINDOW_S * 100)):  # consistent, with a wild sample in four: no adaptation
        outliers.add(k * 0.01, 0, 1e6 if k % 4 == 0 else float(rng.chisquare(1)), 1, np.zeros(1))
    assert outliers.noise_scale == [1.0]
    assert mon.noise_scale[0] > ADAPT_FLAG and "shaft.gyr" in mon.inconsistent()
    assert mon.stats()["sensors"]["shaft.gyr"]["noise_scale"] == mon.noise_scale[0]


def test_the_noise_scale_comes_back_when_the_sensor_calms_down():
    from estimator_service.backends.consistency import ADAPT_WINDOW_S

    mon = ConsistencyMonitor(["a.gyr"], window_s=0.5)
    mon.noise_scale[0] = 100.0
    for k in range(int(4 * ADAPT_WINDOW_S * 100)):  # consistent with the configured σ: NIS per row 1/100 scaled
        mon.add(k * 0.01, 0, 0.01, 1, np.array([0.1]))
    assert mon.noise_scale[0] == 1.0 and mon.quality() == "ok"

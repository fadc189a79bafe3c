"""The fgs's fixed-lag smoothers (estimator_service/backends/fixed_lag.py): the generational ISAM2 and gtsam's
IncrementalFixedLagSmoother solve the same problem alike, the generational one re-eliminates only the top of
its Bayes tree, and the fgs takes gtsam's where the generations' ordering groups do not fit."""

from __future__ import annotations

from pathlib import Path

import gtsam
import numpy as np
import pytest

from estimator_service.backends.fixed_lag import GenerationalISAM2, GtsamFixedLag, fixed_lag_smoother, generations_fit
from estimator_service.bench import bench_log
from estimator_service.logfile import read_log
from estimator_service.offline import rig_of_log
from estimator_service.pipeline import Pipeline

# runs backends (or estimator subprocesses): their kernels compiled before the tests start (conftest.py)
pytestmark = pytest.mark.kernels()

DT = 0.001
DIM = 4


def _params(relinearize_threshold: float) -> gtsam.ISAM2Params:
    p = gtsam.ISAM2Params()
    p.setRelinearizeThreshold(relinearize_threshold)
    p.relinearizeSkip = 1
    p.findUnusedFactorSlots = True
    p.setFactorization("QR")
    return p


def _x(k: int) -> int:
    return gtsam.symbol("x", k)


def _run_chain(smoothers: list, updates: int, chunk: int, lag: int, late: bool, seed: int = 0) -> list[list[tuple]]:
    """A linear-Gaussian chain of DIM-vectors fed to every smoother alike, one chunk of steps per update:
    x_k = x_{k−1} + u_k (a between factor per step), every third step a second, noisier reading of the step
    (joining x_{k−1} and x_k, as the fgs's samples do), and (``late``)
    each update a reading of a step of the previous chunks still in the window, which makes ISAM2 re-eliminate
    older generations.  Returns per smoother, per update: (newest estimate, its marginal covariance, keys in
    the window, re-eliminated variables, factor slots)."""
    rng = np.random.default_rng(seed)
    step_noise = gtsam.noiseModel.Diagonal.Sigmas(np.linspace(0.01, 0.04, DIM))
    read_noise = gtsam.noiseModel.Diagonal.Sigmas(np.full(DIM, 0.1))
    truth = np.zeros(DIM)
    out: list[list[tuple]] = [[] for _ in smoothers]
    graph, values, stamps = gtsam.NonlinearFactorGraph(), gtsam.Values(), {}
    graph.add(gtsam.PriorFactorVector(_x(0), np.zeros(DIM), gtsam.noiseModel.Isotropic.Sigma(DIM, 1.0)))
    values.insert(_x(0), np.zeros(DIM))
    stamps[_x(0)] = 0.0
    k = 0
    for u in range(updates):
        for _ in range(chunk if u else chunk - 1):
            k += 1
            step = rng.normal(0.0, 0.02, DIM)
            truth = truth + step
            graph.add(gtsam.BetweenFactorVector(_x(k - 1), _x(k), step + rng.normal(0.0, 0.01, DIM), step_noise))
            if k % 3 == 0:
                graph.add(gtsam.BetweenFactorVector(_x(k - 1), _x(k), step + rng.normal(0.0, 0.1, DIM), read_noise))
            values.insert(_x(k), truth + rng.normal(0.0, 0.05, DIM))
            stamps[_x(k)] = k * DT
        if late and u >= 3:
            j = k - chunk - int(rng.integers(1, lag - chunk))  # a step of an older chunk, inside the window
            graph.add(gtsam.PriorFactorVector(_x(j), rng.normal(0.0, 0.1, DIM), read_noise))
        for s, rows in zip(smoothers, out, strict=True):
            s.update(graph, values, stamps)
            rows.append((s.calculate_estimate().atVector(_x(k)), s.marginal_covariance(_x(k)), s.key_count(),
                         s.reeliminated(), s.factor_slots()))
        graph, values, stamps = gtsam.NonlinearFactorGraph(), gtsam.Values(), {}
    return out


@pytest.mark.parametrize("chunk, lag, relinearize_threshold", [(10, 20, 1e9), (10, 20, 1e-3), (7, 20, 1e-3), (10, 25, 1e-3),
                                                             (6, 12, 1e-3)])
def test_generational_and_gtsam_smoothers_agree_with_late_readings(chunk: int, lag: int, relinearize_threshold: float) -> None:
    """Linear factors: marginalisation is exact, so both smoothers give the newest variable the same posterior,
    whichever keys each re-eliminates, marginalises or relinearises (a threshold of 1e-3 relinearises
    variables deep in the window: their re-elimination must keep the generation order, or marginalising a
    non-leaf would leave ISAM2 wrong without an error), at every ratio of lag to chunk where the generations'
    ordering groups fit (fewer would make ccolamd fail)."""
    assert generations_fit(lag, chunk)
    gen = GenerationalISAM2(lag * DT, _params(relinearize_threshold), 0.5 * DT)
    ref = GtsamFixedLag(lag * DT, _params(relinearize_threshold))
    mine, theirs = _run_chain([gen, ref], 300, chunk, lag, late=True)
    for (x, P, keys, _, slots), (x_ref, P_ref, _, _, _) in zip(mine, theirs, strict=True):
        np.testing.assert_allclose(x, x_ref, rtol=0, atol=1e-9)
        np.testing.assert_allclose(P, P_ref, rtol=1e-9, atol=1e-15)
        assert keys <= lag + chunk
        assert slots <= 4 * (lag + chunk)


def test_generational_smoother_reeliminates_only_the_new_generation_and_the_root() -> None:
    """Without late readings or relinearisation an update re-eliminates its new keys and the root clique it
    attaches to (measured: 13 = 10 + the root's 3); gtsam's re-eliminates the keys it marginalises and the path
    from them to the root as well (measured: 13, 25 and 50 in turn; 22 on average in the fgs)."""
    chunk, lag = 10, 20
    gen = GenerationalISAM2(lag * DT, _params(1e9), 0.5 * DT)
    ref = GtsamFixedLag(lag * DT, _params(1e9))
    mine, theirs = _run_chain([gen, ref], 100, chunk, lag, late=False)
    assert max(r[3] for r in mine[5:]) <= chunk + 3
    assert all(r[2] == lag + 1 for r in mine[5:])  # the last lag steps, both ends included
    assert np.mean([r[3] for r in theirs[5:]]) >= lag


def test_generational_smoother_refuses_updates_its_ordering_groups_do_not_fit() -> None:
    """Two new keys per update against a lag of 20 steps: ccolamd would be handed group numbers beyond its
    bound (measured: a heap corruption in gtsam), so the update raises before ISAM2 sees it."""
    assert not generations_fit(20, 2)
    gen = GenerationalISAM2(20 * DT, _params(0.5), 0.5 * DT)
    with pytest.raises(ValueError, match="generations_fit"):
        _run_chain([gen], 50, 2, 20, late=False)
    with pytest.raises(ValueError):
        gen.update(gtsam.NonlinearFactorGraph(), gtsam.Values(), {})


def test_the_fgs_takes_gtsams_smoother_where_the_generations_do_not_fit() -> None:
    """ccolamd takes a group number only up to the count of keys it orders (≥ one more than an update's new
    keys): ⌈lag / chunk⌉ generation groups must fit."""
    assert generations_fit(20, 10) and generations_fit(20, 7) and not generations_fit(20, 6) and not generations_fit(20, 1)
    assert isinstance(fixed_lag_smoother(20, 10, DT, _params(0.5)), GenerationalISAM2)
    assert isinstance(fixed_lag_smoother(20, 2, DT, _params(0.5)), GtsamFixedLag)


def test_fgs_tracks_the_public_scenario_on_gtsams_smoother_as_well(sim_log_10s: Path) -> None:
    """Two steps per update (gtsam's smoother) against the default ten (the generational one): the same
    accuracy bound as the public scenario's test (test_backends.py)."""
    reader = read_log(sim_log_10s)
    rig = rig_of_log(reader.header, sim_log_10s)
    for chunk, kind in ((10, GenerationalISAM2), (2, GtsamFixedLag)):
        rig.estimator.fgs.update({"chunk_steps": chunk})
        backend = Pipeline(rig, "fgs").backend
        backend.initialize(0.0, backend.model.q0, np.zeros(backend.model.n))
        assert isinstance(backend._smoother, kind)
    rec = bench_log(sim_log_10s, "fgs", "gyros", {"chunk_steps": 2})
    assert rec.rmse_crank_deg is not None and rec.rmse_crank_deg <= 0.25
    assert rec.steps >= 9990

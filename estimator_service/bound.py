"""The best accuracy any estimator can expect on a simulated log: the posterior Cramér–Rao bound.

For a state model with additive Gaussian noise, the Bayesian information matrix J of the state obeys
the Riccati recursion of the extended Kalman filter with every Jacobian taken at the *true* state
(Tichavský, Muravchik & Nehorai, IEEE Trans. Signal Process. 46(5), 1998):
J⁺ = (Q + F J⁻¹ Fᵀ)⁻¹ + Hᵀ R⁻¹ H, J₀ = P₀⁻¹.  Its inverse bounds the mean squared error of *any*
estimator that shares the model, the prior P₀ and the noise densities Q, R, averaged over draws of the
prior, the process noise and the sensor noise: E[(ẑ − z)²] ≥ (J⁻¹)_zz at every step.

Here that recursion is the filters' own (backends/filter.py: state x = [z, ż, c, b, η, p], the same
F, H, process noise and priors as ``rigstate estimate``), run on a log that carries ``truth/state``
with the mean reset to the true augmented state before every prediction and update:
- z, ż from ``truth/state`` (the sample nearest each time; the log's truth rate is 1 kHz),
- c: the simulation's unmodelled joint dampers as the viscous coefficient on each DOF at the true
  point, b = 0,
- the sensor parameters: the simulated gyro/accelerometer biases and IMU stamping lags,
- the model's parameter errors η at 0 (the Jacobians' dependence on them is second order).
Gating, force jumps and re-initialisations are off: the bound uses every sample.

What it answers: the crank RMSE that no estimator with these priors can beat *on average* over the
scenario's unknowns.  One simulated run is one draw (e.g. a start exactly 1° off against a prior σ of
1.7°), so a single run's error may fall below the bound; across draws it cannot.  Memory: the truth is
read alongside the run from a second reader of the same log and kept for ``KEEP_S`` seconds (and at
most 4096 samples more) only.
"""

from __future__ import annotations

import bisect
import copy
import math
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from estimator_service import schema
from estimator_service.bench import Accuracy
from estimator_service.backends.ekf import ExtendedKalmanFilter
from estimator_service.backends.sensor_params import SensorParams
from estimator_service.dofs import dofs_of
from estimator_service.errors import UserError
from estimator_service.logfile import read_log
from estimator_service.model import Model
from estimator_service.offline import rig_of_log, run_log
from estimator_service.pipeline import Pipeline
from estimator_service.rig import Rig

#: seconds of truth kept behind the newest time asked for (late-data re-runs go back ``history_s``)
KEEP_S = 1.0

#: edges (s) of the windows the bound is reported over (the last one is open)
WINDOWS_S = (0.0, 1.0, 2.0, 5.0, 10.0)

#: the smoother's keys that set the same state model's priors and noise as the filters' keys
FGS_AS_FILTER = {"prior_sigma_q": "init_sigma_z", "prior_sigma_qd": "init_sigma_zd",
                 "prior_sigma_damping": "init_sigma_damping", "prior_sigma_force": "init_sigma_force",
                 "sigma_damping_rw": "sigma_damping", "sigma_force_rw": "sigma_force",
                 "estimate_force": "estimate_force"}


class TruthCursor:
    """``truth/state`` of a log, read forward on demand: (z, ż) at the sample nearest a time.

    Times asked for may go back at most ``KEEP_S`` behind the newest one asked for.
    """

    def __init__(self, log_path: str | Path) -> None:
        self._records: Iterator = (r for r in read_log(log_path) if r.topic == "truth/state")
        self._t: list[float] = []  # sample times, increasing; [_lo:] are kept
        self._state: list[tuple[np.ndarray, np.ndarray]] = []
        self._lo = 0
        self._done = False

    def _pull(self) -> bool:
        for rec in self._records:
            m = schema.decode("truth/state", rec.payload)
            self._t.append(float(m["t"]))
            self._state.append((np.asarray(m["z"], float), np.asarray(m["zd"], float)))
            return True
        self._done = True
        return False

    def at(self, t: float) -> tuple[np.ndarray, np.ndarray]:
        """(z, ż) of the truth sample nearest ``t`` (s)."""
        while (len(self._t) == self._lo or self._t[-1] < t) and not self._done and self._pull():
            pass
        if len(self._t) == self._lo:
            raise ValueError("the log has no truth/state")
        lo = bisect.bisect_left(self._t, t - KEEP_S, self._lo)
        if lo > self._lo + 4096:  # forget what is older than KEEP_S, in batches
            del self._t[:lo], self._state[:lo]
            self._lo = 0
        i = bisect.bisect_left(self._t, t, self._lo)
        if i == len(self._t) or (i > self._lo and t - self._t[i - 1] <= self._t[i] - t):
            i -= 1
        return self._state[i]


def sensor_truth(rig: Rig, names: list[str]) -> np.ndarray:
    """The true values of the sensor-parameter states ``names`` (backends/sensor_params.py order): the
    simulated gyro biases (rad/s) and accelerometer biases (m/s²) less the rig's known ``*_bias_cal``,
    the stamp lag the rig does not state (``[simulation] stamp_offset_s``, s; the stated
    ``time_offset_s`` is taken off by the pipeline) and the true mount angle less the stated one
    (``[simulation.mount_deg]``, rad)."""
    values: dict[str, float] = {}
    for imu in rig.imus:  # the states hold what the rig's known calibration and time offset leave
        for a in range(3):
            values[f"{imu.name}.gyr_bias[{a}]"] = float(imu.gyr.bias[a] - imu.gyr_bias_cal[a])
            values[f"{imu.name}.acc_bias[{a}]"] = float(imu.acc.bias[a] - imu.acc_bias_cal[a])
        values[f"{imu.name}.time_offset"] = rig.simulation.stamp_offset_s.get(imu.name, 0.0)
        values[f"{imu.name}.mount"] = rig.simulation.mount.get(imu.name, imu.mount) - imu.mount
    return np.array([values.get(n, 0.0) for n in names])


class TruthLinearisedEkf(ExtendedKalmanFilter):
    """The EKF whose mean is the truth: its covariance is the posterior Cramér–Rao bound.

    ``truth``: where (z, ż) come from; ``truth_model``: the simulated mechanism (with its dampers);
    ``p_true``: the sensor parameters' true values.  ``variances`` collects (t, diag P of z) of every
    estimate; its reader empties it.
    """

    name = "ekf"

    def __init__(self, model: Model, sensors: list, config, truth: TruthCursor, truth_model: Model,
                 p_true: np.ndarray) -> None:
        super().__init__(model, sensors, config)
        self._truth, self._truth_model, self._p_true = truth, truth_model, p_true
        # a mount the simulation sets off its stated value is released by the estimators' test within its first
        # samples (backends/mount_test.py): the bound is that of the mount free within its prior from the start
        self.mounts.released.update(k for k in self.mounts.columns if p_true[k] != 0.0)
        self._tt = 0.0
        self.variances: deque[tuple[float, np.ndarray]] = deque()

    def _unmodelled_damping(self, q: np.ndarray, qd: np.ndarray, R: np.ndarray) -> np.ndarray:
        """Viscous coefficient per DOF (g,) of the dampers the truth has and the model has not, at q."""
        d = self._truth_model.Q_jac(q, qd)[1] - self.model.Q_jac(q, qd)[1]
        return -np.diag(R.T @ d @ R)

    def _to_truth(self) -> None:
        g = self.model.g
        z, zd = self._truth.at(self._tt)
        x = np.zeros(self.L)
        x[:g], x[g : 2 * g] = z, zd
        x[self.nd :] = self._p_true
        self.x, self.point = x, self.point_of(x, self.point)
        if self.params.estimate_force:
            x[2 * g : 3 * g] = self._unmodelled_damping(self.point.q, self.point.qd, self.point.R)
            self.point = self.point_of(x, self.point)

    def initialize(self, t0: float, q: np.ndarray, qd: np.ndarray) -> None:
        super().initialize(t0, q, qd)
        self._tt = t0
        self._to_truth()

    def predict(self, h: float, propagate: bool = True) -> None:
        super().predict(h, propagate)
        self._tt += h
        self._to_truth()

    def update(self, group: list, h: float = 0.0) -> None:
        if h > 0.0:  # (the mean's transition through predict: the truth's time and state follow it)
            self.predict(h, propagate=False)
        super().update(group)
        self._to_truth()  # the next prediction starts from the truth again

    def _snapshot(self) -> tuple:
        return super()._snapshot(), self._tt

    def _restore(self, s: tuple) -> None:
        super()._restore(s[0])
        self._tt = s[1]

    def _estimate(self, t: float):
        g = self.model.g
        self.variances.append((t, np.diag(self.P)[:g].copy()))
        return super()._estimate(t)


@dataclass
class BoundRecord:
    """The bound of one log under one backend's priors: RMSE per DOF over the moving part (° or m,
    as ``rigstate bench`` reports errors), and per time window (``WINDOWS_S``)."""

    config: str
    priors: str
    steps: int
    rmse_dof: dict[str, float]
    windows: dict[str, dict[str, float]] = field(default_factory=dict)


def filter_table(rig: Rig, priors: str) -> dict:
    """The filter table ([estimator.ekf] keys) that carries backend ``priors``' priors and noise."""
    if priors != "fgs":
        return dict(getattr(rig.estimator, priors, {}) or {})
    from estimator_service.backends.fgs import FgsParams

    p = FgsParams.from_dict(rig.estimator.source, "estimator.fgs", rig.estimator.fgs or {})
    out = {key: getattr(p, fgs_key) for fgs_key, key in FGS_AS_FILTER.items()}
    out["sigma_zd"] = p.sigma_acc * math.sqrt(rig.estimator.dt)  # per-step acceleration σ as a density
    return out


def bound_log(log_path: str | Path, label: str, priors: str = "ekf", rig: Rig | None = None) -> BoundRecord:
    """The posterior Cramér–Rao bound of a log with ``truth/state`` under backend ``priors``' priors
    (ekf, ukf, errekf: their table; fgs: its priors and noise mapped onto the same state model).
    ``rig``: the rig to use instead of the log's own (e.g. with other sensors fused)."""
    if not any(r.topic == "truth/state" for r in read_log(log_path)):
        raise UserError(f"{log_path}: no truth/state in this log: the bound needs the true states of a "
                        "simulated log (rigstate simulate, or bench --scenarios)")
    reader = read_log(log_path)
    rig = rig or rig_of_log(reader.header, log_path)
    table = filter_table(rig, priors)
    table.update(gate_nis=0.0, jump_after=0, nis_limit=math.inf, outliers_to_reinit=2**62)
    rig = copy.copy(rig)  # the caller's rig keeps its tables
    rig.estimator = replace(rig.estimator, ekf=table)
    truth_model = rig.truth_model()

    def make(model: Model, sensors: list, config) -> TruthLinearisedEkf:
        return TruthLinearisedEkf(model, sensors, config, TruthCursor(log_path), truth_model,
                                  sensor_truth(rig, SensorParams(sensors).names))

    pipe = Pipeline(rig, "ekf", backend_factory=make)
    backend = pipe.backend
    dofs = dofs_of(pipe.model)
    moving = Accuracy(dofs, pipe.dt)
    edges = list(WINDOWS_S) + [math.inf]
    win = np.zeros((len(edges) - 1, len(dofs)))
    count = np.zeros(len(edges) - 1)
    truth = TruthCursor(log_path)
    for rec in run_log(pipe, iter(reader)):
        if rec.topic != "est/state":
            continue
        while backend.variances:
            t, var = backend.variances.popleft()
            moving.add_squared(var.tolist(), 0.0, 1, truth.at(t)[1])
            k = int(np.searchsorted(edges, t, side="right")) - 1
            win[k] += var
            count[k] += 1
    rmse = moving.result()[0]
    windows = {}
    for k in range(len(edges) - 1):
        if count[k]:
            name = f"{edges[k]:g}-{edges[k + 1]:g} s" if math.isfinite(edges[k + 1]) else f"{edges[k]:g} s-"
            windows[name] = {d.name: float(d.shown(math.sqrt(win[k, i] / count[k]))) for i, d in enumerate(dofs)}
    return BoundRecord(config=label, priors=priors, steps=pipe.steps, rmse_dof=rmse, windows=windows)

"""Discrete extended Kalman filter in independent coordinates (Sensors 2016 §3.3.1), and the
transition/measurement model it shares with the UKF.

State x = [z, ż, c, b] (4g): independent coordinates and rates, plus an unknown generalized force
on the DOF, τ = b − c ⊙ ż (viscous coefficient c, bias b; random walks), which absorbs bearing
friction the model does not know (set ``estimate_force = false`` for the paper's plain [z, ż]).
Transition: ż, z̈ = M̄⁻¹Q̄ (R-matrix, via the model) integrated by Heun's method (``integrator =
"heun"``, default) or explicit Euler (``"euler"``, as in the paper; measurably less accurate), with
the analytic Jacobian chained through the integrator.  The filter keeps the full q of the last
estimate as the Newton start of the position problem, so the assembly branch is kept.  A
measurement at t_m inside a step is used at t_m: predict to t_m, update, predict the rest.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import numpy as np

from estimator_service.backends.base import Backend, Estimate, Measurement, params_from_dict
from estimator_service.model import AssemblyError, Model

log = logging.getLogger(__name__)


@dataclass
class FilterParams:
    """Parameters of the EKF and UKF (rig TOML tables ``[estimator.ekf]`` / ``[estimator.ukf]``).

    Process noise values are continuous-time densities: the variance added per step is σ² Δt.
    """

    integrator: str = "heun"  #: "heun" (2nd order) or "euler" (the paper's; costs accuracy)
    sigma_z: float = 1e-4  #: process noise on z (rad/√s or m/√s)
    sigma_zd: float = 0.02  #: process noise on ż (rad/s/√s or m/s/√s)
    estimate_force: bool = True  #: augment the state with the unknown DOF force (c, b)
    sigma_damping: float = 1e-4  #: random walk of c (N·m·s/rad per √s)
    sigma_force: float = 5e-4  #: random walk of b (N·m/√s)
    init_sigma_z: float = 0.03  #: initial standard deviation of z (rad or m)
    init_sigma_zd: float = 0.05  #: initial standard deviation of ż
    init_sigma_damping: float = 0.05  #: initial standard deviation of c
    init_sigma_force: float = 0.1  #: initial standard deviation of b
    reinit_sigma_zd: float = 2.0  #: standard deviation of ż after a re-initialisation
    nis_limit: float = 100.0  #: normalised innovation squared per measurement row counted as an outlier
    outliers_to_reinit: int = 20  #: consecutive outlier updates that mean divergence
    max_constraint_residual: float = 1e-3  #: |Φ| above this (or NaN) means divergence
    max_rate: float = 100.0  #: |ż| above this (rad/s or m/s) means divergence
    position_tol: float = 1e-10  #: position-problem tolerance (relative, see Model.solve_position)
    alpha: float = 1.0  #: UKF Merwe sigma-point spread (small values give huge negative weights: fragile)
    beta: float = 2.0  #: UKF prior-distribution parameter (2 for Gaussian)
    kappa: float = 0.0  #: UKF secondary scaling
    covariance_step_s: float = 0.01  #: longest interval the covariance is propagated over at once (s)

    @classmethod
    def from_dict(cls, file: str, section: str, d: dict) -> "FilterParams":
        """Build from a TOML table (ConfigError on unknown keys and bad values)."""
        return params_from_dict(cls, file, section, d, frozenset({"alpha", "position_tol", "covariance_step_s"}),
                                {"integrator": ("heun", "euler")})


class IndependentFilter(Backend):
    """Shared machinery of the EKF and UKF: the state, transition and measurement models."""

    section = ""

    def __init__(self, model: Model, sensors: list, config) -> None:
        super().__init__(model, sensors, config)
        self.params = FilterParams.from_dict(config.source, f"estimator.{self.section}", getattr(config, self.section, {}) or {})
        g = model.g
        self.L = 4 * g if self.params.estimate_force else 2 * g
        p = self.params
        q_cont = [p.sigma_z] * g + [p.sigma_zd] * g
        if p.estimate_force:
            q_cont += [p.sigma_damping] * g + [p.sigma_force] * g
        self._Qc = np.diag(np.square(q_cont))
        self._pending: list[Measurement] = []
        self.x = np.zeros(self.L)
        self.P = np.eye(self.L)
        self.q = model.q0.copy()
        self._outliers = 0
        self._consistent_key: bytes | None = None
        self._consistent_val: tuple[np.ndarray, np.ndarray] = (self.q, self.q)

    # ------------------------------------------------------------------ model pieces
    def tau(self, x: np.ndarray) -> np.ndarray | None:
        """Generalized forces (n,) of the unknown DOF force in state x."""
        if not self.params.estimate_force:
            return None
        g, tau = self.model.g, np.zeros(self.model.n)
        tau[self.model.dof] = x[3 * g :] - x[2 * g : 3 * g] * x[g : 2 * g]
        return tau

    def consistent(self, x: np.ndarray, q_hint: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(q, q̇) of state x: position problem from ``q_hint`` (keeps the branch), q̇ = R ż.

        The last result is reused for the same x (prediction, update and output share states).
        """
        key = x[: 2 * self.model.g].tobytes()
        if key == self._consistent_key:
            return self._consistent_val
        g = self.model.g
        q = self.model.solve_position(q_hint, x[:g], tol=self.params.position_tol)
        out = (q, self.model.solve_velocity(q, x[g : 2 * g]))
        self._consistent_key, self._consistent_val = key, out
        return out

    def deriv(self, x: np.ndarray, q_hint: np.ndarray, jac: bool) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
        """(ẋ, ∂ẋ/∂x or None, q) at state x."""
        m, g = self.model, self.model.g
        q, qd = self.consistent(x, q_hint)
        xdot = np.zeros(self.L)
        xdot[:g] = x[g : 2 * g]
        if not jac:
            xdot[g : 2 * g] = m.forward_dynamics(q, qd, self.tau(x))[m.dof]
            return xdot, None, q
        j = m.state_jacobians(q, qd, self.tau(x))
        xdot[g : 2 * g] = j.qdd[m.dof]
        A = np.zeros((self.L, self.L))
        A[:g, g : 2 * g] = np.eye(g)
        dqdd = self._dqdd_dx(x, j)
        A[g : 2 * g] = dqdd[m.dof]
        return xdot, A, q

    def _dqdd_dx(self, x: np.ndarray, j) -> np.ndarray:
        """∂q̈/∂x (n, L) from the model's state Jacobians."""
        m, g = self.model, self.model.g
        out = np.zeros((m.n, self.L))
        out[:, :g] = j.dqdd_dq @ j.R + j.dqdd_dqd @ j.dqd_dz
        out[:, g : 2 * g] = j.dqdd_dqd @ j.R
        if self.params.estimate_force:
            G = j.dqdd_dtau[:, m.dof]
            out[:, g : 2 * g] -= G * x[2 * g : 3 * g]
            out[:, 2 * g : 3 * g] = -G * x[g : 2 * g]
            out[:, 3 * g :] = G
        return out

    def transition(self, x: np.ndarray, h: float, jac: bool) -> tuple[np.ndarray, np.ndarray | None]:
        """State after h seconds (Heun or Euler) and its Jacobian F = ∂x⁺/∂x.

        For Heun, F = I + hA + h²/2 A² with A = ∂ẋ/∂x at the start of the step: the Heun map's
        exact Jacobian up to O(h³), for one Jacobian evaluation instead of two.
        """
        k1, A1, q1 = self.deriv(x, self.q, jac)
        if self.params.integrator == "euler":
            return x + h * k1, (np.eye(self.L) + h * A1) if jac else None
        xp = x + h * k1
        k2, _, _ = self.deriv(xp, q1, False)
        x_new = x + 0.5 * h * (k1 + k2)
        if not jac:
            return x_new, None
        hA = h * A1
        return x_new, np.eye(self.L) + hA + 0.5 * hA @ hA

    def predict_measurement(self, x: np.ndarray, sensor_ids: list[int], jac: bool) -> tuple[np.ndarray, np.ndarray | None]:
        """Stacked predicted readings of the given sensors at state x, and ∂y/∂x."""
        m, g = self.model, self.model.g
        q, qd = self.consistent(x, self.q)
        if jac:
            j = m.state_jacobians(q, qd, self.tau(x))
            qdd, dqdd = j.qdd, self._dqdd_dx(x, j)
            dq = np.zeros((m.n, self.L))
            dq[:, :g] = j.R
            dqd = np.zeros((m.n, self.L))
            dqd[:, :g] = j.dqd_dz
            dqd[:, g : 2 * g] = j.R
        else:
            qdd = m.forward_dynamics(q, qd, self.tau(x))
        ys, Hs = [], []
        for i in sensor_ids:
            y, H_q, H_qd, H_qdd = self.sensors[i].h(q, qd, qdd)
            ys.append(y)
            if jac:
                Hs.append(H_q @ dq + H_qd @ dqd + H_qdd @ dqdd)
        return np.concatenate(ys), (np.vstack(Hs) if jac else None)

    def innovation(self, y_meas: np.ndarray, y_pred: np.ndarray, sensor_ids: list[int]) -> np.ndarray:
        """y − h(x), with angles (encoders, inclinations) wrapped to (−π, π]."""
        e = y_meas - y_pred
        r = 0
        for i in sensor_ids:
            s = self.sensors[i]
            if s.kind in ("enc", "incl"):
                e[r : r + s.dim] = (e[r : r + s.dim] + math.pi) % (2 * math.pi) - math.pi
            r += s.dim
        return e

    # ------------------------------------------------------------------ Backend interface
    def initialize(self, t0: float, q: np.ndarray, qd: np.ndarray) -> None:
        super().initialize(t0, q, qd)
        m, g, p = self.model, self.model.g, self.params
        self.q = q.copy()
        self.x = np.zeros(self.L)
        self.x[:g], self.x[g : 2 * g] = q[m.dof], qd[m.dof]
        sig = [p.init_sigma_z] * g + [p.init_sigma_zd] * g
        if p.estimate_force:
            sig += [p.init_sigma_damping] * g + [p.init_sigma_force] * g
        self.P = np.diag(np.square(sig))
        self._pending = []
        self._outliers = 0
        self._good = (t0, q.copy(), qd.copy())

    def add_measurement(self, m: Measurement) -> None:
        self._pending.append(m)
        self.note_measurement(m)

    def step(self) -> list[Estimate]:
        t_end = self.t + self.dt
        due = sorted((m for m in self._pending if m.t <= t_end + 1e-12), key=lambda m: m.t)
        self._pending = [m for m in self._pending if m.t > t_end + 1e-12]
        try:
            t = self.t
            i = 0
            while i < len(due):
                t_m = max(due[i].t, t)
                group = [mm for mm in due[i:] if abs(max(mm.t, t) - t_m) < 1e-9]
                i += len(group)
                if t_m > t + 1e-12:
                    self.predict(t_m - t)
                    t = t_m
                self.update(group)
            if t_end > t + 1e-12:
                self.predict(t_end - t)
            self.t = t_end
            q, qd = self.consistent(self.x, self.q)
            self.q = q
            g = self.model.g
            if not (np.all(np.isfinite(self.x)) and np.all(np.isfinite(self.P))) or \
                    np.abs(self.model.Phi(q)).max() > self.params.max_constraint_residual:
                raise FloatingPointError("NaN or constraint blow-up")
            if np.abs(self.x[g : 2 * g]).max() > self.params.max_rate:
                raise FloatingPointError(f"rate {self.x[g:2 * g]} beyond max_rate")
            if self._outliers >= self.params.outliers_to_reinit:
                raise FloatingPointError(f"{self._outliers} consecutive outlier innovations")
        except (FloatingPointError, AssemblyError, np.linalg.LinAlgError) as exc:
            return [self._reinitialize(str(exc), t_end)]
        if self._outliers == 0:  # a state the sensors agree with: the restart point after a divergence
            self._good = (self.t, q.copy(), qd.copy())
        g = self.model.g
        return [self.make_estimate(self.t, q, qd, self.P[: 2 * g, : 2 * g].copy())]

    def _reinitialize(self, why: str, t: float) -> Estimate:
        """Restart from the last good state with a wide covariance (rates unknown: ±reinit_sigma_zd)."""
        log.warning("%s: divergence (%s); re-initialising from the last good state", self.name, why)
        _, q, qd = self._good
        pending = self._pending
        self.initialize(t, q, qd)
        g = self.model.g
        self.P[g : 2 * g, g : 2 * g] = np.eye(g) * self.params.reinit_sigma_zd**2
        self._pending = pending
        self.mark_reinit(why)
        return self.make_estimate(t, q, qd, self.P[: 2 * g, : 2 * g].copy())

    def count_outlier(self, nis: float, rows: int) -> None:
        """Track consecutive updates whose normalised innovation is far out of bounds."""
        self._outliers = self._outliers + 1 if nis > self.params.nis_limit * rows else 0

    def predict(self, h: float) -> None:
        """Advance the mean by h seconds; the covariance follows once per interval (see subclasses)."""
        self._begin_interval()
        self.x, _ = self.transition(self.x, h, jac=False)
        self.q, _ = self.consistent(self.x, self.q)
        self._interval_h += h
        if self._interval_h >= self.params.covariance_step_s - 1e-12:
            self._propagate_covariance()

    def _begin_interval(self) -> None:
        """Remember what the covariance propagation of the interval starting now needs."""
        raise NotImplementedError

    def _propagate_covariance(self) -> None:
        """Propagate P over the interval since its start (no-op if none is open)."""
        raise NotImplementedError

    def update(self, group: list[Measurement]) -> None:
        raise NotImplementedError


class ExtendedKalmanFilter(IndependentFilter):
    """DEKF: linearised transition and measurement models, Joseph-form covariance update.

    The mean advances every step; the covariance over intervals of up to ``covariance_step_s``
    (and always up to each measurement) with F = I + HA + (HA)²/2, A = ∂ẋ/∂x at the interval start.
    """

    name = "ekf"
    section = "ekf"

    def initialize(self, t0: float, q: np.ndarray, qd: np.ndarray) -> None:
        super().initialize(t0, q, qd)
        self._A: np.ndarray | None = None
        self._interval_h = 0.0

    def _begin_interval(self) -> None:
        if self._A is None:
            _, self._A, _ = self.deriv(self.x, self.q, jac=True)

    def _propagate_covariance(self) -> None:
        if self._A is None:
            return
        HA = self._interval_h * self._A
        F = np.eye(self.L) + HA + 0.5 * HA @ HA
        self.P = F @ self.P @ F.T + self._Qc * self._interval_h
        self.P = 0.5 * (self.P + self.P.T)
        self._A, self._interval_h = None, 0.0

    def update(self, group: list[Measurement]) -> None:
        self._propagate_covariance()
        ids = [m.sensor for m in group]
        y_pred, H = self.predict_measurement(self.x, ids, jac=True)
        e = self.innovation(np.concatenate([m.y for m in group]), y_pred, ids)
        Rm = np.diag(np.concatenate([np.square(self.sensors[i].sigma) for i in ids]))
        S = H @ self.P @ H.T + Rm
        K = np.linalg.solve(S, H @ self.P).T
        self.count_outlier(float(e @ np.linalg.solve(S, e)), len(e))
        self.x = self.x + K @ e
        I_KH = np.eye(self.L) - K @ H
        self.P = I_KH @ self.P @ I_KH.T + K @ Rm @ K.T
        self.q, _ = self.consistent(self.x, self.q)

"""Fixed-lag factor-graph smoother on gtsam (factor-graph paper §5–6), dependent coordinates.

One variable per 1 ms step: x_k = [q_k, q̇_k, q̈_k] (3n).  One *fused* CustomFactor per step joins
x_{k-1} and x_k and stacks every residual of that step, each row with its own sigma:

=========================  =====================================================  ===========
residual                   definition                                              rows
=========================  =====================================================  ===========
trapezoidal, positions     q_k − q_{k−1} − Δt/2 (q̇_{k−1} + q̇_k)                    n
trapezoidal, velocities    q̇_k − q̇_{k−1} − Δt/2 (q̈_{k−1} + q̈_k)                   n
position constraints       Φ(q_k)                                                  m
velocity constraints       Φ_q(q_k) q̇_k                                            m
dynamics                   q̈_k − f(q_k, q̇_k)   (KKT forward dynamics)              n
each measurement j         h_j(x(t_j)) − y_j,  x(t_j) = (1−α) x_{k−1} + α x_k      dim_j
=========================  =====================================================  ===========

with α = (t_j − t_{k−1})/Δt, so a sample between two steps is used at its own time.  The graph is
solved by gtsam's ``IncrementalFixedLagSmoother`` (ISAM2) with marginalisation of the variables
older than the window.  Several steps are added per ISAM2 update (``chunk_steps``), which amortises
the update cost; the declared output latency is the chunk length plus ``output_delay_ms``.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from dataclasses import dataclass, fields

import gtsam
import numpy as np

from estimator_service.backends.base import Backend, Estimate, Measurement
from estimator_service.errors import ConfigError
from estimator_service.model import Model

log = logging.getLogger(__name__)


@dataclass
class FgsParams:
    """Parameters of the smoother (rig TOML table ``[estimator.fgs]``).

    Sigmas are standard deviations of the residual rows listed in the module docstring, in the
    residual's units (m, m/s, m², m²/s, m/s² or rad, rad/s, rad/s² per coordinate kind).
    """

    window_ms: float = 20.0  #: smoother lag (ms); variables older than this are marginalised
    chunk_steps: int = 10  #: 1 ms steps added per ISAM2 update (10 = once per 100 Hz IMU sample)
    output_delay_ms: float = 0.0  #: emit the estimate this far behind the newest step (≤ window)
    sigma_int_q: float = 1e-5  #: trapezoidal position integrator
    sigma_int_qd: float = 1e-4  #: trapezoidal velocity integrator
    sigma_pc: float = 1e-5  #: position constraints Φ(q)
    sigma_vc: float = 1e-4  #: velocity constraints Φ_q q̇
    sigma_dyn: float = 3.0  #: dynamics q̈ − f(q, q̇): unmodelled forces (process noise)
    prior_sigma_q: float = 0.02  #: prior on q at initialisation (m / rad)
    prior_sigma_qd: float = 0.05  #: prior on q̇ at initialisation (m/s / rad/s)
    prior_sigma_qdd: float = 10.0  #: prior on q̈ at initialisation
    relinearize_threshold: float = 0.5  #: ISAM2 relinearisation threshold
    max_constraint_residual: float = 1e-3  #: |Φ| above this is divergence (→ re-initialisation)

    @classmethod
    def from_dict(cls, file: str, section: str, d: dict) -> "FgsParams":
        """Build from a TOML table; unknown keys and non-positive values raise ConfigError."""
        known = {f.name: f for f in fields(cls)}
        out = cls()
        for key, value in d.items():
            if key not in known:
                raise ConfigError(file, f"{section}.{key}", f"unknown key; known keys: {sorted(known)}")
            typ = int if known[key].type in ("int", int) else float
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ConfigError(file, f"{section}.{key}", f"expected a number, got {value!r}")
            if value < 0 or (value == 0 and key != "output_delay_ms"):
                raise ConfigError(file, f"{section}.{key}", f"must be > 0, got {value!r}")
            setattr(out, key, typ(value))
        if out.output_delay_ms > out.window_ms:
            raise ConfigError(file, f"{section}.output_delay_ms", f"must be <= window_ms ({out.window_ms}), got {out.output_delay_ms}")
        return out


def _X(k: int) -> int:
    return gtsam.symbol("x", k)


class FixedLagSmoother(Backend):
    """gtsam fixed-lag smoother over [q, q̇, q̈] at every step; see the module docstring."""

    name = "fgs"

    def __init__(self, model: Model, sensors: list, config) -> None:
        super().__init__(model, sensors, config)
        source = getattr(config, "source", "rig")
        self.params = FgsParams.from_dict(source, "estimator.fgs", getattr(config, "fgs", {}) or {})
        p, n, m = self.params, model.n, model.m
        self._n = n
        self._window_steps = max(2, int(round(p.window_ms * 1e-3 / self.dt)))
        self._delay_steps = int(round(p.output_delay_ms * 1e-3 / self.dt))
        self.output_latency_s = (p.chunk_steps - 1) * self.dt + self._delay_steps * self.dt
        self._base_sigmas = np.concatenate([
            np.full(n, p.sigma_int_q), np.full(n, p.sigma_int_qd), np.full(m, p.sigma_pc),
            np.full(m, p.sigma_vc), np.full(n, p.sigma_dyn),
        ])
        # Constant part of the Jacobians: integrator rows.
        dt, I = self.dt, np.eye(n)
        nb = 2 * n + 2 * m + n
        self._J_prev0 = np.zeros((nb, 3 * n))
        self._J_prev0[:n, :n] = -I
        self._J_prev0[:n, n : 2 * n] = -dt / 2 * I
        self._J_prev0[n : 2 * n, n : 2 * n] = -I
        self._J_prev0[n : 2 * n, 2 * n :] = -dt / 2 * I
        self._J_cur0 = np.zeros((nb, 3 * n))
        self._J_cur0[:n, :n] = I
        self._J_cur0[:n, n : 2 * n] = -dt / 2 * I
        self._J_cur0[n : 2 * n, n : 2 * n] = I
        self._J_cur0[n : 2 * n, 2 * n :] = -dt / 2 * I
        self._pending: list[Measurement] = []
        self._smoother: gtsam.IncrementalFixedLagSmoother | None = None

    # ------------------------------------------------------------------ residuals
    def _step_residual(self, xp: np.ndarray | None, xc: np.ndarray, meas: list[tuple[float, Measurement]],
                       want_jac: bool) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
        """Residual of one step (see module docstring) and its Jacobians w.r.t. x_{k-1} and x_k.

        ``xp`` is None for the first step (no integrator rows: they are zeroed by huge sigma).
        """
        model, n, m, dt = self.model, self._n, self.model.m, self.dt
        q, qd, qdd = xc[:n], xc[n : 2 * n], xc[2 * n :]
        rows = [np.zeros(2 * n)]
        if xp is not None:
            qp, qdp, qddp = xp[:n], xp[n : 2 * n], xp[2 * n :]
            rows = [q - qp - dt / 2 * (qdp + qd), qd - qdp - dt / 2 * (qddp + qdd)]
        Phi_q = model.Phi_q(q)
        if want_jac:
            f, df_dq, df_dqd = model.forward_dynamics_jac(q, qd)
        else:
            f = model.forward_dynamics(q, qd)
        rows += [model.Phi(q), Phi_q @ qd, qdd - f]
        Jp = Jc = None
        if want_jac:
            Jp = self._J_prev0.copy() if xp is not None else np.zeros_like(self._J_prev0)
            Jc = self._J_cur0.copy() if xp is not None else np.zeros_like(self._J_cur0)
            r = 2 * n
            Jc[r : r + m, :n] = Phi_q
            r += m
            Jc[r : r + m, :n] = model.hess_contract(q, qd)
            Jc[r : r + m, n : 2 * n] = Phi_q
            r += m
            Jc[r : r + n, :n] = -df_dq
            Jc[r : r + n, n : 2 * n] = -df_dqd
            Jc[r : r + n, 2 * n :] = np.eye(n)
        if meas:
            mrows, mjp, mjc = [], [], []
            for alpha, mm in meas:
                sensor = self.sensors[mm.sensor]
                x = xc if xp is None else (1.0 - alpha) * xp + alpha * xc
                y, H_q, H_qd, H_qdd = sensor.h(x[:n], x[n : 2 * n], x[2 * n :])
                e = np.asarray(y, dtype=float) - mm.y
                if sensor.kind in ("enc", "incl"):
                    e = (e + math.pi) % (2 * math.pi) - math.pi
                mrows.append(e)
                if want_jac:
                    H = np.hstack([H_q, H_qd, H_qdd])
                    mjc.append(H * (alpha if xp is not None else 1.0))
                    mjp.append(H * (1.0 - alpha))
            rows += mrows
            if want_jac:
                Jp = np.vstack([Jp] + mjp)
                Jc = np.vstack([Jc] + mjc)
        return np.concatenate(rows), Jp, Jc

    def _sigmas(self, meas: list[tuple[float, Measurement]], first: bool) -> np.ndarray:
        s = self._base_sigmas.copy()
        if first:
            s[: 2 * self._n] = 1.0  # no integrator rows at the first step (residual is 0)
        if meas:
            s = np.concatenate([s] + [np.asarray(self.sensors[mm.sensor].sigma, float) for _, mm in meas])
        return s

    def _make_factor(self, k: int, meas: list[tuple[float, Measurement]]) -> gtsam.CustomFactor:
        noise = gtsam.noiseModel.Diagonal.Sigmas(self._sigmas(meas, first=k == self._k0))
        if k == self._k0:
            def unary(this: gtsam.CustomFactor, values: gtsam.Values, H: list | None) -> np.ndarray:
                xc = values.atVector(this.keys()[0])
                e, _, Jc = self._step_residual(None, xc, meas, H is not None)
                if H is not None:
                    H[0] = Jc
                return e

            return gtsam.CustomFactor(noise, [_X(k)], unary)

        def binary(this: gtsam.CustomFactor, values: gtsam.Values, H: list | None) -> np.ndarray:
            keys = this.keys()
            xp, xc = values.atVector(keys[0]), values.atVector(keys[1])
            e, Jp, Jc = self._step_residual(xp, xc, meas, H is not None)
            if H is not None:
                H[0] = Jp
                H[1] = Jc
            return e

        return gtsam.CustomFactor(noise, [_X(k - 1), _X(k)], binary)

    # ------------------------------------------------------------------ Backend interface
    def initialize(self, t0: float, q: np.ndarray, qd: np.ndarray) -> None:
        """Start a new graph at time ``t0`` (s) from (q, q̇); q̈ from the model."""
        super().initialize(t0, q, qd)
        p = self.params
        lag_s = self._window_steps * self.dt
        params = gtsam.ISAM2Params()
        params.setRelinearizeThreshold(p.relinearize_threshold)
        params.relinearizeSkip = 1
        self._smoother = gtsam.IncrementalFixedLagSmoother(lag_s, params)
        self._k0 = self._k = 0
        self._t0 = t0
        qdd = self.model.forward_dynamics(q, qd)
        self._x_last = np.concatenate([q, qd, qdd])
        self._chunk_graph = gtsam.NonlinearFactorGraph()
        self._chunk_values = gtsam.Values()
        self._chunk_stamps: dict[int, float] = {}
        self._chunk_keys: list[int] = []
        n = self._n
        prior_sig = np.concatenate([np.full(n, p.prior_sigma_q), np.full(n, p.prior_sigma_qd), np.full(n, p.prior_sigma_qdd)])
        self._chunk_graph.add(gtsam.PriorFactorVector(_X(0), self._x_last, gtsam.noiseModel.Diagonal.Sigmas(prior_sig)))
        self._add_step_variable(0, self._x_last)
        self._recent: deque[tuple[int, np.ndarray]] = deque(maxlen=self._window_steps + 1)
        self._recent.append((0, self._x_last.copy()))

    def _add_step_variable(self, k: int, x_guess: np.ndarray) -> None:
        meas = self._take_measurements(k)
        self._chunk_graph.add(self._make_factor(k, meas))
        self._chunk_values.insert(_X(k), x_guess)
        self._chunk_stamps[_X(k)] = self._t0 + k * self.dt
        self._chunk_keys.append(k)

    def _take_measurements(self, k: int) -> list[tuple[float, Measurement]]:
        """Pending measurements with t in (t_{k-1}, t_k] (all with t <= t_k for the first step)."""
        t_k = self._t0 + k * self.dt
        keep, out = [], []
        for mm in self._pending:
            if mm.t <= t_k + 1e-9:
                alpha = 1.0 if k == self._k0 else min(1.0, max(0.0, (mm.t - (t_k - self.dt)) / self.dt))
                out.append((alpha, mm))
            else:
                keep.append(mm)
        self._pending = keep
        return out

    def add_measurement(self, m: Measurement) -> None:
        """Buffer a measurement; it enters the factor of the step whose interval contains its time."""
        self._pending.append(m)
        self.note_measurement(m)

    def _predict(self, x: np.ndarray) -> np.ndarray:
        """Initial guess for the next step: one Heun step of the model from x."""
        n, dt = self._n, self.dt
        q, qd, qdd = x[:n], x[n : 2 * n], x[2 * n :]
        q1 = q + dt * qd + 0.5 * dt * dt * qdd
        qd1 = qd + dt * qdd
        qdd1 = self.model.forward_dynamics(q1, qd1)
        return np.concatenate([q1, qd1, qdd1])

    def step(self) -> list[Estimate]:
        """Advance one Δt; every ``chunk_steps`` steps run one ISAM2 update and emit estimates."""
        self._k += 1
        self._x_last = self._predict(self._x_last)
        self._add_step_variable(self._k, self._x_last)
        self.t = self._t0 + self._k * self.dt
        if len(self._chunk_keys) < self.params.chunk_steps:
            return []
        return self._update()

    def _update(self) -> list[Estimate]:
        assert self._smoother is not None
        keys = self._chunk_keys
        try:
            self._smoother.update(self._chunk_graph, self._chunk_values, self._chunk_stamps)
            values = self._smoother.calculateEstimate()
            xs = [values.atVector(_X(k)) for k in keys]
        except RuntimeError as exc:  # gtsam IndeterminantLinearSystem and friends
            return [self._reinitialize(f"gtsam: {exc}")]
        self._chunk_graph = gtsam.NonlinearFactorGraph()
        self._chunk_values = gtsam.Values()
        self._chunk_stamps = {}
        self._chunk_keys = []
        newest = xs[-1]
        n = self._n
        if not np.all(np.isfinite(newest)) or np.max(np.abs(self.model.Phi(newest[:n]))) > self.params.max_constraint_residual:
            return [self._reinitialize("constraint residual blow-up or NaN in the smoother estimate")]
        self._x_last = newest
        for k, x in zip(keys, xs):
            self._recent.append((k, x))
        out = []
        if self._delay_steps == 0:
            emit = list(zip(keys, xs))
        else:
            # re-read the delayed steps from the smoothed window (they have seen newer data)
            emit = []
            for k in keys:
                kd = k - self._delay_steps
                if kd >= 0 and values.exists(_X(kd)):
                    emit.append((kd, values.atVector(_X(kd))))
        for k, x in emit:
            out.append(self.make_estimate(self._t0 + k * self.dt, x[:n], x[n : 2 * n]))
        return out

    def _reinitialize(self, why: str) -> Estimate:
        """Restart the graph from the last good state (projected on the constraints)."""
        log.warning("fgs: divergence (%s); re-initialising", why)
        k_good, x_good = self._recent[-1]
        n = self._n
        q = self.model.solve_position(x_good[:n], x_good[:n][self.model.dof])
        qd = self.model.solve_velocity(q, x_good[n : 2 * n][self.model.dof])
        t = self.t
        pending = self._pending
        self.initialize(t, q, qd)
        self._pending = pending
        self.mark_reinit(why)
        return self.make_estimate(t, q, qd)

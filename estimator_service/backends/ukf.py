"""Unscented Kalman filter in independent coordinates (Sensors 2016 §3.3.2).

Same state, transition and measurement models as the EKF (estimator_service/backends/ekf.py), but
the Gaussian is propagated through them with Merwe's scaled sigma points (2L + 1 points) instead
of Jacobians.  Every sigma point solves its own position problem from the mean's q.

The mean advances every 1 ms step (Heun).  The sigma points are pushed through the transition over
intervals of up to ``covariance_step_s`` (default 10 ms, one 100 Hz IMU period, and always up to each
measurement) in one Heun step: the covariance sees the same nonlinearity for a tenth of the cost.
"""

from __future__ import annotations

import numpy as np

from estimator_service.backends.base import Measurement
from estimator_service.backends.ekf import IndependentFilter


class UnscentedKalmanFilter(IndependentFilter):
    """UKF with additive process and measurement noise."""

    name = "ukf"
    section = "ukf"

    def _weights(self) -> tuple[np.ndarray, np.ndarray, float]:
        p, L = self.params, self.L
        lam = p.alpha**2 * (L + p.kappa) - L
        wm = np.full(2 * L + 1, 1.0 / (2 * (L + lam)))
        wc = wm.copy()
        wm[0] = lam / (L + lam)
        wc[0] = wm[0] + 1 - p.alpha**2 + p.beta
        return wm, wc, L + lam

    def sigma_points(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(points (2L+1, L), mean weights, covariance weights) of the current Gaussian."""
        wm, wc, c = self._weights()
        P = 0.5 * (self.P + self.P.T)
        jitter = 0.0
        for _ in range(6):
            try:
                S = np.linalg.cholesky(c * (P + jitter * np.eye(self.L)))
                break
            except np.linalg.LinAlgError:
                jitter = max(1e-12, 10 * jitter)
        else:
            raise np.linalg.LinAlgError("covariance is not positive definite")
        pts = np.vstack([self.x, self.x + S.T, self.x - S.T])
        return pts, wm, wc

    def initialize(self, t0: float, q: np.ndarray, qd: np.ndarray) -> None:
        super().initialize(t0, q, qd)
        self._interval_start: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
        self._interval_h = 0.0

    def _begin_interval(self) -> None:
        if self._interval_start is None:
            self._interval_start = (self.x.copy(), self.P.copy(), self.q.copy())

    def _propagate_covariance(self) -> None:
        """P over the interval since its start: sigma points through one transition of its length."""
        if self._interval_start is None:
            return
        x0, P0, q0 = self._interval_start
        h = self._interval_h
        x_now, q_now = self.x, self.q
        self.x, self.P, self.q = x0, P0, q0
        pts, wm, wc = self.sigma_points()
        out = np.array([self.transition(x, h, jac=False)[0] for x in pts])
        d = out - wm @ out
        self.x, self.q = x_now, q_now
        self.P = (wc[:, None] * d).T @ d + self._Qc * h
        self._interval_start, self._interval_h = None, 0.0

    def update(self, group: list[Measurement]) -> None:
        self._propagate_covariance()
        ids = [m.sensor for m in group]
        pts, wm, wc = self.sigma_points()
        Y = np.array([self.predict_measurement(x, ids, jac=False)[0] for x in pts])
        y_mean = wm @ Y
        # innovations of the sigma points relative to the mean, angles wrapped
        dY = np.array([self.innovation(y, y_mean, ids) for y in Y])
        dX = pts - self.x
        Rm = np.diag(np.concatenate([np.square(self.sensors[i].sigma) for i in ids]))
        S = (wc[:, None] * dY).T @ dY + Rm
        C = (wc[:, None] * dX).T @ dY
        K = np.linalg.solve(S, C.T).T
        e = self.innovation(np.concatenate([m.y for m in group]), y_mean, ids)
        self.count_outlier(float(e @ np.linalg.solve(S, e)), len(e))
        self.x = self.x + K @ e
        self.P = self.P - K @ S @ K.T
        self.P = 0.5 * (self.P + self.P.T)
        self.q, _ = self.consistent(self.x, self.q)

"""Unscented Kalman filter in independent coordinates (Sensors 2016 §3.3.2).

Same state, transition and measurement models as the EKF (estimator_service/backends/filter.py), but
the Gaussian is propagated through them with Merwe's scaled sigma points (2L + 1 points, parameters
alpha, beta, kappa) instead of Jacobians.  Every sigma point solves its own position problem,
starting from the mean's consistent point (so all stay on the mean's assembly branch).  The square
root of P is lower-triangular, so the sigma points along ż, c, b, ε and p have the mean's z: they take
its position and inverse as they are (and those along c, b, ε its velocity terms too); the others are
light points, R and s refined with the mean's inverse instead of inverting [Φ_q; S] (backends/manifold.py
ManifoldDynamics.point; large mechanisms only).

The mean advances every 1 ms step.  The sigma points are pushed through one transition of the
interval's length (up to ``covariance_step_s``, default 10 ms = one 100 Hz IMU period, and always up
to each measurement): the covariance sees the same nonlinearity for a fraction of the cost.
Additive process noise (continuous density × interval) and measurement noise.  The interval's
propagation is computed ahead, in the two steps after it opens (IndependentFilter._precompute_interval,
half of the sigma points in each: UnscentedKalmanFilter.covariance_ahead), and
an IMU update's part that needs no readings (the sigma points at the sample's time and their readings'
mean and covariance) in the step before its expected sample (FusedUpdates._prepare_update:
kernels.fused_update.ukf_update_prepare); the update step does the rest
(kernels.fused_update.ukf_update_finish).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from estimator_service import kernels
from estimator_service.backends.filter import FilterParams, IndependentFilter
from estimator_service.backends.manifold import Point
from estimator_service.errors import ConfigError


@dataclass
class UkfParams(FilterParams):
    """``[estimator.ukf]``: the shared filter parameters plus Merwe's sigma-point scaling."""

    alpha: float = 1.0  #: sigma-point spread (> 0; tiny values give huge negative weights: fragile)
    beta: float = 2.0  #: prior-distribution parameter (2 is optimal for a Gaussian)
    kappa: float = 0.0  #: secondary scaling (L + kappa must stay > 0)

    @classmethod
    def from_dict(cls, file: str, section: str, d: dict) -> UkfParams:
        out = super().from_dict(file, section, d)
        if out.alpha > 1.0:
            raise ConfigError(file, f"{section}.alpha", f"must be in (0, 1], got {out.alpha!r}")
        return out


class UnscentedKalmanFilter(IndependentFilter):
    """UKF with Merwe scaled sigma points; Cholesky factor with growing jitter if P is not positive definite."""

    name = "ukf"
    section = "ukf"
    params_class = UkfParams
    kernel_kind = "ukf"

    def __init__(self, model, sensors: list, config) -> None:
        super().__init__(model, sensors, config)
        p, L = self.params, self.L
        lam = p.alpha**2 * (L + p.kappa) - L
        self._wm = np.full(2 * L + 1, 1.0 / (2 * (L + lam)))
        self._wc = self._wm.copy()
        self._wm[0] = lam / (L + lam)
        self._wc[0] = self._wm[0] + 1 - p.alpha**2 + p.beta
        self._scale = L + lam
        compiled = self.dynamics.kernel is not None
        #: the UKF's algebra (estimator_service/kernels/kalman.py), compiled with the kernels
        self._sigma_points = kernels.compiled_or_python(kernels.ukf_sigma_points, compiled)
        self._covariance = kernels.compiled_or_python(kernels.ukf_covariance, compiled)
        self._innovation = kernels.compiled_or_python(kernels.ukf_innovation, compiled)
        self._correct_ukf = kernels.compiled_or_python(kernels.ukf_correct, compiled)
        #: the first half of the open interval's sigma points propagated ahead: (x0, P0, h, the sigma points,
        #: the first half's transitions), or None (:meth:`covariance_ahead`)
        self._ahead: tuple | None = None

    def sigma_points(self, x: np.ndarray, P: np.ndarray) -> np.ndarray:
        """Sigma points (2L+1, L) of N(x, P): x, x ± columns of chol((L + λ) P), with a growing jitter on
        the diagonal (from 1e-12 of its largest entry) while P is not positive definite (kernels.ukf_sigma_points)."""
        X, ok = self._sigma_points(x, P, self._scale)
        if not ok:
            raise np.linalg.LinAlgError("covariance is not positive definite")
        return X

    def covariance_over(self, x0: np.ndarray, P0: np.ndarray, pt0: Point, h: float) -> np.ndarray:
        return self._covariance(self.sigma_transitions(self.sigma_points(x0, P0), x0, pt0, h), self._wm, self._wc)

    def covariance_ahead(self, x0: np.ndarray, P0: np.ndarray, pt0: Point, h: float) -> np.ndarray | None:
        """:meth:`covariance_over` over two steps: the first half of the sigma points' transitions in the
        first (kept with the interval's start and length), the rest and the covariance in the next, so that
        no step carries all of them.  Each row's transition is its own: the same result as in one step."""
        part = self._ahead
        if part is None or part[0] is not x0 or part[1] is not P0 or part[2] != h:
            X = self.sigma_points(x0, P0)
            half = (X.shape[0] + 1) // 2
            self._ahead = (x0, P0, h, X, self.sigma_transitions(X[:half], x0, pt0, h))
            return None
        X, first = part[3], part[4]
        self._ahead = None
        Xn = np.vstack([first, self.sigma_transitions(X[first.shape[0] :], x0, pt0, h)])
        return self._covariance(Xn, self._wm, self._wc)

    def fuse_propagation(self) -> bool:
        """The sigma points' propagation is compiled for every integrator: always in the update's call."""
        return True

    def precomputes_interval(self) -> bool:
        """The sigma points' propagation needs the interval's start and length only: computed ahead, in a
        step without an update (IndependentFilter._precompute_interval)."""
        return True

    def prepare_call(self, gids: np.ndarray, rvar: np.ndarray, P: np.ndarray, interval: tuple | None,
                     h_mean: float) -> tuple:
        """kernels.fused_update.ukf_update_prepare (see FusedUpdates.prepare_call, backends/fused_update.py)."""
        return self.dynamics.kernel.ukf_update_prepare(self.x, P, self.point_buffer(), gids, rvar, self.nd,
                                                       (self._wm, self._wc, self._scale), *self.tau_terms(), self._table,
                                                       *self.solver_terms(), self._interval_terms(interval),
                                                       self.advance_terms(h_mean))

    def finish_call(self, prepared: tuple, dims: np.ndarray, angle: np.ndarray, y: np.ndarray,
                    rvar: np.ndarray) -> tuple:
        """kernels.fused_update.ukf_update_finish (see FusedUpdates.finish_call)."""
        force, _, e0 = self.tau_terms()
        return self.finished(prepared, self.dynamics.kernel.ukf_update_finish(
            prepared, y, angle, rvar, dims, self.params.gate_nis, self._wc, force, e0, *self.solver_terms()))

    @staticmethod
    def prepared_rows(prepared: tuple, rows: np.ndarray) -> tuple:
        """:meth:`prepare_call`'s output for the readings ``rows`` only: (status, ȳ, X, dY, S, …)."""
        st, ybar, X, dY, S, *rest = prepared
        return (st, ybar[rows], X, np.ascontiguousarray(dY[:, rows]), S[np.ix_(rows, rows)], *rest)

    def _interval_terms(self, interval: tuple | None) -> tuple | None:
        """The interval to propagate for the update kernels: (x0, P0, its point's buffer, G there, h, integrator
        code, process noise), or None."""
        if interval is None:
            return None
        x0, P0, pt0, h, G0, Qh = interval
        return (x0, P0, self.dynamics.kernel.point_buffer(pt0), G0, h, kernels.INTEGRATOR_CODES[self.params.integrator],
                Qh)

    def innovation_terms(self, ids: list[int], y: np.ndarray, rvar: np.ndarray) -> tuple[tuple, tuple]:
        """((sigma points, dY, S, e), the NIS statistics) of the readings y of ``ids`` at the current state."""
        pts = self.sigma_points(self.x, self.P)
        _, dY, S, e = self._innovation(self.sigma_readings(pts, ids), self._wm, self._wc, self.angle_rows(ids), y, rvar)
        return (pts, dY, S, e), self.sensor_nis(ids, e, S)

    def correct(self, terms: tuple, rvar: np.ndarray, keep: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The UKF's correction with the rows ``keep``."""
        pts, dY, S, e = terms
        return self._correct_ukf(pts, self.x, self.P, self._wc, dY, S, e, keep)

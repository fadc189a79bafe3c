"""Discrete extended Kalman filter in independent coordinates (Sensors 2016 §3.3.1).

The state, transition and measurement models are the filters' shared ones
(estimator_service/backends/filter.py); the EKF propagates the covariance over each interval with a
transition Jacobian F from A = ∂ẋ/∂x at the interval's two ends (Heun's form with its second stage at
the mean's actual end: kernels.interval_jacobian; with RK4 the exact Jacobian of its map) and fuses with
H = ∂y/∂x in Joseph form.  A group of sensors (every kind: kernels.SensorTable) is fused by two compiled calls, the
open interval's propagation included: the part that needs no readings (the mean's transition to the sample's time, the
interval's covariance, H, S: kernels.fused_update.ekf_update_prepare), computed ahead in the step before an IMU's
expected sample when it can be (FusedUpdates._prepare_update, backends/fused_update.py), then the rest
(kernels.fused_update.ekf_update_finish).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from estimator_service import kernels
from estimator_service.backends.filter import FilterParams, IndependentFilter
from estimator_service.backends.manifold import Point


@dataclass
class EkfParams(FilterParams):
    """``[estimator.ekf]``: the shared filter parameters (see :class:`FilterParams`)."""


class ExtendedKalmanFilter(IndependentFilter):
    """DEKF: linearised transition and measurement models, Joseph-form covariance update."""

    name = "ekf"
    section = "ekf"
    params_class = EkfParams

    def __init__(self, model, sensors: list, config) -> None:
        super().__init__(model, sensors, config)
        self._interval_jacobian = kernels.compiled_or_python(kernels.interval_jacobian, self.dynamics.kernel is not None)
        if self.dynamics.kernel is not None and self.uses_transition_jacobian():
            kernels.warm_transition_jacobian(self.dynamics.kernel)  # (compiled here, not inside a step)

    def uses_transition_jacobian(self) -> bool:
        """Whether :meth:`covariance_over` takes the exact Jacobian of the integrator's map (RK4), whose compiled
        kernel the ``ekf`` kind leaves out (kernels.warm_transition_jacobian)."""
        return self.params.integrator == "rk4"

    def covariance_over(self, x0: np.ndarray, P0: np.ndarray, pt0: Point, h: float) -> np.ndarray:
        """F P0 Fᵀ over an interval of h seconds that started at x0 (point ``pt0``) and ends at the current
        mean: F from A = ∂ẋ/∂x at both ends (kernels.interval_jacobian: Heun's form with its second stage at
        the interval's actual end, or Euler's), the exact Jacobian of the RK4 map from x0 with RK4; each A
        with the parameter forces G(q̈) of its own point, the RK4 map with x0's."""
        integ = self.params.integrator
        if integ == "rk4":
            F = self.transition_jacobian(x0, h, pt0)
        else:
            F = self._interval_jacobian(self.A(x0, pt0, pt0), self.A(self.x, self.point, self.point), h,
                                        kernels.INTEGRATOR_CODES[integ])
        P = F @ P0 @ F.T
        return 0.5 * (P + P.T)

    def fuse_propagation(self) -> bool:
        """F comes from both ends of the interval (:meth:`covariance_over`): the compiled update
        propagates the open interval in the same call (not with RK4)."""
        return self.params.integrator != "rk4"

    def prepare_call(self, gids: np.ndarray, rvar: np.ndarray, P: np.ndarray, interval: tuple | None,
                     h_mean: float) -> tuple:
        """kernels.fused_update.ekf_update_prepare (see FusedUpdates.prepare_call, backends/fused_update.py)."""
        P, prop = self._interval_terms(P, interval)
        return self.dynamics.kernel.ekf_update_prepare(self.x, P, self.point_buffer(), gids, rvar, self.nd,
                                                       *self.tau_terms(), self._table, *self.solver_terms(), prop,
                                                       self.advance_terms(h_mean))

    def finish_call(self, prepared: tuple, dims: np.ndarray, angle: np.ndarray, y: np.ndarray,
                    rvar: np.ndarray) -> tuple:
        """kernels.fused_update.ekf_update_finish (see FusedUpdates.finish_call)."""
        force, _, e0 = self.tau_terms()
        return self.finished(prepared, self.dynamics.kernel.ekf_update_finish(
            prepared, y, angle, rvar, dims, self.params.gate_nis, force, e0, *self.solver_terms()))

    @staticmethod
    def prepared_rows(prepared: tuple, rows: np.ndarray) -> tuple:
        """:meth:`prepare_call`'s output for the readings ``rows`` only: (status, y_p, H, P Hᵀ, S, …)."""
        st, yp, Hx, PHt, S, *rest = prepared
        return (st, yp[rows], Hx[rows], np.ascontiguousarray(PHt[:, rows]), S[np.ix_(rows, rows)], *rest)

    def _interval_terms(self, P: np.ndarray, interval: tuple | None) -> tuple:
        """(the prior P, the interval to propagate (x0, its point's buffer, G there, h, integrator code, process
        noise) or None) for the update kernels: with an interval, P is its start's."""
        if interval is None:
            return P, None
        x0, P0, pt0, h, G0, Qh = interval
        return P0, (x0, self.dynamics.kernel.point_buffer(pt0), G0, h, self.propagation_code(), Qh)

    def propagation_code(self) -> int:
        """How the update kernel propagates the open interval's covariance (kernels.interval_jacobian's code): by
        the integrator's F from A at both ends of the interval."""
        return kernels.INTEGRATOR_CODES[self.params.integrator]

    def innovation_terms(self, ids: list[int], y: np.ndarray, rvar: np.ndarray) -> tuple[tuple, tuple]:
        """((H, P Hᵀ, S, e), the NIS statistics) of the readings y of ``ids`` at the current state."""
        y_pred, H = self.predict_measurement(self.x, self.point, ids, jac=True)
        e = self.innovation(y, y_pred, ids)
        PHt, S = self._innovation_cov(self.P, H, rvar)
        return (H, PHt, S, e), self.sensor_nis(ids, e, S)

    def correct(self, terms: tuple, rvar: np.ndarray, keep: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Joseph-form correction with the rows ``keep``."""
        H, PHt, S, e = terms
        return self._correct(self.x, self.P, H, PHt, S, e, rvar, keep)

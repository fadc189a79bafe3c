"""Discrete extended Kalman filter in independent coordinates (Sensors 2016 §3.3.1).

The state, transition and measurement models are the filters' shared ones
(estimator_service/backends/filter.py); the EKF propagates the covariance with the exact transition
Jacobian F and fuses with H = ∂y/∂x in Joseph form.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from estimator_service.backends.base import Measurement
from estimator_service.backends.filter import FilterParams, IndependentFilter, Point


@dataclass
class EkfParams(FilterParams):
    """``[estimator.ekf]``: the shared filter parameters (see :class:`FilterParams`)."""


class ExtendedKalmanFilter(IndependentFilter):
    """DEKF: linearised transition and measurement models, Joseph-form covariance update."""

    name = "ekf"
    section = "ekf"
    params_class = EkfParams

    def covariance_over(self, x0: np.ndarray, P0: np.ndarray, pt0: Point, h: float) -> np.ndarray:
        F = self.transition_jacobian(x0, h, pt0)
        P = F @ P0 @ F.T
        return 0.5 * (P + P.T)

    def update(self, group: list[Measurement]) -> None:
        self.propagate_covariance()
        ids = [m.sensor for m in group]
        y_pred, H = self.predict_measurement(self.x, self.point, ids, jac=True)
        e = self.innovation(np.concatenate([m.y for m in group]), y_pred, ids)
        rvar = self.measurement_var(ids)
        PHt, S = self._innovation_cov(self.P, H, rvar)
        keep = self.gate_and_record(ids, self.sensor_nis(ids, e, S))
        if not keep:
            return
        self.x, self.P = self._correct(self.x, self.P, H, PHt, S, e, rvar, np.array(keep, dtype=np.int64))
        self.point = self.point_of(self.x, self.point)

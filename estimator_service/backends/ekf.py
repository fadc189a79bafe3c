"""Discrete extended Kalman filter in independent coordinates (Sensors 2016 §3.3.1).

The state, transition and measurement models are the filters' shared ones
(estimator_service/backends/filter.py); the EKF propagates the covariance over each interval with a
transition Jacobian F from A = ∂ẋ/∂x at the interval's two ends (Heun's form with its second stage at
the mean's actual end: kernels.interval_jacobian; with RK4 the exact Jacobian of its map) and fuses with
H = ∂y/∂x in Joseph form.  A group of gyros is fused in one compiled call, the open interval's
propagation included (kernels._ekf_gyro_update).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from estimator_service.backends.base import Measurement
from estimator_service import kernels
from estimator_service.backends.filter import FilterParams, IndependentFilter, Point, _arrays, compiled_gyro_ids


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

    def covariance_over(self, x0: np.ndarray, P0: np.ndarray, pt0: Point, h: float) -> np.ndarray:
        """F P0 Fᵀ over an interval of h seconds that started at x0 (point ``pt0``) and ends at the current
        mean: F from A = ∂ẋ/∂x at both ends (kernels.interval_jacobian: Heun's form with its second stage at
        the interval's actual end, or Euler's), the exact Jacobian of the RK4 map from x0 with RK4."""
        integ = self.params.integrator
        if integ == "rk4":
            F = self.transition_jacobian(x0, h, pt0)
        else:
            F = self._interval_jacobian(self.A(x0, pt0), self.A(self.x, self.point), h, kernels.INTEGRATOR_CODES[integ])
        P = F @ P0 @ F.T
        return 0.5 * (P + P.T)

    #: the covariance is propagated with F from both ends of its interval (:meth:`covariance_over`), so the
    #: compiled gyro update may propagate it first in the same call (not with RK4)
    fuse_propagation = True

    def update(self, group: list[Measurement]) -> None:
        """Fuse a group of measurements: one compiled call for gyros (:meth:`_gyro_update`, with the
        covariance's propagation over the open interval), else the propagation, H, the innovation, its NIS
        and gate, the Joseph-form correction and the new point step by step."""
        ids = [m.sensor for m in group]
        y = group[0].y if len(group) == 1 else np.concatenate([m.y for m in group])
        rvar = self.measurement_var(ids)
        fused = self._gyro_update(ids, y, rvar)
        if fused is None:
            self.propagate_covariance()
            y_pred, H = self.predict_measurement(self.x, self.point, ids, jac=True)
            e = self.innovation(y, y_pred, ids)
            PHt, S = self._innovation_cov(self.P, H, rvar)
            keep = self.gate_and_record(ids, self.sensor_nis(ids, e, S))
        else:
            status, total, each, zr, e, H, PHt, S, xn, Pn, *point = fused
            self.monitor.innovation(float(total), len(e))
            keep = self.gate_and_record(ids, (each, zr))
            if status != 3:  # corrected (every sensor passed the gate, as gate_and_record found too)
                self.x, self.P = xn, Pn
                self.point = Point(xn[: self.model.g].copy(), *point[:6], float(point[6])) if status == 0 else \
                    self.point_of(self.x, self.point)  # (the reference path finds it, or raises)
                return
        if not keep:
            return
        self.x, self.P = self._correct(self.x, self.P, H, PHt, S, e, rvar, np.array(keep, dtype=np.int64))
        self.point = self.point_of(self.x, self.point)

    def _gyro_update(self, ids: list[int], y: np.ndarray, rvar: np.ndarray) -> tuple | None:
        """The update of a group of gyros by the compiled kernel (kernels._ekf_gyro_update: H, innovation,
        NIS, gate, correction and new point in one call), or None when the kernels are off or the group
        holds other sensors (then :meth:`update` takes the step-by-step path).  Status 2 before the
        correction (a singular state Jacobian) raises, as the step-by-step path does."""
        gids = compiled_gyro_ids(self._gyros, ids)
        if gids is None:
            return None
        interval = None
        if self._interval_start is not None:
            if not self.fuse_propagation or self.params.integrator == "rk4":
                self.propagate_covariance()
            else:
                x0, _, pt0 = self._interval_start
                h = self._interval_h
                interval = (x0, _arrays(pt0.q, pt0.qd, pt0.R, pt0.Jm), h,
                            kernels.INTEGRATOR_CODES[self.params.integrator], self.process_noise(pt0) * h)
        pt, d = self.point, self.dynamics
        P0 = self.P if interval is None else self._interval_start[1]
        out = d.kernel.ekf_gyro_update(self.x, P0, _arrays(pt.z, pt.q, pt.qd, pt.qdd, pt.R, pt.Jm), gids,
                                       self._dims[gids], y, rvar, self.params.gate_nis, self.nd, *self.tau_terms(),
                                       self._gyros, d.tol, d.quadratic_res, d.max_newton, interval)
        if out[0] == 4:  # a singular Jacobian at the interval's start: all of it step by step
            self.propagate_covariance()
            return None
        if interval is not None:
            self.P, self._interval_start, self._interval_h = out[-1], None, 0.0
        if out[0] == 2 and out[8].size == 0:
            raise np.linalg.LinAlgError("singular configuration (state Jacobian)")
        return out[:-1]

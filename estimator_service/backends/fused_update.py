"""The filters' update of a group of sensors by the backend's compiled kernel: IndependentFilter's part that runs
an update as two compiled calls (kernels/fused_update.py) and prepares the first ahead of it.

:meth:`FusedUpdates._fused` advances the mean to the update's time and fuses the group in
:meth:`~FusedUpdates.fused_call` (the part that needs no readings, :meth:`~FusedUpdates.prepare_call`, then the rest,
:meth:`~FusedUpdates.finish_call`), with the open covariance interval's propagation when the backend fuses it
(:meth:`~FusedUpdates.fuse_propagation`); in a step without an update, :meth:`~FusedUpdates._prepare_update` computes
the next update's first part ahead.  The EKF and the UKF (backends/ekf.py, backends/ukf.py) supply the calls.

A mixin of :class:`~estimator_service.backends.filter.IndependentFilter`, whose state it reads and sets: the mean x,
its point and covariance P, the open covariance interval (``_interval_start``, ``_interval_h``, ``_interval_expect``,
:meth:`_open_interval`, :meth:`_close_interval`, :meth:`_precomputed`, :meth:`interval_noise`,
:meth:`propagate_covariance`, :meth:`predict`) and the compiled groups' bookkeeping set up in its ``__init__``
(``_table``, ``_dims``, ``_compiled_groups``, ``_all_compiled``, ``_all_compiled_terms``, ``_prepared``,
``_prepared_rows``).  The step-by-step path (IndependentFilter.update) is the reference; the two give the same numbers.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np

from estimator_service import kernels
from estimator_service.backends.manifold import BufferPoint, compiled_sensor_ids


class FusedUpdates(ABC):
    """The compiled update of a group of sensors, computed ahead when it can be (see the module docstring)."""

    def _prepare_update(self) -> None:
        """In a step without an update, when the open covariance interval is expected to end with an update
        within the next step (the last interval's length: an IMU's period), compute that update's part that
        needs no readings for every sensor (:meth:`prepare_call`: the mean's transition to its time, the
        interval's propagation unless it was computed ahead (:meth:`_precompute_interval`), the predicted
        readings and their covariances), so that the update step does only the rest (:meth:`_finish_prepared`).
        The same numbers, whichever step computes them; unused when the update's time or the state differs, or
        it has other sensors."""
        start, key = self._interval_start, self._all_compiled
        self._prepared = None
        if not key or start is None or not self.fuse_propagation():
            return
        h_mean = self._interval_expect - self._interval_h  # to the expected update (s)
        if not 1e-12 < h_mean <= self.dt + 1e-12:
            return
        x0, P0, pt0, G0 = start
        h_total = self._interval_h + h_mean
        P_pre = self._precomputed(h_total)
        interval = None if P_pre is not None else (x0, P0, pt0, h_total, G0, self.interval_noise(pt0, h_total))
        prepared = self.prepare_call(*self._all_compiled_terms, self.P if P_pre is None else P_pre, interval, h_mean)
        if prepared[0] == 0:
            self._prepared = (self.x, start, P_pre, self._interval_h, h_mean, prepared)

    def _finish_prepared(self, key: tuple[int, ...], dims: np.ndarray, angle: np.ndarray, y: np.ndarray,
                         rvar: np.ndarray, h: float, P_pre: np.ndarray | None) -> tuple | None:
        """The fused update's output (:meth:`fused_call`) of the sensors ``key`` from the part prepared ahead
        (:meth:`_prepare_update`) when it was from this state, open interval and covariance propagated ahead
        (``P_pre``), to this time (to 1 ns): its rows of these sensors (:meth:`prepared_rows`: the predicted
        readings and their covariances of a group of distinct sensors are those rows of every sensor's); else
        None.  The prepared part is used once."""
        prep, self._prepared = self._prepared, None
        if prep is None:
            return None
        x, start, pre, interval_h, h_mean, prepared = prep
        if x is not self.x or start is not self._interval_start or pre is not P_pre or \
                interval_h != self._interval_h or abs(h - h_mean) > 1e-9:
            return None
        if key != self._all_compiled:
            rows = self._prepared_rows.get(key)
            if rows is None:
                if len(set(key)) < len(key):  # (a sensor's two samples: their noises are independent, not one row's)
                    return None
                first = np.concatenate([[0], np.cumsum(self._dims[list(self._all_compiled)])])
                at = {s: first[j] for j, s in enumerate(self._all_compiled)}
                rows = self._prepared_rows[key] = np.concatenate(
                    [np.arange(at[s], at[s] + self._dims[s]) for s in key]).astype(np.int64)
            prepared = self.prepared_rows(prepared, rows)
        return self.finish_call(prepared, dims, angle, y, rvar)

    def _fused(self, ids: list[int], y: np.ndarray, rvar: np.ndarray, h: float) -> tuple | None:
        """The mean's transition of h seconds and the update of a group of sensors by the backend's compiled
        kernel (:meth:`fused_call`), with the open interval's propagation when the backend fuses it
        (:meth:`fuse_propagation`): its output less the advanced mean and the propagated P, which are taken
        here.  None when the kernels are off, the group holds other sensors or the kernel hands the update
        back (the step-by-step path then does what is left); the mean has been advanced either way.
        Raises as the step-by-step path would on a singular state Jacobian or a covariance that is not
        positive definite."""
        key = tuple(ids)
        compiled_group = self._compiled_groups.get(key)
        if compiled_group is None:  # (once per combination of sensors: the update runs at every IMU sample)
            gids = compiled_sensor_ids(self._table, ids)
            compiled_group = self._compiled_groups[key] = (gids, None if gids is None else self._dims[gids],
                                                           self.angle_rows(ids))
        gids, dims, angle = compiled_group
        if gids is None or not self.fuse_propagation():
            if h > 0.0:
                self.predict(h, propagate=False)
            if gids is None:
                return None
            h = 0.0
            self.propagate_covariance()
        if h > 0.0:  # (as predict)
            self._open_interval()
        P_prior, h_total, out = self.P, self._interval_h + h, None
        P_pre = self._precomputed(h_total) if self._interval_start is not None else None
        # the kernel propagates the open interval (in this call, or in the part prepared ahead)
        propagates = P_pre is None and self._interval_start is not None
        if self._interval_start is not None:
            out = self._finish_prepared(key, dims, angle, y, rvar, h, P_pre)
        if P_pre is not None:  # propagated ahead (:meth:`_precompute_interval`): the update's prior
            self.P = P_pre
        if out is None:
            interval = None
            if propagates:
                x0, P0, pt0, G0 = self._interval_start
                interval = (x0, P0, pt0, h_total, G0, self.interval_noise(pt0, h_total))
            out = self.fused_call(gids, dims, angle, y, rvar, interval, h)
        status = out[0]
        if status == kernels.ADVANCE_FAILED:  # the mean's transition needs the reference path: all step by step
            self.P = P_prior
            self.predict(h, propagate=False)
            return None
        if h > 0.0:
            self.x, self.point = out[-3], out[-2]
            self._interval_h += h
        if P_pre is not None:
            self._close_interval(P_pre, h_total)
        if status == 4:  # the propagation needs the reference path: all of it step by step
            return None
        if propagates:
            self._close_interval(out[-1], h_total)
        if status == 5:
            raise np.linalg.LinAlgError("covariance is not positive definite")
        if status == 2 and out[8].size == 0:
            raise np.linalg.LinAlgError("singular configuration (state Jacobian)")
        return None if status == 6 else out[:-3]

    def fuse_propagation(self) -> bool:
        """Whether :meth:`fused_call` propagates the open covariance interval itself."""
        return False

    def fused_call(self, gids: np.ndarray, dims: np.ndarray, angle: np.ndarray, y: np.ndarray, rvar: np.ndarray,
                   interval: tuple | None, h_mean: float) -> tuple:
        """The backend's compiled update of the sensors ``gids`` (rows per sensor ``dims``) with readings y
        and variances ``rvar``, after the mean's transition of ``h_mean`` seconds (:meth:`advance_terms`):
        :meth:`prepare_call`, then :meth:`finish_call`.  ``interval`` = (x0, P0, its point, h, G(q̈) there,
        process noise over h) of the open covariance interval to propagate first (to the advanced mean), or
        None.  Returns :meth:`finished`'s output."""
        return self.finish_call(self.prepare_call(gids, rvar, self.P, interval, h_mean), dims, angle, y, rvar)

    @abstractmethod
    def prepare_call(self, gids: np.ndarray, rvar: np.ndarray, P: np.ndarray, interval: tuple | None,
                     h_mean: float) -> tuple:
        """The part of :meth:`fused_call` that needs no readings (the prior P when ``interval`` is None), by
        the backend's compiled kernel (kernels.fused_update.ekf_update_prepare, ukf_update_prepare); its status
        first, 0 = usable.  Computed ahead of the update when it can be (:meth:`_prepare_update`)."""

    @abstractmethod
    def finish_call(self, prepared: tuple, dims: np.ndarray, angle: np.ndarray, y: np.ndarray,
                    rvar: np.ndarray) -> tuple:
        """:meth:`fused_call`'s output from :meth:`prepare_call`'s and the readings y (angles: the rows ``angle``)."""

    @staticmethod
    @abstractmethod
    def prepared_rows(prepared: tuple, rows: np.ndarray) -> tuple:
        """:meth:`prepare_call`'s output for the readings ``rows`` only."""

    def point_buffer(self) -> np.ndarray:
        """The current point as one buffer, for the update kernels (kernels.ModelKernels.point_buffer)."""
        return self.dynamics.kernel.point_buffer(self.point)

    def solver_terms(self) -> tuple[float, float, int]:
        """(tolerance, quadratic residual, Newton steps) of the manifold point's position problem, for the kernels."""
        d = self.dynamics
        return d.tol, d.quadratic_res, d.max_newton

    def advance_terms(self, h: float) -> tuple:
        """The kernels' ``advance`` (kernels.ModelKernels.ekf_update_prepare): (h, integrator code, G0, T of the
        parameter forces G(q̈) = G0 − T q̈ at the point the mean reaches)."""
        return (h, kernels.INTEGRATOR_CODES[self.params.integrator], *self._force_terms)

    def finished(self, prepared: tuple, out: tuple) -> tuple:
        """:meth:`fused_call`'s output from :meth:`prepare_call`'s (``prepared``) and the finish kernel's (``out`` =
        (status, total NIS, NIS per sensor, standardised rows, e, x⁺, P⁺, the buffer of x⁺'s point): see
        kernels.ModelKernels.ekf_update_finish): (status, total NIS, NIS per sensor, standardised rows, the four
        terms :meth:`correct` takes, x⁺, P⁺, x⁺'s point (status 0) or None, then the advanced mean x, its point and
        the propagated P)."""
        st, total, each, zr, e, xn, Pn, pt_new = out
        m = self.model
        new = BufferPoint(pt_new, m.n, m.m, m.g) if st == 0 else None
        return (st, total, each, zr, prepared[2], prepared[3], prepared[4], e, xn, Pn, new, prepared[6],
                BufferPoint(prepared[8], m.n, m.m, m.g), prepared[7])

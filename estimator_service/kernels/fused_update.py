"""The fused EKF and UKF updates: an update of a group of sensors in two compiled calls.

The first (:func:`ekf_update_prepare`, :func:`ukf_update_prepare`) needs no readings: the mean's transition to the
update's time, the open covariance interval's propagation, the predicted readings and their covariance; the filter
computes it ahead of the update when its time is known.  The second (:func:`ekf_update_finish`,
:func:`ukf_update_finish`) takes the readings: the innovation, its NIS, the gate, the correction and the corrected
state's point (:func:`_corrected`).  Both take the model as two buffers and points as buffers (transition.py);
``ModelKernels.ekf_update_prepare`` and its siblings (model_kernels.py) document their arguments and statuses.

numpy reference: ``IndependentFilter.update``'s step-by-step path (estimator_service/backends/filter.py:
``predict``, ``propagate_covariance``, ``innovation_terms``, ``gate_and_record``, ``correct``, ``point_of``) with the
EKF's and UKF's algebra of kalman.py.
"""

from __future__ import annotations

import numpy as np

from estimator_service.kernels.jit import inlined, kernel, runtime_value
from estimator_service.kernels.linalg import mm, mmt, part, sym
from estimator_service.kernels.dynamics import A_of, filter_jacobians
from estimator_service.kernels.transition import (ADVANCE_FAILED, advance_buffers, filter_sigma_transitions,
                                                  model_views, pack_point, point_views, stage)
from estimator_service.kernels.measurement import angle_flags, filter_sigma_readings, measure_sensors
from estimator_service.kernels.kalman import (AT_END, AT_END_KINEMATIC, ekf_correct_compact, ekf_innovation_cov_compact, gated_nis,
                                              innovation, interval_jacobian_compact, ukf_correct_compact,
                                              ukf_covariance_compact, ukf_innovation_compact,
                                              ukf_sigma_points_compact)


@kernel
def ekf_update_prepare(x, P, pt, ids, rvar, nd, force, G, e0, t, tol, quad_res, max_newton, prop, x0, pt0, G_int, h,
                        integ, Qh, h_mean, integ_mean, G0, T, mf, mi, pt_adv):
    """The part of ModelKernels.ekf_update_prepare that does not depend on the readings: the mean's transition (its
    point written to ``pt_adv``), the interval's propagation, the predicted readings y_p, H, P Hᵀ and S (variances
    ``rvar``).  Returns (status, y_p, H, P Hᵀ, S, G at the advanced point, the advanced mean x, the propagated P);
    status 0, or ADVANCE_FAILED, 4 or 2 as ModelKernels.ekf_update_prepare (y_p … S empty).  Computed ahead of the
    update when its time is known (ExtendedKalmanFilter.prepare_call)."""
    e1, e2 = np.zeros(0), np.zeros((0, 0))
    st, x, G = advance_buffers(h_mean, integ_mean, x, pt, force, G, e0, G0, T, tol, quad_res, max_newton, mf, mi, pt_adv)
    if st != 0:
        return (ADVANCE_FAILED, e1, e2, e2, e2, G, x, P)
    qe0, H, B, c, Hq, ang, angL, dof, M, Qg, DA, Dc = model_views(mf, mi)
    n, m, g = M.shape[0], c.shape[0], dof.shape[0]
    _, q, qd, qdd, _, R, Jm, _ = point_views(pt_adv, n, m, g)
    L = x.shape[0]
    Rj, dqd_dz, D, ok = filter_jacobians(x, q, qd, R, Jm, L, g, force, G, e0, qe0, Hq, ang, angL, dof, M, Qg, DA, Dc)
    if prop:
        if integ >= AT_END:  # the error-state EKF: Φ from A at the interval's end only (kalman.AT_END)
            if not ok:
                return (4, e1, e2, e2, e2, G, x, P)
            A1 = A_of(D, dof, g)
            if integ == AT_END_KINEMATIC:
                A1[g : 2 * g, : 2 * g] = 0.0
            F = interval_jacobian_compact(A1, A1, h, integ)
        else:
            _, q0, qd0, _, _, R0, Jm0, _ = point_views(pt0, n, m, g)
            _, _, D0, ok0 = filter_jacobians(x0, q0, qd0, R0, Jm0, L, g, force, G_int, e0, qe0, Hq, ang, angL, dof, M,
                                              Qg, DA, Dc)
            if not ok0:
                return (4, e1, e2, e2, e2, G, x, P)
            F = interval_jacobian_compact(A_of(D0, dof, g), A_of(D, dof, g), h, integ)
        P = sym(mmt(mm(F, P), F))
        for i in range(L):
            for j in range(L):
                P[i, j] += Qh[i, j]
    if not ok:
        return (2, e1, e2, e2, e2, G, x, P)
    yp, Hx = measure_sensors(ids, q, qd, qdd, part(x, nd, L), t, qe0, runtime_value(True), Rj, dqd_dz, D, nd)
    PHt, S = ekf_innovation_cov_compact(P, Hx, rvar)
    return (0, yp, Hx, PHt, S, G, x, P)


@inlined
def _corrected(total, each, zr, e, xn, Pn, pt_adv, force, G, e0, tol, quad_res, max_newton, mf, mi, pt_new):
    """A fused update's result after its correction (x⁺, P⁺): (status, total NIS, NIS per sensor, standardised rows,
    innovation, x⁺, P⁺), the point of x⁺ found from the advanced mean's (``pt_adv``) and written to ``pt_new``;
    status ≠ 0 from that point (``pt_new`` not written: the caller finds it on the reference path)."""
    qe0, H, B, c, Hq, ang, angL, dof, M, Qg, DA, Dc = model_views(mf, mi)
    n, m, g = M.shape[0], c.shape[0], dof.shape[0]
    z, q, _, _, _, R, Jm, _ = point_views(pt_adv, n, m, g)
    st, qn, qdn, qddn, zddn, Rn, Jmn, res = stage(xn, g, force, G, e0, z, q, R, Jm, tol, quad_res, max_newton, runtime_value(False),
                                                   qe0, H, B, c, Hq, ang, angL, dof, M, Qg, DA, Dc)
    if st == 0:
        pack_point(pt_new, part(xn, 0, g), qn, qdn, qddn, zddn, Rn, Jmn, res)
    return st, total, each, zr, e, xn, Pn


@inlined
def _gated_innovation(st, y, yp, angle, S, dims, gate):
    """(status, total NIS, NIS per sensor, standardised rows, innovation e = y − y_p) of a fused update's readings
    y (angles: the rows ``angle``) against the prepared part's status ``st``, predicted readings ``yp`` and S:
    the status is the prepared part's when it failed (nothing computed), 3 when a sensor fails the gate, else 0."""
    e1 = np.zeros(0)
    if st != 0:
        return st, 0.0, e1, e1, e1
    e = innovation(y, yp, angle)
    total, each, zr, passed = gated_nis(e, S, dims, gate)
    return (0 if passed else 3), total, each, zr, e


@kernel
def ekf_update_finish(prep, pt_adv, y, angle, rvar, dims, gate, force, e0, tol, quad_res, max_newton, mf, mi, pt_new):
    """The rest of ModelKernels.ekf_update_prepare with the readings y (angles: the rows ``angle``), from
    :func:`ekf_update_prepare`'s output ``prep`` and the advanced mean's point ``pt_adv``: the innovation, its NIS,
    the gate, the correction and the corrected state's point, see :func:`_corrected`."""
    st, yp, Hx, PHt, S, G, x, P = prep
    st, total, each, zr, e = _gated_innovation(st, y, yp, angle, S, dims, gate)
    if st != 0:
        return st, total, each, zr, e, np.zeros(0), np.zeros((0, 0))
    xn, Pn = ekf_correct_compact(x, P, Hx, PHt, S, e, rvar, np.arange(e.shape[0]))
    return _corrected(total, each, zr, e, xn, Pn, pt_adv, force, G, e0, tol, quad_res, max_newton, mf, mi, pt_new)


@kernel
def ukf_update_prepare(x, P, pt, ids, rvar, nd, wm, wc, scale, force, G, e0, t, tol, quad_res, max_newton, prop, x0, P0,
                        pt0, G_int, h, integ, Qh, h_mean, integ_mean, G0, T, mf, mi, pt_adv):
    """The part of ModelKernels.ukf_update_prepare that does not depend on the readings: the mean's transition (its
    point written to ``pt_adv``), the interval's propagation, the sigma points X of (x, P), their predicted readings'
    mean ȳ, deviations dY and S (variances ``rvar``).  Returns (status, ȳ, X, dY, S, G at the advanced point, the
    advanced mean x, the prior P); status 0, or ADVANCE_FAILED, 4, 5 or 6 as ModelKernels.ukf_update_prepare (ȳ … S
    empty).  Computed ahead of the update when its time is known (UnscentedKalmanFilter.prepare_call)."""
    e1, e2 = np.zeros(0), np.zeros((0, 0))
    st, x, G = advance_buffers(h_mean, integ_mean, x, pt, force, G, e0, G0, T, tol, quad_res, max_newton, mf, mi, pt_adv)
    if st != 0:
        return (ADVANCE_FAILED, e1, e2, e2, e2, G, x, P)
    qe0, H, B, c, Hq, ang, angL, dof, M, Qg, DA, Dc = model_views(mf, mi)
    n, m, g = M.shape[0], c.shape[0], dof.shape[0]
    z, q, qd, qdd, _, R, Jm, _ = point_views(pt_adv, n, m, g)
    if prop:
        X0, ok = ukf_sigma_points_compact(x0, P0, scale)
        if not ok:
            return (5, e1, e2, e2, e2, G, x, P)
        z0, q0, qd0, _, zdd0, R0, Jm0, _ = point_views(pt0, n, m, g)
        st, Xn = filter_sigma_transitions(X0, x0, nd, h, integ, g, force, G_int, e0, z0, q0, qd0, R0, Jm0, zdd0,
                                           tol, quad_res, max_newton, qe0, H, B, c, Hq, ang, angL, dof, M, Qg, DA, Dc)
        if st != 0:
            return (4, e1, e2, e2, e2, G, x, P)
        P = ukf_covariance_compact(Xn, wm, wc)
        for i in range(P.shape[0]):
            for j in range(P.shape[1]):
                P[i, j] += Qh[i, j]
    X, ok = ukf_sigma_points_compact(x, P, scale)
    if not ok:
        return (5, e1, e2, e2, e2, G, x, P)
    st, Y = filter_sigma_readings(X, x, nd, ids, g, force, G, e0, z, q, qd, qdd, R, Jm, tol, quad_res, max_newton, t, qe0,
                                   H, B, c, Hq, ang, angL, dof, M, Qg, DA, Dc)
    if st != 0:
        return (6, e1, e2, e2, e2, G, x, P)
    ybar, dY, S, _ = ukf_innovation_compact(Y, wm, wc, angle_flags(ids, t), np.zeros(Y.shape[1]), rvar)
    return (0, ybar, X, dY, S, G, x, P)


@kernel
def ukf_update_finish(prep, pt_adv, y, angle, rvar, dims, gate, wc, force, e0, tol, quad_res, max_newton, mf, mi,
                       pt_new):
    """The rest of ModelKernels.ukf_update_prepare with the readings y (angles: the rows ``angle``), from
    :func:`ukf_update_prepare`'s output ``prep`` and the advanced mean's point ``pt_adv``: the innovation e = y − ȳ,
    its NIS, the gate, the correction and the corrected state's point, see :func:`_corrected`."""
    st, ybar, X, dY, S, G, x, P = prep
    st, total, each, zr, e = _gated_innovation(st, y, ybar, angle, S, dims, gate)
    if st != 0:
        return st, total, each, zr, e, np.zeros(0), np.zeros((0, 0))
    xn, Pn = ukf_correct_compact(X, x, P, wc, dY, S, e, np.arange(e.shape[0]))
    return _corrected(total, each, zr, e, xn, Pn, pt_adv, force, G, e0, tol, quad_res, max_newton, mf, mi, pt_new)

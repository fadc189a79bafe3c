"""The filters' transitions in compiled code: the integrator's stages, the mean's step, the sigma points'.

A filter state x = [z, ż, c, b, ε, p] advances h seconds by Euler, Heun or RK4 (:data:`INTEGRATOR_CODES`), each
stage's manifold point found from the previous one's (:func:`stage`), with the exact Jacobian F = ∂x⁺/∂x of the
integrator map chained through its stages (:func:`filter_transition`, :func:`_transition_stages`); the UKF's sigma
points through the mean's transition, sharing what they can of its stages (:func:`filter_sigma_transitions`); the
mean's step before a fused update with the parameter forces G at the point it reaches (:func:`advance_buffers`), and its
flat entry over buffers (:func:`advance_flat`: the model as two buffers, a point as one).  h in s; SI units.

numpy reference: ``IndependentFilter.transition``, ``xdot``, ``point_of`` and ``predict``
(estimator_service/backends/filter.py), ``UnscentedKalmanFilter.covariance_over`` (estimator_service/backends/ukf.py)
and ``ModelUncertainty.forces`` (estimator_service/backends/uncertainty.py).
"""

from __future__ import annotations

import numpy as np

from estimator_service.kernels.jit import inlined, kernel, runtime_value
from estimator_service.kernels.linalg import axpy, eliminate, eye_plus, maxpy, mm, part, rtmr, same_head
from estimator_service.kernels.manifold import accelerations, point, rate_terms, residual, velocity_terms
from estimator_service.kernels.dynamics import A_of, filter_jacobians, filter_tau


#: the filters' integrators (FilterParams.integrator) and their codes in the transition kernels
INTEGRATOR_CODES = {"heun": 1, "rk4": 2, "euler": 0}


@kernel
def stage(x, g, force, G, e0, ref_z, ref_q, ref_R, ref_Jm, tol, quad_res, max_newton, light,
           qe0, H, B, c, Hq, ang, angL, dof, M, Qg, DA, Dc):
    """The manifold point of filter state x from a reference point (IndependentFilter.point_of); ``light``
    as :func:`point`."""
    tau = filter_tau(x, g, force, G, e0, dof, ref_q.shape[0])
    return point(part(x, 0, g), part(x, g, 2 * g), tau, runtime_value(True), ref_z, ref_q, ref_R, ref_Jm, ref_q, tol, quad_res,
                  max_newton, light, qe0, H, B, c, Hq, ang, angL, dof, M, Qg, DA, Dc)


@kernel
def _xdot(x, zdd, g):
    """ẋ = [ż, z̈, 0, …] (IndependentFilter.xdot)."""
    out = np.zeros(x.shape[0])
    for i in range(g):
        out[i] = x[g + i]
        out[g + i] = zdd[i]
    return out


@kernel
def shared_velocity_terms(x0, g, z0, q0, R0, Jm0, tol, qe0, H, B, c, Hq, ang, angL, dof, M):
    """(ok, q̇, s, M s, M̄⁻¹): :func:`velocity_terms` of the sigma points at x0's z and ż, from x0's point
    (z0, q0, R0, Jm0), once for all of them: each one's :func:`point` is its reference's own position (the
    same test), and :func:`accelerations` with its τ completes its dynamics.  Not ok: find each one's."""
    e1, e2 = np.zeros(0), np.zeros((0, 0))
    if not same_head(x0, z0, g):
        return False, e1, e1, e1, e2
    q = part(q0, 0, q0.shape[0])
    for i in range(g):
        q[dof[i]] = z0[i]
    if not same_head(q, q0, q.shape[0]) or not residual(q, qe0, H, B, c, ang, angL)[1] <= tol:
        return False, e1, e1, e1, e2
    qd, s, Ms, Minv, ok = velocity_terms(q0, part(x0, g, 2 * g), R0, Jm0, M, Hq, ang, angL)
    return ok, qd, s, Ms, Minv


@kernel
def _stage_mass(SZ, SQ, SR, tol, qe0, H, B, c, ang, angL, dof, M):
    """M̄⁻¹ (S, g, g) at each recorded stage point (:func:`_transition_stages`) whose position a stage at
    the same z takes as it is (:func:`point`'s test: its q with q[dof] = z unchanged and consistent);
    (S, 0, 0) when one is not: those stages are found by :func:`point`."""
    S, g = SZ.shape[0], dof.shape[0]
    out = np.zeros((S, g, g))
    for i in range(S):
        q = part(SQ[i], 0, SQ.shape[1])
        for j in range(g):
            q[dof[j]] = SZ[i, j]
        Minv, ok = eliminate(rtmr(SR[i], M))
        if not (ok and same_head(q, SQ[i], q.shape[0]) and residual(q, qe0, H, B, c, ang, angL)[1] <= tol):
            return np.zeros((S, 0, 0))
        for a in range(g):
            for b in range(g):
                out[i, a, b] = Minv[a, b]
    return out


@kernel
def filter_sigma_transitions(X, x0, nd, h, integ, g, force, G, e0, z0, q0, qd0, R0, Jm0, zdd0, tol, quad_res,
                              max_newton, qe0, H, B, c, Hq, ang, angL, dof, M, Qg, DA, Dc):
    """(status, X⁺): each row of X (sigma points) through the mean transition of h seconds from its own
    point (found from the point of x0: z0, q0, …), as UnscentedKalmanFilter.covariance_over; rows equal
    to x0 in the dynamic part [:nd] share x0's transition; the sensor parameters [nd:] are constant.
    A row whose z (or a stage's z) equals x0's (its stage's) shares that position and its inverse
    (:func:`_transition_stages`, :func:`point`): with a lower-triangular square root of P only the rows
    along z and ż need position problems of their own, and those at x0's z and ż share its velocity terms
    too (:func:`shared_velocity_terms`).  The first status ≠ 0 stops (the caller falls back)."""
    N, L, n = X.shape[0], X.shape[1], q0.shape[0]
    out = np.empty((N, L))
    for k in range(N):
        for j in range(L):
            out[k, j] = X[k, j]
    share, vqd, vs, vMs, vMinv = shared_velocity_terms(x0, g, z0, q0, R0, Jm0, tol, qe0, H, B, c, Hq, ang, angL,
                                                        dof, M)
    e3 = np.zeros((0, 0, 0))
    st, base, _, _, _, _, _, _, _, _, SZ, SQ, SR, SJm = _transition_stages(
        x0, h, integ, g, force, G, e0, z0, q0, qd0, R0, Jm0, zdd0, runtime_value(False), runtime_value(False), tol, quad_res,
        max_newton, np.zeros((0, 0)), np.zeros((0, 0)), e3, e3, e3, runtime_value(True), qe0, H, B, c, Hq, ang, angL, dof, M, Qg, DA, Dc)
    if st != 0:
        return st, out
    SMinv = _stage_mass(SZ, SQ, SR, tol, qe0, H, B, c, ang, angL, dof, M)
    for k in range(N):
        x = X[k]
        if same_head(x, x0, nd):
            for j in range(nd):
                out[k, j] = base[j]
            continue
        zs = part(x, 0, g)
        if share and same_head(x, x0, 2 * g):
            tau = filter_tau(x, g, force, G, e0, dof, n)
            _, zdds = accelerations(q0, vqd, tau, R0, vs, vMs, vMinv, qe0, Qg, DA, Dc)
            qs, qds, Rs, Jms = q0, vqd, R0, Jm0
        else:
            st, qs, qds, _, zdds, Rs, Jms, _ = stage(x, g, force, G, e0, z0, q0, R0, Jm0, tol, quad_res, max_newton,
                                                      runtime_value(True), qe0, H, B, c, Hq, ang, angL, dof, M, Qg, DA, Dc)
            if st != 0:
                return st, out
        st, xn, _, _, _, _, _, _, _, _, _, _, _, _ = _transition_stages(
            x, h, integ, g, force, G, e0, zs, qs, qds, Rs, Jms, zdds, runtime_value(False), runtime_value(False), tol, quad_res,
            max_newton, SZ, SQ, SR, SJm, SMinv, runtime_value(False), qe0, H, B, c, Hq, ang, angL, dof, M, Qg, DA, Dc)
        if st != 0:
            return st, out
        for j in range(nd):
            out[k, j] = xn[j]
    return 0, out


#: the stages after the first of Heun's method and RK4 in :func:`filter_transition`: (a, w) = the stage is
#: evaluated at x + a h k_prev, and its slope weighs w in the sum (Heun: (k1 + k2)/2, RK4: (k1 + 2k2 + 2k3 + k4)/6)
_HEUN_STAGES = np.array([[1.0, 1.0]])
_RK4_STAGES = np.array([[0.5, 2.0], [0.5, 2.0], [1.0, 1.0]])


@inlined
def filter_transition(x, h, integ, g, force, G, e0, z0, q0, qd0, R0, Jm0, zdd0, want_point, want_jac, tol, quad_res,
                       max_newton, qe0, H, B, c, Hq, ang, angL, dof, M, Qg, DA, Dc):
    """IndependentFilter.transition from x with its point (z0, q0, q̇0, R0, Jm0, z̈0) by the integrator
    ``integ`` (INTEGRATOR_CODES): (status, x⁺, F, q, q̇, q̈, z̈, R, Jm, residual).  F = ∂x⁺/∂x (if
    ``want_jac``, else empty) is the exact Jacobian of the integrator map chained through its stages;
    (q … residual) is the point of x⁺ found from the last stage's (if ``want_point``, else empty:
    IndependentFilter.predict).  Status as :func:`point`, 2 also for a singular state Jacobian; ≠ 0:
    the caller falls back to the reference path."""
    e3 = np.zeros((0, 0, 0))
    out = _transition_stages(x, h, integ, g, force, G, e0, z0, q0, qd0, R0, Jm0, zdd0, want_point, want_jac, tol,
                             quad_res, max_newton, np.zeros((0, 0)), np.zeros((0, 0)), e3, e3, e3, runtime_value(False),
                             qe0, H, B, c, Hq, ang, angL, dof, M, Qg, DA, Dc)
    return out[0], out[1], out[2], out[3], out[4], out[5], out[6], out[7], out[8], out[9]


@kernel
def _transition_stages(x, h, integ, g, force, G, e0, z0, q0, qd0, R0, Jm0, zdd0, want_point, want_jac, tol, quad_res,
                       max_newton, SZ, SQ, SR, SJm, SMinv, record, qe0, H, B, c, Hq, ang, angL, dof, M, Qg, DA, Dc):
    """:func:`filter_transition`, and the stage points: (its result, then the z, q, R, Jm of each stage after
    the first, stacked, if ``record``).  Given SZ, SQ, SR, SJm (a recorded transition's stages: the
    mean's), stage i is a light point found from (SZ[i], SQ[i], SR[i], SJm[i]) (:func:`point`); at the same
    z (the sigma points along c, b, ε) its position and inverse, and with SMinv[i] (:func:`_stage_mass`;
    empty: not shared) its M̄⁻¹ too, with no position check of its own (the same check for every row)."""
    L, n, m = x.shape[0], q0.shape[0], Jm0.shape[1]
    e1, e2 = np.zeros(0), np.zeros((0, 0))
    nst = 0 if integ == 0 else (_HEUN_STAGES.shape[0] if integ == 1 else _RK4_STAGES.shape[0])
    ns = nst if record else 0
    rec = (np.zeros((ns, g)), np.zeros((ns, n)), np.zeros((ns, n, g)), np.zeros((ns, n, m)))
    fail = (x, e2, e1, e1, e1, e1, e2, e2, np.inf) + rec
    k1 = _xdot(x, zdd0, g)
    A1 = e2
    if want_jac:
        _, _, D, ok = filter_jacobians(x, q0, qd0, R0, Jm0, L, g, force, G, e0, qe0, Hq, ang, angL, dof, M, Qg, DA, Dc)
        if not ok:
            return (2,) + fail
        A1 = A_of(D, dof, g)
    F = e2
    rz, rq, rR, rJm = z0, q0, R0, Jm0
    if integ == 0:
        xn = axpy(x, h, k1)
        if want_jac:
            F = eye_plus(h, A1)
    else:
        # Heun: one stage at x + h k1; RK4: stages at x + h/2 k1, x + h/2 k2, x + h k3 — each stage's point
        # found from the previous one's; D_s = A_s (I + a h D_prev) chains the stage Jacobians
        stages = _HEUN_STAGES if integ == 1 else _RK4_STAGES
        acc, k, Dk, Fsum = k1, k1, A1, A1  # (never written in place)
        for i in range(stages.shape[0]):
            a, w = stages[i, 0], stages[i, 1]
            xs = axpy(x, a * h, k)
            light = i < SZ.shape[0]
            if light:
                rz, rq, rR, rJm = SZ[i], SQ[i], SR[i], SJm[i]
            if light and SMinv[i].shape[0] and same_head(xs, rz, g):  # the stage's position and M̄⁻¹
                tau = filter_tau(xs, g, force, G, e0, dof, n)
                qs, Rs, Jms = rq, rR, rJm
                qds, ss, Mss = rate_terms(rq, part(xs, g, 2 * g), rR, rJm, M, Hq, ang, angL)
                _, zdds = accelerations(rq, qds, tau, rR, ss, Mss, SMinv[i], qe0, Qg, DA, Dc)
            else:
                st, qs, qds, _, zdds, Rs, Jms, _ = stage(xs, g, force, G, e0, rz, rq, rR, rJm, tol, quad_res,
                                                          max_newton, light, qe0, H, B, c, Hq, ang, angL, dof, M, Qg,
                                                          DA, Dc)
                if st != 0:
                    return (st,) + fail
            k = _xdot(xs, zdds, g)
            acc = axpy(acc, w, k)
            rz, rq, rR, rJm = part(xs, 0, g), qs, Rs, Jms
            if record:
                for j in range(n):
                    rec[1][i, j] = qs[j]
                    for l in range(g):
                        rec[2][i, j, l] = Rs[j, l]
                    for l in range(m):
                        rec[3][i, j, l] = Jms[j, l]
                for j in range(g):
                    rec[0][i, j] = rz[j]
            if want_jac:
                _, _, D, ok = filter_jacobians(xs, qs, qds, Rs, Jms, L, g, force, G, e0, qe0, Hq, ang, angL, dof, M, Qg,
                                                DA, Dc)
                if not ok:
                    return (2,) + fail
                Dk = mm(A_of(D, dof, g), eye_plus(a * h, Dk))
                Fsum = maxpy(Fsum, w, Dk)
        if integ == 1:
            xn = axpy(x, 0.5 * h, acc)
            if want_jac:
                F = eye_plus(0.5 * h, Fsum)
        else:
            xn = axpy(x, h / 6, acc)
            if want_jac:
                F = eye_plus(h / 6, Fsum)
    if not want_point:
        return (0, xn, F, e1, e1, e1, e1, e2, e2, 0.0) + rec
    st, q, qd, qdd, zdd, R, Jm, res = stage(xn, g, force, G, e0, rz, rq, rR, rJm, tol, quad_res, max_newton,
                                             runtime_value(False), qe0, H, B, c, Hq, ang, angL, dof, M, Qg, DA, Dc)
    return (st, xn, F, q, qd, qdd, zdd, R, Jm, res) + rec


#: the fused updates' status when the mean's transition to the update's time needs the reference path
#: (nothing done)
ADVANCE_FAILED = 7


# One buffer per model and per point.  A call from Python costs ~0.1 µs per array argument and ~0.4 µs per
# array returned when warm, and several times that from a cold cache (numba's dispatcher types and unboxes
# each argument, and boxes each result through a Python-level call): the per-step mean's transition took 32
# arguments and returned 11 values.  Its flat entry (:func:`advance_flat`) takes the model as two arrays,
# the point as one, and writes its results into buffers the caller allocated.


#: the model's float arrays in ModelKernels.mf, in this order: qe0, H, B, c, Hq, angL, M, Qg, DA, Dc
MODEL_FLOATS = 10


@kernel
def model_views(mf, mi):
    """The model's arrays (qe0, H, B, c, Hq, ang, angL, dof, M, Qg, DA, Dc) as views of its two buffers
    (ModelKernels.mf, mi: mi[0:2 * MODEL_FLOATS] are each float array's start and size in mf, then
    n, ne, m, g, the counts of H, B, Hq rows, angle rows and dampers, then ang (k, 6) and dof (g,))."""
    o = mi[: 2 * MODEL_FLOATS]
    n, ne, g, nH, nB, nHq, na, nd = mi[20], mi[21], mi[23], mi[24], mi[25], mi[26], mi[27], mi[28]  # (mi[22]: m)
    qe0 = mf[o[0] : o[0] + o[1]]
    H = mf[o[2] : o[2] + o[3]].reshape((nH, 4))
    B = mf[o[4] : o[4] + o[5]].reshape((nB, 3))
    c = mf[o[6] : o[6] + o[7]]
    Hq = mf[o[8] : o[8] + o[9]].reshape((nHq, 4))
    angL = mf[o[10] : o[10] + o[11]]
    M = mf[o[12] : o[12] + o[13]].reshape((n, n))
    Qg = mf[o[14] : o[14] + o[15]]
    DA = mf[o[16] : o[16] + o[17]].reshape((nd, ne, ne))
    Dc = mf[o[18] : o[18] + o[19]]
    ang = mi[29 : 29 + 6 * na].reshape((na, 6))
    dof = mi[29 + 6 * na : 29 + 6 * na + g]
    return qe0, H, B, c, Hq, ang, angL, dof, M, Qg, DA, Dc


@kernel
def point_views(pt, n, m, g):
    """(z, q, q̇, q̈, z̈, R, Jm, residual) of a point buffer (ModelKernels.point_buffer: z (g), q, q̇, q̈ (n each), z̈
    (g), R (n, g), Jm (n, m), residual), the arrays as views."""
    a = g + 3 * n + g
    return (pt[:g], pt[g : g + n], pt[g + n : g + 2 * n], pt[g + 2 * n : g + 3 * n], pt[g + 3 * n : a],
            pt[a : a + n * g].reshape((n, g)), pt[a + n * g : a + n * g + n * m].reshape((n, m)), pt[a + n * g + n * m])


@kernel
def pack_point(out, z, q, qd, qdd, zdd, R, Jm, res):
    """Write a point into its buffer ``out`` (:func:`point_views`' layout)."""
    n, g, m = q.shape[0], z.shape[0], Jm.shape[1]
    for i in range(g):
        out[i] = z[i]
        out[g + 3 * n + i] = zdd[i]
    for i in range(n):
        out[g + i] = q[i]
        out[g + n + i] = qd[i]
        out[g + 2 * n + i] = qdd[i]
    a = g + 3 * n + g
    for i in range(n):
        for j in range(g):
            out[a + i * g + j] = R[i, j]
        for j in range(m):
            out[a + n * g + i * m + j] = Jm[i, j]
    out[a + n * g + n * m] = res


@inlined
def advance_buffers(h, integ, x, pt, force, G, e0, G0, T, tol, quad_res, max_newton, mf, mi, pt_out):
    """(status, x⁺, G⁺): the mean's transition of h seconds from x with its point (IndependentFilter.predict, the
    integrator ``integ``), the model as its two buffers (:func:`model_views`) and x's point as one
    (:func:`point_views`); the point x⁺ reaches is written to ``pt_out``, and G⁺ (n, K) = G0 − T q̈ there
    (ModelUncertainty.forces).  h = 0: x, its point and G as given.  Status ≠ 0 as :func:`filter_transition` (x and
    G as given, ``pt_out`` not written).  The start of the flat entries (:func:`advance_flat`, the fused updates'
    first calls)."""
    qe0, H, B, c, Hq, ang, angL, dof, M, Qg, DA, Dc = model_views(mf, mi)
    n, m, g = M.shape[0], c.shape[0], dof.shape[0]
    z, q, qd, qdd, zdd, R, Jm, res = point_views(pt, n, m, g)
    if h <= 0.0:
        pack_point(pt_out, z, q, qd, qdd, zdd, R, Jm, res)
        return 0, x, G
    st, xn, _, qn, qdn, qddn, zddn, Rn, Jmn, resn = filter_transition(
        x, h, integ, g, force, G, e0, z, q, qd, R, Jm, zdd, runtime_value(True), runtime_value(False), tol, quad_res,
        max_newton, qe0, H, B, c, Hq, ang, angL, dof, M, Qg, DA, Dc)
    if st != 0:
        return st, x, G
    Gn = np.empty(G.shape)
    for i in range(G.shape[0]):
        for j in range(G.shape[1]):
            acc = 0.0
            for k in range(qddn.shape[0]):
                acc += T[i, j, k] * qddn[k]
            Gn[i, j] = G0[i, j] - acc
    pack_point(pt_out, part(xn, 0, g), qn, qdn, qddn, zddn, Rn, Jmn, resn)
    return 0, xn, Gn


@kernel
def advance_flat(h, integ, x, pt, force, G, e0, G0, T, tol, quad_res, max_newton, mf, mi, x_out, pt_out, G_out):
    """:func:`advance_buffers` with x⁺ and G⁺ written to ``x_out`` and ``G_out`` too; returns the status (≠ 0:
    nothing written)."""
    st, xn, Gn = advance_buffers(h, integ, x, pt, force, G, e0, G0, T, tol, quad_res, max_newton, mf, mi, pt_out)
    if st != 0:
        return st
    for i in range(xn.shape[0]):
        x_out[i] = xn[i]
    for i in range(Gn.shape[0]):
        for j in range(Gn.shape[1]):
            G_out[i, j] = Gn[i, j]
    return 0

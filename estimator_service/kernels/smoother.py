"""The smoothers' rows in compiled code: the dependent-coordinate ``fgs``'s dynamics and step rows, the independent
smoother's model at a state, a chunk's positions and its step rows.

The dependent smoother's state x = [q, q̇, c, b, ε, p]: forward dynamics with the parameter errors ε in M and the
gravity forces (:func:`fgs_dynamics`, :func:`fgs_accel`), the trapezoidal step rows with the position and velocity
constraints (:func:`fgs_step`).  The independent smoother's x = [z, ż, c, b, η, p]: the manifold point and the
filters' state Jacobians under M(η) (:func:`smoother_point`), a chunk's points (:func:`smoother_positions`), its
step rows (:func:`smoother_step_rows`).  dt in s; SI units.

numpy reference: ``FixedLagSmoother._dynamics``, ``_accel``, ``_forces_and_mass`` and ``_step_residual``
(estimator_service/backends/fgs.py); ``IndependentSmoother._entry``, ``_jacobians``, ``_predict``, ``_positions``
and ``_step_residual`` (estimator_service/backends/fgs_independent.py).
"""

from __future__ import annotations

import numpy as np

from estimator_service.kernels.jit import kernel, runtime_value
from estimator_service.kernels.linalg import axpy, maxpy, part
from estimator_service.kernels.manifold import hess_contract, eval_phi, point_full
from estimator_service.kernels.dynamics import fd, fdjt, filter_jacobians, filter_tau


@kernel
def _param_model(eta, M, dMs, dQs):
    """(M + Σ η_k dMs[k] (n, n), Σ η_k dQs[k] (n,)): the mass matrix and the extra gravity forces of a model with
    parameter errors η (K,) along the directions ``dMs`` (K, n, n), ``dQs`` (K, n) (backends/uncertainty.py);
    M itself without η.  The smoothers' model (FixedLagSmoother._param_model)."""
    n, K = M.shape[0], eta.shape[0]
    Qe = np.zeros(n)
    if K == 0:
        return M, Qe
    dM = np.zeros((n, n))
    for k in range(K):
        for i in range(n):
            Qe[i] += eta[k] * dQs[k, i]
            for j in range(n):
                dM[i, j] += eta[k] * dMs[k, i, j]
    return maxpy(M, 1.0, dM), Qe


@kernel
def _fgs_forces_mass(x, dof, M, dMs, dQs):
    """(q, q̇, τ, M(ε)) of the smoother's x = [q, q̇, c, b, ε, p]: τ_dof = b − c ⊙ ż plus the parameter errors'
    forces Σ ε_k dQs[k], M(ε) = M + Σ ε_k dMs[k] (FixedLagSmoother._forces_and_mass, :func:`_param_model`)."""
    n, g, K = M.shape[0], dof.shape[0], dQs.shape[0]
    q, qd = x[:n].copy(), x[n : 2 * n].copy()
    tau = np.zeros(n)
    for i in range(g):
        tau[dof[i]] = x[2 * n + g + i] - x[2 * n + i] * qd[dof[i]]
    Me, Qe = _param_model(np.ascontiguousarray(x[2 * n + 2 * g : 2 * n + 2 * g + K]), M, dMs, dQs)
    return q, qd, tau + Qe, Me


@kernel
def fgs_accel(x, qe0, H, B, c, Hq, ang, angL, dof, M, Qg, DA, Dc, dMs, dQs):
    """(q̈, ok) at the smoother's x, without Jacobians (FixedLagSmoother._accel)."""
    q, qd, tau, Me = _fgs_forces_mass(x, dof, M, dMs, dQs)
    return fd(q, qd, tau, qe0, H, B, c, Hq, ang, angL, Me, Qg, DA, Dc)


@kernel
def fgs_dynamics(x, qe0, H, B, c, Hq, ang, angL, dof, M, Qg, DA, Dc, dMs, dQs):
    """(q̈, ∂q̈/∂x (n, len(x)), ok) at the smoother's x = [q, q̇, c, b, ε, p] with τ_dof = b − c ⊙ ż and
    the model's parameter errors ε (K = len(dQs)): M + Σ ε_k dMs[k], gravity forces + Σ ε_k dQs[k]
    (FixedLagSmoother._dynamics; the sensor parameters p do not enter the dynamics)."""
    n, g, K = M.shape[0], dof.shape[0], dQs.shape[0]
    q, qd, tau, Me = _fgs_forces_mass(x, dof, M, dMs, dQs)
    f, dq, dqd, dtau, ok = fdjt(q, qd, tau, qe0, H, B, c, Hq, ang, angL, Me, Qg, DA, Dc)
    F = np.zeros((n, x.shape[0]))
    for k in range(K):  # ∂q̈/∂ε_k = ∂q̈/∂τ (dQ_k − dM_k q̈)
        F[:, 2 * n + 2 * g + k] = dtau @ (dQs[k] - dMs[k] @ f)
    F[:, :n] = dq
    F[:, n : 2 * n] = dqd
    for i in range(g):
        d = dof[i]
        for r in range(n):
            G = dtau[r, d]
            F[r, n + d] -= G * x[2 * n + i]
            F[r, 2 * n + i] = -G * qd[d]
            F[r, 2 * n + g + i] = G
    return f, F, ok


@kernel
def _trapezoid_jacobians(J_prev0, J_cur0, Fp, Fc, dof, dt):
    """(J_prev, J_cur) of a smoother step's rows: their constant parts J_prev0, J_cur0 less Δt/2 ∂f/∂x of x_{k−1}
    (``Fp``) and x_k (``Fc``) on the trapezoidal dynamics rows g … 2g − 1, f the DOF rows (``dof``) of q̈."""
    g = dof.shape[0]
    Jp, Jc = J_prev0.copy(), J_cur0.copy()
    for i in range(g):
        d = dof[i]
        for k in range(Jp.shape[1]):
            Jp[g + i, k] -= dt / 2 * Fp[d, k]
            Jc[g + i, k] -= dt / 2 * Fc[d, k]
    return Jp, Jc


@kernel
def fgs_step(xp, xc, has_prev, dt, fp, Fp, fc, Fc, Jp0, Jc0, want_jac, qe0, H, B, c, Hq, ang, angL, dof):
    """(e, J_prev, J_cur) of one step's dynamics rows: FixedLagSmoother._step_residual's reference
    (integrator rows of the DOF, position and velocity constraints, random walks of [c, b, p])."""
    n, m, g, dim = fc.shape[0], c.shape[0], dof.shape[0], xc.shape[0]
    q, qd = xc[:n].copy(), xc[n : 2 * n].copy()
    phi, Jq = eval_phi(q, qe0, H, B, c, ang, angL, True)
    e = np.zeros(2 * g + 2 * m + dim - 2 * n)
    if has_prev:
        for i in range(g):
            d = dof[i]
            e[i] = q[d] - xp[d] - dt / 2 * (xp[n + d] + qd[d])
            e[g + i] = qd[d] - xp[n + d] - dt / 2 * (fp[d] + fc[d])
        for j in range(dim - 2 * n):
            e[2 * g + 2 * m + j] = xc[2 * n + j] - xp[2 * n + j]
    e[2 * g : 2 * g + m] = phi
    e[2 * g + m : 2 * g + 2 * m] = Jq @ qd
    if not want_jac:
        return e, np.zeros((0, 0)), np.zeros((0, 0))
    if has_prev:
        Jp, Jc = _trapezoid_jacobians(Jp0, Jc0, Fp, Fc, dof, dt)
    else:
        Jp, Jc = np.zeros_like(Jp0), np.zeros_like(Jc0)
    Jc[2 * g : 2 * g + m, :n] = Jq
    Jc[2 * g + m : 2 * g + 2 * m, :n] = hess_contract(q, qd, Hq, m, ang, angL)
    Jc[2 * g + m : 2 * g + 2 * m, n : 2 * n] = Jq
    return e, Jp, Jc


@kernel
def _smoother_model(x, g, e0, p0, dMs, dQs, M, dof):
    """(τ (n,), M(η) (n, n), gravity forces of η (n,)) of the independent smoother's x = [z, ż, c, b, η, p]: the
    DOF force τ = b − c ⊙ ż as the filters' (:func:`filter_tau`), and :func:`_param_model` of η
    (IndependentSmoother._entry)."""
    n = M.shape[0]
    tau = filter_tau(x, g, runtime_value(True), np.zeros((n, 0)), e0, dof, n)
    Me, Qe = _param_model(part(x, e0, p0), M, dMs, dQs)
    return tau, Me, Qe


@kernel
def smoother_point(x, zdd, dt, g, e0, p0, has_ref, ref_z, ref_q, ref_R, ref_Jm, q_guess, want_jac, dMs, dQs,
                    tol, quad_res, max_newton, qe0, H, B, c, Hq, ang, angL, dof, M, Qg, DA, Dc):
    """The independent smoother's model at its state x = [z, ż, c, b, η, p] in one call (IndependentSmoother._entry,
    and _jacobians if ``want_jac``), or (dt > 0) at x's Taylor step z + Δt ż + Δt²/2 z̈, ż + Δt z̈ with z̈ = ``zdd``
    (IndependentSmoother._predict: the guess for the next step): (status, x⁺ (x itself if dt = 0), q, q̇, q̈, z̈, R,
    Jm, residual, R, ∂q̇/∂z, ∂q̈/∂x).  The point of (z, ż) under the DOF force τ = b − c ⊙ ż and the model with
    parameter errors η, M(η) = M + Σ η_k dMs[k] and gravity forces + Σ η_k dQs[k] (:func:`_smoother_model`), by
    :func:`point` from the reference point (or from ``q_guess`` without one); its state Jacobians are the filters'
    (:func:`filter_jacobians`) with ∂q̈/∂η_k = ∂q̈/∂τ (dQs[k] − dMs[k] q̈).  Status as :func:`point`, 3 when the
    state Jacobians are singular; the Jacobians empty unless ``want_jac`` and status 0."""
    if dt > 0.0:
        x = part(x, 0, x.shape[0])
        h2 = 0.5 * dt * dt
        for i in range(g):
            x[i] += dt * x[g + i] + h2 * zdd[i]
            x[g + i] += dt * zdd[i]
    tau, Me, Qe = _smoother_model(x, g, e0, p0, dMs, dQs, M, dof)
    st, q, qd, qdd, zddn, R, Jm, res = point_full(part(x, 0, g), part(x, g, 2 * g), axpy(tau, 1.0, Qe), has_ref,
                                                   ref_z, ref_q, ref_R, ref_Jm, q_guess, tol, quad_res, max_newton, qe0,
                                                   H, B, c, Hq, ang, angL, dof, Me, Qg, DA, Dc)
    e2 = np.zeros((0, 0))
    if st != 0 or not want_jac:
        return st, x, q, qd, qdd, zddn, R, Jm, res, e2, e2, e2
    n, K = q.shape[0], p0 - e0
    G = np.zeros((n, K))
    for k in range(K):
        for i in range(n):
            acc = dQs[k, i]
            for j in range(n):
                acc -= dMs[k, i, j] * qdd[j]
            G[i, k] = acc
    x0 = part(x, 0, x.shape[0])
    for k in range(K):  # η enters through M(η) and the gravity forces, not as a force G η
        x0[e0 + k] = 0.0
    Rj, dqd_dz, D, ok = filter_jacobians(x0, q, qd, R, Jm, x.shape[0], g, runtime_value(True), G, e0, qe0, Hq, ang, angL, dof, Me,
                                          axpy(Qg, 1.0, Qe), DA, Dc)
    if not ok:
        return 3, x, q, qd, qdd, zddn, R, Jm, res, e2, e2, e2
    return 0, x, q, qd, qdd, zddn, R, Jm, res, Rj, dqd_dz, D


@kernel
def smoother_positions(X, g, e0, p0, ref_z, ref_q, ref_R, ref_Jm, dMs, dQs, tol, quad_res, max_newton, qe0, H,
                        B, c, Hq, ang, angL, dof, M, Qg, DA, Dc):
    """(status (N,), q (N, n), q̇ (N, n), and q̈, z̈, R, Jm, residual of the last row) of the independent smoother's
    states X (N, len(x)) (a chunk's estimates), each point found from the one before (the first from the reference
    point (z, q, R, Jm)) as :func:`smoother_point` finds it; a row whose status ≠ 0 (as :func:`point`) and the
    rows after it are left to the caller (the last row's terms are then zeros)."""
    N, n = X.shape[0], ref_q.shape[0]
    st = np.ones(N, np.int64)
    Q, QD = np.zeros((N, n)), np.zeros((N, n))
    qdd, zdd, R, Jm, res = np.zeros(n), np.zeros(g), np.zeros((n, g)), np.zeros((n, ref_Jm.shape[1])), 0.0
    rz, rq, rR, rJm = ref_z, ref_q, ref_R, ref_Jm
    for k in range(N):
        x = X[k]
        tau, Me, Qe = _smoother_model(x, g, e0, p0, dMs, dQs, M, dof)
        z = part(x, 0, g)
        out = point_full(z, part(x, g, 2 * g), axpy(tau, 1.0, Qe), runtime_value(True), rz, rq, rR, rJm, rq, tol, quad_res,
                          max_newton, qe0, H, B, c, Hq, ang, angL, dof, Me, Qg, DA, Dc)
        st[k] = out[0]
        if out[0] != 0:
            break
        for j in range(n):
            Q[k, j], QD[k, j] = out[1][j], out[2][j]
        rz, rq, rR, rJm = z, out[1], out[5], out[6]
        if k == N - 1:
            qdd, zdd, R, Jm, res = out[3], out[4], out[5], out[6], out[7]
    return st, Q, QD, qdd, zdd, R, Jm, res


@kernel
def smoother_step_rows(xp, xc, zdd_p, zdd_c, Dp, Dc_, dt, dof, J_prev0, J_cur0, want_jac):
    """(e, J_prev, J_cur) of the independent smoother's step rows between x_{k−1} = ``xp`` and x_k = ``xc``
    with their z̈ and ∂q̈/∂x (IndependentSmoother._step_residual): e = x_k − x_{k−1} less the trapezoidal
    increments of z (by ż) and ż (by z̈); the Jacobians empty unless ``want_jac``."""
    g = dof.shape[0]
    e = xc - xp
    for i in range(g):
        e[i] -= dt / 2 * (xp[g + i] + xc[g + i])
        e[g + i] -= dt / 2 * (zdd_p[i] + zdd_c[i])
    if not want_jac:
        e2 = np.zeros((0, 0))
        return e, e2, e2
    Jp, Jc = _trapezoid_jacobians(J_prev0, J_cur0, Dp, Dc_, dof, dt)
    return e, Jp, Jc

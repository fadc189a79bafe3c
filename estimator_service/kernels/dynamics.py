"""The forward dynamics with its Jacobians in compiled code, of the model and of a filter state.

The KKT form K [q̈; λ] = [Q; γ], K = [[M, Φ_qᵀ], [Φ_q, 0]], and its derivatives by q, q̇ and τ (:func:`fdjt`,
:func:`state_jacobians`); a filter state x = [z, ż, c, b, ε, p]'s DOF force τ = b − c ⊙ ż plus G ε
(:func:`filter_tau`) and its ∂q̈/∂x through its point's R-matrix factors instead of K⁻¹ (:func:`filter_jacobians`),
A = ∂ẋ/∂x (:func:`A_of`).  SI units; arrays as manifold.py describes them.

numpy reference: ``Model.forward_dynamics``, ``forward_dynamics_jac_tau``, ``Q_jac``, ``_kkt`` and
``state_jacobians`` (estimator_service/model.py); ``dqdd_dx`` (estimator_service/backends/manifold.py) and
``IndependentFilter.tau``, ``A`` (estimator_service/backends/filter.py).
"""

from __future__ import annotations

import math

import numpy as np

from estimator_service.kernels.jit import kernel
from estimator_service.kernels.linalg import dot, eliminate, inverse, mm, mmt, mtm, mtv, mv, rtmr
from estimator_service.kernels.manifold import dof_inverse, extend, forces, gamma, hess_contract, padded, eval_phi


@kernel
def filter_tau(x, g, force, G, e0, dof, n):
    """τ (n,) of a filter state x = [z, ż, c, b, ε, p]: b − c ⊙ ż on the DOF coordinates (if ``force``)
    plus G ε (IndependentFilter.tau); ``G`` (n, K) is empty (n, 0) without ε."""
    tau = np.zeros(n)
    if force:
        for i in range(g):
            tau[dof[i]] = x[3 * g + i] - x[2 * g + i] * x[g + i]
    for i in range(n):
        for k in range(G.shape[1]):
            tau[i] += G[i, k] * x[e0 + k]
    return tau


@kernel
def _forces_jac(q, qd, qe0, DA, Dc):
    """(∂Q/∂q, ∂Q/∂q̇), each (n, n): Model.Q_jac (the dampers' bilinear rate forms)."""
    n = q.shape[0]
    dQ_dq, dQ_dqd = np.zeros((n, n)), np.zeros((n, n))
    if DA.shape[0]:
        qe = extend(qe0, q)
        qde = padded(qd, qe0.shape[0])
        for k in range(DA.shape[0]):
            A, ck = DA[k], Dc[k]
            j = mtv(A, qe)
            Aqd = mv(A, qde)
            w = dot(qe, Aqd)
            for i in range(n):
                for l in range(n):
                    dQ_dqd[i, l] -= ck * j[i] * j[l]
                    dQ_dq[i, l] -= ck * (A[l, i] * w + j[i] * Aqd[l])
    return dQ_dq, dQ_dqd


@kernel
def _kkt_inverse(q, qe0, H, B, c, ang, angL, M):
    """(K⁻¹, ok) of the KKT matrix K = [[M, Φ_qᵀ], [Φ_q, 0]] (Model._kkt)."""
    n, m = q.shape[0], c.shape[0]
    _, J = eval_phi(q, qe0, H, B, c, ang, angL, True)
    K = np.zeros((n + m, n + m))
    K[:n, :n] = M
    K[:n, n:] = J.T
    K[n:, :n] = J
    return inverse(K)


@kernel
def _kkt_rhs_jac(q, qd, qdd, lam, Cqd, qe0, Hq, ang, angL, DA, Dc):
    """(R_q, R_q̇), each (n + m, n): the derivatives by q and q̇, at fixed (q̈, λ), of the KKT system's
    [Q − M q̈ − Φ_qᵀλ; γ − Φ_q q̈] at a solution (q̈, λ): the forward dynamics' Jacobians ∂q̈/∂q, ∂q̈/∂q̇ are
    K⁻¹[:n] times these.  ``Cqd`` = Σ_l ∂²Φ/∂q∂q_l q̇_l (:func:`hess_contract`)."""
    n, m = q.shape[0], lam.shape[0]
    dQ_dq, dQ_dqd = _forces_jac(q, qd, qe0, DA, Dc)
    R_q = np.empty((n + m, n))
    R_qd = np.empty((n + m, n))
    Cqdd = hess_contract(q, qdd, Hq, m, ang, angL)
    for j in range(n):
        for i in range(n):
            R_q[i, j] = dQ_dq[i, j]
            R_qd[i, j] = dQ_dqd[i, j]
        for i in range(m):
            R_q[n + i, j] = -Cqdd[i, j]
            R_qd[n + i, j] = -2.0 * Cqd[i, j]
    # ∂(Φ_qᵀλ)/∂q = Σ_r λ_r ∇²Φ_r
    for e in range(Hq.shape[0]):
        R_q[int(Hq[e, 1]), int(Hq[e, 2])] -= lam[int(Hq[e, 0])] * Hq[e, 3]
    for k in range(ang.shape[0]):
        row, th = ang[k, 0], ang[k, 1]
        L = angL[k]
        s, co = math.sin(q[th]), math.cos(q[th])
        if abs(s) >= abs(co):
            d2, d3 = L * co, -L * s
        else:
            d2, d3 = L * s, L * co
        R_q[th, th] -= lam[row] * d2
        R_q[n + row, th] += -d3 * qd[th] * qd[th]
    return R_q, R_qd


@kernel
def fdjt(q, qd, tau, qe0, H, B, c, Hq, ang, angL, M, Qg, DA, Dc):
    """(q̈, ∂q̈/∂q, ∂q̈/∂q̇, ∂q̈/∂τ, ok): Model.forward_dynamics_jac_tau (KKT form, Lagrange multipliers)."""
    n, m = q.shape[0], c.shape[0]
    Kinv, ok = _kkt_inverse(q, qe0, H, B, c, ang, angL, M)
    Cqd = hess_contract(q, qd, Hq, m, ang, angL)
    rhs = np.empty(n + m)
    rhs[:n] = forces(q, qd, tau, qe0, Qg, DA, Dc)
    rhs[n:] = -(Cqd @ qd)
    x = Kinv @ rhs
    qdd, lam = x[:n].copy(), x[n:].copy()
    R_q, R_qd = _kkt_rhs_jac(q, qd, qdd, lam, Cqd, qe0, Hq, ang, angL, DA, Dc)
    Kn = np.ascontiguousarray(Kinv[:n])
    return qdd, Kn @ R_q, Kn @ R_qd, np.ascontiguousarray(Kinv[:n, :n]), ok


@kernel
def fd(q, qd, tau, qe0, H, B, c, Hq, ang, angL, M, Qg, DA, Dc):
    """(q̈, ok): Model.forward_dynamics (KKT form)."""
    n, m = q.shape[0], c.shape[0]
    Kinv, ok = _kkt_inverse(q, qe0, H, B, c, ang, angL, M)
    rhs = np.empty(n + m)
    rhs[:n] = forces(q, qd, tau, qe0, Qg, DA, Dc)
    rhs[n:] = gamma(q, qd, Hq, c.shape[0], ang, angL)
    return (Kinv @ rhs)[:n].copy(), ok


@kernel
def _kkt_rows(V, R, Jm, Mbinv, M):
    """K⁻¹[:n] V (n, k) for V (n + m, k), K the KKT matrix, from the R-matrix factors of a consistent point
    instead of K⁻¹: q̈ = N Q + (I − N M) Jm γ with N = R M̄⁻¹ Rᵀ, so K⁻¹[:n] = [N, (I − N M) Jm] and
    K⁻¹[:n] V = W + N (V[:n] − M W) with W = Jm V[n:].  O(n m k) against O((n + m)³) for K⁻¹."""
    n, m, k = R.shape[0], Jm.shape[1], V.shape[1]
    Vm = np.empty((m, k))
    for i in range(m):
        for j in range(k):
            Vm[i, j] = V[n + i, j]
    W = mm(Jm, Vm)
    MW = mm(M, W)
    U = np.empty((n, k))
    for i in range(n):
        for j in range(k):
            U[i, j] = V[i, j] - MW[i, j]
    out = mm(R, mm(Mbinv, mtm(R, U)))
    for i in range(n):
        for j in range(k):
            out[i, j] = W[i, j] + out[i, j]
    return out


@kernel
def state_jacobians(q, qd, tau, qe0, H, B, c, Hq, ang, angL, dof, M, Qg, DA, Dc):
    """(R, ∂q̇/∂z, q̈, ∂q̈/∂q, ∂q̈/∂q̇, ∂q̈/∂τ, ok): Model.state_jacobians for a square system."""
    qdd, dq, dqd, dtau, ok1 = fdjt(q, qd, tau, qe0, H, B, c, Hq, ang, angL, M, Qg, DA, Dc)
    Jinv, ok2 = dof_inverse(q, qe0, H, B, c, ang, angL, dof)
    m = c.shape[0]
    R = np.ascontiguousarray(Jinv[:, m:])
    dqd_dz = (np.ascontiguousarray(Jinv[:, :m]) @ -hess_contract(q, qd, Hq, m, ang, angL)) @ R
    return R, dqd_dz, qdd, dq, dqd, dtau, ok1 and ok2


@kernel
def filter_jacobians(x, q, qd, R, Jm, L, g, force, G, e0, qe0, Hq, ang, angL, dof, M, Qg, DA, Dc):
    """(R, ∂q̇/∂z, ∂q̈/∂x (n, L), ok) of filter state x at its point (q, q̇, R, Jm): the forward dynamics'
    state Jacobians (as :func:`fdjt`, but with K⁻¹[:n] applied through the point's R-matrix factors,
    :func:`_kkt_rows`) chained through q = q(z), q̇ = R ż and τ(x) (IndependentFilter._dqdd_dx).  q̈ is
    found again for τ(x) (a point's q̈ may be of the τ before its parameter forces were refreshed):
    q̈ = R M̄⁻¹Rᵀ(Q − M s) + s, s = Jm γ, and λ = Jmᵀ(Q − M q̈) (the KKT system's first rows, Φ_q Jm = I).
    ok: M̄ = RᵀMR is invertible."""
    n, m = q.shape[0], Jm.shape[1]
    tau = filter_tau(x, g, force, G, e0, dof, n)
    Cqd = hess_contract(q, qd, Hq, m, ang, angL)
    Mbinv, ok = eliminate(rtmr(R, M))
    Q = forces(q, qd, tau, qe0, Qg, DA, Dc)
    s = mv(Jm, mv(Cqd, qd))
    for i in range(n):
        s[i] = -s[i]
    Ms = mv(M, s)
    t = np.empty(n)
    for i in range(n):
        t[i] = Q[i] - Ms[i]
    qdd = mv(R, mv(Mbinv, mtv(R, t)))
    for i in range(n):
        qdd[i] += s[i]
    Mq = mv(M, qdd)
    for i in range(n):
        t[i] = Q[i] - Mq[i]
    lam = mtv(Jm, t)
    R_q, R_qd = _kkt_rhs_jac(q, qd, qdd, lam, Cqd, qe0, Hq, ang, angL, DA, Dc)
    dqd_dz = mm(Jm, mm(Cqd, R))
    for i in range(n):
        for j in range(g):
            dqd_dz[i, j] = -dqd_dz[i, j]
    V = mm(R_q, R)
    V2 = mm(R_qd, dqd_dz)
    for i in range(V.shape[0]):
        for j in range(g):
            V[i, j] += V2[i, j]
    Dz = _kkt_rows(V, R, Jm, Mbinv, M)
    Dzd = _kkt_rows(mm(R_qd, R), R, Jm, Mbinv, M)
    D = np.zeros((n, L))
    for r in range(n):
        for j in range(g):
            D[r, j] = Dz[r, j]
            D[r, g + j] = Dzd[r, j]
    if force:  # ∂q̈/∂τ_dof = N[:, dof] = R M̄⁻¹ R[dof]ᵀ
        Rd = np.empty((g, g))
        for i in range(g):
            for j in range(g):
                Rd[i, j] = R[dof[i], j]
        Nd = mm(R, mmt(Mbinv, Rd))
        for i in range(g):
            for r in range(n):
                col = Nd[r, i]
                D[r, g + i] -= col * x[2 * g + i]
                D[r, 2 * g + i] = -col * x[g + i]
                D[r, 3 * g + i] = col
    K = G.shape[1]
    if K:
        DG = mm(R, mm(Mbinv, mtm(R, G)))
        for r in range(n):
            for k in range(K):
                D[r, e0 + k] = DG[r, k]
    return R, dqd_dz, D, ok


@kernel
def A_of(D, dof, g):
    """A = ∂ẋ/∂x (L, L) of a filter state from its ∂q̈/∂x (n, L) (IndependentFilter.A)."""
    L = D.shape[1]
    A = np.zeros((L, L))
    for i in range(g):
        A[i, g + i] = 1.0
        for j in range(L):
            A[g + i, j] = D[dof[i], j]
    return A

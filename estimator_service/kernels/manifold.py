"""The manifold point in compiled code: constraint rows, the position problem, the R-matrix dynamics.

A filter state's (z, ż) and the DOF forces τ give the consistent point (q, q̇, q̈, z̈, R, Jm): the position problem
Φ(q) = 0 with q[dof] = z (second-order predictor from a reference point, chord steps with its Jm, Newton), then
q̇ = R ż, z̈ = (RᵀMR)⁻¹ Rᵀ(Q − M Jm γ), q̈ = R z̈ + Jm γ, with [Jm, R] = [Φ_q; S]⁻¹.  :func:`point` does it in one
call (~15 µs on the development machine against ~90–140 µs of numpy calls).

Arrays (SI units, the global frame of the mechanism): the quadratic constraint rows Φ_r = ½ qeᵀH_r qe + B_r·qe + c_r
over the extended coordinates qe (q, then the fixed points' coordinates qe0), their nonzeros as rows (``H``: (r, i, j,
value), ``B``: (r, j, value), ``Hq``: the Hessians over q); the relative-angle rows ``ang`` (row, θ, xa, ya, xb, yb)
with lengths ``angL`` (x- or y-form, whichever is better conditioned, as ``Model._angle_terms``); gravity forces
``Qg``; the joint dampers' bilinear rate forms ``DA``, ``Dc``; the constant mass matrix ``M``.  Residuals in m² for
distance rows, m for angle rows; z, q in rad or m.

numpy reference: ``Model.Phi``, ``Phi_q``, ``hess_contract``, ``gamma``, ``Q`` and ``solve_position``
(estimator_service/model.py) and ``ManifoldDynamics.point`` with its ``_refine`` and ``_light``
(estimator_service/backends/manifold.py).
"""

from __future__ import annotations

import math

import numpy as np

from estimator_service.model import CONTINUATION_STEP
from estimator_service.kernels.jit import inlined, kernel
from estimator_service.kernels.linalg import (SMALL_N, cols, dot, eliminate, eliminate_in_place, mm, mtv, mv,
                                              rtmr, same_head)


@kernel
def extend(qe0, q):
    """The extended coordinates qe (q, then the fixed points' coordinates from qe0)."""
    qe = np.empty(qe0.shape[0])
    n = q.shape[0]
    for i in range(qe0.shape[0]):
        qe[i] = q[i] if i < n else qe0[i]
    return qe


@kernel
def padded(v, ne):
    """A vector over q (n,) padded with zeros to the extended coordinates (ne,): q̇e, q̈e."""
    out = np.zeros(ne)
    for i in range(v.shape[0]):
        out[i] = v[i]
    return out


@kernel
def _phi_into(q, qe, phi, want_jac, J, qe0, H, B, c, ang, angL):
    """max |Φ(q)|, with qe (ne,) the extended coordinates, Φ (m,) in ``phi`` and, if ``want_jac``, Φ_q added to the
    first m rows of J (zero there on entry), written in place: :func:`eval_phi` without its allocations (the manifold
    point's chord steps evaluate Φ several times)."""
    n, m = q.shape[0], c.shape[0]
    for i in range(qe0.shape[0]):
        qe[i] = q[i] if i < n else qe0[i]
    for r in range(m):
        phi[r] = c[r]
    for e in range(B.shape[0]):
        r, j, v = int(B[e, 0]), int(B[e, 1]), B[e, 2]
        phi[r] += v * qe[j]
        if want_jac and j < n:
            J[r, j] += v
    for e in range(H.shape[0]):  # the quadratic rows' Hessians, nonzeros only
        r, i, j, v = int(H[e, 0]), int(H[e, 1]), int(H[e, 2]), H[e, 3]
        phi[r] += 0.5 * v * qe[i] * qe[j]
        if want_jac and i < n:
            J[r, i] += v * qe[j]
    for k in range(ang.shape[0]):
        row, th, xa, ya, xb, yb = ang[k, 0], ang[k, 1], ang[k, 2], ang[k, 3], ang[k, 4], ang[k, 5]
        L = angL[k]
        s, co = math.sin(q[th]), math.cos(q[th])
        if abs(s) >= abs(co):
            ia, ib, val, d1 = xa, xb, -L * co, L * s
        else:
            ia, ib, val, d1 = ya, yb, -L * s, -L * co
        phi[row] = qe[ib] - qe[ia] + val
        if want_jac:
            if ib < n:
                J[row, ib] += 1.0
            if ia < n:
                J[row, ia] -= 1.0
            J[row, th] = d1
    res = 0.0
    for r in range(m):
        res = max(res, abs(phi[r]))
    return res


@kernel
def eval_phi(q, qe0, H, B, c, ang, angL, want_jac):
    """(Φ (m,), Φ_q (m, n) or an empty array): Model.Phi / Model.Phi_q.  ``H``: the nonzeros of the
    quadratic rows' Hessians (over the extended coordinates) as rows (r, i, j, value); ``B``: the nonzeros
    of the linear terms (m, ne) as rows (r, j, value)."""
    m = c.shape[0]
    phi = np.empty(m)
    J = np.zeros((m, q.shape[0])) if want_jac else np.zeros((0, 0))
    _phi_into(q, np.empty(qe0.shape[0]), phi, want_jac, J, qe0, H, B, c, ang, angL)
    return phi, J


@kernel
def hess_contract(q, v, Hq, m, ang, angL):
    """(m, n) with [r, k] = Σ_l ∂²Φ_r/∂q_k∂q_l v_l: Model.hess_contract.  ``Hq``: the nonzeros of
    the quadratic rows' Hessians over q as rows (r, k, l, value)."""
    out = np.zeros((m, q.shape[0]))
    for e in range(Hq.shape[0]):
        out[int(Hq[e, 0]), int(Hq[e, 1])] += Hq[e, 3] * v[int(Hq[e, 2])]
    for k in range(ang.shape[0]):
        row, th = ang[k, 0], ang[k, 1]
        L = angL[k]
        s, co = math.sin(q[th]), math.cos(q[th])
        d2 = L * co if abs(s) >= abs(co) else L * s
        out[row, th] = d2 * v[th]
    return out


@kernel
def gamma(q, qd, Hq, m, ang, angL):
    """γ = −Φ̇_q q̇ (m,): Model.gamma, −q̇ᵀ∇²Φ_r q̇ summed over the Hessians' nonzeros (as
    :func:`hess_contract`, without its (m, n) matrix)."""
    out = np.zeros(m)
    for e in range(Hq.shape[0]):
        out[int(Hq[e, 0])] -= Hq[e, 3] * qd[int(Hq[e, 1])] * qd[int(Hq[e, 2])]
    for k in range(ang.shape[0]):
        row, th = ang[k, 0], ang[k, 1]
        L = angL[k]
        s, co = math.sin(q[th]), math.cos(q[th])
        d2 = L * co if abs(s) >= abs(co) else L * s
        out[row] -= d2 * qd[th] * qd[th]
    return out


@kernel
def _jm_gamma(q, v, Jm, Hq, ang, angL):
    """Jm γ(q, v) (n,): :func:`gamma` of the velocity v mapped by Jm (the second-order term of a position
    step, s = Jm γ of the dynamics)."""
    return mv(Jm, gamma(q, v, Hq, Jm.shape[1], ang, angL))


@kernel
def dof_inverse(q, qe0, H, B, c, ang, angL, dof):
    """([Φ_q; S]⁻¹ (n, n), ok) for a square system (m + g = n)."""
    n, m = q.shape[0], c.shape[0]
    K = np.zeros((n, n))
    _phi_into(q, np.empty(qe0.shape[0]), np.empty(m), True, K, qe0, H, B, c, ang, angL)  # Φ_q: K's first m rows
    for i in range(dof.shape[0]):
        K[m + i, dof[i]] = 1.0
    return eliminate_in_place(K)


@kernel
def forces(q, qd, tau, qe0, Qg, DA, Dc):
    """Generalized forces (n,): gravity + joint dampers + tau (Model.Q)."""
    n = q.shape[0]
    out = np.empty(n)
    for i in range(n):
        out[i] = Qg[i] + tau[i]
    if DA.shape[0]:
        qe = extend(qe0, q)
        qde = padded(qd, qe0.shape[0])
        for k in range(DA.shape[0]):
            A = DA[k]
            w = dot(qe, mv(A, qde))
            j = mtv(A, qe)
            for i in range(n):
                out[i] -= Dc[k] * j[i] * w
    return out


@kernel
def _dynamics(q, zd, tau, R, Jm, M, Hq, ang, angL, qe0, Qg, DA, Dc):
    """(q̇, q̈, z̈, R, Jm) at a consistent q with [Φ_q; S]⁻¹ = [Jm, R] there: the R-matrix dynamics of
    ManifoldDynamics._dynamics."""
    qd, s, Ms, Minv, ok = velocity_terms(q, zd, R, Jm, M, Hq, ang, angL)
    qdd, zdd = accelerations(q, qd, tau, R, s, Ms, Minv, qe0, Qg, DA, Dc)
    return qd, qdd, zdd, R, Jm, ok


@kernel
def velocity_terms(q, zd, R, Jm, M, Hq, ang, angL):
    """The part of :func:`_dynamics` that does not depend on τ: (q̇ = R ż, s = Jm γ, M s, M̄⁻¹, ok)."""
    Minv, ok = eliminate(rtmr(R, M))
    qd, s, Ms = rate_terms(q, zd, R, Jm, M, Hq, ang, angL)
    return qd, s, Ms, Minv, ok


@kernel
def rate_terms(q, zd, R, Jm, M, Hq, ang, angL):
    """The part of :func:`velocity_terms` that depends on ż: (q̇ = R ż, s = Jm γ, M s)."""
    qd = mv(R, zd)
    s = _jm_gamma(q, qd, Jm, Hq, ang, angL)
    return qd, s, mv(M, s)


@kernel
def accelerations(q, qd, tau, R, s, Ms, Minv, qe0, Qg, DA, Dc):
    """The rest of :func:`_dynamics`, with the forces τ: (q̈, z̈)."""
    Qt = forces(q, qd, tau, qe0, Qg, DA, Dc)
    for i in range(Qt.shape[0]):
        Qt[i] -= Ms[i]
    zdd = mv(Minv, mtv(R, Qt))
    qdd = mv(R, zdd)
    for i in range(qdd.shape[0]):
        qdd[i] += s[i]
    return qdd, zdd


@kernel
def residual(q, qe0, H, B, c, ang, angL):
    """(Φ(q), max |Φ|)."""
    phi = np.empty(c.shape[0])
    return phi, _phi_into(q, np.empty(qe0.shape[0]), phi, False, phi.reshape((1, -1)), qe0, H, B, c, ang, angL)


@kernel
def _failed(status, q, res):
    """:func:`point`'s result without a point (status 1 or 2)."""
    e1, e2 = np.zeros(0), np.zeros((0, 0))
    return status, q, e1, e1, e1, e2, e2, res


@inlined
def _solved(q, zd, tau, res, qe0, H, B, c, Hq, ang, angL, dof, M, Qg, DA, Dc):
    """:func:`point`'s result at a solved q: [Φ_q; S] inverted there, the R-matrix dynamics."""
    Jinv, ok = dof_inverse(q, qe0, H, B, c, ang, angL, dof)
    if not ok:
        return _failed(2, q, res)
    m = c.shape[0]
    return _solved_with(q, zd, tau, res, cols(Jinv, m, q.shape[0]), cols(Jinv, 0, m), Hq, ang, angL, M, qe0, Qg,
                        DA, Dc)


@inlined
def _solved_with(q, zd, tau, res, R, Jm, Hq, ang, angL, M, qe0, Qg, DA, Dc):
    """:func:`point`'s result at a solved q whose [Φ_q; S]⁻¹ = [Jm, R] is known (a reference point's own q)."""
    qd, qdd, zdd, R, Jm, ok = _dynamics(q, zd, tau, R, Jm, M, Hq, ang, angL, qe0, Qg, DA, Dc)
    return (0 if ok else 2), q, qd, qdd, zdd, R, Jm, res


#: a chord step of the manifold point (ManifoldDynamics.point) must shrink the residual at least by this
#: factor, else Newton takes over
CHORD_RATE = 0.25


#: a light point (:func:`point` with ``light``: the UKF's sigma points) refines R and s = Jm γ with its
#: reference's [Φ_q; S]⁻¹ until a correction is below REFINE_TOL (relative to the largest entry), in at
#: most REFINE_MAX corrections, each at most REFINE_RATE of the one before; else [Φ_q; S] is inverted
REFINE_TOL = 1e-12
REFINE_MAX = 12
REFINE_RATE = 0.5


@kernel
def _refine(J, Y, top, bottom, ref_R, ref_Jm, dof):
    """(Y, ok): the solution of [Φ_q; S] Y = [top; bottom] (J = Φ_q at the point) by iterative refinement
    from the guess Y with a nearby point's inverse [ref_Jm, ref_R]: Y −= ref_Jm (J Y − top) + ref_R (S Y − bottom)."""
    prev = np.inf
    n, k, m, g = Y.shape[0], Y.shape[1], top.shape[0], dof.shape[0]
    Y = Y.copy()
    r1, r2 = np.empty((m, k)), np.empty((g, k))
    for _ in range(REFINE_MAX):
        JY = mm(J, Y)
        for i in range(m):
            for j in range(k):
                r1[i, j] = JY[i, j] - top[i, j]
        for i in range(g):
            for j in range(k):
                r2[i, j] = Y[dof[i], j] - bottom[i, j]
        d1, d2 = mm(ref_Jm, r1), mm(ref_R, r2)
        dmax, ymax = 0.0, 0.0
        for i in range(n):
            for j in range(k):
                d = d1[i, j] + d2[i, j]
                Y[i, j] -= d
                dmax, ymax = max(dmax, abs(d)), max(ymax, abs(Y[i, j]))
        if dmax <= REFINE_TOL * ymax:
            return Y, True
        if not dmax <= REFINE_RATE * prev:
            break
        prev = dmax
    return Y, False


@inlined
def _solved_light(q, zd, tau, res, ref_R, ref_Jm, qe0, H, B, c, Hq, ang, angL, dof, M, Qg, DA, Dc):
    """:func:`point`'s light result at a solved q near the reference (R and s refined with its inverse,
    :func:`_refine`; the reference's Jm returned in place of the point's), or the full one when refining
    does not converge."""
    n, m, g = q.shape[0], c.shape[0], dof.shape[0]
    _, J = eval_phi(q, qe0, H, B, c, ang, angL, True)
    R, ok = _refine(J, ref_R, np.zeros((m, g)), np.eye(g), ref_R, ref_Jm, dof)
    if ok:
        qd = mv(R, zd)
        gam = gamma(q, qd, Hq, m, ang, angL)
        s2, ok = _refine(J, mv(ref_Jm, gam).reshape((n, 1)), gam.reshape((m, 1)), np.zeros((g, 1)), ref_R, ref_Jm,
                         dof)
        if ok:
            s = cols(s2, 0, 1).reshape(n)
            Minv, ok = eliminate(rtmr(R, M))
            qdd, zdd = accelerations(q, qd, tau, R, s, mv(M, s), Minv, qe0, Qg, DA, Dc)
            return (0 if ok else 2), q, qd, qdd, zdd, R, ref_Jm, res
    return _solved(q, zd, tau, res, qe0, H, B, c, Hq, ang, angL, dof, M, Qg, DA, Dc)


#: how :func:`position` ended: solved at the reference's own q (its [Φ_q; S]⁻¹ holds), solved by chord steps with
#: the reference's Jm, solved by Newton; or a singular constraint Jacobian, or no convergence
_AT_REFERENCE, _BY_CHORD, _BY_NEWTON, _SINGULAR, _NOT_CONVERGED = 0, 1, 2, 3, 4


@kernel
def _span(z, ref_z):
    """max |z − ref_z| (rad or m)."""
    out = 0.0
    for i in range(z.shape[0]):
        out = max(out, abs(z[i] - ref_z[i]))
    return out


@kernel
def _newton_position(q, tol, quad_res, max_newton, qe0, H, B, c, ang, angL, dof):
    """(how, q, residual): Newton on Φ(q) = 0 with q[dof] held, q updated in place (:func:`position`'s last stage)."""
    n, m = q.shape[0], c.shape[0]
    qe, phi = np.empty(qe0.shape[0]), np.empty(m)
    no_jac = phi.reshape((1, m))
    for _ in range(max_newton):
        res = _phi_into(q, qe, phi, False, no_jac, qe0, H, B, c, ang, angL)
        if not res < np.inf:
            break
        if res <= tol:
            return _BY_NEWTON, q, res
        Jinv, ok = dof_inverse(q, qe0, H, B, c, ang, angL, dof)
        if not ok:
            return _SINGULAR, q, res
        for i in range(n):
            acc = 0.0
            for r in range(m):
                acc += Jinv[i, r] * phi[r]
            q[i] -= acc
        if res <= quad_res:  # quadratic convergence: the next residual is ~C res² ≪ tol
            return _BY_NEWTON, q, res
    return _NOT_CONVERGED, q, np.inf


@inlined
def _continued(z, ref_z, ref_q, tol, quad_res, max_newton, qe0, H, B, c, ang, angL, dof):
    """:func:`position` over a change of z larger than CONTINUATION_STEP: Newton from the reference's q in steps of
    at most that size, each from the step before, so the solution stays on the reference's assembly branch (as
    Model.solve_position)."""
    steps = int(math.ceil(_span(z, ref_z) / CONTINUATION_STEP))
    q = ref_q.copy()
    how, res = _NOT_CONVERGED, np.inf
    for k in range(1, steps + 1):
        for i in range(dof.shape[0]):
            q[dof[i]] = ref_z[i] + (z[i] - ref_z[i]) * k / steps
        how, q, res = _newton_position(q, tol, quad_res, max_newton, qe0, H, B, c, ang, angL, dof)
        if how != _BY_NEWTON:
            return how, q, res
    return how, q, res


@inlined
def position(z, has_ref, ref_z, ref_q, ref_R, ref_Jm, q_guess, tol, quad_res, max_newton, qe0, H, B, c, Hq, ang,
              angL, dof):
    """(how (_AT_REFERENCE … _NOT_CONVERGED), q, max |Φ(q)|): the position problem of :func:`point` with q[dof] = z.
    From a reference at the same z the predictor is the reference's q itself; from another, second order (q_ref +
    R Δz + ½ Jm γ(q_ref, R Δz)); then chord steps with the reference's Jm while each shrinks the residual by
    CHORD_RATE, then Newton.  The residual returned is the one checked last (before a final quadratic step)."""
    n, m = (ref_q.shape[0] if has_ref else q_guess.shape[0]), c.shape[0]
    q = np.empty(n)
    if has_ref and _span(z, ref_z) > CONTINUATION_STEP:  # one step so far may land on another assembly branch
        return _continued(z, ref_z, ref_q, tol, quad_res, max_newton, qe0, H, B, c, ang, angL, dof)
    if has_ref and same_head(z, ref_z, z.shape[0]):  # the predictor's v = 0: ref_q itself
        for i in range(n):
            q[i] = ref_q[i]
    elif has_ref:
        v = np.zeros(n)
        for i in range(n):
            for j in range(z.shape[0]):
                v[i] += ref_R[i, j] * (z[j] - ref_z[j])
        w = _jm_gamma(ref_q, v, ref_Jm, Hq, ang, angL)
        for i in range(n):
            q[i] = ref_q[i] + v[i] + 0.5 * w[i]
    else:
        for i in range(n):
            q[i] = q_guess[i]
    for i in range(dof.shape[0]):
        q[dof[i]] = z[i]
    qe, phi = np.empty(qe0.shape[0]), np.empty(m)  # (Φ and the extended coordinates of each evaluation)
    no_jac = phi.reshape((1, m))
    if has_ref:  # chord steps with the reference's Jm; [Φ_q; S] inverted once, at the solution
        prev = np.inf
        for _ in range(max_newton):
            res = _phi_into(q, qe, phi, False, no_jac, qe0, H, B, c, ang, angL)
            if res <= tol:
                return (_AT_REFERENCE if same_head(q, ref_q, q.shape[0]) else _BY_CHORD), q, res
            if not res < CHORD_RATE * prev:  # too slow (or NaN): Newton from here
                break
            prev = res
            for i in range(n):  # q −= Jm_ref Φ
                acc = 0.0
                for r in range(m):
                    acc += ref_Jm[i, r] * phi[r]
                q[i] -= acc
    return _newton_position(q, tol, quad_res, max_newton, qe0, H, B, c, ang, angL, dof)


@inlined
def _point_at(how, q, res, zd, tau, ref_R, ref_Jm, qe0, H, B, c, Hq, ang, angL, dof, M, Qg, DA, Dc):
    """:func:`point`'s result from its position (:func:`position`'s ``how``, q, residual): at the reference's own q
    with its inverse, else with [Φ_q; S] inverted at q; _failed's when the position was not found."""
    if how == _AT_REFERENCE:
        return _solved_with(q, zd, tau, res, ref_R, ref_Jm, Hq, ang, angL, M, qe0, Qg, DA, Dc)
    if how == _SINGULAR:
        return _failed(2, q, res)
    if how == _NOT_CONVERGED:
        return _failed(1, q, res)
    return _solved(q, zd, tau, res, qe0, H, B, c, Hq, ang, angL, dof, M, Qg, DA, Dc)


@kernel
def point(z, zd, tau, has_ref, ref_z, ref_q, ref_R, ref_Jm, q_guess, tol, quad_res, max_newton, light,
           qe0, H, B, c, Hq, ang, angL, dof, M, Qg, DA, Dc):
    """ManifoldDynamics.point in one call (:func:`position`, then :func:`_point_at`); status 0 = converged, 1 = no
    convergence (the caller falls back to the model's continuation solver), 2 = singular constraint Jacobian or mass
    matrix.  From a reference at the same z whose q is consistent, the reference's [Φ_q; S]⁻¹ = [Jm, R] is the one at
    q, and no inversion is needed (the UKF's sigma points that differ from the mean only in ż, the force or the
    parameters: exact).  ``light`` (the UKF's sigma points, which need no Jm of their own): a position solved by the
    chord steps gets R and s refined with the reference's inverse instead of inverting (:func:`_solved_light`) when
    n > SMALL_N (a smaller matrix is inverted faster by :func:`inverse`'s own elimination); the result holds the
    reference's Jm.  The smoothers' points are never light: :func:`point_full` (which does not compile
    :func:`_solved_light`)."""
    how, q, res = position(z, has_ref, ref_z, ref_q, ref_R, ref_Jm, q_guess, tol, quad_res, max_newton, qe0, H, B,
                            c, Hq, ang, angL, dof)
    if how == _BY_CHORD and light and q.shape[0] > SMALL_N:  # (a small matrix is inverted faster than refined)
        return _solved_light(q, zd, tau, res, ref_R, ref_Jm, qe0, H, B, c, Hq, ang, angL, dof, M, Qg, DA, Dc)
    return _point_at(how, q, res, zd, tau, ref_R, ref_Jm, qe0, H, B, c, Hq, ang, angL, dof, M, Qg, DA, Dc)


@kernel
def point_full(z, zd, tau, has_ref, ref_z, ref_q, ref_R, ref_Jm, q_guess, tol, quad_res, max_newton,
                qe0, H, B, c, Hq, ang, angL, dof, M, Qg, DA, Dc):
    """:func:`point`, never light (the independent smoother's)."""
    how, q, res = position(z, has_ref, ref_z, ref_q, ref_R, ref_Jm, q_guess, tol, quad_res, max_newton, qe0, H, B,
                            c, Hq, ang, angL, dof)
    return _point_at(how, q, res, zd, tau, ref_R, ref_Jm, qe0, H, B, c, Hq, ang, angL, dof, M, Qg, DA, Dc)

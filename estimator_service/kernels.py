"""Compiled kernels of the estimators' hot path (numba), over the model's own arrays.

The EKF, UKF and error-state EKF spend most of a step finding the point of the constraint manifold
at a state (z, ż): the position problem Φ(q) = 0 with q[dof] = z (Newton from a second-order
predictor), then the R-matrix dynamics q̇ = R ż, z̈ = (RᵀMR)⁻¹ Rᵀ(Q − M Jm γ), q̈ = R z̈ + Jm γ.
In numpy that is some fifty small calls (~90–140 µs on the development machine); :func:`_point`
does it in one call (~15 µs).  The smoother's per-step dynamics factor (forward dynamics with its
Jacobians, integrator and constraint rows) and the filters' state Jacobians are compiled likewise.
docs/performance.md lists the kernels and the figures.

The numpy code in estimator_service/model.py and the backends stays the reference path:
``RIGSTATE_KERNELS=numpy`` (or numba missing) keeps it, and tests/test_kernels.py checks every kernel
against it on every shipped mechanism.

Arrays (SI units): the quadratic constraint rows Φ_r = ½ qeᵀH_r qe + B_r·qe + c_r over the extended
coordinates qe (q, then the fixed points' coordinates), the relative-angle rows (x- or y-form,
whichever is better conditioned, as ``Model._angle_terms``), gravity forces, joint dampers (bilinear
rate forms) and the constant mass matrix.

Compilation: ``@njit(cache=True)``; the first use compiles (~40 s on an idle 2-core machine) and
writes numba's cache beside this module or under ``$NUMBA_CACHE_DIR`` (the systemd unit sets a
``CacheDirectory``); later processes load it (~0.5 s).  :func:`compile_model` compiles what a backend uses (the
filters' or the smoother's kernels) at its construction, never inside a step.  On a cold cache and a machine with
more than one CPU, the independent smoother's and the filters' kernels compile in two processes
(:func:`warm_in_helper`; on the 2-core development machine ~30 % less wall time: the manifold point, which most
kernels contain, is compiled by one of them).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import subprocess
import sys
from types import SimpleNamespace
from typing import NamedTuple

import numpy as np

from estimator_service.angles import wrap_angle
from estimator_service.model import CONTINUATION_STEP

log = logging.getLogger(__name__)

#: environment switch: ``numpy`` keeps the reference implementation
ENV_SWITCH = "RIGSTATE_KERNELS"

#: how long a process may take to its first output on a cold compile cache (s): compiling every kernel
#: takes ~77 s on an idle 2-core machine and much longer on a loaded one (the systemd unit's
#: TimeoutStartSec matches)
COLD_START_TIMEOUT_S = 300.0

try:
    from numba import njit, types
    from numba.extending import intrinsic, register_jitable
except ImportError:  # pragma: no cover - numba is a dependency; the reference path still works without it
    njit = None
else:
    register_jitable(wrap_angle)  # (the compiled code's angle wrap is the project's one rule)


def enabled() -> bool:
    """True when numba is importable and ``RIGSTATE_KERNELS`` is not ``numpy``."""
    return njit is not None and os.environ.get(ENV_SWITCH, "numba").strip().lower() != "numpy"


@contextlib.contextmanager
def reference_path():
    """Within this block, models compiled by :func:`compile_model` keep the numpy reference
    (``rigstate bench --reference`` runs both paths side by side in one process)."""
    old = os.environ.get(ENV_SWITCH)
    os.environ[ENV_SWITCH] = "numpy"
    try:
        yield
    finally:
        if old is None:
            del os.environ[ENV_SWITCH]
        else:
            os.environ[ENV_SWITCH] = old


def _jit(fn):
    return njit(cache=True)(fn) if njit is not None else fn


if njit is not None:

    @intrinsic
    def _rt(typingctx, v):
        """v as a run-time value in compiled code.  numba types a constant argument (``True``, ``0``) as a literal
        and compiles the callee again for each one: the manifold point was compiled five times (~600 KB each in
        numba's cache), the integrator's stages three times, their transitions four.  A flag passed through ``_rt``
        shares the callee's one specialization with every other caller, Python's included."""
        def codegen(context, builder, signature, args):
            return context.cast(builder, args[0], signature.args[0], signature.return_type)

        return types.unliteral(v)(v), codegen
else:  # pragma: no cover - without numba there is nothing to specialise

    def _rt(v):
        return v


@_jit
def _extend(qe0, q):
    """The extended coordinates qe (q, then the fixed points' coordinates from qe0)."""
    qe = np.empty(qe0.shape[0])
    n = q.shape[0]
    for i in range(qe0.shape[0]):
        qe[i] = q[i] if i < n else qe0[i]
    return qe


@_jit
def _padded(v, ne):
    """A vector over q (n,) padded with zeros to the extended coordinates (ne,): q̇e, q̈e."""
    out = np.zeros(ne)
    for i in range(v.shape[0]):
        out[i] = v[i]
    return out


# The filters' and the smoother's kernels are written as loops over arrays: no slice assignments, array
# expressions, ``@`` or LAPACK calls on their path.  numba expands each of those into generic code (layouts,
# broadcasting, overlap checks, error paths: 2-10 KB of machine code each, at every use) and LLVM compiles all
# of it: as loops, the fused EKF update's first kernel is 275 KB instead of 414 KB of machine code, the
# manifold point 95 KB instead of 153 KB, and the kernels compile in three quarters of the time
# (docs/performance.md, "fourteenth stop").  Loops cost ~1 ns a multiply-add; the mechanisms' matrices are
# small and sparse (a zero multiplier is skipped).  A product of more than ``SMALL_MV`` multiply-adds (a
# mechanism of 20 coordinates and more) goes to BLAS, out of line (:func:`_blas_mm`): one copy of its code.

#: products of more multiply-adds than this are BLAS calls (:func:`_blas_mm`, :func:`_blas_mv`), smaller ones loops
SMALL_MV = 400


@_jit
def _blas_mm(A, B):
    """A B by BLAS (any layouts: copied to C order first)."""
    return np.ascontiguousarray(A) @ np.ascontiguousarray(B)


@_jit
def _blas_mv(A, x):
    """A x by BLAS (any layout: copied to C order first)."""
    return np.ascontiguousarray(A) @ np.ascontiguousarray(x)


@_jit
def _mv(A, x):
    """A x (A (r, k), any layout).  Column by column: each entry is summed in the order of a row's dot product,
    but the r sums advance side by side instead of as one chain of dependent additions."""
    r, k = A.shape
    if r * k > SMALL_MV:
        return _blas_mv(A, x)
    out = np.zeros(r)
    for j in range(k):
        xj = x[j]
        for i in range(r):
            out[i] += A[i, j] * xj
    return out


@_jit
def _mtv(A, x):
    """Aᵀ x (A (r, k), any layout) without forming Aᵀ."""
    r, k = A.shape
    if r * k > SMALL_MV:
        return _blas_mv(A.T, x)
    out = np.zeros(k)
    for i in range(r):
        xi = x[i]
        for j in range(k):
            out[j] += A[i, j] * xi
    return out


@_jit
def _dot(a, b):
    """aᵀ b of two vectors."""
    acc = 0.0
    for i in range(a.shape[0]):
        acc += a[i] * b[i]
    return acc


@_jit
def _mm(A, B):
    """A B (A (r, k), B (k, c), any layout); a zero entry of A is skipped (the mechanisms' sparse matrices)."""
    r, k = A.shape
    c = B.shape[1]
    if r * k * c > SMALL_MV:
        return _blas_mm(A, B)
    out = np.zeros((r, c))
    for l in range(k):  # (as :func:`_mv`: the r × c sums side by side)
        for i in range(r):
            a = A[i, l]
            if a != 0.0:
                for j in range(c):
                    out[i, j] += a * B[l, j]
    return out


@_jit
def _mmt(A, B):
    """A Bᵀ (A (r, k), B (c, k)) without forming Bᵀ (:func:`_mm` on the transposed view)."""
    return _mm(A, B.T)


@_jit
def _mtm(A, B):
    """Aᵀ B (A (k, r), B (k, c)) without forming Aᵀ (:func:`_mm` on the transposed view)."""
    return _mm(A.T, B)


@_jit
def _rtmr(R, M):
    """Rᵀ M R (g, g) of R (n, g)."""
    n, g = R.shape
    if n * n > SMALL_MV:
        return _blas_mm(R.T, _blas_mm(M, R))
    MR = _mm(M, R)
    out = np.zeros((g, g))
    for i in range(n):
        for b in range(g):
            acc = MR[i, b]
            if acc != 0.0:
                for a in range(g):
                    out[a, b] += R[i, a] * acc
    return out


@_jit
def _cols(A, a, b):
    """A copy of the columns a … b − 1 of A (r, k): (r, b − a), C-contiguous."""
    r = A.shape[0]
    out = np.empty((r, b - a))
    for i in range(r):
        for j in range(a, b):
            out[i, j - a] = A[i, j]
    return out


@_jit
def _part(x, a, b):
    """A copy of the entries a … b − 1 of the vector x (C-contiguous)."""
    out = np.empty(b - a)
    for i in range(a, b):
        out[i - a] = x[i]
    return out


@_jit
def _sym(P):
    """(P + Pᵀ)/2."""
    L = P.shape[0]
    out = np.empty((L, L))
    for i in range(L):
        for j in range(L):
            out[i, j] = 0.5 * (P[i, j] + P[j, i])
    return out


@_jit
def _axpy(x, a, y):
    """x + a y of two vectors (a new one)."""
    out = np.empty(x.shape[0])
    for i in range(x.shape[0]):
        out[i] = x[i] + a * y[i]
    return out


@_jit
def _maxpy(X, a, Y):
    """X + a Y of two matrices (a new one)."""
    r, c = X.shape
    out = np.empty((r, c))
    for i in range(r):
        for j in range(c):
            out[i, j] = X[i, j] + a * Y[i, j]
    return out


@_jit
def _eye_plus(a, A):
    """I + a A of a square matrix."""
    L = A.shape[0]
    out = np.empty((L, L))
    for i in range(L):
        for j in range(L):
            out[i, j] = a * A[i, j]
        out[i, i] += 1.0
    return out


@_jit
def _phi_into(q, qe, phi, want_jac, J, qe0, H, B, c, ang, angL):
    """max |Φ(q)|, with qe (ne,) the extended coordinates, Φ (m,) in ``phi`` and, if ``want_jac``, Φ_q added to the
    first m rows of J (zero there on entry), written in place: :func:`_phi` without its allocations (the manifold
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


@_jit
def _phi(q, qe0, H, B, c, ang, angL, want_jac):
    """(Φ (m,), Φ_q (m, n) or an empty array): Model.Phi / Model.Phi_q.  ``H``: the nonzeros of the
    quadratic rows' Hessians (over the extended coordinates) as rows (r, i, j, value); ``B``: the nonzeros
    of the linear terms (m, ne) as rows (r, j, value)."""
    m = c.shape[0]
    phi = np.empty(m)
    J = np.zeros((m, q.shape[0])) if want_jac else np.zeros((0, 0))
    _phi_into(q, np.empty(qe0.shape[0]), phi, want_jac, J, qe0, H, B, c, ang, angL)
    return phi, J


@_jit
def _hess_contract(q, v, Hq, m, ang, angL):
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


@_jit
def _gamma(q, qd, Hq, m, ang, angL):
    """γ = −Φ̇_q q̇ (m,): Model.gamma, −q̇ᵀ∇²Φ_r q̇ summed over the Hessians' nonzeros (as
    :func:`_hess_contract`, without its (m, n) matrix)."""
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


@_jit
def _jm_gamma(q, v, Jm, Hq, ang, angL):
    """Jm γ(q, v) (n,): :func:`_gamma` of the velocity v mapped by Jm (the second-order term of a position
    step, s = Jm γ of the dynamics)."""
    return _mv(Jm, _gamma(q, v, Hq, Jm.shape[1], ang, angL))


#: matrices up to this size are inverted in place by :func:`_inverse`'s own elimination
SMALL_N = 16


@_jit
def _inverse(A):
    """(A⁻¹, ok): :func:`_eliminate` up to ``SMALL_N`` rows (no call overhead), LAPACK's LU beyond (O(n³)
    in blocked code: 20 times faster at n = 81 for a dense matrix)."""
    n = A.shape[0]
    if n > SMALL_N:
        try:
            X = np.ascontiguousarray(np.linalg.inv(A))
        except Exception:  # singular
            return np.eye(n), False
        return X, bool(np.all(np.isfinite(X)))
    return _eliminate(A)


@_jit
def _eliminate(A):
    """(A⁻¹, ok): Gauss-Jordan elimination with partial pivoting, skipping zero multipliers: for a sparse
    A (the constraint Jacobian [Φ_q; S], a few nonzeros per row) it does a few row operations per column,
    and beats LAPACK's dense LU at any size (ladder-21, n = 41: ~8 µs against ~30)."""
    return _eliminate_in_place(A.copy())


@_jit
def _eliminate_in_place(W):
    """:func:`_eliminate` of W, overwritten."""
    n = W.shape[0]
    X = np.eye(n)
    for col in range(n):
        p = col
        best = abs(W[col, col])
        for r in range(col + 1, n):
            if abs(W[r, col]) > best:
                best, p = abs(W[r, col]), r
        if best == 0.0 or not best < np.inf:
            return X, False
        if p != col:
            for j in range(n):
                W[col, j], W[p, j] = W[p, j], W[col, j]
                X[col, j], X[p, j] = X[p, j], X[col, j]
        inv = 1.0 / W[col, col]
        for j in range(n):
            W[col, j] *= inv
            X[col, j] *= inv
        for r in range(n):  # (W's row col is zero left of col and 1 at col)
            if r != col:
                f = W[r, col]
                if f != 0.0:
                    W[r, col] = 0.0
                    for j in range(col + 1, n):
                        W[r, j] -= f * W[col, j]
                    for j in range(n):
                        X[r, j] -= f * X[col, j]
    return X, True


@_jit
def _dof_inverse(q, qe0, H, B, c, ang, angL, dof):
    """([Φ_q; S]⁻¹ (n, n), ok) for a square system (m + g = n)."""
    n, m = q.shape[0], c.shape[0]
    K = np.zeros((n, n))
    _phi_into(q, np.empty(qe0.shape[0]), np.empty(m), True, K, qe0, H, B, c, ang, angL)  # Φ_q: K's first m rows
    for i in range(dof.shape[0]):
        K[m + i, dof[i]] = 1.0
    return _eliminate_in_place(K)


@_jit
def _forces(q, qd, tau, qe0, Qg, DA, Dc):
    """Generalized forces (n,): gravity + joint dampers + tau (Model.Q)."""
    n = q.shape[0]
    out = np.empty(n)
    for i in range(n):
        out[i] = Qg[i] + tau[i]
    if DA.shape[0]:
        qe = _extend(qe0, q)
        qde = _padded(qd, qe0.shape[0])
        for k in range(DA.shape[0]):
            A = DA[k]
            w = _dot(qe, _mv(A, qde))
            j = _mtv(A, qe)
            for i in range(n):
                out[i] -= Dc[k] * j[i] * w
    return out


@_jit
def _dynamics(q, zd, tau, R, Jm, M, Hq, ang, angL, qe0, Qg, DA, Dc):
    """(q̇, q̈, z̈, R, Jm) at a consistent q with [Φ_q; S]⁻¹ = [Jm, R] there: the R-matrix dynamics of
    ManifoldDynamics._dynamics."""
    qd, s, Ms, Minv, ok = _velocity_terms(q, zd, R, Jm, M, Hq, ang, angL)
    qdd, zdd = _accelerations(q, qd, tau, R, s, Ms, Minv, qe0, Qg, DA, Dc)
    return qd, qdd, zdd, R, Jm, ok


@_jit
def _velocity_terms(q, zd, R, Jm, M, Hq, ang, angL):
    """The part of :func:`_dynamics` that does not depend on τ: (q̇ = R ż, s = Jm γ, M s, M̄⁻¹, ok)."""
    Minv, ok = _eliminate(_rtmr(R, M))
    qd, s, Ms = _rate_terms(q, zd, R, Jm, M, Hq, ang, angL)
    return qd, s, Ms, Minv, ok


@_jit
def _rate_terms(q, zd, R, Jm, M, Hq, ang, angL):
    """The part of :func:`_velocity_terms` that depends on ż: (q̇ = R ż, s = Jm γ, M s)."""
    qd = _mv(R, zd)
    s = _jm_gamma(q, qd, Jm, Hq, ang, angL)
    return qd, s, _mv(M, s)


@_jit
def _accelerations(q, qd, tau, R, s, Ms, Minv, qe0, Qg, DA, Dc):
    """The rest of :func:`_dynamics`, with the forces τ: (q̈, z̈)."""
    Qt = _forces(q, qd, tau, qe0, Qg, DA, Dc)
    for i in range(Qt.shape[0]):
        Qt[i] -= Ms[i]
    zdd = _mv(Minv, _mtv(R, Qt))
    qdd = _mv(R, zdd)
    for i in range(qdd.shape[0]):
        qdd[i] += s[i]
    return qdd, zdd


@_jit
def _residual(q, qe0, H, B, c, ang, angL):
    """(Φ(q), max |Φ|)."""
    phi = np.empty(c.shape[0])
    return phi, _phi_into(q, np.empty(qe0.shape[0]), phi, False, phi.reshape((1, -1)), qe0, H, B, c, ang, angL)


@_jit
def _failed(status, q, res):
    """:func:`_point`'s result without a point (status 1 or 2)."""
    e1, e2 = np.zeros(0), np.zeros((0, 0))
    return status, q, e1, e1, e1, e2, e2, res


@_jit
def _solved(q, zd, tau, res, qe0, H, B, c, Hq, ang, angL, dof, M, Qg, DA, Dc):
    """:func:`_point`'s result at a solved q: [Φ_q; S] inverted there, the R-matrix dynamics."""
    Jinv, ok = _dof_inverse(q, qe0, H, B, c, ang, angL, dof)
    if not ok:
        return _failed(2, q, res)
    m = c.shape[0]
    return _solved_with(q, zd, tau, res, _cols(Jinv, m, q.shape[0]), _cols(Jinv, 0, m), Hq, ang, angL, M, qe0, Qg,
                        DA, Dc)


@_jit
def _solved_with(q, zd, tau, res, R, Jm, Hq, ang, angL, M, qe0, Qg, DA, Dc):
    """:func:`_point`'s result at a solved q whose [Φ_q; S]⁻¹ = [Jm, R] is known (a reference point's own q)."""
    qd, qdd, zdd, R, Jm, ok = _dynamics(q, zd, tau, R, Jm, M, Hq, ang, angL, qe0, Qg, DA, Dc)
    return (0 if ok else 2), q, qd, qdd, zdd, R, Jm, res


@_jit
def _same_head(x, x0, nd):
    """x[:nd] == x0[:nd] (bitwise; e.g. a sigma point that differs from the mean only in the sensor parameters)."""
    for i in range(nd):
        if x[i] != x0[i]:
            return False
    return True


#: a chord step of the manifold point (ManifoldDynamics.point) must shrink the residual at least by this
#: factor, else Newton takes over
CHORD_RATE = 0.25


#: a light point (:func:`_point` with ``light``: the UKF's sigma points) refines R and s = Jm γ with its
#: reference's [Φ_q; S]⁻¹ until a correction is below REFINE_TOL (relative to the largest entry), in at
#: most REFINE_MAX corrections, each at most REFINE_RATE of the one before; else [Φ_q; S] is inverted
REFINE_TOL = 1e-12
REFINE_MAX = 12
REFINE_RATE = 0.5


@_jit
def _refine(J, Y, top, bottom, ref_R, ref_Jm, dof):
    """(Y, ok): the solution of [Φ_q; S] Y = [top; bottom] (J = Φ_q at the point) by iterative refinement
    from the guess Y with a nearby point's inverse [ref_Jm, ref_R]: Y −= ref_Jm (J Y − top) + ref_R (S Y − bottom)."""
    prev = np.inf
    n, k, m, g = Y.shape[0], Y.shape[1], top.shape[0], dof.shape[0]
    Y = Y.copy()
    r1, r2 = np.empty((m, k)), np.empty((g, k))
    for _ in range(REFINE_MAX):
        JY = _mm(J, Y)
        for i in range(m):
            for j in range(k):
                r1[i, j] = JY[i, j] - top[i, j]
        for i in range(g):
            for j in range(k):
                r2[i, j] = Y[dof[i], j] - bottom[i, j]
        d1, d2 = _mm(ref_Jm, r1), _mm(ref_R, r2)
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


@_jit
def _solved_light(q, zd, tau, res, ref_R, ref_Jm, qe0, H, B, c, Hq, ang, angL, dof, M, Qg, DA, Dc):
    """:func:`_point`'s light result at a solved q near the reference (R and s refined with its inverse,
    :func:`_refine`; the reference's Jm returned in place of the point's), or the full one when refining
    does not converge."""
    n, m, g = q.shape[0], c.shape[0], dof.shape[0]
    _, J = _phi(q, qe0, H, B, c, ang, angL, True)
    R, ok = _refine(J, ref_R, np.zeros((m, g)), np.eye(g), ref_R, ref_Jm, dof)
    if ok:
        qd = _mv(R, zd)
        gam = _gamma(q, qd, Hq, m, ang, angL)
        s2, ok = _refine(J, _mv(ref_Jm, gam).reshape((n, 1)), gam.reshape((m, 1)), np.zeros((g, 1)), ref_R, ref_Jm,
                         dof)
        if ok:
            s = _cols(s2, 0, 1).reshape(n)
            Minv, ok = _eliminate(_rtmr(R, M))
            qdd, zdd = _accelerations(q, qd, tau, R, s, _mv(M, s), Minv, qe0, Qg, DA, Dc)
            return (0 if ok else 2), q, qd, qdd, zdd, R, ref_Jm, res
    return _solved(q, zd, tau, res, qe0, H, B, c, Hq, ang, angL, dof, M, Qg, DA, Dc)


#: how :func:`_position` ended: solved at the reference's own q (its [Φ_q; S]⁻¹ holds), solved by chord steps with
#: the reference's Jm, solved by Newton; or a singular constraint Jacobian, or no convergence
_AT_REFERENCE, _BY_CHORD, _BY_NEWTON, _SINGULAR, _NOT_CONVERGED = 0, 1, 2, 3, 4


@_jit
def _span(z, ref_z):
    """max |z − ref_z| (rad or m)."""
    out = 0.0
    for i in range(z.shape[0]):
        out = max(out, abs(z[i] - ref_z[i]))
    return out


@_jit
def _newton_position(q, tol, quad_res, max_newton, qe0, H, B, c, ang, angL, dof):
    """(how, q, residual): Newton on Φ(q) = 0 with q[dof] held, q updated in place (:func:`_position`'s last stage)."""
    n, m = q.shape[0], c.shape[0]
    qe, phi = np.empty(qe0.shape[0]), np.empty(m)
    no_jac = phi.reshape((1, m))
    for _ in range(max_newton):
        res = _phi_into(q, qe, phi, False, no_jac, qe0, H, B, c, ang, angL)
        if not res < np.inf:
            break
        if res <= tol:
            return _BY_NEWTON, q, res
        Jinv, ok = _dof_inverse(q, qe0, H, B, c, ang, angL, dof)
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


@_jit
def _continued(z, ref_z, ref_q, tol, quad_res, max_newton, qe0, H, B, c, ang, angL, dof):
    """:func:`_position` over a change of z larger than CONTINUATION_STEP: Newton from the reference's q in steps of
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


@_jit
def _position(z, has_ref, ref_z, ref_q, ref_R, ref_Jm, q_guess, tol, quad_res, max_newton, qe0, H, B, c, Hq, ang,
              angL, dof):
    """(how (_AT_REFERENCE … _NOT_CONVERGED), q, max |Φ(q)|): the position problem of :func:`_point` with q[dof] = z.
    From a reference at the same z the predictor is the reference's q itself; from another, second order (q_ref +
    R Δz + ½ Jm γ(q_ref, R Δz)); then chord steps with the reference's Jm while each shrinks the residual by
    CHORD_RATE, then Newton.  The residual returned is the one checked last (before a final quadratic step)."""
    n, m = (ref_q.shape[0] if has_ref else q_guess.shape[0]), c.shape[0]
    q = np.empty(n)
    if has_ref and _span(z, ref_z) > CONTINUATION_STEP:  # one step so far may land on another assembly branch
        return _continued(z, ref_z, ref_q, tol, quad_res, max_newton, qe0, H, B, c, ang, angL, dof)
    if has_ref and _same_head(z, ref_z, z.shape[0]):  # the predictor's v = 0: ref_q itself
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
                return (_AT_REFERENCE if _same_head(q, ref_q, q.shape[0]) else _BY_CHORD), q, res
            if not res < CHORD_RATE * prev:  # too slow (or NaN): Newton from here
                break
            prev = res
            for i in range(n):  # q −= Jm_ref Φ
                acc = 0.0
                for r in range(m):
                    acc += ref_Jm[i, r] * phi[r]
                q[i] -= acc
    return _newton_position(q, tol, quad_res, max_newton, qe0, H, B, c, ang, angL, dof)


@_jit
def _point_at(how, q, res, zd, tau, ref_R, ref_Jm, qe0, H, B, c, Hq, ang, angL, dof, M, Qg, DA, Dc):
    """:func:`_point`'s result from its position (:func:`_position`'s ``how``, q, residual): at the reference's own q
    with its inverse, else with [Φ_q; S] inverted at q; _failed's when the position was not found."""
    if how == _AT_REFERENCE:
        return _solved_with(q, zd, tau, res, ref_R, ref_Jm, Hq, ang, angL, M, qe0, Qg, DA, Dc)
    if how == _SINGULAR:
        return _failed(2, q, res)
    if how == _NOT_CONVERGED:
        return _failed(1, q, res)
    return _solved(q, zd, tau, res, qe0, H, B, c, Hq, ang, angL, dof, M, Qg, DA, Dc)


@_jit
def _point(z, zd, tau, has_ref, ref_z, ref_q, ref_R, ref_Jm, q_guess, tol, quad_res, max_newton, light,
           qe0, H, B, c, Hq, ang, angL, dof, M, Qg, DA, Dc):
    """ManifoldDynamics.point in one call (:func:`_position`, then :func:`_point_at`); status 0 = converged, 1 = no
    convergence (the caller falls back to the model's continuation solver), 2 = singular constraint Jacobian or mass
    matrix.  From a reference at the same z whose q is consistent, the reference's [Φ_q; S]⁻¹ = [Jm, R] is the one at
    q, and no inversion is needed (the UKF's sigma points that differ from the mean only in ż, the force or the
    parameters: exact).  ``light`` (the UKF's sigma points, which need no Jm of their own): a position solved by the
    chord steps gets R and s refined with the reference's inverse instead of inverting (:func:`_solved_light`) when
    n > SMALL_N (a smaller matrix is inverted faster by :func:`_inverse`'s own elimination); the result holds the
    reference's Jm.  The smoothers' points are never light: :func:`_point_full` (which does not compile
    :func:`_solved_light`)."""
    how, q, res = _position(z, has_ref, ref_z, ref_q, ref_R, ref_Jm, q_guess, tol, quad_res, max_newton, qe0, H, B,
                            c, Hq, ang, angL, dof)
    if how == _BY_CHORD and light and q.shape[0] > SMALL_N:  # (a small matrix is inverted faster than refined)
        return _solved_light(q, zd, tau, res, ref_R, ref_Jm, qe0, H, B, c, Hq, ang, angL, dof, M, Qg, DA, Dc)
    return _point_at(how, q, res, zd, tau, ref_R, ref_Jm, qe0, H, B, c, Hq, ang, angL, dof, M, Qg, DA, Dc)


@_jit
def _point_full(z, zd, tau, has_ref, ref_z, ref_q, ref_R, ref_Jm, q_guess, tol, quad_res, max_newton,
                qe0, H, B, c, Hq, ang, angL, dof, M, Qg, DA, Dc):
    """:func:`_point`, never light (the independent smoother's)."""
    how, q, res = _position(z, has_ref, ref_z, ref_q, ref_R, ref_Jm, q_guess, tol, quad_res, max_newton, qe0, H, B,
                            c, Hq, ang, angL, dof)
    return _point_at(how, q, res, zd, tau, ref_R, ref_Jm, qe0, H, B, c, Hq, ang, angL, dof, M, Qg, DA, Dc)


#: the filters' integrators (FilterParams.integrator) and their codes in the transition kernels
INTEGRATOR_CODES = {"heun": 1, "rk4": 2, "euler": 0}


@_jit
def _filter_tau(x, g, force, G, e0, dof, n):
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


@_jit
def _stage(x, g, force, G, e0, ref_z, ref_q, ref_R, ref_Jm, tol, quad_res, max_newton, light,
           qe0, H, B, c, Hq, ang, angL, dof, M, Qg, DA, Dc):
    """The manifold point of filter state x from a reference point (IndependentFilter.point_of); ``light``
    as :func:`_point`."""
    tau = _filter_tau(x, g, force, G, e0, dof, ref_q.shape[0])
    return _point(_part(x, 0, g), _part(x, g, 2 * g), tau, _rt(True), ref_z, ref_q, ref_R, ref_Jm, ref_q, tol, quad_res,
                  max_newton, light, qe0, H, B, c, Hq, ang, angL, dof, M, Qg, DA, Dc)


@_jit
def _xdot(x, zdd, g):
    """ẋ = [ż, z̈, 0, …] (IndependentFilter.xdot)."""
    out = np.zeros(x.shape[0])
    for i in range(g):
        out[i] = x[g + i]
        out[g + i] = zdd[i]
    return out


@_jit
def _shared_velocity_terms(x0, g, z0, q0, R0, Jm0, tol, qe0, H, B, c, Hq, ang, angL, dof, M):
    """(ok, q̇, s, M s, M̄⁻¹): :func:`_velocity_terms` of the sigma points at x0's z and ż, from x0's point
    (z0, q0, R0, Jm0), once for all of them: each one's :func:`_point` is its reference's own position (the
    same test), and :func:`_accelerations` with its τ completes its dynamics.  Not ok: find each one's."""
    e1, e2 = np.zeros(0), np.zeros((0, 0))
    if not _same_head(x0, z0, g):
        return False, e1, e1, e1, e2
    q = _part(q0, 0, q0.shape[0])
    for i in range(g):
        q[dof[i]] = z0[i]
    if not _same_head(q, q0, q.shape[0]) or not _residual(q, qe0, H, B, c, ang, angL)[1] <= tol:
        return False, e1, e1, e1, e2
    qd, s, Ms, Minv, ok = _velocity_terms(q0, _part(x0, g, 2 * g), R0, Jm0, M, Hq, ang, angL)
    return ok, qd, s, Ms, Minv


@_jit
def _stage_mass(SZ, SQ, SR, tol, qe0, H, B, c, ang, angL, dof, M):
    """M̄⁻¹ (S, g, g) at each recorded stage point (:func:`_transition_stages`) whose position a stage at
    the same z takes as it is (:func:`_point`'s test: its q with q[dof] = z unchanged and consistent);
    (S, 0, 0) when one is not: those stages are found by :func:`_point`."""
    S, g = SZ.shape[0], dof.shape[0]
    out = np.zeros((S, g, g))
    for i in range(S):
        q = _part(SQ[i], 0, SQ.shape[1])
        for j in range(g):
            q[dof[j]] = SZ[i, j]
        Minv, ok = _eliminate(_rtmr(SR[i], M))
        if not (ok and _same_head(q, SQ[i], q.shape[0]) and _residual(q, qe0, H, B, c, ang, angL)[1] <= tol):
            return np.zeros((S, 0, 0))
        for a in range(g):
            for b in range(g):
                out[i, a, b] = Minv[a, b]
    return out


@_jit
def _filter_sigma_transitions(X, x0, nd, h, integ, g, force, G, e0, z0, q0, qd0, R0, Jm0, zdd0, tol, quad_res,
                              max_newton, qe0, H, B, c, Hq, ang, angL, dof, M, Qg, DA, Dc):
    """(status, X⁺): each row of X (sigma points) through the mean transition of h seconds from its own
    point (found from the point of x0: z0, q0, …), as UnscentedKalmanFilter.covariance_over; rows equal
    to x0 in the dynamic part [:nd] share x0's transition; the sensor parameters [nd:] are constant.
    A row whose z (or a stage's z) equals x0's (its stage's) shares that position and its inverse
    (:func:`_transition_stages`, :func:`_point`): with a lower-triangular square root of P only the rows
    along z and ż need position problems of their own, and those at x0's z and ż share its velocity terms
    too (:func:`_shared_velocity_terms`).  The first status ≠ 0 stops (the caller falls back)."""
    N, L, n = X.shape[0], X.shape[1], q0.shape[0]
    out = np.empty((N, L))
    for k in range(N):
        for j in range(L):
            out[k, j] = X[k, j]
    share, vqd, vs, vMs, vMinv = _shared_velocity_terms(x0, g, z0, q0, R0, Jm0, tol, qe0, H, B, c, Hq, ang, angL,
                                                        dof, M)
    e3 = np.zeros((0, 0, 0))
    st, base, _, _, _, _, _, _, _, _, SZ, SQ, SR, SJm = _transition_stages(
        x0, h, integ, g, force, G, e0, z0, q0, qd0, R0, Jm0, zdd0, _rt(False), _rt(False), tol, quad_res,
        max_newton, np.zeros((0, 0)), np.zeros((0, 0)), e3, e3, e3, _rt(True), qe0, H, B, c, Hq, ang, angL, dof, M, Qg, DA, Dc)
    if st != 0:
        return st, out
    SMinv = _stage_mass(SZ, SQ, SR, tol, qe0, H, B, c, ang, angL, dof, M)
    for k in range(N):
        x = X[k]
        if _same_head(x, x0, nd):
            for j in range(nd):
                out[k, j] = base[j]
            continue
        zs = _part(x, 0, g)
        if share and _same_head(x, x0, 2 * g):
            tau = _filter_tau(x, g, force, G, e0, dof, n)
            _, zdds = _accelerations(q0, vqd, tau, R0, vs, vMs, vMinv, qe0, Qg, DA, Dc)
            qs, qds, Rs, Jms = q0, vqd, R0, Jm0
        else:
            st, qs, qds, _, zdds, Rs, Jms, _ = _stage(x, g, force, G, e0, z0, q0, R0, Jm0, tol, quad_res, max_newton,
                                                      _rt(True), qe0, H, B, c, Hq, ang, angL, dof, M, Qg, DA, Dc)
            if st != 0:
                return st, out
        st, xn, _, _, _, _, _, _, _, _, _, _, _, _ = _transition_stages(
            x, h, integ, g, force, G, e0, zs, qs, qds, Rs, Jms, zdds, _rt(False), _rt(False), tol, quad_res,
            max_newton, SZ, SQ, SR, SJm, SMinv, _rt(False), qe0, H, B, c, Hq, ang, angL, dof, M, Qg, DA, Dc)
        if st != 0:
            return st, out
        for j in range(nd):
            out[k, j] = xn[j]
    return 0, out


@_jit
def _forces_jac(q, qd, qe0, DA, Dc):
    """(∂Q/∂q, ∂Q/∂q̇), each (n, n): Model.Q_jac (the dampers' bilinear rate forms)."""
    n = q.shape[0]
    dQ_dq, dQ_dqd = np.zeros((n, n)), np.zeros((n, n))
    if DA.shape[0]:
        qe = _extend(qe0, q)
        qde = _padded(qd, qe0.shape[0])
        for k in range(DA.shape[0]):
            A, ck = DA[k], Dc[k]
            j = _mtv(A, qe)
            Aqd = _mv(A, qde)
            w = _dot(qe, Aqd)
            for i in range(n):
                for l in range(n):
                    dQ_dqd[i, l] -= ck * j[i] * j[l]
                    dQ_dq[i, l] -= ck * (A[l, i] * w + j[i] * Aqd[l])
    return dQ_dq, dQ_dqd


@_jit
def _kkt_inverse(q, qe0, H, B, c, ang, angL, M):
    """(K⁻¹, ok) of the KKT matrix K = [[M, Φ_qᵀ], [Φ_q, 0]] (Model._kkt)."""
    n, m = q.shape[0], c.shape[0]
    _, J = _phi(q, qe0, H, B, c, ang, angL, True)
    K = np.zeros((n + m, n + m))
    K[:n, :n] = M
    K[:n, n:] = J.T
    K[n:, :n] = J
    return _inverse(K)


@_jit
def _kkt_rhs_jac(q, qd, qdd, lam, Cqd, qe0, Hq, ang, angL, DA, Dc):
    """(R_q, R_q̇), each (n + m, n): the derivatives by q and q̇, at fixed (q̈, λ), of the KKT system's
    [Q − M q̈ − Φ_qᵀλ; γ − Φ_q q̈] at a solution (q̈, λ): the forward dynamics' Jacobians ∂q̈/∂q, ∂q̈/∂q̇ are
    K⁻¹[:n] times these.  ``Cqd`` = Σ_l ∂²Φ/∂q∂q_l q̇_l (:func:`_hess_contract`)."""
    n, m = q.shape[0], lam.shape[0]
    dQ_dq, dQ_dqd = _forces_jac(q, qd, qe0, DA, Dc)
    R_q = np.empty((n + m, n))
    R_qd = np.empty((n + m, n))
    Cqdd = _hess_contract(q, qdd, Hq, m, ang, angL)
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


@_jit
def _fdjt(q, qd, tau, qe0, H, B, c, Hq, ang, angL, M, Qg, DA, Dc):
    """(q̈, ∂q̈/∂q, ∂q̈/∂q̇, ∂q̈/∂τ, ok): Model.forward_dynamics_jac_tau (KKT form, Lagrange multipliers)."""
    n, m = q.shape[0], c.shape[0]
    Kinv, ok = _kkt_inverse(q, qe0, H, B, c, ang, angL, M)
    Cqd = _hess_contract(q, qd, Hq, m, ang, angL)
    rhs = np.empty(n + m)
    rhs[:n] = _forces(q, qd, tau, qe0, Qg, DA, Dc)
    rhs[n:] = -(Cqd @ qd)
    x = Kinv @ rhs
    qdd, lam = x[:n].copy(), x[n:].copy()
    R_q, R_qd = _kkt_rhs_jac(q, qd, qdd, lam, Cqd, qe0, Hq, ang, angL, DA, Dc)
    Kn = np.ascontiguousarray(Kinv[:n])
    return qdd, Kn @ R_q, Kn @ R_qd, np.ascontiguousarray(Kinv[:n, :n]), ok


@_jit
def _kkt_rows(V, R, Jm, Mbinv, M):
    """K⁻¹[:n] V (n, k) for V (n + m, k), K the KKT matrix, from the R-matrix factors of a consistent point
    instead of K⁻¹: q̈ = N Q + (I − N M) Jm γ with N = R M̄⁻¹ Rᵀ, so K⁻¹[:n] = [N, (I − N M) Jm] and
    K⁻¹[:n] V = W + N (V[:n] − M W) with W = Jm V[n:].  O(n m k) against O((n + m)³) for K⁻¹."""
    n, m, k = R.shape[0], Jm.shape[1], V.shape[1]
    Vm = np.empty((m, k))
    for i in range(m):
        for j in range(k):
            Vm[i, j] = V[n + i, j]
    W = _mm(Jm, Vm)
    MW = _mm(M, W)
    U = np.empty((n, k))
    for i in range(n):
        for j in range(k):
            U[i, j] = V[i, j] - MW[i, j]
    out = _mm(R, _mm(Mbinv, _mtm(R, U)))
    for i in range(n):
        for j in range(k):
            out[i, j] = W[i, j] + out[i, j]
    return out


@_jit
def _state_jacobians(q, qd, tau, qe0, H, B, c, Hq, ang, angL, dof, M, Qg, DA, Dc):
    """(R, ∂q̇/∂z, q̈, ∂q̈/∂q, ∂q̈/∂q̇, ∂q̈/∂τ, ok): Model.state_jacobians for a square system."""
    qdd, dq, dqd, dtau, ok1 = _fdjt(q, qd, tau, qe0, H, B, c, Hq, ang, angL, M, Qg, DA, Dc)
    Jinv, ok2 = _dof_inverse(q, qe0, H, B, c, ang, angL, dof)
    m = c.shape[0]
    R = np.ascontiguousarray(Jinv[:, m:])
    dqd_dz = (np.ascontiguousarray(Jinv[:, :m]) @ -_hess_contract(q, qd, Hq, m, ang, angL)) @ R
    return R, dqd_dz, qdd, dq, dqd, dtau, ok1 and ok2


@_jit
def _filter_jacobians(x, q, qd, R, Jm, L, g, force, G, e0, qe0, Hq, ang, angL, dof, M, Qg, DA, Dc):
    """(R, ∂q̇/∂z, ∂q̈/∂x (n, L), ok) of filter state x at its point (q, q̇, R, Jm): the forward dynamics'
    state Jacobians (as :func:`_fdjt`, but with K⁻¹[:n] applied through the point's R-matrix factors,
    :func:`_kkt_rows`) chained through q = q(z), q̇ = R ż and τ(x) (IndependentFilter._dqdd_dx).  q̈ is
    found again for τ(x) (a point's q̈ may be of the τ before its parameter forces were refreshed):
    q̈ = R M̄⁻¹Rᵀ(Q − M s) + s, s = Jm γ, and λ = Jmᵀ(Q − M q̈) (the KKT system's first rows, Φ_q Jm = I).
    ok: M̄ = RᵀMR is invertible."""
    n, m = q.shape[0], Jm.shape[1]
    tau = _filter_tau(x, g, force, G, e0, dof, n)
    Cqd = _hess_contract(q, qd, Hq, m, ang, angL)
    Mbinv, ok = _eliminate(_rtmr(R, M))
    Q = _forces(q, qd, tau, qe0, Qg, DA, Dc)
    s = _mv(Jm, _mv(Cqd, qd))
    for i in range(n):
        s[i] = -s[i]
    Ms = _mv(M, s)
    t = np.empty(n)
    for i in range(n):
        t[i] = Q[i] - Ms[i]
    qdd = _mv(R, _mv(Mbinv, _mtv(R, t)))
    for i in range(n):
        qdd[i] += s[i]
    Mq = _mv(M, qdd)
    for i in range(n):
        t[i] = Q[i] - Mq[i]
    lam = _mtv(Jm, t)
    R_q, R_qd = _kkt_rhs_jac(q, qd, qdd, lam, Cqd, qe0, Hq, ang, angL, DA, Dc)
    dqd_dz = _mm(Jm, _mm(Cqd, R))
    for i in range(n):
        for j in range(g):
            dqd_dz[i, j] = -dqd_dz[i, j]
    V = _mm(R_q, R)
    V2 = _mm(R_qd, dqd_dz)
    for i in range(V.shape[0]):
        for j in range(g):
            V[i, j] += V2[i, j]
    Dz = _kkt_rows(V, R, Jm, Mbinv, M)
    Dzd = _kkt_rows(_mm(R_qd, R), R, Jm, Mbinv, M)
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
        Nd = _mm(R, _mmt(Mbinv, Rd))
        for i in range(g):
            for r in range(n):
                col = Nd[r, i]
                D[r, g + i] -= col * x[2 * g + i]
                D[r, 2 * g + i] = -col * x[g + i]
                D[r, 3 * g + i] = col
    K = G.shape[1]
    if K:
        DG = _mm(R, _mm(Mbinv, _mtm(R, G)))
        for r in range(n):
            for k in range(K):
                D[r, e0 + k] = DG[r, k]
    return R, dqd_dz, D, ok


@_jit
def _A_of(D, dof, g):
    """A = ∂ẋ/∂x (L, L) of a filter state from its ∂q̈/∂x (n, L) (IndependentFilter.A)."""
    L = D.shape[1]
    A = np.zeros((L, L))
    for i in range(g):
        A[i, g + i] = 1.0
        for j in range(L):
            A[g + i, j] = D[dof[i], j]
    return A


#: the stages after the first of Heun's method and RK4 in :func:`_filter_transition`: (a, w) = the stage is
#: evaluated at x + a h k_prev, and its slope weighs w in the sum (Heun: (k1 + k2)/2, RK4: (k1 + 2k2 + 2k3 + k4)/6)
_HEUN_STAGES = np.array([[1.0, 1.0]])
_RK4_STAGES = np.array([[0.5, 2.0], [0.5, 2.0], [1.0, 1.0]])


@_jit
def _filter_transition(x, h, integ, g, force, G, e0, z0, q0, qd0, R0, Jm0, zdd0, want_point, want_jac, tol, quad_res,
                       max_newton, qe0, H, B, c, Hq, ang, angL, dof, M, Qg, DA, Dc):
    """IndependentFilter.transition from x with its point (z0, q0, q̇0, R0, Jm0, z̈0) by the integrator
    ``integ`` (INTEGRATOR_CODES): (status, x⁺, F, q, q̇, q̈, z̈, R, Jm, residual).  F = ∂x⁺/∂x (if
    ``want_jac``, else empty) is the exact Jacobian of the integrator map chained through its stages;
    (q … residual) is the point of x⁺ found from the last stage's (if ``want_point``, else empty:
    IndependentFilter.predict).  Status as :func:`_point`, 2 also for a singular state Jacobian; ≠ 0:
    the caller falls back to the reference path."""
    e3 = np.zeros((0, 0, 0))
    out = _transition_stages(x, h, integ, g, force, G, e0, z0, q0, qd0, R0, Jm0, zdd0, want_point, want_jac, tol,
                             quad_res, max_newton, np.zeros((0, 0)), np.zeros((0, 0)), e3, e3, e3, _rt(False),
                             qe0, H, B, c, Hq, ang, angL, dof, M, Qg, DA, Dc)
    return out[0], out[1], out[2], out[3], out[4], out[5], out[6], out[7], out[8], out[9]


@_jit
def _transition_stages(x, h, integ, g, force, G, e0, z0, q0, qd0, R0, Jm0, zdd0, want_point, want_jac, tol, quad_res,
                       max_newton, SZ, SQ, SR, SJm, SMinv, record, qe0, H, B, c, Hq, ang, angL, dof, M, Qg, DA, Dc):
    """:func:`_filter_transition`, and the stage points: (its result, then the z, q, R, Jm of each stage after
    the first, stacked, if ``record``).  Given SZ, SQ, SR, SJm (a recorded transition's stages: the
    mean's), stage i is a light point found from (SZ[i], SQ[i], SR[i], SJm[i]) (:func:`_point`); at the same
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
        _, _, D, ok = _filter_jacobians(x, q0, qd0, R0, Jm0, L, g, force, G, e0, qe0, Hq, ang, angL, dof, M, Qg, DA, Dc)
        if not ok:
            return (2,) + fail
        A1 = _A_of(D, dof, g)
    F = e2
    rz, rq, rR, rJm = z0, q0, R0, Jm0
    if integ == 0:
        xn = _axpy(x, h, k1)
        if want_jac:
            F = _eye_plus(h, A1)
    else:
        # Heun: one stage at x + h k1; RK4: stages at x + h/2 k1, x + h/2 k2, x + h k3 — each stage's point
        # found from the previous one's; D_s = A_s (I + a h D_prev) chains the stage Jacobians
        stages = _HEUN_STAGES if integ == 1 else _RK4_STAGES
        acc, k, Dk, Fsum = k1, k1, A1, A1  # (never written in place)
        for i in range(stages.shape[0]):
            a, w = stages[i, 0], stages[i, 1]
            xs = _axpy(x, a * h, k)
            light = i < SZ.shape[0]
            if light:
                rz, rq, rR, rJm = SZ[i], SQ[i], SR[i], SJm[i]
            if light and SMinv[i].shape[0] and _same_head(xs, rz, g):  # the stage's position and M̄⁻¹
                tau = _filter_tau(xs, g, force, G, e0, dof, n)
                qs, Rs, Jms = rq, rR, rJm
                qds, ss, Mss = _rate_terms(rq, _part(xs, g, 2 * g), rR, rJm, M, Hq, ang, angL)
                _, zdds = _accelerations(rq, qds, tau, rR, ss, Mss, SMinv[i], qe0, Qg, DA, Dc)
            else:
                st, qs, qds, _, zdds, Rs, Jms, _ = _stage(xs, g, force, G, e0, rz, rq, rR, rJm, tol, quad_res,
                                                          max_newton, light, qe0, H, B, c, Hq, ang, angL, dof, M, Qg,
                                                          DA, Dc)
                if st != 0:
                    return (st,) + fail
            k = _xdot(xs, zdds, g)
            acc = _axpy(acc, w, k)
            rz, rq, rR, rJm = _part(xs, 0, g), qs, Rs, Jms
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
                _, _, D, ok = _filter_jacobians(xs, qs, qds, Rs, Jms, L, g, force, G, e0, qe0, Hq, ang, angL, dof, M, Qg,
                                                DA, Dc)
                if not ok:
                    return (2,) + fail
                Dk = _mm(_A_of(D, dof, g), _eye_plus(a * h, Dk))
                Fsum = _maxpy(Fsum, w, Dk)
        if integ == 1:
            xn = _axpy(x, 0.5 * h, acc)
            if want_jac:
                F = _eye_plus(0.5 * h, Fsum)
        else:
            xn = _axpy(x, h / 6, acc)
            if want_jac:
                F = _eye_plus(h / 6, Fsum)
    if not want_point:
        return (0, xn, F, e1, e1, e1, e1, e2, e2, 0.0) + rec
    st, q, qd, qdd, zdd, R, Jm, res = _stage(xn, g, force, G, e0, rz, rq, rR, rJm, tol, quad_res, max_newton,
                                             _rt(False), qe0, H, B, c, Hq, ang, angL, dof, M, Qg, DA, Dc)
    return (st, xn, F, q, qd, qdd, zdd, R, Jm, res) + rec


#: SensorTable.kind of a sensor: not covered by the compiled measurement model (the reference path), a gyro, an
#: accelerometer, an inclination, an encoder, a drive's commanded position or velocity (sensors.DriveCommand)
NOT_COMPILED, GYRO, ACCELEROMETER, INCLINATION, ENCODER, COMMAND_POSITION, COMMAND_VELOCITY = 0, 1, 2, 3, 4, 5, 6


@_jit
def _measure_sensors(ids, q, qd, qdd, p, t, qe0, want_jac, R, dqd_dz, D, nd):
    """Stacked readings y of the sensors ``ids`` (SensorTable ``t``: rows per sensor ``t.dims``) at (q, q̇, q̈)
    with sensor parameters p, and, if ``want_jac``, H = ∂y/∂x (rows, L) of the filter state
    (IndependentFilter.predict_measurement with SensorParams.measure); δ below is the sensor's IMU's time
    offset p[t.offset] (−1: none), b the biases p[t.bias] (−1: none).

    - Gyro: y = col ω − δ col ω̇ + b with ω = qeᵀ A q̇e, ω̇ = qeᵀ A q̈e (the body-rate form A of its body:
      Model.body_rate).
    - Accelerometer (sensors.Accelerometer.h_mounted): y = A₂ R(φ + μ)ᵀ (C q̈ − g) + b, C the point matrix of its
      mounting point (Model.point_matrix), φ its body's angle (Model.body_angle), μ its residual mount angle
      p[t.mount_state] (−1: none, μ = 0), g gravity (m/s²); no time offset.
    - Inclination: y = φ + mount − δ ω (rad).
    - Encoder: y = q[coordinate] when its angle is a coordinate, else φ of its body less φ of the body it is
      measured against, if any (rad).
    - Drive command: y = q[coordinate] (position) or q̇[coordinate] (velocity) of its DOF's coordinate.

    H chains q = q(z) (R), q̇ (∂q̇/∂z, R) and q̈ (D = ∂q̈/∂x)."""
    n, ne, k = q.shape[0], qe0.shape[0], ids.shape[0]
    qe = _extend(qe0, q)
    qde = _padded(qd, ne)
    qdde = _padded(qdd, ne)
    rows = 0
    for a in range(k):
        rows += t.dims[ids[a]]
    y = np.zeros(rows)
    Hq = np.zeros((rows, n))
    Hqd = np.zeros((rows, n))
    Hqdd = np.zeros((rows, n))
    Hp = np.zeros((rows, p.shape[0]))
    row0 = _rt(0)  # (the row functions compiled once, not also for a literal 0)
    for a in range(k):
        i = ids[a]
        kind = t.kind[i]
        if kind == ACCELEROMETER:
            _accelerometer_rows(row0, i, qe, qdd, p, t, want_jac, y, Hq, Hqdd, Hp)
        elif kind == GYRO:
            _gyro_rows(row0, i, qe, qde, qdde, p, t, want_jac, y, Hq, Hqd, Hqdd, Hp)
        elif kind == INCLINATION or kind == ENCODER:
            _angle_row(row0, i, qe, qde, p, t, want_jac, y, Hq, Hqd, Hp)
        elif kind == COMMAND_POSITION or kind == COMMAND_VELOCITY:
            _command_row(row0, i, q, qd, t, want_jac, y, Hq, Hqd)
        for r in range(t.dims[i]):
            b = t.bias[i, r]
            if b >= 0:
                y[row0 + r] += p[b]
                Hp[row0 + r, b] = 1.0
        row0 += t.dims[i]
    if not want_jac:
        return y, np.zeros((0, 0))
    g = R.shape[1]
    Hx = _mm(Hqdd, D)
    HqR, Hqd_z, HqdR = _mm(Hq, R), _mm(Hqd, dqd_dz), _mm(Hqd, R)
    for r in range(rows):
        for j in range(g):
            Hx[r, j] += HqR[r, j] + Hqd_z[r, j]
            Hx[r, g + j] += HqdR[r, j]
        for j in range(p.shape[0]):
            Hx[r, nd + j] += Hp[r, j]
    return y, Hx


@_jit
def _gyro_rows(row0, i, qe, qde, qdde, p, t, want_jac, y, Hq, Hqd, Hqdd, Hp):
    """Gyro i's three rows of :func:`_measure_sensors` from ``row0``, its bias left out: y, and with ``want_jac``
    ∂y/∂q, ∂y/∂q̇, ∂y/∂q̈ and ∂y/∂δ, written in place."""
    n = Hq.shape[1]
    A = t.rate_form[i]
    Aqd = _mv(A, qde)
    w = _dot(qe, Aqd)
    Atq = _mtv(A, qe) if want_jac else Aqd  # (for H only)
    kk = t.offset[i]
    Aqdd, wd = Aqd, 0.0
    if kk >= 0:  # ω̇ for the time offset's term
        Aqdd = _mv(A, qdde)
        wd = _dot(qe, Aqdd)
    for r in range(3):
        row = row0 + r
        cr = t.col[i, r]
        y[row] = cr * w
        if want_jac:
            for j in range(n):
                Hq[row, j] = cr * Aqd[j]
                Hqd[row, j] = cr * Atq[j]
        if kk >= 0:
            d = cr * wd
            y[row] -= p[kk] * d
            Hp[row, kk] = -d
            if want_jac:
                for j in range(n):
                    Hq[row, j] -= p[kk] * (cr * Aqdd[j])
                    Hqdd[row, j] -= p[kk] * (cr * Atq[j])


@_jit
def _accelerometer_rows(row0, i, qe, qdd, p, t, want_jac, y, Hq, Hqdd, Hp):
    """Accelerometer i's three rows of :func:`_measure_sensors` from ``row0``, its bias left out: y = A₂ Rᵀ v with
    R = R(φ + μ), v = C q̈ − g and, with ``want_jac``, ∂y/∂q = A₂ (∂Rᵀ/∂φ) v ∂φ/∂q, ∂y/∂q̈ = A₂ Rᵀ C and
    ∂y/∂μ = A₂ (∂Rᵀ/∂φ) v, written in place (cos φ and sin φ: the body's first two points' difference over its
    length, turned by the mount μ = p[t.mount_state] if estimated)."""
    n = qdd.shape[0]
    xi, yi, xj, yj = t.body_points[i, 0], t.body_points[i, 1], t.body_points[i, 2], t.body_points[i, 3]
    dx, dy = qe[xj] - qe[xi], qe[yj] - qe[yi]
    s2 = dx * dx + dy * dy
    length = np.sqrt(s2)
    c, s = dx / length, dy / length
    km = t.mount_state[i]
    if km >= 0:
        cm, sm = math.cos(p[km]), math.sin(p[km])
        c, s = c * cm - s * sm, s * cm + c * sm
    C = t.point[i]
    vx, vy = -t.gravity[0], -t.gravity[1]
    for j in range(n):
        vx += C[0, j] * qdd[j]
        vy += C[1, j] * qdd[j]
    u0, u1 = c * vx + s * vy, c * vy - s * vx  # Rᵀ v (body frame)
    for r in range(3):
        row = row0 + r
        a0, a1 = t.axes2[i, r, 0], t.axes2[i, r, 1]
        y[row] = a0 * u0 + a1 * u1
        if want_jac:
            _add_angle_gradient(Hq, row, xi, yi, xj, yj, dx, dy, a0 * u1 - a1 * u0)  # (∂y/∂φ) ∂φ/∂q
            if km >= 0:
                Hp[row, km] = a0 * u1 - a1 * u0
            r0, r1 = a0 * c - a1 * s, a0 * s + a1 * c  # row r of A₂ Rᵀ
            for j in range(n):
                Hqdd[row, j] = r0 * C[0, j] + r1 * C[1, j]


@_jit
def _add_angle_gradient(Hq, row, xi, yi, xj, yj, dx, dy, k):
    """Add k ∂φ/∂q to Hq[row]: φ = atan2(dy, dx) with dx = qe[xj] − qe[xi], dy = qe[yj] − qe[yi] (Model.body_angle;
    the fixed points' columns, ≥ n, left out)."""
    n = Hq.shape[1]
    s2 = dx * dx + dy * dy
    if xj < n:
        Hq[row, xj] -= k * dy / s2
    if xi < n:
        Hq[row, xi] += k * dy / s2
    if yj < n:
        Hq[row, yj] += k * dx / s2
    if yi < n:
        Hq[row, yi] -= k * dx / s2


@_jit
def _body_angle(pts, qe, row, sign, want_jac, Hq):
    """The angle φ (rad, atan2) of the body whose first two points' qe indices are ``pts`` (xi, yi, xj, yj),
    times ``sign``; with ``want_jac``, sign ∂φ/∂q added to Hq[row]."""
    dx, dy = qe[pts[2]] - qe[pts[0]], qe[pts[3]] - qe[pts[1]]
    if want_jac:
        _add_angle_gradient(Hq, row, pts[0], pts[1], pts[2], pts[3], dx, dy, sign)
    return sign * math.atan2(dy, dx)


@_jit
def _angle_row(row0, i, qe, qde, p, t, want_jac, y, Hq, Hqd, Hp):
    """An inclination's or an encoder's row of :func:`_measure_sensors` (rad): y and, with ``want_jac``, ∂y/∂q,
    ∂y/∂q̇ and ∂y/∂δ, written in place."""
    n = Hq.shape[1]
    coord = t.coordinate[i]
    if coord >= 0:  # an encoder whose angle is a coordinate
        y[row0] = qe[coord]
        if want_jac:
            Hq[row0, coord] = 1.0
        return
    v = _body_angle(t.body_points[i], qe, row0, 1.0, want_jac, Hq)
    if t.relative_points[i, 0] >= 0:
        v += _body_angle(t.relative_points[i], qe, row0, -1.0, want_jac, Hq)
    y[row0] = v + t.mount[i]
    kk = t.offset[i]
    if kk >= 0:  # y − δ ω of an inclination: ω = qeᵀ A q̇e
        A = t.rate_form[i]
        Aqd = _mv(A, qde)
        w = _dot(qe, Aqd)
        y[row0] -= p[kk] * w
        if want_jac:
            Hp[row0, kk] = -w
            Atq = _mtv(A, qe)
            for j in range(n):
                Hq[row0, j] -= p[kk] * Aqd[j]
                Hqd[row0, j] -= p[kk] * Atq[j]


@_jit
def _command_row(row0, i, q, qd, t, want_jac, y, Hq, Hqd):
    """A drive command's row of :func:`_measure_sensors`: y = q or q̇ of its coordinate and, with ``want_jac``, the 1
    of ∂y/∂q or ∂y/∂q̇, written in place."""
    c = t.coordinate[i]
    if t.kind[i] == COMMAND_POSITION:
        y[row0] = q[c]
        if want_jac:
            Hq[row0, c] = 1.0
    else:
        y[row0] = qd[c]
        if want_jac:
            Hqd[row0, c] = 1.0


def sparse_forms(A: np.ndarray) -> np.ndarray:
    """The nonzeros of each sensor's body-rate form A (ns, ne, ne) as rows (a, b, value), padded with
    zero rows to the largest count: (ns, nnz, 3), for :func:`_sensor_readings`."""
    rows = [np.argwhere(Ai != 0.0) for Ai in A]
    out = np.zeros((A.shape[0], max([len(r) for r in rows] + [1]), 3))
    for i, r in enumerate(rows):
        out[i, : len(r), :2] = r
        out[i, : len(r), 2] = A[i][r[:, 0], r[:, 1]]
    return out


@_jit
def _sensor_readings(ids, q, qd, qdd, p, t, qe0, out):
    """The readings of :func:`_measure_sensors` (no H) written to ``out``; a gyro's over the nonzeros ``t.rate_nz``
    of its body-rate form (:func:`sparse_forms`): ω = Σ A_ab qe_a q̇e_b, ω̇ likewise with q̈ (same value, summed
    in another order)."""
    n = q.shape[0]
    qe = _extend(qe0, q)
    no_jac = np.zeros((0, 0))
    row0 = _rt(0)  # (the row functions compiled once, not also for a literal 0)
    for a in range(ids.shape[0]):
        i = ids[a]
        kind = t.kind[i]
        if kind == GYRO:
            kk = t.offset[i]
            nz = t.rate_nz[i]
            w, wd = 0.0, 0.0
            for e in range(nz.shape[0]):
                ia, ib, v = int(nz[e, 0]), int(nz[e, 1]), nz[e, 2]
                if ib < n:  # q̇e, q̈e: zero beyond q (the fixed points)
                    w += v * qe[ia] * qd[ib]
                    if kk >= 0:
                        wd += v * qe[ia] * qdd[ib]
            for r in range(3):
                cr = t.col[i, r]
                out[row0 + r] = cr * w
                if kk >= 0:
                    out[row0 + r] -= p[kk] * (cr * wd)
        elif kind == ACCELEROMETER:
            _accelerometer_rows(row0, i, qe, qdd, p, t, _rt(False), out, no_jac, no_jac, no_jac)
        elif kind == INCLINATION or kind == ENCODER:
            _angle_row(row0, i, qe, _padded(qd, qe.shape[0]), p, t, _rt(False), out, no_jac, no_jac, no_jac)
        elif kind == COMMAND_POSITION or kind == COMMAND_VELOCITY:
            _command_row(row0, i, q, qd, t, _rt(False), out, no_jac, no_jac)
        for r in range(t.dims[i]):
            b = t.bias[i, r]
            if b >= 0:
                out[row0 + r] += p[b]
        row0 += t.dims[i]


@_jit
def _filter_sigma_readings(X, x0, nd, ids, g, force, G, e0, z0, q0, qd0, qdd0, R0, Jm0, tol, quad_res, max_newton, t,
                           qe0, H, B, c, Hq, ang, angL, dof, M, Qg, DA, Dc):
    """(status, Y (rows of X, readings)): the sensors ``ids`` (SensorTable ``t``) read at each row of X (sigma
    points) from its own point, found from x0's point (z0, q0, …; rows equal to x0 in [:nd] use it), as
    UnscentedKalmanFilter.update; status as :func:`_point` (≠ 0: the caller falls back).  Rows at x0's z and ż
    share its velocity terms (:func:`_shared_velocity_terms`)."""
    rows = 0
    for a in range(ids.shape[0]):
        rows += t.dims[ids[a]]
    Y = np.zeros((X.shape[0], rows))
    share, vqd, vs, vMs, vMinv = _shared_velocity_terms(x0, g, z0, q0, R0, Jm0, tol, qe0, H, B, c, Hq, ang, angL,
                                                        dof, M)
    for k in range(X.shape[0]):
        x = X[k]
        if _same_head(x, x0, nd):
            q, qd, qdd = q0, qd0, qdd0
        elif share and _same_head(x, x0, 2 * g):
            tau = _filter_tau(x, g, force, G, e0, dof, q0.shape[0])
            q, qd = q0, vqd
            qdd, _ = _accelerations(q0, vqd, tau, R0, vs, vMs, vMinv, qe0, Qg, DA, Dc)
        else:
            st, q, qd, qdd, _, _, _, _ = _stage(x, g, force, G, e0, z0, q0, R0, Jm0, tol, quad_res, max_newton,
                                                _rt(True), qe0, H, B, c, Hq, ang, angL, dof, M, Qg, DA, Dc)
            if st != 0:
                return st, Y
        _sensor_readings(ids, q, qd, qdd, _part(x, nd, x.shape[0]), t, qe0, Y[k])
    return 0, Y


@_jit
def _inverse_or_nan(A):
    """A⁻¹ of a C-contiguous A (:func:`_inverse`: no LAPACK call for a small matrix), or NaN everywhere when A is singular or
    not finite (what follows is NaN: gated, or taken for divergence)."""
    X, ok = _inverse(A)
    if not ok:
        X[:] = np.nan
    return X


@_jit
def block_nis(e, S, dims):
    """(eᵀS⁻¹e of all rows, the same of each block of consecutive rows of sizes ``dims`` against its own
    diagonal block of S): the filters' NIS of an update and of each sensor in it (IndependentFilter.update).
    A NaN in e gives NaN (the gate rejects it), as with numpy: S is inverted, never solved against e."""
    total = e @ _mv(_inverse_or_nan(S), e)
    each = np.zeros(dims.shape[0])
    r = 0
    for i in range(dims.shape[0]):
        d = dims[i]
        eb = np.ascontiguousarray(e[r : r + d])
        each[i] = eb @ _mv(_inverse_or_nan(np.ascontiguousarray(S[r : r + d, r : r + d])), eb)
        r += d
    return total, each


@_jit
def ekf_innovation_cov(P, H, rvar):
    """(P Hᵀ, S = H P Hᵀ + diag(rvar)) of an EKF update (measurement variances ``rvar``)."""
    PHt = P @ np.ascontiguousarray(H.T)
    S = H @ PHt
    for i in range(rvar.shape[0]):
        S[i, i] += rvar[i]
    return PHt, S


@_jit
def ekf_correct(x, P, H, PHt, S, e, rvar, keep):
    """(x⁺, P⁺) of an EKF update with the rows ``keep`` of its innovation e (the others gated):
    K = P Hᵀ S⁻¹, x⁺ = x + K e, Joseph form P⁺ = (I − KH) P (I − KH)ᵀ + K diag(rvar) Kᵀ, symmetrised."""
    k, L = keep.shape[0], x.shape[0]
    Hk = np.zeros((k, L))
    PHtk = np.zeros((L, k))
    Sk = np.zeros((k, k))
    ek = np.zeros(k)
    rk = np.zeros(k)
    for a in range(k):
        i = keep[a]
        Hk[a] = H[i]
        PHtk[:, a] = PHt[:, i]
        ek[a] = e[i]
        rk[a] = rvar[i]
        for b in range(k):
            Sk[a, b] = S[i, keep[b]]
    K = PHtk @ _inverse_or_nan(Sk)
    xn = x + K @ ek
    IKH = np.eye(L) - K @ Hk
    Pn = IKH @ P @ np.ascontiguousarray(IKH.T) + (K * rk) @ np.ascontiguousarray(K.T)
    return xn, 0.5 * (Pn + Pn.T)


# The fused updates' algebra as loops (see the note at _mv); compiled, they are the step-by-step path's too
# (compiled_or_python), and the functions above, uncompiled, the numpy reference; tests/test_kernels.py compares
# each pair.


@_jit
def _inverse_or_nan_compact(A):
    """:func:`_inverse_or_nan` by :func:`_eliminate` at any size (the innovation covariances are small)."""
    X, ok = _eliminate(A)
    if not ok:
        for i in range(X.shape[0]):
            for j in range(X.shape[1]):
                X[i, j] = np.nan
    return X


@_jit
def _block_nis_compact(e, S, dims):
    """:func:`block_nis` as loops."""
    total = _dot(e, _mv(_inverse_or_nan_compact(S), e))
    each = np.zeros(dims.shape[0])
    r = 0
    for i in range(dims.shape[0]):
        d = dims[i]
        Sb = np.empty((d, d))
        for a in range(d):
            for b in range(d):
                Sb[a, b] = S[r + a, r + b]
        eb = _part(e, r, r + d)
        each[i] = _dot(eb, _mv(_inverse_or_nan_compact(Sb), eb))
        r += d
    return total, each


@_jit
def _ekf_innovation_cov_compact(P, H, rvar):
    """:func:`ekf_innovation_cov` as loops."""
    PHt = _mmt(P, H)
    S = _mm(H, PHt)
    for i in range(rvar.shape[0]):
        S[i, i] += rvar[i]
    return PHt, S


@_jit
def _kept_rows(S, e, keep):
    """(S[keep][:, keep], e[keep]) as loops: the innovation's rows of the readings the gate kept."""
    k = keep.shape[0]
    Sk = np.empty((k, k))
    ek = np.empty(k)
    for a in range(k):
        i = keep[a]
        ek[a] = e[i]
        for b in range(k):
            Sk[a, b] = S[i, keep[b]]
    return Sk, ek


@_jit
def _ekf_correct_compact(x, P, H, PHt, S, e, rvar, keep):
    """:func:`ekf_correct` as loops."""
    k, L = keep.shape[0], x.shape[0]
    Hk = np.empty((k, L))
    PHtk = np.empty((L, k))
    for a in range(k):
        i = keep[a]
        for j in range(L):
            Hk[a, j] = H[i, j]
            PHtk[j, a] = PHt[j, i]
    Sk, ek = _kept_rows(S, e, keep)
    K = _mm(PHtk, _inverse_or_nan_compact(Sk))
    xn = _axpy(x, 1.0, _mv(K, ek))
    IKH = _mm(K, Hk)
    for i in range(L):
        for j in range(L):
            IKH[i, j] = (1.0 if i == j else 0.0) - IKH[i, j]
    Pn = _mmt(_mm(IKH, P), IKH)
    Kr = np.empty((L, k))
    for i in range(L):
        for a in range(k):
            Kr[i, a] = K[i, a] * rvar[keep[a]]
    KrK = _mmt(Kr, K)
    for i in range(L):
        for j in range(L):
            Pn[i, j] += KrK[i, j]
    return xn, _sym(Pn)


@_jit
def gate_stats(e, H, P, sigma):
    """(largest |e_i|/σ_i, eᵀS⁻¹e, standardised rows e_i/√S_ii) of a sample's residual e with row sigmas σ and
    covariance S = H P Hᵀ + diag(σ²) against the smoother's prediction (FixedLagSmoother._gate)."""
    S = H @ P @ np.ascontiguousarray(H.T)
    worst = 0.0
    for i in range(sigma.shape[0]):
        S[i, i] += sigma[i] * sigma[i]
        worst = max(worst, abs(e[i]) / sigma[i])
    return worst, e @ np.linalg.solve(S, e), e / np.sqrt(np.diag(S))


@_jit
def _gate_stats_compact(e, H, P, sigma):
    """:func:`gate_stats` as loops (S inverted by :func:`_eliminate`, no LAPACK: compiled in a fraction of the time)."""
    S = _mm(H, _mmt(P, H))
    worst = 0.0
    for i in range(sigma.shape[0]):
        S[i, i] += sigma[i] * sigma[i]
        worst = max(worst, abs(e[i]) / sigma[i])
    zr = np.empty(e.shape[0])
    for i in range(e.shape[0]):
        zr[i] = e[i] / math.sqrt(S[i, i])
    return worst, _dot(e, _mv(_inverse_or_nan_compact(S), e)), zr


@_jit
def _gated_nis(e, S, dims, gate):
    """(total NIS, NIS per sensor (rows ``dims``), standardised rows e_i/√S_ii, whether every sensor passes
    the outlier gate: its NIS ≤ ``gate`` × its rows; gate 0: off) of an update's innovation e with
    covariance S: the fused updates' share of IndependentFilter.sensor_nis and gate_and_record."""
    total, each = _block_nis_compact(e, S, dims)
    zr = np.empty(e.shape[0])
    for i in range(e.shape[0]):
        zr[i] = e[i] / math.sqrt(S[i, i])
    passed = True
    for i in range(dims.shape[0]):
        if gate > 0 and not each[i] <= gate * dims[i]:
            passed = False
    return total, each, zr, passed


#: the fused updates' status when the mean's transition to the update's time needs the reference path
#: (nothing done)
ADVANCE_FAILED = 7


@_jit
def _advance_mean(h, integ, x, z, q, qd, qdd, zdd, R, Jm, res, g, force, G, G0, T, e0, tol, quad_res, max_newton,
                  qe0, H, B, c, Hq, ang, angL, dof, M, Qg, DA, Dc):
    """(status, x, z, q, q̇, q̈, z̈, R, Jm, residual, G): the mean's transition of h seconds from x with its point
    (IndependentFilter.predict, the integrator ``integ``) and the point it reaches, before a fused update at
    that time; G (n, K) = G0 − T q̈ there (ModelUncertainty.forces).  h = 0: x, its point and G as given.
    Status ≠ 0 as :func:`_filter_transition`: x, its point and G as given."""
    if h <= 0.0:
        return 0, x, z, q, qd, qdd, zdd, R, Jm, res, G
    st, xn, _, qn, qdn, qddn, zddn, Rn, Jmn, resn = _filter_transition(
        x, h, integ, g, force, G, e0, z, q, qd, R, Jm, zdd, _rt(True), _rt(False), tol, quad_res, max_newton, qe0, H,
        B, c, Hq,
        ang, angL, dof, M, Qg, DA, Dc)
    if st != 0:
        return st, x, z, q, qd, qdd, zdd, R, Jm, res, G
    Gn = np.empty(G.shape)
    for i in range(G.shape[0]):
        for j in range(G.shape[1]):
            acc = 0.0
            for k in range(qddn.shape[0]):
                acc += T[i, j, k] * qddn[k]
            Gn[i, j] = G0[i, j] - acc
    return 0, xn, _part(xn, 0, g), qn, qdn, qddn, zddn, Rn, Jmn, resn, Gn


# One buffer per model and per point.  A call from Python costs ~0.1 µs per array argument and ~0.4 µs per
# array returned when warm, and several times that from a cold cache (numba's dispatcher types and unboxes
# each argument, and boxes each result through a Python-level call): the per-step mean's transition took 32
# arguments and returned 11 values.  Its flat entry (:func:`_advance_flat`) takes the model as two arrays,
# the point as one, and writes its results into buffers the caller allocated.

#: the model's float arrays in ModelKernels.mf, in this order: qe0, H, B, c, Hq, angL, M, Qg, DA, Dc
_MODEL_FLOATS = 10


@_jit
def _model_views(mf, mi):
    """The model's arrays (qe0, H, B, c, Hq, ang, angL, dof, M, Qg, DA, Dc) as views of its two buffers
    (ModelKernels.mf, mi: mi[0:2 * _MODEL_FLOATS] are each float array's start and size in mf, then
    n, ne, m, g, the counts of H, B, Hq rows, angle rows and dampers, then ang (k, 6) and dof (g,))."""
    o = mi[: 2 * _MODEL_FLOATS]
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


@_jit
def _point_views(pt, n, m, g):
    """(z, q, q̇, q̈, z̈, R, Jm, residual) of a point buffer (ModelKernels.point_buffer: z (g), q, q̇, q̈ (n each), z̈
    (g), R (n, g), Jm (n, m), residual), the arrays as views."""
    a = g + 3 * n + g
    return (pt[:g], pt[g : g + n], pt[g + n : g + 2 * n], pt[g + 2 * n : g + 3 * n], pt[g + 3 * n : a],
            pt[a : a + n * g].reshape((n, g)), pt[a + n * g : a + n * g + n * m].reshape((n, m)), pt[a + n * g + n * m])


@_jit
def _pack_point(out, z, q, qd, qdd, zdd, R, Jm, res):
    """Write a point into its buffer ``out`` (:func:`_point_views`' layout)."""
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


@_jit
def _advance_flat(h, integ, x, pt, force, G, e0, G0, T, tol, quad_res, max_newton, mf, mi, x_out, pt_out, G_out):
    """:func:`_advance_mean` with the model's two buffers (:func:`_model_views`) and x's point as one buffer
    (:func:`_point_views`), its results written to ``x_out``, ``pt_out`` and ``G_out``; returns the status
    (≠ 0: nothing written, as :func:`_advance_mean`)."""
    qe0, H, B, c, Hq, ang, angL, dof, M, Qg, DA, Dc = _model_views(mf, mi)
    n, m, g = M.shape[0], c.shape[0], dof.shape[0]
    z, q, qd, qdd, zdd, R, Jm, res = _point_views(pt, n, m, g)
    st, xn, zn, qn, qdn, qddn, zddn, Rn, Jmn, resn, Gn = _advance_mean(
        h, integ, x, z, q, qd, qdd, zdd, R, Jm, res, g, force, G, G0, T, e0, tol, quad_res, max_newton, qe0, H, B,
        c, Hq, ang, angL, dof, M, Qg, DA, Dc)
    if st != 0:
        return st
    for i in range(xn.shape[0]):
        x_out[i] = xn[i]
    _pack_point(pt_out, zn, qn, qdn, qddn, zddn, Rn, Jmn, resn)
    for i in range(Gn.shape[0]):
        for j in range(Gn.shape[1]):
            G_out[i, j] = Gn[i, j]
    return 0


@_jit
def interval_jacobian(A0, A1, h, integ):
    """F (L, L) of a covariance interval of h seconds (ExtendedKalmanFilter.covariance_over) from A = ∂ẋ/∂x
    at its start (A0) and at the mean at its end (A1), by the integrator ``integ`` (INTEGRATOR_CODES; not
    RK4): Euler I + h A0; Heun's form I + h/2 (A0 + A1 (I + h A0)), its second stage at the interval's
    actual end (where the mean's 1 ms steps took it) rather than at the Euler predictor x0 + h ẋ0."""
    L = A0.shape[0]
    F = h * A0
    if integ == 1:
        F = 0.5 * (F + h * (A1 + h * (A1 @ A0)))
    for i in range(L):
        F[i, i] += 1.0
    return F


@_jit
def _interval_jacobian_compact(A0, A1, h, integ):
    """:func:`interval_jacobian` as loops (the fused EKF update's; tests/test_kernels.py compares the two)."""
    L = A0.shape[0]
    F = np.empty((L, L))
    AA = _mm(A1, A0) if integ == 1 else A0
    for i in range(L):
        for j in range(L):
            F[i, j] = h * A0[i, j]
            if integ == 1:
                F[i, j] = 0.5 * (F[i, j] + h * (A1[i, j] + h * AA[i, j]))
        F[i, i] += 1.0
    return F


@_jit
def _ekf_update_prepare(x, P, pt, ids, rvar, nd, force, G, e0, t, tol, quad_res, max_newton, prop, x0, pt0, G_int, h,
                        integ, Qh, h_mean, integ_mean, G0, T, mf, mi, pt_adv):
    """The part of ModelKernels.ekf_update_prepare that does not depend on the readings: the mean's transition (its
    point written to ``pt_adv``), the interval's propagation, the predicted readings y_p, H, P Hᵀ and S (variances
    ``rvar``).  Returns (status, y_p, H, P Hᵀ, S, G at the advanced point, the advanced mean x, the propagated P);
    status 0, or ADVANCE_FAILED, 4 or 2 as ModelKernels.ekf_update_prepare (y_p … S empty).  Computed ahead of the
    update when its time is known (ExtendedKalmanFilter.prepare_call)."""
    qe0, H, B, c, Hq, ang, angL, dof, M, Qg, DA, Dc = _model_views(mf, mi)
    n, m, g = M.shape[0], c.shape[0], dof.shape[0]
    e1, e2 = np.zeros(0), np.zeros((0, 0))
    z, q, qd, qdd, zdd, R, Jm, res = _point_views(pt, n, m, g)
    st, x, z, q, qd, qdd, zdd, R, Jm, res, G = _advance_mean(h_mean, integ_mean, x, z, q, qd, qdd, zdd, R, Jm, res, g,
                                                            force, G, G0, T, e0, tol, quad_res, max_newton, qe0, H, B,
                                                            c, Hq, ang, angL, dof, M, Qg, DA, Dc)
    if st != 0:
        return (ADVANCE_FAILED, e1, e2, e2, e2, G, x, P)
    _pack_point(pt_adv, z, q, qd, qdd, zdd, R, Jm, res)
    L = x.shape[0]
    Rj, dqd_dz, D, ok = _filter_jacobians(x, q, qd, R, Jm, L, g, force, G, e0, qe0, Hq, ang, angL, dof, M, Qg, DA, Dc)
    if prop:
        _, q0, qd0, _, _, R0, Jm0, _ = _point_views(pt0, n, m, g)
        _, _, D0, ok0 = _filter_jacobians(x0, q0, qd0, R0, Jm0, L, g, force, G_int, e0, qe0, Hq, ang, angL, dof, M, Qg,
                                          DA, Dc)
        if not ok0:
            return (4, e1, e2, e2, e2, G, x, P)
        F = _interval_jacobian_compact(_A_of(D0, dof, g), _A_of(D, dof, g), h, integ)
        P = _sym(_mmt(_mm(F, P), F))
        for i in range(L):
            for j in range(L):
                P[i, j] += Qh[i, j]
    if not ok:
        return (2, e1, e2, e2, e2, G, x, P)
    yp, Hx = _measure_sensors(ids, q, qd, qdd, _part(x, nd, L), t, qe0, _rt(True), Rj, dqd_dz, D, nd)
    PHt, S = _ekf_innovation_cov_compact(P, Hx, rvar)
    return (0, yp, Hx, PHt, S, G, x, P)


@_jit
def _angle_flags(ids, t):
    """Which rows of the stacked readings of the sensors ``ids`` (SensorTable ``t``) are angles (inclinations,
    encoders: wrapped in innovations, IndependentFilter.angle_rows)."""
    rows = 0
    for a in range(ids.shape[0]):
        rows += t.dims[ids[a]]
    out = np.zeros(rows, np.bool_)
    row0 = 0
    for a in range(ids.shape[0]):
        kind = t.kind[ids[a]]
        if kind == INCLINATION or kind == ENCODER:
            out[row0 : row0 + t.dims[ids[a]]] = True
        row0 += t.dims[ids[a]]
    return out


@_jit
def _innovation(y, y_pred, angle):
    """e = y − y_pred with the rows flagged in ``angle`` wrapped to [−π, π) (IndependentFilter.innovation)."""
    e = _axpy(y, -1.0, y_pred)
    for r in range(e.shape[0]):
        if angle[r]:
            e[r] = wrap_angle(e[r])
    return e


@_jit
def _corrected(total, each, zr, e, xn, Pn, pt_adv, force, G, e0, tol, quad_res, max_newton, mf, mi, pt_new):
    """A fused update's result after its correction (x⁺, P⁺): (status, total NIS, NIS per sensor, standardised rows,
    innovation, x⁺, P⁺), the point of x⁺ found from the advanced mean's (``pt_adv``) and written to ``pt_new``;
    status ≠ 0 from that point (``pt_new`` not written: the caller finds it on the reference path)."""
    qe0, H, B, c, Hq, ang, angL, dof, M, Qg, DA, Dc = _model_views(mf, mi)
    n, m, g = M.shape[0], c.shape[0], dof.shape[0]
    z, q, _, _, _, R, Jm, _ = _point_views(pt_adv, n, m, g)
    st, qn, qdn, qddn, zddn, Rn, Jmn, res = _stage(xn, g, force, G, e0, z, q, R, Jm, tol, quad_res, max_newton, _rt(False),
                                                   qe0, H, B, c, Hq, ang, angL, dof, M, Qg, DA, Dc)
    if st == 0:
        _pack_point(pt_new, _part(xn, 0, g), qn, qdn, qddn, zddn, Rn, Jmn, res)
    return st, total, each, zr, e, xn, Pn


@_jit
def _ekf_update_finish(prep, pt_adv, y, angle, rvar, dims, gate, force, e0, tol, quad_res, max_newton, mf, mi, pt_new):
    """The rest of ModelKernels.ekf_update_prepare with the readings y (angles: the rows ``angle``), from
    :func:`_ekf_update_prepare`'s output ``prep`` and the advanced mean's point ``pt_adv``: the innovation, its NIS,
    the gate, the correction and the corrected state's point, see :func:`_corrected`."""
    st, yp, Hx, PHt, S, G, x, P = prep
    e1 = np.zeros(0)
    if st != 0:
        return st, 0.0, e1, e1, e1, e1, np.zeros((0, 0))
    e = _innovation(y, yp, angle)
    total, each, zr, passed = _gated_nis(e, S, dims, gate)
    if not passed:
        return 3, total, each, zr, e, e1, np.zeros((0, 0))
    xn, Pn = _ekf_correct_compact(x, P, Hx, PHt, S, e, rvar, np.arange(e.shape[0]))
    return _corrected(total, each, zr, e, xn, Pn, pt_adv, force, G, e0, tol, quad_res, max_newton, mf, mi, pt_new)


@_jit
def ukf_sigma_points(x, P, scale):
    """(sigma points (2L+1, L) of N(x, P): x, x ± the columns of chol(scale (P + jitter I)), ok): Merwe's
    points (UnscentedKalmanFilter.sigma_points), P symmetrised first, the jitter on the diagonal growing
    from 1e-12 of its largest entry while P is not positive definite; not ok after 8 tries."""
    L = x.shape[0]
    P = 0.5 * (P + P.T)
    big = 0.0
    for i in range(L):
        big = max(big, abs(P[i, i]))
    jitter = 0.0
    X = np.zeros((2 * L + 1, L))
    for _ in range(8):
        A = scale * (P + jitter * np.eye(L))
        try:
            S = np.linalg.cholesky(A)
        except Exception:  # not positive definite
            jitter = _next_jitter(jitter, big)
            continue
        X[0] = x
        X[1 : L + 1] = x + S.T
        X[L + 1 :] = x - S.T
        return X, True
    return X, False


@_jit
def _next_jitter(jitter, big):
    """The next diagonal jitter of :func:`ukf_sigma_points` after a failed Cholesky: 1e-12 of P's largest diagonal
    entry first, then ten times the last."""
    return 1e-12 * max(big, 1e-300) if jitter == 0.0 else 10 * jitter


@_jit
def _merwe_rows(x, S, X):
    """X's rows: x, then x + S's columns, then x − S's columns (Merwe's points from S Sᵀ = scale P), as loops."""
    L = x.shape[0]
    for k in range(L):
        X[0, k] = x[k]
    for j in range(L):
        for k in range(L):
            X[1 + j, k] = x[k] + S[k, j]
            X[1 + L + j, k] = x[k] - S[k, j]


@_jit
def _wrap_angle_rows(dY, e, angle):
    """The rows flagged in ``angle`` of the readings' deviations dY (columns) and of e, wrapped in place."""
    for r in range(angle.shape[0]):
        if angle[r]:
            for k in range(dY.shape[0]):
                dY[k, r] = wrap_angle(dY[k, r])
            e[r] = wrap_angle(e[r])


@_jit
def ukf_innovation(Y, wm, wc, angle, y, rvar):
    """(ȳ = Σ wm Y, dY = Y − ȳ, S = Σ wc dYᵀdY + diag(rvar), e = y − ȳ) of a UKF update from the sigma
    points' readings Y (rows), angles (rows flagged in ``angle``) wrapped to [−π, π) in dY and e
    (UnscentedKalmanFilter.update, IndependentFilter.innovation)."""
    ybar = wm @ Y
    dY = Y - ybar
    e = y - ybar
    _wrap_angle_rows(dY, e, angle)
    W = dY * wc.reshape((-1, 1))
    S = np.ascontiguousarray(W.T) @ dY
    for i in range(rvar.shape[0]):
        S[i, i] += rvar[i]
    return ybar, dY, S, e


@_jit
def ukf_correct(X, x, P, wc, dY, S, e, keep):
    """(x⁺, P⁺) of a UKF update with the rows ``keep`` of its innovation (the others gated): the cross
    covariance C = Σ wc (X − x)ᵀ dY, K = C S⁻¹, x⁺ = x + K e, P⁺ = P − K S Kᵀ, symmetrised."""
    k = keep.shape[0]
    dYk = np.zeros((dY.shape[0], k))
    Sk = np.zeros((k, k))
    ek = np.zeros(k)
    for a in range(k):
        i = keep[a]
        dYk[:, a] = dY[:, i]
        ek[a] = e[i]
        for b in range(k):
            Sk[a, b] = S[i, keep[b]]
    W = (X - x) * wc.reshape((-1, 1))
    K = (np.ascontiguousarray(W.T) @ dYk) @ _inverse_or_nan(Sk)
    Pn = P - (K @ Sk) @ np.ascontiguousarray(K.T)
    return x + K @ ek, 0.5 * (Pn + Pn.T)


@_jit
def ukf_covariance(Xn, wm, wc):
    """Σ wc (X⁺ − x̄)ᵀ(X⁺ − x̄) with x̄ = Σ wm X⁺: the covariance of the propagated sigma points."""
    d = Xn - wm @ Xn
    W = d * wc.reshape((-1, 1))
    return np.ascontiguousarray(W.T) @ d


@_jit
def _cholesky(A):
    """(the lower Cholesky factor of A, ok): not ok when a pivot is not positive (A not positive definite)."""
    L = A.shape[0]
    C = np.zeros((L, L))
    for j in range(L):
        d = A[j, j]
        for k in range(j):
            d -= C[j, k] * C[j, k]
        if not d > 0.0:
            return C, False
        cj = math.sqrt(d)
        C[j, j] = cj
        for i in range(j + 1, L):
            v = A[i, j]
            for k in range(j):
                v -= C[i, k] * C[j, k]
            C[i, j] = v / cj
    return C, True


@_jit
def _ukf_sigma_points_compact(x, P, scale):
    """:func:`ukf_sigma_points` as loops (:func:`_cholesky`)."""
    L = x.shape[0]
    P = _sym(P)
    big = 0.0
    for i in range(L):
        big = max(big, abs(P[i, i]))
    jitter = 0.0
    X = np.zeros((2 * L + 1, L))
    A = np.empty((L, L))
    for _ in range(8):
        for i in range(L):
            for j in range(L):
                A[i, j] = scale * (P[i, j] + (jitter if i == j else 0.0))
        S, ok = _cholesky(A)
        if not ok:
            jitter = _next_jitter(jitter, big)
            continue
        _merwe_rows(x, S, X)
        return X, True
    return X, False


@_jit
def _weighted_deviations(X, wm, wc):
    """(x̄ = Σ wm X, d = X − x̄, W = wc ⊙ d by rows) of points X (rows)."""
    N, L = X.shape
    xbar = np.zeros(L)
    for k in range(N):
        for j in range(L):
            xbar[j] += wm[k] * X[k, j]
    d, W = np.empty((N, L)), np.empty((N, L))
    for k in range(N):
        for j in range(L):
            d[k, j] = X[k, j] - xbar[j]
            W[k, j] = d[k, j] * wc[k]
    return xbar, d, W


@_jit
def _ukf_covariance_compact(Xn, wm, wc):
    """:func:`ukf_covariance` as loops."""
    _, d, W = _weighted_deviations(Xn, wm, wc)
    return _mtm(W, d)


@_jit
def _ukf_innovation_compact(Y, wm, wc, angle, y, rvar):
    """:func:`ukf_innovation` as loops."""
    ybar, dY, _ = _weighted_deviations(Y, wm, wc)
    e = _axpy(y, -1.0, ybar)
    _wrap_angle_rows(dY, e, angle)
    N, rows = dY.shape
    W = np.empty((N, rows))
    for k in range(N):
        for r in range(rows):
            W[k, r] = dY[k, r] * wc[k]
    S = _mtm(W, dY)
    for i in range(rvar.shape[0]):
        S[i, i] += rvar[i]
    return ybar, dY, S, e


@_jit
def _ukf_correct_compact(X, x, P, wc, dY, S, e, keep):
    """:func:`ukf_correct` as loops."""
    k, N, L = keep.shape[0], X.shape[0], x.shape[0]
    dYk = np.empty((N, k))
    for a in range(k):
        for r in range(N):
            dYk[r, a] = dY[r, keep[a]]
    Sk, ek = _kept_rows(S, e, keep)
    W = np.empty((N, L))
    for r in range(N):
        for j in range(L):
            W[r, j] = (X[r, j] - x[j]) * wc[r]
    K = _mm(_mtm(W, dYk), _inverse_or_nan_compact(Sk))
    KSK = _mmt(_mm(K, Sk), K)
    Pn = np.empty((L, L))
    for i in range(L):
        for j in range(L):
            Pn[i, j] = P[i, j] - KSK[i, j]
    return _axpy(x, 1.0, _mv(K, ek)), _sym(Pn)


@_jit
def _ukf_update_prepare(x, P, pt, ids, rvar, nd, wm, wc, scale, force, G, e0, t, tol, quad_res, max_newton, prop, x0, P0,
                        pt0, G_int, h, integ, Qh, h_mean, integ_mean, G0, T, mf, mi, pt_adv):
    """The part of ModelKernels.ukf_update_prepare that does not depend on the readings: the mean's transition (its
    point written to ``pt_adv``), the interval's propagation, the sigma points X of (x, P), their predicted readings'
    mean ȳ, deviations dY and S (variances ``rvar``).  Returns (status, ȳ, X, dY, S, G at the advanced point, the
    advanced mean x, the prior P); status 0, or ADVANCE_FAILED, 4, 5 or 6 as ModelKernels.ukf_update_prepare (ȳ … S
    empty).  Computed ahead of the update when its time is known (UnscentedKalmanFilter.prepare_call)."""
    qe0, H, B, c, Hq, ang, angL, dof, M, Qg, DA, Dc = _model_views(mf, mi)
    n, m, g = M.shape[0], c.shape[0], dof.shape[0]
    e1, e2 = np.zeros(0), np.zeros((0, 0))
    z, q, qd, qdd, zdd, R, Jm, res = _point_views(pt, n, m, g)
    st, x, z, q, qd, qdd, zdd, R, Jm, res, G = _advance_mean(h_mean, integ_mean, x, z, q, qd, qdd, zdd, R, Jm, res, g,
                                                            force, G, G0, T, e0, tol, quad_res, max_newton, qe0, H, B,
                                                            c, Hq, ang, angL, dof, M, Qg, DA, Dc)
    if st != 0:
        return (ADVANCE_FAILED, e1, e2, e2, e2, G, x, P)
    _pack_point(pt_adv, z, q, qd, qdd, zdd, R, Jm, res)
    if prop:
        X0, ok = _ukf_sigma_points_compact(x0, P0, scale)
        if not ok:
            return (5, e1, e2, e2, e2, G, x, P)
        z0, q0, qd0, _, zdd0, R0, Jm0, _ = _point_views(pt0, n, m, g)
        st, Xn = _filter_sigma_transitions(X0, x0, nd, h, integ, g, force, G_int, e0, z0, q0, qd0, R0, Jm0, zdd0,
                                           tol, quad_res, max_newton, qe0, H, B, c, Hq, ang, angL, dof, M, Qg, DA, Dc)
        if st != 0:
            return (4, e1, e2, e2, e2, G, x, P)
        P = _ukf_covariance_compact(Xn, wm, wc)
        for i in range(P.shape[0]):
            for j in range(P.shape[1]):
                P[i, j] += Qh[i, j]
    X, ok = _ukf_sigma_points_compact(x, P, scale)
    if not ok:
        return (5, e1, e2, e2, e2, G, x, P)
    st, Y = _filter_sigma_readings(X, x, nd, ids, g, force, G, e0, z, q, qd, qdd, R, Jm, tol, quad_res, max_newton, t, qe0,
                                   H, B, c, Hq, ang, angL, dof, M, Qg, DA, Dc)
    if st != 0:
        return (6, e1, e2, e2, e2, G, x, P)
    ybar, dY, S, _ = _ukf_innovation_compact(Y, wm, wc, _angle_flags(ids, t), np.zeros(Y.shape[1]), rvar)
    return (0, ybar, X, dY, S, G, x, P)


@_jit
def _ukf_update_finish(prep, pt_adv, y, angle, rvar, dims, gate, wc, force, e0, tol, quad_res, max_newton, mf, mi,
                       pt_new):
    """The rest of ModelKernels.ukf_update_prepare with the readings y (angles: the rows ``angle``), from
    :func:`_ukf_update_prepare`'s output ``prep`` and the advanced mean's point ``pt_adv``: the innovation e = y − ȳ,
    its NIS, the gate, the correction and the corrected state's point, see :func:`_corrected`."""
    st, ybar, X, dY, S, G, x, P = prep
    e1 = np.zeros(0)
    if st != 0:
        return st, 0.0, e1, e1, e1, e1, np.zeros((0, 0))
    e = _innovation(y, ybar, angle)
    total, each, zr, passed = _gated_nis(e, S, dims, gate)
    if not passed:
        return 3, total, each, zr, e, e1, np.zeros((0, 0))
    xn, Pn = _ukf_correct_compact(X, x, P, wc, dY, S, e, np.arange(e.shape[0]))
    return _corrected(total, each, zr, e, xn, Pn, pt_adv, force, G, e0, tol, quad_res, max_newton, mf, mi, pt_new)


#: the loop twin that stands for a numpy function when compiled: the same algebra the fused updates run, so compiled
#: code holds one version of it (not also the numpy function compiled with its LAPACK calls)
_TWINS = {interval_jacobian: _interval_jacobian_compact, block_nis: _block_nis_compact,
          ekf_innovation_cov: _ekf_innovation_cov_compact, ekf_correct: _ekf_correct_compact,
          ukf_sigma_points: _ukf_sigma_points_compact, ukf_covariance: _ukf_covariance_compact,
          ukf_innovation: _ukf_innovation_compact, ukf_correct: _ukf_correct_compact, gate_stats: _gate_stats_compact}


def compiled_or_python(fn, compiled: bool):
    """``fn`` compiled (its loop twin in :data:`_TWINS` where it has one), or its plain numpy function (the reference
    path: kernels off)."""
    return _TWINS.get(fn, fn) if compiled else getattr(fn, "py_func", fn)


@_jit
def _fd(q, qd, tau, qe0, H, B, c, Hq, ang, angL, M, Qg, DA, Dc):
    """(q̈, ok): Model.forward_dynamics (KKT form)."""
    n, m = q.shape[0], c.shape[0]
    Kinv, ok = _kkt_inverse(q, qe0, H, B, c, ang, angL, M)
    rhs = np.empty(n + m)
    rhs[:n] = _forces(q, qd, tau, qe0, Qg, DA, Dc)
    rhs[n:] = _gamma(q, qd, Hq, c.shape[0], ang, angL)
    return (Kinv @ rhs)[:n].copy(), ok


@_jit
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
    return _maxpy(M, 1.0, dM), Qe


@_jit
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


@_jit
def _fgs_accel(x, qe0, H, B, c, Hq, ang, angL, dof, M, Qg, DA, Dc, dMs, dQs):
    """(q̈, ok) at the smoother's x, without Jacobians (FixedLagSmoother._accel)."""
    q, qd, tau, Me = _fgs_forces_mass(x, dof, M, dMs, dQs)
    return _fd(q, qd, tau, qe0, H, B, c, Hq, ang, angL, Me, Qg, DA, Dc)


@_jit
def _fgs_dynamics(x, qe0, H, B, c, Hq, ang, angL, dof, M, Qg, DA, Dc, dMs, dQs):
    """(q̈, ∂q̈/∂x (n, len(x)), ok) at the smoother's x = [q, q̇, c, b, ε, p] with τ_dof = b − c ⊙ ż and
    the model's parameter errors ε (K = len(dQs)): M + Σ ε_k dMs[k], gravity forces + Σ ε_k dQs[k]
    (FixedLagSmoother._dynamics; the sensor parameters p do not enter the dynamics)."""
    n, g, K = M.shape[0], dof.shape[0], dQs.shape[0]
    q, qd, tau, Me = _fgs_forces_mass(x, dof, M, dMs, dQs)
    f, dq, dqd, dtau, ok = _fdjt(q, qd, tau, qe0, H, B, c, Hq, ang, angL, Me, Qg, DA, Dc)
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


@_jit
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


@_jit
def _fgs_step(xp, xc, has_prev, dt, fp, Fp, fc, Fc, Jp0, Jc0, want_jac, qe0, H, B, c, Hq, ang, angL, dof):
    """(e, J_prev, J_cur) of one step's dynamics rows: FixedLagSmoother._step_residual's reference
    (integrator rows of the DOF, position and velocity constraints, random walks of [c, b, p])."""
    n, m, g, dim = fc.shape[0], c.shape[0], dof.shape[0], xc.shape[0]
    q, qd = xc[:n].copy(), xc[n : 2 * n].copy()
    phi, Jq = _phi(q, qe0, H, B, c, ang, angL, True)
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
    Jc[2 * g + m : 2 * g + 2 * m, :n] = _hess_contract(q, qd, Hq, m, ang, angL)
    Jc[2 * g + m : 2 * g + 2 * m, n : 2 * n] = Jq
    return e, Jp, Jc


@_jit
def _smoother_model(x, g, e0, p0, dMs, dQs, M, dof):
    """(τ (n,), M(η) (n, n), gravity forces of η (n,)) of the independent smoother's x = [z, ż, c, b, η, p]: the
    DOF force τ = b − c ⊙ ż as the filters' (:func:`_filter_tau`), and :func:`_param_model` of η
    (IndependentSmoother._entry)."""
    n = M.shape[0]
    tau = _filter_tau(x, g, _rt(True), np.zeros((n, 0)), e0, dof, n)
    Me, Qe = _param_model(_part(x, e0, p0), M, dMs, dQs)
    return tau, Me, Qe


@_jit
def _smoother_point(x, zdd, dt, g, e0, p0, has_ref, ref_z, ref_q, ref_R, ref_Jm, q_guess, want_jac, dMs, dQs,
                    tol, quad_res, max_newton, qe0, H, B, c, Hq, ang, angL, dof, M, Qg, DA, Dc):
    """The independent smoother's model at its state x = [z, ż, c, b, η, p] in one call (IndependentSmoother._entry,
    and _jacobians if ``want_jac``), or (dt > 0) at x's Taylor step z + Δt ż + Δt²/2 z̈, ż + Δt z̈ with z̈ = ``zdd``
    (IndependentSmoother._predict: the guess for the next step): (status, x⁺ (x itself if dt = 0), q, q̇, q̈, z̈, R,
    Jm, residual, R, ∂q̇/∂z, ∂q̈/∂x).  The point of (z, ż) under the DOF force τ = b − c ⊙ ż and the model with
    parameter errors η, M(η) = M + Σ η_k dMs[k] and gravity forces + Σ η_k dQs[k] (:func:`_smoother_model`), by
    :func:`_point` from the reference point (or from ``q_guess`` without one); its state Jacobians are the filters'
    (:func:`_filter_jacobians`) with ∂q̈/∂η_k = ∂q̈/∂τ (dQs[k] − dMs[k] q̈).  Status as :func:`_point`, 3 when the
    state Jacobians are singular; the Jacobians empty unless ``want_jac`` and status 0."""
    if dt > 0.0:
        x = _part(x, 0, x.shape[0])
        h2 = 0.5 * dt * dt
        for i in range(g):
            x[i] += dt * x[g + i] + h2 * zdd[i]
            x[g + i] += dt * zdd[i]
    tau, Me, Qe = _smoother_model(x, g, e0, p0, dMs, dQs, M, dof)
    st, q, qd, qdd, zddn, R, Jm, res = _point_full(_part(x, 0, g), _part(x, g, 2 * g), _axpy(tau, 1.0, Qe), has_ref,
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
    x0 = _part(x, 0, x.shape[0])
    for k in range(K):  # η enters through M(η) and the gravity forces, not as a force G η
        x0[e0 + k] = 0.0
    Rj, dqd_dz, D, ok = _filter_jacobians(x0, q, qd, R, Jm, x.shape[0], g, _rt(True), G, e0, qe0, Hq, ang, angL, dof, Me,
                                          _axpy(Qg, 1.0, Qe), DA, Dc)
    if not ok:
        return 3, x, q, qd, qdd, zddn, R, Jm, res, e2, e2, e2
    return 0, x, q, qd, qdd, zddn, R, Jm, res, Rj, dqd_dz, D


@_jit
def _smoother_positions(X, g, e0, p0, ref_z, ref_q, ref_R, ref_Jm, dMs, dQs, tol, quad_res, max_newton, qe0, H,
                        B, c, Hq, ang, angL, dof, M, Qg, DA, Dc):
    """(status (N,), q (N, n), q̇ (N, n), and q̈, z̈, R, Jm, residual of the last row) of the independent smoother's
    states X (N, len(x)) (a chunk's estimates), each point found from the one before (the first from the reference
    point (z, q, R, Jm)) as :func:`_smoother_point` finds it; a row whose status ≠ 0 (as :func:`_point`) and the
    rows after it are left to the caller (the last row's terms are then zeros)."""
    N, n = X.shape[0], ref_q.shape[0]
    st = np.ones(N, np.int64)
    Q, QD = np.zeros((N, n)), np.zeros((N, n))
    qdd, zdd, R, Jm, res = np.zeros(n), np.zeros(g), np.zeros((n, g)), np.zeros((n, ref_Jm.shape[1])), 0.0
    rz, rq, rR, rJm = ref_z, ref_q, ref_R, ref_Jm
    for k in range(N):
        x = X[k]
        tau, Me, Qe = _smoother_model(x, g, e0, p0, dMs, dQs, M, dof)
        z = _part(x, 0, g)
        out = _point_full(z, _part(x, g, 2 * g), _axpy(tau, 1.0, Qe), _rt(True), rz, rq, rR, rJm, rq, tol, quad_res,
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


@_jit
def _smoother_step_rows(xp, xc, zdd_p, zdd_c, Dp, Dc_, dt, dof, J_prev0, J_cur0, want_jac):
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


def contiguous(*arrays: np.ndarray) -> tuple[np.ndarray, ...]:
    """C-contiguous float64 arrays for the kernels (a point from the reference path may hold views): one compiled
    signature, never a compilation inside a step."""
    return tuple(np.ascontiguousarray(a, dtype=np.float64) for a in arrays)


def _nonzeros(T: np.ndarray) -> np.ndarray:
    """The nonzeros of a constant array as rows (indices…, value): of a stack of Hessians (m, a, a) as
    (r, i, j, value) (nnz, 4), of a matrix (m, a) as (r, j, value) (nnz, 3).  A distance row's Hessian
    has 8, so evaluating Φ, Φ_q and the contractions costs O(m), not O(m·n²)."""
    idx = np.argwhere(T != 0.0)
    return np.ascontiguousarray(np.column_stack([idx.astype(np.float64), T[tuple(idx.T)]]).reshape(len(idx), T.ndim + 1))


class SensorTable(NamedTuple):
    """The sensors the compiled measurement model reads (:func:`_measure_sensors`), as arrays indexed by sensor
    (built by SensorParams.sensor_table; passed to the kernels whole).  Rows of other sensors hold zeros and −1.

    - ``kind`` (ns,): :data:`GYRO`, :data:`ACCELEROMETER`, :data:`INCLINATION`, :data:`ENCODER`,
      :data:`COMMAND_POSITION`, :data:`COMMAND_VELOCITY` or :data:`NOT_COMPILED` (the reference path); ``dims`` (ns,): its rows (3 for an IMU's gyro or accelerometer, 1
      for an angle);
    - the body-rate form A of its body (``rate_form`` (ns, ne, ne): ω = qeᵀ A q̇e, Model.body_rate) and its nonzeros
      (``rate_nz``: :func:`sparse_forms`): a gyro's, an inclination's (for its time offset);
    - a gyro's sensor axes' z components (``col`` (ns, 3));
    - an accelerometer's sensor axes' in-plane components (``axes2`` (ns, 3, 2), Accelerometer.A2) and its point's
      matrix (``point`` (ns, 2, ne): r = C qe, Model.point_matrix);
    - the qe indices (xi, yi, xj, yj) of the first two points of its body (``body_points`` (ns, 4)), which give
      the body's angle (Model.body_angle), and of the body an encoder is measured against (``relative_points``;
      −1: the ground); the coordinate an encoder reads when its angle is one, a drive command's (``coordinate``
      (ns,); −1: none);
      an inclination's mounting angle (``mount`` (ns,), rad);
    - the index into p of its IMU's time offset (``offset`` (ns,); −1: none), of each axis's bias (``bias``
      (ns, 3); −1: none) and of an accelerometer's residual mount angle (``mount_state`` (ns,); −1: none);
    - ``gravity`` (2,): the model's gravity (m/s², global frame)."""

    kind: np.ndarray
    dims: np.ndarray
    rate_form: np.ndarray
    rate_nz: np.ndarray
    col: np.ndarray
    axes2: np.ndarray
    point: np.ndarray
    body_points: np.ndarray
    relative_points: np.ndarray
    coordinate: np.ndarray
    mount: np.ndarray
    offset: np.ndarray
    bias: np.ndarray
    mount_state: np.ndarray
    gravity: np.ndarray

    @classmethod
    def empty(cls, ns: int, ne: int, gravity: np.ndarray) -> SensorTable:
        """A table of ``ns`` sensors, none of them compiled (yet)."""
        i64 = np.int64
        return cls(np.zeros(ns, i64), np.zeros(ns, i64), np.zeros((ns, ne, ne)), np.zeros((ns, 1, 3)),
                   np.zeros((ns, 3)), np.zeros((ns, 3, 2)), np.zeros((ns, 2, ne)), np.zeros((ns, 4), i64),
                   np.full((ns, 4), -1, i64), np.full(ns, -1, i64), np.zeros(ns), np.full(ns, -1, i64),
                   np.full((ns, 3), -1, i64), np.full(ns, -1, i64), np.ascontiguousarray(gravity, dtype=np.float64))

    def covers(self, i: int) -> bool:
        """Whether the compiled measurement model reads sensor i."""
        return bool(self.kind[i] != NOT_COMPILED)


class ModelKernels:
    """A model's arrays for the kernels, and the compiled replacements of its hot methods.

    :meth:`install` binds them as the model's instance attributes, so every caller of ``Model``
    (filters, smoother, sensors) runs compiled code; the class methods of
    :class:`~estimator_service.model.Model` stay the numpy reference (``Model.forward_dynamics(model, …)``).
    Only for square systems (m + g = n, no redundant constraints).
    """

    def __init__(self, model) -> None:
        f64 = np.float64
        self.model = model
        self.qe0 = np.ascontiguousarray(model._qe, dtype=f64)
        self.H = _nonzeros(model._H)
        self.B = _nonzeros(model._B)
        self.c = np.ascontiguousarray(model._c, dtype=f64)
        self.Hq = _nonzeros(model._Hq)
        self.ang = np.array([(a.row, a.theta, a.xa, a.ya, a.xb, a.yb) for a in model._angles],
                            dtype=np.int64).reshape(len(model._angles), 6)
        self.angL = np.array([a.length for a in model._angles], dtype=f64)
        self.dof = np.ascontiguousarray(model.dof, dtype=np.int64)
        self.M = np.ascontiguousarray(model.M, dtype=f64)
        self.Qg = np.ascontiguousarray(model._Q_gravity, dtype=f64)
        ne = model.ne
        self.DA = np.array([A for A, _ in model._dampers], dtype=f64).reshape(len(model._dampers), ne, ne)
        self.Dc = np.array([cc for _, cc in model._dampers], dtype=f64)
        self.mf, self.mi = self._model_buffers()
        #: entries of a point buffer (_point_views)
        self.point_size = 2 * model.g + 3 * model.n + model.n * model.g + model.n * model.m + 1
        self._zero_tau = np.zeros(model.n)
        self._empty = np.zeros((0, 0))
        self._empty1 = np.zeros(0)
        self.warmed: set[str] = set()  #: kinds compiled so far (:meth:`warm_up`)

    def _model_buffers(self) -> tuple[np.ndarray, np.ndarray]:
        """(mf, mi): the model's arrays in two buffers (:func:`_model_views`), for the flat entries."""
        floats = [self.qe0, self.H, self.B, self.c, self.Hq, self.angL, self.M, self.Qg, self.DA, self.Dc]
        assert len(floats) == _MODEL_FLOATS
        starts = np.cumsum([0] + [a.size for a in floats])
        head = [v for k, a in enumerate(floats) for v in (starts[k], a.size)]
        model = self.model
        counts = [model.n, self.qe0.size, model.m, model.g, len(self.H), len(self.B), len(self.Hq), len(self.ang),
                  len(self.DA)]
        mi = np.concatenate([np.array(head + counts, dtype=np.int64), self.ang.ravel(), self.dof]).astype(np.int64)
        return np.concatenate([a.ravel() for a in floats]).astype(np.float64), mi

    def point_buffer(self, pt) -> np.ndarray:
        """The point ``pt`` (z, q, q̇, q̈, z̈, R, Jm, residual) as one buffer (:func:`_point_views`): its own when it
        came from a flat entry, else packed once and kept on it."""
        buf = getattr(pt, "buf", None)
        if buf is None:
            buf = np.empty(self.point_size)
            _pack_point(buf, *contiguous(pt.z, pt.q, pt.qd, pt.qdd, pt.zdd, pt.R, pt.Jm), float(pt.residual))
            pt.buf = buf
        return buf

    def advance_flat(self, x: np.ndarray, h: float, integ: int, force: bool, G: np.ndarray, e0: int, pt,
                     force_terms: tuple, tol: float, quad_res: float, max_newton: int) -> tuple | None:
        """(x⁺, the buffer of its point, G⁺ (n, K) = G0 − T q̈ there): the filter mean's transition of h seconds
        from x with its point ``pt`` (z, q, q̇, q̈, z̈, R, Jm, residual) by the integrator ``integ``, the point it
        reaches and the parameter forces at it (:func:`_advance_mean`; ``force_terms`` = (G0, T)), by the flat
        entry :func:`_advance_flat`; None when it needs the reference path."""
        x_out, pt_out, G_out = np.empty(x.shape[0]), np.empty(self.point_size), np.empty(force_terms[0].shape)
        st = _advance_flat(h, integ, x, self.point_buffer(pt), force, G, e0, *force_terms, tol, quad_res, max_newton,
                           self.mf, self.mi, x_out, pt_out, G_out)
        return None if st != 0 else (x_out, pt_out, G_out)

    def _tau(self, tau: np.ndarray | None) -> np.ndarray:
        return self._zero_tau if tau is None else np.ascontiguousarray(tau, dtype=np.float64)

    def forward_dynamics_jac_tau(self, q: np.ndarray, qd: np.ndarray, tau: np.ndarray | None = None,
                                 M: np.ndarray | None = None) -> tuple:
        """Model.forward_dynamics_jac_tau, compiled."""
        qdd, dq, dqd, dtau, ok = _fdjt(np.ascontiguousarray(q, dtype=np.float64), np.ascontiguousarray(qd, dtype=np.float64),
                                       self._tau(tau), self.qe0, self.H, self.B, self.c, self.Hq, self.ang, self.angL,
                                       self.M if M is None else np.ascontiguousarray(M, dtype=np.float64),
                                       self.Qg, self.DA, self.Dc)
        if not ok:
            raise np.linalg.LinAlgError("singular KKT matrix (constraint Jacobian rank-deficient)")
        return qdd, dq, dqd, dtau

    def forward_dynamics(self, q: np.ndarray, qd: np.ndarray, tau: np.ndarray | None = None,
                         M: np.ndarray | None = None) -> np.ndarray:
        """Model.forward_dynamics, compiled."""
        qdd, ok = _fd(np.ascontiguousarray(q, dtype=np.float64), np.ascontiguousarray(qd, dtype=np.float64),
                      self._tau(tau), self.qe0, self.H, self.B, self.c, self.Hq, self.ang, self.angL,
                      self.M if M is None else np.ascontiguousarray(M, dtype=np.float64),
                      self.Qg, self.DA, self.Dc)
        if not ok:
            raise np.linalg.LinAlgError("singular KKT matrix (constraint Jacobian rank-deficient)")
        return qdd

    def fgs_dynamics(self, x: np.ndarray, dMs: np.ndarray, dQs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(q̈, ∂q̈/∂x) of the smoother's state x = [q, q̇, c, b, ε, p] (FixedLagSmoother._dynamics) with
        the parameter error directions ``dMs`` (K, n, n), ``dQs`` (K, n) of its ε."""
        f, F, ok = _fgs_dynamics(np.ascontiguousarray(x, dtype=np.float64), self.qe0, self.H, self.B, self.c, self.Hq,
                                 self.ang, self.angL, self.dof, self.M, self.Qg, self.DA, self.Dc, dMs, dQs)
        if not ok:
            raise np.linalg.LinAlgError("singular KKT matrix (constraint Jacobian rank-deficient)")
        return f, F

    def fgs_accel(self, x: np.ndarray, dMs: np.ndarray, dQs: np.ndarray) -> np.ndarray:
        """q̈ at the smoother's state x (FixedLagSmoother._accel), see :func:`_fgs_accel`."""
        f, ok = _fgs_accel(np.ascontiguousarray(x, dtype=np.float64), self.qe0, self.H, self.B, self.c, self.Hq,
                           self.ang, self.angL, self.dof, self.M, self.Qg, self.DA, self.Dc, dMs, dQs)
        if not ok:
            raise np.linalg.LinAlgError("singular KKT matrix (constraint Jacobian rank-deficient)")
        return f

    def fgs_step(self, xp: np.ndarray | None, xc: np.ndarray, dt: float, prev: tuple | None, cur: tuple,
                 J_prev0: np.ndarray, J_cur0: np.ndarray, want_jac: bool) -> tuple:
        """(e, J_prev or None, J_cur or None) of the smoother's dynamics rows (FixedLagSmoother._step_residual);
        ``prev`` and ``cur`` are :meth:`fgs_dynamics` of x_{k-1} (None at the first step) and x_k."""
        xc = np.ascontiguousarray(xc, dtype=np.float64)
        has_prev = xp is not None
        fp, Fp = prev if has_prev else cur
        e, Jp, Jc = _fgs_step(np.ascontiguousarray(xp, dtype=np.float64) if has_prev else xc, xc, has_prev, dt,
                              fp, Fp, cur[0], cur[1], J_prev0, J_cur0, want_jac, self.qe0, self.H, self.B, self.c,
                              self.Hq, self.ang, self.angL, self.dof)
        return e, (Jp if want_jac else None), (Jc if want_jac else None)

    def state_jacobians(self, q: np.ndarray, qd: np.ndarray, tau: np.ndarray | None = None,
                        M: np.ndarray | None = None):
        """Model.state_jacobians, compiled."""
        from estimator_service.model import StateJacobians

        *out, ok = _state_jacobians(np.ascontiguousarray(q, dtype=np.float64), np.ascontiguousarray(qd, dtype=np.float64),
                                    self._tau(tau), self.qe0, self.H, self.B, self.c, self.Hq, self.ang, self.angL,
                                    self.dof, self.M if M is None else np.ascontiguousarray(M, dtype=np.float64),
                                    self.Qg, self.DA, self.Dc)
        if not ok:
            raise np.linalg.LinAlgError("singular configuration (constraint Jacobian rank-deficient)")
        return StateJacobians(*out)

    def point(self, z: np.ndarray, zd: np.ndarray, tau: np.ndarray | None, ref_z: np.ndarray | None,
              ref_q: np.ndarray | None, ref_R: np.ndarray | None, ref_Jm: np.ndarray | None,
              q_guess: np.ndarray | None, tol: float, quad_res: float, max_newton: int,
              M: np.ndarray | None = None, light: bool = False) -> tuple:
        """(status, q, q̇, q̈, z̈, R, Jm, residual) of the manifold point: see :func:`_point`; ``M`` replaces
        the model's mass matrix (a model with parameter errors)."""
        has_ref = ref_z is not None
        z = np.ascontiguousarray(z, dtype=np.float64)
        zd = np.ascontiguousarray(zd, dtype=np.float64)
        if has_ref:
            ref_q, ref_z = np.ascontiguousarray(ref_q, dtype=np.float64), np.ascontiguousarray(ref_z, dtype=np.float64)
            ref_R, ref_Jm = np.ascontiguousarray(ref_R, dtype=np.float64), np.ascontiguousarray(ref_Jm, dtype=np.float64)
            guess = ref_q
        else:
            guess = np.ascontiguousarray(q_guess, dtype=np.float64)
            ref_z, ref_q, ref_R, ref_Jm = z, guess, self._empty, self._empty
        return _point(z, zd, self._tau(tau), has_ref, ref_z, ref_q, ref_R, ref_Jm, guess, tol, quad_res, max_newton,
                      light and has_ref, self.qe0, self.H, self.B, self.c, self.Hq, self.ang, self.angL, self.dof,
                      self.M if M is None else M, self.Qg, self.DA, self.Dc)

    def filter_transition(self, x: np.ndarray, h: float, integ: int, force: bool, G: np.ndarray, e0: int,
                          ref: tuple, want_point: bool, want_jac: bool, tol: float, quad_res: float,
                          max_newton: int) -> tuple:
        """(status, x⁺, F, q, q̇, q̈, z̈, R, Jm, residual): the filter's transition of h seconds, its Jacobian
        and the point of its result, see :func:`_filter_transition`; ``ref`` = (z, q, q̇, R, Jm, z̈) of x's point."""
        z0, q0, qd0, R0, Jm0, zdd0 = ref
        return _filter_transition(np.ascontiguousarray(x, dtype=np.float64), h, integ, self.dof.shape[0], force, G, e0,
                                  z0, q0, qd0, R0, Jm0, zdd0, want_point, want_jac, tol, quad_res, max_newton, self.qe0,
                                  self.H, self.B, self.c, self.Hq, self.ang, self.angL, self.dof, self.M, self.Qg,
                                  self.DA, self.Dc)

    def filter_sigma_transitions(self, X: np.ndarray, x0: np.ndarray, nd: int, h: float, integ: int, force: bool,
                                 G: np.ndarray, e0: int, ref: tuple, tol: float, quad_res: float,
                                 max_newton: int) -> tuple[int, np.ndarray]:
        """(status, X⁺): sigma points through the filter's mean transition, see :func:`_filter_sigma_transitions`;
        ``ref`` = (z, q, q̇, R, Jm, z̈) of x0's point."""
        z0, q0, qd0, R0, Jm0, zdd0 = ref
        return _filter_sigma_transitions(np.ascontiguousarray(X, dtype=np.float64),
                                         np.ascontiguousarray(x0, dtype=np.float64), nd, h, integ, self.dof.shape[0], force,
                                         G, e0, z0, q0, qd0, R0, Jm0, zdd0, tol, quad_res, max_newton, self.qe0, self.H,
                                         self.B, self.c, self.Hq, self.ang, self.angL, self.dof, self.M, self.Qg,
                                         self.DA, self.Dc)

    def filter_jacobians(self, x: np.ndarray, point: tuple, force: bool, G: np.ndarray, e0: int,
                         M: np.ndarray | None = None, Qg: np.ndarray | None = None) -> tuple:
        """(R, ∂q̇/∂z, ∂q̈/∂x, ok) of a filter state at its point ``point`` = (q, q̇, R, Jm), see
        :func:`_filter_jacobians`; ``M`` and ``Qg`` replace the model's mass matrix and gravity forces."""
        q, qd, R, Jm = point
        return _filter_jacobians(np.ascontiguousarray(x, dtype=np.float64), q, qd, R, Jm, x.shape[0],
                                 self.dof.shape[0], force, G, e0, self.qe0, self.Hq, self.ang, self.angL, self.dof,
                                 self.M if M is None else M, self.Qg if Qg is None else Qg, self.DA, self.Dc)

    def measure_sensors(self, ids: np.ndarray, q: np.ndarray, qd: np.ndarray, qdd: np.ndarray, p: np.ndarray, table,
                        jac: tuple | None, nd: int) -> tuple[np.ndarray, np.ndarray]:
        """(y, H or an empty array) of the sensors ``ids`` (SensorParams.sensor_table ``table``), see
        :func:`_measure_sensors`; ``jac`` = (R, ∂q̇/∂z, ∂q̈/∂x) for H, or None."""
        R, dqd_dz, D = jac if jac is not None else (self._empty, self._empty, self._empty)
        return _measure_sensors(ids, q, qd, qdd, np.ascontiguousarray(p, dtype=np.float64), table, self.qe0,
                                jac is not None, R, dqd_dz, D, nd)

    def smoother_point(self, x: np.ndarray, layout: tuple, ref: tuple | None, q_guess: np.ndarray, want_jac: bool,
                       terms: tuple, solver: tuple, step: tuple | None = None) -> tuple:
        """(status, x⁺, q, q̇, q̈, z̈, R, Jm, residual, R, ∂q̇/∂z, ∂q̈/∂x) of the independent smoother's state x, see
        :func:`_smoother_point`; ``layout`` = (g, e0, p0) of x, ``ref`` = (z, q, R, Jm) of the reference point
        or None (Newton from ``q_guess``), ``terms`` = (dMs (K, n, n), dQs (K, n)) of η, ``solver`` = (tol,
        quadratic residual, max Newton steps); ``step`` = (z̈, Δt): at x's Taylor step instead (x⁺)."""
        zdd, dt = (self._empty1, 0.0) if step is None else step
        if ref is None:
            e2 = self._empty
            ref, has_ref = (x[: layout[0]], q_guess, e2, e2), False
        else:
            has_ref = True
        return _smoother_point(x, zdd, dt, *layout, has_ref, *ref, q_guess, want_jac, *terms, *solver, self.qe0, self.H,
                               self.B, self.c, self.Hq, self.ang, self.angL, self.dof, self.M, self.Qg, self.DA, self.Dc)

    def smoother_positions(self, X: np.ndarray, layout: tuple, ref: tuple, terms: tuple, solver: tuple) -> tuple:
        """(status, q, q̇, and the last row's q̈, z̈, R, Jm, residual) of the independent smoother's states X (N, len(x)),
        see :func:`_smoother_positions`;
        ``ref`` = (z, q, R, Jm) of the point the first search starts from."""
        return _smoother_positions(np.ascontiguousarray(X, dtype=np.float64), *layout, *ref, *terms, *solver, self.qe0,
                                   self.H, self.B, self.c, self.Hq, self.ang, self.angL, self.dof, self.M, self.Qg,
                                   self.DA, self.Dc)

    def ekf_update_prepare(self, x: np.ndarray, P: np.ndarray, pt: np.ndarray, ids: np.ndarray, rvar: np.ndarray,
                           nd: int, force: bool, G: np.ndarray, e0: int, table, tol: float, quad_res: float,
                           max_newton: int, interval: tuple | None, advance: tuple) -> tuple:
        """The part of an EKF update with the sensors ``ids`` (SensorParams.sensor_table ``table``) that needs no
        readings (:func:`_ekf_update_prepare`); :meth:`ekf_update_finish` does the rest (IndependentFilter.fused_call:
        the two in a row; one compiled function for both would compile their call trees again, ~25 s on a fresh
        install).  ``pt`` is x's point as a buffer (:meth:`point_buffer`); ``rvar`` the readings' variances;
        ``interval`` = (x0, its point's buffer, G there, h, integrator code, process noise over h) of a covariance to
        propagate first (from x0's P), or None; ``advance`` = (h, integrator code, G0, T) of the mean's transition to
        the update's time (h = 0: none).

        In order: the mean's transition of h seconds to the update's time from x with its point, by the
        advance's integrator (:func:`_advance_mean`, G from G0 and T at the point reached); status
        ADVANCE_FAILED when it needs the reference path (nothing done).  With an interval, the covariance over
        it: P = sym(F P0 Fᵀ) + Qh with F from x0 to the advanced x (:func:`interval_jacobian`, Euler or Heun);
        status 4 when x0's Jacobian is singular (nothing else done).  Then H and the readings at the point of x
        (:func:`_filter_jacobians`, :func:`_measure_sensors`) and S; status 2 when x's Jacobian is singular.
        Returns (status, y_p, H, P Hᵀ, S, G, the advanced x, the propagated P, the buffer of the advanced x's
        point)."""
        pt_adv = np.empty(self.point_size)
        prop, x0, pt0, G_int, h, integ, Qh = self._interval_args(x, interval)
        return _ekf_update_prepare(np.ascontiguousarray(x, dtype=np.float64), P, pt, ids, rvar, nd, force, G, e0, table,
                                   tol, quad_res, max_newton, prop, x0, pt0, G_int, h, integ, Qh, *advance, self.mf,
                                   self.mi, pt_adv) + (pt_adv,)

    def ekf_update_finish(self, prepared: tuple, y: np.ndarray, angle: np.ndarray, rvar: np.ndarray, dims: np.ndarray,
                          gate: float, force: bool, e0: int, tol: float, quad_res: float, max_newton: int) -> tuple:
        """The rest of an EKF update from :meth:`ekf_update_prepare`'s output and the readings y (angles: the rows
        ``angle``; :func:`_ekf_update_finish`): the innovation e, the NIS of all rows and of each sensor (rows
        ``dims``), the standardised rows e_i/√S_ii; then, when every sensor passes the outlier gate (NIS ≤ ``gate`` ×
        its rows; gate 0: off), the Joseph-form correction with every row and the point of the corrected state found
        from the advanced mean's.  Returns (status, total NIS, NIS per sensor, standardised rows, e, x⁺, P⁺, the
        buffer of x⁺'s point): status 0 = corrected, 3 = a sensor failed the gate (not corrected: x⁺ and P⁺ empty;
        the caller gates and corrects), 1 or 2 from the corrected state's point (x⁺ and P⁺ given, the point not: the
        caller finds it on the reference path), else the prepared part's."""
        pt_new = np.empty(self.point_size)
        return _ekf_update_finish(prepared[:8], prepared[8], y, angle, rvar, dims, gate, force, e0, tol, quad_res,
                                  max_newton, self.mf, self.mi, pt_new) + (pt_new,)

    def ukf_update_prepare(self, x: np.ndarray, P: np.ndarray, pt: np.ndarray, ids: np.ndarray, rvar: np.ndarray,
                           nd: int, weights: tuple, force: bool, G: np.ndarray, e0: int, table, tol: float,
                           quad_res: float, max_newton: int, interval: tuple | None, advance: tuple) -> tuple:
        """The part of a UKF update with the sensors ``ids`` that needs no readings (:func:`_ukf_update_prepare`);
        :meth:`ukf_update_finish` does the rest, as :meth:`ekf_update_prepare`.  ``weights`` = (wm, wc, scale);
        ``interval`` = (x0, P0, its point's buffer, G there, h, integrator code, process noise over h) or None; the
        others as there.

        After the mean's transition: with an interval, the sigma points of (x0, P0) through the mean transition
        of its h seconds (:func:`_filter_sigma_transitions`), their covariance plus Qh.  Then the sigma points of
        (x, P) (Merwe's weights, spread ``scale``), their readings (:func:`_filter_sigma_readings`), ȳ, dY and S.
        Returns (status, ȳ, X, dY, S, G, the advanced x, the prior P, the buffer of the advanced x's point):
        status 0, 4 = the propagation needs the reference path (nothing done), 5 = a covariance not positive
        definite, 6 = a sigma point's reading needs the reference path (the propagation done), ADVANCE_FAILED as
        there."""
        pt_adv = np.empty(self.point_size)
        if interval is None:
            prop, x0, P0, pt0, G_int, h, integ, Qh = False, x, P, pt, G, 0.0, 0, self._empty
        else:
            prop, (x0, P0, pt0, G_int, h, integ, Qh) = True, interval
        return _ukf_update_prepare(np.ascontiguousarray(x, dtype=np.float64), P, pt, ids, rvar, nd, *weights, force, G,
                                   e0, table, tol, quad_res, max_newton, prop,
                                   np.ascontiguousarray(x0, dtype=np.float64), P0, pt0, G_int, h, integ, Qh, *advance,
                                   self.mf, self.mi, pt_adv) + (pt_adv,)

    def ukf_update_finish(self, prepared: tuple, y: np.ndarray, angle: np.ndarray, rvar: np.ndarray, dims: np.ndarray,
                          gate: float, wc: np.ndarray, force: bool, e0: int, tol: float, quad_res: float,
                          max_newton: int) -> tuple:
        """The rest of a UKF update (:func:`_ukf_update_finish`), as :meth:`ekf_update_finish`."""
        pt_new = np.empty(self.point_size)
        return _ukf_update_finish(prepared[:8], prepared[8], y, angle, rvar, dims, gate, wc, force, e0, tol, quad_res,
                                  max_newton, self.mf, self.mi, pt_new) + (pt_new,)

    def _interval_args(self, x: np.ndarray, interval: tuple | None) -> tuple:
        """(propagate, x0, its point's buffer, G there, h, integrator code, process noise) of the EKF's update
        kernels, from ``interval`` or, without one, placeholders of the same types."""
        if interval is None:
            return False, np.ascontiguousarray(x, dtype=np.float64), np.zeros(self.point_size), \
                np.zeros((self.model.n, 0)), 0.0, 0, self._empty
        x0, pt0, G_int, h, integ, Qh = interval
        return True, np.ascontiguousarray(x0, dtype=np.float64), pt0, G_int, h, integ, Qh

    def filter_sigma_readings(self, X: np.ndarray, x0: np.ndarray, nd: int, ids: np.ndarray, force: bool, G: np.ndarray,
                              e0: int, ref: tuple, tol: float, quad_res: float, max_newton: int, table) -> tuple:
        """(status, Y): the sensors ``ids`` read at each sigma point, see :func:`_filter_sigma_readings`;
        ``ref`` = (z, q, q̇, q̈, R, Jm) of x0's point."""
        z0, q0, qd0, qdd0, R0, Jm0 = ref
        return _filter_sigma_readings(np.ascontiguousarray(X, dtype=np.float64), np.ascontiguousarray(x0, dtype=np.float64),
                                      nd, ids, self.dof.shape[0], force, G, e0, z0, q0, qd0, qdd0, R0, Jm0, tol, quad_res,
                                      max_newton, table, self.qe0, self.H, self.B,
                                      self.c, self.Hq, self.ang, self.angL, self.dof, self.M, self.Qg, self.DA, self.Dc)

    def install(self) -> None:
        """Bind the compiled methods on the model (instance attributes shadow the numpy reference)."""
        model = self.model
        model.forward_dynamics_jac_tau = self.forward_dynamics_jac_tau
        model.forward_dynamics = self.forward_dynamics
        model.state_jacobians = self.state_jacobians
        model.kernels = self

    def _warm_up_table(self) -> SensorTable:
        """A table of one gyro that reads nothing (zero rate form), for :meth:`warm_up`: the measurement kernels'
        argument types."""
        table = SensorTable.empty(1, self.model.ne, self.model.gravity)
        table.kind[0], table.dims[0] = GYRO, 3
        return table

    def _start_helper(self, kind: str) -> subprocess.Popen | None:
        """A process compiling :meth:`warm_helper_part` of ``kind`` into numba's cache while this one compiles the point
        (:meth:`_warm_point`), or None: no part to hand over, one CPU, or the cache holds its kernels already
        (then loading them takes ~0.5 s: a helper would only cost its start-up)."""
        if kind not in HELPED_KINDS or (os.cpu_count() or 1) < 2 or not cache_is_cold(HELPED_KINDS[kind]):
            return None
        try:
            return subprocess.Popen([sys.executable, "-c", f"from estimator_service.kernels import warm_in_helper; "
                                     f"warm_in_helper({kind!r})"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        except OSError as exc:  # (compiled here instead)
            log.info("no helper process for the cold compile (%s)", exc)
            return None

    def warm_helper_part(self, kind: str) -> None:
        """The helper's part of a cold compile of ``kind`` (:data:`HELPED_KINDS`; argument types only: any model's
        kernels compile the same code), none of it inside the manifold point: the state Jacobians and the measurement
        model, which the independent smoother's point kernel and its sample factors call; for the filters also the
        update algebra and the model's forward-dynamics and state Jacobians (the state Jacobians first: the
        transition kernels need them soonest)."""
        model, k = self.model, self
        n, g, m = model.n, model.g, model.m
        q = np.ascontiguousarray(model.q0, dtype=np.float64)
        qd, R, Jm = np.zeros(n), np.zeros((n, g)), np.zeros((n, m))
        xf = np.concatenate([q[model.dof], np.zeros(3 * g + 1)])  # [z, ż, c, b, p], as warm_up's
        ids, table = np.zeros(1, np.int64), k._warm_up_table()
        k.filter_jacobians(xf, (q, qd, R, Jm), True, np.zeros((n, 0)), 4 * g)  # (the smoother's G has one column: same type)
        for jac in (None, (R, R, np.zeros((n, xf.size)))):
            k.measure_sensors(ids, q, qd, qd, xf[4 * g :], table, jac, 4 * g)
        if kind == "filter":
            self._warm_update_algebra(xf, ids)
            for f in (k.forward_dynamics_jac_tau, k.state_jacobians):
                try:
                    f(q, qd)
                except np.linalg.LinAlgError:
                    pass  # compiled; singular at this configuration

    def _warm_point(self, kind: str) -> None:
        """The manifold point of ``kind`` (its longest kernel, inside most others), compiled while the helper compiles
        its part: the filters' (``_point``, as :meth:`_warm_all` calls it first) or the independent smoother's."""
        model, k = self.model, self
        q = np.ascontiguousarray(model.q0, dtype=np.float64)
        z, zd, e2 = q[model.dof].copy(), np.zeros(model.g), np.zeros((0, 0))
        if kind == "filter":
            k.point(z, zd, None, None, None, None, None, q, 1e-10, 1e-7, 6)
        else:
            _point_full(z, zd, np.zeros(model.n), False, z, q, e2, e2, q, 1e-10, 1e-7, 6, k.qe0, k.H, k.B, k.c, k.Hq,
                        k.ang, k.angL, k.dof, k.M, k.Qg, k.DA, k.Dc)

    @staticmethod
    def _warm_update_algebra(xf: np.ndarray, ids: np.ndarray) -> tuple:
        """The filters' update algebra in loop form (compiled_or_python's _TWINS), the EKF's and the UKF's, at a
        filter state ``xf`` with one reading: returns (P, e, UKF weights) for the update kernels' warm-up."""
        P, Hm, e = np.eye(xf.size), np.ones((1, xf.size)), np.ones(1)
        _interval_jacobian_compact(P, P, 1e-3, INTEGRATOR_CODES["heun"])
        PHt, S = _ekf_innovation_cov_compact(P, Hm, e)
        _block_nis_compact(e, S, ids + 1)
        _ekf_correct_compact(xf, P, Hm, PHt, S, e, e, ids)
        X, _ = _ukf_sigma_points_compact(xf, P, 1.0)
        w = np.full(X.shape[0], 1.0 / X.shape[0])
        _ukf_covariance_compact(X, w, w)
        Y = X[:, :1].copy()
        _, dY, S1, e1 = _ukf_innovation_compact(Y, w, w, np.zeros(1, np.bool_), e, e)
        _ukf_correct_compact(X, xf, P, w, dY, S1, e1, ids)
        return P, e, w

    def warm_up(self, kind: str) -> None:
        """Call the kernels of ``kind`` (:data:`KINDS`) once at the initial configuration: compiled (or
        loaded from numba's cache) here, at start-up, never inside a time step; on a cold cache with a helper
        process (:meth:`_start_helper`)."""
        if kind in self.warmed:
            return
        helper = self._start_helper(kind)
        try:
            if helper is not None:  # the point here meanwhile; the rest then loads the helper's part
                self._warm_point(kind)
                _join_helper(helper)
            self._warm_all(kind)
        finally:
            if helper is not None:  # (ended by now, unless this process was interrupted or the helper overran)
                helper.kill()
                helper.wait()
        self.warmed.add(kind)

    def _warm_all(self, kind: str) -> None:
        """:meth:`warm_up`'s calls (each compiles, or loads what numba's cache holds)."""
        model = self.model
        q = np.ascontiguousarray(model.q0, dtype=np.float64)
        z, zd, qd = q[model.dof].copy(), np.zeros(model.g), np.zeros(model.n)
        x = np.concatenate([q, qd, np.zeros(2 * model.g)])
        if kind in ("filter", "manifold"):
            xf = np.concatenate([z, zd, np.zeros(2 * model.g + 1)])  # the x layout [z, ż, c, b, p] with one parameter
            G = np.zeros((model.n, 0))
            ids, table = np.zeros(1, np.int64), self._warm_up_table()
            if kind == "filter":
                status, q1, _, _, _, R, Jm, _ = self.point(z, zd, None, None, None, None, None, q, 1e-10, 1e-7, 6)
                if status == 0:  # both signatures (from a guess, from a reference point), the state Jacobians
                    self.point(z, zd, None, z, q1, R, Jm, None, 1e-10, 1e-7, 6)
                    self.filter_jacobians(xf, (q1, qd, R, Jm), True, G, 4 * model.g)
            else:  # the independent smoother's model at a state (the point and state Jacobians inside: one η)
                layout, solver = (model.g, 4 * model.g, 4 * model.g + 1), (1e-10, 1e-7, 6)
                terms = (np.zeros((1, model.n, model.n)), np.zeros((1, model.n)))
                out = self.smoother_point(xf, layout, None, q, True, terms, solver)
                status, q1, R, Jm = out[0], out[2], out[6], out[7]
                if status == 0:  # from a reference point at a Taylor step, a chunk's positions, a step's rows
                    self.smoother_point(xf, layout, (z, q1, R, Jm), q1, True, terms, solver, (zd, 1e-3))
                    self.smoother_positions(np.vstack([xf, xf]), layout, (z, q1, R, Jm), terms, solver)
                    J0 = np.zeros((xf.size, xf.size))
                    _smoother_step_rows(xf, xf, zd, zd, out[11], out[11], 1e-3, self.dof, J0, J0, True)
            calls = [(self.forward_dynamics_jac_tau, (q, qd)), (self.state_jacobians, (q, qd))] if kind == "filter" else []
            if status == 0:  # the measurement model, with and without H
                for jac in (None, (R, R, np.zeros((model.n, xf.size)))):
                    self.measure_sensors(ids, q1, qd, qd, xf[4 * model.g :], table, jac, 4 * model.g)
            if status == 0 and kind == "filter":  # the transitions and the update's algebra
                ref = (z, q1, qd, R, Jm, np.zeros(model.g))
                self.filter_transition(xf, 1e-3, INTEGRATOR_CODES["heun"], True, G, 4 * model.g, ref, True, True,
                                       1e-10, 1e-7, 6)
                start = SimpleNamespace(z=z, q=q1, qd=qd, qdd=qd, zdd=np.zeros(model.g), R=R, Jm=Jm, residual=0.0)
                self.advance_flat(xf, 1e-3, INTEGRATOR_CODES["heun"], True, G, 4 * model.g, start,
                                  (G, np.zeros((model.n, 0, model.n))), 1e-10, 1e-7, 6)
                self.filter_sigma_transitions(np.vstack([xf, xf]), xf, 4 * model.g, 1e-3, INTEGRATOR_CODES["heun"], True,
                                              G, 4 * model.g, ref, 1e-10, 1e-7, 6)
                self.filter_sigma_readings(np.vstack([xf, xf]), xf, 4 * model.g, ids, True, G, 4 * model.g,
                                        (z, q1, qd, qd, R, Jm), 1e-10, 1e-7, 6, table)
                P, e, w = self._warm_update_algebra(xf, ids)
                # the mean's transition to the update's time: (h, integrator, G0, T); the point as a buffer
                advance = (1e-3, INTEGRATOR_CODES["heun"], G, np.zeros((model.n, 0, model.n)))
                pt = self.point_buffer(start)
                for interval in (None, (xf, pt, G, 1e-3, INTEGRATOR_CODES["heun"], P)):
                    prepared = self.ekf_update_prepare(xf, P, pt, ids, np.ones(3), 4 * model.g,
                                                       True, G, 4 * model.g, table, 1e-10, 1e-7, 6, interval, advance)
                    self.ekf_update_finish(prepared, np.zeros(3), np.zeros(3, np.bool_), np.ones(3), ids + 3, 30.0,
                                           True, 4 * model.g, 1e-10, 1e-7, 6)
                for interval in (None, (xf, P, pt, G, 1e-3, INTEGRATOR_CODES["heun"], P)):
                    prepared = self.ukf_update_prepare(xf, P, pt, ids, np.ones(3), 4 * model.g,
                                                       (w, w, 1.0), True, G, 4 * model.g, table, 1e-10, 1e-7, 6,
                                                       interval, advance)
                    self.ukf_update_finish(prepared, np.zeros(3), np.zeros(3, np.bool_), np.ones(3), ids + 3, 30.0, w,
                                           True, 4 * model.g, 1e-10, 1e-7, 6)
        else:
            no_params = (np.zeros((0, model.n, model.n)), np.zeros((0, model.n)))  # no ε: same compiled types
            calls = [(self.forward_dynamics, (q, qd)), (self.fgs_dynamics, (x, *no_params)), (self.fgs_accel, (x, *no_params))]
        for f, args in calls:
            try:
                f(*args)
            except np.linalg.LinAlgError:
                pass  # compiled; singular at this configuration
        if kind in ("smoother", "manifold"):  # the gate's statistics of a sample
            _gate_stats_compact(np.ones(1), np.ones((1, 2)), np.eye(2), np.ones(1))  # (compiled_or_python's _TWINS)
        if kind == "smoother":
            try:
                cur = self.fgs_dynamics(x, *no_params)
                J0 = np.zeros((4 * model.g + 2 * model.m, len(x)))
                self.fgs_step(x, x, 1e-3, cur, cur, J0, J0, True)
            except np.linalg.LinAlgError:
                pass
            # the measurement factors' and the gate's model, with and without H over x = [q, q̇, …]
            ids, table, n = np.zeros(1, np.int64), self._warm_up_table(), model.n
            for jac in (None, (np.eye(n), np.zeros((n, n)), np.zeros((n, x.size)))):
                self.measure_sensors(ids, q, qd, qd, x[2 * model.n :], table, jac, 2 * model.n)


#: the kinds (:data:`KINDS`) whose cold compile a helper process shares (ModelKernels._start_helper), each with the
#: kernel whose absence from numba's cache means a cold compile of the kind
HELPED_KINDS = {"manifold": _smoother_point, "filter": _advance_flat}


def cache_is_cold(dispatcher=None) -> bool:
    """Whether numba's cache holds nothing for ``dispatcher`` (default: the manifold point, which every backend uses)
    for this source and numba version: the next start compiles.  False when kernels are off or that cannot be told."""
    if not enabled():
        return False
    try:
        return not (dispatcher or _position)._cache._cache_file._load_index()
    except Exception:  # (numba's cache internals: a changed layout means "don't know", nothing worse)
        return False


def _join_helper(helper: subprocess.Popen) -> None:
    """Wait for the helper process: its part is in numba's cache then (unless it failed: compiled here instead).
    One that outlives :data:`COLD_START_TIMEOUT_S` is left to ModelKernels.warm_up, which stops it."""
    try:
        helper.wait(timeout=COLD_START_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        log.warning("the kernels' helper process took over %g s; stopped", COLD_START_TIMEOUT_S)


def warm_in_helper(kind: str) -> None:
    """The helper process's work (ModelKernels._start_helper): :meth:`ModelKernels.warm_helper_part` of ``kind`` on the
    shipped rig's model."""
    from estimator_service.paths import default_rig
    from estimator_service.rig import load_rig

    ModelKernels(load_rig(str(default_rig())).model).warm_helper_part(kind)


#: which kernels a backend uses: the filters' (manifold point, state Jacobians, transitions, update algebra),
#: the dependent-coordinate smoother's, or the independent one's ("manifold": the point, the filters' state
#: Jacobians and measurement model only)
KINDS = ("filter", "smoother", "manifold")


def compile_model(model, kind: str) -> ModelKernels | None:
    """Compile (or load from the cache) the kernels of ``kind`` (:data:`KINDS`) for ``model`` and
    install them; returns them, or None when kernels are off (:func:`enabled`), the constraint system
    is not square, or compiling failed on this machine (the numpy reference is kept).  Idempotent."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    k = getattr(model, "kernels", None)
    if k is None:
        if not enabled() or model.m + model.g != model.n:
                return None
        k = ModelKernels(model)
    try:
        k.warm_up(kind)
    except Exception as exc:  # a numba or LLVM failure on this machine: the numpy path still works
        log.warning("compiled kernels unavailable (%s: %s); using the numpy reference path", type(exc).__name__, exc)
        return None
    k.install()
    return k

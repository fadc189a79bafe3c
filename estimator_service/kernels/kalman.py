"""The EKF's and UKF's update algebra, the NIS and the outlier gate (no model in this module).

Each public function here is written in numpy and is itself the numpy reference (``compiled_or_python(fn, False)``
gives its plain Python function: the reference path); compiled, it stands for its loop twin (``_*_compact``, the same
algebra as loops, :data:`_TWINS`), which the fused updates (fused_update.py) run too.  tests/test_kernels.py compares
each pair.  The innovation e and its covariance S are in the readings' units; x and P in the filter state's.

Their callers: ``IndependentFilter.sensor_nis`` (estimator_service/backends/filter.py), ``ExtendedKalmanFilter``
(backends/ekf.py: ``ekf_innovation_cov``, ``ekf_correct``, ``interval_jacobian``), ``UnscentedKalmanFilter``
(backends/ukf.py: ``ukf_*``) and ``FixedLagSmoother._gate`` (backends/fgs.py: ``gate_stats``).
"""

from __future__ import annotations

import math

import numpy as np

from estimator_service.angles import wrap_angle
from estimator_service.kernels.jit import kernel
from estimator_service.kernels.linalg import (axpy, cholesky, dot, inverse_or_nan, inverse_or_nan_compact, mm,
                                              mmt, mtm, mv, part, sym)


#: :func:`interval_jacobian`'s codes beyond the integrators' (transition.INTEGRATOR_CODES): the error-state EKF's
#: transition Φ = I + h A_e linearised at the interval's end (backends/errekf.py, ``error_model``): "linearised"
#: A_e = A; "kinematic" A_e = A without ∂z̈/∂(z, ż) (the fused update, fused_update.ekf_update_prepare, leaves those
#: out of A before it calls; :func:`interval_jacobian` treats both codes alike)
AT_END, AT_END_KINEMATIC = 3, 4
ERROR_MODEL_CODES = {"linearised": AT_END, "kinematic": AT_END_KINEMATIC}


@kernel
def block_nis(e, S, dims):
    """(eᵀS⁻¹e of all rows, the same of each block of consecutive rows of sizes ``dims`` against its own
    diagonal block of S): the filters' NIS of an update and of each sensor in it (IndependentFilter.update).
    A NaN in e gives NaN (the gate rejects it), as with numpy: S is inverted, never solved against e."""
    total = e @ mv(inverse_or_nan(S), e)
    each = np.zeros(dims.shape[0])
    r = 0
    for i in range(dims.shape[0]):
        d = dims[i]
        eb = np.ascontiguousarray(e[r : r + d])
        each[i] = eb @ mv(inverse_or_nan(np.ascontiguousarray(S[r : r + d, r : r + d])), eb)
        r += d
    return total, each


@kernel
def ekf_innovation_cov(P, H, rvar):
    """(P Hᵀ, S = H P Hᵀ + diag(rvar)) of an EKF update (measurement variances ``rvar``)."""
    PHt = P @ np.ascontiguousarray(H.T)
    S = H @ PHt
    for i in range(rvar.shape[0]):
        S[i, i] += rvar[i]
    return PHt, S


@kernel
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
    K = PHtk @ inverse_or_nan(Sk)
    xn = x + K @ ek
    IKH = np.eye(L) - K @ Hk
    Pn = IKH @ P @ np.ascontiguousarray(IKH.T) + (K * rk) @ np.ascontiguousarray(K.T)
    return xn, 0.5 * (Pn + Pn.T)


# The fused updates' algebra as loops (see the note at mv); compiled, they are the step-by-step path's too
# (compiled_or_python), and the functions above, uncompiled, the numpy reference; tests/test_kernels.py compares
# each pair.


@kernel
def block_nis_compact(e, S, dims):
    """:func:`block_nis` as loops."""
    total = dot(e, mv(inverse_or_nan_compact(S), e))
    each = np.zeros(dims.shape[0])
    r = 0
    for i in range(dims.shape[0]):
        d = dims[i]
        Sb = np.empty((d, d))
        for a in range(d):
            for b in range(d):
                Sb[a, b] = S[r + a, r + b]
        eb = part(e, r, r + d)
        each[i] = dot(eb, mv(inverse_or_nan_compact(Sb), eb))
        r += d
    return total, each


@kernel
def ekf_innovation_cov_compact(P, H, rvar):
    """:func:`ekf_innovation_cov` as loops."""
    PHt = mmt(P, H)
    S = mm(H, PHt)
    for i in range(rvar.shape[0]):
        S[i, i] += rvar[i]
    return PHt, S


@kernel
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


@kernel
def ekf_correct_compact(x, P, H, PHt, S, e, rvar, keep):
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
    K = mm(PHtk, inverse_or_nan_compact(Sk))
    xn = axpy(x, 1.0, mv(K, ek))
    IKH = mm(K, Hk)
    for i in range(L):
        for j in range(L):
            IKH[i, j] = (1.0 if i == j else 0.0) - IKH[i, j]
    Pn = mmt(mm(IKH, P), IKH)
    Kr = np.empty((L, k))
    for i in range(L):
        for a in range(k):
            Kr[i, a] = K[i, a] * rvar[keep[a]]
    KrK = mmt(Kr, K)
    for i in range(L):
        for j in range(L):
            Pn[i, j] += KrK[i, j]
    return xn, sym(Pn)


@kernel
def gate_stats(e, H, P, sigma):
    """(largest |e_i|/σ_i, eᵀS⁻¹e, standardised rows e_i/√S_ii) of a sample's residual e with row sigmas σ and
    covariance S = H P Hᵀ + diag(σ²) against the smoother's prediction (FixedLagSmoother._gate)."""
    S = H @ P @ np.ascontiguousarray(H.T)
    worst = 0.0
    for i in range(sigma.shape[0]):
        S[i, i] += sigma[i] * sigma[i]
        worst = max(worst, abs(e[i]) / sigma[i])
    return worst, e @ np.linalg.solve(S, e), e / np.sqrt(np.diag(S))


@kernel
def gate_stats_compact(e, H, P, sigma):
    """:func:`gate_stats` as loops (S inverted by :func:`eliminate`, no LAPACK: compiled in a fraction of the time)."""
    S = mm(H, mmt(P, H))
    worst = 0.0
    for i in range(sigma.shape[0]):
        S[i, i] += sigma[i] * sigma[i]
        worst = max(worst, abs(e[i]) / sigma[i])
    zr = np.empty(e.shape[0])
    for i in range(e.shape[0]):
        zr[i] = e[i] / math.sqrt(S[i, i])
    return worst, dot(e, mv(inverse_or_nan_compact(S), e)), zr


@kernel
def gated_nis(e, S, dims, gate):
    """(total NIS, NIS per sensor (rows ``dims``), standardised rows e_i/√S_ii, whether every sensor passes
    the outlier gate: its NIS ≤ ``gate`` × its rows; gate 0: off) of an update's innovation e with
    covariance S: the fused updates' share of IndependentFilter.sensor_nis and gate_and_record."""
    total, each = block_nis_compact(e, S, dims)
    zr = np.empty(e.shape[0])
    for i in range(e.shape[0]):
        zr[i] = e[i] / math.sqrt(S[i, i])
    passed = True
    for i in range(dims.shape[0]):
        if gate > 0 and not each[i] <= gate * dims[i]:
            passed = False
    return total, each, zr, passed


@kernel
def innovation(y, y_pred, angle):
    """e = y − y_pred with the rows flagged in ``angle`` wrapped to [−π, π) (IndependentFilter.innovation)."""
    e = axpy(y, -1.0, y_pred)
    for r in range(e.shape[0]):
        if angle[r]:
            e[r] = wrap_angle(e[r])
    return e


@kernel
def interval_jacobian(A0, A1, h, integ):
    """F (L, L) of a covariance interval of h seconds (ExtendedKalmanFilter.covariance_over) from A = ∂ẋ/∂x
    at its start (A0) and at the mean at its end (A1), by the integrator ``integ`` (INTEGRATOR_CODES; not
    RK4): Euler I + h A0; Heun's form I + h/2 (A0 + A1 (I + h A0)), its second stage at the interval's
    actual end (where the mean's 1 ms steps took it) rather than at the Euler predictor x0 + h ẋ0; with
    :data:`AT_END` (or :data:`AT_END_KINEMATIC`), I + h A1: the error-state EKF's Φ (ErrorStateKalmanFilter)."""
    L = A0.shape[0]
    F = h * (A1 if integ >= AT_END else A0)
    if integ == 1:
        F = 0.5 * (F + h * (A1 + h * (A1 @ A0)))
    for i in range(L):
        F[i, i] += 1.0
    return F


@kernel
def interval_jacobian_compact(A0, A1, h, integ):
    """:func:`interval_jacobian` as loops (the fused EKF update's; tests/test_kernels.py compares the two)."""
    L = A0.shape[0]
    F = np.empty((L, L))
    AA = mm(A1, A0) if integ == 1 else A0
    Af = A1 if integ >= AT_END else A0
    for i in range(L):
        for j in range(L):
            F[i, j] = h * Af[i, j]
            if integ == 1:
                F[i, j] = 0.5 * (F[i, j] + h * (A1[i, j] + h * AA[i, j]))
        F[i, i] += 1.0
    return F


@kernel
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


@kernel
def _next_jitter(jitter, big):
    """The next diagonal jitter of :func:`ukf_sigma_points` after a failed Cholesky: 1e-12 of P's largest diagonal
    entry first, then ten times the last."""
    return 1e-12 * max(big, 1e-300) if jitter == 0.0 else 10 * jitter


@kernel
def _merwe_rows(x, S, X):
    """X's rows: x, then x + S's columns, then x − S's columns (Merwe's points from S Sᵀ = scale P), as loops."""
    L = x.shape[0]
    for k in range(L):
        X[0, k] = x[k]
    for j in range(L):
        for k in range(L):
            X[1 + j, k] = x[k] + S[k, j]
            X[1 + L + j, k] = x[k] - S[k, j]


@kernel
def _wrap_angle_rows(dY, e, angle):
    """The rows flagged in ``angle`` of the readings' deviations dY (columns) and of e, wrapped in place."""
    for r in range(angle.shape[0]):
        if angle[r]:
            for k in range(dY.shape[0]):
                dY[k, r] = wrap_angle(dY[k, r])
            e[r] = wrap_angle(e[r])


@kernel
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


@kernel
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
    K = (np.ascontiguousarray(W.T) @ dYk) @ inverse_or_nan(Sk)
    Pn = P - (K @ Sk) @ np.ascontiguousarray(K.T)
    return x + K @ ek, 0.5 * (Pn + Pn.T)


@kernel
def ukf_covariance(Xn, wm, wc):
    """Σ wc (X⁺ − x̄)ᵀ(X⁺ − x̄) with x̄ = Σ wm X⁺: the covariance of the propagated sigma points."""
    d = Xn - wm @ Xn
    W = d * wc.reshape((-1, 1))
    return np.ascontiguousarray(W.T) @ d


@kernel
def ukf_sigma_points_compact(x, P, scale):
    """:func:`ukf_sigma_points` as loops (:func:`cholesky`)."""
    L = x.shape[0]
    P = sym(P)
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
        S, ok = cholesky(A)
        if not ok:
            jitter = _next_jitter(jitter, big)
            continue
        _merwe_rows(x, S, X)
        return X, True
    return X, False


@kernel
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


@kernel
def ukf_covariance_compact(Xn, wm, wc):
    """:func:`ukf_covariance` as loops."""
    _, d, W = _weighted_deviations(Xn, wm, wc)
    return mtm(W, d)


@kernel
def ukf_innovation_compact(Y, wm, wc, angle, y, rvar):
    """:func:`ukf_innovation` as loops."""
    ybar, dY, _ = _weighted_deviations(Y, wm, wc)
    e = axpy(y, -1.0, ybar)
    _wrap_angle_rows(dY, e, angle)
    N, rows = dY.shape
    W = np.empty((N, rows))
    for k in range(N):
        for r in range(rows):
            W[k, r] = dY[k, r] * wc[k]
    S = mtm(W, dY)
    for i in range(rvar.shape[0]):
        S[i, i] += rvar[i]
    return ybar, dY, S, e


@kernel
def ukf_correct_compact(X, x, P, wc, dY, S, e, keep):
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
    K = mm(mtm(W, dYk), inverse_or_nan_compact(Sk))
    KSK = mmt(mm(K, Sk), K)
    Pn = np.empty((L, L))
    for i in range(L):
        for j in range(L):
            Pn[i, j] = P[i, j] - KSK[i, j]
    return axpy(x, 1.0, mv(K, ek)), sym(Pn)


#: the loop twin that stands for a numpy function when compiled: the same algebra the fused updates run, so compiled
#: code holds one version of it (not also the numpy function compiled with its LAPACK calls)
_TWINS = {interval_jacobian: interval_jacobian_compact, block_nis: block_nis_compact,
          ekf_innovation_cov: ekf_innovation_cov_compact, ekf_correct: ekf_correct_compact,
          ukf_sigma_points: ukf_sigma_points_compact, ukf_covariance: ukf_covariance_compact,
          ukf_innovation: ukf_innovation_compact, ukf_correct: ukf_correct_compact, gate_stats: gate_stats_compact}


def compiled_or_python(fn, compiled: bool):
    """``fn`` compiled (its loop twin in :data:`_TWINS` where it has one), or its plain numpy function (the reference
    path: kernels off)."""
    return _TWINS.get(fn, fn) if compiled else getattr(fn, "py_func", fn)

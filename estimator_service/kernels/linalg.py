"""Small dense linear algebra as loops, for the kernels (numba; no model in this module).

Products (:func:`mv`, :func:`mm` and their transposed forms), copies of parts (:func:`cols`, :func:`part`),
vector and matrix updates (:func:`axpy`, :func:`maxpy`, :func:`eye_plus`, :func:`sym`), inversion by
Gauss-Jordan elimination (:func:`eliminate`, :func:`inverse`; LAPACK beyond ``SMALL_N`` rows) and a Cholesky
factor (:func:`cholesky`).  Unitless: they serve every array of the other modules.  Their numpy reference is
numpy itself (``@``, ``numpy.linalg.inv``, ``numpy.linalg.cholesky``): tests/test_kernels.py compares the kernels
built on them with the numpy reference path, and the Kalman algebra's loop twins (kalman.py) with the numpy
functions beside them.
"""

from __future__ import annotations

import math

import numpy as np

from estimator_service.kernels.jit import kernel


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


@kernel
def _blas_mm(A, B):
    """A B by BLAS (any layouts: copied to C order first)."""
    return np.ascontiguousarray(A) @ np.ascontiguousarray(B)


@kernel
def _blas_mv(A, x):
    """A x by BLAS (any layout: copied to C order first)."""
    return np.ascontiguousarray(A) @ np.ascontiguousarray(x)


@kernel
def mv(A, x):
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


@kernel
def mtv(A, x):
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


@kernel
def dot(a, b):
    """aᵀ b of two vectors."""
    acc = 0.0
    for i in range(a.shape[0]):
        acc += a[i] * b[i]
    return acc


@kernel
def mm(A, B):
    """A B (A (r, k), B (k, c), any layout); a zero entry of A is skipped (the mechanisms' sparse matrices)."""
    r, k = A.shape
    c = B.shape[1]
    if r * k * c > SMALL_MV:
        return _blas_mm(A, B)
    out = np.zeros((r, c))
    for l in range(k):  # (as :func:`mv`: the r × c sums side by side)
        for i in range(r):
            a = A[i, l]
            if a != 0.0:
                for j in range(c):
                    out[i, j] += a * B[l, j]
    return out


@kernel
def mmt(A, B):
    """A Bᵀ (A (r, k), B (c, k)) without forming Bᵀ (:func:`mm` on the transposed view)."""
    return mm(A, B.T)


@kernel
def mtm(A, B):
    """Aᵀ B (A (k, r), B (k, c)) without forming Aᵀ (:func:`mm` on the transposed view)."""
    return mm(A.T, B)


@kernel
def rtmr(R, M):
    """Rᵀ M R (g, g) of R (n, g)."""
    n, g = R.shape
    if n * n > SMALL_MV:
        return _blas_mm(R.T, _blas_mm(M, R))
    MR = mm(M, R)
    out = np.zeros((g, g))
    for i in range(n):
        for b in range(g):
            acc = MR[i, b]
            if acc != 0.0:
                for a in range(g):
                    out[a, b] += R[i, a] * acc
    return out


@kernel
def cols(A, a, b):
    """A copy of the columns a … b − 1 of A (r, k): (r, b − a), C-contiguous."""
    r = A.shape[0]
    out = np.empty((r, b - a))
    for i in range(r):
        for j in range(a, b):
            out[i, j - a] = A[i, j]
    return out


@kernel
def part(x, a, b):
    """A copy of the entries a … b − 1 of the vector x (C-contiguous)."""
    out = np.empty(b - a)
    for i in range(a, b):
        out[i - a] = x[i]
    return out


@kernel
def sym(P):
    """(P + Pᵀ)/2."""
    L = P.shape[0]
    out = np.empty((L, L))
    for i in range(L):
        for j in range(L):
            out[i, j] = 0.5 * (P[i, j] + P[j, i])
    return out


@kernel
def axpy(x, a, y):
    """x + a y of two vectors (a new one)."""
    out = np.empty(x.shape[0])
    for i in range(x.shape[0]):
        out[i] = x[i] + a * y[i]
    return out


@kernel
def maxpy(X, a, Y):
    """X + a Y of two matrices (a new one)."""
    r, c = X.shape
    out = np.empty((r, c))
    for i in range(r):
        for j in range(c):
            out[i, j] = X[i, j] + a * Y[i, j]
    return out


@kernel
def eye_plus(a, A):
    """I + a A of a square matrix."""
    L = A.shape[0]
    out = np.empty((L, L))
    for i in range(L):
        for j in range(L):
            out[i, j] = a * A[i, j]
        out[i, i] += 1.0
    return out


@kernel
def same_head(x, x0, nd):
    """x[:nd] == x0[:nd] (bitwise; e.g. a sigma point that differs from the mean only in the sensor parameters)."""
    for i in range(nd):
        if x[i] != x0[i]:
            return False
    return True


#: matrices up to this size are inverted in place by :func:`inverse`'s own elimination
SMALL_N = 16


@kernel
def inverse(A):
    """(A⁻¹, ok): :func:`eliminate` up to ``SMALL_N`` rows (no call overhead), LAPACK's LU beyond (O(n³)
    in blocked code: 20 times faster at n = 81 for a dense matrix)."""
    n = A.shape[0]
    if n > SMALL_N:
        try:
            X = np.ascontiguousarray(np.linalg.inv(A))
        except Exception:  # singular
            return np.eye(n), False
        return X, bool(np.all(np.isfinite(X)))
    return eliminate(A)


@kernel
def eliminate(A):
    """(A⁻¹, ok): Gauss-Jordan elimination with partial pivoting, skipping zero multipliers: for a sparse
    A (the constraint Jacobian [Φ_q; S], a few nonzeros per row) it does a few row operations per column,
    and beats LAPACK's dense LU at any size (ladder-21, n = 41: ~8 µs against ~30)."""
    return eliminate_in_place(A.copy())


@kernel
def eliminate_in_place(W):
    """:func:`eliminate` of W, overwritten."""
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


@kernel
def inverse_or_nan(A):
    """A⁻¹ of a C-contiguous A (:func:`inverse`: no LAPACK call for a small matrix), or NaN everywhere when A is singular or
    not finite (what follows is NaN: gated, or taken for divergence)."""
    X, ok = inverse(A)
    if not ok:
        X[:] = np.nan
    return X


@kernel
def inverse_or_nan_compact(A):
    """:func:`inverse_or_nan` by :func:`eliminate` at any size (the innovation covariances are small)."""
    X, ok = eliminate(A)
    if not ok:
        for i in range(X.shape[0]):
            for j in range(X.shape[1]):
                X[i, j] = np.nan
    return X


@kernel
def cholesky(A):
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

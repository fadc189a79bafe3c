"""The measurement model in compiled code: every kind of sensor's readings and their H = ∂y/∂x.

:class:`SensorTable` holds the sensors as arrays (built by ``SensorParams.sensor_table``); :func:`measure_sensors`
stacks the readings of a group of them at a point (q, q̇, q̈) with the sensor parameters p, and H of the filter state;
:func:`_sensor_readings` the readings alone (a gyro's over the nonzeros of its body-rate form);
:func:`filter_sigma_readings` the readings at each UKF sigma point.  Units: rad/s (gyros), m/s² (accelerometers,
body frame), rad (inclinations, encoders), the DOF's unit or its rate (drive commands).

numpy reference: ``SensorParams.measure`` (estimator_service/backends/sensor_params.py) over the sensors of
estimator_service/sensors.py (``Gyro``, ``Accelerometer.h_mounted``, ``Inclination``, ``Encoder``, ``DriveCommand``)
and ``Model.body_rate``, ``body_angle``, ``point_matrix`` (estimator_service/model.py); ``measure_independent``
(estimator_service/backends/manifold.py); ``IndependentFilter.angle_rows`` and ``sigma_readings``
(estimator_service/backends/filter.py).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from estimator_service.kernels.jit import kernel, runtime_value
from estimator_service.kernels.linalg import dot, mm, mtv, mv, part, same_head
from estimator_service.kernels.manifold import accelerations, extend, padded
from estimator_service.kernels.dynamics import filter_tau
from estimator_service.kernels.transition import shared_velocity_terms, stage


#: SensorTable.kind of a sensor: not covered by the compiled measurement model (the reference path), a gyro, an
#: accelerometer, an inclination, an encoder, a drive's commanded position or velocity (sensors.DriveCommand)
NOT_COMPILED, GYRO, ACCELEROMETER, INCLINATION, ENCODER, COMMAND_POSITION, COMMAND_VELOCITY = 0, 1, 2, 3, 4, 5, 6


class SensorTable(NamedTuple):
    """The sensors the compiled measurement model reads (:func:`measure_sensors`), as arrays indexed by sensor
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


@kernel
def measure_sensors(ids, q, qd, qdd, p, t, qe0, want_jac, R, dqd_dz, D, nd):
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
    qe = extend(qe0, q)
    qde = padded(qd, ne)
    qdde = padded(qdd, ne)
    rows = 0
    for a in range(k):
        rows += t.dims[ids[a]]
    y = np.zeros(rows)
    Hq = np.zeros((rows, n))
    Hqd = np.zeros((rows, n))
    Hqdd = np.zeros((rows, n))
    Hp = np.zeros((rows, p.shape[0]))
    row0 = runtime_value(0)  # (the row functions compiled once, not also for a literal 0)
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
    Hx = mm(Hqdd, D)
    HqR, Hqd_z, HqdR = mm(Hq, R), mm(Hqd, dqd_dz), mm(Hqd, R)
    for r in range(rows):
        for j in range(g):
            Hx[r, j] += HqR[r, j] + Hqd_z[r, j]
            Hx[r, g + j] += HqdR[r, j]
        for j in range(p.shape[0]):
            Hx[r, nd + j] += Hp[r, j]
    return y, Hx


@kernel
def _gyro_rows(row0, i, qe, qde, qdde, p, t, want_jac, y, Hq, Hqd, Hqdd, Hp):
    """Gyro i's three rows of :func:`measure_sensors` from ``row0``, its bias left out: y, and with ``want_jac``
    ∂y/∂q, ∂y/∂q̇, ∂y/∂q̈ and ∂y/∂δ, written in place."""
    n = Hq.shape[1]
    A = t.rate_form[i]
    Aqd = mv(A, qde)
    w = dot(qe, Aqd)
    Atq = mtv(A, qe) if want_jac else Aqd  # (for H only)
    kk = t.offset[i]
    Aqdd, wd = Aqd, 0.0
    if kk >= 0:  # ω̇ for the time offset's term
        Aqdd = mv(A, qdde)
        wd = dot(qe, Aqdd)
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


@kernel
def _accelerometer_rows(row0, i, qe, qdd, p, t, want_jac, y, Hq, Hqdd, Hp):
    """Accelerometer i's three rows of :func:`measure_sensors` from ``row0``, its bias left out: y = A₂ Rᵀ v with
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


@kernel
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


@kernel
def _body_angle(pts, qe, row, sign, want_jac, Hq):
    """The angle φ (rad, atan2) of the body whose first two points' qe indices are ``pts`` (xi, yi, xj, yj),
    times ``sign``; with ``want_jac``, sign ∂φ/∂q added to Hq[row]."""
    dx, dy = qe[pts[2]] - qe[pts[0]], qe[pts[3]] - qe[pts[1]]
    if want_jac:
        _add_angle_gradient(Hq, row, pts[0], pts[1], pts[2], pts[3], dx, dy, sign)
    return sign * math.atan2(dy, dx)


@kernel
def _angle_row(row0, i, qe, qde, p, t, want_jac, y, Hq, Hqd, Hp):
    """An inclination's or an encoder's row of :func:`measure_sensors` (rad): y and, with ``want_jac``, ∂y/∂q,
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
        Aqd = mv(A, qde)
        w = dot(qe, Aqd)
        y[row0] -= p[kk] * w
        if want_jac:
            Hp[row0, kk] = -w
            Atq = mtv(A, qe)
            for j in range(n):
                Hq[row0, j] -= p[kk] * Aqd[j]
                Hqd[row0, j] -= p[kk] * Atq[j]


@kernel
def _command_row(row0, i, q, qd, t, want_jac, y, Hq, Hqd):
    """A drive command's row of :func:`measure_sensors`: y = q or q̇ of its coordinate and, with ``want_jac``, the 1
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


@kernel
def _sensor_readings(ids, q, qd, qdd, p, t, qe0, out):
    """The readings of :func:`measure_sensors` (no H) written to ``out``; a gyro's over the nonzeros ``t.rate_nz``
    of its body-rate form (:func:`sparse_forms`): ω = Σ A_ab qe_a q̇e_b, ω̇ likewise with q̈ (same value, summed
    in another order)."""
    n = q.shape[0]
    qe = extend(qe0, q)
    no_jac = np.zeros((0, 0))
    row0 = runtime_value(0)  # (the row functions compiled once, not also for a literal 0)
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
            _accelerometer_rows(row0, i, qe, qdd, p, t, runtime_value(False), out, no_jac, no_jac, no_jac)
        elif kind == INCLINATION or kind == ENCODER:
            _angle_row(row0, i, qe, padded(qd, qe.shape[0]), p, t, runtime_value(False), out, no_jac, no_jac, no_jac)
        elif kind == COMMAND_POSITION or kind == COMMAND_VELOCITY:
            _command_row(row0, i, q, qd, t, runtime_value(False), out, no_jac, no_jac)
        for r in range(t.dims[i]):
            b = t.bias[i, r]
            if b >= 0:
                out[row0 + r] += p[b]
        row0 += t.dims[i]


@kernel
def angle_flags(ids, t):
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


@kernel
def filter_sigma_readings(X, x0, nd, ids, g, force, G, e0, z0, q0, qd0, qdd0, R0, Jm0, tol, quad_res, max_newton, t,
                           qe0, H, B, c, Hq, ang, angL, dof, M, Qg, DA, Dc):
    """(status, Y (rows of X, readings)): the sensors ``ids`` (SensorTable ``t``) read at each row of X (sigma
    points) from its own point, found from x0's point (z0, q0, …; rows equal to x0 in [:nd] use it), as
    UnscentedKalmanFilter.update; status as :func:`point` (≠ 0: the caller falls back).  Rows at x0's z and ż
    share its velocity terms (:func:`shared_velocity_terms`)."""
    rows = 0
    for a in range(ids.shape[0]):
        rows += t.dims[ids[a]]
    Y = np.zeros((X.shape[0], rows))
    share, vqd, vs, vMs, vMinv = shared_velocity_terms(x0, g, z0, q0, R0, Jm0, tol, qe0, H, B, c, Hq, ang, angL,
                                                        dof, M)
    for k in range(X.shape[0]):
        x = X[k]
        if same_head(x, x0, nd):
            q, qd, qdd = q0, qd0, qdd0
        elif share and same_head(x, x0, 2 * g):
            tau = filter_tau(x, g, force, G, e0, dof, q0.shape[0])
            q, qd = q0, vqd
            qdd, _ = accelerations(q0, vqd, tau, R0, vs, vMs, vMinv, qe0, Qg, DA, Dc)
        else:
            st, q, qd, qdd, _, _, _, _ = stage(x, g, force, G, e0, z0, q0, R0, Jm0, tol, quad_res, max_newton,
                                                runtime_value(True), qe0, H, B, c, Hq, ang, angL, dof, M, Qg, DA, Dc)
            if st != 0:
                return st, Y
        _sensor_readings(ids, q, qd, qdd, part(x, nd, x.shape[0]), t, qe0, Y[k])
    return 0, Y

"""Joint parameter and state identification from recorded logs (after Marklund et al.).

One batch nonlinear least-squares problem over whole logs.  Unknowns: per log the trajectory in
independent coordinates, ``z_k``, ``ż_k`` at the nodes ``t_k = t_0 + k h`` of a uniform grid
(``h`` = ``dt``, default 2 ms: the dynamics grid may be coarser than the sensors), plus the chosen
parameters ``p``.  Residuals, each divided by its standard deviation:

- dynamics, trapezoidal rule between nodes k and k+1 (per DOF)::

      z_{k+1} − z_k − h/2 (ż_k + ż_{k+1})            σ = σ_a h²/2
      ż_{k+1} − ż_k − h/2 (z̈_k + z̈_{k+1})           σ = σ_a h

  with z̈ = z̈(z, ż; p) the forward dynamics of the model (mass matrix, gravity, joint dampers)
  and σ_a (``sigma_acc``, rad/s² or m/s²) the unmodelled acceleration;
- observations: every gyro, accelerometer and encoder sample of the logs, with the rig's noise
  sigmas.  A sample stamped t (IMU with time offset δ: the rig at t − δ) is predicted by quadratic
  interpolation of the predictions at the three nearest nodes (error O(h³ d³y/dt³));
- priors on the parameters (``p − p₀``)/σ_p.

Solved by Levenberg–Marquardt (Marquardt diagonal scaling) on the sparse normal equations with a
sparse LU (SuperLU); all Jacobians are analytic (tests compare them with finite differences).  The
kinematics and dynamics of all nodes are evaluated at once with stacked numpy arrays (the same
equations as :class:`~estimator_service.model.Model`, which they are tested against).

Parameter uncertainty: the marginal covariance of ``p`` is the inverse of the Schur complement of the
information matrix JᵀJ at the solution (states eliminated) plus the priors, times the reduced χ²
(2·cost / (rows − unknowns)).  A parameter is flagged *not identifiable* when the data shrink its
prior σ by less than half, or when it loads on a direction of the data information matrix whose
information is below the prior's (see docs/identify.md).

Units SI; angles rad; body frames as in docs/architecture.md.
"""

from __future__ import annotations

import math
import os
import sys
import time
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import scipy.sparse as sp
import scipy.sparse.linalg as spla
import tomli_w
import yaml
from scipy.signal import savgol_filter

from estimator_service import schema
from estimator_service.angles import wrap_angle
from estimator_service.errors import UserError
from estimator_service.logfile import read_log
from estimator_service.mechanism import Damper, Mechanism
from estimator_service.model import AssemblyError, Model
from estimator_service.rig import Rig
from estimator_service.sensors import Encoder
from estimator_service.stacked import StackedModel, assembly_guesses

BODY_FIELDS = ("mass", "I0", "cog_x", "cog_y")
SENSOR_KINDS = ("gyro_bias", "acc_bias", "mount", "time_offset")
AXIS_NAMES = ("x", "y", "z")


# ------------------------------------------------------------------------------------ parameters
@dataclass
class Param:
    """One scalar unknown parameter.

    ``kind``: a body field (``mass`` kg, ``I0`` kg·m² about the body's first point, ``cog_x``,
    ``cog_y`` m in the body frame), ``damper`` (N·m·s/rad), ``gyro_bias`` (rad/s), ``acc_bias``
    (m/s²), ``mount`` (rad), ``time_offset`` (s).  ``target``: body index, damper index in the
    identification mechanism, or IMU index; ``axis``: sensor axis of a bias.
    """

    name: str
    kind: str
    target: int
    value: float
    prior_sigma: float
    axis: int = 0
    unit: str = ""
    prior: float = 0.0

    @property
    def dynamic(self) -> bool:
        """True if the parameter changes the dynamics (body and damper parameters)."""
        return self.kind in BODY_FIELDS or self.kind == "damper"


def _known_names(rig: Rig) -> list[str]:
    mech = rig.mechanism
    out = [f"{b.name}.{f}" for b in mech.bodies for f in BODY_FIELDS]
    out += [f"damper:{b.name}" for b in mech.bodies] + ["damper:<body>/<body>"]
    out += [f"{k}:{s.name}" for k in SENSOR_KINDS for s in rig.imus]
    return out


def _damper_pair(rig: Rig, spec: str) -> tuple[int, int | None]:
    """Bodies (a, b or None = ground) of ``damper:<body>``, ``damper:<dof>`` or ``damper:<a>/<b>``."""
    mech = rig.mechanism
    names = [b.name for b in mech.bodies]
    parts = spec.split("/")
    if len(parts) == 2 and all(p in names for p in parts) and parts[0] != parts[1]:
        return names.index(parts[0]), names.index(parts[1])
    if len(parts) == 1 and spec in names:
        return names.index(spec), None
    for d in mech.dofs:  # a DOF that is the absolute angle of a body: that body's ground joint
        if d.name == spec and d.coordinate >= len(mech.coordinate_names()) - len(mech.relative_coordinates):
            rc = mech.relative_coordinates[d.coordinate - (len(mech.coordinate_names()) - len(mech.relative_coordinates))]
            for i, b in enumerate(mech.bodies):
                if tuple(b.points[:2]) == (rc.a, rc.b):
                    return i, None
    raise KeyError(spec)


def parse_params(rig: Rig, spec: str, priors: dict[str, float] | None = None) -> tuple[list[Param], Mechanism]:
    """Parameters named in ``spec`` (comma separated, docs/identify.md) and the mechanism to identify
    them on (the rig's, with a zero damper added for every ``damper:`` not yet in it).

    A bias expands to one parameter per sensor axis (``gyro_bias:coupler.x`` …).  ``priors`` maps a
    parameter name to its prior σ (SI units), overriding the defaults.  UserError on unknown names.
    """
    mech = rig.mechanism
    dampers = list(mech.dampers)
    out: list[Param] = []
    names = [s.strip() for s in spec.split(",") if s.strip()]
    if not names:
        raise UserError("--params: no parameter given; known: " + ", ".join(_known_names(rig)))
    imu_names = [s.name for s in rig.imus]
    for name in names:
        bad = UserError(f"--params: unknown parameter {name!r}; known: {', '.join(_known_names(rig))}")
        if any(p.name == name or p.name.startswith(name + ".") for p in out):
            raise UserError(f"--params: parameter {name!r} given twice")
        if ":" in name:
            kind, what = name.split(":", 1)
            if kind == "damper":
                try:
                    a, b = _damper_pair(rig, what)
                except KeyError:
                    raise bad from None
                idx = next((i for i, d in enumerate(dampers) if {d.body_a, d.body_b} == {a, b}), None)
                if idx is None:
                    dampers.append(Damper(a, b, 0.0))
                    idx = len(dampers) - 1
                out.append(Param(name, "damper", idx, dampers[idx].c, 1.0, unit="N·m·s/rad"))
                continue
            if kind not in SENSOR_KINDS or what not in imu_names:
                raise bad
            k = imu_names.index(what)
            imu = rig.imus[k]
            if kind == "gyro_bias":
                out += [Param(f"{name}.{AXIS_NAMES[i]}", kind, k, float(imu.gyr_bias_cal[i]), math.radians(2.0), i, "rad/s")
                        for i in range(3)]
            elif kind == "acc_bias":
                out += [Param(f"{name}.{AXIS_NAMES[i]}", kind, k, float(imu.acc_bias_cal[i]), 0.5, i, "m/s²")
                        for i in range(3)]
            elif kind == "mount":
                out.append(Param(name, kind, k, imu.mount, math.radians(10.0), unit="rad"))
            else:
                out.append(Param(name, kind, k, imu.time_offset_s, 0.02, unit="s"))
            continue
        body_name, _, fld = name.rpartition(".")
        bnames = [b.name for b in mech.bodies]
        if body_name not in bnames or fld not in BODY_FIELDS:
            raise bad
        bi = bnames.index(body_name)
        body = mech.bodies[bi]
        length = math.dist(*((mech.points[i].x, mech.points[i].y) for i in body.points[:2]))
        value = {"mass": body.mass, "I0": body.I0, "cog_x": body.cog[0], "cog_y": body.cog[1]}[fld]
        sigma = {"mass": 0.5 * body.mass or 1.0, "I0": 0.5 * body.I0 or 1.0}.get(fld, 0.5 * length)
        unit = {"mass": "kg", "I0": "kg·m²"}.get(fld, "m")
        out.append(Param(name, fld, bi, value, sigma, unit=unit))
    for p in out:
        p.prior = p.value
    for key, sigma in (priors or {}).items():
        hit = [p for p in out if p.name == key or p.name.startswith(key + ".")]
        if not hit:
            raise UserError(f"--prior: {key!r} is not one of the parameters {[p.name for p in out]}")
        if not (sigma > 0 and math.isfinite(sigma)):
            raise UserError(f"--prior: {key}: sigma must be > 0, got {sigma!r}")
        for p in hit:
            p.prior_sigma = sigma
    return out, replace(mech, dampers=dampers)


def mechanism_with(mech: Mechanism, params: list[Param], values: np.ndarray) -> Mechanism:
    """``mech`` with the body and damper parameters set to ``values`` (same order as ``params``)."""
    bodies = list(mech.bodies)
    dampers = list(mech.dampers)
    for p, v in zip(params, values, strict=False):
        if p.kind in BODY_FIELDS:
            b = bodies[p.target]
            if p.kind == "mass":
                b = replace(b, mass=float(v))
            elif p.kind == "I0":
                b = replace(b, I0=float(v))
            elif p.kind == "cog_x":
                b = replace(b, cog=(float(v), b.cog[1]))
            else:
                b = replace(b, cog=(b.cog[0], float(v)))
            bodies[p.target] = b
        elif p.kind == "damper":
            dampers[p.target] = replace(dampers[p.target], c=float(v))
    return replace(mech, bodies=bodies, dampers=dampers)


# ------------------------------------------------------------------------------------ log data
@dataclass
class Channel:
    """One sensor channel of one log: sample times (s, stamps), readings (k, dim), sigma (dim,)."""

    kind: str  # "gyr", "acc", "enc"
    sensor: int  # IMU index (gyr, acc) or encoder index
    t: np.ndarray
    y: np.ndarray
    sigma: np.ndarray


@dataclass
class LogData:
    path: str
    channels: list[Channel]
    t0: float
    t1: float


def read_channels(rig: Rig, path: str) -> LogData:
    """Gyro, accelerometer and encoder samples of a log (raw readings: no calibration applied)."""
    reader = read_log(path)
    imu_topics = {f"imu/{s.name}": k for k, s in enumerate(rig.imus)}
    enc_topics = {f"enc/{e.name}": k for k, e in enumerate(rig.encoders)}
    encs = [Encoder(e.name, f"enc/{e.name}", rig.model, e.body, e.relative_to, e.cpr, e.offset, e.sigma)
            for e in rig.encoders]
    imu_rows: dict[int, list] = {k: [] for k in imu_topics.values()}
    enc_rows: dict[int, list] = {k: [] for k in enc_topics.values()}
    for rec in reader:
        if rec.topic in imu_topics:
            try:
                msg = schema.decode(rec.topic, rec.payload)
            except schema.SchemaError:
                continue
            imu_rows[imu_topics[rec.topic]].append([msg["t"], *msg["gyr"], *msg["acc"]])
        elif rec.topic in enc_topics:
            k = enc_topics[rec.topic]
            try:
                msg = schema.decode(rec.topic, rec.payload)
                enc_rows[k].append([msg["t"], float(encs[k].measure(msg)[0])])
            except schema.SchemaError as exc:
                raise UserError(f"{path}: {exc}") from None
    channels = []
    for k, rows in imu_rows.items():
        if rows:
            a = np.asarray(rows)
            imu = rig.imus[k]
            channels.append(Channel("gyr", k, a[:, 0], a[:, 1:4], imu.gyr.sigma))
            channels.append(Channel("acc", k, a[:, 0], a[:, 4:7], imu.acc.sigma))
    for k, rows in enc_rows.items():
        if rows:
            a = np.asarray(rows)
            channels.append(Channel("enc", k, a[:, 0], np.unwrap(a[:, 1:2], axis=0), np.array([rig.encoders[k].sigma])))
    if not channels:
        raise UserError(f"{path}: no IMU or encoder messages of this rig in the log")
    t0 = min(float(c.t[0]) for c in channels)
    t1 = max(float(c.t[-1]) for c in channels)
    return LogData(path, channels, t0, t1)


# ------------------------------------------------------------------------------------ the problem
def dof_encoders(rig: Rig, model: Model) -> dict[int, int]:
    """Per DOF coordinate (index into q) measured by an encoder against the ground: the encoder index."""
    out: dict[int, int] = {}
    for k, e in enumerate(rig.encoders):
        enc = Encoder(e.name, "", model, e.body, e.relative_to, e.cpr, e.offset, e.sigma)
        if enc.coordinate is not None and enc.coordinate in model.dof:
            out.setdefault(enc.coordinate, k)
    return out


@dataclass
class Result:
    """Outcome of :func:`identify`: parameters with estimate, 1σ, correlation, flags, and figures."""

    params: list[Param]
    estimate: np.ndarray
    sigma: np.ndarray
    correlation: np.ndarray
    identifiable: list[bool]
    reasons: list[str]
    reduced_chi2: float
    cost: float
    iterations: int
    seconds: float
    condition: float
    trajectories: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = field(default_factory=list)  #: (t, z, ż) per log
    mechanism: Mechanism | None = None


class Problem:
    """The least-squares problem: ``residuals_and_jacobian(x)`` with x = [per log (z_k, ż_k)…, p].

    ``rig``: the nominal rig; ``params`` from :func:`parse_params` (with its mechanism ``mech``).
    """

    def __init__(self, rig: Rig, params: list[Param], mech: Mechanism, logs: list[LogData],
                 dt: float = 0.002, sigma_acc: float = 0.01) -> None:
        self.rig, self.params, self.mech, self.logs = rig, params, mech, logs
        self.h, self.sigma_acc = dt, sigma_acc
        self.model = Model(mech)
        self.g = self.model.g
        self.nodes = [int(math.ceil((lg.t1 - lg.t0) / dt)) + 1 for lg in logs]
        for lg, n in zip(logs, self.nodes, strict=False):
            if n < 3:
                raise UserError(f"{lg.path}: {lg.t1 - lg.t0:.3g} s of sensor data: too short for a {dt:g} s grid")
        self.offsets = np.cumsum([0] + [2 * self.g * n for n in self.nodes])
        self.P = len(params)
        self.nx = int(self.offsets[-1])
        self.dyn_idx = [i for i, p in enumerate(params) if p.dynamic]
        self._q_warm: list[np.ndarray | None] = [None] * len(logs)
        self.n_prior_rows = self.P

    # -------------------------------------------------------------- parameters -> models
    def _models(self, p: np.ndarray) -> tuple[StackedModel, np.ndarray, np.ndarray]:
        """Stacked model at p, and per dynamic parameter ∂M/∂p (D, n, n), ∂Q_gravity/∂p (D, n).

        M and Q_gravity are affine in each body parameter separately (mass, I0, mass·cog), so the
        central difference between two model builds is exact up to rounding.
        """
        mech = mechanism_with(self.mech, self.params, p)
        sm = StackedModel(Model(mech))
        n = sm.n
        dM = np.zeros((len(self.dyn_idx), n, n))
        dQ = np.zeros((len(self.dyn_idx), n))
        for d, i in enumerate(self.dyn_idx):
            if self.params[i].kind == "damper":
                continue
            e = max(1e-6, 1e-4 * abs(p[i]))
            hi, lo = p.copy(), p.copy()
            hi[i] += e
            lo[i] -= e
            mh = Model(mechanism_with(self.mech, self.params, hi))
            ml = Model(mechanism_with(self.mech, self.params, lo))
            dM[d] = (mh.M - ml.M) / (2 * e)
            dQ[d] = (mh.arrays.Q_gravity - ml.arrays.Q_gravity) / (2 * e)
        return sm, dM, dQ

    # -------------------------------------------------------------- initial trajectory
    def initial_x(self) -> np.ndarray:
        """Initial unknowns: z from an encoder on each DOF (smoothed), ż from its derivative; p₀."""
        x = np.zeros(self.nx + self.P)
        m = self.model
        for li, lg in enumerate(self.logs):
            t = lg.t0 + self.h * np.arange(self.nodes[li])
            Z = np.zeros((len(t), self.g))
            Zd = np.zeros((len(t), self.g))
            for j, coord in enumerate(m.dof):
                ch = self._dof_encoder(lg, int(coord))
                if ch is None:
                    raise UserError(f"{lg.path}: identification needs an encoder measuring DOF "
                                    f"{m.dof_names[j]!r} against the ground for the initial trajectory; the log has none")
                dt_enc = float(np.median(np.diff(ch.t)))
                win = max(5, int(round(0.03 / dt_enc)) | 1)
                ang = savgol_filter(ch.y[:, 0], win, 3) if len(ch.t) > win else ch.y[:, 0]
                rate = savgol_filter(ch.y[:, 0], win, 3, deriv=1, delta=dt_enc) if len(ch.t) > win else np.gradient(ch.y[:, 0], ch.t)
                Z[:, j] = np.interp(t, ch.t, ang)
                Zd[:, j] = np.interp(t, ch.t, rate)
            blk = x[self.offsets[li]: self.offsets[li + 1]].reshape(-1, 2 * self.g)
            blk[:, : self.g] = Z
            blk[:, self.g:] = Zd
        x[self.nx:] = [p.value for p in self.params]
        return x

    def _dof_encoder(self, lg: LogData, coord: int) -> Channel | None:
        k = dof_encoders(self.rig, self.model).get(coord)
        return next((ch for ch in lg.channels if ch.kind == "enc" and ch.sensor == k), None)

    # -------------------------------------------------------------- residuals
    def residuals_and_jacobian(self, x: np.ndarray, want_jac: bool = True) -> tuple[np.ndarray, sp.csr_matrix | None]:
        """Whitened residual vector and its sparse Jacobian at x."""
        p = x[self.nx:]
        sm, dM, dQ = self._models(p)
        rows: list[np.ndarray] = []
        cols: list[np.ndarray] = []
        vals: list[np.ndarray] = []
        res: list[np.ndarray] = []
        r0 = 0
        for li, lg in enumerate(self.logs):
            r0 = self._log_terms(li, lg, x, sm, dM, dQ, r0, rows, cols, vals, res)
        # priors
        sig = np.array([q.prior_sigma for q in self.params])
        res.append((p - np.array([q.prior for q in self.params])) / sig)
        rows.append(r0 + np.arange(self.P))
        cols.append(self.nx + np.arange(self.P))
        vals.append(1.0 / sig)
        r0 += self.P
        r = np.concatenate(res)
        if not want_jac:
            return r, None
        J = sp.csr_matrix((np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))), shape=(r0, self.nx + self.P))
        return r, J

    def _log_terms(self, li: int, lg: LogData, x: np.ndarray, sm: StackedModel, dM: np.ndarray, dQ: np.ndarray,
                   r0: int, rows: list, cols: list, vals: list, res: list) -> int:
        g, h, N, P, nx = self.g, self.h, self.nodes[li], self.P, self.nx
        off = int(self.offsets[li])
        blk = x[off: off + 2 * g * N].reshape(N, 2 * g)
        Z, Zd = blk[:, :g], blk[:, g:]
        q = self._positions(li, sm, Z)
        st = sm.evaluate(q, Zd)
        self._q_warm[li] = st["q"]
        dof = sm.dof
        # ∂q̈/∂p for the dynamic parameters: Kinv_nn (∂Q/∂p − ∂M/∂p q̈)
        D = len(self.dyn_idx)
        dqdd_dp = np.zeros((N, sm.n, P))
        for d, i in enumerate(self.dyn_idx):
            prm = self.params[i]
            rhs = st["jw"][:, prm.target] if prm.kind == "damper" else dQ[d] - st["qdd"] @ dM[d].T
            dqdd_dp[:, :, i] = np.einsum("nij,nj->ni", st["Kinv_nn"], rhs)
        zdd = st["qdd"][:, dof]
        zdd_z = st["dqdd_dz"][:, dof]
        zdd_zd = st["dqdd_dzd"][:, dof]
        zdd_p = dqdd_dp[:, dof]
        iz = off + np.arange(N)[:, None] * 2 * g + np.arange(g)[None, :]  # (N, g) column of z_k
        izd = iz + g
        # ---- dynamics
        s1, s2 = self.sigma_acc * h * h / 2, self.sigma_acc * h
        k = np.arange(N - 1)
        r1 = (Z[1:] - Z[:-1] - h / 2 * (Zd[:-1] + Zd[1:])) / s1
        r2 = (Zd[1:] - Zd[:-1] - h / 2 * (zdd[:-1] + zdd[1:])) / s2
        ri1 = r0 + k[:, None] * 2 * g + np.arange(g)[None, :]
        ri2 = ri1 + g
        res += [np.concatenate([r1, r2], axis=1).ravel()]
        for ri, cz, v in ((ri1, iz[1:], 1 / s1), (ri1, iz[:-1], -1 / s1), (ri1, izd[:-1], -h / 2 / s1),
                          (ri1, izd[1:], -h / 2 / s1), (ri2, izd[1:], 1 / s2), (ri2, izd[:-1], -1 / s2)):
            rows.append(ri.ravel())
            cols.append(cz.ravel())
            vals.append(np.full(ri.size, v))
        for kk, sl in ((k, slice(None, -1)), (k + 1, slice(1, None))):
            for jac, idx in ((zdd_z, iz), (zdd_zd, izd)):
                blkj = -h / 2 / s2 * jac[sl]  # (N-1, g, g)
                rows.append(np.repeat(ri2[:, :, None], g, axis=2).ravel())
                cols.append(np.repeat(idx[kk][:, None, :], g, axis=1).ravel())
                vals.append(blkj.ravel())
        if D:
            dp = -h / 2 / s2 * (zdd_p[:-1] + zdd_p[1:])[:, :, self.dyn_idx]  # (N-1, g, D)
            rows.append(np.repeat(ri2[:, :, None], D, axis=2).ravel())
            cols.append(np.broadcast_to(nx + np.array(self.dyn_idx), dp.shape).ravel())
            vals.append(dp.ravel())
        r0 += 2 * g * (N - 1)
        # ---- observations
        for ch in lg.channels:
            Y, Yz, Yzd, Yp = self._node_prediction(ch, sm, st, dqdd_dp, x)
            dim = Y.shape[1]
            delta_i = next((i for i, q in enumerate(self.params) if q.kind == "time_offset" and q.target == ch.sensor), None) \
                if ch.kind != "enc" else None
            delta = x[nx + delta_i] if delta_i is not None else (self.rig.imus[ch.sensor].time_offset_s if ch.kind != "enc" else 0.0)
            # quadratic interpolation through nodes k-1, k, k+1 (u = k + w): error O(h³ d³y/dt³);
            # linear interpolation's chord error ÿh²/8 biased the inertia by 3e-4 relative at 2 ms
            u = (ch.t - delta - lg.t0) / h
            kk = np.clip(np.floor(u).astype(int), 1, N - 2)
            w = (u - kk)[:, None]
            lag = ((w * (w - 1) / 2, kk - 1), (1 - w * w, kk), (w * (w + 1) / 2, kk + 1))
            dlag = (w - 0.5, -2 * w, w + 0.5)  # d weight / d w
            pred = sum(wgt * Y[kn] for wgt, kn in lag)
            bias_cols = []
            if ch.kind in ("gyr", "acc"):
                bkind = "gyro_bias" if ch.kind == "gyr" else "acc_bias"
                cal = self.rig.imus[ch.sensor].gyr_bias_cal if ch.kind == "gyr" else self.rig.imus[ch.sensor].acc_bias_cal
                b = cal.copy()
                for i, q in enumerate(self.params):
                    if q.kind == bkind and q.target == ch.sensor:
                        b[q.axis] = x[nx + i]
                        bias_cols.append((q.axis, nx + i))
                pred = pred + b
            e = pred - ch.y
            if ch.kind == "enc":
                e = wrap_angle(e)
            sig = ch.sigma
            ns = len(ch.t)
            res.append((e / sig).ravel())
            ridx = r0 + np.arange(ns)[:, None] * dim + np.arange(dim)[None, :]  # (ns, dim)
            for wgt, kn in lag:
                for jac, idx in ((Yz, iz), (Yzd, izd)):
                    blkj = (wgt[:, :, None] * jac[kn]) / sig[None, :, None]  # (ns, dim, g)
                    rows.append(np.repeat(ridx[:, :, None], g, axis=2).ravel())
                    cols.append(np.repeat(idx[kn][:, None, :], dim, axis=1).ravel())
                    vals.append(blkj.ravel())
                if Yp is not None:
                    blkp = (wgt[:, :, None] * Yp[kn]) / sig[None, :, None]  # (ns, dim, Pc)
                    rows.append(np.repeat(ridx[:, :, None], blkp.shape[2], axis=2).ravel())
                    cols.append(np.broadcast_to(nx + np.array(self._yp_idx), blkp.shape).ravel())
                    vals.append(blkp.ravel())
            for axis, col in bias_cols:
                rows.append(ridx[:, axis])
                cols.append(np.full(ns, col))
                vals.append(np.full(ns, 1.0 / sig[axis]))
            if delta_i is not None:
                dY = -sum(dw * Y[kn] for dw, (_, kn) in zip(dlag, lag, strict=False)) / h / sig  # ∂pred/∂δ, ∂w/∂δ = -1/h
                rows.append(ridx.ravel())
                cols.append(np.full(ridx.size, nx + delta_i))
                vals.append(dY.ravel())
            r0 += ns * dim
        return r0

    def _positions(self, li: int, sm: StackedModel, Z: np.ndarray) -> np.ndarray:
        """Consistent q at every node: Newton from the last solution, or at first from the guesses of
        stacked.assembly_guesses along the trajectory, so every node is on the file's assembly branch."""
        warm = self._q_warm[li]
        return sm.solve_position(assembly_guesses(self.model, Z) if warm is None else warm, Z)

    def _node_prediction(self, ch: Channel, sm: StackedModel, st: dict, dqdd_dp: np.ndarray,
                         x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
        """Prediction of a channel at every node without bias: Y (N, dim), ∂Y/∂z, ∂Y/∂ż (N, dim, g),
        ∂Y/∂p (N, dim, Pc) for the parameters ``self._yp_idx`` it depends on (or None)."""
        rig, nx = self.rig, self.nx
        if ch.kind == "gyr":
            imu = rig.imus[ch.sensor]
            col = imu.sensor_axes[:, 2]
            w, w_z, w_zd = sm.body_rate(st, imu.body)
            return col * w[:, None], col[None, :, None] * w_z[:, None, :], col[None, :, None] * w_zd[:, None, :], None
        if ch.kind == "enc":
            e = rig.encoders[ch.sensor]
            enc = Encoder(e.name, "", sm.model, e.body, e.relative_to, e.cpr, e.offset, e.sigma)
            if enc.coordinate is not None:
                y = st["q"][:, enc.coordinate]
                y_q = np.zeros((len(y), sm.n))
                y_q[:, enc.coordinate] = 1.0
            else:
                y, y_q = sm.body_angle(st["q"], e.body)
                if e.relative_to is not None:
                    yb, yb_q = sm.body_angle(st["q"], e.relative_to)
                    y, y_q = y - yb, y_q - yb_q
            yz = np.einsum("ni,nij->nj", y_q, st["R"])
            return y[:, None], yz[:, None, :], np.zeros((len(y), 1, self.g)), None
        # accelerometer: y = A2 Rt(φ + α) (a − g),  a = C q̈
        imu = rig.imus[ch.sensor]
        mi = next((i for i, q in enumerate(self.params) if q.kind == "mount" and q.target == ch.sensor), None)
        alpha = x[nx + mi] if mi is not None else imu.mount
        A2 = imu.axes[:, :2]
        Cp = sm.model.point_matrix(imu.body, imu.at)[:, : sm.n]
        a = st["qdd"] @ Cp.T
        phi, phi_q = sm.body_angle(st["q"], imu.body)
        psi = phi + alpha
        c, s = np.cos(psi), np.sin(psi)
        Rt = np.stack([np.stack([c, s], -1), np.stack([-s, c], -1)], -2)  # (N, 2, 2) global -> sensor plane
        dRt = np.stack([np.stack([-s, c], -1), np.stack([-c, -s], -1)], -2)
        v = a - sm.model.gravity
        ARt = np.einsum("ij,njk->nik", A2, Rt)  # (N, 3, 2)
        y = np.einsum("nik,nk->ni", ARt, v)
        dy_dpsi = np.einsum("ij,njk,nk->ni", A2, dRt, v)  # (N, 3)
        ARtC = ARt @ Cp  # (N, 3, n)
        phi_z = np.einsum("ni,nij->nj", phi_q, st["R"])
        yz = dy_dpsi[:, :, None] * phi_z[:, None, :] + ARtC @ st["dqdd_dz"]
        yzd = ARtC @ st["dqdd_dzd"]
        idx = list(self.dyn_idx) + ([mi] if mi is not None else [])
        self._yp_idx = idx
        if not idx:
            return y, yz, yzd, None
        yp = np.zeros((len(y), 3, len(idx)))
        if self.dyn_idx:
            yp[:, :, : len(self.dyn_idx)] = ARtC @ dqdd_dp[:, :, self.dyn_idx]
        if mi is not None:
            yp[:, :, -1] = dy_dpsi
        return y, yz, yzd, yp


# ------------------------------------------------------------------------------------ solver
def _lu(A: sp.spmatrix):
    """Sparse LU of a symmetric positive definite matrix ordered [trajectory (banded), parameters].

    The natural order is the right one: the trajectory block is banded (neighbouring nodes only) and
    the parameters form a dense border at the end, so elimination creates no fill outside the
    border.  (COLAMD scatters the border and was ~100× slower here.)
    """
    return spla.splu(sp.csc_matrix(A), permc_spec="NATURAL", diag_pivot_thresh=0.0,
                     options={"SymmetricMode": True})


def solve(problem: Problem, x0: np.ndarray, max_iter: int = 50, progress: Callable[[str], None] | None = None,
          tol: float = 1e-2) -> tuple[np.ndarray, float, int]:
    """Levenberg–Marquardt with Marquardt scaling on the sparse normal equations.

    Stops when the predicted cost decrease of an accepted step is below ``tol`` (Δχ² = 0.02: the step
    moves the estimate by at most ~0.14σ in any direction), when a rejected step changes the cost by
    no more than rounding (1e-10 relative), or after ``max_iter`` steps.  Returns (x, cost, iterations).
    """
    x = x0.copy()
    r, J = problem.residuals_and_jacobian(x)
    cost = 0.5 * float(r @ r)
    lam, nu = 1e-9, 2.0
    it = 0
    if progress:
        progress(f"iter {it:3d}  cost {cost:.6e}")
    while it < max_iter:
        it += 1
        A = (J.T @ J).tocsc()
        gvec = J.T @ r
        d = A.diagonal().copy()
        d[d <= 0] = 1.0
        step = -_lu(A + sp.diags(lam * d)).solve(gvec)
        pred = -(gvec @ step) - 0.5 * float(step @ (A @ step))
        try:
            r_new, J_new = problem.residuals_and_jacobian(x + step)
            cost_new = 0.5 * float(r_new @ r_new)
        except AssemblyError:
            cost_new = math.inf
        rho = (cost - cost_new) / pred if pred > 0 else -1.0
        if rho > 0 and math.isfinite(cost_new):
            x, r, J, cost = x + step, r_new, J_new, cost_new
            # the diagonal of JᵀJ spans many decades (stiff dynamics rows): relax the damping fast
            lam = max(lam * max(0.1, 1 - (2 * rho - 1) ** 3), 1e-15)
            nu = 2.0
            if progress:
                progress(f"iter {it:3d}  cost {cost:.6e}  lambda {lam:.1e}  predicted decrease {pred:.3e}")
            if pred < tol:
                break
        else:
            lam *= nu
            nu *= 2
            if progress:
                progress(f"iter {it:3d}  step rejected (cost {cost_new:.6e}); lambda {lam:.1e}")
            if lam > 1e12 or cost_new - cost <= 1e-10 * cost:
                break  # no further decrease at working precision: converged
    return x, cost, it


def covariance(problem: Problem, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, float, int, int]:
    """(posterior covariance of p (P, P), data information of p (P, P), reduced χ², rows, unknowns)."""
    r, J = problem.residuals_and_jacobian(x)
    nx = problem.nx
    Jd = J[: J.shape[0] - problem.n_prior_rows]  # without the prior rows
    A = (Jd.T @ Jd).tocsc()
    Axx, Axp, App = A[:nx, :nx], A[:nx, nx:].toarray(), A[nx:, nx:].toarray()
    info = App - Axp.T @ _lu(Axx).solve(Axp)
    info = 0.5 * (info + info.T)
    prior = np.diag([1.0 / q.prior_sigma**2 for q in problem.params])
    cov = np.linalg.inv(info + prior)
    rows, unknowns = J.shape[0], J.shape[1]
    chi2 = float(r @ r) / max(rows - unknowns, 1)
    return cov, info, chi2, rows, unknowns


def identify(rig: Rig, params: list[Param], mech: Mechanism, logs: list[str | LogData], dt: float = 0.002,
             sigma_acc: float = 0.01, max_iter: int = 50,
             progress: Callable[[str], None] | None = None) -> Result:
    """Identify ``params`` (from :func:`parse_params`) and the trajectories from logs (paths, or
    channels already read by :func:`read_channels`).  ``params`` receive the estimates."""
    t_start = time.perf_counter()
    missing = [name for coord, name in zip(rig.model.dof, rig.model.dof_names, strict=False) if coord not in dof_encoders(rig, rig.model)]
    if missing:
        raise UserError(f"{rig.path}: identification needs an encoder measuring each DOF against the ground for the "
                        f"initial trajectory; none for {missing}")
    logs = [lg if isinstance(lg, LogData) else read_channels(rig, lg) for lg in logs]
    problem = Problem(rig, params, mech, logs, dt, sigma_acc)
    x0 = problem.initial_x()
    x, cost, iters = solve(problem, x0, max_iter, progress)
    cov, info, chi2, _, _ = covariance(problem, x)
    sigma = np.sqrt(np.diag(cov) * chi2)
    corr = cov / np.sqrt(np.outer(np.diag(cov), np.diag(cov)))
    prior_sig = np.array([q.prior_sigma for q in params])
    # identifiability: information relative to the prior, per direction
    S = np.diag(prior_sig)
    evals, evecs = np.linalg.eigh(S @ info @ S)
    dinfo = np.sqrt(np.clip(np.diag(info), 1e-300, None))
    ev_n = np.linalg.eigvalsh(info / np.outer(dinfo, dinfo))
    condition = float(ev_n[-1] / max(ev_n[0], 1e-300))
    ok, reasons = [], []
    for i in range(len(params)):
        why = []
        if math.sqrt(cov[i, i]) > 0.5 * prior_sig[i]:
            why.append("the data shrink its prior sigma by less than half")
        weak = [j for j in range(len(evals)) if evals[j] < 1.0 and abs(evecs[i, j]) > 0.3]
        if weak:
            partners = [params[k].name for k in range(len(params)) if k != i and any(abs(evecs[k, j]) > 0.3 for j in weak)]
            why.append("in a direction the data barely inform" + (f" (with {', '.join(partners)})" if partners else ""))
        ok.append(not why)
        reasons.append("; ".join(why))
    p = x[problem.nx:]
    trajs = []
    for li, lg in enumerate(logs):
        blk = x[problem.offsets[li]: problem.offsets[li + 1]].reshape(-1, 2 * problem.g)
        trajs.append((lg.t0 + dt * np.arange(len(blk)), blk[:, : problem.g].copy(), blk[:, problem.g:].copy()))
    for q, v in zip(params, p, strict=False):
        q.value = float(v)
    return Result(params, p.copy(), sigma, corr, ok, reasons, chi2, cost, iters, time.perf_counter() - t_start,
                  condition, trajs, mechanism_with(mech, params, p))


def stderr_progress(line: str) -> None:
    """Print one progress line to stderr."""
    print(line, file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------ output
def write_identified(rig: Rig, result: Result, out: str, sources: list[str]) -> list[str]:
    """Write the identified rig TOML ``out`` (and ``<out stem>.yaml`` if body or damper parameters
    were identified) that ``rigstate estimate --rig`` and the daemon load directly.  Returns the
    paths written.

    IMU parameters go to ``[[imu]]``: ``gyr_bias_cal``, ``acc_bias_cal`` (biases the estimator
    subtracts), ``mount_deg``, ``time_offset_s``.  Body parameters are written as numbers (mass, I0,
    cog) into a copy of the mechanism YAML; identified dampers into its ``dampers`` (a
    ``[simulation.damper]`` on the same joint is dropped: the friction is now modelled).
    """
    out_path = Path(out)
    for prm in result.params:
        if prm.kind in ("mass", "I0", "damper") and prm.value < 0:
            raise UserError(f"{prm.name}: identified value {prm.value:.6g} {prm.unit} is not physical (must be >= 0); "
                            f"{out} not written. The model misses something the data show: add the parameters "
                            "that explain it (friction, biases, mounting, time offset) or fix the priors")
    doc = tomllib.loads(rig.toml_text)
    written = []
    imus = doc.get("imu", [])
    for prm in result.params:
        if prm.kind in SENSOR_KINDS:
            t = imus[prm.target]
            if prm.kind in ("gyro_bias", "acc_bias"):
                key = "gyr_bias_cal" if prm.kind == "gyro_bias" else "acc_bias_cal"
                cur = list(t.get(key, [0.0, 0.0, 0.0]))
                cur[prm.axis] = prm.value
                t[key] = [float(v) for v in cur]
            elif prm.kind == "mount":
                t["mount_deg"] = math.degrees(prm.value)
            else:
                t["time_offset_s"] = prm.value
    mech_path = Path(rig.mechanism_path)
    if any(prm.dynamic for prm in result.params):
        assert result.mechanism is not None
        ydoc = yaml.safe_load(rig.mechanism_yaml)
        mech = result.mechanism
        for prm in result.params:
            if prm.kind in BODY_FIELDS:
                b = mech.bodies[prm.target]
                entry = ydoc["planar_bodies"][prm.target]
                entry["mass"], entry["I0"], entry["cog"] = float(b.mass), float(b.I0), [float(b.cog[0]), float(b.cog[1])]
        names = [b.name for b in mech.bodies]
        ydoc["dampers"] = [{"bodies": [names[d.body_a], "ground" if d.body_b is None else names[d.body_b]], "c": float(d.c)}
                           for d in mech.dampers]
        mech_path = out_path.with_suffix(".yaml")
        head = f"# Identified by rigstate identify from {', '.join(sources)}; base: {rig.mechanism_path}\n"
        mech_path.write_text(head + yaml.safe_dump(ydoc, sort_keys=False))
        written.append(str(mech_path))
        joints = {frozenset((d.body_a, d.body_b)) for prm in result.params if prm.kind == "damper"
                  for d in [mech.dampers[prm.target]]}
        sim = doc.get("simulation", {})
        if "damper" in sim:
            kept = []
            for d in sim["damper"]:
                a, b = d["bodies"]
                ia = a if isinstance(a, int) else names.index(a)
                ib = None if b == "ground" else (b if isinstance(b, int) else names.index(b))
                if frozenset((ia, ib)) not in joints:
                    kept.append(d)
            sim["damper"] = kept
            if not kept:
                del sim["damper"]
    doc.setdefault("rig", {})["mechanism"] = os.path.relpath(mech_path.resolve(), out_path.resolve().parent)
    lines = [f"# Identified by rigstate identify from {', '.join(sources)}; base: {rig.path}"]
    for prm, s, ok in zip(result.params, result.sigma, result.identifiable, strict=False):
        lines.append(f"#   {prm.name} = {prm.value:.6g} ± {s:.2g} {prm.unit}" + ("" if ok else "  (NOT IDENTIFIABLE)"))
    out_path.write_text("\n".join(lines) + "\n" + tomli_w.dumps(doc))
    written.insert(0, str(out_path))
    return written


def format_report(result: Result) -> str:
    """Table of the parameters (estimate, 1σ, prior, identifiable) and their correlations."""
    def show(prm: Param, v: float) -> tuple[float, str]:
        if prm.kind == "mount":
            return math.degrees(v), "deg"
        if prm.kind == "gyro_bias":
            return math.degrees(v), "deg/s"
        if prm.kind == "time_offset":
            return v * 1e3, "ms"
        return v, prm.unit

    lines = [f"{'parameter':28s} {'initial':>12s} {'estimate':>12s} {'1 sigma':>10s}  unit      identifiable"]
    for prm, v, s, ok, why in zip(result.params, result.estimate, result.sigma, result.identifiable, result.reasons, strict=False):
        p0, unit = show(prm, prm.prior)
        pv, _ = show(prm, v)
        ps, _ = show(prm, s)
        lines.append(f"{prm.name:28s} {p0:12.6g} {pv:12.6g} {ps:10.3g}  {unit:9s} {'yes' if ok else 'NO: ' + why}")
    P = len(result.params)
    if P > 1:
        lines.append("correlations:")
        width = max(len(p.name) for p in result.params)
        for i, prm in enumerate(result.params):
            lines.append(f"  {prm.name:{width}s} " + " ".join(f"{result.correlation[i, j]:+.2f}" for j in range(P)))
    lines.append(f"reduced chi2 {result.reduced_chi2:.3f}; condition number of the (normalised) data information "
                 f"{result.condition:.3g}; {result.iterations} iterations, {result.seconds:.1f} s")
    return "\n".join(lines)

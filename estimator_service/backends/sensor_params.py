"""Estimated sensor parameters shared by every backend: biases per fused axis, IMU time offsets and the in-plane
mount angles of fused accelerometers.

Parameter vector p (``SensorParams.dim``), constant between random-walk increments:

- a bias per fused gyro axis (and per fused accelerometer axis if its prior is > 0), in the
  sensor's units (rad/s, m/s²): the reading is h + b;
- a residual time offset δ per IMU (s) whose ``time_offset_prior_s`` is > 0 (except the reference
  IMU, below), on top of the rig's known ``time_offset_s`` that the pipeline already takes off the
  stamps: the IMU stamps a sample taken at t − δ with t, so the reading stamped t is
  h(x(t − δ)) ≈ h − δ ḣ.  ḣ is exact for gyros (ω̇ = qeᵀ A q̈e, the body-rate bilinear form
  evaluated at q̈, since q̇eᵀ A q̇e = 0) and inclinations (φ̇ = ω); an accelerometer's ḣ would need
  the jerk and is taken as 0 (its time offset is not modelled);
- a residual in-plane mount angle μ (rad) per fused accelerometer whose ``mount_prior`` is > 0, on top of the
  rig's ``mount_deg`` (already in its axes): the axes rotated by μ about body z read y = A₂ R(φ + μ)ᵀ (a_P − g),
  so ∂y/∂μ = ∂y/∂φ, the reading of in-plane axes rotated by 90° (sensors.Accelerometer.h_mounted).

Measurement of sensor i: y = h(q, q̇, q̈; μ) − δ ḣ(q, q̈) + b, with Jacobians w.r.t. q, q̇, q̈ and p.

Identifiability (1-DOF mechanism, gyros only): the rates of the bodies are tied by the kinematics,
so a gyro bias shows up as a rate ratio that disagrees with the configuration; two gyro biases and
the unknown DOF force are told apart only through the dynamics (a biased rate integrates to a
drifting angle that gravity contradicts).  They converge while the mechanism moves; at rest a
common bias and a constant DOF force are not separable.  A common time offset of every IMU is
not observable at all (the dynamics are time-invariant: a shifted trajectory fits as well), so
without a time reference (a fused encoder, or an IMU whose offset is known: ``time_offset_prior_s = 0``) the first
fused IMU is the reference (offset 0) and the others' offsets are estimated relative to it, which is
observable through the kinematics whenever the mechanism accelerates.  If the reference IMU itself
is late, the estimates are late by as much.  An accelerometer's mount μ and its body's angle φ enter its
reading only as φ + μ: μ is told apart from φ by the other sensors and the dynamics, which fix φ (the body's
gyro integrates to φ up to a constant that gravity's pull on the mechanism sets, the kinematics tie φ to the
other bodies' gyros); at rest μ and the mechanism's pose are separable only through gravity's equilibrium.
"""

from __future__ import annotations

import math

import numpy as np

from estimator_service.kernels import (ACCELEROMETER, COMMAND_POSITION, COMMAND_VELOCITY, ENCODER, GYRO, INCLINATION,
                                       SensorTable, sparse_forms)
from estimator_service.sensors import Accelerometer, DriveCommand, Encoder, Gyro, Inclination, VirtualSensor


#: :meth:`SensorParams.report`: (biases, time offsets s, accelerometer mounts deg or None)
Report = tuple[dict[str, list[float]], dict[str, float], dict[str, float] | None]


class SensorParams:
    """Layout, priors and measurement function of the sensor parameters of a list of fused sensors."""

    def __init__(self, sensors: list[VirtualSensor]) -> None:
        self.sensors = sensors
        names, prior, walk = [], [], []
        #: per sensor: (indices into p of its biased axes, the axes) — empty when unbiased
        self.bias: list[tuple[np.ndarray, np.ndarray]] = []
        #: per sensor: index into p of its IMU's estimated time offset, or None
        self.offset_index: list[int | None] = []
        #: per sensor: index into p of its estimated residual mount angle μ (rad; accelerometers), or None
        self.mount_index: list[int | None] = []
        offsets: dict[str, int] = {}
        # Without a time reference (a fused encoder or an IMU with a known offset) the first IMU is the
        # reference: a common offset of every IMU is unobservable (the dynamics are time-invariant).
        timed = [s for s in sensors if isinstance(s, (Gyro, Inclination))]
        has_ref = any(s.kind == "enc" for s in sensors) or any(s.time_offset_prior_s <= 0 for s in timed)
        reference = None if has_ref or not timed else timed[0].topic
        for s in sensors:
            bp = np.asarray(getattr(s, "bias_prior", np.zeros(s.dim)), float)
            axes = np.flatnonzero(bp > 0)
            idx = np.arange(len(prior), len(prior) + len(axes))
            self.bias.append((idx, axes))
            for a in axes:
                names.append(f"{s.name}.{s.kind}_bias[{a}]")
                prior.append(bp[a])
                walk.append(float(np.asarray(s.bias_walk)[a]))
            est = isinstance(s, (Gyro, Inclination)) and s.time_offset_prior_s > 0 and s.topic != reference
            if est and s.topic not in offsets:
                offsets[s.topic] = len(prior)
                names.append(f"{s.name}.time_offset")
                prior.append(float(s.time_offset_prior_s))
                walk.append(0.0)
            self.offset_index.append(offsets[s.topic] if est else None)
            mount_prior = s.mount_prior if isinstance(s, Accelerometer) else 0.0
            self.mount_index.append(len(prior) if mount_prior > 0 else None)
            if mount_prior > 0:
                names.append(f"{s.name}.mount")
                prior.append(mount_prior)
                walk.append(0.0)
        self.names = names
        self.dim = len(prior)
        self.prior = np.asarray(prior, float)
        self.walk = np.asarray(walk, float)
        self.offset_topics = {t: i for t, i in offsets.items()}
        #: (p's bytes, :meth:`report` of that p): p changes only in updates, the report is asked every step
        self._reported: tuple[bytes, Report] | None = None
        #: per sensor: (report key, dim, [(axis, index into p)], name, known offset s, offset index or None,
        #: stated mount rad (None: not an accelerometer), mount index or None)
        self._report_plan = [(f"{s.name}.{s.kind}", s.dim, list(zip(axes.tolist(), idx.tolist(), strict=True)), s.name,
                              s.time_offset_s, k, s.mount if isinstance(s, Accelerometer) else None, km)
                             for s, (idx, axes), k, km in zip(sensors, self.bias, self.offset_index, self.mount_index,
                                                              strict=True)]

    def sensor_table(self) -> SensorTable | None:
        """The sensors' arrays for the compiled measurement kernels (None without sensors)."""
        if not self.sensors:
            return None
        model = self.sensors[0].model
        t = SensorTable.empty(len(self.sensors), model.ne, model.gravity)
        for i, s in enumerate(self.sensors):
            t.dims[i] = s.dim
            if s.is_input:
                continue  # a drive's torque: an input, never read (backends/drive_inputs.py)
            if isinstance(s, DriveCommand):
                t.kind[i] = COMMAND_POSITION if s.kind == "pos" else COMMAND_VELOCITY
                t.coordinate[i] = s.coordinate
                continue  # (no body, bias or time offset)
            t.body_points[i] = model.arrays.body_geom[s.body][:4]
            t.mount_state[i] = -1 if self.mount_index[i] is None else self.mount_index[i]
            if isinstance(s, Gyro):
                t.kind[i] = GYRO
                t.rate_form[i] = model.arrays.omega_A[s.body]
                t.col[i] = s.col
            elif isinstance(s, Accelerometer):
                t.kind[i] = ACCELEROMETER
                t.axes2[i] = s.A2
                t.point[i] = model.point_matrix(s.body, s.at)
            elif isinstance(s, Inclination):
                t.kind[i] = INCLINATION
                t.rate_form[i] = model.arrays.omega_A[s.body]
                t.mount[i] = s.mount
            elif isinstance(s, Encoder):
                t.kind[i] = ENCODER
                t.coordinate[i] = -1 if s.coordinate is None else s.coordinate
                if s.relative_to is not None:
                    t.relative_points[i] = model.arrays.body_geom[s.relative_to][:4]
            else:
                continue  # another kind of sensor: the reference path (SensorParams.measure)
            t.offset[i] = -1 if self.offset_index[i] is None else self.offset_index[i]
            idx, axes = self.bias[i]
            t.bias[i, axes] = idx
        return t._replace(rate_nz=sparse_forms(t.rate_form))

    def measure(self, i: int, q: np.ndarray, qd: np.ndarray, qdd: np.ndarray, p: np.ndarray,
                jac: bool = True) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(y, ∂y/∂q, ∂y/∂q̇, ∂y/∂q̈, ∂y/∂p) of sensor i at (q, q̇, q̈) with parameters p."""
        s = self.sensors[i]
        Hp = np.zeros((s.dim, self.dim))
        km = self.mount_index[i]
        if km is not None:
            y, Hq, Hqd, Hqdd, Hp[:, km] = s.h_mounted(q, qd, qdd, p[km])
        else:
            y, Hq, Hqd, Hqdd = s.h(q, qd, qdd)
        y = np.array(y, dtype=float)
        k = self.offset_index[i]
        if k is not None:
            delta = p[k]
            d, dq, dqd, dqdd = self._rate(s, q, qd, qdd)
            y -= delta * d
            if jac:
                Hq, Hqd, Hqdd = Hq - delta * dq, Hqd - delta * dqd, Hqdd - delta * dqdd
            Hp[:, k] = -d
        idx, axes = self.bias[i]
        if len(idx):
            y[axes] += p[idx]
            Hp[axes, idx] = 1.0
        return y, Hq, Hqd, Hqdd, Hp

    @staticmethod
    def _rate(s: VirtualSensor, q, qd, qdd):
        """(ḣ, ∂ḣ/∂q, ∂ḣ/∂q̇, ∂ḣ/∂q̈) of a gyro or an inclination."""
        n = len(q)
        if isinstance(s, Gyro):
            wd, wd_q, wd_qdd = s.model.body_rate(q, qdd, s.body)
            return s.col * wd, np.outer(s.col, wd_q), np.zeros((3, n)), np.outer(s.col, wd_qdd)
        w, w_q, w_qd = s.model.body_rate(q, qd, s.body)
        return np.array([w]), w_q[None, :], w_qd[None, :], np.zeros((1, n))

    def report(self, p: np.ndarray) -> Report:
        """(bias map: sensor name.kind -> per-axis bias, sensor units, 0 where not estimated;
        time offsets: IMU name -> s, the known offset plus the estimated residual, where either is set;
        accelerometer mounts: IMU name -> deg, the stated ``mount_deg`` plus the estimated residual, where either is
        set; None where neither is, so that a rig without a fused accelerometer publishes what it did before).

        Read-only: the same maps are returned again while p is bit for bit the same."""
        key = p.tobytes()
        if self._reported is None or self._reported[0] != key:
            self._reported = key, self._report(p)
        return self._reported[1]

    def _report(self, p: np.ndarray) -> Report:
        """:meth:`report`, built anew (from p as Python floats: a few numbers, asked after every update)."""
        pl = p.tolist()
        bias: dict[str, list[float]] = {}
        offs: dict[str, float] = {}
        mounts: dict[str, float] = {}
        for key, dim, axes, name, known, k, mount, km in self._report_plan:
            if axes:
                b = [0.0] * dim
                for a, j in axes:
                    b[a] = pl[j]
                bias[key] = b
            if k is not None or known != 0.0:
                offs[name] = known + (pl[k] if k is not None else 0.0)
            if km is not None or mount:
                mounts[name] = math.degrees(mount + (pl[km] if km is not None else 0.0))
        return bias, offs, mounts or None

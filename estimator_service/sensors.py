"""Virtual sensors: measurement functions h(q, q̇, q̈) with analytic Jacobians, and noise models.

Frames: the body frame has x along the body's first→second point, y CCW-perpendicular in the
plane, z out of the plane.  A sensor's axes are given in the body frame by a 3×3 matrix ``A``
(row i = sensor axis i), so a body-frame vector v reads ``A v`` on the sensor.

- Gyro: body angular rate ω (rad/s, CCW) about body z → ``A[:, 2] ω``.
- Accelerometer: proper acceleration a_P − g of the mounting point (m/s²), in the body frame, then
  sensor axes.  At rest with body x pointing up it reads +9.81 on body x.
- Encoder: angle (rad, continuous) of a body relative to ground or to another body; quadrature
  counts with ``cpr = 4 · lines`` and a zero ``offset`` (count 0 reads ``offset``).
- Inclination: body angle φ (rad), as an IMU's orientation output gives it.
- Drive command (``act/<name>``): what a motor controller commands of the DOF it drives, its position z (rad
  or m) or velocity ż, read as a measurement of that DOF within the stated tracking error.
- Drive torque (``act/<name>``): the torque (N·m, or N for a length DOF) a motor controller applies to its DOF,
  no measurement but a known input the backends apply to the DOF force (backends/drive_inputs.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from estimator_service.angles import counts_to_angle
from estimator_service.model import Model
from estimator_service.schema import SchemaError

AXES = {"+x": (1, 0, 0), "-x": (-1, 0, 0), "+y": (0, 1, 0), "-y": (0, -1, 0), "+z": (0, 0, 1), "-z": (0, 0, -1)}


def axes_matrix(axes: object) -> np.ndarray:
    """3×3 sensor-axes matrix from three strings like ``["+x", "-z", "+y"]`` (a proper rotation)."""
    if not isinstance(axes, list) or len(axes) != 3 or any(a not in AXES for a in axes):
        raise ValueError(f"expected three axis names, got {axes!r}")
    A = np.array([AXES[a] for a in axes], dtype=float)
    if abs(np.linalg.det(A) - 1.0) > 1e-9:
        raise ValueError(f"axes {axes} do not form a right-handed frame")
    return A


def mount_axes(axes: np.ndarray, angle: float) -> np.ndarray:
    """Axes matrix of a sensor mounted rotated by ``angle`` (rad, CCW about body z) from ``axes``.

    A body-frame vector v reads ``axes @ Rz(angle)ᵀ v`` on the rotated sensor.
    """
    if angle == 0.0:
        return axes
    c, s = math.cos(angle), math.sin(angle)
    return axes @ np.array([[c, s, 0.0], [-s, c, 0.0], [0.0, 0.0, 1.0]])


@dataclass
class NoiseModel:
    """White noise ``sigma``, constant ``bias`` and quantisation step ``lsb`` (0 = none), per axis."""

    sigma: np.ndarray
    bias: np.ndarray
    lsb: float = 0.0

    def sample(self, y: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """A noisy reading of the true value ``y``."""
        out = y + self.bias + self.sigma * rng.standard_normal(len(y))
        if self.lsb > 0:
            out = np.round(out / self.lsb) * self.lsb
        return out


class VirtualSensor:
    """Base: ``name`` (rig sensor), ``topic``, ``kind``, ``dim``, ``sigma`` (dim,) for fusion."""

    kind = ""
    field = ""
    #: a known input the backends apply (DriveTorque), not a reading they fuse through ``h``
    is_input = False

    def __init__(self, name: str, topic: str, model: Model, sigma: np.ndarray) -> None:
        self.name, self.topic, self.model = name, topic, model
        self.sigma = np.asarray(sigma, dtype=float)
        self.dim = len(self.sigma)
        #: estimation (backends/sensor_params.py): prior std and random-walk density of each axis's
        #: bias (0 = no bias state); the IMU's known time offset (s, applied by the pipeline) and the
        #: prior std (s) of an estimated residual offset (0 = none)
        self.bias_prior = np.zeros(self.dim)
        self.bias_walk = np.zeros(self.dim)
        self.time_offset_s = 0.0
        self.time_offset_prior_s = 0.0

    def set_estimation(self, bias_prior: float, bias_walk: float, time_offset_s: float = 0.0,
                       time_offset_prior_s: float = 0.0) -> None:
        """Bias states on the axes that read the planar motion (prior std, walk density; 0 = none), the
        known time offset (s) and the prior std of the residual offset state (s; 0 = none).  The other
        axes read only noise in the model: no bias state."""
        planar = self.planar_axes()
        self.bias_prior = np.where(planar, bias_prior, 0.0)
        self.bias_walk = np.where(planar, bias_walk, 0.0)
        self.time_offset_s = float(time_offset_s)
        self.time_offset_prior_s = float(time_offset_prior_s)

    def h(self, q: np.ndarray, qd: np.ndarray, qdd: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(y, ∂y/∂q, ∂y/∂q̇, ∂y/∂q̈) at a state (q, q̇, q̈); y (dim,), Jacobians (dim, n)."""
        raise NotImplementedError

    def planar_axes(self) -> np.ndarray:
        """Which axes (dim,) can read the planar motion (gyro: along body z; accelerometer: in the plane)."""
        return np.zeros(self.dim, bool)

    def measure(self, msg: dict) -> np.ndarray:
        """The measured value in a validated bus message of ``topic``."""
        return np.asarray(msg[self.field], dtype=float)


class Gyro(VirtualSensor):
    """``cal_bias`` (rad/s, sensor axes): a known bias subtracted from every reading (default zeros);
    ``cal_scale`` (per axis, > 0): a known scale factor the reading is then divided by (default ones)."""

    kind, field = "gyr", "gyr"

    def __init__(self, name: str, topic: str, model: Model, body: int, axes: np.ndarray, noise: NoiseModel,
                 cal_bias: np.ndarray | None = None, cal_scale: np.ndarray | None = None) -> None:
        super().__init__(name, topic, model, noise.sigma)
        self.body, self.col, self.noise = body, axes[:, 2].copy(), noise
        self.cal_bias = np.zeros(3) if cal_bias is None else np.asarray(cal_bias, dtype=float)
        self.cal_scale = None if cal_scale is None or np.all(cal_scale == 1.0) else np.asarray(cal_scale, dtype=float)

    def measure(self, msg: dict) -> np.ndarray:
        y = np.asarray(msg[self.field], dtype=float) - self.cal_bias
        return y if self.cal_scale is None else y / self.cal_scale

    def planar_axes(self) -> np.ndarray:
        return np.abs(self.col) > 0.5

    def h(self, q, qd, qdd):
        w, w_q, w_qd = self.model.body_rate(q, qd, self.body)
        n = len(q)
        return self.col * w, np.outer(self.col, w_q), np.outer(self.col, w_qd), np.zeros((3, n))


class Accelerometer(VirtualSensor):
    """``cal_bias`` (m/s², sensor axes): a known bias subtracted from every reading (default zeros).

    ``mount`` (rad): the rig's stated in-plane mount angle, already in ``axes``; ``mount_prior`` (rad): the prior
    std of a residual mount angle μ on top of it that the estimators learn (backends/sensor_params.py; 0 = none).
    The sensor's axes rotated by μ about body z read ``A₂ R(φ + μ)ᵀ (a_P − g)``: μ adds to the body angle φ."""

    kind, field = "acc", "acc"

    def __init__(self, name: str, topic: str, model: Model, body: int, at: tuple[float, float],
                 axes: np.ndarray, noise: NoiseModel, cal_bias: np.ndarray | None = None) -> None:
        super().__init__(name, topic, model, noise.sigma)
        self.body, self.at, self.A2, self.noise = body, at, axes[:, :2].copy(), noise
        self.cal_bias = np.zeros(3) if cal_bias is None else np.asarray(cal_bias, dtype=float)
        self.mount = 0.0
        self.mount_prior = 0.0

    def set_mount(self, mount: float, mount_prior: float) -> None:
        """The stated mount angle (rad, in the axes already) and the prior std (rad) of a residual mount state."""
        self.mount, self.mount_prior = float(mount), float(mount_prior)

    def measure(self, msg: dict) -> np.ndarray:
        return np.asarray(msg[self.field], dtype=float) - self.cal_bias

    def planar_axes(self) -> np.ndarray:
        return np.abs(self.A2).sum(axis=1) > 0.5

    def h(self, q, qd, qdd):
        return self.h_mounted(q, qd, qdd, 0.0)[:4]

    def mount_jacobian(self, y: np.ndarray) -> np.ndarray:
        """∂y/∂μ (3,) at the reading ``y`` (m/s², sensor axes, bias taken off): the in-plane part of y turned by
        90° (:meth:`h_mounted`'s last output, from the reading instead of the state)."""
        u = self.A2.T @ y  # the in-plane reading R(φ + μ)ᵀ v
        return self.A2 @ np.array([u[1], -u[0]])

    def h_mounted(self, q: np.ndarray, qd: np.ndarray, qdd: np.ndarray, mu: float
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(y, ∂y/∂q, ∂y/∂q̇, ∂y/∂q̈, ∂y/∂μ) with the axes rotated by a further ``mu`` (rad, CCW about body z):
        y = A₂ R(φ + μ)ᵀ v, v = a_P − g (m/s², global); ∂y/∂μ = ∂y/∂φ = A₂ R(φ + μ + 90°)ᵀ v, the reading of
        in-plane axes rotated by 90°."""
        m = self.model
        a, a_q, a_qd, a_qdd = m.point_acceleration(q, qd, qdd, self.body, self.at)
        phi, phi_q = m.body_angle(q, self.body)
        c, s = math.cos(phi + mu), math.sin(phi + mu)
        Rt = np.array([[c, s], [-s, c]])  # global -> the sensor's in-plane frame
        dRt = np.array([[-s, c], [-c, -s]])  # d Rt / d phi
        v = a - m.gravity
        ARt = self.A2 @ Rt
        y = ARt @ v
        y_phi = self.A2 @ (dRt @ v)
        return y, np.outer(y_phi, phi_q) + ARt @ a_q, ARt @ a_qd, ARt @ a_qdd, y_phi


class Inclination(VirtualSensor):
    """The IMU's angle: body angle plus the mounting angle ``mount`` (rad)."""

    kind, field = "incl", "quat"

    def __init__(self, name: str, topic: str, model: Model, body: int, axes: np.ndarray, sigma: float,
                 mount: float = 0.0) -> None:
        super().__init__(name, topic, model, np.array([sigma]))
        self.body, self.axis, self.mount = body, axes[:, 2].copy(), mount

    def h(self, q, qd, qdd):
        phi, phi_q = self.model.body_angle(q, self.body)
        n = len(q)
        return np.array([phi + self.mount]), phi_q[None, :], np.zeros((1, n)), np.zeros((1, n))

    def quaternion(self, phi: float) -> np.ndarray:
        """Orientation [w, x, y, z] reported by the IMU: rotation by φ about its axis along body z."""
        return np.concatenate([[math.cos(phi / 2)], math.sin(phi / 2) * self.axis])

    def measure(self, msg: dict) -> np.ndarray:
        quat = msg.get("quat")
        if quat is None:
            raise SchemaError(f"{self.topic}: field 'quat' is needed for the inclination of {self.name!r}")
        w, v = quat[0], np.asarray(quat[1:])
        return np.array([2.0 * math.atan2(float(v @ self.axis), w)])


class Encoder(VirtualSensor):
    kind, field = "enc", "count"

    def __init__(self, name: str, topic: str, model: Model, body: int, relative_to: int | None,
                 cpr: int, offset: float, sigma: float) -> None:
        super().__init__(name, topic, model, np.array([sigma]))
        self.body, self.relative_to, self.cpr, self.offset = body, relative_to, cpr, offset
        # a body measured against the ground whose angle is a coordinate of q: use it (continuous)
        self.coordinate: int | None = None
        if relative_to is None:
            pts = model.mech.bodies[body].points[:2]
            for k, rc in enumerate(model.mech.relative_coordinates):
                if (rc.a, rc.b) == tuple(pts):
                    self.coordinate = model.n - len(model.mech.relative_coordinates) + k

    def h(self, q, qd, qdd):
        n = len(q)
        J = np.zeros((1, n))
        if self.coordinate is not None:
            J[0, self.coordinate] = 1.0
            return np.array([q[self.coordinate]]), J, np.zeros((1, n)), np.zeros((1, n))
        phi, phi_q = self.model.body_angle(q, self.body)
        if self.relative_to is not None:
            phi_b, phi_b_q = self.model.body_angle(q, self.relative_to)
            phi, phi_q = phi - phi_b, phi_q - phi_b_q
        J[0] = phi_q
        return np.array([phi]), J, np.zeros((1, n)), np.zeros((1, n))

    def to_counts(self, angle: float) -> int:
        """Quadrature count of an angle (rad): round((angle − offset) · cpr / 2π)."""
        return int(round((angle - self.offset) * self.cpr / (2 * math.pi)))

    def from_counts(self, count: int) -> float:
        """Angle (rad) of a count."""
        return counts_to_angle(count, self.cpr, self.offset)

    def measure(self, msg: dict) -> np.ndarray:
        if msg["cpr"] != self.cpr:
            raise SchemaError(f"{self.topic}: field 'cpr': the rig says {self.cpr} counts per revolution, got {msg['cpr']}")
        return np.array([self.from_counts(msg["count"])])


class DriveSignal(VirtualSensor):
    """What a motor controller publishes on ``act/<name>`` about the DOF ``dof`` (index into z) it drives: its
    message field ``field`` (bus schema ``act``), the sampling period ``period_s`` it is held for (s) and the age
    ``max_age_s`` (s) after which it is stale (not used, and a torque no longer held)."""

    def __init__(self, name: str, topic: str, model: Model, dof: int, sigma: float, period_s: float,
                 max_age_s: float) -> None:
        super().__init__(name, topic, model, np.array([sigma]))
        self.dof, self.coordinate = dof, int(model.dof[dof])
        self.period_s, self.max_age_s = period_s, max_age_s

    def measure(self, msg: dict) -> np.ndarray:
        v = msg.get(self.field)
        if v is None:
            raise SchemaError(f"{self.topic}: field {self.field!r} is needed for the drive of {self.name!r}")
        return np.array([float(v)])


class DriveCommand(DriveSignal):
    """A commanded position (``kind`` "pos", rad or m) or velocity ("vel", rad/s or m/s) of the DOF: a reading
    y = z or ż of it, within ``sigma`` (the drive's tracking error)."""

    def __init__(self, name: str, topic: str, model: Model, dof: int, what: str, sigma: float, period_s: float,
                 max_age_s: float) -> None:
        super().__init__(name, topic, model, dof, sigma, period_s, max_age_s)
        self.kind, self.field = {"position": ("pos", "position"), "velocity": ("vel", "velocity")}[what]

    def h(self, q, qd, qdd):
        n = len(q)
        J, zero = np.zeros((1, n)), np.zeros((1, n))
        J[0, self.coordinate] = 1.0
        if self.kind == "pos":
            return np.array([q[self.coordinate]]), J, zero, zero.copy()
        return np.array([qd[self.coordinate]]), zero, J, zero.copy()


class DriveTorque(DriveSignal):
    """The drive's torque on the DOF (N·m, or N for a length DOF): a known generalized force, held from its
    message until the next one (``sigma``: the error of each value), not a reading of the state (no ``h``).
    A value beyond ``limit`` (N·m or N; None: no limit) is implausible: refused as malformed."""

    kind, field = "tau", "torque"
    is_input = True

    def __init__(self, name: str, topic: str, model: Model, dof: int, sigma: float, period_s: float,
                 max_age_s: float, limit: float | None = None) -> None:
        super().__init__(name, topic, model, dof, sigma, period_s, max_age_s)
        self.limit = limit

    def measure(self, msg: dict) -> np.ndarray:
        y = super().measure(msg)
        if self.limit is not None and not abs(y[0]) <= self.limit:
            raise SchemaError(f"{self.topic}: field 'torque': {y[0]:g} is beyond the drive's limit {self.limit:g}")
        return y

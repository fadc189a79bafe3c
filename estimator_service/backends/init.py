"""Initial state of a backend, from the rig's ``[estimator.init]`` and the first sensor messages.

Modes (docs/config.md):
- ``pose``: named DOF values from the config (``crank_deg = 90``, optional ``crank_error_deg`` added
  on purpose, ``crank_rate``), starting at the time of the first sensor message.
- ``encoder``: the first reading of encoder ``encoder = "<name>"``; the mechanism at rest.
- ``gravity``: the rig at rest; the mean accelerometer reading of IMU ``imu = "<name>"`` over
  ``samples`` messages gives the body's angle from the gravity direction; the position problem is
  solved for the DOF that puts the body at that angle, on the branch closest to ``<dof>_hint_deg``
  (default: the mechanism file's assembly).
"""

from __future__ import annotations

import math

import numpy as np

from estimator_service.angles import wrap_angle
from estimator_service.errors import ConfigError
from estimator_service.model import AssemblyError, Model
from estimator_service.sensors import Accelerometer, Encoder


def z_for_body_angle(model: Model, body: int, angle: float, relative_to: int | None = None,
                     hint: float | None = None) -> np.ndarray:
    """Assembled q with the body at ``angle`` (rad, relative to ground or another body), 1-DOF rigs.

    Scans the DOF over a full turn, refines each candidate by Newton on the DOF and returns the
    solution whose DOF value is closest to ``hint`` (the configured branch).
    """
    if model.g != 1:
        raise ValueError(f"initialisation from one body angle needs a 1-DOF mechanism, this one has {model.g}")
    z_ref = float(model.q0[model.dof][0]) if hint is None else hint

    def angle_of(q: np.ndarray) -> tuple[float, np.ndarray]:
        phi, phi_q = model.body_angle(q, body)
        if relative_to is not None:
            phi_b, phi_b_q = model.body_angle(q, relative_to)
            phi, phi_q = phi - phi_b, phi_q - phi_b_q
        return phi, phi_q

    best: tuple[float, np.ndarray] | None = None
    q = model.q0.copy()
    for k in range(36):
        z = z_ref + math.radians(10 * k)
        try:
            q = model.solve_position(q, np.array([z]))
            for _ in range(30):
                phi, phi_q = angle_of(q)
                err = wrap_angle(phi - angle)
                if abs(err) < 1e-12:
                    break
                slope = float(phi_q @ model.R(q)[:, 0])
                if abs(slope) < 1e-9:
                    break
                z = float(q[model.dof][0]) - err / slope
                q = model.solve_position(q, np.array([z]))
        except AssemblyError:
            continue
        if abs(wrap_angle(angle_of(q)[0] - angle)) < 1e-9:
            dist = abs(wrap_angle(float(q[model.dof][0]) - z_ref))
            if best is None or dist < best[0] - 1e-9:
                best = (dist, q.copy())
    if best is None:
        raise AssemblyError(f"{model.mech.source}: no assembly puts body {model.mech.bodies[body].name!r} at {math.degrees(angle):.3f} deg")
    q = best[1]
    q[model.dof] = z_ref + wrap_angle(float(q[model.dof][0]) - z_ref)  # continuous DOF near the hint
    return model.solve_position(q, q[model.dof])


def q_from_encoder(model: Model, encoder: Encoder, angle: float, q_branch: np.ndarray) -> np.ndarray:
    """Assembled q in which ``encoder`` reads ``angle`` (rad), on the branch of ``q_branch``.

    An encoder on a DOF coordinate sets it directly (the other DOFs keep ``q_branch``'s values);
    otherwise the position problem is solved for the DOF that puts the body at that angle, taking
    the solution closest to ``q_branch``'s DOF value (1-DOF mechanisms).
    """
    dof = list(model.dof)
    if encoder.coordinate is not None and encoder.coordinate in dof:
        z = q_branch[model.dof].copy()
        z[dof.index(encoder.coordinate)] = angle
        return model.solve_position(q_branch, z)
    return z_for_body_angle(model, encoder.body, angle, encoder.relative_to, float(q_branch[model.dof][0]))


def body_angle_at_rest(model: Model, acc: Accelerometer, mean_reading: np.ndarray) -> float:
    """Angle φ (rad) of the accelerometer's body from its mean reading at rest (m/s², sensor axes).

    At rest the proper acceleration is −g; in the body frame it reads Rᵀ(φ)(−g), so φ is the angle
    of −g in the global frame minus the angle of the reading in the body frame.
    """
    v_body = acc.A2.T @ mean_reading
    g_up = -model.gravity / np.linalg.norm(model.gravity)
    return math.atan2(g_up[1], g_up[0]) - math.atan2(v_body[1], v_body[0])


#: a resuming initialiser measures the DOF rate from a fused encoder over at least this span (s): the
#: slope at the last reading of a quadratic fitted to the readings (the rig may be accelerating)
RESUME_RATE_SPAN_S = 0.03


class Initializer:
    """Watches the first messages and returns (t0, q, q̇) once the configured mode can start.

    ``resume``: the last estimated q when the estimator re-initialises after a reset (a silence, a
    source restart) or a failed step, not at its first start.  The rig has moved since: mode ``pose``
    (a pose the rig is put in before a run) then starts from the first fused encoder instead — its
    angle on the branch of ``resume`` and its rate over :data:`RESUME_RATE_SPAN_S` of readings — or, without a
    fused encoder, from ``resume`` at rest.  Modes ``encoder`` and ``gravity`` measure as at the start.
    """

    def __init__(self, model: Model, rig, sensors: list, resume: np.ndarray | None = None) -> None:
        self.model, self.rig = model, rig
        self.resume = None if resume is None else np.array(resume, dtype=float)
        #: encoder readings (t, angle) collected for the rate (resuming, or a driven rig in encoder mode)
        self._resume_enc = next((s for s in sensors if isinstance(s, Encoder)), None)
        self._resume_readings: list[tuple[float, float]] = []
        cfg = dict(rig.estimator.init)
        self.source = rig.estimator.source
        self.mode = cfg.pop("mode", "pose")
        self.cfg = cfg
        self._acc_sum = None
        self._acc_n = 0
        if self.mode == "pose":
            dof_keys = {f"{d}{sfx}" for d in model.dof_names for sfx in ("", "_deg", "_rate", "_error_deg")}
        else:
            dof_keys = {f"{d}_hint_deg" for d in model.dof_names}
        names = {"pose": set(), "encoder": {"encoder"}, "gravity": {"imu", "samples"}}[self.mode]
        for key, value in cfg.items():
            field = f"estimator.init.{key}"
            if key not in dof_keys | names:
                raise ConfigError(self.source, field, f"unknown key for mode {self.mode!r}; known: {sorted(dof_keys | names)}")
            if key in dof_keys and (isinstance(value, bool) or not isinstance(value, (int, float))):
                raise ConfigError(self.source, field, f"expected a number, got {value!r}")
        all_sensors = rig.all_virtual_sensors(model)
        if self.mode == "encoder":
            name = cfg.get("encoder")
            self.encoder = next((s for s in all_sensors if isinstance(s, Encoder) and s.name == name), None)
            if self.encoder is None:
                known = [s.name for s in all_sensors if isinstance(s, Encoder)]
                raise ConfigError(self.source, "estimator.init.encoder", f"unknown encoder {name!r}; encoders: {known}")
        if self.mode == "gravity":
            name = cfg.get("imu")
            self.acc = next((s for s in all_sensors if isinstance(s, Accelerometer) and s.name == name), None)
            if self.acc is None:
                known = [s.name for s in all_sensors if isinstance(s, Accelerometer)]
                raise ConfigError(self.source, "estimator.init.imu", f"unknown imu {name!r}; imus: {known}")
            self.samples = cfg.get("samples", 20)
            if isinstance(self.samples, bool) or not isinstance(self.samples, int) or self.samples < 1:
                raise ConfigError(self.source, "estimator.init.samples", f"expected an integer >= 1, got {self.samples!r}")

    def pose(self) -> tuple[np.ndarray, np.ndarray]:
        """(q, q̇) of the configured pose, including the deliberate ``<dof>_error_deg``."""
        m = self.model
        z = m.q0[m.dof].copy()
        zd = np.zeros(m.g)
        for i, name in enumerate(m.dof_names):
            if f"{name}_deg" in self.cfg:
                z[i] = math.radians(float(self.cfg[f"{name}_deg"]))
            elif name in self.cfg:
                z[i] = float(self.cfg[name])
            z[i] += math.radians(float(self.cfg.get(f"{name}_error_deg", 0.0)))
            zd[i] = float(self.cfg.get(f"{name}_rate", 0.0))
        q = m.solve_position(m.q0, z)
        return q, m.solve_velocity(q, zd)

    def branch(self) -> np.ndarray:
        """The configured branch: q assembled at the ``<dof>_hint_deg`` values, else the file's q0."""
        m = self.model
        z = m.q0[m.dof].copy()
        for i, name in enumerate(m.dof_names):
            if f"{name}_hint_deg" in self.cfg:
                z[i] = math.radians(float(self.cfg[f"{name}_hint_deg"]))
        return m.solve_position(m.q0, z)

    def offer(self, topic: str, msg: dict) -> tuple[float, np.ndarray, np.ndarray] | None:
        """Feed a validated sensor message; returns (t0, q, q̇) when initialisation is possible."""
        m = self.model
        if self.mode == "pose" and self.resume is not None:
            return self._offer_resume(topic, msg)
        if self.mode == "pose":
            q, qd = self.pose()
            return float(msg["t"]), q, qd
        if self.mode == "encoder":
            if topic != self.encoder.topic:
                return None
            if m.driven.any():  # a drive may be running at the start: the rate from the first readings too
                return self._from_encoder(self.encoder, self.branch(), msg)
            q = q_from_encoder(m, self.encoder, float(self.encoder.measure(msg)[0]), self.branch())
            return float(msg["t"]), q, np.zeros(m.n)
        if topic != self.acc.topic:
            return None
        y = self.acc.measure(msg)
        self._acc_sum = y if self._acc_sum is None else self._acc_sum + y
        self._acc_n += 1
        if self._acc_n < self.samples:
            return None
        phi = body_angle_at_rest(m, self.acc, self._acc_sum / self._acc_n)
        q = z_for_body_angle(m, self.acc.body, phi, None, float(self.branch()[m.dof][0]))
        return float(msg["t"]), q, np.zeros(m.n)

    def _offer_resume(self, topic: str, msg: dict) -> tuple[float, np.ndarray, np.ndarray] | None:
        """Mode ``pose`` resuming: from the fused encoder's angle and rate, else the last pose at rest."""
        m, enc = self.model, self._resume_enc
        if enc is None:
            return float(msg["t"]), m.solve_position(self.resume, self.resume[m.dof]), np.zeros(m.n)
        if topic != enc.topic:
            return None
        return self._from_encoder(enc, self.resume, msg)

    def _from_encoder(self, enc: Encoder, branch: np.ndarray, msg: dict) -> tuple[float, np.ndarray, np.ndarray] | None:
        """(t, q, q̇) from an encoder's angle (on the branch of ``branch``) and its rate over
        :data:`RESUME_RATE_SPAN_S` of its readings, once that much has been read."""
        m = self.model
        t, angle = float(msg["t"]), float(enc.measure(msg)[0])
        readings = self._resume_readings
        if readings and t <= readings[-1][0]:
            return None
        readings.append((t, angle))
        if t - readings[0][0] < RESUME_RATE_SPAN_S:
            return None
        q = q_from_encoder(m, enc, angle, branch)
        ts = np.array([r[0] for r in readings]) - t
        angles = np.unwrap([r[1] for r in readings])
        rate = float(np.polyfit(ts, angles, 2)[1]) if len(ts) >= 3 else float((angles[-1] - angles[0]) / -ts[0])
        _, dphi_dq = enc.h(q, np.zeros(m.n), np.zeros(m.n))[:2]
        R = m.R(q)
        slope = dphi_dq[0] @ R  # ∂(reading)/∂z, (g,)
        zd = np.zeros(m.g)
        k = int(np.argmax(np.abs(slope)))
        if abs(slope[k]) > 1e-9 and m.g == 1:
            zd[k] = rate / slope[k]
        return t, q, R @ zd

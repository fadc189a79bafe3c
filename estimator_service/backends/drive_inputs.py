"""Known drive inputs (``[[drive]] input = "torque"``): a motor controller's torque on the DOF it drives, held from
each ``act/<name>`` message until the next, applied by every backend through the DOF force of its state.

The state's force on a DOF is τ = b − c ⊙ ż (backends/filter.py, backends/fgs.py); on a torque-driven DOF b carries
the held torque u as well, b = b' + u, b' the force the model lacks (bearing friction): a message at t that
changes u by Δu moves b by Δu at t, a known jump that adds no uncertainty (each value's own error is white noise
held for a period: process noise on ż, Model._add_drives).  The filters move their mean's b at the message's
time; the smoother offsets the random walk of b of the step that holds it.

A torque is held at most ``max_age_s`` after its time; then it is stale (its controller fell silent): b keeps it
as its mean (a silent controller rarely drops its output) but walks as fast as the drive's torques go, by the
largest it stated per ``max_age_s`` (variance rate u_max²/max_age_s), so the sensors take the force over.  The
next message re-anchors the held torque without moving b (b followed the torque meanwhile, from the sensors); the
messages after it move b by their changes again.
"""

from __future__ import annotations

import math

import numpy as np

from estimator_service.backends.base import Measurement


class HeldTorques:
    """The held torque u (g,) of each torque-driven DOF of a backend's sensors (N·m or N), its message time, the
    largest |u| stated so far and whether it went stale; :meth:`state` / :meth:`restore` for a filter's snapshots."""

    def __init__(self, g: int, sensors: list) -> None:
        #: sensor index -> the DOF its torque drives (sensors.DriveTorque)
        self.dof = {i: s.dof for i, s in enumerate(sensors) if s.is_input}
        self._max_age = np.full(g, math.inf)
        for i, d in self.dof.items():
            self._max_age[d] = sensors[i].max_age_s
        self.u = np.zeros(g)
        self._t = np.full(g, -math.inf)
        self._largest = np.zeros(g)
        self._stale = np.ones(g, dtype=bool)  # (none held yet: it walks by 0)

    def __bool__(self) -> bool:
        return bool(self.dof)

    def apply(self, m: Measurement) -> np.ndarray:
        """Hold the torque of message ``m`` (a DriveTorque's): the change Δu (g,) of the held torques it makes b make
        (none for the first one after a stale spell: it re-anchors)."""
        d = self.dof[m.sensor]
        du = np.zeros(len(self.u))
        du[d] = float(m.y[0]) - self.u[d]
        self.u = self.u + du
        if self._stale[d] and self._t[d] > -math.inf:
            du[d] = 0.0
        self._largest = np.maximum(self._largest, np.abs(self.u))
        self._t = self._t.copy()
        self._t[d] = m.t
        self._stale = self._stale.copy()
        self._stale[d] = False
        return du

    def expire(self, t: float) -> bool:
        """Mark the torques held longer than their ``max_age_s`` at time t (s) stale; whether any went stale now."""
        gone = ~self._stale & (t - self._t > self._max_age)
        if gone.any():
            self._stale = self._stale | gone
        return bool(gone.any())

    def walk(self) -> np.ndarray:
        """Variance rate (g,) of b's walk ((N·m)²/s or N²/s): u_max²/max_age_s where the torque is stale, else 0."""
        return np.where(self._stale, np.square(self._largest) / self._max_age, 0.0)

    def prior(self) -> tuple[np.ndarray, np.ndarray]:
        """(mean, variance) (g,) of b at a (re)start beyond the backend's own prior: the held torques, uncertain
        by the largest stated where stale."""
        return self.u.copy(), np.where(self._stale, np.square(self._largest), 0.0)

    def state(self) -> tuple:
        """What :meth:`restore` takes back (the arrays are replaced, never modified in place)."""
        return self.u, self._t, self._largest, self._stale

    def restore(self, s: tuple) -> None:
        self.u, self._t, self._largest, self._stale = s

"""The backend interface: measurements in, estimates out.  Pure: no sockets, no clocks.

A backend advances in fixed steps ``dt`` of sensor time.  ``add_measurement`` buffers a sample
(any sensor, any time not before the current step); the next ``step`` uses it at its own time.
``step`` returns the estimates that became available (a chunked smoother returns several at once).
Late data: a measurement older than the current step is still used at its own time if it is newer
than :meth:`Backend.earliest_time` (the filters keep ``history_s`` of snapshots and re-run from it;
the smoother adds it to its window); callers drop and count older data.
Status of an estimate: ``ok``; ``degraded`` when no fused measurement arrived for
``degraded_after_s`` of sensor time (predictions continue); ``reinit`` on the first estimate after
a divergence was detected and the backend re-initialised.

Shared here: the parameter-table loader, divergence detection (:class:`DivergenceMonitor`) and the
restart pose after a divergence (:meth:`Backend.restart_pose`: the latest encoder reading if any,
else the last good pose, at rest).
"""

from __future__ import annotations

import math

import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass, fields
from typing import TypeVar

import numpy as np
import scipy.linalg

from estimator_service.backends.init import q_from_encoder
from estimator_service.errors import ConfigError
from estimator_service.model import AssemblyError, Model
from estimator_service.tails import chi2_isf, norm_sf

P = TypeVar("P")


def params_from_dict(cls: type[P], file: str, section: str, d: dict, positive: frozenset[str] = frozenset(),
                     choices: dict[str, tuple[str, ...]] | None = None) -> P:
    """A backend's parameter dataclass from its TOML table.

    Types follow the defaults (bool, str from ``choices``, int, float); numbers must be >= 0, and
    > 0 for the names in ``positive``.  Unknown keys and bad values raise ConfigError naming
    ``file``, ``section.key`` and the value.
    """
    known = {f.name for f in fields(cls)}  # type: ignore[arg-type]
    out = cls()
    for key, value in d.items():
        field = f"{section}.{key}"
        if key not in known:
            raise ConfigError(file, field, f"unknown key; known keys: {sorted(known)}")
        default = getattr(out, key)
        if isinstance(default, bool):
            if not isinstance(value, bool):
                raise ConfigError(file, field, f"expected true or false, got {value!r}")
        elif isinstance(default, str):
            allowed = (choices or {}).get(key, ())
            if value not in allowed:
                raise ConfigError(file, field, f"expected one of {list(allowed)}, got {value!r}")
        else:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                    (isinstance(default, int) and not isinstance(value, int)):
                raise ConfigError(file, field, f"expected {'an integer' if isinstance(default, int) else 'a number'}, got {value!r}")
            if value < 0 or (value == 0 and key in positive):
                raise ConfigError(file, field, f"must be {'> 0' if key in positive else '>= 0'}, got {value!r}")
            value = type(default)(value)
        setattr(out, key, value)
    return out

log = logging.getLogger(__name__)


#: a driven DOF's rate is uncertain by what its drive can do in this long (s): at a start (the drive may be
#: running) and when the sensors say it jumped (a reversal the rate's noise had not foreseen)
DRIVE_JUMP_S = 1.0
#: a driven DOF's rate jumped when the test of :func:`rate_jump_statistic` exceeds what a deviation of this many σ
#: would give (the backends' ``drive_jump_sigma``): without a jump, 0.27 % of the updates whose NIS could pass it
DRIVE_JUMP_SIGMA = 3.0


def drive_rate_sigma(model: Model) -> np.ndarray:
    """(g,) standard deviation (rad/s or m/s) of a driven DOF's rate at a start or a jump: its drive's
    acceleration density times √``DRIVE_JUMP_S``; 0 for the DOFs no drive moves."""
    return model.drive_density * np.sqrt(DRIVE_JUMP_S)


def rate_jump_threshold(sigma: float, k: int) -> float:
    """The χ²_k quantile of :func:`rate_jump_statistic` (k driven DOFs) with the tail of a ``sigma``-σ deviation
    of a normal variable (both sides): sigma² for one driven DOF; inf when ``sigma`` is 0 (never)."""
    if sigma <= 0:
        return np.inf
    return float(chi2_isf(2 * norm_sf(sigma), k))


def rate_jump_statistic(e: np.ndarray, S: np.ndarray, U: np.ndarray) -> float:
    """Generalised likelihood-ratio statistic of a jump of the driven DOFs' rates in one update: the innovation
    e (m,) with covariance S (m, m) projected on U (m, k), the readings' sensitivity to those rates (∂y/∂ż):
    (Uᵀ S⁻¹ e)ᵀ (Uᵀ S⁻¹ U)⁻¹ (Uᵀ S⁻¹ e), χ²_k without a jump; 0 when the readings do not see the rates."""
    try:
        F = scipy.linalg.cho_factor(S)
    except np.linalg.LinAlgError:
        return 0.0
    a = U.T @ scipy.linalg.cho_solve(F, e)
    B = U.T @ scipy.linalg.cho_solve(F, U)
    if not np.all(np.isfinite(B)) or not np.linalg.det(B) > 1e-300:
        return 0.0
    return float(a @ np.linalg.solve(B, a))


def drive_jump_cov(model: Model, h: float) -> np.ndarray:
    """(2g, 2g) covariance of (z, ż) added when a driven DOF's rate jumped (a reversal) at an unknown time within
    the last h seconds: the rate by :func:`drive_rate_sigma` σ, the angle by σ times the time since the jump
    (uniform in h: variance σ²h²/3); 0 for the DOFs no drive moves.  The two are left uncorrelated (the
    uniform jump's σ²h/2): where nothing but a gyro sees the angle (a vertical shaft), that correlation moves
    the angle by h/2 of the gyro's innovation at every jump, and the moves add up to a drift no sensor corrects."""
    v = np.square(drive_rate_sigma(model))
    h = min(max(h, 0.0), DRIVE_JUMP_S)
    return np.diag(np.concatenate([v * h * h / 3.0, v]))


def dof_force(model: Model, c: np.ndarray, b: np.ndarray, zd: np.ndarray) -> np.ndarray:
    """Generalized forces (n,) of the unknown force on each DOF, τ = b − c ⊙ ż (viscous coefficient c in
    N·m·s/rad or N·s/m, constant part b in N·m or N), acting on the DOF coordinates only."""
    tau = np.zeros(model.n)
    tau[model.dof] = b - c * zd
    return tau


@dataclass
class Measurement:
    """A sample of fused sensor ``sensor`` (index into the backend's sensor list) at time ``t`` (s)."""

    t: float
    sensor: int
    y: np.ndarray


@dataclass
class Estimate:
    """State estimate at time ``t``: q, q̇ (dependent), z, ż (independent), covariance of [z, ż]."""

    t: float
    q: np.ndarray
    qd: np.ndarray
    z: np.ndarray
    zd: np.ndarray
    P_z: np.ndarray | None
    status: str
    quality: str | None = None  #: ``ok`` / ``inconsistent`` (backends/consistency.py), None if not monitored
    bias: dict[str, list[float]] | None = None  #: estimated sensor biases by "<sensor>.<kind>" (sensor units)
    time_offset_s: dict[str, float] | None = None  #: IMU time-stamp offsets (s), estimated or fixed
    mount_deg: dict[str, float] | None = None  #: fused accelerometers' in-plane mount angles by IMU (deg), estimated or stated
    #: estimated relative errors of the model's masses and inertias by "<body>.mass" / "<body>.inertia"
    model: dict[str, float] | None = None


class DivergenceMonitor:
    """Decides when a filter has diverged.

    Divergence is any of: a non-finite state or covariance; a constraint residual max |Φ| above
    ``max_constraint_residual`` (m² for distance rows, m for angle rows); a rate |ż| above
    ``max_rate`` (rad/s or m/s); ``outliers_to_reinit`` consecutive updates whose normalised
    innovation squared eᵀS⁻¹e exceeds ``nis_limit`` per measurement row (χ² with one degree of
    freedom per row has mean 1, so 100 per row is far out of bounds).
    """

    def __init__(self, nis_limit: float, outliers_to_reinit: int, max_constraint_residual: float,
                 max_rate: float) -> None:
        self.nis_limit, self.outliers_to_reinit = nis_limit, outliers_to_reinit
        self.max_constraint_residual, self.max_rate = max_constraint_residual, max_rate
        self.outliers = 0
        #: the last covariance :meth:`finite` found finite (not checked again)
        self._finite_P: np.ndarray | None = None

    def reset(self) -> None:
        self.outliers = 0

    def finite(self, x: np.ndarray, P: np.ndarray) -> bool:
        """Whether the state x and its covariance P hold no NaN or inf (nor an entry above ~1e154, whose square
        overflows: diverged either way).  A covariance is replaced, never
        modified in place, once the filter has stepped with it (IndependentFilter._snapshot keeps it): the
        same P array found finite before is not checked again (it changes every ``covariance_step_s``)."""
        if not math.isfinite(x @ x):  # (a NaN or inf entry makes the sum of squares NaN or inf)
            return False
        if P is not self._finite_P:
            v = P.reshape(-1)
            if not math.isfinite(v @ v):
                return False
            self._finite_P = P
        return True

    def innovation(self, nis: float, rows: int) -> None:
        """Count an update's normalised innovation squared (NaN counts as an outlier)."""
        self.outliers = self.outliers + 1 if not nis <= self.nis_limit * rows else 0

    def problem(self, finite: bool, residual: float, zd: np.ndarray) -> str | None:
        """Why the state is diverged, or None: ``finite`` = state and covariance are finite,
        ``residual`` = max |Φ(q)|, ``zd`` = independent rates."""
        if not finite:
            return "NaN or inf in the state or covariance"
        if not residual <= self.max_constraint_residual:
            return f"constraint residual {residual:.3g} above {self.max_constraint_residual:g}"
        if not all(abs(v) <= self.max_rate for v in zd.tolist()):  # (NaN fails too)
            return f"rate {float(np.abs(zd).max()):.3g} above max_rate {self.max_rate:g}"
        if self.outliers >= self.outliers_to_reinit:
            return f"{self.outliers} consecutive updates with innovations far out of bounds"
        return None


class Backend(ABC):
    """Common state handling; subclasses implement initialize/add_measurement/step."""

    name = ""
    #: the compiled kernels it asks kernels.compile_model for (one of kernels.KINDS): what its start compiles
    kernel_kind = ""

    def __init__(self, model: Model, sensors: list, config) -> None:
        self.model = model
        self.sensors = sensors
        self.config = config
        self.dt = float(config.dt)
        self.t = 0.0
        self.output_latency_s = 0.0
        self.status = "init"
        self.reinit_count = 0
        #: sensor-time silence (s) after which estimates are ``degraded``
        self.degraded_after_s = 0.2
        self.last_encoder: Measurement | None = None
        self._reinit_pending: str | None = None
        self._last_measurement_t: float | None = None
        #: how far back (s) the filters keep snapshots to re-run from a late measurement
        self.history_s = float(getattr(config, "history_s", 0.2))
        #: whether the backend runs on compiled kernels (the dynamics provider kernels.compile_model gave it) or on
        #: the model's numpy reference (kernels off, or not compiled on this machine)
        self.compiled = False

    def earliest_time(self) -> float:
        """Measurements with t above this (s) are still used at their own time; older ones are late."""
        return self.t

    def initialize(self, t0: float, q: np.ndarray, qd: np.ndarray) -> None:
        """Start (or restart) at sensor time ``t0`` (s) from a consistent (q, q̇)."""
        self.t = t0
        self._last_measurement_t = t0

    @abstractmethod
    def add_measurement(self, m: Measurement) -> None:
        """Buffer a measurement for the step whose interval contains ``m.t``."""

    @abstractmethod
    def step(self) -> list[Estimate]:
        """Advance one ``dt``; return the estimates now available."""

    def steps_to_output(self) -> int:
        """Steps (≥ 1) until one returns estimates: 1 for a backend that emits every step (the live
        loop wakes for that step, not before)."""
        return 1

    def note_measurement(self, m: Measurement) -> None:
        """Book-keeping for the degraded status and the restart pose (latest finite encoder reading); a known
        input (a drive's torque) observes nothing: not counted."""
        if self.sensors[m.sensor].is_input:
            return
        self._last_measurement_t = m.t if self._last_measurement_t is None else max(self._last_measurement_t, m.t)
        if self.sensors[m.sensor].kind == "enc" and np.all(np.isfinite(m.y)):
            self.last_encoder = m

    def mark_reinit(self, why: str) -> None:
        """Record a re-initialisation; the next estimate carries status ``reinit``."""
        self.reinit_count += 1
        self._reinit_pending = why

    def fresh_encoder(self) -> Measurement | None:
        """The latest fused encoder reading if it is no older than ``degraded_after_s``, else None."""
        m = self.last_encoder
        return m if m is not None and self.t - m.t <= self.degraded_after_s else None

    def restart_pose(self, q_good: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(q, q̇) to restart from after a divergence: the latest encoder reading (no older than
        ``degraded_after_s``) on the branch of ``q_good``, else ``q_good`` itself; at rest (q̇ = 0)."""
        m = self.fresh_encoder()
        if m is not None:
            try:
                return q_from_encoder(self.model, self.sensors[m.sensor], float(m.y[0]), q_good), np.zeros(self.model.n)
            except AssemblyError as exc:
                log.warning("%s: encoder %s cannot restart the filter: %s", self.name, self.sensors[m.sensor].name, exc)
        return q_good.copy(), np.zeros(self.model.n)

    def current_status(self, t: float) -> str:
        if self._reinit_pending is not None:
            self._reinit_pending = None
            return "reinit"
        if self.sensors and (self._last_measurement_t is None or t - self._last_measurement_t > self.degraded_after_s):
            return "degraded"
        return "ok"

    def make_estimate(self, t: float, q: np.ndarray, qd: np.ndarray, P_z: np.ndarray | None = None) -> Estimate:
        """An Estimate with z, ż taken from q, q̇ (copies) and the current status."""
        self.status = self.current_status(t)
        d = self.model.dof  # (an index array: q[d] is a copy)
        return Estimate(t, q.copy(), qd.copy(), q[d], qd[d], P_z, self.status)

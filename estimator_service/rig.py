"""Rig configuration (TOML): mechanism, sensors, simulation, estimator and bus settings.

Every key, unit and default is documented in docs/config.md.  Errors are ``ConfigError`` naming
the file, the field (e.g. ``imu[1].rate_hz``) and the value.
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path

import numpy as np

from estimator_service.bus import CurveAuth, endpoint_problem
from estimator_service.errors import ConfigError
from estimator_service.mechanism import Damper, Mechanism, parse_mechanism
from estimator_service.model import Model
from estimator_service.names import name_problem
from estimator_service.sensors import (
    AXES,
    Accelerometer,
    DriveCommand,
    DriveTorque,
    Encoder,
    Gyro,
    Inclination,
    NoiseModel,
    VirtualSensor,
    axes_matrix,
    mount_axes,
)
from datetime import UTC

from estimator_service.backends import REGISTRY

#: the backend names a rig may name (``[estimator] backend`` and its tables): the registry's
BACKENDS = tuple(REGISTRY)
INIT_MODES = ("pose", "encoder", "gravity")


@dataclass(frozen=True)
class DriveConfig:
    """A driven DOF (``[[drive]]``): a motor imposes its motion, an acceleration the estimators do not know
    and carry as white noise of density ``accel_density`` (rad/s²/√Hz, or m/s²/√Hz for a length) — unless its
    controller states on ``act/<name>`` what it does (``input``): the torque it applies (N·m or N, a known input
    of the model) or the position (rad or m) / velocity (rad/s or m/s) it commands (a measurement of z / ż), each
    within ``sigma`` (the same units), ``rate_hz`` times a second, stale after ``max_age_s``."""

    dof: str
    accel_density: float
    input: str = "unknown"  #: what is known of the drive: one of DRIVE_INPUTS
    name: str = ""  #: the controller's topic is act/<name> (measured inputs)
    sigma: float = 0.0  #: the error of what it states: a torque's, or the drive's tracking error of its command
    rate_hz: float = 100.0  #: how often the controller publishes (Hz): a torque is held that long
    max_age_s: float = 0.1  #: a message older than this is not used; a torque is not held longer (s)
    endpoint: str = ""  #: where the controller publishes
    limit: float | None = None  #: input "torque": the largest plausible |torque| (N·m or N); None: no limit

    @property
    def measured(self) -> bool:
        """The controller states what the drive does (an ``act`` topic)."""
        return self.input != "unknown"

    @property
    def topic(self) -> str:
        return f"act/{self.name}"


#: the drive inputs a ``[[drive]]`` may state: nothing but its noise, or a controller's torque or command
DRIVE_INPUTS = ("unknown", "torque", "velocity", "position")
#: the [[drive]] keys only a measured input takes
_MEASURED_DRIVE_KEYS = {"name", "sigma", "rate_hz", "max_age_s", "endpoint", "limit"}
#: default density of a drive's unknown acceleration (rad/s²/√Hz): a stepper reversing 1 rad/s every second
#: or so (1 rad/s in a ~0.01 s step: (1 rad/s)²/1 s ≈ 1 (rad/s²)²/Hz), with room for its step vibration
DRIVE_ACCEL_DENSITY = 5.0
#: ... of a drive whose torque is known (input "torque"): the torque explains its acceleration, what is left is
#: what the model and the torque reading miss (the motor's own inertia, cogging, vibration): a tenth
DRIVE_TORQUE_ACCEL_DENSITY = 0.5


@dataclass(frozen=True)
class DriveProfile:
    """The simulator's drive of one DOF (``[simulation.drive.<dof>]``): back and forth between ``low`` and
    ``high`` (rad or m) at ``speed`` (rad/s or m/s), each reversal a raised-cosine change of the rate over
    ``ramp_s`` seconds (a stepper's abrupt reversal: a few ms)."""

    speed: float
    low: float
    high: float
    ramp_s: float

    def rate_and_accel(self, t: float) -> tuple[float, float]:
        """(ż, z̈) of the profile at time t (s): legs of (high − low)/speed seconds, the first upwards from t = 0,
        the reversals centred at the legs' ends (the turning points fall within speed·ramp_s/4 of low and high)."""
        leg = (self.high - self.low) / self.speed
        k = max(1, round(t / leg))  # the nearest reversal
        u = (t - k * leg) / self.ramp_s + 0.5  # 0..1 through reversal k
        sign = 1.0 if k % 2 == 0 else -1.0  # the rate after reversal k: up again after an even one
        if 0.0 <= u <= 1.0:
            c = math.cos(math.pi * u)
            return -sign * self.speed * c, sign * self.speed * math.pi / self.ramp_s * math.sin(math.pi * u)
        return (sign if u > 1.0 else -sign) * self.speed, 0.0

    def edges(self, t0: float, t1: float) -> list[float]:
        """The times in (t0, t1) (s) where a reversal starts or ends: the profile's acceleration is smooth between
        them and its derivative jumps at them (what an integrator must not step across)."""
        leg = (self.high - self.low) / self.speed
        half = self.ramp_s / 2
        k = max(1, math.floor((t0 - half) / leg))
        out = []
        while k * leg - half < t1:
            out += [e for e in (k * leg - half, k * leg + half) if t0 < e < t1]
            k += 1
        return out


@dataclass
class ImuConfig:
    """One IMU: gyroscope + accelerometer (+ orientation) fixed to a body."""

    name: str
    body: int
    at: tuple[float, float]  #: mounting point in the body frame (m)
    axes: np.ndarray  #: 3×3, row i = sensor axis i in body-frame coordinates
    rate_hz: float
    gyr: NoiseModel
    acc: NoiseModel
    use: tuple[str, ...]  #: fused channels: "gyr", "acc", "incl"
    endpoint: str
    phase_s: float = 0.0  #: sampling time offset in simulation (s)
    incl_sigma: float = 0.01  #: orientation (inclination) noise (rad)
    mount: float = 0.0  #: in-plane mounting angle (rad, CCW about body z) of the sensor axes
    time_offset_s: float = 0.0  #: IMU stamp minus true sampling time (s): stamps lag by this much
    gyr_bias_cal: np.ndarray = field(default_factory=lambda: np.zeros(3))  #: known gyro bias the estimator subtracts (rad/s)
    gyr_scale_cal: np.ndarray = field(default_factory=lambda: np.ones(3))  #: known gyro scale factor the estimator divides by
    acc_bias_cal: np.ndarray = field(default_factory=lambda: np.zeros(3))  #: known accelerometer bias the estimator subtracts (m/s²)
    gyr_bias_prior: float = 0.0052  #: estimator: prior std of each gyro axis bias (rad/s; 0 = no bias state)
    gyr_bias_walk: float = 3.5e-5  #: estimator: random-walk density of the gyro biases (rad/s/√s)
    acc_bias_prior: float = 0.05  #: estimator: prior std of each accelerometer axis bias (m/s²; 0 = none)
    acc_bias_walk: float = 1e-4  #: estimator: random-walk density of the accelerometer biases (m/s²/√s)
    time_offset_prior_s: float = 0.003  #: estimator: prior std of the residual time offset state (s; 0 = none)
    #: estimator: prior std (rad) of a fused accelerometer's residual in-plane mount angle state (0 = none)
    mount_prior: float = math.radians(5.0)

    @property
    def sensor_axes(self) -> np.ndarray:
        """Axes matrix including the mounting angle: ``axes`` rotated by ``mount`` about body z."""
        return mount_axes(self.axes, self.mount)


@dataclass
class EncoderConfig:
    """One quadrature encoder measuring a body's angle relative to ground or another body."""

    name: str
    body: int
    relative_to: int | None
    lines: int
    offset: float  #: rad; count 0 reads this angle
    rate_hz: float
    use: bool
    endpoint: str
    sigma: float  #: rad, for fusion (default: the quantisation step / sqrt(12))

    @property
    def cpr(self) -> int:
        return 4 * self.lines


@dataclass
class SimulationConfig:
    """Settings of ``rigstate simulate`` and ``driver sim``."""

    duration_s: float = 10.0
    seed: int = 0
    initial: dict[str, float] = field(default_factory=dict)  #: dof name -> value (rad or m)
    initial_rate: dict[str, float] = field(default_factory=dict)  #: dof name -> rate
    dampers: list[Damper] = field(default_factory=list)  #: unmodelled friction (simulator only)
    torques: dict[str, float] = field(default_factory=dict)  #: dof name -> constant generalized force (N·m or N)
    truth_rate_hz: float = 1000.0
    #: body index -> (mass factor, I0 factor) of the simulator's "true" body against the mechanism file
    body_scale: dict[int, tuple[float, float]] = field(default_factory=dict)
    #: IMU name -> extra stamp lag (s, >= 0) the estimator is not told, on top of the IMU's time_offset_s
    stamp_offset_s: dict[str, float] = field(default_factory=dict)
    #: IMU name -> its true in-plane mount angle (rad) instead of the rig's ``mount_deg`` (the estimator is not told)
    mount: dict[str, float] = field(default_factory=dict)
    #: gyro outliers: (IMU name, times s, added rate rad/s on the axis that reads the planar rate)
    outliers: list[tuple[str, tuple[float, ...], float]] = field(default_factory=list)
    #: dof name -> the motor's motion imposed on it (``[simulation.drive.<dof>]``)
    drives: dict[str, DriveProfile] = field(default_factory=dict)


@dataclass
class EstimatorConfig:
    """``[estimator]``: backend choice, time step, initialisation and per-backend tables."""

    source: str
    backend: str = "fgs"
    dt: float = 0.001
    init: dict = field(default_factory=dict)
    ekf: dict = field(default_factory=dict)
    ukf: dict = field(default_factory=dict)
    fgs: dict = field(default_factory=dict)
    #: sensor-time discipline (s; docs/config.md "[estimator] time keys")
    max_ahead_s: float = 0.5
    max_behind_s: float = 2.0
    history_s: float = 0.2
    stale_after_s: float = 1.0
    reset_messages: int = 10
    errekf: dict = field(default_factory=dict)
    model: dict = field(default_factory=dict)  #: ``[estimator.model]``: model uncertainty (backends/uncertainty.py)


@dataclass
class BusConfig:
    """``[bus]``: the estimator's and the simulator's endpoints; ``auth`` from ``[bus.auth]`` (None: none)."""

    estimator: str = "tcp://127.0.0.1:5600"
    sim: str = "tcp://127.0.0.1:5599"
    auth: CurveAuth | None = None


#: ``[bus.auth]`` keys and their defaults (relative to the rig TOML's directory; ``rigstate keys generate keys``)
AUTH_DEFAULTS = {"server_key": "keys/server.key", "server_secret_key": "keys/server.key_secret",
                 "client_secret_key": "keys/client.key_secret", "allowed_clients": "keys/clients"}


class Rig:
    """A whole rig: its mechanism, sensors and settings (see module docstring)."""

    def __init__(self, name: str, path: str, toml_text: str, mechanism: Mechanism, mechanism_yaml: str,
                 mechanism_path: str, imus: list[ImuConfig], encoders: list[EncoderConfig],
                 simulation: SimulationConfig, estimator: EstimatorConfig, bus: BusConfig,
                 drives: tuple[DriveConfig, ...] = ()) -> None:
        self.name, self.path, self.toml_text = name, path, toml_text
        self.drives = drives
        self.mechanism, self.mechanism_yaml, self.mechanism_path = mechanism, mechanism_yaml, mechanism_path
        self.imus, self.encoders = imus, encoders
        self.simulation, self.estimator, self.bus = simulation, estimator, bus

    @cached_property
    def model(self) -> Model:
        """The estimator's model of the mechanism (without the simulator's unmodelled friction), with the
        rig's driven DOFs (``[[drive]]``)."""
        return Model(self.mechanism, drives={d.dof: d.accel_density for d in self.drives},
                     torque={d.dof: d.sigma * math.sqrt(1.0 / d.rate_hz) for d in self.drives if d.input == "torque"})

    def truth_model(self, drive_inertia: bool = True) -> Model:
        """The simulator's model: the mechanism plus the unmodelled dampers of ``[simulation]``, with the
        bodies' mass and I0 scaled by ``[simulation.body.<name>]`` (a "true" model the estimator lacks), and a
        drive inertia on each DOF of ``[simulation.drive]`` (its profile's torque moves it); without
        ``drive_inertia``, the free mechanism (a motor's torque on it is what moves it so)."""
        bodies = list(self.mechanism.bodies)
        for i, (fm, fi) in self.simulation.body_scale.items():
            bodies[i] = replace(bodies[i], mass=bodies[i].mass * fm, I0=bodies[i].I0 * fi)
        return Model(replace(self.mechanism, bodies=bodies,
                             dampers=list(self.mechanism.dampers) + list(self.simulation.dampers)),
                     drives={dof: 1.0 for dof in self.simulation.drives} if drive_inertia else None)

    def header(self, meta: dict | None = None) -> dict:
        """Log header keys (docs/log-format.md) describing this rig."""
        from datetime import datetime

        return {
            "format": "rigstate-log", "version": 1,
            "created": datetime.now(UTC).isoformat(timespec="seconds"),
            "rig_path": self.path, "rig_toml": self.toml_text,
            "mechanism_path": self.mechanism_path, "mechanism_yaml": self.mechanism_yaml,
            "meta": meta or {},
        }

    def sensor_endpoints(self) -> list[str]:
        """Where sensor messages come from: the sim/replay endpoint and each sensor's driver endpoint."""
        eps = [self.bus.sim] + [s.endpoint for s in self.imus] + [e.endpoint for e in self.encoders] + \
            [d.endpoint for d in self.drives if d.measured]
        return list(dict.fromkeys(eps))

    def all_sensor_topics(self) -> list[str]:
        """Every sensor topic of the rig, fused or not (a drive controller's act/<name> included)."""
        return [f"imu/{s.name}" for s in self.imus] + [f"enc/{e.name}" for e in self.encoders] + \
            [d.topic for d in self.drives if d.measured]

    def all_virtual_sensors(self, model: Model) -> list[VirtualSensor]:
        """Every channel the rig has, fused or not, in the documented order."""
        return self._sensors(model, fused_only=False, imus=self.imus)

    def simulated_sensors(self, model: Model) -> list[VirtualSensor]:
        """Every channel as the simulator reads it: :meth:`all_virtual_sensors` with each IMU at its true mount
        angle (``[simulation.mount_deg]``, else its ``mount_deg``)."""
        mounts = self.simulation.mount
        return self._sensors(model, fused_only=False,
                             imus=[replace(s, mount=mounts[s.name]) if s.name in mounts else s for s in self.imus])

    def virtual_sensors(self, model: Model) -> list[VirtualSensor]:
        """The fused channels: per IMU gyr, acc, incl if in ``use``; then encoders with ``use``; then each drive
        controller's torque (an input) or command."""
        return self._sensors(model, fused_only=True, imus=self.imus)

    def _sensors(self, model: Model, fused_only: bool, imus: list[ImuConfig]) -> list[VirtualSensor]:
        out: list[VirtualSensor] = []
        for s in imus:
            topic = f"imu/{s.name}"
            axes = s.sensor_axes
            if not fused_only or "gyr" in s.use:
                out.append(Gyro(s.name, topic, model, s.body, axes, s.gyr, s.gyr_bias_cal, s.gyr_scale_cal))
                out[-1].set_estimation(s.gyr_bias_prior, s.gyr_bias_walk, s.time_offset_s, s.time_offset_prior_s)
            if not fused_only or "acc" in s.use:
                out.append(Accelerometer(s.name, topic, model, s.body, s.at, axes, s.acc, s.acc_bias_cal))
                out[-1].set_estimation(s.acc_bias_prior, s.acc_bias_walk, s.time_offset_s, s.time_offset_prior_s)
                out[-1].set_mount(s.mount, s.mount_prior)
            if not fused_only or "incl" in s.use:
                out.append(Inclination(s.name, topic, model, s.body, axes, s.incl_sigma, s.mount))
                out[-1].set_estimation(0.0, 0.0, s.time_offset_s, s.time_offset_prior_s)
        for e in self.encoders:
            if not fused_only or e.use:
                out.append(Encoder(e.name, f"enc/{e.name}", model, e.body, e.relative_to, e.cpr, e.offset, e.sigma))
        for d in self.drives:
            if not d.measured:
                continue
            k, period = model.dof_names.index(d.dof), 1.0 / d.rate_hz
            if d.input == "torque":
                out.append(DriveTorque(d.name, d.topic, model, k, d.sigma, period, d.max_age_s, d.limit))
            else:
                out.append(DriveCommand(d.name, d.topic, model, k, d.input, d.sigma, period, d.max_age_s))
        return out

    def time_offsets(self) -> dict[str, float]:
        """Per IMU topic, ``time_offset_s`` (stamp minus true sampling time, s), where non-zero."""
        return {f"imu/{s.name}": s.time_offset_s for s in self.imus if s.time_offset_s}

    def topic_of(self, sensor: VirtualSensor) -> str:
        """Bus topic whose messages carry the sensor's measurement (field ``sensor.field``)."""
        return sensor.topic


# ------------------------------------------------------------------------------------------ parsing
def load_rig(path: str | Path) -> Rig:
    """Read a rig TOML file and the mechanism file it names (relative to the TOML file)."""
    path = Path(path)
    text = _read_text(path, str(path), "")
    doc = _toml(text, str(path))
    mech_rel = _get(doc, "rig", str(path)).get("mechanism")
    if not isinstance(mech_rel, str):
        raise ConfigError(str(path), "rig.mechanism", f"expected the path of a mechanism YAML file, got {mech_rel!r}")
    mech_path = (path.parent / mech_rel).resolve()
    yaml_text = _read_text(mech_path, str(path), "rig.mechanism")
    return _build_checked(doc, text, str(path), yaml_text, str(mech_path))


def load_rig_text(toml_text: str, mechanism_yaml: str, name: str = "<log header>") -> Rig:
    """Rebuild a rig from the texts stored in a log header."""
    return _build_checked(_toml(toml_text, name), toml_text, name, mechanism_yaml, name + ":mechanism")


def _read_text(path: Path, source: str, field_name: str) -> str:
    """The UTF-8 text of ``path``; ConfigError(source, field_name, ...) if unreadable or not UTF-8."""
    what = "" if str(path) == source else f"{path}: "
    try:
        return path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(source, field_name, f"{what}cannot read: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(source, field_name, f"{what}not UTF-8 text (byte {exc.object[exc.start]:#04x} "
                          f"at offset {exc.start})") from None


def _toml(text: str, source: str) -> dict:
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(source, "", f"TOML syntax error: {exc}") from None
    except RecursionError:
        raise ConfigError(source, "", "TOML nested too deeply") from None


def _build_checked(doc: dict, text: str, source: str, yaml_text: str, mech_path: str) -> Rig:
    """:func:`_build`, with absurdly deep nesting in a value reported as a ConfigError."""
    try:
        return _build(doc, text, source, yaml_text, mech_path)
    except RecursionError:
        raise ConfigError(source, "", "a value is nested too deeply") from None


def _get(doc: dict, key: str, source: str) -> dict:
    v = doc.get(key, {})
    if not isinstance(v, dict):
        raise ConfigError(source, key, f"expected a table, got {v!r}")
    return v


def _array_of_tables(doc: dict, key: str, source: str, field_name: str) -> list[dict]:
    """``[[key]]`` entries of ``doc`` (an error names ``field_name`` if it is anything else)."""
    v = doc.get(key, [])
    if not isinstance(v, list) or not all(isinstance(t, dict) for t in v):
        raise ConfigError(source, field_name, f"expected an array of tables ([[{field_name}]]), got {v!r}")
    return v


def _is_number(v: object) -> bool:
    """A finite TOML integer or float (booleans are not numbers here)."""
    return not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)


class _Fields:
    """Typed access to one TOML table with unknown-key detection."""

    def __init__(self, source: str, prefix: str, table: dict, known: set[str]) -> None:
        self.source, self.prefix, self.t = source, prefix, table
        unknown = set(table) - known
        if unknown:
            raise ConfigError(source, f"{prefix}.{sorted(unknown)[0]}", f"unknown key; known keys: {sorted(known)}")

    def err(self, key: str, problem: str) -> ConfigError:
        return ConfigError(self.source, f"{self.prefix}.{key}", problem)

    def num(self, key: str, default: float | None = None, positive: bool = False, nonneg: bool = False) -> float:
        v = self.t.get(key, default)
        if v is None:
            raise self.err(key, "missing")
        if not _is_number(v):
            raise self.err(key, f"expected a number, got {v!r}")
        if positive and v <= 0:
            raise self.err(key, f"must be > 0, got {v!r}")
        if nonneg and v < 0:
            raise self.err(key, f"must be >= 0, got {v!r}")
        return float(v)

    def vec3(self, key: str) -> np.ndarray:
        v = self.t.get(key, [0.0, 0.0, 0.0])
        if not isinstance(v, list) or len(v) != 3 or not all(_is_number(x) for x in v):
            raise self.err(key, f"expected 3 numbers, got {v!r}")
        return np.array(v, dtype=float)

    def string(self, key: str, default: str | None = None) -> str:
        v = self.t.get(key, default)
        if not isinstance(v, str) or not v:
            raise self.err(key, f"expected a non-empty string, got {v!r}")
        return v


def _body(f: _Fields, key: str, mech: Mechanism, allow_ground: bool = False) -> int | None:
    v = f.t.get(key)
    if allow_ground and (v is None or v == "ground"):
        return None
    for i, b in enumerate(mech.bodies):
        if v == b.name or (isinstance(v, int) and not isinstance(v, bool) and v == i):
            return i
    raise f.err(key, f"unknown body {v!r}; bodies are {[b.name for b in mech.bodies]}")


def _sensor_name(f: _Fields) -> str:
    """A sensor's ``name`` (its topic is ``imu/<name>`` or ``enc/<name>``): a valid topic component."""
    nm = f.string("name")
    problem = name_problem(nm)
    if problem is not None:
        raise f.err("name", problem)
    return nm


def _endpoint(f: _Fields, key: str, default: str) -> str:
    ep = f.string(key, default)
    problem = endpoint_problem(ep)
    if problem is not None:
        raise f.err(key, problem)
    return ep


_IMU_KEYS = {"name", "body", "point", "at", "axes", "rate_hz", "gyr_sigma", "gyr_sigma_dps", "acc_sigma",
             "gyr_bias", "acc_bias", "gyr_lsb", "acc_lsb", "use", "endpoint", "phase_s", "incl_sigma",
             "mount_deg", "time_offset_s", "gyr_bias_cal", "gyr_scale_cal", "acc_bias_cal", "gyr_bias_prior_dps", "gyr_bias_walk_dps",
             "acc_bias_prior", "acc_bias_walk", "time_offset_prior_s", "mount_prior_deg"}
_ENC_KEYS = {"name", "body", "relative_to", "lines", "offset", "rate_hz", "use", "endpoint", "sigma"}


def _build(doc: dict, text: str, source: str, yaml_text: str, mech_path: str) -> Rig:
    known_top = {"rig", "imu", "encoder", "drive", "simulation", "estimator", "bus"}
    unknown = set(doc) - known_top
    if unknown:
        raise ConfigError(source, sorted(unknown)[0], f"unknown table; known: {sorted(known_top)}")
    rf = _Fields(source, "rig", _get(doc, "rig", source), {"name", "mechanism", "description"})
    mech = parse_mechanism(yaml_text, mech_path)
    name = rf.string("name", Path(source).stem)
    names: set[str] = set()  # topics are imu/<name> and enc/<name>: unique within a kind
    imus = []
    port = 5601
    for i, t in enumerate(_array_of_tables(doc, "imu", source, "imu")):
        f = _Fields(source, f"imu[{i}]", t, _IMU_KEYS)
        nm = _sensor_name(f)
        if nm in names:
            raise f.err("name", f"duplicate sensor name {nm!r}")
        names.add(nm)
        body = _body(f, "body", mech)
        assert body is not None
        if "point" in t and "at" in t:
            raise f.err("at", "give a named point or at = [x, y], not both")
        if "point" in t:
            npnt = next((p for p in mech.named_points if p.name == t["point"]), None)
            if npnt is None:
                raise f.err("point", f"unknown named point {t['point']!r}; named points are {[p.name for p in mech.named_points]}")
            if npnt.body != body:
                raise f.err("point", f"named point {npnt.name!r} is on body {mech.bodies[npnt.body].name!r}, not on {mech.bodies[body].name!r}")
            at = npnt.local
        else:
            v = t.get("at", [0.0, 0.0])
            if not isinstance(v, list) or len(v) != 2 or not all(_is_number(x) for x in v):
                raise f.err("at", f"expected [x, y] in the body frame (m), got {v!r}")
            at = (float(v[0]), float(v[1]))
        axes_v = t.get("axes", ["+x", "+y", "+z"])
        try:
            axes = axes_matrix(axes_v)
        except ValueError as exc:
            raise f.err("axes", f"{exc}; use three of {list(AXES)}") from None
        if "gyr_sigma" in t and "gyr_sigma_dps" in t:
            raise f.err("gyr_sigma", "give gyr_sigma (rad/s) or gyr_sigma_dps (deg/s), not both")
        gyr_sigma = math.radians(f.num("gyr_sigma_dps", nonneg=True)) if "gyr_sigma_dps" in t else f.num("gyr_sigma", math.radians(0.5), nonneg=True)
        use = t.get("use", ["gyr"])
        if not isinstance(use, list) or any(u not in ("gyr", "acc", "incl") for u in use):
            raise f.err("use", f"expected a list of 'gyr', 'acc', 'incl', got {use!r}")
        imus.append(ImuConfig(
            name=nm, body=body, at=at, axes=axes, rate_hz=f.num("rate_hz", 100.0, positive=True),
            gyr=NoiseModel(np.full(3, gyr_sigma), f.vec3("gyr_bias"), f.num("gyr_lsb", 0.0, nonneg=True)),
            acc=NoiseModel(np.full(3, f.num("acc_sigma", 0.05, nonneg=True)), f.vec3("acc_bias"), f.num("acc_lsb", 0.0, nonneg=True)),
            use=tuple(use), endpoint=_endpoint(f, "endpoint", f"tcp://127.0.0.1:{port}"), phase_s=f.num("phase_s", 0.0, nonneg=True),
            incl_sigma=f.num("incl_sigma", 0.01, positive=True), mount=math.radians(f.num("mount_deg", 0.0)),
            time_offset_s=_time_offset(f), gyr_bias_cal=f.vec3("gyr_bias_cal"),
            gyr_scale_cal=_scale3(f, "gyr_scale_cal"), acc_bias_cal=f.vec3("acc_bias_cal"),
            gyr_bias_prior=math.radians(f.num("gyr_bias_prior_dps", 0.3, nonneg=True)),
            gyr_bias_walk=math.radians(f.num("gyr_bias_walk_dps", 0.002, nonneg=True)),
            acc_bias_prior=f.num("acc_bias_prior", 0.05, nonneg=True), acc_bias_walk=f.num("acc_bias_walk", 1e-4, nonneg=True),
            # a time_offset_s the rig states is known: no residual offset state unless its prior is given too
            time_offset_prior_s=f.num("time_offset_prior_s", 0.0 if "time_offset_s" in t else ImuConfig.time_offset_prior_s,
                                      nonneg=True),
            mount_prior=_mount_prior(f),
        ))
        port += 1
    encoders = []
    names = set()
    for i, t in enumerate(_array_of_tables(doc, "encoder", source, "encoder")):
        f = _Fields(source, f"encoder[{i}]", t, _ENC_KEYS)
        nm = _sensor_name(f)
        if nm in names:
            raise f.err("name", f"duplicate sensor name {nm!r}")
        names.add(nm)
        body = _body(f, "body", mech)
        rel = _body(f, "relative_to", mech, allow_ground=True)
        lines = t.get("lines")
        if isinstance(lines, bool) or not isinstance(lines, int) or lines <= 0:
            raise f.err("lines", f"expected a positive integer (lines per revolution), got {lines!r}")
        use = t.get("use", False)
        if not isinstance(use, bool):
            raise f.err("use", f"expected true or false, got {use!r}")
        step = 2 * math.pi / (4 * lines)
        encoders.append(EncoderConfig(
            name=nm, body=body, relative_to=rel, lines=lines, offset=f.num("offset", 0.0),  # type: ignore[arg-type]
            rate_hz=f.num("rate_hz", 1000.0, positive=True), use=use,
            endpoint=_endpoint(f, "endpoint", f"tcp://127.0.0.1:{port}"), sigma=f.num("sigma", step / math.sqrt(12), positive=True),
        ))
        port += 1
    sim = _simulation(source, _get(doc, "simulation", source), mech, [s.name for s in imus])
    est = _estimator(source, _get(doc, "estimator", source))
    bf = _Fields(source, "bus", _get(doc, "bus", source), {"estimator", "sim", "auth"})
    bus = BusConfig(estimator=_endpoint(bf, "estimator", BusConfig.estimator), sim=_endpoint(bf, "sim", BusConfig.sim),
                    auth=_auth(source, bf))
    return Rig(name, source, text, mech, yaml_text, mech_path, imus, encoders, sim, est, bus,
               _drives(doc, source, mech, port))


def _drives(doc: dict, source: str, mech: Mechanism, port: int) -> tuple[DriveConfig, ...]:
    """``[[drive]]`` tables: one per driven DOF; a measured input's controller publishes on act/<name> (default
    name: the DOF's) at ``endpoint`` (default: the next port after the sensors', from ``port``)."""
    dof_names = _dof_names(mech)
    drives: list[DriveConfig] = []
    for i, t in enumerate(_array_of_tables(doc, "drive", source, "drive")):
        f = _Fields(source, f"drive[{i}]", t, {"dof", "input", "accel_density"} | _MEASURED_DRIVE_KEYS)
        dof = t.get("dof")
        if dof not in dof_names:
            raise f.err("dof", f"unknown dof {dof!r}; dofs are {dof_names}")
        if any(d.dof == dof for d in drives):
            raise f.err("dof", f"dof {dof!r} has a [[drive]] already")
        inp = t.get("input", "unknown")
        if inp not in DRIVE_INPUTS:
            raise f.err("input", f"expected one of {list(DRIVE_INPUTS)}, got {inp!r}")
        density = f.num("accel_density", DRIVE_TORQUE_ACCEL_DENSITY if inp == "torque" else DRIVE_ACCEL_DENSITY,
                        positive=True)
        if inp == "unknown":
            extra = sorted(_MEASURED_DRIVE_KEYS & set(t))
            if extra:
                raise f.err(extra[0], 'only a measured input (input = "torque", "velocity" or "position") has it')
            drives.append(DriveConfig(dof=dof, input=inp, accel_density=density))
            continue
        name = _sensor_name(f) if "name" in t else dof
        if any(d.name == name for d in drives):
            raise f.err("name", f"duplicate drive name {name!r} (its topic act/{name})")
        if "limit" in t and inp != "torque":
            raise f.err("limit", 'only input = "torque" has it (a command beyond what the sensors say is gated)')
        rate = f.num("rate_hz", DriveConfig.rate_hz, positive=True)
        max_age = f.num("max_age_s", max(DriveConfig.max_age_s, 3.0 / rate), positive=True)
        if max_age < 1.0 / rate:
            raise f.err("max_age_s", f"must be at least one period of rate_hz ({1.0 / rate:g} s), got {max_age!r}")
        drives.append(DriveConfig(
            dof=dof, input=inp, accel_density=density, name=name, sigma=f.num("sigma", positive=True), rate_hz=rate,
            max_age_s=max_age, endpoint=_endpoint(f, "endpoint", f"tcp://127.0.0.1:{port}"),
            limit=f.num("limit", positive=True) if "limit" in t else None))
        port += 1
    return tuple(drives)


def _auth(source: str, bus: _Fields) -> CurveAuth | None:
    """``[bus.auth]`` (absent: None): key file paths, relative to the rig file's directory."""
    if "auth" not in bus.t:
        return None
    t = bus.t["auth"]
    if not isinstance(t, dict):
        raise bus.err("auth", f"expected a table [bus.auth], got {t!r}")
    f = _Fields(source, "bus.auth", t, set(AUTH_DEFAULTS))
    base = Path(source).parent
    paths = {k: base / f.string(k, default) for k, default in AUTH_DEFAULTS.items()}
    return CurveAuth(source=source, **paths)


def _scale3(f: _Fields, key: str) -> np.ndarray:
    """A per-axis scale factor (three numbers > 0; default ones)."""
    if key not in f.t:
        return np.ones(3)
    v = f.vec3(key)
    if not np.all(v > 0):
        raise f.err(key, f"expected three scale factors > 0, got {f.t[key]!r}")
    return v


def _mount_prior(f: _Fields) -> float:
    """``mount_prior_deg`` of an IMU (0 ≤ value ≤ 45 deg) in rad: a larger error is a wrong ``axes``, not a mount."""
    v = f.num("mount_prior_deg", math.degrees(ImuConfig.mount_prior), nonneg=True)
    if v > 45.0:
        raise f.err("mount_prior_deg", f"must be <= 45 deg (a larger error is a wrong axes assignment), got {v!r}")
    return math.radians(v)


def _time_offset(f: _Fields) -> float:
    """``time_offset_s`` of an IMU: |value| < 0.5 s."""
    v = f.num("time_offset_s", 0.0)
    if abs(v) >= 0.5:
        raise f.err("time_offset_s", f"must be between -0.5 and 0.5 s, got {v!r}")
    return v


def _dof_names(mech: Mechanism) -> list[str]:
    """The DOF names: the file's ``dofs``, else the coordinates the model chooses (mbse files)."""
    return [d.name for d in mech.dofs] if mech.dofs else Model(mech).dof_names


def _simulation(source: str, t: dict, mech: Mechanism, imu_names: list[str]) -> SimulationConfig:
    f = _Fields(source, "simulation", t, {"duration_s", "seed", "initial", "damper", "torque", "truth_rate_hz",
                                         "body", "stamp_offset_s", "mount_deg", "outlier", "drive"})
    seed = t.get("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise f.err("seed", f"expected an integer >= 0, got {seed!r}")
    initial, rates = {}, {}
    dof_names = _dof_names(mech) if t.get("initial") or t.get("torque") or t.get("drive") else []
    init = t.get("initial", {})
    if not isinstance(init, dict):
        raise f.err("initial", "expected a table of <dof>_deg / <dof> / <dof>_rate values")
    for key, v in init.items():
        fi = _Fields(source, "simulation.initial", {key: v}, {key})
        base = key.removesuffix("_deg").removesuffix("_rate")
        if base not in dof_names:
            raise fi.err(key, f"unknown dof {base!r}; named dofs are {dof_names}")
        if key.endswith("_rate"):
            rates[base] = fi.num(key)
        elif key.endswith("_deg"):
            initial[base] = math.radians(fi.num(key))
        else:
            initial[base] = fi.num(key)
    dampers = []
    for i, d in enumerate(_array_of_tables(t, "damper", source, "simulation.damper")):
        fd = _Fields(source, f"simulation.damper[{i}]", d, {"bodies", "c"})
        pair = d.get("bodies")
        if not isinstance(pair, list) or len(pair) != 2:
            raise fd.err("bodies", f"expected [body, body or 'ground'], got {pair!r}")
        a = _body(_Fields(source, f"simulation.damper[{i}]", {"bodies": pair[0]}, {"bodies"}), "bodies", mech)
        b = _body(_Fields(source, f"simulation.damper[{i}]", {"bodies": pair[1]}, {"bodies"}), "bodies", mech, allow_ground=True)
        dampers.append(Damper(a, b, fd.num("c", nonneg=True)))  # type: ignore[arg-type]
    torque = t.get("torque", {})
    if not isinstance(torque, dict):
        raise f.err("torque", "expected a table of <dof> = generalized force (N·m or N)")
    ft = _Fields(source, "simulation.torque", torque, set(dof_names))
    torques = {key: ft.num(key) for key in torque}
    body_scale = {}
    bt = t.get("body", {})
    if not isinstance(bt, dict):
        raise f.err("body", "expected tables [simulation.body.<body name>] with mass_scale, I0_scale")
    for key, v in bt.items():
        if not isinstance(v, dict):
            raise f.err(f"body.{key}", f"expected a table with mass_scale, I0_scale, got {v!r}")
        fb = _Fields(source, f"simulation.body.{key}", v, {"mass_scale", "I0_scale"})
        bi = _body(_Fields(source, "simulation.body", {key: key}, {key}), key, mech)
        body_scale[bi] = (fb.num("mass_scale", 1.0, positive=True), fb.num("I0_scale", 1.0, positive=True))
    so = t.get("stamp_offset_s", {})
    if not isinstance(so, dict):
        raise f.err("stamp_offset_s", "expected a table of <imu name> = seconds")
    fso = _Fields(source, "simulation.stamp_offset_s", so, set(imu_names))
    stamp = {k: fso.num(k, nonneg=True) for k in so}
    for k, v in stamp.items():
        if v >= 0.5:
            raise fso.err(k, f"must be < 0.5 s, got {v!r}")
    mt = t.get("mount_deg", {})
    if not isinstance(mt, dict):
        raise f.err("mount_deg", "expected a table of <imu name> = degrees")
    fmt = _Fields(source, "simulation.mount_deg", mt, set(imu_names))
    mounts = {k: math.radians(fmt.num(k)) for k in mt}
    outliers = []
    for i, o in enumerate(_array_of_tables(t, "outlier", source, "simulation.outlier")):
        fo = _Fields(source, f"simulation.outlier[{i}]", o, {"imu", "times_s", "gyr_dps"})
        imu = o.get("imu")
        if imu not in imu_names:
            raise fo.err("imu", f"unknown IMU {imu!r}; IMUs are {imu_names}")
        times = o.get("times_s")
        if not isinstance(times, list) or not all(_is_number(x) and x >= 0 for x in times):
            raise fo.err("times_s", f"expected a list of times >= 0 (s), got {times!r}")
        outliers.append((imu, tuple(float(x) for x in times), math.radians(fo.num("gyr_dps"))))
    return SimulationConfig(
        duration_s=f.num("duration_s", 10.0, positive=True), seed=seed, initial=initial, initial_rate=rates,
        dampers=dampers, torques=torques, truth_rate_hz=f.num("truth_rate_hz", 1000.0, positive=True),
        body_scale=body_scale, stamp_offset_s=stamp, mount=mounts, outliers=outliers,
        drives=_sim_drives(source, f, dof_names),
    )


def _sim_drives(source: str, f: _Fields, dof_names: list[str]) -> dict[str, DriveProfile]:
    """``[simulation.drive.<dof>]``: speed_dps | speed, from_deg | from, to_deg | to, ramp_s."""
    drives = f.t.get("drive", {})
    if not isinstance(drives, dict):
        raise f.err("drive", "expected tables [simulation.drive.<dof>]")
    out = {}
    for dof, d in drives.items():
        if dof not in dof_names:
            raise f.err(f"drive.{dof}", f"unknown dof {dof!r}; dofs are {dof_names}")
        if not isinstance(d, dict):
            raise f.err(f"drive.{dof}", "expected a table of speed_dps, from_deg, to_deg, ramp_s")
        fd = _Fields(source, f"simulation.drive.{dof}", d, {"speed_dps", "speed", "from_deg", "from", "to_deg", "to", "ramp_s"})

        def value(key: str, unit: str, fd: _Fields = fd, d: dict = d) -> float:
            return math.radians(fd.num(f"{key}_{unit}")) if f"{key}_{unit}" in d else fd.num(key)

        speed, low, high = value("speed", "dps"), value("from", "deg"), value("to", "deg")
        if not speed > 0:
            raise fd.err("speed", f"must be > 0, got {speed!r} (rad/s or m/s)")
        if not high > low:
            raise fd.err("to", f"must be above from, got from {low!r} to {high!r} (rad or m)")
        ramp = fd.num("ramp_s", 0.01, positive=True)
        if ramp >= (high - low) / speed:
            raise fd.err("ramp_s", f"must be shorter than a leg ({(high - low) / speed:g} s), got {ramp!r}")
        out[dof] = DriveProfile(speed=speed, low=low, high=high, ramp_s=ramp)
    return out


def _estimator(source: str, t: dict) -> EstimatorConfig:
    f = _Fields(source, "estimator", t, {"backend", "dt", "init", "model", *BACKENDS, *_TIME_KEYS})
    backend = t.get("backend", "fgs")
    if backend not in BACKENDS:
        raise f.err("backend", f"expected one of {list(BACKENDS)}, got {backend!r}")
    init = t.get("init", {})
    if not isinstance(init, dict):
        raise f.err("init", "expected a table")
    if init.get("mode", "pose") not in INIT_MODES:
        raise ConfigError(source, "estimator.init.mode", f"expected one of {list(INIT_MODES)}, got {init.get('mode')!r}")
    tables = {}
    for b in BACKENDS:
        v = t.get(b, {})
        if not isinstance(v, dict):
            raise f.err(b, "expected a table")
        tables[b] = dict(v)
    times = {k: f.num(k, getattr(EstimatorConfig, k), positive=True) for k in _TIME_KEYS if k != "reset_messages"}
    reset = t.get("reset_messages", EstimatorConfig.reset_messages)
    if isinstance(reset, bool) or not isinstance(reset, int) or not 1 <= reset <= 1000:
        raise f.err("reset_messages", f"expected an integer in 1..1000, got {reset!r}")
    if times["history_s"] > times["max_behind_s"]:
        raise f.err("history_s", f"must be <= max_behind_s ({times['max_behind_s']}), got {times['history_s']}")
    model = t.get("model", {})
    if not isinstance(model, dict):
        raise f.err("model", "expected a table")
    return EstimatorConfig(source=source, backend=backend, dt=f.num("dt", 0.001, positive=True), init=dict(init),
                           reset_messages=reset, model=dict(model), **times, **tables)


_TIME_KEYS = ("max_ahead_s", "max_behind_s", "history_s", "stale_after_s", "reset_messages")

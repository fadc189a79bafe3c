"""The one home of what several test modules share: paths, the CLI runners, finite differences, rig writers,
simulated logs, a filter run through the pipeline and the drivers' message sink.  Fixtures are in conftest.py;
test modules import from here, never from one another."""

from __future__ import annotations

import argparse
import fcntl
import io
import math
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import numpy as np

from estimator_service import schema
from estimator_service.bus import free_port
from estimator_service.logfile import LogWriter, read_log
from estimator_service.paths import config_dir
from estimator_service.rig import Rig, load_rig
from estimator_service.simulate import simulate

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data"  # third-party test data, copied in with licences (tests/data/README.md)
MBSE = DATA / "mbse-models"
MBSE_REFERENCE = DATA / "mbse-reference"
XBUS_CAPTURES = DATA / "xbus-captures"
MECHANISMS = config_dir() / "mechanisms"
RIG = config_dir() / "rigs" / "fourbar-sensors2016.toml"
RIG_ACC = config_dir() / "rigs" / "fourbar-sensors2016-acc.toml"

#: how long a CLI command may run before the test fails (s): generous, for a loaded 2-core machine; a test
#: asserts what the command did, never how long it took
CLI_TIMEOUT_S = 600.0


# ------------------------------------------------------------------------------------------- the CLI
def cli(*args: str, cwd: Path | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    """``rigstate ARGS`` in a subprocess (``python -m estimator_service.cli``), output captured as text."""
    return subprocess.run([sys.executable, "-m", "estimator_service.cli", *args], capture_output=True, text=True,
                          cwd=cwd, env=None if env is None else {**os.environ, **env}, timeout=CLI_TIMEOUT_S)


def run_main(*args: str) -> subprocess.CompletedProcess:
    """``rigstate ARGS`` in this process (``cli.main``, the console command's entry point): what :func:`cli` gives
    (exit code, stdout and stderr as text) without starting a process, whose imports and kernel loading cost
    ~2 s of CPU each.  For the commands whose process boundary is not what a test checks (that stays :func:`cli`:
    daemons, drivers, signals, a process's imports); the signal handlers a command installs are restored after it.
    Log records go to pytest's log capture, not to the stderr returned (error messages and prints do)."""
    from estimator_service import cli as entry

    out, err = io.StringIO(), io.StringIO()
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        with redirect_stdout(out), redirect_stderr(err):
            try:
                code = entry.main(list(args))
            except SystemExit as exc:  # argparse: --help (0), a usage error (2)
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
    return subprocess.CompletedProcess(["rigstate", *args], code, out.getvalue(), err.getvalue())


def rigstate(*args: str, env: dict | None = None, **kw) -> subprocess.Popen:
    """``rigstate --log-level WARNING ARGS`` started in the background (a daemon, a driver, a recorder), its
    output unbuffered (what a test reads arrives as it is printed), stdin closed unless ``kw`` says otherwise."""
    kw.setdefault("stdin", subprocess.DEVNULL)
    return subprocess.Popen([sys.executable, "-m", "estimator_service.cli", "--log-level", "WARNING", *args],
                            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}, **kw)


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """The subcommands of a parser (its subparsers by name)."""
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


def ep() -> str:
    """A free loopback endpoint."""
    return f"tcp://127.0.0.1:{free_port()}"


# ------------------------------------------------------------------------------------------- numerics
def fd_jac(f: Callable[[np.ndarray], np.ndarray], x: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """Central finite-difference Jacobian of ``f`` at ``x`` (a scalar f gives one row)."""
    cols = [(np.atleast_1d(f(x + eps * e)) - np.atleast_1d(f(x - eps * e))) / (2 * eps) for e in np.eye(len(x))]
    return np.array(cols).T


# ------------------------------------------------------------------------------------------- rigs
def rig_text(base: Path = RIG, edits: Iterable[tuple[str, str] | tuple[str, str, int]] = ()) -> str:
    """The TOML of the rig file ``base`` with its mechanism path made absolute (so that a copy works from any
    folder), then each edit ``(old, new)`` (every occurrence) or ``(old, new, count)`` applied; an edit whose
    ``old`` is not in the text fails the test (the shipped rig changed under it)."""
    text = base.read_text()
    text = re.sub(r'^mechanism = "([^"/][^"]*)"', lambda m: f'mechanism = "{(base.parent / m[1]).resolve()}"', text,
                  count=1, flags=re.M)
    for old, new, *count in edits:
        assert old in text, f"{old!r} not in {base}"
        text = text.replace(old, new, *count)
    return text


def write_rig_copy(path: Path, base: Path = RIG, edits: Iterable[tuple[str, str] | tuple[str, str, int]] = ()) -> Path:
    """:func:`rig_text` written to ``path``; returns ``path``."""
    path.write_text(rig_text(base, edits))
    return path


PENDULUM_YAML = """\
# a compound pendulum released from rest at -53 deg; its DOF is named "swing" (rad)
points:
  - {x: 0, y: 0, fixed: true}
  - {x: 0.3, y: -0.4}
planar_bodies:
  - {name: arm, points: [0, 1], length: auto, mass: 1.0, I0: mass*length^2/3, cog: [0.5*length, 0]}
relative_coordinates:
  - {type: RelativeAngleAbsoluteDOF, points: [0, 1], name: theta}
dofs:
  - {name: swing, coordinate: theta}
"""

INCLINE_YAML = """\
# a block sliding down a 30 deg incline (both its points on the line 0-1); its DOF "slide" is x2 (m)
parameters:
  a: deg2rad(-30)
points:
  - {x: 0, y: 0, fixed: true}
  - {x: cos(a), y: sin(a), fixed: true}
  - {x: 0.2*cos(a), y: 0.2*sin(a)}
  - {x: 0.1*cos(a), y: 0.1*sin(a)}
planar_bodies:
  - {name: block, points: [2, 3], length: auto, mass: 1.0, I0: 0.01, cog: [0.05, 0]}
sliders:
  - {point: 2, through: [0, 1]}
  - {point: 3, through: [0, 1]}
dofs:
  - {name: slide, coordinate: x2}
"""

RIG_TEMPLATE = """\
[rig]
name = "{name}"
mechanism = "{name}.yaml"

[[imu]]
name = "{body}"
body = "{body}"
at = [0.05, 0.0]
rate_hz = 100
gyr_sigma_dps = 0.5
acc_sigma = 0.05
use = {use}
endpoint = "tcp://127.0.0.1:{port}"

[simulation]
duration_s = 3.0
seed = 2

[estimator]
backend = "ekf"

[bus]
estimator = "tcp://127.0.0.1:{port_est}"
sim = "tcp://127.0.0.1:{port_sim}"
"""


def write_rig(directory: Path, kind: str) -> Path:
    """A rig TOML (and its mechanism YAML) in ``directory`` whose DOF is not named "crank": ``pendulum`` (DOF
    ``swing``, an angle) or ``incline`` (DOF ``slide``, a translation in m); free loopback ports."""
    yaml_text, body, use = {"pendulum": (PENDULUM_YAML, "arm", '["gyr"]'),
                            "incline": (INCLINE_YAML, "block", '["gyr", "acc"]')}[kind]
    (directory / f"{kind}.yaml").write_text(yaml_text)
    path = directory / f"{kind}.toml"
    path.write_text(RIG_TEMPLATE.format(name=kind, body=body, use=use, port=free_port(), port_est=free_port(),
                                        port_sim=free_port()))
    return path


SHAFT_YAML = MECHANISMS / "shaft.yaml"

#: a stepper-like driven shaft, simulated (6 s, seed 3: 50°/s between 0 and 120°, 10 ms reversals), a gyro and
#: accelerometer IMU 5 cm off its axis, a 9000-line encoder that initialises the estimate; ``{imu}``: more keys of
#: its IMU, ``{drive}``: its ``[[drive]]`` keys after ``dof``
SIM_SHAFT = """
[rig]
name = "shaft-sim"
mechanism = "{mech}"
[[imu]]
name = "shaft"
body = "shaft"
at = [0.05, 0.0]
axes = ["+x", "+z", "-y"]
gyr_sigma_dps = 2.0
acc_sigma = 0.1
use = ["gyr", "acc"]
{imu}
[[encoder]]
name = "shaft"
body = "shaft"
lines = 9000
[[drive]]
dof = "shaft"
{drive}
[simulation]
duration_s = 6.0
seed = 3
[simulation.drive.shaft]
speed_dps = 50
from_deg = 0
to_deg = 120
ramp_s = 0.01
[estimator.init]
mode = "encoder"
encoder = "shaft"
"""


def sim_shaft_text(drive: str = "", imu: str = "") -> str:
    """The TOML text of :data:`SIM_SHAFT` with ``drive`` and ``imu`` (its mechanism by absolute path)."""
    return SIM_SHAFT.format(mech=SHAFT_YAML, drive=drive, imu=imu)


# ------------------------------------------------------------------------------------------- logs
def write_sim_log(path: Path, rig_path: Path | Rig, duration: float | None = None, seed: int | None = None) -> Path:
    """Simulate the rig (a file, or loaded) for ``duration`` s into the log file ``path`` (``duration`` and ``seed``:
    the rig's if None)."""
    rig = rig_path if isinstance(rig_path, Rig) else load_rig(rig_path)
    header = rig.header({"duration_s": rig.simulation.duration_s if duration is None else duration})
    header["created"] = "test"
    with LogWriter(path, header) as w:
        for topic, msg in simulate(rig=rig, duration=duration, seed=seed):
            w.write(topic, msg["t"], schema.encode(topic, msg))
    return path


def write_offgrid_log(path: Path) -> Path:
    """6 s of the public scenario with both IMUs sampled half-way between the estimator's 1 ms steps
    (``phase_s = 0.0005``), written to ``path`` (its rig beside it)."""
    rig_path = write_rig_copy(path.with_suffix(".toml"), RIG, [("rate_hz = 100\n", "rate_hz = 100\nphase_s = 0.0005\n")])
    return write_sim_log(path, rig_path, 6.0)


def shared_file(directory: Path, name: str, make: Callable[[Path], object]) -> Path:
    """``directory / name``, written by ``make(path)`` unless it is there: made once however many processes ask for
    it (a file lock: the others wait, then read it).  For what each xdist worker of a session would otherwise make
    on its own (seeded simulations: the same bytes whoever makes them)."""
    path = directory / name
    with open(directory / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not path.exists():
            part = directory / f".{name}.part"
            make(part)
            part.rename(path)
    return path


class ScenarioLogs:
    """Short logs of the scenario rigs (config/rigs/scenarios, seed of the rig) in the folder ``d``, simulated on
    first use (:func:`shared_file`); ``crank-inertia+50`` is crank-inertia+20 with a 50 % error.
    ``logs[name, seconds]``."""

    def __init__(self, d: Path) -> None:
        self.d = d

    def __getitem__(self, key: tuple[str, float]) -> Path:
        name, seconds = key

        def make(path: Path) -> None:
            scenarios = config_dir() / "rigs" / "scenarios"
            rig = scenarios / f"{name}.toml"
            if name == "crank-inertia+50":
                rig = write_rig_copy(path.with_suffix(".toml"), scenarios / "crank-inertia+20.toml",
                                     [("I0_scale = 1.2", "I0_scale = 1.5")])
            write_sim_log(path, rig, seconds)

        return shared_file(self.d, f"scenario-{name}-{seconds:g}s.log", make)


# ------------------------------------------------------------------------------------------- estimation
def run_filter(log_path: Path, backend: str, params: dict | None = None, snap_dt: float | None = None,
               corrupt=None, imu: dict | None = None, model: dict | None = None):
    """Run a log through the pipeline (the daemon's code path) with backend ``params`` overriding the rig's
    (``imu``: ImuConfig fields set on every IMU, e.g. ``{"gyr_bias_prior": 0.0}``; ``model``: keys of
    ``[estimator.model]``, e.g. ``{"adapt": False}``).

    ``snap_dt``: sensor times moved to the end of their step (what "drop on the grid" would do);
    ``corrupt(topic, msg)``: may alter a decoded message before it is fed.
    Returns (crank RMSE in deg over the moving part, the est/state dicts, the pipeline).
    """
    from estimator_service.bench import accuracy
    from estimator_service.dofs import dofs_of
    from estimator_service.offline import rig_of_log
    from estimator_service.pipeline import Pipeline

    reader = read_log(log_path)
    rig = rig_of_log(reader.header, log_path)
    getattr(rig.estimator, backend).update(params or {})
    rig.estimator.model = {**(rig.estimator.model or {}), **(model or {})}
    for cfg in rig.imus:
        for k, v in (imu or {}).items():
            setattr(cfg, k, v)
    pipe = Pipeline(rig, backend)
    ests: list[dict] = []
    truth: dict[int, dict] = {}
    for rec in reader:
        msg = schema.decode(rec.topic, rec.payload)
        if rec.topic == "truth/state":
            truth[int(round(msg["t"] * 1000))] = msg
            continue
        if snap_dt is not None:
            msg["t"] = math.ceil(msg["t"] / snap_dt - 1e-9) * snap_dt
        if corrupt is not None:
            corrupt(rec.topic, msg)
        ests.extend(pipe.feed(rec.topic, msg))
    rmse, _ = accuracy(truth, ests, dofs_of(pipe.model))
    return rmse["crank"], ests, pipe


def filter_at(backend: str, rig_path: Path = RIG_ACC, z: float = 2.2, zd: float = 1.5, use_encoder: bool = True,
              **params):
    """A backend of the rig with all kinds of sensors fused, initialised at (z rad, ż rad/s), params overridden."""
    from estimator_service.backends import make_backend

    rig = load_rig(rig_path)
    rig.encoders[0].use = use_encoder
    getattr(rig.estimator, backend).update(params)
    m = rig.model
    f = make_backend(backend, m, rig.virtual_sensors(m), rig.estimator)
    q = m.solve_position(m.q0, np.array([z]))
    f.initialize(0.0, q, m.solve_velocity(q, np.array([zd])))
    return f


# ------------------------------------------------------------------------------------------- drivers
class Collector:
    """A driver's sink: keeps every message it emits (each checked against the schema)."""

    def __init__(self) -> None:
        self.msgs: list[dict] = []
        self.cond = threading.Condition()

    def __call__(self, topic: str, msg: dict) -> None:
        schema.validate(topic, msg)  # every message a driver emits is schema-valid
        with self.cond:
            self.msgs.append(msg)
            self.cond.notify_all()

    def wait(self, n: int, timeout: float) -> bool:
        """True once ``n`` messages arrived, False after ``timeout`` s without."""
        with self.cond:
            return self.cond.wait_for(lambda: len(self.msgs) >= n, timeout)


def read_pty(master: int, idle_s: float) -> bytes:
    """Everything a child writes to the terminal ``master`` until it closes it (or ``idle_s`` of silence)."""
    out = b""
    while True:
        ready, _, _ = select.select([master], [], [], idle_s)
        try:
            chunk = os.read(master, 65536) if ready else b""
        except OSError:  # EIO: the child closed the terminal
            chunk = b""
        if not chunk:
            return out
        out += chunk


def wait_until(predicate: Callable[[], bool], timeout_s: float, poll_s: float = 0.02) -> bool:
    """True once ``predicate()`` holds, False after ``timeout_s`` without (a bounded wait on state another
    thread or process changes: a file's size, a counter; ``poll_s`` is how often it is looked at)."""
    end = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > end:
            return False
        time.sleep(poll_s)  # pace: the poll interval of this bounded wait (state with no event to wait on), not a guess
    return True

"""Shared fixtures: paths to shipped configs and the reference mechanism files, small simulated logs."""

from __future__ import annotations

import argparse
import os
import select
import threading
import time
from pathlib import Path

import pytest

from estimator_service import schema
from estimator_service.bus import free_port
from estimator_service.logfile import LogWriter
from estimator_service.paths import config_dir
from estimator_service.rig import load_rig
from estimator_service.simulate import simulate

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data"  # third-party test data, copied in with licences (tests/data/README.md)
MBSE = DATA / "mbse-models"
MBSE_REFERENCE = DATA / "mbse-reference"
XBUS_CAPTURES = DATA / "xbus-captures"
RIG = config_dir() / "rigs" / "fourbar-sensors2016.toml"


def rig_text() -> str:
    """The public rig's TOML with its mechanism path made absolute, for a copy written elsewhere."""
    return RIG.read_text().replace("../mechanisms/", str(RIG.parent.parent / "mechanisms") + "/")


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """The subcommands of a parser (its subparsers by name)."""
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)
RIG_ACC = config_dir() / "rigs" / "fourbar-sensors2016-acc.toml"


def pytest_configure(config: pytest.Config) -> None:
    """Compile the kernels (estimator_service/kernels.py) once, in the first process (the xdist
    controller), before any test or subprocess needs them: a cold numba cache takes ~35 s, which a
    test's estimator subprocess must not spend inside its timeouts.  Later processes load the cache.

    The tests' subprocesses (``python -m estimator_service.cli`` from the clone's root) must import the
    package the tests import: with the current directory first on their path they took the clone's
    source tree instead of the installed package (CI's non-editable install), so they tested other
    files and compiled their own cold cache (CI: an estimator not ready within 20 s, another that
    published nothing in a 6 s run).  ``PYTHONSAFEPATH`` keeps the current directory off their path."""
    os.environ["PYTHONSAFEPATH"] = "1"
    from estimator_service import kernels
    from estimator_service.mechanism import load_mechanism
    from estimator_service.model import Model

    model = Model(load_mechanism(config_dir() / "mechanisms" / "fourbar-sensors2016.yaml"))
    for kind in kernels.KINDS:
        kernels.compile_model(model, kind)


def write_sim_log(path: Path, rig_path: Path, duration: float, seed: int | None = None) -> Path:
    """Simulate a rig into a log file."""
    rig = load_rig(rig_path)
    header = rig.header({"duration_s": duration})
    header["created"] = "test"
    with LogWriter(path, header) as w:
        for topic, msg in simulate(rig=rig, duration=duration, seed=seed):
            w.write(topic, msg["t"], schema.encode(topic, msg))
    return path


@pytest.fixture(scope="session")
def sim_log_10s(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """10 s of the public scenario (gyros only), seed 1."""
    return write_sim_log(tmp_path_factory.mktemp("sim") / "public-10s.log", RIG, 10.0)


@pytest.fixture(scope="session")
def sim_log_acc_10s(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """10 s of the public scenario with the coupler accelerometer fused."""
    return write_sim_log(tmp_path_factory.mktemp("sim") / "public-acc-10s.log", RIG_ACC, 10.0)


@pytest.fixture
def endpoint() -> str:
    return f"tcp://127.0.0.1:{free_port()}"


# ------------------------------------------------------------------ rigs with DOFs not named "crank"
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
    """A rig TOML (and its mechanism YAML) in ``directory``: ``pendulum`` (DOF ``swing``, an angle)
    or ``incline`` (DOF ``slide``, a translation in m); free loopback ports."""
    yaml_text, body, use = {"pendulum": (PENDULUM_YAML, "arm", '["gyr"]'),
                            "incline": (INCLINE_YAML, "block", '["gyr", "acc"]')}[kind]
    (directory / f"{kind}.yaml").write_text(yaml_text)
    path = directory / f"{kind}.toml"
    path.write_text(RIG_TEMPLATE.format(name=kind, body=body, use=use, port=free_port(), port_est=free_port(),
                                        port_sim=free_port()))
    return path


class Collector:
    """A driver's sink: keeps every message it emits (each checked against the schema)."""

    def __init__(self) -> None:
        self.msgs: list[dict] = []
        self.lock = threading.Lock()

    def __call__(self, topic: str, msg: dict) -> None:
        schema.validate(topic, msg)  # every message a driver emits is schema-valid
        with self.lock:
            self.msgs.append(msg)

    def wait(self, n: int, timeout: float) -> bool:
        """True once ``n`` messages arrived, False after ``timeout`` s without."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if len(self.msgs) >= n:
                return True
            time.sleep(0.02)
        return False


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

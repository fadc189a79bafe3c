"""Shared fixtures: paths to shipped configs and the reference mechanism files, small simulated logs."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from estimator_service import schema
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
RIG_ACC = config_dir() / "rigs" / "fourbar-sensors2016-acc.toml"


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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def endpoint() -> str:
    return f"tcp://127.0.0.1:{free_port()}"

"""Fixtures (shared simulated logs, a free endpoint) and the session's set-up: the kernels the selected tests'
subprocesses need compiled before they start.  What test modules share otherwise is in helpers.py."""

from __future__ import annotations

import fcntl
import hashlib
import os
import tempfile
from pathlib import Path

import pytest

from helpers import RIG, RIG_ACC, ScenarioLogs, ep, write_offgrid_log, write_sim_log


def pytest_configure(config: pytest.Config) -> None:
    """The tests' subprocesses (``python -m estimator_service.cli`` from the clone's root) must import the
    package the tests import: with the current directory first on their path they took the clone's source
    tree instead of the installed package (CI's non-editable install), so they tested other files and
    compiled their own cold cache.  ``PYTHONSAFEPATH`` keeps the current directory off their path."""
    os.environ["PYTHONSAFEPATH"] = "1"


def pytest_collection_finish(session: pytest.Session) -> None:
    """Compile (or load from the numba cache) the kernels that the selected tests marked ``kernels`` need, once,
    before the first test: a cold cache takes minutes on a loaded machine, which an estimator subprocess
    must not spend inside a test's timeouts.  Tests that run a backend in the test process compile what they
    use themselves, so ``pytest tests/test_expr.py`` compiles nothing.  Under xdist every worker runs this
    hook; a file lock lets the first compile while the others wait, then load the cache.  The lock is this cache's
    (``NUMBA_CACHE_DIR``, else beside the package): another clone's suite does not hold this one up."""
    from estimator_service import kernels

    kinds: set[str] = set()
    for item in session.items:
        for mark in item.iter_markers("kernels"):
            kinds.update(mark.args or kernels.KINDS)
    if not kinds or not kernels.enabled():
        return
    from estimator_service.mechanism import load_mechanism
    from estimator_service.model import Model
    from estimator_service.paths import config_dir

    cache = hashlib.sha256(f"{os.environ.get('NUMBA_CACHE_DIR', '')}|{kernels.__file__}".encode()).hexdigest()[:16]
    lock = Path(tempfile.gettempdir()) / f"rigstate-tests-kernels-{os.getuid()}-{cache}.lock"
    with open(lock, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # released when the file closes
        model = Model(load_mechanism(config_dir() / "mechanisms" / "fourbar-sensors2016.yaml"))
        for kind in sorted(kinds):
            kernels.compile_model(model, kind)


@pytest.fixture(scope="session")
def sim_log_4s(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """4 s of the public scenario (gyros only), seed 1."""
    return write_sim_log(tmp_path_factory.mktemp("sim") / "public-4s.log", RIG, 4.0)


@pytest.fixture(scope="session")
def sim_log_10s(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """10 s of the public scenario (gyros only), seed 1."""
    return write_sim_log(tmp_path_factory.mktemp("sim") / "public-10s.log", RIG, 10.0)


@pytest.fixture(scope="session")
def sim_log_acc_10s(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """10 s of the public scenario with the coupler accelerometer fused."""
    return write_sim_log(tmp_path_factory.mktemp("sim") / "public-acc-10s.log", RIG_ACC, 10.0)


@pytest.fixture(scope="session")
def offgrid_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """6 s of the public scenario, IMUs sampled half-way between steps (helpers.write_offgrid_log)."""
    return write_offgrid_log(tmp_path_factory.mktemp("offgrid"))


@pytest.fixture(scope="session")
def scenario_logs(tmp_path_factory: pytest.TempPathFactory) -> ScenarioLogs:
    """Short logs of the scenario rigs, simulated on first use (helpers.ScenarioLogs)."""
    return ScenarioLogs(tmp_path_factory.mktemp("scen"))


@pytest.fixture
def endpoint() -> str:
    """A free loopback endpoint."""
    return ep()

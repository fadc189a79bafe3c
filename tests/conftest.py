"""Fixtures (simulated logs made once per session, a free endpoint) and the session's set-up: the kernels the
selected tests' subprocesses need compiled before they start.  What test modules share otherwise is in helpers.py."""

from __future__ import annotations

import fcntl
import hashlib
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest

from estimator_service.logfile import read_log
from estimator_service.rig import load_rig_text

from helpers import (RIG, RIG_ACC, SHAFT_YAML, ScenarioLogs, ep, shared_file, sim_shaft_text, write_offgrid_log,
                     write_sim_log)


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
    hook, and each kind has a file lock: a worker compiles the kinds no other worker holds (on a cold cache the
    workers compile different kinds at once), then waits for the others' and loads them from the cache.  The
    locks are this cache directory's (kernels.cache_dir: ``NUMBA_CACHE_DIR`` or beside the package, and the
    kernels' sources): another clone's suite, or one of other sources, does not hold this one up."""
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

    cache = hashlib.sha256(str(kernels.cache_dir()).encode()).hexdigest()[:16]
    model = Model(load_mechanism(config_dir() / "mechanisms" / "fourbar-sensors2016.yaml"))
    held_elsewhere = []
    for kind in sorted(kinds, key=_COMPILE_ORDER.index):
        lock = open(Path(tempfile.gettempdir()) / f"rigstate-tests-kernels-{os.getuid()}-{cache}-{kind}.lock", "w")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # another worker compiles it: later
            held_elsewhere.append((kind, lock))
            continue
        with lock:  # (the lock is released when its file closes)
            kernels.compile_model(model, kind)
    for kind, lock in held_elsewhere:
        with lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            kernels.compile_model(model, kind)


#: the order a worker takes the kernel kinds in: the two workers of a 2-core machine start with kinds that share the
#: fewest kernels (the ekf's and the dependent smoother's), then each reuses its first kind's in the next
_COMPILE_ORDER = ("ekf", "smoother", "ukf", "manifold")


@pytest.fixture(scope="session")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, Callable[[Path], object]], Path]:
    """``shared(name, make)``: the file ``name`` that ``make(path)`` writes, made once per session
    (helpers.shared_file), in a folder every xdist worker of the session sees (a worker's temporary root is
    ``<the session's>/popen-gwN``)."""
    base = tmp_path_factory.getbasetemp()
    d = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "shared"
    d.mkdir(exist_ok=True)
    return lambda name, make: shared_file(d, name, make)


@pytest.fixture(scope="session")
def public_log(shared) -> Callable[..., Path]:
    """``public_log(seconds, rig=RIG)``: that many seconds of the public scenario (seed 1), simulated once per session."""
    return lambda seconds, rig=RIG: shared(f"{rig.stem}-{seconds:g}s.log", lambda p: write_sim_log(p, rig, seconds))


@pytest.fixture(scope="session")
def sim_log_4s(public_log) -> Path:
    """4 s of the public scenario (gyros only), seed 1."""
    return public_log(4.0)


@pytest.fixture(scope="session")
def sim_log_10s(public_log) -> Path:
    """10 s of the public scenario (gyros only), seed 1."""
    return public_log(10.0)


@pytest.fixture(scope="session")
def sim_log_acc_10s(public_log) -> Path:
    """10 s of the public scenario with the coupler accelerometer fused."""
    return public_log(10.0, RIG_ACC)


@pytest.fixture(scope="session")
def offgrid_log(shared) -> Path:
    """6 s of the public scenario, IMUs sampled half-way between steps (helpers.write_offgrid_log)."""
    return shared("offgrid-6s.log", write_offgrid_log)


@pytest.fixture(scope="session")
def scenario_logs(shared) -> ScenarioLogs:
    """Short logs of the scenario rigs, simulated on first use, once per session (helpers.ScenarioLogs)."""
    return ScenarioLogs(shared("scenarios", lambda p: p.mkdir()))


@pytest.fixture(scope="session")
def shaft_records(shared) -> Callable[[str, str], list[tuple[str, bytes]]]:
    """``shaft_records(name, drive)``: the ``(topic, payload)`` records of helpers.SIM_SHAFT with the ``[[drive]]``
    keys ``drive`` (6 s, seed 3), simulated once per session as ``shaft-<name>.log``.  The IMU's mount prior is the
    estimator's, not the simulation's: a rig that states its mount known reads the same records."""

    def make(path: Path, drive: str) -> None:
        write_sim_log(path, load_rig_text(sim_shaft_text(drive), SHAFT_YAML.read_text(), "shaft-sim.toml"))

    def get(name: str, drive: str) -> list[tuple[str, bytes]]:
        return [(r.topic, r.payload) for r in read_log(shared(f"shaft-{name}.log", lambda p: make(p, drive)))]

    return get


@pytest.fixture
def endpoint() -> str:
    """A free loopback endpoint."""
    return ep()

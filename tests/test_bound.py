"""The posterior Cramér–Rao bound (estimator_service/bound.py): properties it must have whatever the
scenario — it ignores the sensor readings' values, it falls when information is added, it starts at the
prior — on short simulations of the public rigs, real files and the real filter code."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from estimator_service import schema
from estimator_service.bound import bound_log
from estimator_service.logfile import LogWriter, read_log
from estimator_service.offline import rig_of_log
from estimator_service.paths import config_dir
from estimator_service.rig import load_rig
from estimator_service.simulate import simulate

from helpers import run_main

# runs backends (or estimator subprocesses): their kernels compiled before the tests start (conftest.py)
pytestmark = pytest.mark.kernels()

DURATION_S = 2.5


def _simulate(rig_path: Path, out: Path, seed: int) -> Path:
    rig = load_rig(rig_path)
    with LogWriter(out, rig.header({"command": "test", "seed": seed})) as w:
        for topic, msg in simulate(rig=rig, duration=DURATION_S, seed=seed):
            w.write(topic, msg["t"], schema.encode(topic, msg))
    return out


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("bound")
    acc = config_dir() / "rigs" / "fourbar-sensors2016-acc.toml"
    return {"seed1": _simulate(acc, d / "acc-seed1.log", 1), "seed2": _simulate(acc, d / "acc-seed2.log", 2)}


def _crank(rec) -> list[float]:
    return [rec.rmse_dof["crank"]] + [w["crank"] for w in rec.windows.values()]


def test_the_bound_does_not_depend_on_the_readings(logs: dict[str, Path]) -> None:
    """Two runs that differ only in the sensor noise (same truth): the same bound to rounding — the
    recursion linearises at the truth and never looks at a reading's value."""
    a, b = bound_log(logs["seed1"], "a"), bound_log(logs["seed2"], "b")
    assert a.steps == b.steps > 0
    assert _crank(a) == pytest.approx(_crank(b), rel=1e-9, abs=0)


def test_more_sensors_and_a_tighter_prior_lower_the_bound(logs: dict[str, Path]) -> None:
    """Information only helps: fusing the coupler accelerometer as well as the gyros, or starting from a
    tighter prior on the crank angle, gives a bound at or below the gyros-only one in every window; an unknown
    mount of the accelerometer (its default mount state) takes some of that back, never all of it."""
    log = logs["seed1"]
    rig = rig_of_log(read_log(log).header, log)
    assert "acc" in rig.imus[0].use and rig.imus[0].mount_prior > 0
    unknown_mount = bound_log(log, "acc, mount state", rig=rig)
    rig.imus[0].mount_prior = 0.0
    with_acc = bound_log(log, "acc", rig=rig)
    gyros = rig_of_log(read_log(log).header, log)
    for imu in gyros.imus:
        imu.use = ("gyr",)
    gyros_only = bound_log(log, "gyros", rig=gyros)
    tight = rig_of_log(read_log(log).header, log)
    for imu in tight.imus:
        imu.use = ("gyr",)
    tight.estimator.ekf = {"init_sigma_z": 0.005}
    tighter = bound_log(log, "tight", rig=tight)
    for lo, hi in ((with_acc, unknown_mount), (unknown_mount, gyros_only), (tighter, gyros_only)):
        assert all(x <= y * (1 + 1e-9) for x, y in zip(_crank(lo), _crank(hi), strict=True)), (_crank(lo), _crank(hi))
    assert with_acc.rmse_dof["crank"] < 0.9 * gyros_only.rmse_dof["crank"]
    # the first second is held by the prior: the default σ of 0.03 rad is 1.72°, the tight one 0.29°
    assert tighter.windows["0-1 s"]["crank"] < 0.5 * gyros_only.windows["0-1 s"]["crank"]
    assert gyros_only.windows["0-1 s"]["crank"] < 1.72


def test_the_smoothers_priors_give_their_own_bound(logs: dict[str, Path]) -> None:
    """``priors = "fgs"``: the smoother's priors on the same state model (its prior on the angle is
    0.02 rad against the filters' 0.03 rad, so its bound over the first second is lower)."""
    ekf, fgs = bound_log(logs["seed1"], "e", "ekf"), bound_log(logs["seed1"], "f", "fgs")
    assert fgs.priors == "fgs" and fgs.windows["0-1 s"]["crank"] < ekf.windows["0-1 s"]["crank"]


def test_bench_bound_prints_and_writes_every_record(tmp_path: Path) -> None:
    js = tmp_path / "bound.json"
    out = run_main("bench", "--bound", "--duration", "1", "--backends", "ekf,fgs", "--scenarios", "gyros",
                   "--cache-dir", str(tmp_path), "--json", str(js))
    assert out.returncode == 0, out.stderr
    rows = [line for line in out.stdout.splitlines() if " bound crank " in line]
    assert [r.split()[0] for r in rows] == ["ekf", "fgs"]
    recs = json.loads(js.read_text())
    assert [r["priors"] for r in recs] == ["ekf", "fgs"] and all(0 < r["rmse_dof"]["crank"] < 5 for r in recs)
    bad = run_main("bench", "--bound", "--scaling")
    assert bad.returncode == 2 and "--bound" in bad.stderr and "Traceback" not in bad.stderr


def test_a_log_without_truth_is_a_clear_error(logs: dict[str, Path], tmp_path: Path) -> None:
    """A recording of a real rig has no truth to linearise at: exit 2 naming the file, no estimates run."""
    src = read_log(logs["seed1"])
    log = tmp_path / "recorded.log"
    with LogWriter(log, src.header) as w:
        for rec in read_log(logs["seed1"]):
            if rec.topic != "truth/state":
                w.write(rec.topic, rec.t_recv, rec.payload)
    out = run_main("bench", "--bound", str(log), "--backends", "ekf")
    assert out.returncode == 2 and str(log) in out.stderr and "truth/state" in out.stderr
    assert "Traceback" not in out.stderr and "init error" not in out.stderr

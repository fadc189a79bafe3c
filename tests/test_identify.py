"""rigstate identify: Jacobians vs finite differences, identification of
perturbed parameters on a seeded simulation, the written rig, estimation with it, CLI errors; and the
rig concepts it needs (IMU mounting angle, time offset, calibrated biases)."""

from __future__ import annotations

import math
import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from estimator_service import schema
from estimator_service.bench import accuracy
from estimator_service.dofs import dofs_of
from estimator_service.offline import rig_of_log
from estimator_service.errors import ConfigError, UserError
from estimator_service.identify import (
    Channel, LogData, Problem, identify, parse_params, read_channels, write_identified,
)
from estimator_service.logfile import LogWriter, read_log
from estimator_service.offline import estimate_log
from estimator_service.paths import config_dir
from estimator_service.rig import load_rig
from estimator_service.simulate import simulate

from helpers import run_main, write_sim_log

# runs backends (or estimator subprocesses): their kernels compiled before the tests start (conftest.py)
pytestmark = pytest.mark.kernels("ekf")

CONFIG = config_dir()
GYRO_BIAS = math.radians(0.2)
MOUNT = math.radians(3.0)
OFFSET = 0.004
FRICTION = 0.04
I0_NOMINAL = 1.0 / 3.0  # fourbars1 crank: (1/3) m L²


def _rig_texts(truth: bool, mech_path: str, duration: float) -> str:
    """fourbars1 with one coupler IMU at 1 kHz (gyr + acc), the crank encoder, truth at 100 Hz."""
    imu_extra = ""
    sim_extra = ""
    if truth:
        imu_extra = f"gyr_bias = [0.0, 0.0, {GYRO_BIAS!r}]\nmount_deg = 3.0\ntime_offset_s = {OFFSET!r}\n"
        sim_extra = f'\n[[simulation.damper]]\nbodies = ["crank", "ground"]\nc = {FRICTION!r}\n'
    return f"""
[rig]
name = "fourbars1-test"
mechanism = "{mech_path}"

[[imu]]
name = "coupler"
body = "coupler"
point = "coupler_mid"
rate_hz = 1000
gyr_sigma_dps = 0.5
acc_sigma = 0.05
use = ["gyr", "acc"]
{imu_extra}
[[encoder]]
name = "crank"
body = "crank"
lines = 1024
rate_hz = 1000

[simulation]
duration_s = {duration}
seed = 3
truth_rate_hz = 100
{sim_extra}
[simulation.initial]
crank_deg = 30.0

[estimator]
backend = "ekf"

[estimator.init]
mode = "pose"
crank_deg = 30.0
"""


@pytest.fixture(scope="module")
def rigs(shared) -> dict[str, Path]:
    """Truth rig (crank I0 +20 %, crank friction, gyro bias, 3° mount, 4 ms offset), nominal rig, 8 s log: written
    once per session (conftest.shared), read only by the tests."""

    def make(d: Path) -> None:
        d.mkdir()
        nominal_yaml = (CONFIG / "mechanisms" / "fourbars1.yaml").read_text()
        truth_yaml = nominal_yaml.replace("I0: (1/3)*mass*length^2\n    cog: [0.5*length, 0.0]\n  - name: coupler",
                                          "I0: 1.2*(1/3)*mass*length^2\n    cog: [0.5*length, 0.0]\n  - name: coupler", 1)
        assert truth_yaml != nominal_yaml
        (d / "truth.yaml").write_text(truth_yaml)
        (d / "nominal.yaml").write_text(nominal_yaml)
        (d / "truth.toml").write_text(_rig_texts(True, "truth.yaml", 8.0))
        (d / "nominal.toml").write_text(_rig_texts(False, "nominal.yaml", 8.0))
        write_sim_log(d / "truth-8s.log", d / "truth.toml", 8.0)

    d = shared("identify", make)
    return {"dir": d, "truth": d / "truth.toml", "nominal": d / "nominal.toml", "log": d / "truth-8s.log"}


def _cut(lg: LogData, t_end: float, t_start: float = 0.0) -> LogData:
    """The samples of ``lg`` in [t_start, t_end] (s)."""
    chans = []
    for c in lg.channels:
        keep = (c.t >= t_start) & (c.t <= t_end)
        chans.append(Channel(c.kind, c.sensor, c.t[keep], c.y[keep], c.sigma))
    return LogData(lg.path, chans, min(c.t[0] for c in chans), max(c.t[-1] for c in chans))


@pytest.mark.timeout(900)  # a loaded 2-core machine; the work is bounded
def test_jacobian_matches_finite_differences(rigs: dict[str, Path]) -> None:
    """Every parameter kind and random trajectory columns: analytic sparse Jacobian vs central differences."""
    rig = load_rig(rigs["nominal"])
    spec = ("crank.I0,crank.mass,coupler.cog_x,coupler.cog_y,damper:crank,damper:coupler/rocker,"
            "gyro_bias:coupler,acc_bias:coupler,mount:coupler,time_offset:coupler")
    params, mech = parse_params(rig, spec)
    lg = _cut(read_channels(rig, str(rigs["log"])), 0.4)
    pb = Problem(rig, params, mech, [lg], dt=0.002)
    x = pb.initial_x()
    x[pb.nx:] += 0.01 * np.arange(1, pb.P + 1)
    x[pb.nx + [p.name for p in params].index("time_offset:coupler")] = 0.0033  # between nodes
    r, J = pb.residuals_and_jacobian(x)
    rng = np.random.default_rng(0)
    cols = list(rng.choice(pb.nx, 25, replace=False)) + list(range(pb.nx, pb.nx + pb.P))
    for c in cols:
        e = 1e-7 * max(1.0, abs(x[c]))
        xp, xm = x.copy(), x.copy()
        xp[c] += e
        xm[c] -= e
        fd = (pb.residuals_and_jacobian(xp, False)[0] - pb.residuals_and_jacobian(xm, False)[0]) / (2 * e)
        an = J[:, [c]].toarray().ravel()
        name = params[c - pb.nx].name if c >= pb.nx else f"trajectory column {c}"
        assert np.max(np.abs(fd - an)) <= 1e-5 * np.max(np.abs(an)), name


# --------------------------------------------------------------------------- identification
@pytest.fixture(scope="module")
def identified(rigs: dict[str, Path]):
    rig = load_rig(rigs["nominal"])
    params, mech = parse_params(rig, "crank.I0,damper:crank,gyro_bias:coupler,mount:coupler,time_offset:coupler")
    lines: list[str] = []
    result = identify(rig, params, mech, [str(rigs["log"])], dt=0.001, progress=lines.append)
    return rig, result, lines


@pytest.mark.timeout(900)  # a loaded 2-core machine; the work is bounded
def test_identified_parameters_within_tolerances(identified) -> None:
    """Perturbed truth recovered: within 3σ and 5 % (biases 0.02°/s, angle 0.3°, offset 1 ms)."""
    _, res, lines = identified
    est = {p.name: (v, s) for p, v, s in zip(res.params, res.estimate, res.sigma, strict=False)}
    truth = {"crank.I0": 1.2 * I0_NOMINAL, "damper:crank": FRICTION, "gyro_bias:coupler.x": 0.0,
             "gyro_bias:coupler.y": 0.0, "gyro_bias:coupler.z": GYRO_BIAS, "mount:coupler": MOUNT,
             "time_offset:coupler": OFFSET}
    tol = {"crank.I0": 0.05 * 1.2 * I0_NOMINAL, "damper:crank": 0.05 * FRICTION, "mount:coupler": math.radians(0.3),
           "time_offset:coupler": 0.001}
    for name, true in truth.items():
        v, s = est[name]
        assert abs(v - true) <= 3 * s, (name, v, true, s)
        assert abs(v - true) <= tol.get(name, math.radians(0.02)), (name, v, true)
        assert 0 < s < tol.get(name, math.radians(0.02)), (name, s)
    assert all(res.identifiable), res.reasons
    assert 0.8 < res.reduced_chi2 < 1.2
    assert lines[0].startswith("iter   0") and "cost" in lines[-1]
    assert res.correlation.shape == (7, 7) and np.allclose(np.diag(res.correlation), 1.0)


@pytest.mark.timeout(900)  # a loaded 2-core machine; the work is bounded
def test_unidentifiable_parameters_are_flagged(rigs: dict[str, Path]) -> None:
    """Scaling every mass and inertia together leaves a gravity-driven motion unchanged: flagged."""
    rig = load_rig(rigs["nominal"])
    spec = ",".join(f"{b}.{f}" for b in ("crank", "coupler", "rocker") for f in ("mass", "I0"))
    params, mech = parse_params(rig, spec)
    lg = _cut(read_channels(rig, str(rigs["log"])), 2.0)
    res = identify(rig, params, mech, [lg], dt=0.004)
    flagged = [p.name for p, ok in zip(res.params, res.identifiable, strict=False) if not ok]
    assert len(flagged) >= 2, res.reasons
    for p, why in zip(res.params, res.reasons, strict=False):
        if p.name in flagged:
            assert "barely inform (with " in why, why  # names the parameters it trades off against
    assert res.condition > 1e6


@pytest.mark.timeout(900)  # a loaded 2-core machine; the work is bounded
def test_two_logs_share_the_parameters(rigs: dict[str, Path]) -> None:
    """The log cut in two (two trajectories, one parameter set) gives the same parameters."""
    rig = load_rig(rigs["nominal"])
    lg = read_channels(rig, str(rigs["log"]))
    params, mech = parse_params(rig, "crank.I0,damper:crank,gyro_bias:coupler,mount:coupler,time_offset:coupler")
    res = identify(rig, params, mech, [_cut(lg, 4.0), _cut(lg, 8.0, 4.2)], dt=0.002)
    assert len(res.trajectories) == 2 and res.trajectories[1][0][0] >= 4.2
    assert abs(res.estimate[0] - 1.2 * I0_NOMINAL) < 0.05 * 1.2 * I0_NOMINAL
    assert abs(res.estimate[1] - FRICTION) < 0.05 * FRICTION
    assert abs(res.estimate[4] - GYRO_BIAS) < math.radians(0.02)
    assert abs(res.estimate[5] - MOUNT) < math.radians(0.3)
    assert abs(res.estimate[6] - OFFSET) < 0.001


def _crank_rmse(log: Path) -> float:
    truth, ests = {}, []
    for rec in read_log(log):
        if rec.topic == "truth/state":
            m = schema.decode(rec.topic, rec.payload)
            truth[int(round(m["t"] * 1000))] = m
        elif rec.topic == "est/state":
            ests.append(schema.decode(rec.topic, rec.payload))
    reader = read_log(log)
    rmse, _ = accuracy(truth, ests, dofs_of(rig_of_log(reader.header, log).model))
    assert "crank" in rmse
    return rmse["crank"]


@pytest.mark.timeout(900)  # a loaded 2-core machine; the work is bounded
def test_written_rig_loads_and_improves_estimation(identified, rigs: dict[str, Path], tmp_path: Path) -> None:
    rig, res, _ = identified
    paths = write_identified(rig, res, str(tmp_path / "fourbars1-identified.toml"), [str(rigs["log"])])
    assert paths == [str(tmp_path / "fourbars1-identified.toml"), str(tmp_path / "fourbars1-identified.yaml")]
    new = load_rig(paths[0])
    imu = new.imus[0]
    assert imu.mount == pytest.approx(res.estimate[5], abs=1e-12)
    assert imu.time_offset_s == pytest.approx(res.estimate[6], abs=1e-12)
    np.testing.assert_allclose(imu.gyr_bias_cal, res.estimate[2:5], atol=1e-12)
    assert new.mechanism.bodies[0].I0 == pytest.approx(res.estimate[0], rel=1e-12)
    assert [(d.body_a, d.body_b) for d in new.mechanism.dampers] == [(0, None)]
    assert new.mechanism.dampers[0].c == pytest.approx(res.estimate[1], rel=1e-12)
    # the other bodies keep their (expression-derived) values
    for b_new, b_old in zip(new.mechanism.bodies[1:], rig.mechanism.bodies[1:], strict=False):
        assert (b_new.mass, b_new.I0, b_new.cog) == (b_old.mass, b_old.I0, b_old.cog)
    short = tmp_path / "first-3s.log"  # estimation is the slow part: 3 s show the difference
    reader = read_log(rigs["log"])
    with LogWriter(short, reader.header) as w:
        for rec in reader:
            if rec.t_recv <= 3.0:
                w.write(rec.topic, rec.t_recv, rec.payload)
    rmse = {}
    for label, rig_path in (("nominal", rigs["nominal"]), ("identified", Path(paths[0]))):
        out = tmp_path / f"est-{label}.log"
        estimate_log(short, out, "ekf", rig_path)
        rmse[label] = _crank_rmse(out)
    assert rmse["identified"] < 0.7 * rmse["nominal"], rmse


# --------------------------------------------------------------------------- CLI

@pytest.mark.timeout(900)  # a loaded 2-core machine; the work is bounded
def test_cli_identify_writes_rig(rigs: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "id.toml"
    r = run_main("identify", str(rigs["log"]), "--rig", str(rigs["nominal"]), "--params",
            "crank.I0,damper:crank,gyro_bias:coupler,mount:coupler,time_offset:coupler", "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert "iter   0  cost" in r.stderr
    row = next(line for line in r.stdout.splitlines() if line.startswith("mount:coupler"))
    assert abs(float(row.split()[2]) - 3.0) < 0.3  # deg, estimate column
    assert f"wrote {out}" in r.stdout and (tmp_path / "id.yaml").exists()
    rig = load_rig(out)
    assert rig.imus[0].mount == pytest.approx(MOUNT, abs=math.radians(0.3))
    assert rig.mechanism.dampers[0].c > 0


@pytest.mark.parametrize("args, needle", [
    (["--params", "crank.I1"], "unknown parameter 'crank.I1'; known: crank.mass, crank.I0"),
    (["--params", "crank.I0", "--prior", "crank.I0"], "expected NAME=SIGMA"),
    (["--params", "crank.I0", "--dt", "0"], "--dt must be > 0"),
])
def test_cli_errors_exit_2(rigs: dict[str, Path], args: list[str], needle: str) -> None:
    r = run_main("identify", str(rigs["log"]), "--rig", str(rigs["nominal"]), *args)
    assert r.returncode == 2, r.stderr
    assert needle in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("spec, priors, needle", [
    ("gyro_bias:rocker", None, "unknown parameter 'gyro_bias:rocker'; known: crank.mass"),
    ("damper:nowhere", None, "unknown parameter 'damper:nowhere'"),
    ("coupler.mass, ", None, None),
    ("", None, "no parameter given"),
    ("crank.I0,crank.I0", None, "given twice"),
    ("crank.I0", {"coupler.mass": 1.0}, "is not one of the parameters"),
    ("crank.I0", {"crank.I0": -1.0}, "sigma must be > 0"),
])
def test_parse_params_errors(rigs: dict[str, Path], spec: str, priors: dict | None, needle: str | None) -> None:
    rig = load_rig(rigs["nominal"])
    if needle is None:
        params, _ = parse_params(rig, spec, priors)
        assert [p.name for p in params] == ["coupler.mass"] and params[0].value == 2.0
        return
    with pytest.raises(UserError, match=re.escape(needle)):
        parse_params(rig, spec, priors)


def test_parse_params_dampers_and_biases(rigs: dict[str, Path]) -> None:
    rig = load_rig(rigs["nominal"])
    params, mech = parse_params(rig, "damper:crank,damper:rocker/coupler,acc_bias:coupler", {"acc_bias:coupler": 0.1})
    assert [(d.body_a, d.body_b, d.c) for d in mech.dampers] == [(0, None, 0.0), (2, 1, 0.0)]
    assert [p.name for p in params][2:] == ["acc_bias:coupler.x", "acc_bias:coupler.y", "acc_bias:coupler.z"]
    assert all(p.prior_sigma == 0.1 for p in params[2:])


def test_unphysical_estimate_is_not_written(identified, rigs: dict[str, Path], tmp_path: Path) -> None:
    rig, res, _ = identified
    bad = replace(res, params=[replace(p) for p in res.params])
    bad.params[1].value = -0.01  # damper:crank
    with pytest.raises(UserError, match="damper:crank: identified value -0.01 .* is not physical"):
        write_identified(rig, bad, str(tmp_path / "x.toml"), [str(rigs["log"])])
    assert not (tmp_path / "x.toml").exists()


def test_cli_log_without_dof_encoder(rigs: dict[str, Path], tmp_path: Path) -> None:
    text = rigs["nominal"].read_text().replace('[[encoder]]\nname = "crank"\nbody = "crank"', '[[encoder]]\nname = "rk"\nbody = "rocker"')
    (tmp_path / "nominal.yaml").write_text((rigs["dir"] / "nominal.yaml").read_text())
    (tmp_path / "rk.toml").write_text(text)
    r = run_main("identify", str(rigs["log"]), "--rig", str(tmp_path / "rk.toml"), "--params", "crank.I0")
    assert r.returncode == 2
    assert "needs an encoder measuring each DOF against the ground" in r.stderr and "['crank']" in r.stderr


# --------------------------------------------------------------------------- rig concepts
def test_time_offset_stamps_lag_the_samples(rigs: dict[str, Path]) -> None:
    """With time_offset_s = δ an IMU message stamped t carries the reading the δ = 0 rig makes at t − δ."""
    truth = load_rig(rigs["truth"])
    no_lag = load_rig(rigs["truth"])
    no_lag.imus[0].time_offset_s = 0.0
    a = [m for tp, m in simulate(rig=truth, duration=0.3) if tp == "imu/coupler"]
    b = [m for tp, m in simulate(rig=no_lag, duration=0.3) if tp == "imu/coupler"]
    assert a[0]["t"] == pytest.approx(OFFSET) and b[0]["t"] == 0.0
    for ma, mb in zip(a, b, strict=False):
        assert ma["t"] == pytest.approx(mb["t"] + OFFSET, abs=1e-9)
        np.testing.assert_allclose(ma["gyr"], mb["gyr"], atol=1e-9)
        np.testing.assert_allclose(ma["acc"], mb["acc"], atol=1e-9)


def test_mount_rotates_accelerometer_and_calibration_is_subtracted(rigs: dict[str, Path]) -> None:
    rig = load_rig(rigs["truth"])
    plain = load_rig(rigs["nominal"])
    m = rig.model
    q = m.q0
    qd = m.solve_velocity(q, np.array([1.5]))
    qdd = m.forward_dynamics(q, qd)
    acc = next(s for s in rig.all_virtual_sensors(m) if s.kind == "acc")
    acc0 = next(s for s in plain.all_virtual_sensors(plain.model) if s.kind == "acc")
    y, y0 = acc.h(q, qd, qdd)[0], acc0.h(q, qd, qdd)[0]
    c, s = math.cos(MOUNT), math.sin(MOUNT)
    np.testing.assert_allclose(y[:2], [c * y0[0] + s * y0[1], -s * y0[0] + c * y0[1]], atol=1e-12)
    incl = next(s for s in rig.all_virtual_sensors(m) if s.kind == "incl")
    assert incl.h(q, qd, qdd)[0][0] == pytest.approx(m.body_angle(q, 1)[0] + MOUNT)
    rig.imus[0].gyr_bias_cal = np.array([0.0, 0.0, 0.01])
    gyr = next(s for s in rig.virtual_sensors(m) if s.kind == "gyr")
    np.testing.assert_allclose(gyr.measure({"gyr": [0.1, 0.2, 0.3]}), [0.1, 0.2, 0.29])


@pytest.mark.parametrize("line, field", [("time_offset_s = 0.7", "imu[0].time_offset_s"),
                                         ("mount_deg = \"x\"", "imu[0].mount_deg"),
                                         ("gyr_bias_cal = [1, 2]", "imu[0].gyr_bias_cal")])
def test_rig_rejects_bad_new_keys(rigs: dict[str, Path], tmp_path: Path, line: str, field: str) -> None:
    (tmp_path / "nominal.yaml").write_text((rigs["dir"] / "nominal.yaml").read_text())
    p = tmp_path / "bad.toml"
    p.write_text(rigs["nominal"].read_text().replace('use = ["gyr", "acc"]\n', f'use = ["gyr", "acc"]\n{line}\n'))
    with pytest.raises(ConfigError, match=field.replace("[", r"\[").replace("]", r"\]")):
        load_rig(p)


def test_simulator_rejects_negative_time_offset(rigs: dict[str, Path]) -> None:
    rig = load_rig(rigs["truth"])
    rig.imus[0].time_offset_s = -0.001
    with pytest.raises(UserError, match="time_offset_s"):
        next(iter(simulate(rig=rig, duration=0.1)))

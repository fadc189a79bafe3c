"""Virtual sensors (Jacobians vs finite differences, physical checks), rig config, simulator accuracy."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from estimator_service import schema
from estimator_service.errors import ConfigError
from estimator_service.logfile import read_log
from estimator_service.mechanism import load_mechanism
from estimator_service.model import Model
from estimator_service.paths import config_dir
from estimator_service.rig import load_rig
from estimator_service.sensors import Accelerometer, Encoder, Gyro, Inclination
from estimator_service.simulate import simulate

from conftest import RIG, RIG_ACC
from test_model import fd_jac


@pytest.fixture(scope="module")
def rig():
    return load_rig(RIG_ACC)


@pytest.mark.parametrize("crank", [0.4, 2.0, 3.9])
def test_sensor_jacobians_match_finite_differences(rig, crank: float) -> None:
    m = rig.model
    rng = np.random.default_rng(5)
    q = m.solve_position(m.q0, np.array([crank])) + 1e-3 * rng.standard_normal(m.n)
    qd = m.solve_velocity(q, np.array([1.3])) + 0.1 * rng.standard_normal(m.n)
    qdd = rng.standard_normal(m.n)
    sensors = rig.all_virtual_sensors(m)
    assert {type(s) for s in sensors} == {Gyro, Accelerometer, Inclination, Encoder}
    for s in sensors:
        y, H_q, H_qd, H_qdd = s.h(q, qd, qdd)
        assert y.shape == (s.dim,)
        np.testing.assert_allclose(H_q, fd_jac(lambda x: s.h(x, qd, qdd)[0], q), atol=1e-7, err_msg=f"{s.kind} {s.name} q")
        np.testing.assert_allclose(H_qd, fd_jac(lambda x: s.h(q, x, qdd)[0], qd), atol=1e-7, err_msg=f"{s.kind} {s.name} qd")
        np.testing.assert_allclose(H_qdd, fd_jac(lambda x: s.h(q, qd, x)[0], qdd), atol=1e-7, err_msg=f"{s.kind} {s.name} qdd")


def test_gyro_reads_the_crank_rate_and_accelerometer_reads_gravity_at_rest() -> None:
    m = Model(load_mechanism(config_dir() / "mechanisms" / "fourbar-sensors2016.yaml"))
    crank = m.body_index("crank")
    from estimator_service.sensors import NoiseModel, axes_matrix

    noise = NoiseModel(np.zeros(3), np.zeros(3))
    gyro = Gyro("c", "imu/c", m, crank, axes_matrix(["+x", "+y", "+z"]), noise)
    q = m.solve_position(m.q0, np.array([0.7]))
    qd = m.solve_velocity(q, np.array([2.5]))
    np.testing.assert_allclose(gyro.h(q, qd, None)[0], [0, 0, 2.5], atol=1e-12)
    flipped = Gyro("c", "imu/c", m, crank, axes_matrix(["+x", "-z", "+y"]), noise)
    np.testing.assert_allclose(flipped.h(q, qd, None)[0], [0, -2.5, 0], atol=1e-12)
    # crank at 90 deg: body x points up; at rest the accelerometer at A reads +9.81 on body x
    q = m.solve_position(m.q0, np.array([math.pi / 2]))
    acc = Accelerometer("c", "imu/c", m, crank, (0.0, 0.0), axes_matrix(["+x", "+y", "+z"]), noise)
    np.testing.assert_allclose(acc.h(q, np.zeros(m.n), np.zeros(m.n))[0], [9.81, 0, 0], atol=1e-12)


def test_encoder_counts_and_noise_model() -> None:
    rig = load_rig(RIG)
    enc = next(s for s in rig.all_virtual_sensors(rig.model) if isinstance(s, Encoder) and s.name == "crank")
    assert enc.cpr == 4096
    assert enc.to_counts(2 * math.pi) == 4096 and enc.to_counts(-math.pi / 2) == -1024
    assert enc.from_counts(enc.to_counts(1.0)) == pytest.approx(1.0, abs=math.pi / 4096)
    with pytest.raises(schema.SchemaError, match="4096"):
        enc.measure({"count": 1, "cpr": 1000})
    from estimator_service.sensors import NoiseModel

    nm = NoiseModel(np.full(3, 0.1), np.array([1.0, 0, 0]), lsb=0.01)
    rng = np.random.default_rng(0)
    samples = np.array([nm.sample(np.zeros(3), rng) for _ in range(4000)])
    assert samples.mean(axis=0) == pytest.approx([1.0, 0, 0], abs=0.01)
    assert samples.std(axis=0) == pytest.approx([0.1] * 3, rel=0.05)
    np.testing.assert_allclose(samples / 0.01, np.round(samples / 0.01), atol=1e-9)  # quantised


def test_rig_errors_name_file_field_value(tmp_path: Path) -> None:
    text = RIG.read_text().replace('rate_hz = 100\ngyr_sigma_dps = 0.5\nacc_sigma = 0.05\nuse = ["gyr"]\nendpoint = "tcp://127.0.0.1:5602"',
                                   'rate_hz = -5\ngyr_sigma_dps = 0.5\nacc_sigma = 0.05\nuse = ["gyr"]\nendpoint = "tcp://127.0.0.1:5602"')
    bad = tmp_path / "rig.toml"
    bad.write_text(text.replace("../mechanisms/", str(config_dir() / "mechanisms") + "/"))
    with pytest.raises(ConfigError, match=r"rig.toml: imu\[1\].rate_hz: must be > 0, got -5"):
        load_rig(bad)
    bad.write_text(RIG.read_text().replace('body = "rocker"\npoint', 'body = "wheel"\npoint')
                   .replace("../mechanisms/", str(config_dir() / "mechanisms") + "/"))
    with pytest.raises(ConfigError, match=r"imu\[1\].body: unknown body 'wheel'"):
        load_rig(bad)


def _energy_drift(mech_path: Path, crank0: float, duration: float) -> tuple[float, float]:
    model = Model(load_mechanism(mech_path))
    model_q0 = model.solve_position(model.q0, np.array([crank0]))
    model.q0[:] = model_q0
    E, worst_phi = [], 0.0
    for topic, msg in simulate(model=model, duration=duration):
        q, qd = np.array(msg["q"]), np.array(msg["qd"])
        worst_phi = max(worst_phi, float(np.abs(model.Phi(q)).max()))
        E.append(model.energy(q, qd))
    E = np.array(E)
    return float(np.abs(E - E[0]).max() / np.abs(E).max()), worst_phi


@pytest.mark.parametrize("name, crank0", [("fourbar-sensors2016.yaml", math.pi / 2), ("fourbars1.yaml", 0.3)])
def test_frictionless_simulation_conserves_energy_and_constraints(name: str, crank0: float) -> None:
    drift, phi = _energy_drift(config_dir() / "mechanisms" / name, crank0, 10.0)
    assert drift <= 1e-6
    assert phi <= 1e-9


def test_simulation_is_seeded_and_streams_are_complete(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "estimator_service.cli", "simulate", "--rig", str(RIG), "--duration", "0.5", "--seed", "4"]
    for name in ("a", "b"):
        out = subprocess.run(cmd + ["--out", str(tmp_path / f"{name}.log")], capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
    assert (tmp_path / "a.log").read_bytes() == (tmp_path / "b.log").read_bytes()
    subprocess.run(cmd[:-1] + ["5", "--out", str(tmp_path / "c.log")], check=True, capture_output=True)
    assert (tmp_path / "a.log").read_bytes() != (tmp_path / "c.log").read_bytes()
    counts: dict[str, int] = {}
    for rec in read_log(tmp_path / "a.log"):
        schema.decode(rec.topic, rec.payload)
        counts[rec.topic] = counts.get(rec.topic, 0) + 1
    assert counts == {"truth/state": 501, "imu/coupler": 51, "imu/rocker": 51, "enc/crank": 501, "enc/rocker": 501}


def test_simulate_mechanism_only(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "estimator_service.cli", "simulate", "--mechanism",
                          str(config_dir() / "mechanisms" / "slider-crank.yaml"), "--duration", "0.2",
                          "--out", str(tmp_path / "m.log")], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    recs = list(read_log(tmp_path / "m.log"))
    assert {r.topic for r in recs} == {"truth/state"} and len(recs) == 201
    first = schema.decode("truth/state", recs[0].payload)
    assert first["zd"] == [0.0]  # released at rest

"""Rig TOML: shipped rigs, defaults, rebuilding from a log header, errors naming file, field and value."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from estimator_service.errors import ConfigError
from estimator_service.paths import config_dir
from estimator_service.rig import load_rig, load_rig_text
from estimator_service.sensors import Accelerometer, Encoder, Gyro

from helpers import RIG, RIG_ACC

MECH_DIR = config_dir() / "mechanisms"


def write_rig(tmp_path: Path, text: str) -> Path:
    """A rig file in tmp_path whose mechanism paths point at the shipped mechanisms."""
    path = tmp_path / "rig.toml"
    path.write_text(text.replace("../mechanisms/", str(MECH_DIR) + "/"))
    return path


MINIMAL = """
[rig]
mechanism = "../mechanisms/fourbar-sensors2016.yaml"

[[imu]]
name = "a"
body = "coupler"

[[encoder]]
name = "crank"
body = "crank"
lines = 500
"""


def test_public_scenario_rig() -> None:
    rig = load_rig(RIG)
    assert rig.name == "fourbar-sensors2016" and rig.mechanism_yaml == (MECH_DIR / "fourbar-sensors2016.yaml").read_text()
    assert [b.name for b in rig.mechanism.bodies] == ["crank", "coupler", "rocker"]
    sim = rig.simulation
    assert sim.duration_s == 20.0 and sim.initial == {"crank": pytest.approx(math.pi / 2)} and sim.initial_rate == {"crank": 0.0}
    assert [(d.body_a, d.body_b, d.c) for d in sim.dampers] == [(0, None, 0.02)]  # crank bearing, unmodelled
    assert rig.model.mech.dampers == []  # the estimators' model does not know the friction
    assert len(rig.truth_model().mech.dampers) == 1
    coupler, rocker = rig.imus
    assert coupler.at == pytest.approx(rig.mechanism.named_points[0].local)  # named point imu1 = coupler point 3
    assert coupler.rate_hz == rocker.rate_hz == 100
    np.testing.assert_allclose(coupler.gyr.sigma, [math.radians(0.5)] * 3)
    np.testing.assert_allclose(coupler.acc.sigma, [0.05] * 3)
    assert [(e.name, e.cpr, e.use, e.relative_to) for e in rig.encoders] == [("crank", 4096, False, None), ("rocker", 40000, False, None)]
    assert rig.estimator.init == {"mode": "pose", "crank_deg": 90.0, "crank_error_deg": 1.0}
    assert rig.estimator.dt == 0.001
    # fused channels in the documented order: per imu gyr then acc (if used), then used encoders
    fused = rig.virtual_sensors(rig.model)
    assert [(type(s), s.name) for s in fused] == [(Gyro, "coupler"), (Gyro, "rocker")]
    assert [rig.topic_of(s) for s in fused] == ["imu/coupler", "imu/rocker"]
    assert rig.sensor_endpoints() == ["tcp://127.0.0.1:5599", "tcp://127.0.0.1:5601", "tcp://127.0.0.1:5602", "tcp://127.0.0.1:5603"]
    acc = load_rig(RIG_ACC)
    assert [(type(s), s.name) for s in acc.virtual_sensors(acc.model)] == [(Gyro, "coupler"), (Accelerometer, "coupler"), (Gyro, "rocker")]


def test_every_shipped_rig_loads_and_assembles() -> None:
    rigs = sorted((config_dir() / "rigs").glob("*.toml"))
    assert {p.name for p in rigs} >= {"fourbar-sensors2016.toml", "fourbar-sensors2016-acc.toml", "fourbars1.toml"}
    for path in rigs:
        rig = load_rig(path)
        m = rig.model
        assert np.abs(m.Phi(m.q0)).max() < 1e-9, path
        assert all(s.dim == len(s.sigma) for s in rig.all_virtual_sensors(m))


def test_defaults(tmp_path: Path) -> None:
    rig = load_rig(write_rig(tmp_path, MINIMAL))
    assert rig.name == "rig"  # the file stem
    imu, enc = rig.imus[0], rig.encoders[0]
    assert imu.rate_hz == 100 and imu.use == ("gyr",) and imu.at == (0.0, 0.0)
    np.testing.assert_array_equal(imu.axes, np.eye(3))
    np.testing.assert_allclose(imu.gyr.sigma, [math.radians(0.5)] * 3)
    np.testing.assert_array_equal(imu.gyr.bias, np.zeros(3))
    assert imu.gyr.lsb == 0 and imu.acc.lsb == 0
    assert imu.mount == 0 and imu.mount_prior == pytest.approx(math.radians(5.0))  # a mount state for a fused accelerometer
    assert rig.simulation.mount == {}
    assert enc.rate_hz == 1000 and enc.use is False and enc.relative_to is None and enc.offset == 0
    assert enc.sigma == pytest.approx(2 * math.pi / 2000 / math.sqrt(12))  # quantisation step / sqrt(12)
    assert (imu.endpoint, enc.endpoint) == ("tcp://127.0.0.1:5601", "tcp://127.0.0.1:5602")
    assert (rig.bus.estimator, rig.bus.sim) == ("tcp://127.0.0.1:5600", "tcp://127.0.0.1:5599")
    assert (rig.simulation.duration_s, rig.simulation.seed, rig.simulation.truth_rate_hz) == (10.0, 0, 1000.0)
    assert rig.simulation.dampers == [] and rig.simulation.torques == {}
    est = rig.estimator
    assert (est.backend, est.dt, est.init, est.ekf, est.ukf, est.fgs) == ("fgs", 0.001, {}, {}, {}, {})
    assert rig.virtual_sensors(rig.model)[0].name == "a" and len(rig.virtual_sensors(rig.model)) == 1


def test_backend_tables_are_stored_for_the_backends(tmp_path: Path) -> None:
    rig = load_rig(write_rig(tmp_path, MINIMAL + """
[simulation.torque]
crank = 0.3

[estimator]
backend = "ukf"
[estimator.ukf]
alpha = 0.5
[estimator.fgs]
window_ms = 50
anything = "each backend validates its own keys"
"""))
    assert rig.estimator.backend == "ukf"
    assert rig.estimator.ukf == {"alpha": 0.5} and rig.estimator.fgs["window_ms"] == 50 and rig.estimator.ekf == {}
    assert rig.simulation.torques == {"crank": 0.3}


def test_rebuilt_from_log_header_texts() -> None:
    rig = load_rig(RIG_ACC)
    header = rig.header({"seed": 1})
    assert header["rig_toml"] == RIG_ACC.read_text() and header["meta"] == {"seed": 1}
    again = load_rig_text(header["rig_toml"], header["mechanism_yaml"], "run.log")
    assert again.name == rig.name and again.toml_text == rig.toml_text
    np.testing.assert_array_equal(again.model.q0, rig.model.q0)
    assert [(s.kind, s.name, s.topic) for s in again.virtual_sensors(again.model)] == \
           [(s.kind, s.name, s.topic) for s in rig.virtual_sensors(rig.model)]
    assert again.simulation == rig.simulation and again.estimator.init == rig.estimator.init
    with pytest.raises(ConfigError, match=r"run.log: imu\[0\].rate_hz: must be > 0, got 0"):
        load_rig_text(header["rig_toml"].replace("rate_hz = 100", "rate_hz = 0", 1), header["mechanism_yaml"], "run.log")


@pytest.mark.parametrize("old, new, field, problem", [
    ('rate_hz = 100\ngyr_sigma_dps = 0.5\nacc_sigma = 0.05\nuse = ["gyr"]\nendpoint = "tcp://127.0.0.1:5602"',
     'rate_hz = -5\ngyr_sigma_dps = 0.5\nacc_sigma = 0.05\nuse = ["gyr"]\nendpoint = "tcp://127.0.0.1:5602"',
     r"imu\[1\].rate_hz", "must be > 0, got -5"),
    ('body = "rocker"\npoint', 'body = "wheel"\npoint', r"imu\[1\].body", "unknown body 'wheel'"),
    ('point = "imu2"', 'point = "imu1"', r"imu\[1\].point", "is on body 'coupler', not on 'rocker'"),
    ('point = "imu1"', 'point = "imu9"', r"imu\[0\].point", "unknown named point 'imu9'"),
    ('point = "imu1"', 'at = [0.1, "x"]', r"imu\[0\].at", "expected \\[x, y\\]"),
    ('point = "imu1"', 'point = "imu1"\nat = [0.1, 0]', r"imu\[0\].at", "not both"),
    ('axes = ["+x", "-z", "+y"]', 'axes = ["+x", "+z", "+y"]', r"imu\[0\].axes", "right-handed"),
    ('gyr_sigma_dps = 0.5', 'gyr_sigma_dps = 0.5\ngyr_sigma = 0.01', r"imu\[0\].gyr_sigma", "not both"),
    ('acc_sigma = 0.05', 'acc_sigma = -1', r"imu\[0\].acc_sigma", "must be >= 0, got -1"),
    ('acc_sigma = 0.05', 'acc_sigma = 0.05\nacc_bias = [0, 1]', r"imu\[0\].acc_bias", "expected 3 numbers"),
    ('use = ["gyr"]', 'use = ["gyro"]', r"imu\[0\].use", "'gyr', 'acc', 'incl'"),
    ('acc_sigma = 0.05', 'acc_sigma = 0.05\nmount_prior_deg = -1', r"imu\[0\].mount_prior_deg", "must be >= 0, got -1"),
    ('acc_sigma = 0.05', 'acc_sigma = 0.05\nmount_prior_deg = 60', r"imu\[0\].mount_prior_deg", "must be <= 45 deg .*got 60"),
    ('acc_sigma = 0.05', 'acc_sigma = 0.05\nmount_prior_deg = "5"', r"imu\[0\].mount_prior_deg", "expected a number, got '5'"),
    ("truth_rate_hz = 1000", "truth_rate_hz = 1000\nmount_deg = 3", "simulation.mount_deg", "expected a table"),
    ("truth_rate_hz = 1000", "truth_rate_hz = 1000\n[simulation.mount_deg]\nwheel = 3", "simulation.mount_deg.wheel",
     "unknown key"),
    ("truth_rate_hz = 1000", "truth_rate_hz = 1000\n[simulation.mount_deg]\ncoupler = nan", "simulation.mount_deg.coupler",
     "expected a number, got nan"),
    ('acc_sigma = 0.05', 'acc_sigma = 0.05\nsample_rate = 5', r"imu\[0\].sample_rate", "unknown key"),
    ('endpoint = "tcp://127.0.0.1:5601"', 'endpoint = "127.0.0.1:5601"', r"imu\[0\].endpoint", "ZeroMQ endpoint"),
    ("lines = 1024", "lines = 0", r"encoder\[0\].lines", "positive integer"),
    ('relative_to = "ground"\nlines = 1024', 'relative_to = "table"\nlines = 1024', r"encoder\[0\].relative_to", "unknown body 'table'"),
    ("use = false", "use = 1", r"encoder\[0\].use", "true or false"),
    ("crank_deg = 90.0\ncrank_rate", "theta_deg = 90.0\ncrank_rate", r"simulation.initial.theta_deg", "unknown dof 'theta'"),
    ('bodies = ["crank", "ground"]', 'bodies = ["crank", "floor"]', r"simulation.damper\[0\].bodies", "unknown body 'floor'"),
    ("c = 0.02", "c = -0.02", r"simulation.damper\[0\].c", "must be >= 0"),
    ("seed = 1", "seed = -1", "simulation.seed", "integer >= 0, got -1"),
    ("duration_s = 20.0", "duration_s = 0", "simulation.duration_s", "must be > 0, got 0"),
    ("truth_rate_hz = 1000", "truth_rate_hz = 1000\n[simulation.torque]\nrocker = 1",
     "simulation.torque.rocker", "unknown key"),
    ('backend = "fgs"', 'backend = "kalman"', "estimator.backend", "'ekf', 'ukf', 'fgs'"),
    ('mode = "pose"', 'mode = "magic"', "estimator.init.mode", "got 'magic'"),
    ("dt = 0.001", "dt = -0.001", "estimator.dt", "must be > 0"),
    ('sim = "tcp://127.0.0.1:5599"', 'sim = "localhost"', "bus.sim", "ZeroMQ endpoint"),
    ("[[imu]]\nname = \"rocker\"", "[[imu]]\nname = \"coupler\"", r"imu\[1\].name", "duplicate sensor name 'coupler'"),
    ("[bus]", "[buss]", "buss", "unknown table"),
    ("[rig]", "[rig]\nmechanisms = 1", "rig.mechanisms", "unknown key"),
    ('mechanism = "../mechanisms/fourbar-sensors2016.yaml"', 'mechanism = "../mechanisms/none.yaml"', "rig.mechanism", "cannot read"),
    ("seed = 1", "seed = = 1", "", "TOML syntax error"),
])
def test_errors_name_file_field_and_value(tmp_path: Path, old: str, new: str, field: str, problem: str) -> None:
    text = RIG.read_text()
    assert old in text
    path = write_rig(tmp_path, text.replace(old, new, 1))
    with pytest.raises(ConfigError, match=r"rig.toml: " + (field + ": " if field else "") + ".*" + problem):
        load_rig(path)


def test_sensor_sections_must_be_arrays_of_tables(tmp_path: Path) -> None:
    path = write_rig(tmp_path, MINIMAL.replace("[[imu]]", "[imu]"))
    with pytest.raises(ConfigError, match=r"rig.toml: imu: expected an array of tables"):
        load_rig(path)


def test_encoder_relative_to_a_body(tmp_path: Path) -> None:
    rig = load_rig(write_rig(tmp_path, MINIMAL.replace('body = "crank"', 'body = "rocker"\nrelative_to = "coupler"\nuse = true')))
    enc = rig.virtual_sensors(rig.model)[-1]
    assert isinstance(enc, Encoder) and (enc.body, enc.relative_to, enc.cpr) == (2, 1, 2000)
    q = rig.model.q0
    phi = rig.model.body_angle(q, 2)[0] - rig.model.body_angle(q, 1)[0]
    assert enc.h(q, np.zeros(rig.model.n), np.zeros(rig.model.n))[0][0] == pytest.approx(phi)

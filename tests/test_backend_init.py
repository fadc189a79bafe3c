"""Initialisation of the backends: configured pose, encoder reading (on a DOF or on another body, with
the configured branch), gravity direction at rest; configuration errors; the restart pose after a
divergence; encoder initialisation through the pipeline."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from estimator_service import schema
from estimator_service.backends import make_backend
from estimator_service.backends.base import Measurement
from estimator_service.backends.init import Initializer, body_angle_at_rest, q_from_encoder, z_for_body_angle
from estimator_service.errors import ConfigError
from estimator_service.logfile import read_log
from estimator_service.offline import rig_of_log
from estimator_service.pipeline import Pipeline
from estimator_service.rig import load_rig
from estimator_service.sensors import Accelerometer, Encoder

from helpers import RIG, RIG_ACC, write_rig_copy, write_sim_log

# runs backends (or estimator subprocesses): their kernels compiled before the tests start (conftest.py)
pytestmark = pytest.mark.kernels("ekf")


def rig_with_init(init: dict, path: Path = RIG_ACC):
    rig = load_rig(path)
    rig.estimator.init = init
    return rig, rig.model


def sensor(rig, cls, name: str):
    return next(s for s in rig.all_virtual_sensors(rig.model) if isinstance(s, cls) and s.name == name)


def rocker_angle(m, q: np.ndarray) -> float:
    return m.body_angle(q, m.body_index("rocker"))[0]


def test_pose_mode_with_deliberate_error_and_rate() -> None:
    rig, m = rig_with_init({"mode": "pose", "crank_deg": 30.0, "crank_error_deg": 1.0, "crank_rate": -2.0})
    init = Initializer(m, rig, rig.virtual_sensors(m))
    t0, q, qd = init.offer("imu/rocker", {"t": 0.25, "seq": 0, "gyr": [0.0, 0.0, 0.0], "acc": [0.0, 0.0, 0.0]})
    assert t0 == 0.25 and q[m.dof[0]] == pytest.approx(math.radians(31.0), abs=1e-12)
    assert qd[m.dof[0]] == pytest.approx(-2.0) and np.abs(m.Phi_q(q) @ qd).max() < 1e-12
    assert np.abs(m.Phi(q)).max() < 1e-10


def test_encoder_on_the_dof_sets_it_directly() -> None:
    rig, m = rig_with_init({"mode": "encoder", "encoder": "crank"})
    enc = sensor(rig, Encoder, "crank")
    init = Initializer(m, rig, rig.virtual_sensors(m))
    count = enc.to_counts(math.radians(40.0))
    assert init.offer("enc/rocker", {"t": 2.0, "seq": 0, "count": 5, "cpr": 40000}) is None  # waits for its encoder
    t0, q, qd = init.offer("enc/crank", {"t": 3.0, "seq": 0, "count": count, "cpr": enc.cpr})
    assert t0 == 3.0 and q[m.dof[0]] == pytest.approx(enc.from_counts(count), abs=1e-12)
    assert np.abs(m.Phi(q)).max() < 1e-10 and not qd.any()


def test_encoder_on_another_body_picks_the_configured_branch() -> None:
    """The rocker angle is reached at two crank angles; ``crank_hint_deg`` picks one."""
    rig, m = rig_with_init({"mode": "encoder", "encoder": "rocker"})
    enc = sensor(rig, Encoder, "rocker")
    q40 = m.solve_position(m.q0, np.array([math.radians(40.0)]))
    phi = rocker_angle(m, q40)
    other = z_for_body_angle(m, enc.body, phi, None, math.radians(40.0) + math.pi)  # search from the far side
    z_other = float(other[m.dof][0])
    assert abs(math.remainder(z_other - math.radians(40.0), 2 * math.pi)) > math.radians(5.0)  # another solution
    assert rocker_angle(m, other) == pytest.approx(phi, abs=1e-9)
    for hint, z_expected in ((40.0, math.radians(40.0)), (math.degrees(z_other) + 5.0, z_other)):
        rig.estimator.init = {"mode": "encoder", "encoder": "rocker", "crank_hint_deg": hint}
        init = Initializer(m, rig, rig.virtual_sensors(m))
        _, q, _ = init.offer("enc/rocker", {"t": 0.0, "seq": 0, "count": enc.to_counts(phi), "cpr": enc.cpr})
        assert math.remainder(q[m.dof[0]] - z_expected, 2 * math.pi) == pytest.approx(0.0, abs=5e-3)  # rocker counts 1.6e-4 rad, amplified
        assert rocker_angle(m, q) == pytest.approx(enc.from_counts(enc.to_counts(phi)), abs=1e-9)


def test_gravity_at_rest_gives_the_body_angle_and_the_branch() -> None:
    rig, m = rig_with_init({"mode": "gravity", "imu": "rocker", "samples": 3, "crank_hint_deg": 45})
    acc = sensor(rig, Accelerometer, "rocker")
    q_true = m.solve_position(m.q0, np.array([math.radians(40.0)]))
    y = acc.h(q_true, np.zeros(m.n), np.zeros(m.n))[0]
    assert body_angle_at_rest(m, acc, y) == pytest.approx(rocker_angle(m, q_true), abs=1e-12)
    init = Initializer(m, rig, rig.virtual_sensors(m))
    rng = np.random.default_rng(3)
    noise = [0.01 * rng.standard_normal(3) for _ in range(3)]
    noise[2] = -noise[0] - noise[1]  # zero-mean noise: the mean reading is the true one
    outs = [init.offer("imu/rocker", {"t": 1.0 + 0.01 * k, "seq": k, "gyr": [0.0, 0.0, 0.0], "acc": (y + n).tolist()})
            for k, n in enumerate(noise)]
    assert outs[0] is None and outs[1] is None
    t0, q, qd = outs[2]
    assert t0 == pytest.approx(1.02) and not qd.any()
    assert q[m.dof[0]] == pytest.approx(math.radians(40.0), abs=1e-9)
    # the coupler's IMU works too
    rig.estimator.init = {"mode": "gravity", "imu": "coupler", "samples": 1}
    acc_c = sensor(rig, Accelerometer, "coupler")
    init = Initializer(m, rig, rig.virtual_sensors(m))
    y_c = acc_c.h(q_true, np.zeros(m.n), np.zeros(m.n))[0]
    _, q, _ = init.offer("imu/coupler", {"t": 0.0, "seq": 0, "gyr": [0.0, 0.0, 0.0], "acc": y_c.tolist()})
    assert m.body_angle(q, acc_c.body)[0] == pytest.approx(m.body_angle(q_true, acc_c.body)[0], abs=1e-9)


@pytest.mark.parametrize("init, field, text", [
    ({"mode": "pose", "crank_hint_deg": 3.0}, "estimator.init.crank_hint_deg", "unknown key for mode 'pose'"),
    ({"mode": "pose", "crank_deg": "ninety"}, "estimator.init.crank_deg", "'ninety'"),
    ({"mode": "encoder", "encoder": "coupler"}, "estimator.init.encoder", "unknown encoder 'coupler'"),
    ({"mode": "encoder", "encoder": "crank", "crank_deg": 3.0}, "estimator.init.crank_deg", "unknown key"),
    ({"mode": "gravity", "imu": "wrist"}, "estimator.init.imu", "unknown imu 'wrist'"),
    ({"mode": "gravity", "imu": "rocker", "samples": 0}, "estimator.init.samples", "got 0"),
])
def test_init_config_errors_name_file_field_and_value(init: dict, field: str, text: str) -> None:
    rig, m = rig_with_init(init)
    with pytest.raises(ConfigError) as exc:
        Initializer(m, rig, rig.virtual_sensors(m))
    assert str(RIG_ACC.name) in str(exc.value) and field in str(exc.value) and text in str(exc.value)


def test_restart_pose_uses_a_recent_encoder_reading_else_the_last_good_pose() -> None:
    rig = load_rig(RIG)
    rig.encoders[0].use = True
    m = rig.model
    f = make_backend("ekf", m, rig.virtual_sensors(m), rig.estimator)
    q = m.solve_position(m.q0, np.array([1.0]))
    f.initialize(0.0, q, m.solve_velocity(q, np.array([2.0])))
    enc_index = [s.kind for s in f.sensors].index("enc")
    q_good = m.solve_position(m.q0, np.array([1.2]))
    assert f.restart_pose(q_good)[0] is not q_good and np.array_equal(f.restart_pose(q_good)[0], q_good)
    f.add_measurement(Measurement(0.0005, enc_index, np.array([1.25])))
    f.add_measurement(Measurement(0.0007, enc_index, np.array([float("nan")])))  # ignored as a restart source
    f.step()
    q_r, qd_r = f.restart_pose(q_good)
    assert q_r[m.dof[0]] == pytest.approx(1.25) and np.abs(m.Phi(q_r)).max() < 1e-10 and not qd_r.any()
    np.testing.assert_allclose(q_from_encoder(m, f.sensors[enc_index], 1.25, q_good), q_r, atol=1e-12)
    for _ in range(250):  # the reading gets older than degraded_after_s (0.2 s)
        f.step()
    assert np.array_equal(f.restart_pose(q_good)[0], q_good)


def test_pipeline_starts_from_the_encoder(tmp_path: Path) -> None:
    """Encoder-mode initialisation through the pipeline: the filter starts on the encoder reading, at
    rest, and tracks the simulated run (gyros only: the angle is weakly observable, errors of some
    tenths of a degree are the filter's, not the start's)."""
    rig_path = write_rig_copy(tmp_path / "enc-init.toml", RIG, [('mode = "pose"\ncrank_deg = 90.0\ncrank_error_deg = 1.0',
                                                                 'mode = "encoder"\nencoder = "crank"')])
    log = write_sim_log(tmp_path / "enc-init.log", rig_path, 2.0)
    reader = read_log(log)
    pipe = Pipeline(rig_of_log(reader.header, log), "ekf")
    ests, truth, first_enc = [], {}, None
    for rec in reader:
        msg = schema.decode(rec.topic, rec.payload)
        if rec.topic == "truth/state":
            truth[int(round(msg["t"] * 1000))] = msg["crank"]
        if rec.topic == "enc/crank" and first_enc is None:
            first_enc = msg["count"] * 2 * math.pi / msg["cpr"]
        if rec.topic != "truth/state":
            ests.extend(pipe.feed(rec.topic, msg))
    assert ests and first_enc is not None
    assert abs(ests[0]["crank"] - math.pi / 2) < math.radians(0.1) and abs(first_enc - math.pi / 2) < math.radians(0.1)
    err = [abs(e["crank"] - truth[k]) for e in ests if (k := int(round(e["t"] * 1000))) in truth]
    assert len(err) > 1900 and err[0] < 1e-6  # exact start: the encoder read 90 deg
    assert math.sqrt(np.mean(np.square(err))) < math.radians(0.5) and max(err) < math.radians(2.0)

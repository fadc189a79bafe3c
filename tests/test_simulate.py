"""Simulator: energy and constraint accuracy, power balance with friction and torque, sensor streams,
seeded determinism, ``rigstate simulate``, and the simulated source ``drivers.sim`` (over real ZeroMQ)."""

from __future__ import annotations

import math
import signal
import subprocess
import sys
from pathlib import Path

import msgpack
import numpy as np
import pytest

from drivers.sim import SimRecording, SimSource, encoder_angle_fn, imu_sample_fn
from estimator_service import schema
from estimator_service.bus import Subscriber
from estimator_service.errors import ConfigError
from estimator_service.logfile import read_log
from estimator_service.mechanism import load_mechanism
from estimator_service.model import Model
from estimator_service.paths import config_dir
from estimator_service.rig import load_rig, load_rig_text
from estimator_service.sensors import Accelerometer, Encoder, Gyro, mount_axes
from estimator_service.simulate import simulate

from helpers import RIG, RIG_ACC, cli, run_main

MECH_DIR = config_dir() / "mechanisms"


def rig_variant(**replacements: str):
    """The public gyros + accelerometer rig with text replacements, rebuilt as from a log header."""
    text = RIG_ACC.read_text()
    for old, new in replacements.values():
        assert old in text
        text = text.replace(old, new)
    return load_rig_text(text, (MECH_DIR / "fourbar-sensors2016.yaml").read_text(), "variant.toml")


@pytest.mark.parametrize("name", ["fourbar-sensors2016.yaml", "fourbars1.yaml"])
def test_frictionless_energy_drift_and_constraint_residual(name: str) -> None:
    """Released at rest from the file's assembly, 10 s: relative energy drift <= 1e-6, |Φ| <= 1e-9."""
    model = Model(load_mechanism(MECH_DIR / name))
    E, phi, phi_v, n = [], 0.0, 0.0, 0
    for topic, msg in simulate(model=model, duration=10.0):
        assert topic == "truth/state"
        q, qd = np.array(msg["q"]), np.array(msg["qd"])
        phi = max(phi, float(np.abs(model.Phi(q)).max()))
        phi_v = max(phi_v, float(np.abs(model.Phi_q(q) @ qd).max()))
        E.append(model.energy(q, qd))
        n += 1
    E = np.array(E)
    assert n == 10001
    assert np.ptp([msg["z"][0] for _, msg in simulate(model=model, duration=0.5)]) > 0.01  # it does move
    assert np.abs(E - E[0]).max() / np.abs(E).max() <= 1e-6
    assert phi <= 1e-9 and phi_v <= 1e-9


def test_an_overconstrained_mechanism_drops_its_redundant_row_and_keeps_it_satisfied(tmp_path: Path) -> None:
    """mbse's pick-and-place robot: its parallelograms make one of 21 constraint rows redundant.  The
    model keeps 20 independent rows (the dropped one named), so the dynamics are square.  Driven 2 s by
    constant torques 10 % below those that hold it (unheld it falls into a singular pose), the energy
    minus the torques' work is conserved, the kept rows hold, and so does the dropped distance (a
    redundant row holds wherever the others do, on the assembly's branch)."""
    mech = Path(__file__).parent / "data" / "mbse-models" / "pick-and-place-robot.yaml"
    model = Model(load_mechanism(mech))
    assert (model.n, model.m, model.g) == (22, 20, 2) and model.redundant == ["distance 5-6 = 0.707107 m (body body5)"]
    assert np.linalg.matrix_rank(model.Phi_q(model.q0)) == 20
    out = run_main("model", "check", str(mech))
    assert out.returncode == 0 and "constraints Phi (m = 20)" in out.stdout
    assert "distance 5-6 = 0.707107 m (body body5): redundant" in out.stdout
    (tmp_path / "pp.toml").write_text(f"""
[rig]
mechanism = "{mech}"
[simulation]
duration_s = 2.0
[simulation.torque]
a0 = -99.0
a1 = 112.5
""")
    rig = load_rig(tmp_path / "pp.toml")
    ix = {name: i for i, name in enumerate(model.coord_names)}
    E, z, phi, dropped = [], [], 0.0, 0.0
    for _, msg in simulate(rig=rig):
        q, qd = np.array(msg["q"]), np.array(msg["qd"])
        phi = max(phi, float(np.abs(model.Phi(q)).max()))
        d = math.hypot(q[ix["x6"]] - q[ix["x5"]], q[ix["y6"]] - q[ix["y5"]])
        dropped = max(dropped, abs(d - math.sqrt(0.5)))
        E.append(model.energy(q, qd) - (-99.0 * msg["z"][0] + 112.5 * msg["z"][1]))
        z.append(msg["z"])
    assert np.ptp(np.array(z), axis=0).min() > 0.05  # both DOFs move
    assert np.abs(np.array(E) - E[0]).max() / np.abs(E).max() <= 1e-6
    assert phi <= 1e-9 and dropped <= 1e-9


def test_power_balance_with_unmodelled_friction_and_applied_torque() -> None:
    """E(t) − E(0) = ∫ (τ − c θ̇) θ̇ dt for the crank-bearing damper c and a constant crank torque τ."""
    c, tau = 0.02, 0.8
    rig = rig_variant(torque=("truth_rate_hz = 1000", f"truth_rate_hz = 1000\n[simulation.torque]\ncrank = {tau}"))
    model = rig.model
    t, E, w = [], [], []
    for topic, msg in simulate(rig=rig, duration=2.0):
        if topic == "truth/state":
            t.append(msg["t"])
            E.append(model.energy(np.array(msg["q"]), np.array(msg["qd"])))
            w.append(msg["crank_rate"])
            assert msg["crank"] == msg["z"][0] and msg["crank_rate"] == msg["zd"][0]
    t, E, w = map(np.array, (t, E, w))
    p = (tau - c * w) * w
    work = np.concatenate([[0.0], np.cumsum((p[1:] + p[:-1]) / 2 * np.diff(t))])
    assert np.abs(E - E[0]).max() > 1.0  # the torque really does work (J)
    np.testing.assert_allclose(E - E[0], work, atol=1e-5 * np.abs(E - E[0]).max())


def test_streams_are_time_ordered_and_equal_the_virtual_sensors_without_noise() -> None:
    rig = rig_variant(gyr=("gyr_sigma_dps = 0.5\nacc_sigma = 0.05\nuse = [\"gyr\", \"acc\"]",
                           "gyr_sigma_dps = 0\nacc_sigma = 0\nuse = [\"gyr\", \"acc\"]"))
    model = rig.truth_model()
    sensors = rig.all_virtual_sensors(model)
    gyro = next(s for s in sensors if isinstance(s, Gyro) and s.name == "coupler")
    acc = next(s for s in sensors if isinstance(s, Accelerometer) and s.name == "coupler")
    encoders = {s.topic: s for s in sensors if isinstance(s, Encoder)}
    msgs = list(simulate(rig=rig, duration=0.5))
    times = [m["t"] for _, m in msgs]
    assert times == sorted(times) and times[0] == 0.0 and times[-1] == 0.5
    truth = {m["t"]: m for topic, m in msgs if topic == "truth/state"}
    seqs: dict[str, list[int]] = {}
    for topic, m in msgs:
        schema.encode(topic, m)  # every message satisfies the schema
        if topic == "truth/state":
            continue
        seqs.setdefault(topic, []).append(m["seq"])
        st = truth[m["t"]]
        q, qd = np.array(st["q"]), np.array(st["qd"])
        qdd = model.forward_dynamics(q, qd)
        if topic == "imu/coupler":
            np.testing.assert_allclose(m["gyr"], gyro.h(q, qd, qdd)[0], atol=1e-12)
            np.testing.assert_allclose(m["acc"], acc.h(q, qd, qdd)[0], atol=1e-12)
            assert m["dev_t"] == m["t"] and m["status"] == 0
        elif topic.startswith("enc/"):
            enc = encoders[topic]
            assert m["count"] == enc.to_counts(enc.h(q, qd, qdd)[0][0]) and m["cpr"] == enc.cpr
            assert m["angle"] == enc.from_counts(m["count"])
    assert {k: len(v) for k, v in seqs.items()} == {"imu/coupler": 51, "imu/rocker": 51, "enc/crank": 501, "enc/rocker": 501}
    assert all(v == list(range(len(v))) for v in seqs.values())


def test_an_imu_is_simulated_at_its_true_mount_which_the_estimator_is_not_told() -> None:
    """``[simulation.mount_deg] coupler = 3``: the coupler IMU's accelerometer and orientation read as if its axes
    were turned by 3° about body z (its gyro reads the same planar rate); the rig's own sensors, which the
    estimators fuse, stay at the stated mount (0); the rocker IMU is not moved."""
    rig = rig_variant(noise=("gyr_sigma_dps = 0.5\nacc_sigma = 0.05\nuse = [\"gyr\", \"acc\"]",
                             "gyr_sigma_dps = 0\nacc_sigma = 0\nincl_sigma = 1e-15\nuse = [\"gyr\", \"acc\"]"),
                      mount=("truth_rate_hz = 1000", "truth_rate_hz = 1000\n\n[simulation.mount_deg]\ncoupler = 3.0"))
    assert rig.simulation.mount == {"coupler": pytest.approx(math.radians(3.0))} and rig.imus[0].mount == 0.0
    model = rig.truth_model()
    fused = {s.kind: s for s in rig.virtual_sensors(model) if s.name == "coupler"}
    assert fused["acc"].mount == 0.0
    turned = Accelerometer("c", "imu/coupler", model, fused["acc"].body, fused["acc"].at,
                           mount_axes(rig.imus[0].axes, math.radians(3.0)), fused["acc"].noise)
    truth, checked = {}, 0
    for topic, m in simulate(rig=rig, duration=0.5):
        if topic == "truth/state":
            truth[m["t"]] = m
            continue
        if topic != "imu/coupler":
            continue
        st = truth[m["t"]]
        q, qd = np.array(st["q"]), np.array(st["qd"])
        qdd = model.forward_dynamics(q, qd)
        np.testing.assert_allclose(m["acc"], turned.h(q, qd, qdd)[0], atol=1e-12)
        np.testing.assert_allclose(m["acc"], fused["acc"].h_mounted(q, qd, qdd, math.radians(3.0))[0], atol=1e-12)
        assert np.abs(np.array(m["acc"]) - fused["acc"].h(q, qd, qdd)[0]).max() > 0.3  # ~g sin 3°: not what the rig says
        np.testing.assert_allclose(m["gyr"], fused["gyr"].h(q, qd, qdd)[0], atol=1e-12)
        phi = 2.0 * math.atan2(-m["quat"][2], m["quat"][0])  # the orientation about the sensor's y (body z: -y row)
        assert phi == pytest.approx(model.body_angle(q, fused["acc"].body)[0] + math.radians(3.0), abs=1e-9)
        checked += 1
    assert checked == 51


def test_sensor_noise_has_the_configured_sigma() -> None:
    rig = load_rig(RIG_ACC)
    model = rig.truth_model()
    sensors = rig.all_virtual_sensors(model)
    gyro = next(s for s in sensors if isinstance(s, Gyro) and s.name == "rocker")
    acc = next(s for s in sensors if isinstance(s, Accelerometer) and s.name == "coupler")
    truth, dg, da = {}, [], []
    for topic, m in simulate(rig=rig, duration=3.0):
        if topic == "truth/state":
            truth[m["t"]] = m
        elif topic in ("imu/rocker", "imu/coupler"):
            q, qd = np.array(truth[m["t"]]["q"]), np.array(truth[m["t"]]["qd"])
            qdd = model.forward_dynamics(q, qd)
            if topic == "imu/rocker":
                dg.append(np.array(m["gyr"]) - gyro.h(q, qd, qdd)[0])
            else:
                da.append(np.array(m["acc"]) - acc.h(q, qd, qdd)[0])
    assert np.std(dg) == pytest.approx(math.radians(0.5), rel=0.1)
    assert np.std(da) == pytest.approx(0.05, rel=0.1)
    assert abs(np.mean(dg)) < 3 * math.radians(0.5) / math.sqrt(len(dg) * 3)


def test_simulate_command_is_seeded_and_self_describing(tmp_path: Path) -> None:
    args = ["simulate", "--rig", str(RIG), "--duration", "0.5", "--seed", "4"]
    for name, run in (("a", cli), ("b", run_main)):  # a process of its own, and this one
        out = run(*args, "--out", str(tmp_path / f"{name}.log"))
        assert out.returncode == 0, out.stderr
    assert (tmp_path / "a.log").read_bytes() == (tmp_path / "b.log").read_bytes()
    assert run_main(*args[:-1], "5", "--out", str(tmp_path / "c.log")).returncode == 0
    assert (tmp_path / "a.log").read_bytes() != (tmp_path / "c.log").read_bytes()
    log = read_log(tmp_path / "a.log")
    assert log.header["rig_toml"] == RIG.read_text()
    assert log.header["mechanism_yaml"] == (MECH_DIR / "fourbar-sensors2016.yaml").read_text()
    assert log.header["meta"] == {"command": "simulate", "seed": 4, "duration_s": 0.5}
    rig = load_rig_text(log.header["rig_toml"], log.header["mechanism_yaml"], "a.log")
    recs = list(log)
    counts: dict[str, int] = {}
    for rec in recs:
        counts[rec.topic] = counts.get(rec.topic, 0) + 1
    assert counts == {"truth/state": 501, "imu/coupler": 51, "imu/rocker": 51, "enc/crank": 501, "enc/rocker": 501}
    # the log is exactly the simulator's output for the header's rig and seed
    expected = [(topic, schema.encode(topic, msg)) for topic, msg in simulate(rig=rig, duration=0.5, seed=4)]
    assert [(r.topic, r.payload) for r in recs] == expected


def test_simulate_mechanism_only_records_truth_from_rest(tmp_path: Path) -> None:
    out = run_main("simulate", "--mechanism", str(MECH_DIR / "slider-crank.yaml"), "--duration", "0.2", "--out", str(tmp_path / "m.log"))
    assert out.returncode == 0, out.stderr
    log = read_log(tmp_path / "m.log")
    recs = list(log)
    assert {r.topic for r in recs} == {"truth/state"} and len(recs) == 201
    first = schema.decode("truth/state", recs[0].payload)
    model = Model(load_mechanism(MECH_DIR / "slider-crank.yaml"))
    np.testing.assert_allclose(first["q"], model.q0, atol=1e-12)
    assert first["zd"] == [0.0]  # released at rest
    assert log.header["rig_toml"] == "" and log.header["mechanism_yaml"] == (MECH_DIR / "slider-crank.yaml").read_text()


def test_simulate_command_errors(tmp_path: Path) -> None:
    out = run_main("simulate", "--rig", str(RIG), "--duration", "-1", "--out", str(tmp_path / "x.log"))
    assert out.returncode == 2 and "--duration must be > 0" in out.stderr
    out = run_main("simulate", "--mechanism", str(tmp_path / "none.yaml"), "--out", str(tmp_path / "x.log"))
    assert out.returncode == 2 and "none.yaml" in out.stderr


def test_sim_source_and_recording_sample_sources() -> None:
    rig = load_rig(RIG)
    direct = list(simulate(rig=rig, duration=0.3))
    assert list(SimSource(rig, duration=0.3)) == direct  # threaded producer: same messages, same order
    for i, _ in enumerate(SimSource(rig, duration=5.0, lookahead=10)):
        if i == 50:
            break  # the consumer leaving stops the producer thread (the generator's finally joins it)
    rec = SimRecording.run(rig, duration=0.3)
    assert rec.messages == direct
    imu = imu_sample_fn(rec, "coupler")
    m1, m2 = rec.samples["imu/coupler"][1:3]  # t = 0.01, 0.02: linear interpolation in between
    mid = imu(0.015)
    assert mid[0] == pytest.approx([(a + b) / 2 for a, b in zip(m1["gyr"], m2["gyr"], strict=False)])
    assert mid[1] == pytest.approx([(a + b) / 2 for a, b in zip(m1["acc"], m2["acc"], strict=False)])
    for got, want in zip(imu(0.02), (m2["gyr"], m2["acc"], m2["quat"]), strict=False):
        assert got == pytest.approx(want)
    assert imu(-1.0)[0] == pytest.approx(rec.samples["imu/coupler"][0]["gyr"])  # held before the start
    angle = encoder_angle_fn(rec, "crank")
    assert angle(0.2) == pytest.approx(rec.latest("enc/crank", 0.2)["angle"])
    assert angle(0.2) == pytest.approx(rec.latest("truth/state", 0.2)["crank"], abs=2 * math.pi / 4096)
    with pytest.raises(Exception, match="imu/wheel"):
        imu_sample_fn(rec, "wheel")


def test_driver_sim_publishes_the_simulation_over_zeromq(endpoint: str) -> None:
    rig = load_rig(RIG)
    expected = [(topic, schema.encode(topic, msg)) for topic, msg in simulate(rig=rig, duration=0.2, seed=9)]
    with Subscriber([endpoint], topics=[""]) as sub:
        proc = subprocess.Popen([sys.executable, "-m", "estimator_service.cli", "driver", "sim", "--config", str(RIG),
                                 "--endpoint", endpoint, "--speed", "0", "--duration", "0.2", "--seed", "9", "--wait", "10"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        got = []
        while len(got) < len(expected):
            item = sub.recv(timeout_s=20)
            assert item is not None, f"received {len(got)} of {len(expected)} messages"
            got.append((item[0], item[1]))
        assert proc.wait(timeout=30) == 0, proc.stderr.read()
    assert [t for t, _ in got] == [t for t, _ in expected]
    assert [msgpack.unpackb(p) for _, p in got] == [msgpack.unpackb(p) for _, p in expected]


def test_driver_sim_stops_cleanly_on_sigterm(endpoint: str) -> None:
    """Real-time pacing, stopped mid-run: the producer thread is released and the exit code is 0."""
    # (a subscriber of a sensor topic too: the driver waits for one, up to --wait, before it publishes)
    with Subscriber([endpoint], topics=["truth/state", "imu/"]) as sub:
        proc = subprocess.Popen([sys.executable, "-m", "estimator_service.cli", "driver", "sim", "--config", str(RIG),
                                 "--endpoint", endpoint, "--speed", "1", "--duration", "20", "--wait", "10"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        ts = []
        while len(ts) < 200:
            item = sub.recv(timeout_s=20)
            assert item is not None
            if item[0] == "truth/state":
                ts.append(schema.decode("truth/state", item[1])["t"])
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, proc.stderr.read()
    assert ts == [round(k * 0.001, 9) for k in range(200)]


def test_a_mechanism_without_named_dofs_takes_initial_values_and_torques_by_its_chosen_dof_names(tmp_path: Path) -> None:
    """mbse files name no DOF: the model chooses the coordinates (here a0, a1 of the pick-and-place
    robot); [simulation.initial] and [simulation.torque] take those names (they were refused: "known
    keys: []"); the simulation runs them (its redundant constraint row is dropped, test above)."""
    mech = Path(__file__).parent / "data" / "mbse-models" / "pick-and-place-robot.yaml"
    assert Model(load_mechanism(mech)).dof_names == ["a0", "a1"]
    text = f"""
[rig]
mechanism = "{mech}"

[[imu]]
name = "platform"
body = "body5"
rate_hz = 100

[simulation]
duration_s = 1.0

[simulation.initial]
a0_rate = 0.01

[simulation.torque]
a0 = -110.0
a1 = 125.0
"""
    (tmp_path / "pp.toml").write_text(text)
    rig = load_rig(tmp_path / "pp.toml")
    assert rig.simulation.torques == {"a0": -110.0, "a1": 125.0} and rig.simulation.initial_rate == {"a0": 0.01}
    (tmp_path / "bad.toml").write_text(text.replace("a1 = 125.0", "crank = 1.0"))
    with pytest.raises(ConfigError, match=r"simulation\.torque\.crank"):
        load_rig(tmp_path / "bad.toml")
    r = run_main("simulate", "--rig", str(tmp_path / "pp.toml"), "--out", str(tmp_path / "pp.log"))
    assert r.returncode == 0, r.stderr
    assert {rec.topic for rec in read_log(tmp_path / "pp.log")} == {"imu/platform", "truth/state"}

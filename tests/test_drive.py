"""Driven DOFs (``[[drive]]``): a motor imposes the DOF's motion; the model leaves its acceleration to the
drive and every backend carries the drive's unknown acceleration as process noise."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from estimator_service.errors import ConfigError
from estimator_service.evaluate import score_against_truth
from estimator_service.mechanism import parse_mechanism
from estimator_service.model import Model
from estimator_service.rig import DRIVE_ACCEL_DENSITY, load_rig_text
from estimator_service.paths import config_dir
from estimator_service.simulate import simulate

from helpers import DATA, SHAFT_YAML, sim_shaft_text

DOUBLE_PENDULUM = """
points:
  - {x: 0, y: 0, fixed: true}
  - {x: 0.3, y: 0}
  - {x: 0.3, y: -0.2}
planar_bodies:
  - {name: upper, points: [0, 1], length: 0.3, mass: 1.0, I0: 0.03, cog: [0.15, 0]}
  - {name: lower, points: [1, 2], length: 0.2, mass: 0.5, I0: 0.0067, cog: [0.1, 0]}
relative_coordinates:
  - {type: RelativeAngleAbsoluteDOF, points: [0, 1], name: a}
  - {type: RelativeAngleAbsoluteDOF, points: [1, 2], name: b}
dofs:
  - {name: upper, coordinate: a}
  - {name: lower, coordinate: b}
"""


def _state(model: Model, zd: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    q = model.q0.copy()
    return q, model.solve_velocity(q, zd)


def test_a_driven_dof_keeps_its_velocity_and_the_free_one_follows_the_mechanism():
    """Upper link driven: its model acceleration is ~0 (the drive decides it), and the lower link moves as the
    mechanism says with the upper one's acceleration imposed: z̈_b = (Q̄_b − M̄_ba·0) / M̄_bb."""
    mech = parse_mechanism(DOUBLE_PENDULUM, "double.yaml")
    free, driven = Model(mech), Model(mech, drives={"upper": 3.0})
    q, qd = _state(free, np.array([1.5, -0.7]))
    zdd_free = free.zdd(q, qd)
    zdd = driven.zdd(q, qd)
    assert abs(zdd_free[0]) > 1.0  # gravity swings the free upper link
    assert abs(zdd[0]) < 1e-5 * abs(zdd_free[0])
    R = free.R(q)
    Mbar = R.T @ free.M @ R
    Qbar = R.T @ (free.Q(q, qd) - free.M @ free.solve_acceleration(q, qd, np.zeros(2)))
    assert zdd[1] == pytest.approx(Qbar[1] / Mbar[1, 1], rel=1e-5)
    assert driven.driven.tolist() == [True, False] and driven.drive_density.tolist() == [3.0, 0.0]
    assert not free.driven.any() and not free.drive_density.any()


def _shaft_rig(drive: str) -> str:
    mech = config_dir() / "mechanisms" / "shaft.yaml"
    return f"""
[rig]
name = "shaft"
mechanism = "{mech}"
[[imu]]
name = "shaft"
body = "shaft"
{drive}
"""


def test_a_rig_states_its_drives_and_the_estimator_model_has_them():
    yaml = (config_dir() / "mechanisms" / "shaft.yaml").read_text()
    rig = load_rig_text(_shaft_rig('[[drive]]\ndof = "shaft"\naccel_density = 12.5'), yaml, "r.toml")
    assert rig.model.driven.tolist() == [True] and rig.model.drive_density.tolist() == [12.5]
    rig = load_rig_text(_shaft_rig('[[drive]]\ndof = "shaft"'), yaml, "r.toml")
    assert rig.model.drive_density.tolist() == [DRIVE_ACCEL_DENSITY]
    assert not load_rig_text(_shaft_rig(""), yaml, "r.toml").model.driven.any()


@pytest.mark.parametrize("table, message", [
    ('[[drive]]\ndof = "crank"', "r.toml: drive[0].dof: unknown dof 'crank'; dofs are ['shaft']"),
    ('[[drive]]\ndof = "shaft"\naccel_density = -1', "r.toml: drive[0].accel_density: must be > 0, got -1"),
    ('[[drive]]\ndof = "shaft"\ninput = "servo"', "r.toml: drive[0].input: expected one of ['unknown', 'torque', 'velocity', 'position'], got 'servo'"),
    ('[[drive]]\ndof = "shaft"\n[[drive]]\ndof = "shaft"', "r.toml: drive[1].dof: dof 'shaft' has a [[drive]] already"),
    ('[[drive]]\ndof = "shaft"\ntorque = 1', "r.toml: drive[0].torque: unknown key"),
])
def test_a_wrong_drive_is_an_error_naming_the_field_and_value(table, message):
    yaml = (config_dir() / "mechanisms" / "shaft.yaml").read_text()
    with pytest.raises(ConfigError) as exc:
        load_rig_text(_shaft_rig(table), yaml, "r.toml")
    assert str(exc.value).startswith(message)


def test_the_simulated_drive_goes_back_and_forth_with_smooth_reversals():
    from estimator_service.rig import DriveProfile

    p = DriveProfile(speed=1.0, low=0.0, high=2.0, ramp_s=0.1)  # legs of 2 s
    ts = np.arange(0.0, 8.0, 1e-3)
    rate, acc = np.array([p.rate_and_accel(t) for t in ts]).T
    assert rate[0] == 1.0 and np.all(np.abs(rate) <= 1.0 + 1e-12)
    assert np.max(np.abs(np.diff(rate))) < 1.0 * np.pi / 0.1 * 1e-3 * 1.01  # continuous: at most the peak z̈ × dt
    z = np.concatenate([[0.0], np.cumsum((rate[1:] + rate[:-1]) / 2) * 1e-3])
    assert z.max() == pytest.approx(2.0, abs=0.1 / 4) and z.min() == pytest.approx(0.0, abs=1e-9)
    turns = ts[1:][np.diff(np.sign(rate)) != 0]
    assert turns == pytest.approx([2.0, 4.0, 6.0], abs=2e-3)
    fine = np.arange(1.9, 2.1, 1e-5)  # through a reversal: z̈ is the rate's derivative (the jerk jumps at its ends)
    rate_f, acc_f = np.array([p.rate_and_accel(t) for t in fine]).T
    assert np.allclose(np.gradient(rate_f, fine)[1:-1], acc_f[1:-1], atol=0.01)
    assert acc_f.min() == pytest.approx(-2 * np.pi / 2 / 0.1, rel=1e-3)  # peak: speed π / ramp
    edges = p.edges(0.0, 8.0)  # where a pulse starts or ends: z̈ is 0 on one side, not on the other
    assert edges == pytest.approx([1.95, 2.05, 3.95, 4.05, 5.95, 6.05, 7.95]) and p.edges(0.0, 3.0) + p.edges(3.0, 8.0) == edges
    assert all(sorted(abs(p.rate_and_accel(e + d)[1]) > 1e-2 for d in (-1e-4, 1e-4)) == [False, True] for e in edges)


def test_the_simulator_follows_a_drive_through_its_reversals():
    """The simulator integrates between the reversal pulses' edges: the simulated rate is the profile's through
    every reversal, 10 ms each (one stepped over would leave it 2 × 90°/s off; the drive does not cancel the shaft's
    own gravity torque: measured 2e-4 rad/s apart after 1.6 s)."""
    text = sim_shaft_text().replace("speed_dps = 50\nfrom_deg = 0\nto_deg = 120", "speed_dps = 90\nfrom_deg = 0\nto_deg = 45")
    rig = load_rig_text(text, SHAFT_YAML.read_text(), "r.toml")
    prof = rig.simulation.drives["shaft"]
    truth = [m for t, m in simulate(rig=rig, duration=1.6) if t == "truth/state"]
    assert len(prof.edges(0.0, 1.6)) == 6  # three reversals, 0.5 s apart
    err = [abs(m["zd"][0] - prof.rate_and_accel(m["t"])[0]) for m in truth]
    assert max(err) < 1e-3 * prof.speed, max(err)


@pytest.fixture(scope="module")
def driven_shaft_log(shaft_records) -> tuple[object, list]:
    """6 s of a stepper-like drive (50°/s between 0 and 120°, 10 ms reversals), simulated once per session
    (conftest.shaft_records: the same records as test_drive_inputs' unknown drive): (rig, records)."""
    return load_rig_text(sim_shaft_text(), SHAFT_YAML.read_text(), "shaft-sim.toml"), shaft_records("unknown", "")


@pytest.mark.kernels()
@pytest.mark.parametrize("backend", ["fgs", "ekf", "ukf", "errekf"])
def test_every_backend_follows_a_driven_shaft_and_knows_its_uncertainty(driven_shaft_log, backend):
    """A driven shaft's model is free-swinging gravity dynamics the drive overrides: with [[drive]] every backend
    follows it through the reversals (measured 0.15–0.16° RMSE over 20 s for ekf and fgs), |error| ≤ 3σ almost
    always, quality ok, no re-initialisation; the truth does go back and forth."""
    from estimator_service import schema

    rig, records = driven_shaft_log
    r = score_against_truth(rig, records, backend)
    z = np.array([schema.decode(topic, payload)["z"][0] for topic, payload in records if topic == "truth/state"])
    assert np.degrees(z.max()) > 115 and np.degrees(z.min()) < 5 and np.degrees(z[-1]) < 100  # reversed, twice
    assert r.n > 5000 and r.status == {"ok"}, r
    assert r.rmse_deg < 0.3
    assert r.within > 0.95
    assert r.ok > 0.9, r.ok
    assert r.reinit == 0
    assert r.pipeline.backend.jumps <= 2  # (two reversals the rate's noise foresees: a rate jump is rarely tested true)


@pytest.fixture(scope="module")
def roll_excerpt(tmp_path_factory) -> tuple[Path, object]:
    """The real roll excerpt imported as a log, and its rig calibrated on the first 20 s: (log, rig)."""
    from estimator_service import api
    from estimator_service.cli import main

    log = tmp_path_factory.mktemp("roll") / "roll.log"
    assert main(["log", "import", "--table", str(DATA / "real-shaft" / "roll_medium" / "raw.csv"),
        "--map", str(config_dir() / "maps" / "real-shaft.toml"), "--rig", str(config_dir() / "rigs" / "shaft-roll.toml"),
        "--out", str(log)]) == 0
    return log, api.calibrate(log, window=(0.0, 20.0)).rig


@pytest.mark.kernels()
@pytest.mark.parametrize("backend", ["ekf", "fgs"])
def test_a_stepper_reversal_is_a_rate_jump_on_the_real_roll_excerpt(roll_excerpt, backend):
    """The real roll excerpt (150°/s, an abrupt reversal every ~1.2 s, a gyro vibrating by ~60°/s), calibrated on
    its first 20 s: the rate-jump test (drive_jump_sigma, the same code in the filters and the smoother) fires at
    the reversals, not between them, and brings the angle back sooner than the drive's white acceleration alone
    (the smoother's test is off by default: on a gyro-only angle its jumps drift; here it is switched on)."""
    from estimator_service import api

    log, rig = roll_excerpt  # (each backend's test sets its own [estimator.<backend>] only)
    runs = {}
    for sigma in (3.0, 0.0):
        setattr(rig.estimator, backend, {"drive_jump_sigma": sigma})
        res = api.estimate(log, rig=rig, backend=backend, keep_states=False)
        runs[sigma] = (res.summary["dofs"][0]["rmse"], res.pipeline.backend.jumps, res.summary["dofs"][0]["within_3sigma"])
    (on, jumps, within), (off, none, _) = runs[3.0], runs[0.0]
    enc = api.read_log(log, ["enc/shaft"])["enc/shaft"]
    turns = np.count_nonzero(np.diff(np.sign(np.diff(enc["count"].to_numpy()[::5]))) != 0)  # (reversals, ±1 a few)
    assert none == 0 and 0.5 * turns <= jumps <= 3 * turns, (jumps, turns)
    assert on < 0.97 * off and on < 1.0 and within > 0.95, (on, off, within)

"""Issue 15/10 estimation maths: model uncertainty → process noise, sensor biases and IMU time offsets as
states, consistency (NIS) monitoring, the simulator's "true" model, stamp offsets and outliers, and
seeded RMSE bounds on the wrong-model scenarios."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from estimator_service import schema
from estimator_service.backends.uncertainty import ModelUncertainty, UncertaintyParams, parse_uncertainty
from estimator_service.bench import bench_log
from estimator_service.errors import ConfigError
from estimator_service.model import Model
from estimator_service.paths import config_dir
from estimator_service.rig import load_rig
from estimator_service.simulate import simulate

from conftest import RIG, write_sim_log
from test_ekf_ukf import run_filter

SCEN = config_dir() / "rigs" / "scenarios"


def test_mass_matrix_and_gravity_are_linear_in_each_bodys_mass_and_inertia() -> None:
    m = load_rig(RIG).model
    M = np.zeros_like(m.M)
    Qg = np.zeros(m.n)
    for bi, body in enumerate(m.mech.bodies):
        dM_dm, dM_dI, dQ_dm = m.inertia_derivatives(bi)
        M += body.mass * dM_dm + body.I0 * dM_dI
        Qg += body.mass * dQ_dm
    np.testing.assert_allclose(M, m.M, atol=1e-14)
    np.testing.assert_allclose(Qg, m.Q(m.q0, np.zeros(m.n)), atol=1e-12)


@pytest.mark.parametrize("body, key", [("crank", "inertia"), ("coupler", "mass"), ("rocker", "inertia")])
def test_acceleration_uncertainty_matches_a_perturbed_model(body: str, key: str) -> None:
    """σ(Δz̈) from one body's parameter uncertainty = u × |∂z̈/∂ln θ| of a model with θ changed by 0.1 %."""
    rig = load_rig(RIG)
    m = rig.model
    bi = m.body_index(body)
    attr = "I0" if key == "inertia" else "mass"
    b = m.mech.bodies[bi]
    bodies = list(m.mech.bodies)
    bodies[bi] = replace(b, **{attr: getattr(b, attr) * 1.001})
    m2 = Model(replace(m.mech, bodies=bodies))
    unc = ModelUncertainty(m, UncertaintyParams(mass=0.0, inertia=0.0, body={body: {key: 0.2}}))
    q = m.solve_position(m.q0, np.array([2.0]))
    qd = m.solve_velocity(q, np.array([1.5]))
    qdd = m.forward_dynamics(q, qd)
    dz = (m2.forward_dynamics(q, qd)[m.dof] - qdd[m.dof]) / 1e-3
    sd = math.sqrt(unc.accel_cov(qdd, m.R(q))[0, 0])
    assert sd == pytest.approx(0.2 * abs(dz[0]), rel=2e-3)
    assert sd > 0.01


def test_uncertainty_table_errors() -> None:
    m = load_rig(RIG).model
    assert parse_uncertainty("r.toml", {"inertia": 0.1, "body": {"crank": {"inertia": 0.05}}}, m).body == {"crank": {"inertia": 0.05}}
    for table, field, text in [({"inertia": -1}, "estimator.model.inertia", "-1"),
                               ({"massx": 1}, "estimator.model.massx", "unknown key"),
                               ({"error_time_s": 0}, "estimator.model.error_time_s", "> 0"),
                               ({"body": {"wheel": {}}}, "estimator.model.body.wheel", "unknown body"),
                               ({"body": {"crank": {"I0": 1}}}, "estimator.model.body.crank.I0", "unknown key")]:
        with pytest.raises(ConfigError) as exc:
            parse_uncertainty("r.toml", table, m)
        assert "r.toml" in str(exc.value) and field in str(exc.value) and text in str(exc.value)


def test_simulator_true_model_stamp_offset_and_outliers() -> None:
    """The late IMU's reading stamped t is the true rate at t − 4 ms; outliers appear once each; the
    true crank inertia is scaled."""
    rig = load_rig(SCEN / "imu-late-4ms.toml")
    assert rig.simulation.stamp_offset_s == {"rocker": 0.004}
    for imu in rig.imus:
        imu.gyr.sigma[:] = 0.0
    model = rig.truth_model()
    gyr = {s.topic: s for s in rig.all_virtual_sensors(model) if s.kind == "gyr"}
    truth, late = {}, []
    for topic, msg in simulate(rig=rig, duration=0.6):
        if topic == "truth/state":
            truth[round(msg["t"] * 1000)] = msg
        elif topic == "imu/rocker":
            late.append(msg)
    assert late[0]["t"] == pytest.approx(0.01)  # a sample stamped 0 would have been taken before the start
    checked = 0
    for msg in late:
        k = round(msg["t"] * 1000) - 4
        if k in truth and msg["t"] > 0.005:
            st = truth[k]
            qdd = model.forward_dynamics(np.array(st["q"]), np.array(st["qd"]))
            y = gyr["imu/rocker"].h(np.array(st["q"]), np.array(st["qd"]), qdd)[0]
            np.testing.assert_allclose(msg["gyr"], y, atol=1e-9)
            checked += 1
    assert checked >= 50

    rig = load_rig(SCEN / "biases-outliers.toml")
    model = rig.truth_model()
    coupler = next(s for s in rig.all_virtual_sensors(model) if s.kind == "gyr" and s.name == "coupler")
    truth, spikes = None, []
    for topic, msg in simulate(rig=rig, duration=10.0):
        if topic == "truth/state":
            truth = msg
        elif topic == "imu/coupler":
            assert truth["t"] == msg["t"]
            q, qd = np.array(truth["q"]), np.array(truth["qd"])
            err = np.array(msg["gyr"]) - coupler.h(q, qd, model.forward_dynamics(q, qd))[0] - rig.imus[0].gyr.bias
            if abs(err[1]) > math.radians(10):
                spikes.append((msg["t"], math.degrees(err[1])))
    assert [t for t, _ in spikes] == pytest.approx([1.51, 3.21, 5.02, 7.31, 9.11])
    assert all(abs(e - 20.0) < 3.0 for _, e in spikes)
    scaled = load_rig(SCEN / "crank-inertia+20.toml")
    assert scaled.truth_model().mech.bodies[0].I0 == pytest.approx(1.2 * scaled.model.mech.bodies[0].I0)

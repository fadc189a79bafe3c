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
from estimator_service.backends import REGISTRY
from estimator_service.backends.mount_test import MOUNT_HELD_SIGMA
from estimator_service.backends.uncertainty import ModelUncertainty, UncertaintyParams, parse_uncertainty
from estimator_service.bench import bench_log
from estimator_service.errors import ConfigError
from estimator_service.model import Model
from estimator_service.paths import config_dir
from estimator_service.rig import load_rig
from estimator_service.simulate import simulate

from helpers import RIG, ScenarioLogs, run_filter

# runs backends (or estimator subprocesses): their kernels compiled before the tests start (conftest.py)
pytestmark = pytest.mark.kernels()

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


def _perturbed(m: Model, unc: ModelUncertainty, eps: np.ndarray) -> Model:
    """The model whose masses and inertias are off by ε (σ units of ``unc``): θ_k (1 + u_k ε_k)."""
    bodies = list(m.mech.bodies)
    for name, u, e in zip(unc.names, unc.relative, eps, strict=True):
        body, key = name.split(".")
        bi = m.body_index(body)
        attr = "I0" if key == "inertia" else "mass"
        bodies[bi] = replace(bodies[bi], **{attr: getattr(bodies[bi], attr) * (1 + u * e)})
    return Model(replace(m.mech, bodies=bodies))


def test_parameter_error_states_give_the_dynamics_of_the_perturbed_model() -> None:
    """ε (every body's mass and I0, in σ of the default 20 %) in each backend's dynamics = the forward
    dynamics of a model built with those masses and inertias: exact in the smoother (M and gravity forces
    are linear in them), and at the fixed point of the filters' generalized force G(q̈) ε."""
    from estimator_service.backends import make_backend

    rig = load_rig(RIG)
    m = rig.model
    unc = ModelUncertainty(m, UncertaintyParams())
    assert unc.names == ["crank.mass", "crank.inertia", "coupler.mass", "coupler.inertia", "rocker.mass", "rocker.inertia"]
    # 4 identifiable combinations: the crank's mass sits on its ground pivot, and scaling everything together
    # changes no acceleration
    assert unc.dim == 4
    np.testing.assert_allclose(unc.V.T @ unc.V, np.eye(4), atol=1e-12)
    np.testing.assert_allclose(unc.V[0], 0.0, atol=1e-12)
    eps = np.array([0.5, 1.0, -1.5, 0.8, 1.2, -0.6])
    np.testing.assert_allclose(m.M + np.tensordot(eps, unc._dM, 1), _perturbed(m, unc, eps).M, atol=1e-14)
    q = m.solve_position(m.q0, np.array([2.0]))
    qd = m.solve_velocity(q, np.array([1.5]))
    null = eps - unc.V @ (unc.V.T @ eps)  # what the states do not carry changes no acceleration (to first order)
    assert np.abs(_perturbed(m, unc, 1e-4 * null).forward_dynamics(q, qd) - m.forward_dynamics(q, qd)).max() < 1e-9
    eta = unc.V.T @ eps  # the estimated combinations
    eps = unc.V @ eta
    m2 = _perturbed(m, unc, eps)
    np.testing.assert_allclose(m.M + np.tensordot(eta, unc.directions()[0], 1), m2.M, atol=1e-14)
    np.testing.assert_allclose(m.Q(m.q0, np.zeros(m.n)) + eta @ unc.directions()[1], m2.Q(m.q0, np.zeros(m.n)), atol=1e-12)
    want = m2.forward_dynamics(q, qd)
    G = unc.forces(want)  # the filters' G(q̈), from its precomputed terms, against its definition
    np.testing.assert_allclose(G, unc.all_forces(want) @ unc.V, rtol=1e-12, atol=1e-12)
    assert G.shape == (m.n, 4) and G.flags.c_contiguous
    rig.estimator.fgs = {"coordinates": "dependent"}
    fgs = make_backend("fgs", m, rig.virtual_sensors(m), rig.estimator)
    x = np.zeros(fgs._dim)
    x[: 2 * m.n] = np.concatenate([q, qd])
    x[fgs._e0 : fgs._p0] = eta
    np.testing.assert_allclose(fgs._dynamics(x)[0], want, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(fgs._accel(x), want, rtol=1e-10, atol=1e-10)
    rig.estimator.fgs = {"coordinates": "independent"}  # the same model on the manifold, at (z, ż)
    ifgs = make_backend("fgs", m, rig.virtual_sensors(m), rig.estimator)
    ifgs._q_start = q.copy()
    x = np.zeros(ifgs._dim)
    x[: 2 * m.g] = np.concatenate([q[m.dof], qd[m.dof]])
    x[ifgs._e0 : ifgs._p0] = eta
    np.testing.assert_allclose(ifgs._accel(x), want, rtol=1e-10, atol=1e-10)
    assert np.abs(want - m.forward_dynamics(q, qd)).max() > 0.1  # a real change
    ekf = make_backend("ekf", m, rig.virtual_sensors(m), rig.estimator)
    ekf.initialize(0.0, q, qd)
    ekf.x[2:4] = 0.0
    ekf.x[ekf._eps] = eta
    for _ in range(20):  # G(q̈) at the current point: re-evaluating converges to the perturbed model
        ekf.point = ekf.point_of(ekf.x, ekf.point)
    np.testing.assert_allclose(ekf.point.qdd, want, rtol=1e-9, atol=1e-9)


def test_uncertainty_table_errors() -> None:
    m = load_rig(RIG).model
    assert parse_uncertainty("r.toml", {"inertia": 0.1, "body": {"crank": {"inertia": 0.05}}}, m).body == {"crank": {"inertia": 0.05}}
    for table, field, text in [({"inertia": -1}, "estimator.model.inertia", "-1"),
                               ({"massx": 1}, "estimator.model.massx", "unknown key"),
                               ({"error_time_s": 0}, "estimator.model.error_time_s", "> 0"),
                               ({"body": {"wheel": {}}}, "estimator.model.body.wheel", "unknown body"),
                               ({"body": {"crank": {"I0": 1}}}, "estimator.model.body.crank.I0", "unknown key"),
                               ({"adapt": "yes"}, "estimator.model.adapt", "true or false"),
                               ({"adapt_noise": 2}, "estimator.model.adapt_noise", "between 0 and 1"),
                               ({"walk": -0.1}, "estimator.model.walk", "-0.1")]:
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
    assert late[0]["t"] == pytest.approx(0.004)  # the sample taken at 0, stamped 4 ms late
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


# ---------------------------------------------------------------------------------- seeded scenarios (short)
SLOW = pytest.mark.timeout(1200)  # a short simulation and a backend run each, on a loaded 2-core machine


@SLOW
@pytest.mark.parametrize("backend, bound", [("fgs", 0.35), ("ekf", 0.45), ("ukf", 0.45)])
def test_crank_inertia_20_percent_off(scenario_logs: ScenarioLogs, backend: str, bound: float) -> None:
    """The true crank inertia is 20 % above the model's; 4 s (most of it the start from 1° off): RMSE
    within a bound (before the model uncertainty became process noise fgs was 9.5°, the filters 1.06°
    over 10 s; the 10 s figures are in docs/accuracy.md) and the estimates are not flagged."""
    rec = bench_log(scenario_logs["crank-inertia+20", 4.0], backend, "crank-inertia+20")
    assert rec.rmse_crank_deg <= bound
    assert rec.flagged_share is not None and rec.flagged_share < 0.2


@SLOW
@pytest.mark.parametrize("backend", ["ekf", "fgs"])
def test_a_wrong_crank_inertia_is_learned(scenario_logs: ScenarioLogs, backend: str) -> None:
    """The true crank I0 is 20 % (1 σ) above the model's: after 6 s est/state ``model`` reports the
    smallest parameter change with the same dynamics (scaling every mass and inertia together changes
    nothing, so +20 % on the crank reads +16 % on the crank and −4 % on the others) within 6 %, and
    est/diag reports it on the wire."""
    rmse, ests, pipe = run_filter(scenario_logs["crank-inertia+20", 6.0], backend)
    unc = pipe.backend.uncertainty
    truth = np.array([name == "crank.inertia" for name in unc.names], float)  # ε in σ units
    expected = dict(zip(unc.names, 0.2 * (unc.V @ (unc.V.T @ truth)), strict=True))
    assert expected["crank.inertia"] == pytest.approx(0.16) and expected["coupler.mass"] == pytest.approx(-0.04)
    err = ests[-1]["model"]
    assert set(err) == set(unc.names)
    for name, want in expected.items():
        assert err[name] == pytest.approx(want, abs=0.06), (name, err)
    assert rmse <= 0.35
    info = pipe.diag(6.0)["info"]
    assert info["model"]["crank.inertia"] == pytest.approx(err["crank.inertia"], abs=0.02)
    schema.encode("est/diag", pipe.diag(6.0))


@SLOW
def test_late_imu_offset_is_estimated(scenario_logs: ScenarioLogs) -> None:
    """The rocker IMU is stamped 4 ms late (the rig does not say so): its estimated offset is 4 ms (± 1 ms)
    after 4 s, and est/diag reports it."""
    rmse, ests, pipe = run_filter(scenario_logs["imu-late-4ms", 4.0], "ekf")
    assert rmse <= 0.45
    assert ests[-1]["time_offset_s"]["rocker"] == pytest.approx(0.004, abs=1e-3)
    assert "coupler" not in ests[-1]["time_offset_s"]  # the reference IMU
    info = pipe.diag(4.0)["info"]
    assert info["time_offset_s"]["rocker"] == ests[-1]["time_offset_s"]["rocker"]
    schema.encode("est/diag", pipe.diag(4.0))  # the info map is valid on the wire


@SLOW
@pytest.mark.parametrize("backend", list(REGISTRY))
def test_every_backend_learns_a_3_degree_accelerometer_mount_error_within_3_sigma(scenario_logs: ScenarioLogs,
                                                                                 backend: str) -> None:
    """combined-acc-nodelay: the coupler IMU sits 3° off the mount its rig states (0), among every other error of
    the combined scenario; its accelerometer is fused with the default mount prior (5°).  After 4 s each backend's
    est/state ``mount_deg`` is within 3σ of 3° with the σ its est/diag reports (``param_std``), and that σ is
    well below the prior's (learned, not the prior)."""
    seconds = 4.0
    rmse, ests, pipe = run_filter(scenario_logs["combined-acc-nodelay", seconds], backend)
    mount = ests[-1]["mount_deg"]
    assert set(mount) == {"coupler"}  # the rocker's accelerometer is not fused: no state, nothing stated
    info = pipe.diag(seconds)["info"]
    sigma = math.degrees(info["param_std"]["coupler.mount"])
    assert abs(mount["coupler"] - 3.0) <= 3.0 * sigma, (mount, sigma)
    assert sigma < 0.5
    assert info["mount_deg"]["coupler"] == pytest.approx(mount["coupler"], abs=0.05)
    schema.encode("est/diag", pipe.diag(seconds))  # on the wire
    assert rmse < 0.5


@SLOW
@pytest.mark.parametrize("backend", list(REGISTRY))
def test_a_right_accelerometer_mount_stays_held(scenario_logs: ScenarioLogs, backend: str) -> None:
    """biases-acc: the coupler accelerometer is fused and its rig states its mount right.  Over 4 s no backend's
    test (backends/mount_test.py) frees the mount: its std in est/diag stays the held one and the estimate its
    stated 0°, so the state costs nothing here (the wrong mount above is freed by the first samples)."""
    seconds = 4.0
    ests, pipe = run_filter(scenario_logs["biases-acc", seconds], backend)[1:]
    info = pipe.diag(seconds)["info"]
    assert info["param_std"]["coupler.mount"] <= 1.01 * MOUNT_HELD_SIGMA
    assert abs(ests[-1]["mount_deg"]["coupler"]) < 1e-3


@SLOW
def test_gyro_biases_converge(scenario_logs: ScenarioLogs) -> None:
    """Biases +0.25 / −0.2 deg/s, crank and rocker friction, released from 135°: both bias estimates within
    0.07 deg/s of the truth from 5 s on (the issue's target is 0.05; figures in docs/accuracy.md)."""
    rmse, ests, _ = run_filter(scenario_logs["biases-friction", 6.0], "ekf")
    truth = {"coupler.gyr": 0.25, "rocker.gyr": -0.2}
    late = [e for e in ests if e["t"] >= 5.0]
    assert late
    for key, b in truth.items():
        err = max(abs(math.degrees(e["bias"][key][1]) - b) for e in late)
        assert err < 0.07, (key, err)
    assert rmse <= 0.5


@SLOW
@pytest.mark.parametrize("backend, params", [
    ("ekf", {"estimate_force": False}),
    ("ukf", {"estimate_force": False}),
    ("errekf", {"estimate_force": False}),
    ("fgs", {"estimate_force": False}),
    ("fgs", {"estimate_force": False, "coordinates": "dependent"}),
])
def test_quality_flags_a_50_percent_inertia_error(scenario_logs: ScenarioLogs, backend: str, params: dict) -> None:
    """Adaptation off (no parameter-error states, no unknown-force states), crank inertia 50 % off (2.5 σ of the
    default model uncertainty): the estimate is flagged ``inconsistent`` within 1 s (by the innovation-mean test:
    the filters first at 0.29 s, the smoother at 0.28 s in either coordinates; the public scenario is rarely flagged,
    below).  With its force states estimated as constants the smoother absorbed part of the error into them and
    first flagged at 0.29–1.15 s over seeds 1–4."""
    ests = run_filter(scenario_logs["crank-inertia+50", 2.0], backend, params, model={"adapt": False})[1]
    flagged = [e["t"] for e in ests if e["quality"] == "inconsistent"]
    assert flagged and flagged[0] <= 1.0


@SLOW
@pytest.mark.parametrize("backend", ["ekf", "fgs"])
def test_public_scenario_is_rarely_flagged(sim_log_10s: Path, backend: str) -> None:
    """A consistent estimator on the public scenario: the windowed NIS leaves its two-sided 0.999 bounds, and
    the innovation mean its bound, only as often as chance makes it (ekf 20, fgs 10 of 10000 estimates with
    the adaptive defaults: one excursion each)."""
    _, ests, pipe = run_filter(sim_log_10s, backend)
    assert sum(e["quality"] != "ok" for e in ests) <= 0.01 * len(ests)
    stats = pipe.diag(10.0)["info"]["consistency"]["sensors"]
    for s in stats.values():
        assert s["lower_per_row"] < s["nis_per_row"] < s["upper_per_row"] and s["rows"] == 150
        assert s["mean_z"] < s["mean_bound"]


@SLOW
def test_smoother_gates_gyro_outliers(scenario_logs: ScenarioLogs) -> None:
    """Spikes of 20 deg/s in the coupler gyro at 1.5 and 3.2 s: the smoother's gate drops exactly those
    samples and the estimate stays within the bound of the spike-free scenario's."""
    rmse, ests, pipe = run_filter(scenario_logs["biases-outliers", 4.0], "fgs")
    info = pipe.diag(4.0)["info"]["consistency"]
    assert info["sensors"]["coupler.gyr"]["gated"] == 2 and info["sensors"]["rocker.gyr"]["gated"] == 0
    assert rmse <= 0.5

"""DEKF and UKF in independent coordinates: manifold evaluator vs the model, transition and measurement
Jacobians vs finite differences, tracking of seeded simulations (RMSE), Euler vs Heun, measurements
between steps, divergence and re-initialisation, degraded status, parameters, sigma points."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from estimator_service import kernels, schema
from estimator_service.backends import make_backend
from estimator_service.backends.base import Measurement
from estimator_service.backends.ekf import EkfParams
from estimator_service.backends.manifold import ManifoldDynamics, compiled_sensor_ids
from estimator_service.backends.ukf import UkfParams
from estimator_service.errors import ConfigError
from estimator_service.logfile import read_log
from estimator_service.offline import rig_of_log
from estimator_service.pipeline import Pipeline
from estimator_service.rig import load_rig

from helpers import RIG, fd_jac, filter_at, run_filter, write_rig_copy, write_sim_log

# runs backends (or estimator subprocesses): their kernels compiled before the tests start (conftest.py)
pytestmark = pytest.mark.kernels("ekf", "ukf")


# ---------------------------------------------------------------------------------- model pieces
def test_manifold_evaluator_matches_the_model() -> None:
    """Predictor + Newton + R-matrix dynamics = the model's position, velocity and forward dynamics."""
    m = load_rig(RIG).model
    dyn = ManifoldDynamics(m, 1e-12, kernels.compile_model(m, "ekf"))
    q = m.solve_position(m.q0, np.array([0.7]))
    ref = dyn.point(np.array([0.7]), np.array([-2.0]), None, None, q)
    tau = np.zeros(m.n)
    tau[m.dof] = 0.3
    for dz in (1e-4, 5e-3, 0.05, 1.5):  # the last one needs the continuation fallback
        z, zd = np.array([0.7 + dz]), np.array([4.0])
        pt = dyn.point(z, zd, tau, ref)
        q_ref = m.solve_position(ref.q, z)
        qd_ref = m.solve_velocity(q_ref, zd)
        np.testing.assert_allclose(pt.q, q_ref, atol=1e-11)
        np.testing.assert_allclose(pt.qd, qd_ref, atol=1e-10)
        np.testing.assert_allclose(pt.qdd, m.forward_dynamics(q_ref, qd_ref, tau), rtol=1e-8, atol=1e-8)
        np.testing.assert_allclose(pt.R, m.R(q_ref), atol=1e-10)
        assert np.abs(m.Phi(pt.q)).max() < 1e-10


@pytest.mark.parametrize("integrator", ["euler", "heun", "rk4"])
def test_transition_jacobian_is_exact_for_each_integrator(integrator: str) -> None:
    f = filter_at("ekf", integrator=integrator, position_tol=1e-14)
    f.x[2:4] = [0.03, 0.01]  # unknown damping and bias force
    f.x[f._eps] = np.linspace(-0.5, 0.5, f._eps.stop - f._eps.start)  # model parameter errors (σ units)
    x0, pt0 = f.x.copy(), f.point_of(f.x, f.point)
    h = 0.01  # the covariance interval: 10 ms in one transition
    _, F, _ = f.transition(x0, h, pt0, jac=True)
    F_fd = fd_jac(lambda x: f.transition(x, h, f.point_of(x, pt0), jac=False)[0], x0, 1e-6)
    np.testing.assert_allclose(F, F_fd, rtol=1e-5, atol=1e-7)
    assert np.abs(F - np.eye(f.L)).max() > 1e-3  # not trivially the identity


@pytest.mark.parametrize("path", ["compiled", "numpy"])
@pytest.mark.parametrize("backend", ["ekf", "ukf"])
def test_measurement_jacobian_of_gyro_accelerometer_encoder_vs_finite_differences(
        backend: str, path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """H of the whole measurement function of x (q(z), q̇ = Rż, q̈(x)), every sensor kind: the compiled model
    (kernels.measurement.measure_sensors) and the numpy reference path."""
    if path == "numpy":
        monkeypatch.setenv(kernels.ENV_SWITCH, "numpy")
    f = filter_at(backend, position_tol=1e-14)
    assert [s.kind for s in f.sensors] == ["gyr", "acc", "gyr", "enc"]
    ids = list(range(len(f.sensors)))
    assert (compiled_sensor_ids(f._table, ids) is not None) == (path == "compiled" and kernels.enabled())
    f.x[2:4] = [0.03, 0.01]
    f.x[f._eps] = np.linspace(-0.5, 0.5, f._eps.stop - f._eps.start)  # model parameter errors (σ units)
    f.x[f.nd :] = 0.01 * np.arange(1, f.sp.dim + 1)  # sensor biases, time offset (s) and mount (rad)
    assert f.sp.names == ["coupler.gyr_bias[1]", "coupler.time_offset", "coupler.acc_bias[0]",
                          "coupler.acc_bias[2]", "coupler.mount", "rocker.gyr_bias[1]", "rocker.time_offset"]
    x0, pt0 = f.x.copy(), f.point_of(f.x, f.point)
    _, H = f.predict_measurement(x0, pt0, ids, jac=True)
    H_fd = fd_jac(lambda x: f.predict_measurement(x, f.point_of(x, pt0), ids, jac=False)[0], x0, 1e-6)
    np.testing.assert_allclose(H, H_fd, rtol=1e-5, atol=1e-6)
    assert np.abs(H[3:6, 0]).max() > 0.1  # the accelerometer depends on z (centripetal and gravity terms)
    assert np.abs(H[:3, f.nd + 1]).max() > 0.1  # the gyro reading depends on its time offset (through ω̇)
    assert np.abs(H[3:6, f.nd + 4]).max() > 1.0  # the accelerometer's on its mount (gravity turned: ~g per rad)


# ---------------------------------------------------------------------------------- accuracy
def test_euler_costs_accuracy(sim_log_10s: Path) -> None:
    """Same filter, same data: explicit Euler tracks worse than Heun (and RK4 is no worse than Heun).
    Without sensor-parameter states, whose estimation error (~0.07° here) would mask the integrator's."""
    no_params = {"gyr_bias_prior": 0.0, "time_offset_prior_s": 0.0}
    rmse = {i: run_filter(sim_log_10s, "ekf", {"integrator": i}, imu=no_params)[0] for i in ("euler", "heun", "rk4")}
    assert rmse["euler"] > 1.08 * rmse["heun"]
    assert rmse["rk4"] <= 1.05 * rmse["heun"]


def test_euler_open_loop_error_is_much_larger() -> None:
    """1 s of prediction alone (no sensors) against the model integrated to 1e-11 (DOP853)."""
    from estimator_service.simulate import Integrator, initial_state

    rig = load_rig(RIG)
    m = rig.model
    ref = Integrator(m, initial_state(m, {"crank": math.pi / 2}))
    ref.advance(1.0)
    z_ref = ref.state_at(1.0)[0].q[m.dof[0]]
    err = {}
    for integ in ("euler", "heun", "rk4"):
        rig.estimator.ekf = {"integrator": integ, "estimate_force": False}
        f = make_backend("ekf", m, [], rig.estimator)
        f.initialize(0.0, m.solve_position(m.q0, np.array([math.pi / 2])), np.zeros(m.n))
        for _ in range(1000):
            est = f.step()[0]
        assert est.t == pytest.approx(1.0) and est.status == "ok"  # no sensors: never degraded
        err[integ] = abs(est.z[0] - z_ref)
    assert err["heun"] < 1e-5 and err["euler"] > 20 * err["heun"] and err["rk4"] < err["heun"]


# ---------------------------------------------------------------------------------- timing of samples
def test_measurement_between_steps_is_used_at_its_time() -> None:
    """A sample at t = 0.5 ms inside a 1 ms step gives exactly what a 0.5 ms grid gives (predict to the
    sample, update, predict the rest), and differs from the same sample snapped to either grid point."""
    y = np.array([0.0, 0.9, 0.0])  # coupler gyro reading (rad/s), off the prediction

    def run(dt: float, t_m: float, steps: int):
        rig = load_rig(RIG)
        rig.estimator.dt = dt
        rig.estimator.ekf["gate_nis"] = 0  # the sample is far off the prediction: no outlier gate here
        m = rig.model
        f = make_backend("ekf", m, rig.virtual_sensors(m), rig.estimator)
        q = m.solve_position(m.q0, np.array([1.0]))
        f.initialize(0.0, q, m.solve_velocity(q, np.array([3.0])))
        f.add_measurement(Measurement(t_m, 0, y))
        for _ in range(steps):
            est = f.step()[-1]
        return est

    inside = run(0.001, 0.0005, 1)
    fine_grid = run(0.0005, 0.0005, 2)
    assert inside.t == pytest.approx(0.001) and fine_grid.t == pytest.approx(0.001)
    np.testing.assert_allclose(inside.zd, fine_grid.zd, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(inside.P_z, fine_grid.P_z, rtol=1e-10, atol=1e-15)
    for snapped in (run(0.001, 0.0, 1), run(0.001, 0.001, 1)):
        assert abs(snapped.zd[0] - inside.zd[0]) > 1e-6


def test_off_grid_samples_beat_samples_snapped_to_the_grid(offgrid_log: Path) -> None:
    """IMUs sampled half-way between steps: using their true times tracks better than snapping (without
    sensor-parameter states or model uncertainty, whose estimation error would mask the 0.5 ms)."""
    log = offgrid_log
    no_params = {"gyr_bias_prior": 0.0, "time_offset_prior_s": 0.0}
    exact_model = {"mass": 0.0, "inertia": 0.0}
    exact, _, _ = run_filter(log, "ekf", imu=no_params, model=exact_model)
    snapped, _, _ = run_filter(log, "ekf", snap_dt=0.001, imu=no_params, model=exact_model)
    assert exact <= 0.3 and exact < 0.9 * snapped


# ---------------------------------------------------------------------------------- divergence, status
@pytest.mark.parametrize("backend", ["ekf", "ukf"])
def test_nan_measurement_reinitialises_and_recovers(sim_log_10s: Path, backend: str) -> None:
    def corrupt(topic: str, msg: dict) -> None:
        if topic == "imu/coupler" and abs(msg["t"] - 3.0) < 1e-6:
            msg["gyr"] = [0.0, float("nan"), 0.0]

    _, ests, pipe = run_filter(sim_log_10s, backend, {"gate_nis": 0}, corrupt=corrupt)  # no outlier gate
    statuses = [e["status"] for e in ests]
    first = statuses.index("reinit")
    assert ests[first]["t"] == pytest.approx(3.0, abs=1.5e-3) and statuses.count("reinit") == 1
    assert pipe.backend.reinit_count == 1 and statuses[-1] == "ok"
    assert all(np.isfinite(e["crank"]) for e in ests)


def test_outlier_gate_rejects_a_nan_and_spikes(sim_log_10s: Path) -> None:
    """With the default gate a NaN sample and three 20 deg/s spikes are not fused (counted in est/diag);
    no re-initialisation, and the estimate stays within the public-scenario bound."""
    spikes = {3.0: float("nan"), 4.0: 0.35, 5.0: -0.35, 6.0: 0.35}

    def corrupt(topic: str, msg: dict) -> None:
        for t, v in spikes.items():
            if topic == "imu/coupler" and abs(msg["t"] - t) < 1e-6:
                msg["gyr"] = [0.0, v if math.isnan(v) else msg["gyr"][1] + v, 0.0]

    rmse, ests, pipe = run_filter(sim_log_10s, "ekf", corrupt=corrupt)
    assert pipe.backend.reinit_count == 0 and {e["status"] for e in ests} == {"ok"}
    assert pipe.diag(10.0)["info"]["consistency"]["sensors"]["coupler.gyr"]["gated"] == 4
    assert rmse <= 0.3


def test_wild_values_reinitialise_from_the_encoder(tmp_path: Path) -> None:
    """A gyro gone wild for 0.4 s: consecutive innovations far out of bounds -> re-initialisation at
    rest from the fused crank encoder's latest reading; the filter then tracks again."""
    rig_path = write_rig_copy(tmp_path / "enc.toml", RIG, [("lines = 1024\nrate_hz = 1000\nuse = false",
                                                            "lines = 1024\nrate_hz = 50\nuse = true")])
    log = write_sim_log(tmp_path / "enc.log", rig_path, 6.0)
    crank_enc: dict[int, float] = {}

    def corrupt(topic: str, msg: dict) -> None:
        if topic == "imu/coupler" and 2.0 <= msg["t"] < 2.4:
            msg["gyr"] = [0.0, 50.0 * math.sin(msg["t"] * 40), 0.0]
        if topic == "enc/crank":
            crank_enc[int(round(msg["t"] * 1000))] = msg["count"] * 2 * math.pi / msg["cpr"]

    _, ests, _ = run_filter(log, "ekf", corrupt=corrupt)
    re = [e for e in ests if e["status"] == "reinit"]
    assert len(re) >= 1 and 2.0 < re[0]["t"] < 2.5
    last_enc = max(k for k in crank_enc if k <= round(re[0]["t"] * 1000))
    assert re[0]["crank"] == pytest.approx(crank_enc[last_enc], abs=1e-9)  # restarted on the encoder reading
    assert re[0]["crank_rate"] == 0.0  # at rest
    late = [e for e in ests if e["t"] > 4.0]
    assert {e["status"] for e in late} == {"ok"}
    err = [abs(e["crank"] - crank_enc[k]) for e in late if (k := int(round(e["t"] * 1000))) in crank_enc]
    assert len(err) > 90 and max(err) < math.radians(0.5)  # tracking again (encoder: 0.09 deg counts)


def test_degraded_after_configured_silence() -> None:
    f = filter_at("ekf", use_encoder=False, degraded_after_ms=50.0)
    f.add_measurement(Measurement(0.0005, 0, np.array([0.0, -1.5, 0.0])))
    statuses = [f.step()[0].status for _ in range(100)]
    assert statuses[:50] == ["ok"] * 50 and statuses[51:] == ["degraded"] * 49
    f.add_measurement(Measurement(f.t + 0.0002, 2, np.zeros(3)))
    assert f.step()[0].status == "ok"


# ---------------------------------------------------------------------------------- parameters, sigma points
def test_params_defaults_and_errors() -> None:
    p = EkfParams.from_dict("rig.toml", "estimator.ekf", {"integrator": "rk4", "sigma_zd": 0.1, "outliers_to_reinit": 5})
    assert (p.integrator, p.sigma_zd, p.outliers_to_reinit, p.degraded_after_ms) == ("rk4", 0.1, 5, 200.0)
    assert not hasattr(p, "alpha") and UkfParams().alpha == 1.0
    bad = [
        ({"integrator": "rk45"}, "estimator.ekf.integrator", "rk45"),
        ({"sigmaz": 1.0}, "estimator.ekf.sigmaz", "unknown key"),
        ({"sigma_z": -1.0}, "estimator.ekf.sigma_z", "-1.0"),
        ({"outliers_to_reinit": 2.5}, "estimator.ekf.outliers_to_reinit", "2.5"),
        ({"covariance_step_s": 0}, "estimator.ekf.covariance_step_s", "> 0"),
        ({"estimate_force": "yes"}, "estimator.ekf.estimate_force", "'yes'"),
    ]
    for d, field, text in bad:
        with pytest.raises(ConfigError) as exc:
            EkfParams.from_dict("rig.toml", "estimator.ekf", d)
        assert "rig.toml" in str(exc.value) and field in str(exc.value) and text in str(exc.value)
    with pytest.raises(ConfigError, match=r"estimator\.ekf\.alpha"):  # UKF-only key in the EKF table
        EkfParams.from_dict("rig.toml", "estimator.ekf", {"alpha": 0.5})
    with pytest.raises(ConfigError, match=r"estimator\.ukf\.alpha.*1\.5"):
        UkfParams.from_dict("rig.toml", "estimator.ukf", {"alpha": 1.5})


def test_ukf_sigma_points_reproduce_mean_and_covariance_even_when_singular() -> None:
    f = filter_at("ukf", alpha=0.5, kappa=1.0)
    L = f.L  # [z, ż, c, b], the model parameter errors and the sensor parameters
    x = np.concatenate([[1.0, 2.0, 0.01, -0.02], 1e-3 * np.arange(L - 4)])
    a = np.concatenate([[1.0, 2.0, 0.0, 1.0], np.ones(L - 4)])
    for P in (np.diag(np.concatenate([[1e-4, 4e-2, 1e-3, 1e-2], np.full(L - 4, 1e-6)])), 1e-3 * np.outer(a, a)):  # the second has rank 1
        pts = f.sigma_points(x, P)
        assert pts.shape == (2 * L + 1, L) and np.isfinite(pts).all()
        np.testing.assert_allclose(f._wm @ pts, x, atol=1e-12)
        d = pts - x
        np.testing.assert_allclose((f._wc[:, None] * d).T @ d - (f._wc[0]) * np.outer(d[0], d[0]), P, atol=1e-9)


def test_backends_are_imported_on_use_only() -> None:
    """make_backend("ekf") must not import gtsam (the smoother's module is loaded by name on use)."""
    code = ("import sys; from estimator_service.rig import load_rig; from estimator_service.backends import make_backend; "
            f"r = load_rig({str(RIG)!r}); m = r.model; make_backend('ekf', m, r.virtual_sensors(m), r.estimator); "
            "print('gtsam' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
    with pytest.raises(ValueError, match="unknown backend 'kf'"):
        make_backend("kf", None, [], None)


def test_ukf_propagates_the_covariance_interval_ahead_of_the_update() -> None:
    """The ukf's sigma-point propagation over a covariance interval needs only its start and length: it runs
    in the two steps after the interval opens (half of the sigma points in each), for the last interval's
    length (an IMU's period), and the update step takes it; an interval of another length (a sample early) is
    propagated at the update, over its own length."""
    rig = load_rig(RIG)
    rig.estimator.ukf["gate_nis"] = 0  # (every sample fused)
    m = rig.model
    f = make_backend("ukf", m, rig.virtual_sensors(m), rig.estimator)
    q = m.solve_position(m.q0, np.array([1.0]))
    f.initialize(0.0, q, m.solve_velocity(q, np.array([3.0])))
    calls: list[tuple[bool, float]] = []  # (inside an update, interval length) of each propagation
    updating = [False]
    covariance_over, update, fused_call = f.covariance_over, f.update, f.fused_call

    def counted(x0, P0, pt0, h):
        calls.append((updating[0], h))
        return covariance_over(x0, P0, pt0, h)

    def fused(gids, dims, angle, y, rvar, interval, h_mean):
        if interval is not None:  # (the kernel propagates the interval itself)
            calls.append((True, interval[3]))
        return fused_call(gids, dims, angle, y, rvar, interval, h_mean)

    def tracked(group, h=0.0):
        updating[0] = True
        try:
            update(group, h)
        finally:
            updating[0] = False

    covariance_ahead, parts = f.covariance_ahead, [0]

    def counted_ahead(x0, P0, pt0, h):  # (two steps: half of the sigma points in each; the covariance at the second)
        parts[0] += 1
        out = covariance_ahead(x0, P0, pt0, h)
        if out is not None:
            calls.append((updating[0], h))
        return out

    f.covariance_over, f.update, f.fused_call, f.covariance_ahead = counted, tracked, fused, counted_ahead
    sample_times = [0.01 * k for k in range(1, 7)] + [0.065]  # 100 Hz, then one sample 5 ms early
    for t_m in sample_times:
        y = f.predict_measurement(f.x, f.point, [0, 1], jac=False)[0] + 0.01
        for i in (0, 1):
            f.add_measurement(Measurement(t_m, i, y[3 * i : 3 * i + 3]))
        while f.t < t_m - 1e-9:
            f.step()
    in_update = [h for inside, h in calls if inside]
    ahead = [h for inside, h in calls if not inside]
    # every interval propagated ahead for 10 ms (the first for covariance_step_s); the early sample's again
    # at its update, over the 5 ms it lasted
    assert ahead == pytest.approx([0.01] * len(sample_times), abs=1e-12) and parts[0] == 2 * len(ahead)
    assert in_update == pytest.approx([0.005], abs=1e-12)
    assert f._interval_start is None and f._interval_pre is None and f._interval_expect == pytest.approx(0.005)


@pytest.mark.parametrize("backend", ["ekf", "ukf"])
@pytest.mark.parametrize("mean_delay_s, used_share", [(0.0, 0.95), (0.01, 0.5)])
def test_filters_prepare_the_next_update_ahead_with_the_same_result(sim_log_10s: Path, backend: str,
                                                                     mean_delay_s: float, used_share: float) -> None:
    """In the step before an IMU's expected sample, the ekf and the ukf compute the update's part that needs
    no readings for every gyro (the mean's transition to its time, the interval's covariance unless the ukf
    computed it ahead, the predicted readings with H and S or the sigma points': FusedUpdates._prepare_update);
    the update step then does the rest, with the rows of the gyros it has.  On 4 s of the public scenario the estimates equal those without preparation to 1e-10, with the
    messages in time (nearly every update used it) and arriving late (exponential, mean 10 ms: samples of
    one IMU come alone and late ones re-run the steps since their time; a prepared part of a state restored
    must fit it or be dropped; half of the updates used it)."""
    rng = np.random.default_rng(3)
    reader = read_log(sim_log_10s)
    records = [(rec.t_recv + (rng.exponential(mean_delay_s) if mean_delay_s else 0.0), i, rec)
               for i, rec in enumerate(reader) if rec.topic != "truth/state" and rec.t_recv < 4.0]
    records.sort(key=lambda r: (r[0], r[1]))
    runs = []
    for prepare in (True, False):
        pipe = Pipeline(rig_of_log(reader.header, sim_log_10s), backend)
        f = pipe.backend
        finished: list[bool] = []
        finish = f._finish_prepared
        f._finish_prepared = lambda *a, _finish=finish, _log=finished: (lambda out: _log.append(out is not None) or out)(_finish(*a))
        if not prepare:
            f._prepare_update = lambda: None
        ests = [e for _, _, rec in records for e in pipe.feed(rec.topic, schema.decode(rec.topic, rec.payload))]
        runs.append((ests, finished, f))
    (with_prep, used, f), (without, unused, _) = runs
    assert len(with_prep) == len(without) > 3500 and not any(unused)
    assert f.reinit_count == 0 and len(used) >= 390 and sum(used) > used_share * len(used)
    worst = max(float(np.abs(np.subtract(a[k], b[k])).max()) for a, b in zip(with_prep, without, strict=True)
                for k in ("q", "qd"))
    assert worst < 1e-10

"""Compiled kernels (estimator_service/kernels/) against the numpy reference path.

Every shipped mechanism, mbse's files and generated ones up to 41 coordinates, random consistent
states: the manifold point, the forward dynamics with its Jacobians and the filters' state Jacobians
agree with the numpy reference to round-off, and so do the filters' transitions (mean, sigma points,
transition Jacobian) with every integrator; a backend gives the same estimates on both paths; the finite-difference
check of the compiled dynamics Jacobians holds on its own.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from estimator_service import kernels
from estimator_service.backends import REGISTRY
from estimator_service.angles import wrap_angle
from estimator_service.backends.base import Measurement
from estimator_service.backends.filter import INTEGRATORS
from estimator_service.backends.manifold import BufferPoint, ManifoldDynamics, Point, compiled_sensor_ids
from estimator_service.backends.sensor_params import SensorParams
from estimator_service.generate import ladder_yaml
from estimator_service.kernels.kalman import (block_nis_compact, ekf_correct_compact, ekf_innovation_cov_compact,
                                              gate_stats_compact, innovation, interval_jacobian_compact,
                                              ukf_correct_compact, ukf_covariance_compact, ukf_innovation_compact,
                                              ukf_sigma_points_compact)
from estimator_service.kernels.linalg import SMALL_N, cholesky
from estimator_service.kernels.measurement import angle_flags, _sensor_readings
from estimator_service.kernels.transition import point_views
from estimator_service.logfile import read_log
from estimator_service.mechanism import load_mechanism, parse_mechanism
from estimator_service.model import Model
from estimator_service.offline import rig_of_log
from estimator_service.paths import config_dir
from estimator_service.pipeline import Pipeline
from estimator_service.sensors import Accelerometer, Encoder, Gyro, Inclination, NoiseModel, axes_matrix, mount_axes

from helpers import MBSE, RIG, RIG_ACC, write_rig_copy

MECHANISMS = sorted(config_dir().glob("mechanisms/*.yaml")) + sorted(MBSE.glob("*.yaml"))
#: generated ladders: n = 9 (every matrix inverted by the kernels' own elimination) and n = 41 (the
#: [Φ_q; S] and KKT matrices, 41 and 81 rows, by LAPACK: kernels.linalg.SMALL_N)
LADDERS = [5, 21]
# every kind compiled before the tests start (conftest.py)
pytestmark = [pytest.mark.skipif(not kernels.enabled(), reason="kernels off (RIGSTATE_KERNELS=numpy or no numba)"),
              pytest.mark.kernels()]


def _mechanism(which: Path | int):
    """A mechanism file, or the generated ladder of that many bodies."""
    return parse_mechanism(ladder_yaml(which), f"ladder-{which}") if isinstance(which, int) else load_mechanism(which)


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(np.asarray(a) - np.asarray(b)).max() / (1.0 + np.abs(b).max()))


def _states(model: Model, rng: np.random.Generator, count: int):
    """Consistent (q, q̇, τ) near the initial configuration."""
    for _ in range(count):
        q = model.solve_position(model.q0, model.q0[model.dof] + rng.normal(0, 0.05, model.g))
        yield q, model.solve_velocity(q, rng.normal(0, 1.0, model.g)), rng.normal(0, 1.0, model.n)


def _random_state(f, rng: np.random.Generator, z_sd: float, zd_sd: float) -> np.ndarray:
    """A random filter state x = [z, ż, c, b, η, p] of filter ``f`` around the model's q0 (z ± z_sd, ż ± zd_sd)."""
    m, g = f.model, f.model.g
    return np.concatenate([m.q0[m.dof] + rng.normal(0, z_sd, g), rng.normal(0, zd_sd, g), rng.normal(0, 0.05, 2 * g),
                           rng.normal(0, 1.0, f.uncertainty.dim), rng.normal(0, 0.01, f.sp.dim)])


def _start_at(x: np.ndarray, *filters) -> None:
    """Each filter's point at x, solved from the model's q0 (no reference point)."""
    for f in filters:
        f.point = None
        f.point = f.point_of(x, None, f.model.q0)


@pytest.mark.parametrize("which", MECHANISMS + LADDERS, ids=lambda p: p.stem if isinstance(p, Path) else f"ladder-{p}")
def test_kernels_match_the_numpy_reference(which: Path | int) -> None:
    model = Model(_mechanism(which))
    compiled = kernels.compile_model(model, "ekf")
    assert kernels.compile_model(model, "smoother") is not None  # (its kernels compile on every mechanism too)
    assert model.m + model.g == model.n  # (mbse's pick-and-place robot: its redundant row dropped)
    assert compiled is not None
    fast, ref = ManifoldDynamics(model, 1e-10, compiled), ManifoldDynamics(model, 1e-10, None)
    assert fast.kernel is compiled and ref.kernel is None
    rng = np.random.default_rng(7)
    start = ref.point(model.q0[model.dof], np.zeros(model.g), None, None, model.q0)
    for q, qd, tau in _states(model, rng, 20):
        for got, want in zip(compiled.forward_dynamics_jac_tau(q, qd, tau), model.forward_dynamics_jac_tau(q, qd, tau),
                             strict=True):
            assert _rel(got, want) < 1e-11
        assert _rel(compiled.forward_dynamics(q, qd, tau), model.forward_dynamics(q, qd, tau)) < 1e-11
        sj, sj_ref = compiled.state_jacobians(q, qd, tau), model.state_jacobians(q, qd, tau)
        for name in ("R", "dqd_dz", "qdd", "dqdd_dq", "dqdd_dqd", "dqdd_dtau"):
            assert _rel(getattr(sj, name), getattr(sj_ref, name)) < 1e-11, name
        z, zd = q[model.dof], qd[model.dof]
        for ref_point, guess in ((start, None), (None, model.q0)):
            a, b = fast.point(z, zd, tau, ref_point, guess), ref.point(z, zd, tau, ref_point, guess)
            for name in ("q", "qd", "qdd", "zdd", "R", "Jm"):
                assert _rel(getattr(a, name), getattr(b, name)) < 1e-11, name
            assert a.residual == pytest.approx(b.residual, rel=1e-6, abs=1e-13)  # round-off of Φ
        _check_filter_jacobians(model, fast, start, q, qd, rng)
        _check_imu_measurement(model, compiled, q, qd, rng)


def _sensors_on_every_body(model: Model, rng: np.random.Generator) -> SensorParams:
    """On every body of ``model``: a gyro and an accelerometer at a random point with random axes (rotated by a
    random mounting angle), biases on their planar axes, an inclination with a random mount, and an encoder
    against the ground and one against the previous body; a time offset per IMU and a mount state per accelerometer:
    their sensor parameters."""
    sensors = []
    for b, body in enumerate(model.mech.bodies):
        axes = mount_axes(axes_matrix(["+x", "-z", "+y"] if b % 2 else ["-y", "+x", "+z"]), float(rng.uniform(-3, 3)))
        noise = NoiseModel(np.full(3, 0.01), np.zeros(3))
        topic = f"imu/{body.name}"
        imu = [Gyro(f"g{b}", topic, model, b, axes, noise),
               Accelerometer(f"a{b}", topic, model, b, tuple(rng.normal(0, 0.2, 2)), axes, noise),
               Inclination(f"i{b}", topic, model, b, axes, 0.01, float(rng.uniform(-3, 3)))]
        for s in imu:
            s.set_estimation(0.1, 0.0, time_offset_prior_s=0.01)
        imu[1].set_mount(0.0, 0.05)
        sensors += imu + [Encoder(f"e{b}", f"enc/{b}", model, b, None, 4096, 0.0, 1e-3),
                          Encoder(f"r{b}", f"enc/{b}", model, b, b - 1 if b else None, 4096, 0.0, 1e-3)]
    return SensorParams(sensors)


def _check_imu_measurement(model: Model, compiled: kernels.ModelKernels, q: np.ndarray, qd: np.ndarray,
                           rng: np.random.Generator) -> None:
    """The compiled measurement model (kernels.measurement.measure_sensors with H, _sensor_readings) against
    SensorParams.measure (the reference) for every kind of sensor on every body at (q, q̇) with a random q̈ and
    sensor parameters."""
    sp = _sensors_on_every_body(model, rng)
    table, n, ids = sp.sensor_table(), model.n, np.arange(len(sp.sensors))
    assert list(table.kind) == [kernels.GYRO, kernels.ACCELEROMETER, kernels.INCLINATION, kernels.ENCODER,
                                kernels.ENCODER] * len(model.mech.bodies)
    assert (table.coordinate >= 0).any() == bool(model.mech.relative_coordinates)  # (a ladder has none)
    assert [i for i in ids if table.mount_state[i] >= 0] == [i for i in ids if table.kind[i] == kernels.ACCELEROMETER]
    qdd, p = rng.normal(0, 3.0, n), rng.normal(0, 0.05, sp.dim)
    # x = [q, q̇, q̈, p]: H's blocks are ∂y/∂q, ∂y/∂q̇, ∂y/∂q̈, ∂y/∂p
    D = np.hstack([np.zeros((n, 2 * n)), np.eye(n), np.zeros((n, sp.dim))])
    y, H = compiled.measure_sensors(ids, q, qd, qdd, p, table, (np.eye(n), np.zeros((n, n)), D), 3 * n)
    want = [sp.measure(i, q, qd, qdd, p) for i in ids]
    assert _rel(y, np.concatenate([w[0] for w in want])) < 1e-12
    assert _rel(H, np.vstack([np.hstack(w[1:]) for w in want])) < 1e-12
    assert _rel(compiled.measure_sensors(ids, q, qd, qdd, p, table, None, 3 * n)[0], y) < 1e-15
    out = np.zeros(y.size)
    _sensor_readings(ids, q, qd, qdd, p, table, compiled.qe0, out)
    assert _rel(out, y) < 1e-12
    assert angle_flags(ids, table).tolist() == ([False] * 6 + [True] * 3) * len(model.mech.bodies)


def _check_filter_jacobians(model: Model, fast: ManifoldDynamics, start, q: np.ndarray, qd: np.ndarray,
                            rng: np.random.Generator) -> None:
    """The filters' state Jacobians (R-matrix form, no KKT inverse) against the model's KKT-form
    reference chained as IndependentFilter._dqdd_dx: x = [z, ż, c, b, ε] with two parameter errors."""
    g, dof = model.g, model.dof
    G = rng.normal(0, 1.0, (model.n, 2))
    x = np.concatenate([q[dof], qd[dof], rng.normal(0, 0.1, g), rng.normal(0, 1.0, g), rng.normal(0, 1.0, 2)])
    c, b, eps = x[2 * g : 3 * g], x[3 * g : 4 * g], x[4 * g :]
    tau = G @ eps
    tau[dof] += b - c * x[g : 2 * g]
    pt = fast.point(x[:g], x[g : 2 * g], tau, start, None)
    R, dqd_dz, D, ok = fast.kernel.filter_jacobians(x, (pt.q, pt.qd, pt.R, pt.Jm), True, G, 4 * g)
    assert ok
    sj = model.state_jacobians(pt.q, pt.qd, tau)
    Gd = sj.dqdd_dtau[:, dof]
    want = np.hstack([sj.dqdd_dq @ sj.R + sj.dqdd_dqd @ sj.dqd_dz, sj.dqdd_dqd @ sj.R - Gd * c, -Gd * x[g : 2 * g], Gd,
                      sj.dqdd_dtau @ G])
    assert _rel(R, sj.R) < 1e-11 and _rel(dqd_dz, sj.dqd_dz) < 1e-11
    assert _rel(D, want) < 1e-10


def test_compiled_dynamics_jacobians_match_finite_differences() -> None:
    model = Model(load_mechanism(config_dir() / "mechanisms" / "fourbar-sensors2016.yaml"))
    compiled = kernels.compile_model(model, "ekf")
    rng = np.random.default_rng(3)
    q, qd, tau = next(_states(model, rng, 1))
    qdd, dq, dqd, dtau = compiled.forward_dynamics_jac_tau(q, qd, tau)
    h = 1e-6
    for k in range(model.n):  # central differences, q and q̇ perturbed off the manifold as the reference's test does
        e = np.zeros(model.n)
        e[k] = h
        fd_q = (compiled.forward_dynamics_jac_tau(q + e, qd, tau)[0] - compiled.forward_dynamics_jac_tau(q - e, qd, tau)[0]) / (2 * h)
        fd_qd = (compiled.forward_dynamics_jac_tau(q, qd + e, tau)[0] - compiled.forward_dynamics_jac_tau(q, qd - e, tau)[0]) / (2 * h)
        fd_tau = (compiled.forward_dynamics_jac_tau(q, qd, tau + e)[0] - compiled.forward_dynamics_jac_tau(q, qd, tau - e)[0]) / (2 * h)
        assert np.allclose(dq[:, k], fd_q, atol=1e-5 * (1 + np.abs(fd_q).max()))
        assert np.allclose(dqd[:, k], fd_qd, atol=1e-6 * (1 + np.abs(fd_qd).max()))
        assert np.allclose(dtau[:, k], fd_tau, atol=1e-6 * (1 + np.abs(fd_tau).max()))
    assert np.allclose(qdd, model.forward_dynamics(q, qd, tau), atol=1e-12)


@pytest.fixture(scope="module")
def log2(public_log) -> Path:
    return public_log(2.0)


def _estimates(log: Path, backend: str) -> np.ndarray:
    reader = read_log(log)
    pipe = Pipeline(rig_of_log(reader.header, log, None), backend)
    out = []
    for rec in reader:
        if rec.topic in pipe.stats:
            out += [m["q"] for m in pipe.feed_raw(rec.topic, rec.payload)]
    return np.array(out)


@pytest.mark.parametrize("backend", REGISTRY)
def test_a_backend_gives_the_same_estimates_on_both_paths(public_log, backend: str,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """1 s of the public scenario (the smoother's window 50 times over, 100 updates per IMU) on the compiled and the
    numpy path: the same estimates to 1e-8."""
    log = public_log(1.0)
    fast = _estimates(log, backend)
    monkeypatch.setenv(kernels.ENV_SWITCH, "numpy")
    assert not kernels.enabled()
    ref = _estimates(log, backend)
    assert fast.shape == ref.shape and len(fast) > 900
    assert np.abs(fast - ref).max() < 1e-8


#: a fresh process: for each log given in turn builds a backend of its rig (its kernels compiled or loaded from numba's
#: cache there), then runs the log; prints, per log, the kernels that gained a signature during the run (compiled or
#: loaded inside a step: a stall) and those that hold more than one
_SIGNATURES_DURING_A_RUN = """
import json, sys
from estimator_service import kernels
from estimator_service.logfile import read_log
from estimator_service.offline import rig_of_log
from estimator_service.pipeline import Pipeline

def signatures():
    return {name: len(f.signatures) for name, f in kernels.compiled_functions().items()}
results = []
for log in sys.argv[3:]:
    reader = read_log(log)
    rig = rig_of_log(reader.header, log, None)
    getattr(rig.estimator, sys.argv[1]).update(json.loads(sys.argv[2]))
    pipe = Pipeline(rig, sys.argv[1])
    before, estimates = signatures(), 0
    for rec in reader:
        if rec.topic in pipe.stats:
            estimates += len(pipe.feed_raw(rec.topic, rec.payload))
    after = signatures()
    results.append({"estimates": estimates, "gained": {k: [before[k], v] for k, v in after.items() if v != before[k]},
                    "many": {k: v for k, v in after.items() if v > 1}})
print(json.dumps(results))
"""


#: the largest kernels (the manifold point, the integrator's stages, the measurement model): compiled once each.
#: A constant flag passed from compiled code is a literal type to numba, and the callee was compiled again for
#: it (the manifold point five times); ``kernels.jit.runtime_value`` passes such flags as run-time values.
_COMPILED_ONCE = {"point", "stage", "_transition_stages", "filter_transition", "filter_jacobians", "filter_tau",
                  "measure_sensors", "_accelerometer_rows", "_gyro_rows", "_angle_row", "_body_angle"}


@pytest.fixture(scope="module")
def log2_acc(public_log) -> Path:
    return public_log(2.0, RIG_ACC)


#: backends run with settings of their own: the kernels they call beyond their default's
_SETTINGS = {"fgs:dependent": {"coordinates": "dependent"}, "ekf:rk4": {"integrator": "rk4"}}


@pytest.mark.parametrize("backend", [*REGISTRY, *_SETTINGS])
def test_no_kernel_is_compiled_inside_a_step(log2: Path, log2_acc: Path, backend: str) -> None:
    """Every kernel a backend's steps call is compiled (or loaded from the cache) when the backend is built,
    in a fresh process as the estimator daemon, gyros only and then with the accelerometer: the smoother's gyro
    factors called a kernel only the filters warmed, and on a fresh install the demo's estimator stalled
    ~3 s on its first gyro sample (end-to-end latency p99 3044 ms).  The second backend starts as in a fresh
    process: a backend's warm-up is its kind's, on a sensor table of its own (kernels.ModelKernels.warm_up), the
    same for both rigs, and the first run gained nothing beyond it.  The largest kernels hold one specialization
    each (:data:`_COMPILED_ONCE`).  The ekf with RK4 also calls the transition with its Jacobian (for its
    covariance)."""
    name = backend.partition(":")[0]
    settings = json.dumps(_SETTINGS.get(backend, {}))
    out = subprocess.run([sys.executable, "-c", _SIGNATURES_DURING_A_RUN, name, settings, str(log2), str(log2_acc)],
                         capture_output=True, text=True, timeout=600, check=True)
    results = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(results) == 2
    for res in results:
        assert res["estimates"] > 1900 and res["gained"] == {}, res
        assert not _COMPILED_ONCE & set(res["many"]), res["many"]


def _compiled_and_reference(backend: str, rig_file: Path, monkeypatch: pytest.MonkeyPatch,
                            settings: dict | None = None) -> tuple:
    """(compiled, numpy reference) ``backend`` of the rig file, its ``[estimator.<backend>]`` replaced by
    ``settings`` if given."""
    from estimator_service.backends import make_backend
    from estimator_service.rig import load_rig

    def make():
        rig = load_rig(rig_file)
        if settings is not None:
            setattr(rig.estimator, backend, dict(settings))
        return make_backend(backend, rig.model, rig.virtual_sensors(rig.model), rig.estimator)

    fast = make()
    monkeypatch.setenv(kernels.ENV_SWITCH, "numpy")
    return fast, make()


def test_smoother_dynamics_rows_match_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """The dependent-coordinate smoother's rows (coordinates = "dependent"): compiled against numpy."""
    fast, ref = _compiled_and_reference("fgs", RIG_ACC, monkeypatch, {"coordinates": "dependent"})
    assert fast.compiled and fast.kernel is not None and not ref.compiled and ref.kernel is None
    m, rng = fast.model, np.random.default_rng(5)
    for _ in range(10):
        q = m.solve_position(m.q0, m.q0[m.dof] + rng.normal(0, 0.3, m.g))
        qd = m.solve_velocity(q, rng.normal(0, 2.0, m.g))
        xp = np.concatenate([q, qd, rng.normal(0, 0.05, fast._dim - 2 * m.n)])
        xp[fast._e0 : fast._p0] = rng.normal(0, 1.0, fast._p0 - fast._e0)  # model parameter errors (σ units)
        xc = xp + 1e-3 * rng.standard_normal(fast._dim)
        for prev in (xp, None):
            for got, want in zip(fast._step_residual(prev, xc, True), ref._step_residual(prev, xc, True), strict=True):
                assert _rel(got, want) < 1e-11
        for got, want in zip(fast._dynamics(xc), ref._dynamics(xc), strict=True):
            assert _rel(got, want) < 1e-11
        assert _rel(fast._accel(xc), ref._accel(xc)) < 1e-11
        # the IMU's measurement rows (compiled: gyros with biases and a time offset, the accelerometer with biases) at
        # interpolated and end times
        meas = [(0.4, Measurement(0.0, 0, rng.normal(0, 0.5, 3))), (1.0, Measurement(0.0, 1, rng.normal(0, 0.5, 3))),
                (0.7, Measurement(0.0, 2, rng.normal(0, 0.5, 3)))]
        assert fast._table is not None and ref._table is None and fast.sp.dim > 0
        assert [s.kind for s in fast.sensors] == ["gyr", "acc", "gyr"] and fast._table.covers(1)
        for prev in (xp, None):  # (no Jacobian w.r.t. a previous state without one)
            for got, want in zip(fast._measurement_residual(prev, xc, meas, True),
                                 ref._measurement_residual(prev, xc, meas, True), strict=True):
                assert (got is None and want is None) if prev is None and want is None else _rel(got, want) < 1e-11


def test_independent_smoother_rows_match_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """The independent-coordinate smoother (coordinates = "independent"): its point, state Jacobians with the
    model's parameter errors exact (M(η), gravity forces of η), step and IMU rows (gyros, an accelerometer), compiled against numpy."""
    fast, ref = _compiled_and_reference("fgs", RIG_ACC, monkeypatch, {"coordinates": "independent"})
    assert type(fast).__name__ == "IndependentSmoother" and fast.dynamics.kernel is not None and ref.dynamics.kernel is None
    m, g, rng = fast.model, fast.model.g, np.random.default_rng(6)
    assert fast._p0 > fast._e0 and fast.sp.dim > 0
    for f in (fast, ref):
        f._q_start = m.q0.copy()
    for _ in range(10):
        xp = np.concatenate([m.q0[m.dof] + rng.normal(0, 0.3, g), rng.normal(0, 2.0, g), rng.normal(0, 0.05, fast._dim - 2 * g)])
        xp[fast._e0 : fast._p0] = rng.normal(0, 1.0, fast._p0 - fast._e0)  # model parameter errors (σ units)
        xc = xp + 1e-3 * rng.standard_normal(fast._dim)
        for f in (fast, ref):
            f._ref = None  # both Newton searches from q0
        (pa, ja), (pb, jb) = fast._at(xc), ref._at(xc)
        for name in ("q", "qd", "qdd", "zdd", "R", "Jm"):
            assert _rel(getattr(pa, name), getattr(pb, name)) < 1e-10, name
        for got, want in zip(ja, jb, strict=True):
            assert _rel(got, want) < 1e-10
        for got, want in zip(fast._step_residual(xp, xc, True), ref._step_residual(xp, xc, True), strict=True):
            assert _rel(got, want) < 1e-10
        meas = [(0.4, Measurement(0.0, 0, rng.normal(0, 0.5, 3))), (1.0, Measurement(0.0, 1, rng.normal(0, 0.5, 3))),
                (0.7, Measurement(0.0, 2, rng.normal(0, 0.5, 3)))]
        assert fast._table is not None and ref._table is None
        for prev in (xp, None):  # (no Jacobian w.r.t. a previous state without one)
            for got, want in zip(fast._measurement_residual(prev, xc, meas, True),
                                 ref._measurement_residual(prev, xc, meas, True), strict=True):
                assert (got is None and want is None) if prev is None and want is None else _rel(got, want) < 1e-10


@pytest.mark.parametrize("integrator", INTEGRATORS)
def test_filter_transitions_and_jacobians_match_the_reference(integrator: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The filters' compiled transition (mean and next point), sigma-point transitions, transition
    Jacobian F, state Jacobians and gyro measurement model (y, H, sigma-point readings) against the
    reference path, at random states with a DOF force, model-parameter errors ε and sensor parameters
    (gyro biases, a time offset: the public rig's ekf, L = 11)."""
    fast, ref = _compiled_and_reference("ekf", RIG, monkeypatch, {"integrator": integrator})
    assert fast.compiled and fast.dynamics.kernel is not None and not ref.compiled and ref.dynamics.kernel is None
    m, g, rng, h = fast.model, fast.model.g, np.random.default_rng(11), 0.01
    aux = np.random.default_rng(12)  # (the checks of shared and light points: the states stay those of rng)
    assert fast.uncertainty.dim > 0 and fast.sp.dim > 0 and fast.params.estimate_force
    for _ in range(8):
        x = _random_state(fast, rng, 0.5, 3.0)
        _start_at(x, fast, ref)
        assert _rel(fast.point.q, ref.point.q) < 1e-11
        xn, pt, G = fast.dynamics.advance(x, h, integrator, fast.tau_terms(), fast.point, fast._force_terms)
        assert _rel(G, fast.uncertainty.forces(pt.qdd)) < 1e-13  # the parameter forces at the point reached
        xr, _, last = ref.transition(x, h, ref.point, jac=False)
        ptr = ref.point_of(xr, last)
        assert _rel(xn, xr) < 1e-11
        for name in ("z", "q", "qd", "qdd", "zdd", "R", "Jm"):
            assert _rel(getattr(pt, name), getattr(ptr, name)) < 1e-10, name
        # the point reached is one buffer, which the next transition takes as it is; the same point as arrays is
        # packed (once) into the same buffer, and the next step from either is the same, bit for bit
        assert isinstance(pt, BufferPoint) and fast.dynamics.kernel.point_buffer(pt) is pt.buf
        as_arrays = Point(*(np.array(getattr(pt, f)) for f in ("z", "q", "qd", "qdd", "zdd", "R", "Jm")), pt.residual)
        np.testing.assert_array_equal(fast.dynamics.kernel.point_buffer(as_arrays), pt.buf)
        steps = [fast.dynamics.advance(xn, h, integrator, fast.tau_terms(), p, fast._force_terms) for p in (pt, as_arrays)]
        for a, b in zip(steps[0], steps[1], strict=True):
            np.testing.assert_array_equal(getattr(a, "buf", a), getattr(b, "buf", b))
        F = fast.transition_jacobian(x, h, fast.point)
        assert _rel(F, ref.transition(x, h, ref.point, jac=True)[1]) < 1e-10
        for got, want in zip(fast.jacobians(x, fast.point), ref.jacobians(x, ref.point), strict=True):
            assert _rel(got, want) < 1e-10
        # sigma points: rows that differ in the dynamic part, and one that differs only in sensor parameters
        X = np.vstack([x, x + 0.01 * rng.standard_normal(fast.L), x])
        X[2, fast.nd :] += 0.01
        got = fast.dynamics.advance_sigma(X, x, fast.nd, h, integrator, fast.tau_terms(), fast.point)
        want = [ref.transition(r, h, ref.point if k != 1 else ref.point_of(r, ref.point), jac=False)[0]
                for k, r in enumerate(X)]  # (rows 0 and 2 share x's point, as UnscentedKalmanFilter.covariance_over)
        assert _rel(got[:, : fast.nd], np.array(want)[:, : fast.nd]) < 1e-10
        np.testing.assert_array_equal(got[:, fast.nd :], X[:, fast.nd :])
        np.testing.assert_array_equal(got[2, : fast.nd], got[0, : fast.nd])
        # a point at its reference's z is the reference's position, with the reference's inverse: the same as
        # inverting there (Newton from the reference's q as a guess)
        zd2, tau2 = x[g : 2 * g] + 0.5, aux.normal(0, 1.0, m.n)
        for f in (fast, ref):
            a = f.dynamics.point(x[:g], zd2, tau2, f.point)
            b = f.dynamics.point(x[:g], zd2, tau2, None, f.point.q)
            for name in ("q", "qd", "qdd", "zdd", "R", "Jm"):
                assert _rel(getattr(a, name), getattr(b, name)) < 1e-12, name
        # sigma points as the UKF draws them, x ± the columns of a lower-triangular square root: the rows along
        # ż, c, b, ε and p share x's position (or a stage's of x's transition) and its inverse, the others are
        # light points found from x's (its stage's); against each row's own transition (every stage's point
        # found from the row's previous one, [Φ_q; S] inverted at each): the same to the position tolerance
        C = np.tril(aux.standard_normal((fast.L, fast.L))) * 0.02
        S = np.vstack([x, x + C.T, x - C.T])
        got = fast.dynamics.advance_sigma(S, x, fast.nd, h, integrator, fast.tau_terms(), fast.point)
        assert _rel(got, ref.sigma_transitions(S, x, ref.point, h)) < 1e-11
        own = np.array([ref.transition(r, h, ref.point if np.array_equal(r[: fast.nd], x[: fast.nd]) else
                                       ref.point_of(r, ref.point), jac=False)[0] for r in S])
        assert _rel(got[:, : fast.nd], own[:, : fast.nd]) < 1e-8
        # the gyros' readings (biases, a time offset) with H, and at the sigma points
        ids = list(range(len(fast.sensors)))
        assert compiled_sensor_ids(fast._table, ids) is not None and compiled_sensor_ids(ref._table, ids) is None
        for got, want in zip(fast.predict_measurement(x, fast.point, ids, True),
                             ref.predict_measurement(x, ref.point, ids, True), strict=True):
            assert _rel(got, want) < 1e-10
        fast.x, ref.x = x, x
        assert _rel(fast.sigma_readings(X, ids), ref.sigma_readings(X, ids)) < 1e-10
        assert _rel(fast.sigma_readings(S, ids), ref.sigma_readings(S, ids)) < 1e-10


def test_a_point_far_from_its_reference_stays_on_its_assembly_branch(monkeypatch: pytest.MonkeyPatch) -> None:
    """A UKF's sigma point 1.5 rad along the angle of a shaft that only a gyro sees (the yaw rig, whose angle's σ
    grows without bound): solved from the mean's point (compiled and reference), it is the model's continuation
    from there, not the mirrored point one Newton solve found (whose gyro read −ż: the ukf's angle jumped 9°)."""
    fast, ref = _compiled_and_reference("ukf", config_dir() / "rigs" / "shaft-yaw.toml", monkeypatch)
    x = np.zeros(fast.L)
    x[1] = 0.96
    _start_at(x, fast, ref)
    x[0] = 2.29
    for f in (fast, ref):  # (the mean's point, continued from the model's assembly)
        f.point = f.point_of(x, f.point)
    gyro = [i for i, s in enumerate(fast.sensors) if s.kind == "gyr"]
    for dz in (-1.5, 0.2, 1.5, 3.0):
        xs = x.copy()
        xs[0] += dz
        want = fast.model.solve_position(fast.point.q, xs[:1])
        for f in (fast, ref):
            pt = f.point_of(xs, f.point, light=True)
            np.testing.assert_allclose(pt.q, want, atol=1e-9)
            f.x = x
            y = f.sigma_readings(np.vstack([x, xs]), gyro)
            np.testing.assert_allclose(y[1], y[0], atol=1e-9)  # the gyro reads ż wherever the angle is


def test_light_sigma_points_of_a_large_mechanism_match_the_reference(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The UKF on ladder-21 (n = 41 > kernels.linalg.SMALL_N: the light points, R and s refined with the mean's
    inverse): its sigma transitions and sigma readings compiled against the reference path, and light
    points against the points inverted at the same q."""
    from estimator_service.generate import ladder_rig_toml

    (tmp_path / "ladder-21.yaml").write_text(ladder_yaml(21))
    (tmp_path / "ladder-21.toml").write_text(ladder_rig_toml(21, "ladder-21.yaml"))
    fast, ref = _compiled_and_reference("ukf", tmp_path / "ladder-21.toml", monkeypatch)
    m, rng, h = fast.model, np.random.default_rng(21), 0.01
    assert fast.dynamics.kernel is not None and ref.dynamics.kernel is None and m.n > SMALL_N
    ids = list(range(len(fast.sensors)))
    for _ in range(4):
        x = _random_state(fast, rng, 0.1, 2.0)
        _start_at(x, fast, ref)
        for f in (fast, ref):
            f.x = x
        # a light point: R and s refined with the reference's inverse, as the inverse there gives them
        xl = x + 0.002 * rng.standard_normal(fast.L)
        for f in (fast, ref):
            a, b = f.point_of(xl, f.point, light=True), f.point_of(xl, f.point)
            for name in ("q", "qd", "qdd", "zdd", "R"):
                assert _rel(getattr(a, name), getattr(b, name)) < 1e-11, name
            assert np.array_equal(a.Jm, f.point.Jm)  # (light indeed: the reference's Jm)
        P = np.diag(np.square(np.concatenate([[0.003, 0.1, 0.02, 0.02], np.full(fast.L - 4, 0.05)])))
        S = fast.sigma_points(x, P)
        got = fast.dynamics.advance_sigma(S, x, fast.nd, h, "heun", fast.tau_terms(), fast.point)
        assert _rel(got, ref.sigma_transitions(S, x, ref.point, h)) < 1e-10
        assert _rel(fast.sigma_readings(S, ids), ref.sigma_readings(S, ids)) < 1e-10


def test_filter_update_algebra_compiled_equals_its_numpy_function() -> None:
    """The EKF update's algebra and the per-sensor NIS: compiled, and in the fused updates' loop form
    (kernels.kalman.*_compact), against the same functions run by numpy (the reference path), and against the
    textbook formulas, with gated rows left out."""
    rng = np.random.default_rng(5)
    L, dims = 11, np.array([3, 3, 1], dtype=np.int64)
    k = int(dims.sum())
    B = rng.standard_normal((L, L))
    P, H, x, e = B @ B.T + np.eye(L), rng.standard_normal((k, L)), rng.standard_normal(L), rng.standard_normal(k)
    rvar = rng.uniform(0.1, 1.0, k)
    keep = np.array([0, 1, 2, 6], dtype=np.int64)  # the second sensor gated
    PHt, S = kernels.ekf_innovation_cov(P, H, rvar)
    for got, want in zip((PHt, S), kernels.ekf_innovation_cov.py_func(P, H, rvar), strict=True):
        assert _rel(got, want) < 1e-13
    for got, want in zip(ekf_innovation_cov_compact(P, H, rvar), (PHt, S), strict=True):
        assert _rel(got, want) < 1e-13
    assert _rel(S, H @ P @ H.T + np.diag(rvar)) < 1e-13
    total, each = kernels.block_nis(e, S, dims)
    assert total == pytest.approx(e @ np.linalg.solve(S, e), rel=1e-12)
    assert each[1] == pytest.approx(e[3:6] @ np.linalg.solve(S[3:6, 3:6], e[3:6]), rel=1e-12)
    assert _rel(each, kernels.block_nis.py_func(e, S, dims)[1]) < 1e-13
    total_c, each_c = block_nis_compact(e, S, dims)
    assert total_c == pytest.approx(total, rel=1e-13) and _rel(each_c, each) < 1e-13
    e_nan = e.copy()
    e_nan[0] = np.nan  # a NaN sample: its sensor's NIS is NaN (gated), the others' are unchanged
    for nis in (kernels.block_nis, block_nis_compact):
        total_nan, each_nan = nis(e_nan, S, dims)
        assert np.isnan(total_nan) and np.isnan(each_nan[0]) and _rel(each_nan[1:], each[1:]) < 1e-13
    singular = np.zeros((k, k))  # S not invertible: NaN, never an exception
    assert np.isnan(block_nis_compact(e, singular, dims)[0])
    xn, Pn = kernels.ekf_correct(x, P, H, PHt, S, e, rvar, keep)
    for got, want in zip((xn, Pn), kernels.ekf_correct.py_func(x, P, H, PHt, S, e, rvar, keep), strict=True):
        assert _rel(got, want) < 1e-12
    for got, want in zip(ekf_correct_compact(x, P, H, PHt, S, e, rvar, keep), (xn, Pn), strict=True):
        assert _rel(got, want) < 1e-12
    Hk, Rk = H[keep], np.diag(rvar[keep])
    K = P @ Hk.T @ np.linalg.inv(Hk @ P @ Hk.T + Rk)
    assert _rel(xn, x + K @ e[keep]) < 1e-12
    I_KH = np.eye(L) - K @ Hk
    assert _rel(Pn, I_KH @ P @ I_KH.T + K @ Rk @ K.T) < 1e-12


def test_the_smoothers_gate_statistics_compiled_equal_their_numpy_function() -> None:
    """gate_stats (the smoother's outlier gate of a sample against its prediction) in loop form against the numpy
    reference and the textbook formulas: the worst row in σ, eᵀS⁻¹e with S = H P Hᵀ + diag(σ²), e_i/√S_ii."""
    rng = np.random.default_rng(8)
    L, k = 9, 3
    B = rng.standard_normal((L, L))
    P, H, e, sigma = B @ B.T + np.eye(L), rng.standard_normal((k, L)), rng.standard_normal(k), rng.uniform(0.1, 1, k)
    assert kernels.compiled_or_python(kernels.gate_stats, True) is gate_stats_compact
    worst, nis, z = gate_stats_compact(e, H, P, sigma)
    want = kernels.gate_stats.py_func(e, H, P, sigma)
    assert worst == want[0] and nis == pytest.approx(want[1], rel=1e-13) and _rel(z, want[2]) < 1e-14
    S = H @ P @ H.T + np.diag(sigma**2)
    assert worst == np.max(np.abs(e) / sigma) and nis == pytest.approx(e @ np.linalg.solve(S, e), rel=1e-12)
    assert _rel(z, e / np.sqrt(np.diag(S))) < 1e-14


def test_interval_jacobian_is_heuns_form_from_the_intervals_two_ends() -> None:
    """The EKF's covariance interval Jacobian from A at its start and at its end: compiled equals numpy;
    Heun's form I + h/2 (A0 + A1 (I + h A0)), which is the Heun map's I + hA + h²A²/2 when A is constant;
    Euler's I + h A0; the error-state EKF's I + h A1 at the interval's end (both error models' codes)."""
    rng = np.random.default_rng(3)
    A0, A1 = rng.standard_normal((2, 6, 6))
    h, I = 0.01, np.eye(6)
    heun, euler = kernels.INTEGRATOR_CODES["heun"], kernels.INTEGRATOR_CODES["euler"]
    at_end = tuple(kernels.ERROR_MODEL_CODES.values())
    for integ in (heun, euler, *at_end):
        want = kernels.interval_jacobian.py_func(A0, A1, h, integ)
        assert _rel(kernels.interval_jacobian(A0, A1, h, integ), want) < 1e-14
        assert _rel(interval_jacobian_compact(A0, A1, h, integ), want) < 1e-14
    assert _rel(kernels.interval_jacobian(A0, A1, h, heun), I + h / 2 * (A0 + A1 @ (I + h * A0))) < 1e-14
    assert _rel(kernels.interval_jacobian(A0, A0, h, heun), I + h * A0 + h * h / 2 * A0 @ A0) < 1e-14
    assert _rel(kernels.interval_jacobian(A0, A1, h, euler), I + h * A0) < 1e-15
    for integ in at_end:
        assert _rel(kernels.interval_jacobian(A0, A1, h, integ), I + h * A1) < 1e-15


#: the sensors each rig of test_fused_update_equals_the_step_by_step_update fuses
FUSED_KINDS = {"gyros": ["gyr", "gyr"], "gyros+acc": ["gyr", "acc", "gyr"],
               "every kind": ["gyr", "acc", "incl", "gyr", "enc"]}


@pytest.mark.parametrize("sensors", list(FUSED_KINDS))
@pytest.mark.parametrize("backend", ["ekf", "errekf", "errekf:kinematic", "ukf"])
def test_fused_update_equals_the_step_by_step_update(backend: str, sensors: str, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The filters' update of a group of sensors (gyros; gyros and an accelerometer; every kind: an inclination and
    a crank encoder too, angles wrapped) by the compiled kernels (ModelKernels.ekf_update_prepare and _finish,
    ukf_update_prepare and _finish) against the same update step by step (H or the sigma points' readings, innovation, NIS, gate, correction, new point),
    and against the numpy reference path: the same state, covariance, point and consistency records, when
    every sensor passes the gate and when one is gated (the kernel leaves the correction to the caller: the
    other sensor's rows only); the covariance over the open interval propagated first (in the same call; the
    errekf's Φ at the interval's end, of both error models), and the mean's transition to the update's time
    before it (in the same call too)."""
    from estimator_service.backends import make_backend
    from estimator_service.rig import load_rig

    rig_file = RIG if sensors == "gyros" else RIG_ACC
    if sensors == "every kind":  # the coupler's inclination and the crank encoder fused too
        rig_file = write_rig_copy(tmp_path / "every-kind.toml", RIG_ACC, [('use = ["gyr", "acc"]', 'use = ["gyr", "acc", "incl"]', 1),
                                                                         ("use = false", "use = true", 1)])

    backend, _, error_model = backend.partition(":")

    def make():
        rig = load_rig(rig_file)
        if error_model:
            rig.estimator.errekf = {"error_model": error_model}
        return make_backend(backend, rig.model, rig.virtual_sensors(rig.model), rig.estimator)

    fused, steps = make(), make()
    # the step-by-step path: the mean advanced by predict, then every part of the update on its own
    monkeypatch.setattr(steps, "_fused", lambda ids, y, rvar, h: steps.predict(h, propagate=False) if h > 0 else None)
    statuses = []
    name = "ukf_update_finish" if backend == "ukf" else "ekf_update_finish"
    kernel_finish = getattr(fused.dynamics.kernel, name)
    monkeypatch.setattr(fused.dynamics.kernel, name,
                        lambda *a: (lambda out: statuses.append(out[0]) or out)(kernel_finish(*a)))
    monkeypatch.setenv(kernels.ENV_SWITCH, "numpy")
    ref = make()
    ids = list(range(len(fused.sensors)))
    assert [s.kind for s in fused.sensors] == FUSED_KINDS[sensors]
    assert compiled_sensor_ids(fused._table, ids) is not None and ref.dynamics.kernel is None
    rng = np.random.default_rng(8)
    for case, h in (("pass", 0.001), ("gated", 0.001), ("pass", 0.0)):
        x = _random_state(fused, rng, 0.3, 2.0)
        P = np.diag(rng.uniform(1e-4, 1e-2, fused.L))
        for f in (fused, steps, ref):
            f.initialize(0.0, fused.model.q0, np.zeros(fused.model.n))
            _start_at(x, f)
            f.x, f.P = x.copy(), P.copy()
            f.predict(0.004 - h)  # an open covariance interval: the update propagates it first
            assert f._interval_start is not None
        x = fused.x
        y_true = fused.predict_measurement(x, fused.point, ids, jac=False)[0]
        y = y_true + rng.normal(0, 0.01, y_true.size)
        first = np.concatenate([[0], np.cumsum([s.dim for s in fused.sensors])])
        if case == "gated":  # the second sensor (the rocker's gyro, the coupler's accelerometer) far off: gated
            y[first[1] : first[2]] += 5.0
        if "enc" in FUSED_KINDS[sensors]:  # an encoder's reading a turn off: the same angle
            y[-1] += 2 * np.pi
        group = [Measurement(0.0, i, y[first[i] : first[i + 1]]) for i in ids]
        predicts = []
        predict = fused.predict
        monkeypatch.setattr(fused, "predict", lambda *a, **k: predicts.append(a) or predict(*a, **k))
        for f in (fused, steps, ref):
            f.update(group, h)
            assert f._interval_start is None
        monkeypatch.setattr(fused, "predict", predict)
        assert predicts == []  # (the kernel advances the mean itself)
        for other, tol in ((steps, 1e-12), (ref, 1e-10)):
            assert _rel(fused.x, other.x) < tol and _rel(fused.P, other.P) < tol
            for name in ("q", "qd", "qdd", "zdd", "R", "Jm"):
                assert _rel(getattr(fused.point, name), getattr(other.point, name)) < tol, name
            assert fused.consistency.gated == other.consistency.gated
            assert fused.monitor.outliers == other.monitor.outliers
        gated = [0] * len(ids)
        gated[1] = 0 if case == "pass" and h > 0 else 1  # (counted since the start)
        assert fused.consistency.gated == gated
        assert not np.array_equal(fused.x, x)  # corrected (by every row, or by the other sensors')
    assert statuses == [0, 3, 0]  # the kernel corrected, then left a gated update to the caller


def test_ukf_algebra_compiled_equals_its_numpy_function() -> None:
    """The UKF's sigma points (with the jitter of a singular P), propagated covariance, innovation (angles
    wrapped) and correction (gated rows left out): compiled, and in the fused updates' loop form
    (kernels.kalman.*_compact, the Cholesky factor kernels.linalg.cholesky), against the same functions run by numpy (the
    reference path), and against the textbook formulas."""
    rng = np.random.default_rng(6)
    L, k = 7, 4
    B = rng.standard_normal((L, L))
    P, x = B @ B.T + np.eye(L), rng.standard_normal(L)
    wm, wc = np.full(2 * L + 1, 1.0 / (2 * L + 1)), np.full(2 * L + 1, 1.0 / (2 * L + 1))
    wm[0], wc[0] = 0.1, 0.5
    for Pi, tol in ((P, 1e-13), (np.outer(B[0], B[0]), 1e-9)):  # the second of rank 1: jitter, ill-conditioned
        X, ok = kernels.ukf_sigma_points(x, Pi, 3.0)
        Xr, okr = kernels.ukf_sigma_points.py_func(x, Pi, 3.0)
        Xc, okc = ukf_sigma_points_compact(x, Pi, 3.0)
        assert ok and okr and okc and _rel(X, Xr) < tol and _rel(Xc, Xr) < tol
        Sq = (X[1 : L + 1] - x).T
        assert _rel(Sq @ Sq.T, 3.0 * Pi) < 1e-9 and np.allclose(np.triu(Sq, 1), 0.0)
    X, _ = kernels.ukf_sigma_points(x, P, 3.0)
    Xn = np.sin(X)
    d = Xn - wm @ Xn
    assert _rel(kernels.ukf_covariance(Xn, wm, wc), (wc[:, None] * d).T @ d) < 1e-13
    assert _rel(kernels.ukf_covariance(Xn, wm, wc), kernels.ukf_covariance.py_func(Xn, wm, wc)) < 1e-13
    assert _rel(ukf_covariance_compact(Xn, wm, wc), kernels.ukf_covariance.py_func(Xn, wm, wc)) < 1e-13
    Y, y, rvar = 3.0 * np.cos(X[:, :k]), rng.standard_normal(k), rng.uniform(0.1, 1.0, k)
    angle = np.array([False, True, False, False])
    got = kernels.ukf_innovation(Y, wm, wc, angle, y, rvar)
    for a, b in zip(got, kernels.ukf_innovation.py_func(Y, wm, wc, angle, y, rvar), strict=True):
        assert _rel(a, b) < 1e-13
    for a, b in zip(ukf_innovation_compact(Y, wm, wc, angle, y, rvar), got, strict=True):
        assert _rel(a, b) < 1e-13
    ybar, dY, S, e = got
    assert np.allclose(dY[:, 1], wrap_angle(Y[:, 1] - ybar[1])) and e[1] == pytest.approx(wrap_angle(y[1] - ybar[1]))
    assert _rel(S, (wc[:, None] * dY).T @ dY + np.diag(rvar)) < 1e-13
    keep = np.array([0, 2, 3], dtype=np.int64)
    xn, Pn = kernels.ukf_correct(X, x, P, wc, dY, S, e, keep)
    for a, b in zip((xn, Pn), kernels.ukf_correct.py_func(X, x, P, wc, dY, S, e, keep), strict=True):
        assert _rel(a, b) < 1e-12
    for a, b in zip(ukf_correct_compact(X, x, P, wc, dY, S, e, keep), (xn, Pn), strict=True):
        assert _rel(a, b) < 1e-12
    C, ok = cholesky(P)  # the factor, and a matrix that is not positive definite
    assert ok and _rel(C, np.linalg.cholesky(P)) < 1e-13
    assert not cholesky(P - 2 * np.abs(np.linalg.eigvalsh(P)).max() * np.eye(L))[1]
    K = ((wc[:, None] * (X - x)).T @ dY[:, keep]) @ np.linalg.inv(S[np.ix_(keep, keep)])
    assert _rel(xn, x + K @ e[keep]) < 1e-12 and _rel(Pn, P - K @ S[np.ix_(keep, keep)] @ K.T) < 1e-12

_BLAS_THREADS = """

import ctypes, glob, json, os
import estimator_service, numpy
lib = glob.glob(os.path.join(os.path.dirname(numpy.__file__), os.pardir, "numpy.libs", "libscipy_openblas64_*.so"))
print(json.dumps([os.environ.get("OPENBLAS_NUM_THREADS"), ctypes.CDLL(lib[0]).scipy_openblas_get_num_threads64_()]))
"""


@pytest.mark.parametrize("env, want", [(None, 1), ("2", 2)])
def test_the_package_runs_blas_on_one_thread_unless_told(env: str | None, want: int) -> None:
    """Importing estimator_service before numpy leaves OpenBLAS one thread (a second one, spinning on a busy
    2-core machine, made an 81×81 inverse take 23 ms instead of 0.2 ms); an explicit setting is kept."""
    import os

    environ = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")}
    if env is not None:
        environ["OPENBLAS_NUM_THREADS"] = env
    out = subprocess.run([sys.executable, "-c", _BLAS_THREADS], capture_output=True, text=True, timeout=120,
                         check=True, env=environ)
    assert json.loads(out.stdout) == [str(want), want]


def test_one_angle_wrap_in_python_numpy_and_the_kernels():
    """wrap_angle is [−π, π) on floats and arrays, and the compiled code runs the same function (registered
    with numba, not a copy): equal bits on the kernels' wrapped rows."""
    assert wrap_angle(np.pi) == -np.pi and wrap_angle(-np.pi) == -np.pi and wrap_angle(0.0) == 0.0
    a = np.array([7.0, -7.0, 3.0, 100.0, -1e-17, 2 * np.pi])
    w = wrap_angle(a)
    assert np.all(w >= -np.pi) and np.all(w < np.pi)
    assert np.allclose(np.cos(w), np.cos(a)) and np.allclose(np.sin(w), np.sin(a))
    assert [wrap_angle(float(v)) for v in a] == w.tolist()
    y, y_pred, angle = np.zeros(len(a)), -a, np.ones(len(a), dtype=np.bool_)
    assert innovation(y, y_pred, angle).tolist() == w.tolist()
    assert innovation.py_func(y, y_pred, angle).tolist() == w.tolist()


@pytest.mark.parametrize("n, m, g", [(6, 5, 1), (2, 0, 2), (41, 20, 21)])
def test_a_buffer_points_fields_are_the_kernels_views_of_its_buffer(n: int, m: int, g: int) -> None:
    """BufferPoint makes each field when asked, from the layout of kernels.transition.point_views (the one definition),
    also for a mechanism without constraint rows (Jm empty); the arrays are views on the buffer."""
    buf = np.random.default_rng(3).standard_normal(g + 3 * n + g + n * g + n * m + 1)
    pt = BufferPoint(buf, n, m, g)
    for name, want in zip(Point.__dataclass_fields__, point_views.py_func(buf, n, m, g), strict=True):
        got = getattr(pt, name)
        if name == "residual":
            assert type(got) is float and got == float(want)
        else:
            assert got.shape == want.shape and np.array_equal(got, want), name
            assert got.base is buf or got.size == 0, name
    with pytest.raises(AttributeError):
        _ = pt.not_a_field


COMPILE_AND_REPORT = """
import json, os, sys
from estimator_service import kernels
from estimator_service.paths import default_rig
from estimator_service.rig import load_rig

kernels.compile_model(load_rig(str(default_rig())).model, "manifold")
names = ("filter_jacobians", "measure_sensors", "point_full", "smoother_point", "smoother_positions",
         "smoother_step_rows", "gate_stats_compact")
compiled = kernels.compiled_functions()
print(json.dumps({n: [len(compiled[n].signatures), sum(compiled[n].stats.cache_hits.values())] for n in names}))
"""


def test_a_cold_cache_compiles_the_smoothers_kernels_in_two_processes(tmp_path: Path) -> None:
    """On an empty numba cache the independent smoother's kernels are compiled by the process and a helper process
    at once (kernels.warmup.HELPED_KINDS): the state Jacobians and the measurement model are then loaded from the helper's
    cache entries, not compiled again, and every kernel has the one signature the backend uses (the two parts
    compiled the very types the kernels call).  A second process loads everything."""
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "numba")}
    cold, warm = (json.loads(subprocess.run([sys.executable, "-c", COMPILE_AND_REPORT], env=env, capture_output=True,
                                            text=True, timeout=900, check=True).stdout) for _ in range(2))
    assert all(sigs == 1 for sigs, _ in cold.values())
    assert cold["filter_jacobians"][1] == 1 and cold["measure_sensors"][1] == 1  # the helper's, loaded
    assert cold["point_full"][1] == 0 and cold["smoother_point"][1] == 0  # compiled here
    assert all(hits == 1 for name, (_, hits) in warm.items() if name not in ("filter_jacobians", "point_full"))


def test_a_process_pinned_to_one_cpu_counts_one_usable_cpu() -> None:
    """A process that may run on one CPU only (taskset, systemd's CPUAffinity=) starts no helper for a cold compile
    (kernels.warmup.usable_cpus: its affinity, not the machine's count of CPUs): the two would only take turns."""
    from estimator_service.kernels import warmup

    code = ("import os; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); "
            "from estimator_service.kernels import warmup; print(warmup.usable_cpus())")
    pinned = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True).stdout
    assert int(pinned) == 1
    assert warmup.usable_cpus() == len(os.sched_getaffinity(0))  # (this process: as many as it may use)

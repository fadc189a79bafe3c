"""Virtual sensors: analytic Jacobians vs central finite differences, physics, encoder counts, noise."""

from __future__ import annotations

import math

import numpy as np
import pytest

from estimator_service import schema
from estimator_service.backends.mount_test import MOUNT_HELD_SIGMA, MOUNT_RELEASE_SIGMA, MountTest
from estimator_service.backends.sensor_params import SensorParams
from estimator_service.mechanism import load_mechanism
from estimator_service.model import Model
from estimator_service.paths import config_dir
from estimator_service.sensors import Accelerometer, Encoder, Gyro, Inclination, NoiseModel, axes_matrix, mount_axes

from helpers import fd_jac

NOISELESS = NoiseModel(np.zeros(3), np.zeros(3))
AXES_SETS = (["+x", "+y", "+z"], ["+x", "-z", "+y"], ["-y", "+z", "-x"])


@pytest.fixture(scope="module")
def model() -> Model:
    return Model(load_mechanism(config_dir() / "mechanisms" / "fourbar-sensors2016.yaml"))


def every_sensor(m: Model) -> list:
    """Each kind of sensor on each body, several mountings and axes, encoders vs ground and vs a body."""
    out: list = []
    for body in range(len(m.mech.bodies)):
        for axes in AXES_SETS:
            A = axes_matrix(axes)
            out.append(Gyro("g", "imu/g", m, body, A, NOISELESS))
            out.append(Accelerometer("a", "imu/a", m, body, (0.07, -0.03), A, NOISELESS))
        out.append(Inclination("i", "imu/i", m, body, axes_matrix(AXES_SETS[1]), 0.01))
        out.append(Encoder("e", "enc/e", m, body, None, 4096, 0.0, 1e-3))
    out.append(Encoder("r", "enc/r", m, m.body_index("rocker"), m.body_index("coupler"), 40000, 0.2, 1e-4))
    return out


def consistent_state(m: Model, z: float, zd: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """q from the position problem, q̇ from the velocity problem, q̈ from the forward dynamics."""
    q = m.solve_position(m.q0, np.array([z]))
    qd = m.solve_velocity(q, np.array([zd]))
    return q, qd, m.forward_dynamics(q, qd)


def assert_jacobians(s, q: np.ndarray, qd: np.ndarray, qdd: np.ndarray) -> None:
    y, H_q, H_qd, H_qdd = s.h(q, qd, qdd)
    assert y.shape == (s.dim,) and H_q.shape == H_qd.shape == H_qdd.shape == (s.dim, len(q))
    what = f"{s.kind} on body {s.body}"
    np.testing.assert_allclose(H_q, fd_jac(lambda x: s.h(x, qd, qdd)[0], q), atol=1e-7, err_msg=what + " d/dq")
    np.testing.assert_allclose(H_qd, fd_jac(lambda x: s.h(q, x, qdd)[0], qd), atol=1e-7, err_msg=what + " d/dqd")
    np.testing.assert_allclose(H_qdd, fd_jac(lambda x: s.h(q, qd, x)[0], qdd), atol=1e-7, err_msg=what + " d/dqdd")


def test_jacobians_match_finite_differences_on_consistent_states(model: Model) -> None:
    rng = np.random.default_rng(7)
    sensors = every_sensor(model)
    assert {type(s) for s in sensors} == {Gyro, Accelerometer, Inclination, Encoder}
    for _ in range(4):
        q, qd, qdd = consistent_state(model, rng.uniform(-math.pi, math.pi), rng.uniform(-5, 5))
        assert np.abs(model.Phi(q)).max() < 1e-10
        for s in sensors:
            assert_jacobians(s, q, qd, qdd)


def test_jacobians_match_finite_differences_off_the_constraint_manifold(model: Model) -> None:
    """Filters and the smoother linearise at states that violate the constraints slightly."""
    rng = np.random.default_rng(8)
    q, qd, _ = consistent_state(model, 2.0, 1.3)
    q = q + 1e-3 * rng.standard_normal(model.n)
    qd = qd + 0.1 * rng.standard_normal(model.n)
    qdd = rng.standard_normal(model.n)
    for s in every_sensor(model):
        assert_jacobians(s, q, qd, qdd)


def test_gyro_on_a_uniformly_rotating_crank_reads_the_rate(model: Model) -> None:
    crank = model.body_index("crank")
    upright = Gyro("c", "imu/c", model, crank, axes_matrix(["+x", "+y", "+z"]), NOISELESS)
    flipped = Gyro("c", "imu/c", model, crank, axes_matrix(["+x", "-z", "+y"]), NOISELESS)
    rate = 2.5  # rad/s, constant: the crank angle is a DOF, so q̈ of a uniform turn has z̈ = 0
    q = model.q0
    for theta in np.linspace(0, 2 * math.pi, 13):
        q = model.solve_position(q, np.array([theta]))
        qd = model.solve_velocity(q, np.array([rate]))
        qdd = model.solve_acceleration(q, qd, np.zeros(1))
        np.testing.assert_allclose(upright.h(q, qd, qdd)[0], [0, 0, rate], atol=1e-12)
        np.testing.assert_allclose(flipped.h(q, qd, qdd)[0], [0, -rate, 0], atol=1e-12)


def test_gyro_and_accelerometer_match_derivatives_of_the_motion(model: Model) -> None:
    """Along a kinematic path z(t) = z0 + w t + a t²/2: gyro = dφ/dt, accelerometer = R(φ)ᵀ(d²r/dt² − g)."""
    coupler = model.body_index("coupler")
    at = (0.2, 0.05)
    gyro = Gyro("g", "imu/g", model, coupler, axes_matrix(["+x", "+y", "+z"]), NOISELESS)
    acc = Accelerometer("a", "imu/a", model, coupler, at, axes_matrix(["+x", "+y", "+z"]), NOISELESS)
    z0, w, a, h = 1.1, 3.0, -4.0, 1e-4

    def pose(t: float) -> np.ndarray:
        return model.solve_position(model.q0, np.array([z0 + w * t + a * t * t / 2]))

    qm, q, qp = pose(-h), pose(0.0), pose(h)
    qd = model.solve_velocity(q, np.array([w]))
    qdd = model.solve_acceleration(q, qd, np.array([a]))
    phi = [model.body_angle(x, coupler)[0] for x in (qm, q, qp)]
    r = [model.point_position(x, coupler, at)[0] for x in (qm, q, qp)]
    assert gyro.h(q, qd, qdd)[0][2] == pytest.approx((phi[2] - phi[0]) / (2 * h), rel=1e-7)
    a_fd = (r[2] - 2 * r[1] + r[0]) / h**2 - model.gravity
    c, s = math.cos(phi[1]), math.sin(phi[1])
    np.testing.assert_allclose(acc.h(q, qd, qdd)[0], [c * a_fd[0] + s * a_fd[1], -s * a_fd[0] + c * a_fd[1], 0], atol=1e-5)


def test_accelerometer_at_rest_reads_plus_g_along_the_axis_pointing_up(model: Model) -> None:
    crank = model.body_index("crank")
    q = model.solve_position(model.q0, np.array([math.pi / 2]))  # crank at 90 deg: body x points up
    zero = np.zeros(model.n)
    body_axes = Accelerometer("c", "imu/c", model, crank, (0.05, 0.0), axes_matrix(["+x", "+y", "+z"]), NOISELESS)
    np.testing.assert_allclose(body_axes.h(q, zero, zero)[0], [9.81, 0, 0], atol=1e-12)
    # sensor z lies in the plane along body -x (pointing down): reads -g on z
    mounted = Accelerometer("c", "imu/c", model, crank, (0.05, 0.0), axes_matrix(["+z", "+y", "-x"]), NOISELESS)
    np.testing.assert_allclose(mounted.h(q, zero, zero)[0], [0, 0, -9.81], atol=1e-12)


def test_a_mount_residual_turns_the_accelerometer_and_its_jacobians_match_finite_differences(model: Model) -> None:
    """h_mounted(μ) reads as the sensor with its axes turned by a further μ about body z; its Jacobians w.r.t. q,
    q̇, q̈ and μ match central differences (on and off the constraint manifold); ∂y/∂μ is the reading of the
    in-plane axes turned by a further 90°."""
    rng = np.random.default_rng(11)
    coupler, at, stated, mu = model.body_index("coupler"), (0.07, -0.03), 0.4, 0.05
    q0, qd0, qdd0 = consistent_state(model, 1.9, -2.5)
    off = (q0 + 1e-3 * rng.standard_normal(model.n), qd0 + 0.1 * rng.standard_normal(model.n), rng.standard_normal(model.n))
    for axes in AXES_SETS:
        A = axes_matrix(axes)
        acc = Accelerometer("a", "imu/a", model, coupler, at, mount_axes(A, stated), NOISELESS)
        turned = Accelerometer("a", "imu/a", model, coupler, at, mount_axes(A, stated + mu), NOISELESS)
        quarter = Accelerometer("a", "imu/a", model, coupler, at, mount_axes(A, stated + mu + math.pi / 2), NOISELESS)
        for q, qd, qdd in ((q0, qd0, qdd0), off):
            y, H_q, H_qd, H_qdd, H_mu = acc.h_mounted(q, qd, qdd, mu)
            np.testing.assert_allclose(y, turned.h(q, qd, qdd)[0], atol=1e-12)
            np.testing.assert_allclose(H_mu, quarter.h(q, qd, qdd)[0], atol=1e-12)
            np.testing.assert_allclose(acc.mount_jacobian(y), H_mu, atol=1e-12)  # (from the reading alone)
            np.testing.assert_allclose(H_mu, fd_jac(lambda m: acc.h_mounted(q, qd, qdd, m[0])[0], np.array([mu]))[:, 0],
                                       atol=1e-7)
            np.testing.assert_allclose(H_q, fd_jac(lambda x: acc.h_mounted(x, qd, qdd, mu)[0], q), atol=1e-7)
            np.testing.assert_allclose(H_qd, fd_jac(lambda x: acc.h_mounted(q, x, qdd, mu)[0], qd), atol=1e-7)
            np.testing.assert_allclose(H_qdd, fd_jac(lambda x: acc.h_mounted(q, qd, x, mu)[0], qdd), atol=1e-7)
            assert np.abs(H_mu).max() > 1.0  # gravity alone turns the reading by ~g per rad
        assert acc.h(q0, qd0, qdd0)[0] == pytest.approx(acc.h_mounted(q0, qd0, qdd0, 0.0)[0], abs=0.0)


def test_sensor_params_measure_and_report_an_accelerometer_mount(model: Model) -> None:
    """SensorParams: a fused accelerometer with a mount prior has a mount state after its biases; ∂y/∂p matches
    central differences; the report gives the stated mount plus the estimate in degrees, where either is set."""
    coupler, rocker = model.body_index("coupler"), model.body_index("rocker")
    A = axes_matrix(["+x", "-z", "+y"])
    acc = Accelerometer("c", "imu/c", model, coupler, (0.07, -0.03), mount_axes(A, math.radians(2.0)), NOISELESS)
    acc.set_estimation(0.05, 1e-4)
    acc.set_mount(math.radians(2.0), math.radians(5.0))
    stated_only = Accelerometer("r", "imu/r", model, rocker, (0.1, 0.0), mount_axes(A, math.radians(-1.0)), NOISELESS)
    stated_only.set_mount(math.radians(-1.0), 0.0)
    neither = Accelerometer("n", "imu/n", model, rocker, (0.1, 0.0), A, NOISELESS)
    sp = SensorParams([acc, stated_only, neither])
    assert sp.names == ["c.acc_bias[0]", "c.acc_bias[2]", "c.mount"] and sp.mount_index == [2, None, None]
    assert sp.prior[2] == pytest.approx(math.radians(5.0)) and sp.walk[2] == 0.0
    q, qd, qdd = consistent_state(model, 0.8, 3.0)
    p = np.array([0.02, -0.01, math.radians(1.5)])
    y, _, _, _, H_p = sp.measure(0, q, qd, qdd, p)
    np.testing.assert_allclose(H_p, fd_jac(lambda x: sp.measure(0, q, qd, qdd, x)[0], p), atol=1e-7)
    np.testing.assert_allclose(y, acc.h_mounted(q, qd, qdd, p[2])[0] + [0.02, 0.0, -0.01], atol=1e-12)
    assert sp.measure(1, q, qd, qdd, p)[4].tolist() == np.zeros((3, 3)).tolist()  # no state: no ∂y/∂p
    _, _, mounts = sp.report(p)
    assert mounts == {"c": pytest.approx(3.5), "r": pytest.approx(-1.0)}
    assert SensorParams([neither]).report(np.zeros(0))[2] is None  # nothing to say: no mount_deg in est/state


def test_a_held_mount_is_released_by_readings_that_contradict_it_and_only_by_them(model: Model) -> None:
    """MountTest: the mount starts held (prior MOUNT_HELD_SIGMA); 100 s of white innovations at 100 Hz (the mount
    right) never release it, whatever the reading's sensitivity; an error of 1° does within 0.2 s, and the
    release is once, kept through a reset (a re-initialisation) while the running sums start again."""
    acc = Accelerometer("c", "imu/c", model, model.body_index("coupler"), (0.07, -0.03), np.eye(3), NOISELESS)
    acc.set_mount(0.0, math.radians(5.0))
    sp = SensorParams([acc])
    rng = np.random.default_rng(5)
    S = np.diag([0.05, 0.05, 0.08]) ** 2
    L = np.linalg.cholesky(S)
    right = MountTest(sp)
    assert right.columns == [0] and right.prior().tolist() == [MOUNT_HELD_SIGMA]
    for k in range(10000):
        h = acc.mount_jacobian(np.array([9.81 * math.cos(0.01 * k), 9.81 * math.sin(0.01 * k), 0.0]))
        assert not right.add(0, 0.01 * k, L @ rng.standard_normal(3), S, h)
    assert right.released == set()
    wrong = MountTest(sp)
    fired = []
    for k in range(100):
        h = acc.mount_jacobian(np.array([0.0, -9.81, 0.0]))
        e = h * math.radians(1.0) + L @ rng.standard_normal(3)
        if wrong.add(0, 0.01 * k, e, S, h):
            fired.append(k)
    assert len(fired) == 1 and fired[0] <= 20, fired  # (1° of 9.81 m/s² is 3.4σ of a row: ~2 samples at 5σ)
    assert wrong.released == {0} and wrong.prior().tolist() == pytest.approx([math.radians(5.0)])
    wrong.reset()
    assert wrong.released == {0} and not wrong.add(0, 2.0, 100 * h, S, h)
    assert MOUNT_RELEASE_SIGMA >= 4.0  # (a false release per window of 6e-7 or less)


def test_axes_must_be_a_right_handed_frame() -> None:
    np.testing.assert_array_equal(axes_matrix(["+x", "-z", "+y"]), [[1, 0, 0], [0, 0, -1], [0, 1, 0]])
    with pytest.raises(ValueError, match="right-handed"):
        axes_matrix(["+x", "+y", "-z"])
    with pytest.raises(ValueError, match="three axis names"):
        axes_matrix(["+x", "+y", "up"])


def test_encoder_counts_offset_and_message(model: Model) -> None:
    crank = model.body_index("crank")
    enc = Encoder("crank", "enc/crank", model, crank, None, 4096, 0.0, 1e-3)
    assert enc.coordinate is not None  # the crank angle is a coordinate of q: continuous over turns
    q = model.solve_position(model.q0, np.array([7.0]))
    assert enc.h(q, np.zeros(model.n), np.zeros(model.n))[0][0] == pytest.approx(7.0, abs=1e-12)
    assert enc.to_counts(2 * math.pi) == 4096 and enc.to_counts(-math.pi / 2) == -1024
    assert enc.from_counts(enc.to_counts(1.0)) == pytest.approx(1.0, abs=math.pi / 4096)
    shifted = Encoder("crank", "enc/crank", model, crank, None, 4096, 0.5, 1e-3)
    assert shifted.to_counts(0.5) == 0 and shifted.from_counts(1024) == pytest.approx(0.5 + math.pi / 2)
    assert enc.measure({"count": 1024, "cpr": 4096})[0] == pytest.approx(math.pi / 2)
    with pytest.raises(schema.SchemaError, match="4096"):
        enc.measure({"count": 1, "cpr": 1000})


def test_inclination_quaternion_round_trip(model: Model) -> None:
    incl = Inclination("c", "imu/c", model, model.body_index("coupler"), axes_matrix(["+x", "-z", "+y"]), 0.01)
    for phi in (-2.5, 0.0, 0.3, 3.0):
        quat = incl.quaternion(phi)
        assert np.linalg.norm(quat) == pytest.approx(1.0)
        assert incl.measure({"quat": quat.tolist()})[0] == pytest.approx(phi, abs=1e-12)
    with pytest.raises(schema.SchemaError, match="quat"):
        incl.measure({"gyr": [0, 0, 0]})


def test_noise_model_white_bias_quantisation() -> None:
    nm = NoiseModel(np.full(3, 0.1), np.array([1.0, 0, -0.5]), lsb=0.01)
    samples = np.array([nm.sample(np.zeros(3), np.random.default_rng(k)) for k in range(4000)])
    assert samples.mean(axis=0) == pytest.approx([1.0, 0, -0.5], abs=0.01)
    assert samples.std(axis=0) == pytest.approx([0.1] * 3, rel=0.05)
    np.testing.assert_allclose(samples / 0.01, np.round(samples / 0.01), atol=1e-9)  # quantised to the lsb
    a = NoiseModel(np.full(3, 0.1), np.zeros(3)).sample(np.ones(3), np.random.Generator(np.random.PCG64(3)))
    b = NoiseModel(np.full(3, 0.1), np.zeros(3)).sample(np.ones(3), np.random.Generator(np.random.PCG64(3)))
    np.testing.assert_array_equal(a, b)  # same seed, same noise

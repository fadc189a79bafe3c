"""Error-state EKF (errekf): error transition vs finite differences, feedback of the error into the
nominal state, parameters and the rig TOML, seeded RMSE and bias bounds on a bias scenario (the public
scenario and divergence handling are in test_backends.py's per-backend contract tests)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from estimator_service.backends import make_backend
from estimator_service.backends.base import Measurement
from estimator_service.backends.errekf import ErrekfParams, ErrorStateKalmanFilter
from estimator_service.errors import ConfigError
from estimator_service.rig import load_rig

from helpers import RIG_ACC, ScenarioLogs, fd_jac, filter_at, rig_text, run_filter

# runs backends (or estimator subprocesses): their kernels compiled before the tests start (conftest.py)
pytestmark = pytest.mark.kernels("ekf")


def write_text(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def nominal_with_force_and_params() -> ErrorStateKalmanFilter:
    """An errekf on all sensor kinds at (z, ż) = (2.2, 1.5), with a DOF force and sensor parameters set."""
    f = filter_at("errekf", position_tol=1e-14)
    f.x[2:4] = [0.03, 0.01]  # unknown damping (N·m·s/rad) and bias force (N·m)
    f.x[f._eps] = np.linspace(-0.5, 0.5, f._eps.stop - f._eps.start)  # model parameter errors (σ units)
    f.x[f.nd :] = 0.01 * np.arange(1, f.sp.dim + 1)  # sensor biases, time offset (s) and mount (rad)
    f.point = f.point_of(f.x, f.point)
    return f


def test_error_transition_is_the_first_order_step_of_the_model() -> None:
    """Linearised error model: Φ = I + hA is the exact derivative of one Euler step x + h ẋ(x) of the
    model (A analytic, compared with finite differences); it agrees with the nominal's Heun transition
    Jacobian to O(h²); the covariance propagation uses it at the current nominal state."""
    f = nominal_with_force_and_params()
    x0, pt0, h = f.x.copy(), f.point, 0.01
    Phi = f._I + h * f.error_jacobian(x0, pt0)
    euler = fd_jac(lambda x: x + h * f.xdot(x, f.point_of(x, pt0)), x0, 1e-6)
    np.testing.assert_allclose(Phi, euler, rtol=1e-5, atol=1e-7)
    diffs = []
    for hh in (h, h / 2):
        heun = fd_jac(lambda x: f.transition(x, hh, f.point_of(x, pt0), jac=False)[0], x0, 1e-6)
        diffs.append(np.abs(f._I + hh * f.error_jacobian(x0, pt0) - heun).max())
    assert 3.0 < diffs[0] / diffs[1] < 5.0  # the gap to the nominal's transition shrinks as h²
    assert np.abs(Phi - f._I).max() > 10 * diffs[0]
    rng = np.random.default_rng(3)
    B = rng.standard_normal((f.L, f.L))
    P0 = B @ B.T + np.eye(f.L)
    np.testing.assert_allclose(f.covariance_over(x0, P0, pt0, h), Phi @ P0 @ Phi.T, rtol=1e-12, atol=1e-12)
    # the remembered state Jacobians follow the state: a new DOF force gives the model's fresh ones
    x1 = x0.copy()
    x1[3] += 0.5  # bias force (N·m)
    before = f.jacobians(x0, pt0)[2]
    fresh = f._dqdd_dx(x1, f.model.state_jacobians(pt0.q, pt0.qd, f.tau(x1)))
    np.testing.assert_allclose(f.jacobians(x1, pt0)[2], fresh, rtol=1e-10, atol=1e-12)
    assert np.abs(fresh - before).max() > 1e-3


def test_kinematic_error_model_keeps_only_the_force_coupling() -> None:
    """errorEKF's simple error model: [[I, hI], [0, I]] on (δz, δż); the DOF force still drives δż
    exactly as in the linearised model (∂z̈/∂b = M̄⁻¹, checked by finite differences)."""
    lin = nominal_with_force_and_params()
    kin = nominal_with_force_and_params()
    kin.params.error_model = "kinematic"
    x0, g = lin.x.copy(), lin.model.g
    A_lin, A_kin = lin.error_jacobian(x0, lin.point), kin.error_jacobian(x0, kin.point)
    np.testing.assert_array_equal(A_kin[g : 2 * g, : 2 * g], np.zeros((g, g * 2)))
    np.testing.assert_array_equal(A_kin[:g, g : 2 * g], np.eye(g))
    np.testing.assert_array_equal(A_kin[:, 2 * g :], A_lin[:, 2 * g :])
    zdd = lambda x: lin.point_of(x, lin.point).zdd  # noqa: E731
    np.testing.assert_allclose(A_kin[g : 2 * g, 2 * g : 4 * g], fd_jac(zdd, x0, 1e-6)[:, 2 * g : 4 * g], rtol=1e-5, atol=1e-8)
    assert np.abs(A_kin[g : 2 * g, 3 * g : 4 * g]).min() > 0  # the bias force reaches z̈


def test_update_feeds_the_error_back_into_the_nominal_state() -> None:
    """One gyro + encoder update: the nominal moves by exactly δx = K (y − h(x̄)) computed here from the
    prior P and H at the nominal; the corrected nominal point is consistent (Φ(q) = 0, q̇ = R ż)."""
    f = nominal_with_force_and_params()
    f.step()
    f.propagate_covariance()
    ids = [0, 3]  # coupler gyro, crank encoder
    x_nom, P = f.x.copy(), f.P.copy()
    y_pred, H = f.predict_measurement(x_nom, f.point, ids, jac=True)
    y = y_pred + np.array([0.002, -0.004, 0.003, 0.001])  # rad/s, rad: well inside the outlier gate
    S = H @ P @ H.T + np.diag(f.measurement_var(ids))
    dx = P @ H.T @ np.linalg.solve(S, y - y_pred)
    f.t_update = f.t
    f.update([Measurement(f.t, 0, y[:3]), Measurement(f.t, 3, y[3:])])
    np.testing.assert_allclose(f.x, x_nom + dx, rtol=1e-9, atol=1e-13)
    assert np.abs(dx[:2]).max() > 1e-4  # a real correction of z and ż
    g = f.model.g
    np.testing.assert_allclose(f.point.z, f.x[:g], atol=0)
    assert np.abs(f.model.Phi(f.point.q)).max() < 1e-9
    np.testing.assert_allclose(f.point.qd, f.point.R @ f.x[g : 2 * g], atol=1e-12)
    assert np.all(np.linalg.eigvalsh(f.P) > 0) and np.trace(f.P) < np.trace(P)


def test_errekf_parameters_and_rig_table(tmp_path: Path) -> None:
    """``[estimator.errekf]``: the shared filter keys plus error_model; bad values name file, key and value;
    a rig selects the backend and its table like any other."""
    p = ErrekfParams.from_dict("rig.toml", "estimator.errekf", {"error_model": "kinematic", "integrator": "rk4"})
    assert (p.error_model, p.integrator) == ("kinematic", "rk4")
    assert ErrekfParams.from_dict("rig.toml", "estimator.errekf", {}).error_model == "linearised"
    for d, text in (({"error_model": "exact"}, "estimator.errekf.error_model: expected one of ['linearised', 'kinematic'], got 'exact'"),
                    ({"sigma_zd": -1.0}, "estimator.errekf.sigma_zd: must be >= 0, got -1.0"),
                    ({"alpha": 0.5}, "estimator.errekf.alpha: unknown key")):
        with pytest.raises(ConfigError) as exc:
            ErrekfParams.from_dict("rig.toml", "estimator.errekf", d)
        assert str(exc.value).startswith(f"rig.toml: {text}")
    text = rig_text(RIG_ACC, [('backend = "fgs"\ndt = 0.001\n',
                               'backend = "errekf"\ndt = 0.001\n[estimator.errekf]\nerror_model = "kinematic"\n')])
    rig = load_rig(write_text(tmp_path / "rig.toml", text))
    assert rig.estimator.backend == "errekf" and rig.estimator.errekf == {"error_model": "kinematic"}
    be = make_backend(rig.estimator.backend, rig.model, rig.virtual_sensors(rig.model), rig.estimator)
    assert isinstance(be, ErrorStateKalmanFilter) and be.params.error_model == "kinematic"
    rig.estimator.errekf = {"error_model": 3}
    with pytest.raises(ConfigError, match=r"estimator\.errekf\.error_model.*got 3"):
        make_backend("errekf", rig.model, rig.virtual_sensors(rig.model), rig.estimator)


@pytest.mark.timeout(1200)  # a 10 s simulation and a backend run, on a loaded 2-core machine
def test_gyro_biases_friction_and_outliers(scenario_logs: ScenarioLogs) -> None:
    """biases-outliers, 10 s, seeded (gyro biases +0.25 / −0.2 deg/s, crank and rocker friction, five
    20 deg/s spikes in the coupler gyro): exactly the five spikes are gated (counted in est/diag), no
    re-initialisation, crank RMSE within 0.35° and both bias estimates within 0.07 deg/s of the truth
    from 5 s on (measured: RMSE 0.321°, bias errors 0.055 / 0.036 deg/s; ekf 0.322°, 0.054 / 0.036)."""
    rmse, ests, pipe = run_filter(scenario_logs["biases-outliers", 10.0], "errekf")
    gated = {k: v["gated"] for k, v in pipe.diag(10.0)["info"]["consistency"]["sensors"].items()}
    assert gated["coupler.gyr"] == 5 and gated["rocker.gyr"] == 0
    assert rmse <= 0.35 and pipe.backend.reinit_count == 0 and all(e["backend"] == "errekf" for e in ests)
    late = [e for e in ests if e["t"] >= 5.0]
    for key, b in {"coupler.gyr": 0.25, "rocker.gyr": -0.2}.items():
        err = max(abs(math.degrees(e["bias"][key][1]) - b) for e in late)
        assert err < 0.07, (key, err)

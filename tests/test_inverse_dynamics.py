"""Inverse dynamics (estimator_service.inverse_dynamics, `rigstate inverse-dynamics`): trajectory
derivatives vs scipy's Savitzky–Golay filter and vs the analytic trajectory, the crank torque vs mbse's
MSC Adams results, the factor-graph method vs the model method, factor Jacobians vs finite
differences, the pick-and-place robot by forward simulation with the computed torques, power balance
on the shipped mechanisms, and the command line with its errors."""

from __future__ import annotations

import csv
import subprocess
from pathlib import Path

import gtsam
import numpy as np
import pytest
from scipy.integrate import solve_ivp
from scipy.interpolate import CubicSpline
from scipy.signal import savgol_filter

from estimator_service import inverse_dynamics as ID
from estimator_service.commands.inverse_dynamics import read_trajectory
from estimator_service.errors import UserError
from estimator_service.mechanism import load_mechanism
from estimator_service.model import Model
from estimator_service.paths import config_dir

from helpers import MBSE, MBSE_REFERENCE, fd_jac, run_main

FOURBAR = MBSE / "fourbars1-with-rel-angle.yaml"
TRAJECTORY = MBSE_REFERENCE / "fourbars1-with-rel-angle-trajectory.txt"
ADAMS = MBSE_REFERENCE / "InverseDynamics_4bars_MSC.tab"
ROBOT = MBSE / "pick-and-place-robot.yaml"
G_ADAMS = 9.80665  # standard gravity, as the Adams model (tests/data/mbse-reference/README.md)
SHIPPED = sorted((config_dir() / "mechanisms").glob("*.yaml"))


def smooth_trajectory(model: Model, amplitudes: list[float], duration: float, dt: float) -> tuple[np.ndarray, np.ndarray]:
    """Imposed coordinates leaving the file's assembly at rest and coming back at rest: z0 + a sin²(π t / T),
    rounded to 8 significant digits as a text file holds them."""
    t = np.arange(0.0, duration + dt / 2, dt)
    x = model.q0[model.dof] + np.outer(np.sin(np.pi * t / duration) ** 2, amplitudes)
    return t, np.array([[float(f"{v:.7e}") for v in row] for row in x])


def power_balance_error(model: Model, res: ID.InverseDynamicsResult) -> tuple[float, float]:
    """(max |dE/dt − P|, max |P|) over the interior samples: E = kinetic + potential energy of the
    model (numerically differentiated in time), P = τ·q̇_I + power of the joint dampers."""
    t, q, qd = res.t, res.q, res.qd
    E = np.array([model.energy(q[k], qd[k]) for k in range(len(t))])
    P_damp = np.array([(model.Q(q[k], qd[k]) - model.Q(q[k], np.zeros(model.n))) @ qd[k] for k in range(len(t))])
    P = np.sum(res.tau * qd[:, list(res.imposed)], axis=1) + P_damp
    dE = np.gradient(E, t, edge_order=2)
    return float(np.max(np.abs(dE - P)[2:-2])), float(np.max(np.abs(P)))


@pytest.fixture(scope="module")
def fourbar() -> tuple[Model, np.ndarray, np.ndarray]:
    model = ID.imposed_model(load_mechanism(FOURBAR), [4], (0.0, -G_ADAMS))
    t, x = read_trajectory(TRAJECTORY, 1)
    return model, t, x


@pytest.fixture(scope="module")
def fourbar_result(fourbar) -> ID.InverseDynamicsResult:
    model, t, x = fourbar
    return ID.inverse_dynamics(model, t, x, method="model")


# ---------------------------------------------------------------------------------------- derivatives
def test_derivatives_equal_savgol_on_uniform_samples() -> None:
    rng = np.random.default_rng(3)
    t = 0.01 * np.arange(200)
    x = np.column_stack([np.sin(3 * t) + 1e-3 * rng.standard_normal(200), np.cumsum(rng.standard_normal(200))])
    xd, xdd = ID.local_polynomial_derivatives(t, x, window=21, order=5)
    for d, ours in ((1, xd), (2, xdd)):
        ref = savgol_filter(x, 21, 5, deriv=d, delta=0.01, axis=0, mode="interp")
        np.testing.assert_allclose(ours, ref, rtol=1e-7, atol=1e-7 * np.abs(ref).max())


def test_derivatives_exact_for_polynomials_on_nonuniform_samples() -> None:
    rng = np.random.default_rng(4)
    t = np.cumsum(rng.uniform(0.5e-3, 1.5e-3, 300))
    c = np.array([0.3, -2.0, 1.5, 4.0, -3.0, 2.0])  # degree 5 = ORDER: fitted exactly
    x = np.polynomial.polynomial.polyval(t, c)
    xd, xdd = ID.local_polynomial_derivatives(t, x)
    dc = np.polynomial.polynomial.polyder(c)
    np.testing.assert_allclose(xd[:, 0], np.polynomial.polynomial.polyval(t, dc), rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(xdd[:, 0], np.polynomial.polynomial.polyval(t, np.polynomial.polynomial.polyder(dc)),
                               rtol=1e-6, atol=1e-6)


def test_derivatives_of_the_mbse_trajectory_match_the_analytic_ones(fourbar) -> None:
    """The file holds θ = 1.2 (1 − cos 2t) with 8 significant digits (5 ms steps)."""
    _, t, x = fourbar
    xd, xdd = ID.local_polynomial_derivatives(t, x)
    e1 = xd[:, 0] - 2.4 * np.sin(2 * t)
    e2 = xdd[:, 0] - 4.8 * np.cos(2 * t)
    print(f"trajectory derivatives: RMS error {np.sqrt(np.mean(e1**2)):.2e} rad/s, {np.sqrt(np.mean(e2**2)):.2e} rad/s²")
    assert np.sqrt(np.mean(e1**2)) < 2e-6 and np.sqrt(np.mean(e2**2)) < 1e-4
    assert np.abs(e2).max() < 5e-4


# ---------------------------------------------------------------------------------------- Adams
def test_crank_torque_matches_msc_adams(fourbar_result: ID.InverseDynamicsResult) -> None:
    adams = np.loadtxt(ADAMS, comments="%")
    np.testing.assert_array_equal(adams[:, 0], fourbar_result.t)
    err = fourbar_result.reaction[:, 0] - adams[:, 1]  # Adams gives the reaction μ = −τ
    rmse, peak = float(np.sqrt(np.mean(err**2))), float(np.abs(adams[:, 1]).max())
    print(f"Adams: crank torque RMSE {rmse:.4g} N·m = {100 * rmse / peak:.4f} % of the peak {peak:.4g} N·m, "
          f"max error {np.abs(err).max():.4g} N·m")
    assert rmse <= 1e-3 * peak
    # the prescribed motion is followed (Adams' column 3 is the actual angle in degrees)
    np.testing.assert_allclose(np.degrees(fourbar_result.q[:, 4]), adams[:, 2], atol=1e-3)


def test_constraints_hold_along_the_fourbar_solution(fourbar, fourbar_result) -> None:
    model = fourbar[0]
    r = fourbar_result
    for k in range(0, len(r.t), 50):
        assert np.abs(model.Phi(r.q[k])).max() < 1e-10
        assert np.abs(model.Phi_q(r.q[k]) @ r.qd[k]).max() < 1e-10
        assert np.abs(model.Phi_q(r.q[k]) @ r.qdd[k] - model.gamma(r.q[k], r.qd[k])).max() < 1e-9
        # the computed force reproduces the accelerations through the model's forward dynamics
        tau = np.zeros(model.n)
        tau[4] = r.tau[k, 0]
        np.testing.assert_allclose(model.forward_dynamics(r.q[k], r.qd[k], tau), r.qdd[k], atol=1e-9)


# ---------------------------------------------------------------------------------------- factor graph
@pytest.mark.slow
def test_factor_graph_agrees_with_the_model_method_on_the_fourbar(fourbar) -> None:
    model, t, x = fourbar
    t, x = t[:400], x[:400]  # 2 s of the Adams experiment (the whole 10 s takes ~1 min)
    rm = ID.inverse_dynamics(model, t, x, method="model")
    rf = ID.inverse_dynamics(model, t, x, method="fg")
    rel = np.abs(rf.tau - rm.tau).max() / np.abs(rm.tau).max()
    print(f"fg vs model, four-bar: max |Δτ| / max |τ| = {rel:.2e}; run times {rm.info['run_time_s']:.2f} s (model), "
          f"{rf.info['run_time_s']:.2f} s (fg); {rf.info}")
    assert rel <= 1e-6
    np.testing.assert_allclose(rf.q, rm.q, atol=1e-8)
    np.testing.assert_allclose(rf.qd, rm.qd, atol=1e-7)
    np.testing.assert_allclose(rf.qdd, rm.qdd, atol=1e-6 * np.abs(rm.qdd).max())


MECHS = [(FOURBAR, [4]), (ROBOT, [20, 21])] + [(p, None) for p in SHIPPED]


def _imposed(path: Path, imposed: list[int] | None) -> Model:
    mech = load_mechanism(path)
    return ID.imposed_model(mech, imposed if imposed is not None else [d.coordinate for d in mech.dofs])


@pytest.mark.parametrize("path,imposed", MECHS, ids=[p.stem for p, _ in MECHS])
def test_factor_jacobians_match_finite_differences(path: Path, imposed: list[int] | None) -> None:
    model = _imposed(path, imposed)
    rng = np.random.default_rng(5)
    # off the constraint manifold: the factor graph evaluates its factors there while it iterates
    q = model.q0 + 1e-3 * rng.standard_normal(model.n)
    values = {"q": q, "v": rng.standard_normal(model.n), "a": rng.standard_normal(model.n),
              "l": rng.standard_normal(model.m), "f": rng.standard_normal(model.g)}
    cases = [(res, kinds, ()) for res, kinds, _ in ID.RESIDUALS.values()]
    cases.append((ID.res_imposed, ("a",), (rng.standard_normal(model.g),)))
    for res, kinds, extra in cases:
        args = [values[k] for k in kinds]
        e, J = res(model, *args, *extra)
        e_only, none = res(model, *args, *extra, jac=False)
        assert none is None
        np.testing.assert_array_equal(e, e_only)
        for i in range(len(kinds)):
            def f(xi: np.ndarray, i: int = i) -> np.ndarray:
                a = list(args)
                a[i] = xi
                return res(model, *a, *extra, jac=False)[0]

            np.testing.assert_allclose(J[i], fd_jac(f, args[i]), atol=2e-6 * max(1.0, np.abs(J[i]).max()),
                                       err_msg=f"{res.__name__} d/d{kinds[i]}")


def test_custom_factor_linearization_is_the_residual_jacobian() -> None:
    """What gtsam sees: the CustomFactor's linearisation holds the residual and its Jacobians."""
    model = _imposed(ROBOT, [20, 21])
    rng = np.random.default_rng(6)
    vals = [model.q0 + 1e-3 * rng.standard_normal(model.n), rng.standard_normal(model.n),
            rng.standard_normal(model.n), rng.standard_normal(model.m), rng.standard_normal(model.g)]
    keys = [gtsam.symbol(c, 0) for c in "qvalf"]
    values = gtsam.Values()
    for key, v in zip(keys, vals, strict=False):
        values.insert(key, v)
    factor = ID.custom_factor(model, ID.res_dynamics, keys, model.n, 1.0)
    lin = factor.linearize(values)
    e, J = ID.res_dynamics(model, *vals)
    A, b = lin.jacobian()
    np.testing.assert_allclose(A, np.hstack(J), atol=1e-12)
    np.testing.assert_allclose(b, -e, atol=1e-12)


# ---------------------------------------------------------------------------------------- robot
def _forward_simulate(model: Model, res: ID.InverseDynamicsResult) -> np.ndarray:
    """Integrate the free mechanism driven by τ(t) (cubic spline through the computed samples) from the
    first sample's state; independent-coordinate dynamics (RᵀMR) z̈ = Rᵀ(Q + τ − M q̈_c) — the R-matrix
    formulation, not the multipliers the inverse dynamics used.  Returns z at the samples."""
    spline = CubicSpline(res.t, res.tau)
    hint = [res.q[0].copy()]
    g = model.g

    def rhs(t: float, s: np.ndarray) -> np.ndarray:
        q = model.solve_position(hint[0], s[:g])
        hint[0] = q
        qd = model.solve_velocity(q, s[g:])
        tau = np.zeros(model.n)
        tau[model.dof] = spline(t)
        R = model.R(q)
        qdd_c = model.solve_acceleration(q, qd, np.zeros(g))
        zdd = np.linalg.solve(R.T @ model.M @ R, R.T @ (model.Q(q, qd, tau) - model.M @ qdd_c))
        return np.concatenate([s[g:], zdd])

    s0 = np.concatenate([res.q[0, model.dof], res.qd[0, model.dof]])
    sol = solve_ivp(rhs, (res.t[0], res.t[-1]), s0, t_eval=res.t, method="DOP853", rtol=1e-10, atol=1e-12)
    assert sol.success
    return sol.y[:g].T


@pytest.mark.slow
def test_pick_and_place_robot_torques_reproduce_the_motion() -> None:
    """Two imposed coordinates (the motor angles q[20], q[21]); one of the file's 21 constraint rows is
    redundant (the parallelograms) and the model keeps the 20 independent ones."""
    model = _imposed(ROBOT, [20, 21])
    assert model.m == 20 and len(model.redundant) == 1
    t, x = smooth_trajectory(model, [0.3, -0.25], 1.0, 0.002)
    res = ID.inverse_dynamics(model, t, x)
    z = _forward_simulate(model, res)
    err = np.abs(z - x).max()
    p_err, p_max = power_balance_error(model, res)
    print(f"robot: peak |τ| {np.abs(res.tau).max(axis=0)} N·m, forward-simulation error {err:.2e} rad, "
          f"power balance error {p_err:.3g} W of {p_max:.3g} W; run time {res.info['run_time_s']:.2f} s")
    assert err < 1e-4
    assert p_err < 2e-3 * p_max


@pytest.mark.slow
def test_pick_and_place_robot_factor_graph_agrees() -> None:
    model = _imposed(ROBOT, [20, 21])
    t, x = smooth_trajectory(model, [0.3, -0.25], 0.5, 0.005)
    rm = ID.inverse_dynamics(model, t, x, method="model")
    rf = ID.inverse_dynamics(model, t, x, method="fg")
    rel = np.abs(rf.tau - rm.tau).max() / np.abs(rm.tau).max()
    print(f"fg vs model, robot: {rel:.2e}; run times {rm.info['run_time_s']:.2f} s, {rf.info['run_time_s']:.2f} s")
    assert rel <= 1e-6


# ---------------------------------------------------------------------------------------- shipped
@pytest.mark.slow
@pytest.mark.parametrize("path", SHIPPED, ids=[p.stem for p in SHIPPED])
def test_shipped_mechanisms_power_balance_and_methods_agree(path: Path) -> None:
    model = _imposed(path, None)
    t, x = smooth_trajectory(model, [1.0], 2.0, 0.002)
    res = ID.inverse_dynamics(model, t, x)
    p_err, p_max = power_balance_error(model, res)
    print(f"{path.stem}: peak |τ| {np.abs(res.tau).max():.4g}, power balance error {p_err:.3g} W of {p_max:.3g} W")
    assert p_err < 1e-3 * p_max
    rf = ID.inverse_dynamics(model, t[:150], x[:150], method="fg")
    rm = ID.inverse_dynamics(model, t[:150], x[:150], method="model")
    assert np.abs(rf.tau - rm.tau).max() <= 1e-6 * np.abs(rm.tau).max()


# ---------------------------------------------------------------------------------------- errors
def test_imposed_coordinates_are_checked() -> None:
    mech = load_mechanism(FOURBAR)
    with pytest.raises(UserError, match=r"index 5 out of range: q has 5 coordinates, 0..4 \(0=x1"):
        ID.imposed_model(mech, [5])
    with pytest.raises(UserError, match="1 degree\\(s\\) of freedom, but 2"):
        ID.imposed_model(mech, [4, 0])
    with pytest.raises(UserError, match="repeat"):
        ID.imposed_model(load_mechanism(ROBOT), [20, 20])


def test_trajectory_out_of_reach_names_the_sample() -> None:
    """Pushing the slider-crank's piston (x2 imposed) beyond crank + rod = 0.25 m: no assembly."""
    model = ID.imposed_model(load_mechanism(config_dir() / "mechanisms" / "slider-crank.yaml"), [2])
    t = 0.01 * np.arange(200)
    x = model.q0[2] + (0.26 - model.q0[2]) * t[:, None] / t[-1]
    with pytest.raises(UserError, match=r"sample 1\d\d \(t = 1\.\d+ s\): .*slider-crank.yaml: position problem"):
        ID.inverse_dynamics(model, t, x)


# ---------------------------------------------------------------------------------------- CLI
def _cli(*args: str) -> subprocess.CompletedProcess:
    """``rigstate inverse-dynamics ARGS`` (in this process: helpers.run_main)."""
    return run_main("inverse-dynamics", *args)


def test_cli_writes_forces_and_states(tmp_path: Path, fourbar_result: ID.InverseDynamicsResult) -> None:
    out = tmp_path / "F.csv"
    p = _cli("--mechanism", str(FOURBAR), "--trajectory", str(TRAJECTORY), "--imposed", "[ 4 ]",
             "--gravity", str(G_ADAMS), "--out", str(out), "--states")
    assert p.returncode == 0, p.stderr
    assert "wrote" in p.stdout
    with open(out, newline="") as fh:
        rows = list(csv.reader(fh))
    names = ["x1", "y1", "x2", "y2", "a0"]
    assert rows[0] == ["t", "tau_4"] + [f"{p}_{n}" for p in ("q", "qd", "qdd") for n in names]
    data = np.array(rows[1:], dtype=float)
    assert data.shape == (2000, 17)
    np.testing.assert_allclose(data[:, 1], fourbar_result.tau[:, 0], rtol=1e-10, atol=1e-9)
    np.testing.assert_allclose(data[:, 2:7], fourbar_result.q, atol=1e-11)
    adams = np.loadtxt(ADAMS, comments="%")
    assert np.sqrt(np.mean((-data[:, 1] - adams[:, 1]) ** 2)) <= 1e-3 * np.abs(adams[:, 1]).max()


def test_cli_gravity_defaults_to_the_file(tmp_path: Path, fourbar_result: ID.InverseDynamicsResult) -> None:
    """Without --gravity, the file's default (0, −9.81): the static part of the torque scales with g."""
    short = tmp_path / "T.txt"
    short.write_text("# t theta\n" + "".join(TRAJECTORY.read_text().splitlines(keepends=True)[1:61]))
    out = tmp_path / "F.csv"
    p = _cli("--mechanism", str(FOURBAR), "--trajectory", str(short), "--imposed", "4", "--out", str(out))
    assert p.returncode == 0, p.stderr
    tau = np.loadtxt(out, delimiter=",", skiprows=1)[:, 1]
    model = ID.imposed_model(load_mechanism(FOURBAR), [4])
    assert tuple(model.gravity) == (0.0, -9.81)
    t, x = read_trajectory(short, 1)
    np.testing.assert_allclose(tau, ID.inverse_dynamics(model, t, x).tau[:, 0], rtol=1e-10)
    assert np.abs(tau - fourbar_result.tau[:60, 0]).max() > 0.01  # differs from the 9.80665 result


@pytest.mark.parametrize("case,expect", [
    ("bad_value", "T.txt: line 3: '1.2.3' is not a finite number"),
    ("columns", "T.txt: line 2: expected 2 columns (time and 1 imposed coordinate(s)), got 3"),
    ("time", "T.txt: line 3: time 0.0 s is not after the previous sample's 0 s"),
    ("index", "imposed coordinate index 7 out of range: q has 5 coordinates"),
    ("imposed_text", "--imposed: 'a' is not a coordinate index"),
    ("count", "1 degree(s) of freedom, but 2 coordinate(s) are imposed"),
    ("window", "fewer than the --window of 31"),
    ("gravity", "--gravity: expected a magnitude G or GX,GY in m/s², got '1,2,3'"),
    ("missing", "nope.txt: cannot read"),
])
def test_cli_bad_input_exits_2_with_file_line_and_value(tmp_path: Path, case: str, expect: str) -> None:
    traj = tmp_path / "T.txt"
    good = "% t theta\n0 0\n0.005 1e-4\n"
    traj.write_text({"bad_value": "% t theta\n0 0\n0.005 1.2.3\n", "columns": "% x\n0 0 1\n",
                     "time": "# x\n0 0\n0.0 0.1\n"}.get(case, good))
    args = {"index": ["--imposed", "7"], "imposed_text": ["--imposed", "4,a"], "count": ["--imposed", "4,0"],
            "gravity": ["--imposed", "4", "--gravity", "1,2,3"]}.get(case, ["--imposed", "4"])
    path = str(tmp_path / "nope.txt") if case == "missing" else str(traj)
    p = _cli("--mechanism", str(FOURBAR), "--trajectory", path, "--out", str(tmp_path / "F.csv"), *args)
    assert p.returncode == 2, (p.stdout, p.stderr)
    assert expect in p.stderr
    assert "Traceback" not in p.stderr
    assert not (tmp_path / "F.csv").exists()

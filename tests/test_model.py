"""Kinematics and dynamics of estimator_service.model: Jacobians vs finite differences, assembly,
kinematic problems, consistency of the two forward-dynamics formulations, energy."""

from __future__ import annotations

import math

from pathlib import Path

import numpy as np
import pytest
from scipy.integrate import solve_ivp

from estimator_service.mechanism import Damper, load_mechanism
from estimator_service.model import AssemblyError, Model
from estimator_service.paths import config_dir

from helpers import fd_jac, MBSE

SENSORS2016 = config_dir() / "mechanisms" / "fourbar-sensors2016.yaml"


@pytest.fixture(scope="module")
def damped() -> Model:
    """Sensors-2016 testbed with joint dampers, so the damping Jacobians are exercised."""
    mech = load_mechanism(SENSORS2016)
    mech.dampers = [Damper(0, None, 0.3), Damper(1, 2, 0.2)]
    return Model(mech)


def _state(model: Model, crank: float, rate: float, rng: np.random.Generator, off: float = 1e-3):
    q = model.solve_position(model.q0, np.array([crank]))
    qd = model.solve_velocity(q, np.array([rate]))
    # off-manifold perturbation: the factor graph evaluates everything away from Φ = 0 too
    return q, qd, q + off * rng.standard_normal(model.n), qd + 0.1 * rng.standard_normal(model.n)


@pytest.mark.parametrize("crank", [0.3, 1.2, 2.0, 4.0])
def test_constraint_jacobians_match_finite_differences(damped: Model, crank: float) -> None:
    m, rng = damped, np.random.default_rng(1)
    _, _, qp, qdp = _state(m, crank, 1.5, rng)
    v = rng.standard_normal(m.n)
    lam = rng.standard_normal(m.m)
    np.testing.assert_allclose(m.Phi_q(qp), fd_jac(m.Phi, qp), atol=1e-8)
    np.testing.assert_allclose(m.hess_contract(qp, v), fd_jac(lambda x: m.Phi_q(x) @ v, qp), atol=1e-8)
    np.testing.assert_allclose(m.dPhiq_qd_dq(qp, qdp), fd_jac(lambda x: m.Phi_q(x) @ qdp, qp), atol=1e-8)
    np.testing.assert_allclose(m.lambda_hessian(qp, lam), fd_jac(lambda x: m.Phi_q(x).T @ lam, qp), atol=1e-8)
    g_q, g_qd = m.gamma_jac(qp, qdp)
    np.testing.assert_allclose(g_q, fd_jac(lambda x: m.gamma(x, qdp), qp), atol=1e-7)
    np.testing.assert_allclose(g_qd, fd_jac(lambda x: m.gamma(qp, x), qdp), atol=1e-7)


@pytest.mark.parametrize("crank", [0.3, 2.0, 4.0])
def test_dynamics_jacobians_match_finite_differences(damped: Model, crank: float) -> None:
    m, rng = damped, np.random.default_rng(2)
    q, qd, qp, qdp = _state(m, crank, 2.0, rng)
    Q_q, Q_qd = m.Q_jac(qp, qdp)
    np.testing.assert_allclose(Q_q, fd_jac(lambda x: m.Q(x, qdp), qp), atol=1e-7)
    np.testing.assert_allclose(Q_qd, fd_jac(lambda x: m.Q(qp, x), qdp), atol=1e-7)
    qdd, d_q, d_qd = m.forward_dynamics_jac(qp, qdp)
    np.testing.assert_allclose(qdd, m.forward_dynamics(qp, qdp), rtol=1e-10, atol=1e-10)
    scale = max(1.0, np.abs(d_q).max())
    np.testing.assert_allclose(d_q / scale, fd_jac(lambda x: m.forward_dynamics(x, qdp), qp) / scale, atol=1e-6)
    np.testing.assert_allclose(d_qd, fd_jac(lambda x: m.forward_dynamics(qp, x), qdp), atol=1e-6)
    # independent coordinates: z -> q(z) by the position problem, zd -> R zd
    zdd, dz, dzd = m.zdd_jac(q, qd)

    def zdd_of(x: np.ndarray) -> np.ndarray:
        qq = m.solve_position(q, x[: m.g])
        return m.zdd(qq, m.solve_velocity(qq, x[m.g :]))

    J = fd_jac(zdd_of, np.concatenate([q[m.dof], qd[m.dof]]), eps=1e-6)
    np.testing.assert_allclose(zdd, zdd_of(np.concatenate([q[m.dof], qd[m.dof]])), rtol=1e-9)
    np.testing.assert_allclose(np.hstack([dz, dzd]), J, rtol=1e-5, atol=1e-6)


def test_body_and_point_kinematics(damped: Model) -> None:
    m, rng = damped, np.random.default_rng(3)
    q, qd, qp, qdp = _state(m, 0.8, 1.7, rng)
    for b in range(len(m.mech.bodies)):
        w, w_q, w_qd = m.body_rate(q, qd, b)
        _, phi_q = m.body_angle(q, b)
        assert w == pytest.approx(float(phi_q @ qd), abs=1e-9)  # ω = dφ/dt on the manifold
        np.testing.assert_allclose(m.body_rate(qp, qdp, b)[1], fd_jac(lambda x: m.body_rate(x, qdp, b)[0], qp)[0], atol=1e-8)
        np.testing.assert_allclose(m.body_rate(qp, qdp, b)[2], fd_jac(lambda x: m.body_rate(qp, x, b)[0], qdp)[0], atol=1e-8)
        np.testing.assert_allclose(m.body_angle(qp, b)[1], fd_jac(lambda x: m.body_angle(x, b)[0], qp)[0], atol=1e-7)
    # crank: rotating at rate w, crank body angle equals theta1
    crank = m.body_index("crank")
    assert m.body_angle(q, crank)[0] == pytest.approx(0.8)
    assert m.body_rate(q, qd, crank)[0] == pytest.approx(1.7)
    # point position: the coupler's own points are reproduced by their local coordinates
    coupler = m.body_index("coupler")
    r1, _ = m.point_position(q, coupler, (0.0, 0.0))
    r2, _ = m.point_position(q, coupler, (0.540, 0.0))
    np.testing.assert_allclose(np.linalg.norm(r2 - r1), 0.540, rtol=1e-9)
    np.testing.assert_allclose(r2, q[[m.coord_names.index("x2"), m.coord_names.index("y2")]], atol=1e-12)
    _, dr = m.point_position(qp, coupler, (0.3, 0.1))
    np.testing.assert_allclose(dr, fd_jac(lambda x: m.point_position(x, coupler, (0.3, 0.1))[0], qp), atol=1e-9)


def test_kinematic_problems_and_branch(damped: Model) -> None:
    m = damped
    q = m.solve_position(m.q0, np.array([np.pi / 2]))
    assert np.abs(m.Phi(q)).max() < 1e-10
    assert q[m.coord_names.index("y2")] > 0  # assembly keeps point 2 above the ground line
    qd = m.solve_velocity(q, np.array([1.0]))
    np.testing.assert_allclose(m.Phi_q(q) @ qd, 0, atol=1e-12)
    np.testing.assert_allclose(m.R(q)[:, 0], qd, atol=1e-12)
    qdd = m.solve_acceleration(q, qd, np.array([0.5]))
    np.testing.assert_allclose(m.Phi_q(q) @ qdd, m.gamma(q, qd), atol=1e-12)
    # the KKT forward dynamics and the R-matrix equations agree: R^T (M qdd - Q) = 0
    qdd = m.forward_dynamics(q, qd)
    R = m.R(q)
    np.testing.assert_allclose(R.T @ (m.M @ qdd - m.Q(q, qd)), 0, atol=1e-9)
    np.testing.assert_allclose(m.Phi_q(q) @ qdd, m.gamma(q, qd), atol=1e-9)
    # continuing along a trajectory keeps the branch
    for crank in np.linspace(np.pi / 2, 2.5 * np.pi, 40):
        q = m.solve_position(q, np.array([crank]))
        assert q[m.coord_names.index("y2")] > 0


def test_mass_matrix_reproduces_kinetic_energy_of_a_spinning_crank() -> None:
    m = Model(load_mechanism(SENSORS2016))
    q = m.solve_position(m.q0, np.array([0.3]))
    # Move only the crank (others fixed is impossible), so compare the crank body's own term:
    crank = m.mech.bodies[m.body_index("crank")]
    qd = m.solve_velocity(q, np.array([2.0]))
    T = 0.5 * qd @ m.M @ qd
    assert T > 0.5 * crank.I0 * 2.0**2  # the crank alone contributes I_A ω²/2, the rest adds
    assert np.allclose(m.M, m.M.T)


def test_energy_is_conserved_without_damping() -> None:
    """Frictionless motion integrated accurately in independent coordinates conserves energy."""
    m = Model(load_mechanism(SENSORS2016))
    q_ref = [m.solve_position(m.q0, np.array([np.pi / 2]))]

    def rhs(_t: float, x: np.ndarray) -> np.ndarray:
        q = m.solve_position(q_ref[0], x[:1])
        q_ref[0] = q
        return np.concatenate([x[1:], m.zdd(q, m.solve_velocity(q, x[1:]))])

    sol = solve_ivp(rhs, (0, 2.0), [np.pi / 2, 0.0], method="DOP853", rtol=1e-11, atol=1e-12, dense_output=True)
    q = m.solve_position(m.q0, np.array([np.pi / 2]))
    E0 = m.energy(q, np.zeros(m.n))
    drift = 0.0
    for t in np.linspace(0, 2.0, 50):
        z = sol.sol(t)
        q = m.solve_position(q, z[:1])
        drift = max(drift, abs(m.energy(q, m.solve_velocity(q, z[1:])) - E0))
    assert drift / abs(E0) < 1e-7


@pytest.mark.parametrize("name", ["fourbars1.yaml", "fourbars1-with-rel-angle.yaml", "pendulum1.yaml",
                                  "pendulum2.yaml", "pendulum3.yaml", "pick-and-place-robot.yaml"])
def test_mbse_models_assemble(name: str) -> None:
    m = Model(load_mechanism(MBSE / name))
    assert np.abs(m.Phi(m.q0)).max() < 1e-9
    assert m.g >= 1 and m.n - m.g <= m.m
    qd = m.solve_velocity(m.q0, np.ones(m.g))
    qdd = m.forward_dynamics(m.q0, qd)
    assert np.all(np.isfinite(qdd))
    np.testing.assert_allclose(m.Phi_q(m.q0) @ qdd, m.gamma(m.q0, qd), atol=1e-8)


def test_dof_counts_of_mbse_models() -> None:
    assert Model(load_mechanism(MBSE / "fourbars1.yaml")).g == 1
    assert Model(load_mechanism(MBSE / "pendulum1.yaml")).g == 1
    assert Model(load_mechanism(MBSE / "pick-and-place-robot.yaml")).g == 2


def test_unassemblable_mechanism_raises_clear_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "points:\n  - {x: 0, y: 0, fixed: true}\n  - {x: 1, y: 0}\n  - {x: 5, y: 0, fixed: true}\n"
        "planar_bodies:\n  - {points: [0, 1], length: 1, mass: 1, I0: 1, cog: [0.5, 0]}\n"
        "  - {points: [1, 2], length: 1, mass: 1, I0: 1, cog: [0.5, 0]}\n"
    )
    with pytest.raises(AssemblyError, match="bad.yaml"):
        Model(load_mechanism(bad))


def test_a_large_jump_of_the_dof_keeps_the_branch_and_the_angle_coordinate() -> None:
    """One Newton solve over a large change of the crank angle may land on the mirrored root of a
    relative-angle row (its x-form fixes only x); the solver continues in steps and stays consistent."""
    m = Model(load_mechanism(config_dir() / "mechanisms" / "fourbar-sensors2016.yaml"))
    start = m.solve_position(m.q0, np.array([math.radians(-50.0)]))
    for target in (2.2519, -2.9, 3.0, math.radians(129.0)):
        q = m.solve_position(start, np.array([target]))
        stepped = start
        for z in np.linspace(float(start[m.dof][0]), target, 60)[1:]:
            stepped = m.solve_position(stepped, np.array([z]))
        np.testing.assert_allclose(q, stepped, atol=1e-9)
        crank_angle, _ = m.body_angle(q, m.body_index("crank"))
        assert math.cos(crank_angle - target) > 1 - 1e-9  # the points agree with the angle coordinate

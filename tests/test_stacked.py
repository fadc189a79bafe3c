"""The stacked model (estimator_service/stacked.py) against Model node by node: positions, rates, accelerations,
forward dynamics and the state Jacobians; guesses along a trajectory that keep the file's assembly branch."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from estimator_service.mechanism import Damper, load_mechanism
from estimator_service.model import Model
from estimator_service.paths import config_dir
from estimator_service.stacked import StackedModel, assembly_guesses

MECHANISMS = ["fourbars1.yaml", "fourbar-sensors2016.yaml", "slider-crank.yaml"]


def _model(mech_file: str) -> Model:
    """The shipped mechanism, with a damper on the first body when it has none (the damper terms exercised)."""
    mech = load_mechanism(config_dir() / "mechanisms" / mech_file)
    return Model(mech if mech.dampers else replace(mech, dampers=[Damper(0, None, 0.3)]))


def _sequential(m: Model, Z: np.ndarray) -> np.ndarray:
    """Model.solve_position at each node from the previous solution (the reference path)."""
    qs, q = [], m.q0.copy()
    for z in Z:
        q = m.solve_position(q, z)
        qs.append(q)
    return np.array(qs)


@pytest.mark.parametrize("mech_file", MECHANISMS)
def test_stacked_model_matches_model(mech_file: str) -> None:
    """Positions, rates, q̈ and all state Jacobians of the stacked evaluation equal Model's, node by node."""
    m = _model(mech_file)
    sm = StackedModel(m)
    rng = np.random.default_rng(1)
    Z = m.q0[m.dof] + np.cumsum(rng.uniform(-0.05, 0.05, (12, m.g)), axis=0)
    Zd = rng.uniform(-3, 3, (12, m.g))
    q_ref = _sequential(m, Z)
    q_st = sm.solve_position(q_ref + 1e-4 * rng.standard_normal(q_ref.shape), Z)
    np.testing.assert_allclose(q_st, q_ref, atol=1e-10)
    st = sm.evaluate(q_st, Zd)
    for k in range(len(Z)):
        qd = m.solve_velocity(q_ref[k], Zd[k])
        j = m.state_jacobians(q_ref[k], qd)
        np.testing.assert_allclose(st["qd"][k], qd, atol=1e-10)
        np.testing.assert_allclose(st["R"][k], j.R, atol=1e-10)
        np.testing.assert_allclose(st["dqd_dz"][k], j.dqd_dz, atol=1e-9)
        np.testing.assert_allclose(st["qdd"][k], j.qdd, rtol=1e-9, atol=1e-9)
        np.testing.assert_allclose(st["dqdd_dz"][k], j.dqdd_dq @ j.R + j.dqdd_dqd @ j.dqd_dz, rtol=1e-8, atol=1e-8)
        np.testing.assert_allclose(st["dqdd_dzd"][k], j.dqdd_dqd @ j.R, rtol=1e-8, atol=1e-8)
        for b in range(len(m.mech.bodies)):
            w, w_q, w_qd = m.body_rate(q_ref[k], qd, b)
            ws, ws_z, ws_zd = sm.body_rate(st, b)
            assert ws[k] == pytest.approx(w, abs=1e-8)
            np.testing.assert_allclose(ws_z[k], w_q @ j.R + w_qd @ j.dqd_dz, atol=1e-8)
            np.testing.assert_allclose(ws_zd[k], w_qd @ j.R, atol=1e-8)


@pytest.mark.parametrize("mech_file", MECHANISMS)
def test_a_trajectorys_kinematics_and_dynamics_are_models_node_by_node(mech_file: str) -> None:
    """Along two turns of the crank and back (far beyond one Newton step from the file's assembly): the guesses of
    assembly_guesses solved at once are Model's sequential positions (the same assembly branch at every node), and
    the stacked q̇, q̈ of given ż, z̈, γ and the unforced forward dynamics are Model's."""
    m = _model(mech_file)
    sm = StackedModel(m)
    rng = np.random.default_rng(4)
    s = np.linspace(0.0, 1.0, 400)
    Z = m.q0[m.dof] + 4 * np.pi * np.sin(np.pi * s)[:, None] * np.ones((1, m.g))
    Zd, Zdd = rng.uniform(-3, 3, Z.shape), rng.uniform(-20, 20, Z.shape)
    q_ref = _sequential(m, Z)
    q = sm.solve_position(assembly_guesses(m, Z), Z)
    np.testing.assert_allclose(q, q_ref, atol=1e-10)
    qd, qdd_free = sm.velocities(q, Zd), sm.forward_dynamics(q, sm.velocities(q, Zd))
    qdd = sm.accelerations(q, qd, Zdd)
    gam = sm.gamma(q, qd)
    for k in range(0, len(Z), 7):
        qd_ref = m.solve_velocity(q_ref[k], Zd[k])
        np.testing.assert_allclose(qd[k], qd_ref, atol=1e-9)
        np.testing.assert_allclose(gam[k], m.gamma(q_ref[k], qd_ref), rtol=1e-9, atol=1e-9)
        np.testing.assert_allclose(qdd[k], m.solve_acceleration(q_ref[k], qd_ref, Zdd[k]), rtol=1e-9, atol=1e-8)
        np.testing.assert_allclose(qdd_free[k], m.forward_dynamics(q_ref[k], qd_ref), rtol=1e-9, atol=1e-8)
    assert np.max(np.abs(sm.phi(q))) < 1e-10  # (and the constraints hold)

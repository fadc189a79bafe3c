"""Driven DOFs (``[[drive]]``): a motor imposes the DOF's motion; the model leaves its acceleration to the
drive and every backend carries the drive's unknown acceleration as process noise."""

from __future__ import annotations

import numpy as np
import pytest

from estimator_service.errors import ConfigError
from estimator_service.mechanism import parse_mechanism
from estimator_service.model import Model
from estimator_service.rig import DRIVE_ACCEL_DENSITY, load_rig_text
from conftest import config_dir

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
    ('[[drive]]\ndof = "shaft"\ninput = "servo"', "r.toml: drive[0].input: expected one of ['unknown'], got 'servo'"),
    ('[[drive]]\ndof = "shaft"\n[[drive]]\ndof = "shaft"', "r.toml: drive[1].dof: dof 'shaft' has a [[drive]] already"),
    ('[[drive]]\ndof = "shaft"\ntorque = 1', "r.toml: drive[0].torque: unknown key"),
])
def test_a_wrong_drive_is_an_error_naming_the_field_and_value(table, message):
    yaml = (config_dir() / "mechanisms" / "shaft.yaml").read_text()
    with pytest.raises(ConfigError) as exc:
        load_rig_text(_shaft_rig(table), yaml, "r.toml")
    assert str(exc.value).startswith(message)

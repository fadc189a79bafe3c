"""Mechanism YAML loading: the mbse reference files, the shipped mechanisms, extensions, errors."""

from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from estimator_service.errors import ConfigError
from estimator_service.expr import ExprError, evaluate
from estimator_service.mechanism import load_mechanism, parse_mechanism
from estimator_service.model import Model
from estimator_service.paths import config_dir

from conftest import MBSE

# expected q of each mbse file: x, y of non-fixed points in order, then relative coordinates
MBSE_Q = {
    "fourbars1.yaml": ["x1", "y1", "x2", "y2"],
    "fourbars1-with-rel-angle.yaml": ["x1", "y1", "x2", "y2", "a0"],
    "pendulum1.yaml": ["x1", "y1"],
    "pendulum2.yaml": ["x1", "y1", "x2", "y2", "x3", "y3", "x4", "y4", "x5", "y5"],
    "pendulum3.yaml": [f"{c}{i}" for i in range(1, 7) for c in "xy"],
    "pick-and-place-robot.yaml": [f"{c}{i}" for i in range(2, 12) for c in "xy"] + ["a0", "a1"],
}


@pytest.mark.parametrize("name", sorted(MBSE_Q))
def test_mbse_files_load_unchanged_in_mbse_order(name: str) -> None:
    m = Model(load_mechanism(MBSE / name))
    assert m.coord_names == MBSE_Q[name]
    assert np.abs(m.Phi(m.q0)).max() < 1e-9


def test_mbse_body_details() -> None:
    mech = load_mechanism(MBSE / "pendulum2.yaml")
    ternary = mech.bodies[1]
    assert ternary.points == (1, 2, 3)
    assert set(ternary.lengths) == {(1, 2), (1, 3), (2, 3)}  # (0,1), (0,j), (1,j)
    # I0 = (1/2)*mass*length12^2 with length12 = 5
    assert ternary.I0 == pytest.approx(0.5 * 3.0 * 25.0)
    fb = load_mechanism(MBSE / "fourbars1.yaml")
    assert fb.bodies[2].lengths[(2, 3)] == pytest.approx(math.sqrt(13))  # length: auto
    assert fb.bodies[1].I0 == pytest.approx(2.0 * 4.0 / 3.0)


def test_expression_evaluator() -> None:
    assert evaluate("2^3^2") == 512.0  # right associative
    assert evaluate("-2^2") == -4.0
    assert evaluate("(1/3)*mass*length^2", {"mass": 3.0, "length": 2.0}) == pytest.approx(4.0)
    assert evaluate("5*cos(45*pi/180)") == pytest.approx(5 / math.sqrt(2))
    assert evaluate("deg2rad(180) + sqrt(4) + atan2(1, 1)") == pytest.approx(math.pi + 2 + math.pi / 4)
    assert evaluate("1.5e-3 * 2") == pytest.approx(3e-3)
    assert evaluate(7) == 7.0
    for bad, msg in [("L2*2", "undefined name 'L2'"), ("2 +", "end of expression"), ("(1", "end of expression"),
                     ("1 $ 2", "unexpected character"), ("sin(1, 2)", "takes 1"), ("1/0", "division by zero"),
                     ("__import__('os')", "unexpected character"), ("exp(1)", "undefined name 'exp'")]:
        with pytest.raises(ExprError, match=re.escape(msg)):
            evaluate(bad, {"L": 1.0})


def test_shipped_sensors2016_geometry() -> None:
    m = Model(load_mechanism(config_dir() / "mechanisms" / "fourbar-sensors2016.yaml"))
    assert m.coord_names == ["x1", "y1", "x2", "y2", "x3", "y3", "theta1", "theta2"]
    assert m.dof_names == ["crank"] and m.coord_names[m.dof[0]] == "theta1"
    q = m.q0
    p1, p2, p3 = q[0:2], q[2:4], q[4:6]
    assert np.linalg.norm(p1) == pytest.approx(0.120)
    assert np.linalg.norm(p2 - p1) == pytest.approx(0.540)
    assert np.linalg.norm(p3 - p1) == pytest.approx(0.384)
    assert np.linalg.norm(p3 - p2) == pytest.approx(0.212)
    assert np.linalg.norm(p2 - np.array([0.8, 0])) == pytest.approx(0.455)
    d, r = p2 - p1, p3 - p1
    assert d[0] * r[1] - d[1] * r[0] > 0  # point 3 left of 1 -> 2
    assert p2[1] > 0
    crank = m.mech.bodies[0]
    assert crank.I0 == pytest.approx(0.5 * 11.10 * 0.15**2) and crank.cog == (0.0, 0.0)
    coupler = m.mech.bodies[1]
    assert coupler.I0 == pytest.approx(0.40 * 0.54**2 / 12 + 0.40 * 0.27**2)


@pytest.mark.parametrize("name", ["fourbars1.yaml", "slider-crank.yaml", "fourbar-sensors2016.yaml"])
def test_shipped_mechanisms_assemble(name: str) -> None:
    m = Model(load_mechanism(config_dir() / "mechanisms" / name))
    assert "crank" in m.dof_names and m.g == 1
    assert np.abs(m.Phi(m.q0)).max() < 1e-12


def test_slider_keeps_point_on_its_line() -> None:
    m = Model(load_mechanism(config_dir() / "mechanisms" / "slider-crank.yaml"))
    for crank in np.linspace(0, 2 * np.pi, 13):
        q = m.solve_position(m.q0, np.array([crank]))
        assert q[m.coord_names.index("y2")] == pytest.approx(0.0, abs=1e-12)
        qd = m.solve_velocity(q, np.array([3.0]))
        assert qd[m.coord_names.index("y2")] == pytest.approx(0.0, abs=1e-12)
    assert len(m.mech.dampers) == 1 and m.mech.dampers[0].body_b is None


BASE = """
points:
  - {x: 0, y: 0, fixed: true}
  - {x: 1, y: 0}
planar_bodies:
  - {points: [0, 1], length: 1, mass: 1, I0: 1, cog: [0.5, 0]}
"""


@pytest.mark.parametrize("text, field, problem", [
    (BASE.replace("[0, 1]", "[0, 7]"), "planar_bodies[0].points", "unknown point index 7"),
    (BASE.replace("x: 1,", "x: L2*2,"), "points[1].x", "undefined name 'L2'"),
    (BASE.replace("mass: 1, ", ""), "planar_bodies[0]", "missing 'mass'"),
    (BASE.replace("[0, 1]", "[0]"), "planar_bodies[0].points", "2 or more"),
    (BASE + "dofs:\n  - {name: crank, coordinate: theta9}\n", "dofs[0].coordinate", "unknown coordinate 'theta9'"),
    (BASE + "bogus: 1\n", "bogus", "unknown top-level key"),
    (BASE + "dampers:\n  - {bodies: [nope, ground], c: 1}\n", "dampers[0].bodies[0]", "unknown body 'nope'"),
    ("points: [\n", "", "YAML syntax error: line"),
])
def test_errors_name_file_entry_and_problem(text: str, field: str, problem: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_mechanism(text, "my-rig.yaml")
    msg = str(info.value)
    assert msg.startswith("my-rig.yaml: ") and field in msg and problem in msg


def test_extensions_parse() -> None:
    text = BASE + """
gravity: [0, -9.8]
relative_coordinates:
  - {type: RelativeAngleAbsoluteDOF, points: [0, 1], name: theta}
dofs:
  - {name: swing, coordinate: theta}
named_points:
  tip: {point: 1}
  mid: {body: body0, at: [0.5, 0.1]}
dampers:
  - {bodies: [body0, ground], c: 0.5}
"""
    mech = parse_mechanism(text, "x.yaml")
    assert mech.gravity == (0.0, -9.8)
    assert [(d.name, d.coordinate) for d in mech.dofs] == [("swing", 2)]
    assert [(p.name, p.body, p.local) for p in mech.named_points] == [("tip", 0, (1.0, 0.0)), ("mid", 0, (0.5, 0.1))]
    assert mech.dampers[0].c == 0.5


def test_model_check_cli(tmp_path: Path) -> None:
    good = subprocess.run([sys.executable, "-m", "estimator_service.cli", "model", "check",
                           str(config_dir() / "mechanisms" / "fourbar-sensors2016.yaml")], capture_output=True, text=True)
    assert good.returncode == 0, good.stderr
    assert "theta1" in good.stdout and "DOF crank" in good.stdout and "degrees of freedom: 1" in good.stdout
    assert "assembly residual" in good.stdout
    bad = tmp_path / "bad.yaml"
    bad.write_text(BASE.replace("[0, 1]", "[0, 9]"))
    out = subprocess.run([sys.executable, "-m", "estimator_service.cli", "model", "check", str(bad)],
                         capture_output=True, text=True)
    assert out.returncode == 2
    assert "bad.yaml: planar_bodies[0].points: unknown point index 9" in out.stderr
    assert "Traceback" not in out.stderr

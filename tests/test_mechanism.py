"""Mechanism YAML loading: the mbse reference files, the shipped mechanisms, extensions, errors, and
``rigstate model check``."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from estimator_service.cli import main
from estimator_service.errors import ConfigError
from estimator_service.mechanism import load_mechanism, parse_mechanism
from estimator_service.model import Model
from estimator_service.paths import config_dir

from helpers import MBSE

MECHANISMS = config_dir() / "mechanisms"

# expected q of each mbse file: x, y of non-fixed points in order, then relative coordinates
MBSE_Q = {
    "fourbars1.yaml": ["x1", "y1", "x2", "y2"],
    "fourbars1-with-rel-angle.yaml": ["x1", "y1", "x2", "y2", "a0"],
    "pendulum1.yaml": ["x1", "y1"],
    "pendulum2.yaml": ["x1", "y1", "x2", "y2", "x3", "y3", "x4", "y4", "x5", "y5"],
    "pendulum3.yaml": [f"{c}{i}" for i in range(1, 7) for c in "xy"],
    "pick-and-place-robot.yaml": [f"{c}{i}" for i in range(2, 12) for c in "xy"] + ["a0", "a1"],
}


def test_every_mbse_file_is_covered() -> None:
    assert sorted(p.name for p in MBSE.glob("*.yaml")) == sorted(MBSE_Q)


@pytest.mark.parametrize("name", sorted(MBSE_Q))
def test_mbse_files_load_unchanged_in_mbse_order(name: str) -> None:
    mech = load_mechanism(MBSE / name)
    assert mech.coordinate_names() == MBSE_Q[name]
    m = Model(mech)
    assert m.n == len(MBSE_Q[name]) and m.coord_names == MBSE_Q[name]
    # one distance per 2-point body, 2n-3 per n-point body, one row per relative coordinate, less
    # the rows that overconstrained loops make redundant (the pick-and-place robot's parallelograms: one)
    rows = sum(2 * len(b.points) - 3 for b in mech.bodies) + len(mech.relative_coordinates)
    assert m.m + len(m.redundant) == rows and len(m.redundant) == (name == "pick-and-place-robot.yaml")
    assert np.abs(m.Phi(m.q0)).max() < 1e-9


def test_mbse_body_details() -> None:
    mech = load_mechanism(MBSE / "pendulum2.yaml")  # its ternary body has a `visual:` entry (mbse's, allowed)
    ternary = mech.bodies[1]
    assert ternary.name == "body1" and ternary.points == (1, 2, 3)
    assert set(ternary.lengths) == {(1, 2), (1, 3), (2, 3)}  # (p0,p1), (p0,pj), (p1,pj)
    assert ternary.lengths[(2, 3)] == pytest.approx(2 * 5 * math.sin(math.radians(45)))
    assert ternary.I0 == pytest.approx(0.5 * 3.0 * 25.0)  # (1/2)*mass*length12^2, length12 = 5
    fb = load_mechanism(MBSE / "fourbars1.yaml")
    assert fb.bodies[2].lengths == {(2, 3): pytest.approx(math.sqrt(13))}  # length: auto
    assert fb.bodies[1].I0 == pytest.approx(2.0 * 4.0 / 3.0)  # (1/3)*mass*length^2, length: 2*L
    assert fb.bodies[2].cog == pytest.approx((math.sqrt(13) / 2, 0.0))
    assert fb.gravity == (0.0, -9.81) and fb.parameters == {"L": 1.0, "xb": 4.0}
    pick = load_mechanism(MBSE / "pick-and-place-robot.yaml")
    assert [(r.name, r.a, r.b) for r in pick.relative_coordinates] == [("a0", 1, 3), ("a1", 12, 10)]
    assert pick.bodies[5].points == (5, 7, 6, 8) and len(pick.bodies[5].lengths) == 5
    assert pick.bodies[8].cog == pytest.approx((0.5 * math.hypot(0.5, 0.5), 0.0))  # 0.5*length12


def test_sensors2016_geometry() -> None:
    mech = load_mechanism(MECHANISMS / "fourbar-sensors2016.yaml")
    m = Model(mech)
    assert m.coord_names == ["x1", "y1", "x2", "y2", "x3", "y3", "theta1", "theta2"]
    assert m.dof_names == ["crank"] and m.coord_names[m.dof[0]] == "theta1"
    assert [b.name for b in mech.bodies] == ["crank", "coupler", "rocker"]
    assert mech.gravity == (0.0, -9.81)

    def check(q: np.ndarray) -> None:
        p1, p2, p3, B = q[0:2], q[2:4], q[4:6], np.array([0.8, 0.0])
        assert np.linalg.norm(p1) == pytest.approx(0.120, abs=1e-12)
        assert np.linalg.norm(p2 - p1) == pytest.approx(0.540, abs=1e-12)
        assert np.linalg.norm(p3 - p1) == pytest.approx(0.384, abs=1e-12)
        assert np.linalg.norm(p3 - p2) == pytest.approx(0.212, abs=1e-12)
        assert np.linalg.norm(p2 - B) == pytest.approx(0.455, abs=1e-12)
        d, r = p2 - p1, p3 - p1
        assert d[0] * r[1] - d[1] * r[0] > 0  # point 3 left of the directed line 1 -> 2
        assert p2[1] > 0  # rocker above the ground line
        for theta, v in ((q[6], p1), (q[7], p2 - B)):  # continuous angles: equal modulo 2 pi
            assert math.remainder(theta - math.atan2(v[1], v[0]), 2 * math.pi) == pytest.approx(0, abs=1e-12)

    check(m.q0)
    assert m.q0[6] == pytest.approx(math.pi / 2)  # initial crank angle 90 deg
    q = m.q0
    for crank in np.linspace(math.pi / 2, math.pi / 2 + 2 * math.pi, 25)[1:]:  # a full turn, same branch
        q = m.solve_position(q, np.array([crank]))
        check(q)

    crank, coupler, rocker = mech.bodies
    assert crank.points == (0, 1) and crank.mass == 11.10 and crank.cog == (0.0, 0.0)
    assert crank.I0 == pytest.approx(0.5 * 11.10 * 0.15**2)
    assert coupler.points == (1, 2, 3) and coupler.mass == 0.40
    assert coupler.cog == pytest.approx((0.27, 0.0))
    assert coupler.I0 == pytest.approx(0.40 * 0.54**2 / 12 + 0.40 * 0.27**2)
    assert rocker.points == (4, 2) and rocker.mass == 1.23
    assert rocker.I0 == pytest.approx(1.23 * 0.455**2 / 3) and rocker.cog == pytest.approx((0.455 / 2, 0.0))
    imu1, imu2 = mech.named_points
    a3 = (0.384**2 - 0.212**2 + 0.540**2) / (2 * 0.540)  # along 1 -> 2
    assert (imu1.name, imu1.body) == ("imu1", 1)
    assert imu1.local == pytest.approx((a3, math.sqrt(0.384**2 - a3**2)))  # left: +y of the coupler frame
    assert (imu2.name, imu2.body, imu2.local) == ("imu2", 2, (0.25, 0.0))


@pytest.mark.parametrize("name", ["fourbars1.yaml", "slider-crank.yaml", "fourbar-sensors2016.yaml"])
def test_shipped_mechanisms_assemble_with_a_named_crank(name: str) -> None:
    m = Model(load_mechanism(MECHANISMS / name))
    assert m.dof_names == ["crank"] and m.g == 1
    assert np.abs(m.Phi(m.q0)).max() < 1e-12


def test_fourbars1_matches_the_mbse_geometry() -> None:
    ours, ref = load_mechanism(MECHANISMS / "fourbars1.yaml"), load_mechanism(MBSE / "fourbars1.yaml")
    assert ours.points == ref.points
    assert [(b.points, b.mass, b.I0, b.cog, b.lengths) for b in ours.bodies] == \
        [(b.points, b.mass, b.I0, b.cog, b.lengths) for b in ref.bodies]
    assert ours.coordinate_names() == ["x1", "y1", "x2", "y2", "theta"]


def test_slider_keeps_point_on_its_line() -> None:
    m = Model(load_mechanism(MECHANISMS / "slider-crank.yaml"))
    (slider,) = m.mech.sliders
    assert slider.point == 2 and slider.origin == (0.0, 0.0) and slider.direction == (1.0, 0.0)
    for crank in np.linspace(0, 2 * np.pi, 13):
        q = m.solve_position(m.q0, np.array([crank]))
        assert q[m.coord_names.index("y2")] == pytest.approx(0.0, abs=1e-12)
        assert math.dist(q[0:2], q[2:4]) == pytest.approx(0.20, abs=1e-10)
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
REL = "relative_coordinates:\n  - {type: RelativeAngleAbsoluteDOF, points: [0, 1], name: theta}\n"


@pytest.mark.parametrize("text, field, problem", [
    (BASE.replace("[0, 1]", "[0, 7]"), "planar_bodies[0].points", "unknown point index 7 (points are 0..1)"),
    (BASE.replace("x: 1,", "x: L2*2,"), "points[1].x", "undefined name 'L2' in 'L2*2'"),
    (BASE.replace("x: 1,", "x: 1 +,"), "points[1].x", "unexpected end of expression in '1 +'"),
    (BASE.replace("x: 1,", "x: x2,"), "points[1].x", "undefined name 'x2'"),  # only earlier points
    (BASE.replace("x: 1,", ""), "points[1]", "missing 'x'"),
    (BASE.replace("fixed: true", "fixed: 1"), "points[0].fixed", "expected true or false, got 1"),
    (BASE.replace("mass: 1, ", ""), "planar_bodies[0]", "missing 'mass'"),
    (BASE.replace("[0, 1]", "[0]"), "planar_bodies[0].points", "2 or more point indices, got [0]"),
    (BASE.replace("[0, 1]", "[0, 1, 1]"), "planar_bodies[0].points", "repeated point in [0, 1, 1]"),
    (BASE.replace("x: 1,", "x: 0,"), "planar_bodies[0].points", "points 0 and 1 coincide"),
    (BASE.replace("length: 1", "length: -2"), "planar_bodies[0].length", "must be > 0 m, got -2"),
    (BASE.replace("I0: 1", "I0: -mass"), "planar_bodies[0].I0", "must be >= 0 kg·m², got -1"),
    (BASE.replace("cog: [0.5, 0]", "cog: [0.5]"), "planar_bodies[0].cog", "expected [x, y], got [0.5]"),
    (BASE.replace("cog: [0.5, 0]", "cog: [0.5, 0], name: g") + "  - {points: [0, 1], mass: 1, I0: 1, cog: [0, 0], name: g}\n",
     "planar_bodies[1].name", "duplicate name 'g'"),
    (BASE + "relative_coordinates:\n  - {type: RelativeAngle, points: [0, 1]}\n",
     "relative_coordinates[0].type", "unsupported type 'RelativeAngle'"),
    (BASE + "relative_coordinates:\n  - {type: RelativeAngleAbsoluteDOF, points: [1, 1]}\n",
     "relative_coordinates[0].points", "points 1 and 1 coincide"),
    (BASE + "relative_coordinates:\n  - {type: RelativeAngleAbsoluteDOF, points: [0, 1], name: x1}\n",
     "relative_coordinates[0].name", "duplicate name 'x1'"),
    (BASE + "dofs:\n  - {name: crank, coordinate: theta9}\n", "dofs[0].coordinate",
     "unknown coordinate 'theta9'; coordinates are ['x1', 'y1']"),
    (BASE + REL + "dofs:\n  - {name: a, coordinate: theta}\n  - {name: b, coordinate: 2}\n", "dofs[1].coordinate",
     "coordinate 'theta' is already a DOF"),
    (BASE + "dofs:\n  - {name: crank, coord: x1}\n", "dofs[0].coord", "unknown key; known: name, coordinate"),
    (BASE + "bogus: 1\n", "bogus", "unknown top-level key"),
    # unknown keys inside entries: a typo names the entry instead of surfacing as a rank error later
    (BASE.replace("length: 1,", "lenght: 0.6,"), "planar_bodies[0].lenght",
     "unknown key; known: points, length, mass, I0, cog, visual, name (did you mean 'length'?)"),
    (BASE.replace("{x: 1, y: 0}", "{x: 1, y: 0, fixd: true}"), "points[1].fixd",
     "unknown key; known: x, y, fixed (did you mean 'fixed'?)"),
    (BASE + "relative_coordinates:\n  - {type: RelativeAngleAbsoluteDOF, points: [0, 1], nmae: th}\n",
     "relative_coordinates[0].nmae", "unknown key; known: type, points, name (did you mean 'name'?)"),
    (BASE.replace("cog: [0.5, 0]", "cog: [0.5, 0], colour: red"), "planar_bodies[0].colour", "unknown key; known:"),
    (BASE + "gravity: [0, -9.81, 0]\n", "gravity", "expected [x, y], got [0, -9.81, 0]"),
    (BASE + "dampers:\n  - {bodies: [nope, ground], c: 1}\n", "dampers[0].bodies[0]",
     "unknown body 'nope'; bodies are ['body0']"),
    (BASE + "dampers:\n  - {bodies: [0, body0], c: 1}\n", "dampers[0].bodies", "two different bodies"),
    (BASE + "dampers:\n  - {bodies: [0, ground], c: -1}\n", "dampers[0].c", "must be >= 0 N·m·s/rad, got -1"),
    (BASE + "dampers:\n  - {bodies: [0, ground]}\n", "dampers[0]", "missing 'c'"),
    (BASE + "sliders:\n  - {point: 0, through: [0, 1]}\n", "sliders[0].point", "point 0 is fixed"),
    (BASE + "sliders:\n  - {point: 1, through: [0, 1]}\n", "sliders[0].through", "both points of the line must be fixed"),
    (BASE + "sliders:\n  - {point: 1, origin: [0, 0]}\n", "sliders[0]", "'origin: [x, y]' with 'angle_deg'"),
    (BASE + "sliders:\n  - {point: 1, origin: [0, 0], angle: 30}\n", "sliders[0].angle", "unknown key"),
    (BASE + "named_points:\n  tip: {point: 5}\n", "named_points.tip.point", "unknown point index 5"),
    (BASE + "named_points:\n  tip: {body: 0}\n", "named_points.tip", "give either 'point: i' or 'body: b'"),
    (BASE + "named_points:\n  tip: {body: 3, at: [0, 0]}\n", "named_points.tip.body", "unknown body 3"),
    ("parameters:\n  pi: 3\n" + BASE, "parameters.pi", "'pi' is a built-in name"),
    ("parameters:\n  L: 1\n  L: 2\n" + BASE, "", "YAML syntax error: line 3, column 3: duplicate key 'L'"),
    ("points: [\n", "", "YAML syntax error: line 2"),
    ("- 1\n- 2\n", "", "expected a mapping with 'points' and 'planar_bodies', got list"),
    ("planar_bodies: []\n", "points", "a mechanism needs at least one point"),
])
def test_errors_name_file_entry_and_problem(text: str, field: str, problem: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_mechanism(text, "my-rig.yaml")
    err = info.value
    assert (err.file, err.field) == ("my-rig.yaml", field)
    assert problem in err.problem and str(err).startswith("my-rig.yaml: ")


def test_missing_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="nope.yaml: cannot read: No such file or directory"):
        load_mechanism(tmp_path / "nope.yaml")


def test_body_expressions_see_length_mass_index_and_lengthIJ() -> None:
    text = """
parameters: {k: 2}
points:
  - {x: 0, y: 0, fixed: true}
  - {x: 3, y: 0}
  - {x: 3, y: 4}
planar_bodies:
  - {points: [0, 1], length: k*1.5, mass: 2*length, I0: mass*length^2 + index, cog: [length/2, 0]}
  - {points: [0, 1, 2], length: 99, mass: length13 + length23 + index, I0: length12, cog: [x1, y2]}
"""
    mech = parse_mechanism(text, "t.yaml")
    b0, b1 = mech.bodies
    assert (b0.mass, b0.I0, b0.cog, b0.lengths) == (6.0, 54.0, (1.5, 0.0), {(0, 1): 3.0})
    # length is ignored for 3+ points (as mbse); lengthIJ: 1-based, from the initial coordinates
    assert (b1.mass, b1.I0, b1.cog) == (5.0 + 4.0 + 1.0, 3.0, (3.0, 4.0))
    assert b1.lengths == {(0, 1): 3.0, (0, 2): 5.0, (1, 2): 4.0}


def test_extensions_parse() -> None:
    text = """
name: demo
description: a pendulum with a slider and a ternary body
parameters: {L: 1}
points:
  - {x: 0, y: 0, fixed: true}
  - {x: L, y: 0}
  - {x: 2*L, y: 0, fixed: true}
  - {x: L, y: 1}
  - {x: 0, y: 2, fixed: true}
planar_bodies:
  - {name: arm, points: [0, 1], length: auto, mass: 1, I0: 1, cog: [0.5, 0]}
  - {points: [1, 3, 4], mass: 1, I0: 1, cog: [0, 0]}
gravity: [0, -9.8]
relative_coordinates:
  - {type: RelativeAngleAbsoluteDOF, points: [0, 1], name: theta}
  - {type: RelativeAngleAbsoluteDOF, points: [1, 3]}
sliders:
  - {point: 1, through: [0, 2]}
  - {point: 3, origin: [L, 0], angle_deg: 90}
dofs:
  - {name: swing, coordinate: theta}
  - {coordinate: 0}
named_points:
  tip: {point: 1}
  top: {point: 4}
  mid: {body: body1, at: [0.5, 0.1]}
dampers:
  - {bodies: [arm, ground], c: 0.5}
  - {bodies: [1, arm], c: L/10}
"""
    mech = parse_mechanism(text, "x.yaml")
    assert [b.name for b in mech.bodies] == ["arm", "body1"]
    assert mech.gravity == (0.0, -9.8)
    assert mech.coordinate_names() == ["x1", "y1", "x3", "y3", "theta", "a1"]
    assert [(d.name, d.coordinate) for d in mech.dofs] == [("swing", 4), ("x1", 0)]
    assert [(s.point, s.origin) for s in mech.sliders] == [(1, (0.0, 0.0)), (3, (1.0, 0.0))]
    assert mech.sliders[0].direction == (2.0, 0.0)
    assert mech.sliders[1].direction == pytest.approx((0.0, 1.0))
    tip, top, mid = mech.named_points
    assert (tip.name, tip.body, tip.local) == ("tip", 0, (1.0, 0.0))  # first body containing point 1
    # body1 frame: origin point 1 (1, 0), x towards point 3 (1, 1): point 4 (0, 2) is at (2, 1)
    assert (top.body, top.local) == (1, pytest.approx((2.0, 1.0)))
    assert (mid.body, mid.local) == (1, (0.5, 0.1))
    assert [(d.body_a, d.body_b, d.c) for d in mech.dampers] == [(0, None, 0.5), (1, 0, 0.1)]
    assert mech.body_index("body1") == 1 and mech.body_index(0) == 0


def test_model_check_prints_coordinates_constraints_dof_and_residual(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["model", "check", str(MECHANISMS / "fourbar-sensors2016.yaml")]) == 0
    out = capsys.readouterr().out
    q0 = Model(load_mechanism(MECHANISMS / "fourbar-sensors2016.yaml")).q0
    assert "    1  y1         y of point 1 (m)" in out and f"{q0[1]: .6f}" in out
    assert "    6  theta1     angle of point 0 -> point 1 from +x (rad)" in out and "<- DOF crank" in out
    assert "constraints Phi (m = 7):" in out and "distance 1-3 = 0.384 m (body coupler)" in out
    assert "degrees of freedom: 1 (crank)" in out
    assert "named point imu1: body coupler" in out and "rocker: points [4, 2], mass 1.23 kg" in out
    residual = float(out.split("assembly residual |Phi(q0)| = ")[1].split()[0])
    assert residual < 1e-12


def test_model_check_fails_clearly_on_bad_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(BASE.replace("[0, 1]", "[0, 9]"))
    assert main(["model", "check", str(bad)]) == 2
    assert f"{bad}: planar_bodies[0].points: unknown point index 9" in capsys.readouterr().err
    # a four-bar whose links cannot close (1 + 1 + 1 < 10): the Model's AssemblyError
    unclosable = tmp_path / "unclosable.yaml"
    unclosable.write_text("""
points:
  - {x: 0, y: 0, fixed: true}
  - {x: 1, y: 0}
  - {x: 1, y: 1}
  - {x: 10, y: 0, fixed: true}
planar_bodies:
  - {points: [0, 1], length: auto, mass: 1, I0: 1, cog: [0.5, 0]}
  - {points: [1, 2], length: auto, mass: 1, I0: 1, cog: [0.5, 0]}
  - {points: [2, 3], length: 1, mass: 1, I0: 1, cog: [0.5, 0]}
""")
    assert main(["model", "check", str(unclosable)]) == 2
    err = capsys.readouterr().err
    assert str(unclosable) in err and "cannot be assembled" in err


def test_model_check_as_a_process(tmp_path: Path) -> None:
    good = subprocess.run([sys.executable, "-m", "estimator_service.cli", "model", "check",
                           str(MECHANISMS / "slider-crank.yaml")], capture_output=True, text=True)
    assert good.returncode == 0, good.stderr
    assert "point 2 on line through (0, 0)" in good.stdout and "degrees of freedom: 1 (crank)" in good.stdout
    assert "damper crank-ground: c = 0.001 N·m·s/rad" in good.stdout
    bad = tmp_path / "bad.yaml"
    bad.write_text("points: [\n")
    out = subprocess.run([sys.executable, "-m", "estimator_service.cli", "model", "check", str(bad)],
                         capture_output=True, text=True)
    assert out.returncode == 2
    assert f"{bad}: YAML syntax error: line 2" in out.stderr and "Traceback" not in out.stderr

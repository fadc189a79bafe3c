"""Generated mechanisms (estimator_service/generate.py, ``rigstate model ladder``) and the scaling
benchmark's inputs: they assemble, move, keep their constraints, and bad sizes are clear errors."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from estimator_service.generate import ladder_rig_toml, ladder_yaml
from estimator_service.mechanism import parse_mechanism
from estimator_service.model import Model
from estimator_service.rig import load_rig
from estimator_service.simulate import simulate

from helpers import run_main


def grashof_margin(a: float, b: float, c: float, d: float) -> float:
    """(p + q) − (s + l) of a four-bar's link lengths: > 0 is Grashof."""
    s = sorted([a, b, c, d])
    return s[1] + s[2] - s[0] - s[3]


@pytest.mark.parametrize("bodies", [3, 5, 11, 21, 201])
def test_a_ladder_has_its_size_one_dof_and_grashof_stages(bodies: int) -> None:
    mech = parse_mechanism(ladder_yaml(bodies), f"ladder-{bodies}")
    model = Model(mech)
    stages = (bodies - 1) // 2
    assert len(mech.bodies) == bodies and model.g == 1 and model.dof_names == ["crank"]
    assert model.n == 1 + 2 * (1 + 2 * stages - 1) and np.abs(model.Phi(model.q0)).max() < 1e-12
    assert np.linalg.matrix_rank(model.Phi_q(model.q0)) == model.m == model.n - 1  # independent constraints
    pts = [(p.x, p.y) for p in mech.points]
    by = {b.name: b.points for b in mech.bodies}
    drive = by["crank"]
    for k in range(1, stages + 1):  # input (crank or the last rocker's driving pin), coupler, rocker, ground
        rocker = by[f"rocker{k}"]
        links = [math.dist(pts[drive[0]], pts[drive[-1]]), math.dist(*(pts[i] for i in by[f"coupler{k}"])),
                 math.dist(pts[rocker[0]], pts[rocker[1]]), math.dist(pts[drive[0]], pts[rocker[0]])]
        assert links[0] == min(links) and grashof_margin(*links) > 0.05, (k, links)
        drive = [rocker[0], rocker[-1]]


def test_a_simulated_ladder_keeps_its_constraints_and_turns(tmp_path: Path) -> None:
    (tmp_path / "ladder-11.yaml").write_text(ladder_yaml(11))
    (tmp_path / "ladder-11.toml").write_text(ladder_rig_toml(11, "ladder-11.yaml"))
    rig = load_rig(tmp_path / "ladder-11.toml")
    model = rig.model
    truth = [m for topic, m in simulate(rig=rig, duration=2.0) if topic == "truth/state"]
    gyros = {f"imu/{s.name}" for s in rig.imus}
    assert len(truth) == 2001 and math.degrees(truth[0]["crank"]) == pytest.approx(60.0)
    assert max(np.abs(model.Phi(np.array(m["q"]))).max() for m in truth) < 1e-9
    crank = np.unwrap([m["crank"] for m in truth])
    assert np.ptp(crank) > 1.0  # released under gravity, it swings through a large angle
    assert gyros == {"imu/coupler1", "imu/last"}


def test_model_ladder_cli_writes_a_checked_mechanism_and_refuses_bad_sizes(tmp_path: Path) -> None:
    out = tmp_path / "l.yaml"
    ok = run_main("model", "ladder", "--bodies", "7", "--out", str(out))
    assert ok.returncode == 0 and out.read_text() == ladder_yaml(7)
    check = run_main("model", "check", str(out))
    assert check.returncode == 0 and "7 bodies" in check.stdout
    for bad in ("4", "1", "203"):
        r = run_main("model", "ladder", "--bodies", bad)
        assert r.returncode == 2 and "--bodies: a ladder has 1 + 2 x stages bodies" in r.stderr and "Traceback" not in r.stderr
    r = run_main("model", "ladder", "--bodies", "5", "--out", str(tmp_path / "no" / "l.yaml"))
    assert r.returncode == 2 and "cannot write" in r.stderr and "Traceback" not in r.stderr

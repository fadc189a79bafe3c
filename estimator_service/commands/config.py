"""``rigstate config check RIG.toml``: validate a rig and everything it implies, up front."""

from __future__ import annotations

import argparse
import sys

from estimator_service.dofs import dofs_of
from estimator_service.rig import BACKENDS, Rig
from estimator_service.rigcheck import RigCheck, check_rig


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("config", help="rig configuration tools", description="Rig configuration tools.")
    csub = p.add_subparsers(dest="config_command", metavar="SUBCOMMAND")
    csub.required = True
    c = csub.add_parser(
        "check", help="check a rig TOML and everything it implies (mechanism, sensors, bus, estimator, init)",
        description="Loads RIG (every key of docs/config.md), its mechanism file (assembled), the sensors and "
        "their topics, the bus endpoints, every backend's parameter table ([estimator.ekf], [estimator.ukf], "
        "[estimator.fgs], not only the selected backend) and [estimator.init], as the estimator would at "
        "start. Exits 0 with a short summary, or 2 listing every problem (file: field: problem).")
    c.add_argument("rig", metavar="RIG.toml", help="rig configuration file")
    c.set_defaults(func=run_check)


def summary(rig: Rig) -> list[str]:
    """A few lines describing a checked rig."""
    model, mech = rig.model, rig.mechanism
    dofs = ", ".join(f"{d.name} ({d.unit})" for d in dofs_of(model))
    imus = [f"imu/{s.name} ({'+'.join(s.use) or 'not fused'}, {s.rate_hz:g} Hz, {s.endpoint})" for s in rig.imus]
    encs = [f"enc/{e.name} ({'fused' if e.use else 'not fused'}, {e.lines} lines, {e.rate_hz:g} Hz, {e.endpoint})"
            for e in rig.encoders]
    drives = [f"{d.dof} ({d.input}" + (f" on {d.topic}, {d.rate_hz:g} Hz, {d.endpoint})" if d.measured else ")")
              for d in rig.drives]
    est = rig.estimator
    return [
        f"  mechanism  {rig.mechanism_path}: {len(mech.points)} points, {len(mech.bodies)} bodies; q has {model.n} "
        f"coordinates, {model.m} constraints; DOF {dofs}",
        f"  sensors    {', '.join(imus + encs) or 'none'}",
        *([f"  drives     {', '.join(drives)}"] if drives else []),
        f"  bus        estimator {rig.bus.estimator}, sim {rig.bus.sim}",
        f"  estimator  backend {est.backend}, dt {est.dt * 1e3:g} ms; parameters of {', '.join(BACKENDS)} valid; "
        f"init mode {est.init.get('mode', 'pose')}",
    ]


def run_check(args: argparse.Namespace) -> int:
    return report(check_rig(args.rig))


def report(result: RigCheck) -> int:
    """Print a check's problems (stderr, exit code 2) or its summary (exit code 0)."""
    if not result.ok:
        for problem in result.problems:
            print(f"rigstate: error: {problem}", file=sys.stderr)
        print(f"{result.path}: {len(result.problems)} problem(s)", file=sys.stderr)
        return 2
    assert result.rig is not None
    print(f"{result.path}: ok")
    print("\n".join(summary(result.rig)))
    return 0

"""``rigstate model check``: load, assemble and describe a mechanism file; ``rigstate model ladder``:
write a generated mechanism of any size (estimator_service/generate.py)."""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from estimator_service.commands.config import report
from estimator_service.errors import UserError
from estimator_service.generate import ladder_yaml
from estimator_service.mechanism import Mechanism, load_mechanism
from estimator_service.model import Model
from estimator_service.rigcheck import check_rig


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("model", help="mechanism model tools", description="Mechanism model tools.")
    msub = p.add_subparsers(dest="model_command", metavar="SUBCOMMAND")
    msub.required = True
    c = msub.add_parser(
        "check",
        help="load a mechanism YAML, assemble it and print coordinates, constraints, DOF and residual",
        description="Loads FILE (mbse format + rigstate extensions), solves the initial assembly and prints "
        "the coordinates q (index, name, meaning, value), the constraints, the DOF and |Phi(q0)|. "
        "Given a rig TOML (*.toml), checks the whole rig as 'rigstate config check' does, then describes "
        "its mechanism. Exits 2 with a message naming the file and entry on a bad file.",
    )
    c.add_argument("file", help="mechanism YAML file, or a rig TOML file")
    c.set_defaults(func=_check)
    g = msub.add_parser(
        "ladder",
        help="write a generated one-DOF mechanism of any size: a crank driving four-bar stages in series",
        description="Writes the mechanism YAML of a ladder: a crank driving (BODIES - 1) / 2 four-bar stages in "
        "series, each a Grashof crank-rocker (every crank angle assembles). One degree of freedom, named "
        "'crank'; named points crank_pin and last_pin for IMUs. Used by 'rigstate bench --scaling'.",
    )
    g.add_argument("--bodies", type=int, required=True, help="number of bodies: 3, 5, 7, ... (1 + 2 x stages)")
    g.add_argument("--out", help="write here instead of standard output")
    g.set_defaults(func=_ladder)


def _ladder(args: argparse.Namespace) -> int:
    text = ladder_yaml(args.bodies)
    if args.out:
        try:
            Path(args.out).write_text(text)
        except OSError as exc:
            raise UserError(f"{args.out}: cannot write: {exc.strerror or exc}") from None
        print(f"wrote {args.out}")
    else:
        print(text, end="")
    return 0


def _check(args: argparse.Namespace) -> int:
    if args.file.endswith(".toml"):
        result = check_rig(args.file)
        if report(result) != 0 or result.rig is None:
            return 2
        print()
        return _describe(result.rig.mechanism_path, result.rig.mechanism)
    return _describe(args.file, load_mechanism(args.file))


def _describe(file: str, mech: Mechanism) -> int:
    """Print a mechanism's coordinates, constraints, DOF, bodies and assembly residual."""
    model = Model(mech)
    print(f"{file}: {len(mech.points)} points, {len(mech.bodies)} bodies, gravity {mech.gravity} m/s²")
    print(f"\ncoordinates q (n = {model.n}), value at the initial assembly q0:")
    dof = [int(i) for i in model.dof]
    for i, (name, meaning) in enumerate(zip(model.coord_names, model.coord_meanings, strict=True)):
        mark = f"  <- DOF {model.dof_names[dof.index(i)]}" if i in dof else ""
        print(f"  {i:3d}  {name:10s} {meaning:42s} {model.q0[i]: .6f}{mark}")
    print(f"\nconstraints Phi (m = {model.m}):")
    for i, name in enumerate(model.constraint_names):
        print(f"  {i:3d}  {name}")
    for name in model.redundant:
        print(f"       {name}: redundant (dependent on the rows above at q0; it holds wherever they do)")
    print(f"\ndegrees of freedom: {model.g} ({', '.join(model.dof_names)})")
    print("\nbodies:")
    for b in mech.bodies:
        print(f"  {b.name}: points {list(b.points)}, mass {b.mass:g} kg, I0 {b.I0:.6g} kg·m² about point "
              f"{b.points[0]}, cog ({b.cog[0]:.6g}, {b.cog[1]:.6g}) m")
    for p in mech.named_points:
        print(f"  named point {p.name}: body {mech.bodies[p.body].name}, at ({p.local[0]:.6f}, {p.local[1]:.6f}) m")
    for d in mech.dampers:
        other = "ground" if d.body_b is None else mech.bodies[d.body_b].name
        print(f"  damper {mech.bodies[d.body_a].name}-{other}: c = {d.c:g} N·m·s/rad")
    phi = model.Phi(model.q0)
    print(f"\nassembly residual |Phi(q0)| = {np.linalg.norm(phi):.3e} (max |Phi_i| = {np.abs(phi).max(initial=0.0):.3e})")
    return 0

"""``rigstate model check``: load, assemble and describe a mechanism file."""

from __future__ import annotations

import argparse

import numpy as np

from estimator_service.mechanism import load_mechanism
from estimator_service.model import Model


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("model", help="mechanism model tools", description="Mechanism model tools.")
    msub = p.add_subparsers(dest="model_command", metavar="SUBCOMMAND")
    msub.required = True
    c = msub.add_parser(
        "check",
        help="load a mechanism YAML, assemble it and print coordinates, constraints, DOF and residual",
        description="Loads FILE (mbse format + rigstate extensions), solves the initial assembly and prints "
        "the coordinates q (index, name, meaning, value), the constraints, the DOF and |Phi(q0)|. "
        "Exits 2 with a message naming the file and entry on a bad file.",
    )
    c.add_argument("file", help="mechanism YAML file")
    c.set_defaults(func=_check)


def _check(args: argparse.Namespace) -> int:
    mech = load_mechanism(args.file)
    model = Model(mech)
    print(f"{args.file}: {len(mech.points)} points, {len(mech.bodies)} bodies")
    print(f"\ncoordinates q (n = {model.n}):")
    for i, (name, meaning) in enumerate(zip(model.coord_names, model.coord_meanings)):
        mark = "  <- DOF " + model.dof_names[list(model.dof).index(i)] if i in model.dof else ""
        print(f"  {i:3d}  {name:10s} {meaning:42s} {model.q0[i]: .6f}{mark}")
    print(f"\nconstraints Phi (m = {model.m}):")
    for i, name in enumerate(model.constraint_names):
        print(f"  {i:3d}  {name}")
    print(f"\ndegrees of freedom: {model.g} ({', '.join(model.dof_names)})")
    for b in mech.bodies:
        print(f"  body {b.name}: points {list(b.points)}, mass {b.mass:g} kg, I0 {b.I0:.6g} kg·m², cog {tuple(round(c, 6) for c in b.cog)}")
    for p in mech.named_points:
        print(f"  named point {p.name}: body {mech.bodies[p.body].name}, at ({p.local[0]:.6f}, {p.local[1]:.6f}) m")
    print(f"\nassembly residual max |Phi(q0)| = {np.abs(model.Phi(model.q0)).max():.3e}")
    return 0

"""``rigstate inverse-dynamics``: actuator forces that make a mechanism follow imposed coordinate trajectories."""

from __future__ import annotations

import argparse
import csv
import logging
import math
import re
from pathlib import Path

import numpy as np

from estimator_service.errors import UserError
from estimator_service.inverse_dynamics import METHODS, ORDER, WINDOW, imposed_model, inverse_dynamics
from estimator_service.mechanism import load_mechanism

log = logging.getLogger(__name__)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "inverse-dynamics",
        help="generalized forces that make a mechanism follow a prescribed motion of some coordinates",
        description="Reads a mechanism (YAML) and the sampled trajectory of some of its coordinates (text as mbse "
        "writes it: time, then one column per imposed coordinate; '%' or '#' comment lines) and writes the "
        "actuator generalized force on each imposed coordinate at each sample (N·m on angles, N on lengths; "
        "positive drives the coordinate towards larger values; MSC Adams reports the reaction, its negative). "
        "See docs/inverse-dynamics.md.",
    )
    p.add_argument("--mechanism", required=True, metavar="M.yaml", help="mechanism YAML file")
    p.add_argument("--trajectory", required=True, metavar="T.txt", help="trajectory: time (s), then one column per imposed coordinate")
    p.add_argument("--imposed", required=True, metavar="I[,J...]",
                   help="0-based indices into q of the imposed coordinates, in the trajectory's column order (mbse's "
                   "--imposed-coordinates; '[ 20 ; 21 ]' is accepted too); `rigstate model check` lists q")
    p.add_argument("--out", required=True, metavar="F.csv", help="output CSV: t, tau_<I>... (and the states with --states)")
    p.add_argument("--states", action="store_true", help="also write q_<name>, qd_<name>, qdd_<name> for every coordinate")
    p.add_argument("--gravity", metavar="G|GX,GY",
                   help="gravity: a magnitude G along -y (m/s², e.g. 9.80665), or the vector GX,GY; default: the mechanism file's")
    p.add_argument("--method", choices=METHODS, default="model",
                   help="model: sample by sample on the model (default); fg: one gtsam factor graph over the whole trajectory")
    p.add_argument("--window", type=int, default=WINDOW, metavar="N",
                   help=f"samples (odd) of the local degree-{ORDER} polynomial fit that differentiates the trajectory (default {WINDOW})")
    p.set_defaults(func=_run)


def parse_imposed(text: str) -> list[int]:
    """``"4"``, ``"20,21"`` or mbse's ``"[ 20 ; 21 ]"`` -> indices; UserError naming the bad entry."""
    parts = [s for s in re.split(r"[\s,;]+", text.strip().strip("[]").strip()) if s]
    if not parts:
        raise UserError(f"--imposed: no coordinate index in {text!r}")
    out = []
    for s in parts:
        try:
            out.append(int(s))
        except ValueError:
            raise UserError(f"--imposed: {s!r} is not a coordinate index (0-based integer) in {text!r}") from None
    return out


def parse_gravity(text: str) -> tuple[float, float]:
    """``"G"`` -> (0, −G); ``"GX,GY"`` -> (GX, GY) in m/s²; UserError on anything else."""
    parts = [s for s in text.split(",")]
    try:
        vals = [float(s) for s in parts]
    except ValueError:
        raise UserError(f"--gravity: expected a magnitude G or GX,GY in m/s², got {text!r}") from None
    if len(vals) not in (1, 2) or not all(math.isfinite(v) for v in vals):
        raise UserError(f"--gravity: expected a magnitude G or GX,GY in m/s², got {text!r}")
    return (0.0, -vals[0]) if len(vals) == 1 else (vals[0], vals[1])


def read_trajectory(path: str | Path, columns: int) -> tuple[np.ndarray, np.ndarray]:
    """Read a trajectory text file: whitespace-separated time (s) and ``columns`` values per line;
    blank lines and lines starting with ``%`` or ``#`` are skipped.  Returns (t (N,), x (N, columns)).

    UserError naming the file, line and value for an unreadable file, a value that is not a finite
    number, a wrong number of columns, or a time not after the previous one.
    """
    try:
        lines = Path(path).read_text().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"{path}: cannot read: {getattr(exc, 'strerror', None) or exc}") from None
    rows: list[list[float]] = []
    prev_t = -math.inf
    for lineno, line in enumerate(lines, 1):
        s = line.strip()
        if not s or s[0] in "%#":
            continue
        fields = s.split()
        if len(fields) != columns + 1:
            raise UserError(f"{path}: line {lineno}: expected {columns + 1} columns (time and {columns} imposed "
                            f"coordinate(s)), got {len(fields)}: {s!r}")
        row = []
        for f in fields:
            try:
                v = float(f)
            except ValueError:
                v = math.nan
            if not math.isfinite(v):
                raise UserError(f"{path}: line {lineno}: {f!r} is not a finite number")
            row.append(v)
        if row[0] <= prev_t:
            raise UserError(f"{path}: line {lineno}: time {fields[0]} s is not after the previous sample's {prev_t:g} s")
        prev_t = row[0]
        rows.append(row)
    if not rows:
        raise UserError(f"{path}: no samples (only comments or blank lines)")
    data = np.array(rows)
    return data[:, 0], data[:, 1:]


def _run(args: argparse.Namespace) -> int:
    imposed = parse_imposed(args.imposed)
    gravity = parse_gravity(args.gravity) if args.gravity is not None else None
    mech = load_mechanism(args.mechanism)
    model = imposed_model(mech, imposed, gravity)
    t, x = read_trajectory(args.trajectory, len(imposed))
    w = args.window
    if w % 2 == 0 or w <= ORDER:
        raise UserError(f"--window: must be an odd number of samples > {ORDER}, got {w}")
    if w > len(t):
        raise UserError(f"{args.trajectory}: {len(t)} samples, fewer than the --window of {w}")
    names = model.coord_names
    n_rel = len(mech.relative_coordinates)
    units = ["N·m" if i >= model.n - n_rel else "N" for i in imposed]
    print(f"{args.mechanism}: imposed {', '.join(f'q[{i}] = {names[i]}' for i in imposed)}; gravity "
          f"({model.gravity[0]:g}, {model.gravity[1]:g}) m/s²; {len(t)} samples, t = {t[0]:g} .. {t[-1]:g} s; "
          f"method {args.method}")
    res = inverse_dynamics(model, t, x, method=args.method, window=w, progress=log.info)
    header = ["t"] + [f"tau_{i}" for i in imposed]
    cols = [res.t[:, None], res.tau]
    if args.states:
        header += [f"{p}_{name}" for p in ("q", "qd", "qdd") for name in names]
        cols += [res.q, res.qd, res.qdd]
    table = np.hstack(cols)
    try:
        with open(args.out, "w", newline="") as fh:
            wr = csv.writer(fh)
            wr.writerow(header)
            wr.writerows([[f"{v:.12g}" for v in row] for row in table])
    except OSError as exc:
        raise UserError(f"{args.out}: cannot write: {exc.strerror or exc}") from None
    for j, i in enumerate(imposed):
        print(f"tau_{i} ({names[i]}, {units[j]}): min {res.tau[:, j].min():.6g}, max {res.tau[:, j].max():.6g}")
    print(f"run time {res.info['run_time_s']:.2f} s; wrote {args.out}")
    return 0

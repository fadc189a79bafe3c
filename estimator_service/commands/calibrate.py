"""``rigstate calibrate``: a rig calibrated on one recording (axes, signs, mount, time offset, biases,
lever arm, noise, drive), written as a rig TOML that ``estimate`` and the daemon use as it is."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from estimator_service.errors import UserError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "calibrate",
        help="calibrate a rig on a recording with encoders (or a rest): axes, signs, mount, time offset, biases, noise",
        description="Finds from a recording, with nothing to name: each IMU's axis normal to the plane and its sign, "
        "in-plane mount angle, time offset against the encoders, gyro and accelerometer biases, lever arm (where the "
        "motion shows it), the noise of every channel, which channels to fuse and the drive's acceleration density; "
        "prints each with its 1 sigma, draws figures and writes the rig with those keys set (docs/calibrate.md).",
    )
    p.add_argument("log", help="log with the rig's IMU and encoder messages")
    p.add_argument("--rig", help="the rig TOML as written (the values it starts from; default: the rig in the log header)")
    p.add_argument("--out", required=True, help="calibrated rig TOML to write")
    p.add_argument("--window", metavar="START:END",
                   help="part of the log to use, s from its first sensor message (either side may be empty)")
    p.add_argument("--figures", metavar="DIR",
                   help="directory for the figures (default: <out without .toml>-figures next to --out)")
    p.set_defaults(func=_run)


def parse_window(text: str | None) -> tuple[float | None, float | None]:
    """``START:END`` (s; either may be empty) -> (start, end); UserError on anything else."""
    if text is None:
        return None, None
    start, sep, end = text.partition(":")
    try:
        lo = float(start) if start.strip() else None
        hi = float(end) if end.strip() else None
    except ValueError:
        lo = hi = math.nan
    if not sep or any(v is not None and not math.isfinite(v) for v in (lo, hi)) or (lo is not None and lo < 0):
        raise UserError(f"--window: expected START:END in s from the log's first sensor message (START >= 0), got {text!r}")
    if lo is not None and hi is not None and hi <= lo:
        raise UserError(f"--window {text}: the window is empty (END must be after START)")
    return lo, hi


def _run(args: argparse.Namespace) -> int:
    from estimator_service.calibrate import calibrate
    from estimator_service.calibrate_report import format_calibration, write_calibrated, write_figures
    from estimator_service.kinematics_check import read_messages

    window = parse_window(args.window)
    rig, msgs = read_messages(args.log, args.rig)
    cal = calibrate(rig, msgs, window)
    print(format_calibration(cal))
    out = Path(args.out)
    figures = Path(args.figures) if args.figures else out.with_name(out.stem + "-figures")
    paths = write_figures(cal, figures)
    path = write_calibrated(cal, out, args.log)
    print(f"wrote {path}" + (f", {', '.join(str(p) for p in paths)}" if paths else ""))
    return 0

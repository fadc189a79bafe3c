"""``rigstate identify``: joint parameter and trajectory identification from recorded logs."""

from __future__ import annotations

import argparse
import math

from estimator_service.errors import UserError
from estimator_service.identify import format_report, identify, parse_params, stderr_progress, write_identified
from estimator_service.rig import load_rig


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "identify",
        help="identify mechanism, friction and sensor parameters (with the trajectory) from logs",
        description="One batch nonlinear least-squares problem over whole logs: the trajectory in independent "
        "coordinates and the chosen parameters, from the time-discrete dynamics, every gyro, accelerometer and "
        "encoder sample and priors on the parameters (docs/identify.md). Prints each estimate with 1 sigma, "
        "correlations and identifiability, and writes a rig TOML (plus mechanism YAML) that estimate and the "
        "daemon load directly.",
    )
    p.add_argument("logs", nargs="+", metavar="LOG", help="recorded or simulated logs of the rig")
    p.add_argument("--rig", required=True, help="the rig TOML the parameters start from (nominal values = priors)")
    p.add_argument("--params", required=True,
                   help="comma-separated: <body>.mass, <body>.I0, <body>.cog_x, <body>.cog_y, damper:<body> (joint to "
                   "ground) or damper:<body>/<body>, gyro_bias:<imu>, acc_bias:<imu>, mount:<imu>, time_offset:<imu>")
    p.add_argument("--out", help="identified rig TOML to write (a mechanism YAML of the same stem is written next to "
                   "it when body or friction parameters are identified)")
    p.add_argument("--prior", action="append", default=[], metavar="NAME=SIGMA",
                   help="prior standard deviation of a parameter in SI units (rad, s, kg, ...); repeatable")
    p.add_argument("--dt", type=float, default=0.002, help="dynamics grid step in s (default 0.002)")
    p.add_argument("--sigma-acc", type=float, default=0.01,
                   help="unmodelled acceleration of the dynamics residuals, rad/s² or m/s² (default 0.01)")
    p.add_argument("--max-iter", type=int, default=50, help="Levenberg-Marquardt iterations at most (default 50)")
    p.set_defaults(func=_run)


def _priors(items: list[str]) -> dict[str, float]:
    out = {}
    for item in items:
        name, eq, value = item.partition("=")
        try:
            sigma = float(value)
        except ValueError:
            sigma = math.nan
        if not eq or not name or not math.isfinite(sigma):
            raise UserError(f"--prior: expected NAME=SIGMA (a number), got {item!r}")
        out[name.strip()] = sigma
    return out


def _run(args: argparse.Namespace) -> int:
    for flag, v in (("--dt", args.dt), ("--sigma-acc", args.sigma_acc)):
        if not (v > 0 and math.isfinite(v)):
            raise UserError(f"{flag} must be > 0, got {v}")
    if args.dt > 0.05:
        raise UserError(f"--dt must be at most 0.05 s, got {args.dt}")
    if args.max_iter < 1:
        raise UserError(f"--max-iter must be >= 1, got {args.max_iter}")
    rig = load_rig(args.rig)
    params, mech = parse_params(rig, args.params, _priors(args.prior))
    result = identify(rig, params, mech, args.logs, dt=args.dt, sigma_acc=args.sigma_acc, max_iter=args.max_iter,
                      progress=stderr_progress)
    print(format_report(result))
    if args.out:
        for path in write_identified(rig, result, args.out, args.logs):
            print(f"wrote {path}")
    return 0

"""``rigstate validate-kinematics``: check a rig's geometry and IMU mounting from its encoders."""

from __future__ import annotations

import argparse
import json


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "validate-kinematics",
        help="predict every IMU's gyro and accelerometer readings from the encoders alone and compare",
        description="Solves the position, velocity and acceleration problems from the encoder readings "
        "(derivatives by Savitzky-Golay smoothing differentiation), predicts each IMU's readings with the "
        "rig's virtual sensors and compares: RMSE per channel, constant gyro bias, accelerometer bias and "
        "in-plane misalignment (least squares), figures (Sensors 2016 §5.1; docs/report.md).",
    )
    p.add_argument("log", help="log with encoder and IMU messages")
    p.add_argument("--rig", help="rig TOML to check (default: the configuration stored in the log header)")
    p.add_argument("--out", help="directory for figures and kinematics.json")
    p.add_argument("--window", type=float,
                   help="Savitzky-Golay differentiation window (s, default 0.101, docs/report.md)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from estimator_service.kinematics_check import format_result, validate_kinematics, write_outputs

    window = {} if args.window is None else {"window_s": args.window}
    res = validate_kinematics(args.log, args.rig, **window)
    print(json.dumps(res.to_json(), indent=2) if args.json else format_result(res))
    if args.out:
        paths = write_outputs(res, args.out)
        if not args.json:
            print(f"wrote {', '.join(str(p) for p in paths.values())}")
    return 0

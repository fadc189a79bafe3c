"""``rigstate estimator``: the live estimator daemon."""

from __future__ import annotations

import argparse

from estimator_service.daemon import DaemonOptions, run_daemon
from estimator_service.paths import default_rig
from estimator_service.rig import BACKENDS, load_rig


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "estimator",
        help="run the estimator daemon (subscribes to sensors, publishes est/state and est/diag)",
        description="Run the estimator daemon on the bus endpoints of a rig config. Estimates are "
        "stepped on sensor time; under systemd it speaks sd_notify (READY, WATCHDOG, STATUS).",
    )
    p.add_argument("--config", type=str, default=str(default_rig()), help="rig TOML (default: the shipped testbed)")
    p.add_argument("--backend", choices=BACKENDS, help="override [estimator] backend")
    p.add_argument("--duration", type=float, help="stop after this many seconds (default: run until SIGTERM)")
    p.add_argument("--sensor-endpoint", action="append", metavar="ENDPOINT",
                   help="subscribe here instead of the rig's sensor endpoints (repeatable)")
    p.add_argument("--endpoint", help="publish est/* here instead of the rig's [bus] estimator")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    rig = load_rig(args.config)
    opts = DaemonOptions(backend=args.backend, duration_s=args.duration,
                         sensor_endpoints=args.sensor_endpoint, endpoint=args.endpoint)
    return run_daemon(rig, opts)

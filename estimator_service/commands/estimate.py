"""``rigstate estimate``: run a log through a backend offline (the daemon's code path)."""

from __future__ import annotations

import argparse
import sys

from estimator_service.offline import estimate_log


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "estimate",
        help="run a recorded log through a backend and write est/state into a new log",
        description="Runs LOG through the backend exactly as the live daemon does and writes OUT with "
        "the input records plus est/state messages. Deterministic: same input, same bytes.",
    )
    p.add_argument("log", help="input log (from record, simulate or log import)")
    p.add_argument("--backend", choices=["ekf", "ukf", "fgs", "errekf"], help="backend (default: the rig's)")
    p.add_argument("--rig", help="rig TOML (default: the configuration stored in the log header)")
    p.add_argument("--out", required=True, help="output log")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    pipe = estimate_log(args.log, args.out, args.backend, args.rig)
    n_est = pipe.seq
    bad = {t: s.malformed for t, s in pipe.stats.items() if s.malformed}
    print(f"{args.out}: {n_est} est/state messages from backend {pipe.backend_name}"
          + (f"; malformed inputs dropped: {bad}" if bad else ""), file=sys.stdout)
    return 0

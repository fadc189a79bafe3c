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
    p.add_argument("--backend", choices=["ekf", "ukf", "fgs"], help="backend (default: the rig's)")
    p.add_argument("--rig", help="rig TOML (default: the configuration stored in the log header)")
    p.add_argument("--out", required=True, help="output log")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    pipe = estimate_log(args.log, args.out, args.backend, args.rig)
    n_est = pipe.seq
    kinds = ("malformed", "duplicate", "late", "future", "past")
    bad = {t: {k: getattr(s, k) for k in kinds if getattr(s, k)} | dict(s.errors) for t, s in pipe.stats.items()}
    bad = {t: d for t, d in bad.items() if d}
    print(f"{args.out}: {n_est} est/state messages from backend {pipe.backend_name}"
          + (f"; inputs dropped: {bad}" if bad else "")
          + (f"; {pipe.resets} resets (last: {pipe.last_reset})" if pipe.resets else ""), file=sys.stdout)
    return 0

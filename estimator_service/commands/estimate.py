"""``rigstate estimate``: run a log through a backend offline (the daemon's code path), through the
Python API's :func:`estimator_service.api.estimate`."""

from __future__ import annotations

import argparse
import json
import sys

from estimator_service.analysis import format_summary
from estimator_service.api import estimate
from estimator_service.rig import BACKENDS


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "estimate",
        help="run a recorded log through a backend and write est/state into a new log",
        description="Runs LOG through the backend exactly as the live daemon does and writes OUT with "
        "the input records plus est/state messages. The input's own estimator output (est/state, est/diag "
        "of a live recording) is left out unless --keep-estimates. Deterministic: same input, same bytes. "
        "Prints a summary: per-DOF RMSE and max error against truth/state or a non-fused encoder on the DOF, "
        "status counts, step-time p50/p99 (docs/report.md).",
    )
    p.add_argument("log", help="input log (from record, simulate or log import)")
    p.add_argument("--backend", choices=BACKENDS, help="backend (default: the rig's)")
    p.add_argument("--rig", help="rig TOML (default: the configuration stored in the log header)")
    p.add_argument("--out", required=True, help="output log")
    p.add_argument("--keep-estimates", action="store_true",
                   help="keep the input's est/state and est/diag records (mixed with the new est/state)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON on stdout (for scripts)")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    result = estimate(args.log, rig=args.rig, backend=args.backend, out=args.out, keep_estimates=args.keep_estimates,
                      progress=True, keep_states=False)
    summary, pipe = result.summary, result.pipeline
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    bad = summary["dropped_inputs"]
    print(f"{args.out}: {pipe.seq} est/state messages from backend {pipe.backend_name}"
          + (f"; inputs dropped: {bad}" if bad else "")
          + (f"; {pipe.resets} resets (last: {pipe.last_reset})" if pipe.resets else ""), file=sys.stdout)
    print(format_summary(summary))
    return 0

"""``rigstate estimate``: run a log through a backend offline (the daemon's code path)."""

from __future__ import annotations

import argparse
import json
import sys

from estimator_service.analysis import AccuracyAccumulator, format_summary
from estimator_service.offline import EstimateRecord, estimate_log
from estimator_service.pipeline import Pipeline
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
    accs: list[AccuracyAccumulator] = []

    def watch(pipe: Pipeline):
        acc = AccuracyAccumulator(pipe.rig, pipe.model)
        accs.append(acc)
        scored = 0

        def observe(rec: EstimateRecord) -> None:
            nonlocal scored
            if rec.topic == "est/state":
                # the pipeline's own estimates follow the input that completed them (pipe.seq counts
                # them); est/state copied from the input log (a recorded live run) is not scored
                if scored == pipe.seq:
                    return
                scored += 1
            acc.add_raw(rec.topic, rec.payload)
        return observe

    pipe = estimate_log(args.log, args.out, args.backend, args.rig, args.keep_estimates, watch=watch)
    summary = accs[0].summary()
    summary["step_us"] = {"steps": pipe.times.count, **pipe.times.summary_us()}
    summary["backend"] = pipe.backend_name
    summary["out"] = str(args.out)
    kinds = ("malformed", "duplicate", "late", "future", "past")
    bad = {t: {k: getattr(s, k) for k in kinds if getattr(s, k)} | dict(s.errors) for t, s in pipe.stats.items()}
    bad = {t: d for t, d in bad.items() if d}
    summary["dropped_inputs"] = bad
    summary["resets"] = pipe.resets
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    print(f"{args.out}: {pipe.seq} est/state messages from backend {pipe.backend_name}"
          + (f"; inputs dropped: {bad}" if bad else "")
          + (f"; {pipe.resets} resets (last: {pipe.last_reset})" if pipe.resets else ""), file=sys.stdout)
    print(format_summary(summary))
    return 0

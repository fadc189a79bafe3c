"""``rigstate report``: figures and a self-contained HTML page for a log with estimates."""

from __future__ import annotations

import argparse

from estimator_service.rig import BACKENDS



def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "report",
        help="figures (PNG) and one HTML page: estimates vs truth/encoders, errors, rates, residuals, timing",
        description="Draws every DOF's estimate against truth/state or a non-fused encoder, the error with "
        "its RMSE, input rates, further estimated states with 1σ bands, residuals per fused sensor, step "
        "times and latency, status changes. A log without est/state is estimated first (docs/report.md).",
    )
    p.add_argument("log", help="log with est/state (from estimate or record), or a raw log to estimate here")
    p.add_argument("--out", default="report", help="output directory (default ./report)")
    p.add_argument("--backend", choices=BACKENDS,
                   help="(re-)estimate with this backend here, which also times each step")
    p.add_argument("--rig", help="rig TOML (default: the configuration stored in the log header)")
    p.add_argument("--dpi", type=int, default=100, help="resolution of the PNGs (default 100)")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from estimator_service.analysis import format_summary
    from estimator_service.report import load_series, write_report  # matplotlib: only when used

    ls = load_series(args.log, args.backend, args.rig)
    page, pngs = write_report(ls, args.out, args.dpi)
    print(format_summary(ls.accuracy.summary(ls.step_seconds)))
    print(f"wrote {page} and {len(pngs)} figures: {', '.join(p.name for p in pngs.values())}")
    return 0

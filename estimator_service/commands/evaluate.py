"""``rigstate evaluate``: run a grid of scenarios × seeds × backends × settings in parallel."""

from __future__ import annotations

import argparse
import os
import sys
import time



def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "evaluate",
        help="run a grid of scenarios x seeds x backends x settings in parallel; CSV, JSON, figures",
        description="Runs every job of GRID.toml (simulated rigs or recorded logs, seeds, backends, "
        "estimator settings) on a local process pool or a Dask distributed cluster and writes "
        "results.csv, results.json and summary figures (docs/report.md).",
    )
    p.add_argument("grid", help="grid TOML")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                   help="local worker processes (default: the number of CPUs)")
    p.add_argument("--cluster", help="Dask scheduler address, e.g. tcp://10.0.0.5:8786 (instead of the local pool)")
    p.add_argument("--out", default="evaluation", help="output directory (default ./evaluation)")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from estimator_service.evaluate import format_rows, load_grid, run_grid, write_results  # matplotlib, lazily

    jobs = load_grid(args.grid)
    where = f"Dask cluster {args.cluster}" if args.cluster else f"{args.workers} local worker(s)"
    print(f"{len(jobs)} jobs on {where}", flush=True)

    def progress(row: dict) -> None:
        state = f"error: {row['error']}" if row["error"] else f"{row['wall_s']:.1f} s"
        print(f"  [{row['index'] + 1}/{len(jobs)}] {row['scenario']} seed {row['seed']} {row['backend']} "
              f"{row['settings']}: {state}", file=sys.stderr, flush=True)

    t0 = time.perf_counter()
    rows = run_grid(jobs, args.workers, args.cluster, progress)
    wall = time.perf_counter() - t0
    meta = {"grid": str(args.grid), "jobs": len(jobs), "workers": None if args.cluster else args.workers,
            "cluster": args.cluster, "wall_s": wall, "cpu_count": os.cpu_count()}
    paths = write_results(rows, args.out, meta)
    print(format_rows(rows))
    print(f"{len(rows)} jobs in {wall:.1f} s on {where}; wrote {', '.join(str(p) for p in paths.values())}")
    failed = sum(1 for r in rows if r["error"])
    return 1 if failed else 0

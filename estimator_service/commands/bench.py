"""``rigstate bench``: time and accuracy of every backend on the public scenario (and on given logs)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from estimator_service import schema
from estimator_service.errors import UserError
from estimator_service.bench import bench_log, format_table, write_json
from estimator_service.logfile import LogWriter
from estimator_service.paths import config_dir
from estimator_service.rig import load_rig
from estimator_service.simulate import simulate

SCENARIOS = {"gyros": "fourbar-sensors2016.toml", "gyros+acc": "fourbar-sensors2016-acc.toml",
             # wrong models and clocks (issue 15) and real-sensor effects (issue 10): config/rigs/scenarios/
             **{name: f"scenarios/{name}.toml" for name in (
                 "crank-inertia+20", "crank-inertia-20", "coupler-mass+10", "imu-late-4ms", "wrong-model-all",
                 "biases-friction", "biases-outliers", "biases-acc")}}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench",
        help="benchmark the backends: time per 1 ms step, real-time factor, RMSE vs truth",
        description="Simulates the public scenario (Sensors-2016 testbed, 20 s, gyros only and gyros + "
        "accelerometer; cached) and runs every backend on it exactly as 'rigstate estimate' does. Prints a "
        "table; --json writes a list of records.",
    )
    p.add_argument("logs", nargs="*", help="extra logs with truth/state to bench on as well")
    p.add_argument("--backends", default="fgs,ekf,ukf,errekf", help="comma-separated backends (default fgs,ekf,ukf,errekf)")
    p.add_argument("--scenarios", default="gyros,gyros+acc", help=f"public scenarios to run, of {list(SCENARIOS)} or 'all'")
    p.add_argument("--duration", type=float, help="seconds of the public scenario (default: the rig's 20 s)")
    p.add_argument("--cache-dir", default=os.environ.get("RIGSTATE_CACHE", str(Path.home() / ".cache" / "rigstate")),
                   help="where simulated scenario logs are kept")
    p.add_argument("--json", help="write the records as JSON here")
    p.set_defaults(func=_run)


def scenario_log(name: str, cache: Path, duration: float | None) -> Path:
    """The simulated log of a public scenario (simulated once, then reused)."""
    rig = load_rig(config_dir() / "rigs" / SCENARIOS[name])
    dur = rig.simulation.duration_s if duration is None else duration
    path = cache / f"{rig.name}-{dur:g}s-seed{rig.simulation.seed}.log"
    if not path.exists():
        cache.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".part")
        header = rig.header({"command": "bench", "duration_s": dur, "seed": rig.simulation.seed})
        with LogWriter(tmp, header) as w:
            for topic, msg in simulate(rig=rig, duration=dur):
                w.write(topic, msg["t"], schema.encode(topic, msg))
        tmp.rename(path)
    return path


def _run(args: argparse.Namespace) -> int:
    backends = [b for b in args.backends.split(",") if b]
    records = []
    names = list(SCENARIOS) if args.scenarios == "all" else [s for s in args.scenarios.split(",") if s]
    unknown = [s for s in names if s not in SCENARIOS]
    if unknown:
        raise UserError(f"--scenarios: unknown scenario {unknown[0]!r}; scenarios are {list(SCENARIOS)} or 'all'")
    runs = [(scenario_log(s, Path(args.cache_dir), args.duration), s) for s in names]
    runs += [(Path(p), Path(p).name) for p in args.logs]
    for log, label in runs:
        for b in backends:
            rec = bench_log(log, b, label)
            records.append(rec)
            print(format_table([rec]).splitlines()[2], flush=True)
    print()
    print(format_table(records))
    if args.json:
        write_json(records, args.json)
        print(f"wrote {args.json}")
    return 0

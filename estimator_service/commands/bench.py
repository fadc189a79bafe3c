"""``rigstate bench``: time and accuracy of every backend on the public scenario (and on given logs)."""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict
from pathlib import Path

from estimator_service import schema
from estimator_service.backends import REGISTRY
from estimator_service.bound import bound_log
from estimator_service.bench import TABLE_HEADER, TABLE_NOTE, bench_log, format_row, write_json
from estimator_service.errors import UserError
from estimator_service.generate import ladder_rig_toml, ladder_yaml
from estimator_service.logfile import LogWriter
from estimator_service.names import file_stem
from estimator_service.paths import config_dir
from estimator_service.rig import load_rig
from estimator_service.simulate import simulate
from estimator_service.soak import soak

SCENARIOS = {"gyros": "fourbar-sensors2016.toml", "gyros+acc": "fourbar-sensors2016-acc.toml",
             # wrong models and clocks (issue 15) and real-sensor effects (issue 10): config/rigs/scenarios/
             **{name: f"scenarios/{name}.toml" for name in (
                 "crank-inertia+20", "crank-inertia-20", "coupler-mass+10", "imu-late-4ms", "wrong-model-all",
                 "biases-friction", "biases-outliers", "biases-acc",
                 # everything at once, the coupler IMU mounted 3° off (issue 35): gyros only, the accelerometer fused,
                 # each with the IMUs' common 4 ms delay and without it
                 "combined", "combined-acc", "combined-nodelay", "combined-acc-nodelay")}}


#: ``--scaling``: mechanisms of growing size (rig TOML under config/rigs/, or the bodies of a generated ladder)
SCALING: dict[str, str | int] = {"four-bar": SCENARIOS["gyros"], "slider-crank": "scaling/slider-crank.toml",
                                 "ladder-5": 5, "ladder-11": 11, "ladder-21": 21}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench",
        help="benchmark the backends: time per 1 ms step, real-time factor, RMSE vs truth",
        description="Simulates the public scenario (Sensors-2016 testbed, 20 s, gyros only and gyros + "
        "accelerometer; cached) and runs every backend on it exactly as 'rigstate estimate' does. Given LOGs, "
        "benches those only (add --scenarios to run the public scenario as well). Prints a table, one row per "
        "run as it finishes; --json writes a list of records.",
    )
    p.add_argument("logs", nargs="*", metavar="LOG",
                   help="logs with truth/state to bench on (then no public scenario unless --scenarios is given)")
    p.add_argument("--backends", default=",".join(REGISTRY), help=f"comma-separated backends (default {','.join(REGISTRY)})")
    p.add_argument("--scenarios", help=f"comma-separated public scenarios, of {list(SCENARIOS)}, or 'all' "
                   "(default: gyros,gyros+acc, or none when LOGs are given)")
    p.add_argument("--duration", type=float, help="seconds of the public scenario (default: the rig's 20 s)")
    p.add_argument("--cache-dir", default=str(default_cache_dir()),
                   help="where simulated scenario logs are kept (default: $RIGSTATE_CACHE, else ~/.cache/rigstate)")
    p.add_argument("--reference", action="store_true",
                   help="also run every backend on the numpy reference path (kernels off), right after its compiled "
                   "run: the speed-up of the compiled kernels measured side by side (config marked 'numpy')")
    p.add_argument("--scaling", action="store_true",
                   help="instead: the cost per step against mechanism size, every backend on 5 s of each of "
                   f"{list(SCALING)} (ladder-N: 'rigstate model ladder --bodies N'); with --reference, "
                   "on the numpy path as well")
    p.add_argument("--bound", action="store_true",
                   help="instead: the posterior Cramér–Rao bound of each scenario or LOG under each backend's "
                   "priors (estimator_service/bound.py): the RMSE no estimator with those priors can beat on "
                   "average over the scenario's unknowns, over the moving part and per time window")
    p.add_argument("--json", help="write the records as JSON here")
    p.add_argument("--soak", type=float, metavar="MINUTES",
                   help="instead: run the live pipeline (driver sim -> estimator processes) for MINUTES per "
                   "backend and report the estimator's RSS slope (kB/s) and step times as JSON")
    p.add_argument("--latency", type=float, metavar="SECONDS",
                   help="instead: the end-to-end latency of the live pipeline (driver sim --precompute -> estimator "
                   "processes), SECONDS per backend after a 2 s warm-up: est/state arrival less truth/state arrival "
                   "at the same sensor time (ms: p50, p99, max), beside the backend's declared latency; JSON")
    p.add_argument("--rig", default=str(config_dir() / "rigs" / SCENARIOS["gyros"]),
                   help="rig TOML of the soak or latency run (default: the public scenario)")
    p.set_defaults(func=_run)


def default_cache_dir() -> Path:
    """Where simulated scenario logs are kept unless told otherwise: ``$RIGSTATE_CACHE``, else ``~/.cache/rigstate``."""
    return Path(os.environ.get("RIGSTATE_CACHE", str(Path.home() / ".cache" / "rigstate")))


def scenario_log(name: str, cache: Path, duration: float | None) -> Path:
    """The simulated log of a public scenario (simulated once, then reused)."""
    return simulated_log(config_dir() / "rigs" / SCENARIOS[name], cache, duration)


def scaling_log(name: str, cache: Path, duration: float | None) -> Path:
    """The simulated log of a ``--scaling`` mechanism (a generated ladder is written to ``cache``)."""
    what = SCALING[name]
    if isinstance(what, str):
        return simulated_log(config_dir() / "rigs" / what, cache, duration)
    cache.mkdir(parents=True, exist_ok=True)
    mech = cache / f"ladder-{what}.yaml"
    mech.write_text(ladder_yaml(what))
    rig = cache / f"ladder-{what}.toml"
    rig.write_text(ladder_rig_toml(what, mech.name))
    return simulated_log(rig, cache, duration)


def simulated_log(rig_path: Path, cache: Path, duration: float | None) -> Path:
    """The simulated log of a rig (simulated once, then reused from ``cache``)."""
    rig = load_rig(rig_path)
    dur = rig.simulation.duration_s if duration is None else duration
    path = cache / f"{file_stem(rig.name)}-{dur:g}s-seed{rig.simulation.seed}.log"
    if not path.exists():
        cache.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.part")  # two benches may simulate the same log at once
        header = rig.header({"command": "bench", "duration_s": dur, "seed": rig.simulation.seed})
        with LogWriter(tmp, header) as w:
            for topic, msg in simulate(rig=rig, duration=dur):
                w.write(topic, msg["t"], schema.encode(topic, msg))
        tmp.replace(path)  # atomic: a reader sees the whole log or none
    return path


def _run(args: argparse.Namespace) -> int:
    backends = [b for b in args.backends.split(",") if b]
    unknown = sorted(set(backends) - set(REGISTRY))
    if unknown:
        raise UserError(f"--backends: unknown backend {unknown[0]!r}; backends are {sorted(REGISTRY)}")
    if args.soak is not None and args.latency is not None:
        raise UserError("--soak and --latency: give one of them")
    if args.bound and (args.scaling or args.reference or args.soak is not None or args.latency is not None):
        raise UserError("--bound: not with --scaling, --reference, --soak or --latency")
    if args.soak is not None or args.latency is not None:
        return _soak(args, backends)
    if args.scaling:
        runs = [(scaling_log(name, Path(args.cache_dir), args.duration), name) for name in SCALING]
        return _bench(args, backends, runs)
    if args.duration is not None and args.duration <= 0:
        raise UserError(f"--duration: must be > 0 s, got {args.duration}")
    scenarios = args.scenarios if args.scenarios is not None else ("" if args.logs else "gyros,gyros+acc")
    names = list(SCENARIOS) if scenarios == "all" else [s for s in scenarios.split(",") if s]
    for s in names:
        if s not in SCENARIOS:
            raise UserError(f"--scenarios: unknown scenario {s!r}; scenarios are {list(SCENARIOS)} or 'all'")
    for p in args.logs:
        if not Path(p).is_file():
            raise UserError(f"{p}: no such log file")
    if not names and not args.logs:
        raise UserError("nothing to bench: give LOGs or --scenarios")
    runs = [(scenario_log(s, Path(args.cache_dir), args.duration), s) for s in names]
    runs += [(Path(p), Path(p).name) for p in args.logs]
    if args.bound:
        return _bound(args, backends, runs)
    return _bench(args, backends, runs)


def _bound(args: argparse.Namespace, backends: list[str], runs: list[tuple[Path, str]]) -> int:
    """``--bound``: one row per (log, backend's priors): the bound's RMSE per DOF and per window."""
    records = []
    for log, label in runs:
        for b in backends:
            rec = bound_log(log, label, b)
            records.append(rec)
            dof = ", ".join(f"{k} {v:.3f}" for k, v in rec.rmse_dof.items())
            win = "  ".join(f"{w}: " + ", ".join(f"{v:.3f}" for v in vals.values()) for w, vals in rec.windows.items())
            print(f"{b:7} {label[:22]:22} bound {dof}   | {win}", flush=True)
    print("bound: RMSE (° or m) over the moving part that no estimator with the backend's priors can beat on "
          "average; then per window of sensor time")
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in records], indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


def _bench(args: argparse.Namespace, backends: list[str], runs: list[tuple[Path, str]]) -> int:
    """Bench every backend on every (log, label); the table on stdout, the records to --json."""
    records = []
    print(TABLE_HEADER)
    print("-" * len(TABLE_HEADER), flush=True)
    for log, label in runs:
        for b in backends:
            for reference in (False, True) if args.reference else (False,):
                rec = bench_log(log, b, f"{label} numpy" if reference else label, reference=reference, freeze=True)
                if args.scaling:  # the size in the label: the table is the scaling table
                    rec.config = f"{label} n{rec.size['n']}{' numpy' if reference else ''}"
                records.append(rec)
                print(format_row(rec), flush=True)
    print(TABLE_NOTE)
    if args.json:
        write_json(records, args.json)
        print(f"wrote {args.json}")
    return 0


def _soak(args: argparse.Namespace, backends: list[str]) -> int:
    """``--soak MINUTES`` or ``--latency SECONDS``: one live run per backend, one after the other; JSON
    on stdout (and --json)."""
    if args.soak is not None and not args.soak > 0:
        raise UserError(f"--soak: expected minutes > 0, got {args.soak}")
    if args.latency is not None and not args.latency > 0:
        raise UserError(f"--latency: expected seconds > 0, got {args.latency}")
    load_rig(args.rig)  # a bad rig is a clear error before any process starts
    reports = []
    for b in backends:
        if args.latency is not None:
            reports.append(soak(args.rig, b, (args.latency + 2.0) / 60.0, warmup_s=2.0, precompute=True))
        else:
            reports.append(soak(args.rig, b, args.soak))
        print(json.dumps(reports[-1]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(reports, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0

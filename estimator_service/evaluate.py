"""``rigstate evaluate``: a grid of runs (scenarios × seeds × backends × estimator settings) in parallel.

The grid is a TOML file (docs/report.md)::

    [grid]
    backends = ["ekf", "fgs"]          # default: all backends
    seeds = [1, 2, 3]                  # simulated scenarios only (default: each rig's own seed)
    duration_s = 5.0                   # simulated scenarios only (default: each rig's duration_s)

    [[scenario]]
    name = "public"
    rig = "../config/rigs/fourbar-sensors2016.toml"   # simulated, paths relative to the grid file

    [[scenario]]
    name = "lab"
    log = "runs/lab.log"               # a recorded log (seeds and duration_s do not apply)

    [[settings]]
    name = "default"                   # no overrides

    [[settings]]
    name = "fgs-100ms"
    backends = ["fgs"]                 # only with these backends (default: all of the grid's)
    fgs = { window_ms = 100 }          # overrides of [estimator.fgs]; also ekf = {…}, ukf = {…}

Every job (one row of the results) is self-contained: it simulates its scenario (same seed, same
data) or reads its log, runs the backend exactly as ``rigstate estimate`` does and scores it with
:class:`~estimator_service.analysis.AccuracyAccumulator`.  Jobs run on a local process pool
(``workers``) or on a Dask distributed cluster (``cluster`` = scheduler address; the workers need
rigstate installed and must be able to read the grid's rig/mechanism/log files).
"""

from __future__ import annotations

import copy
import csv
import json
import math
import multiprocessing
import os
import time
import tomllib
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure

from estimator_service import schema
from estimator_service.analysis import AccuracyAccumulator
from estimator_service.errors import ConfigError, UserError
from estimator_service.logfile import Record, read_log
from estimator_service.offline import rig_of_log, run_log
from estimator_service.pipeline import Pipeline
from estimator_service.rig import BACKENDS, Rig, load_rig
from estimator_service.simulate import simulate
from estimator_service.paths import make_output_dir


CONNECT_TIMEOUT_S = 10  #: how long to try reaching a Dask scheduler


@dataclass(frozen=True)
class Job:
    """One run of the grid (picklable: plain data only)."""

    index: int
    scenario: str
    kind: str  #: "rig" (simulated) or "log"
    path: str  #: absolute path of the rig TOML or the log
    seed: int | None
    duration_s: float | None
    backend: str
    settings: str
    overrides: tuple[tuple[str, object], ...]  #: [estimator.<backend>] keys to override


def _rig(job: Job) -> Rig:
    if job.kind == "rig":
        return load_rig(job.path)
    return rig_of_log(read_log(job.path).header, job.path)


def _records(job: Job, rig: Rig) -> Iterator[Record]:
    if job.kind == "log":
        yield from read_log(job.path)
        return
    for topic, msg in simulate(rig=rig, duration=job.duration_s, seed=job.seed):
        yield Record(topic, msg["t"], schema.encode(topic, msg))


def run_job(job: Job) -> dict:
    """Run one job; a flat result row (per-DOF columns ``rmse_<dof>``, ``max_<dof>`` in ° or m)."""
    row: dict = {"index": job.index, "scenario": job.scenario, "kind": job.kind, "seed": job.seed,
                 "backend": job.backend, "settings": job.settings, "host": os.uname().nodename, "error": ""}
    c0 = time.perf_counter()
    try:
        rig = _rig(job)
        getattr(rig.estimator, job.backend).update(dict(job.overrides))
        pipe = Pipeline(rig, job.backend)
        acc = AccuracyAccumulator(rig, pipe.model)
        for rec in run_log(pipe, _records(job, rig)):
            acc.add_raw(rec.topic, rec.payload)
    except Exception as exc:  # noqa: BLE001 - a failed job is a row with its error, the grid goes on
        row["error"] = f"{type(exc).__name__}: {exc}"[:500]
        row["wall_s"] = time.perf_counter() - c0
        return row
    s = acc.summary()
    s["step_us"] = {"steps": pipe.times.count, **pipe.times.summary_us()}
    data_s = pipe.times.count * pipe.dt
    wall = time.perf_counter() - c0
    row.update({"data_s": data_s, "wall_s": wall, "estimates": s["estimates"],
                "step_us_mean": s["step_us"]["mean"], "step_us_p50": s["step_us"]["p50"],
                "step_us_p99": s["step_us"]["p99"], "step_us_max": s["step_us"]["max"]})
    for st in ("ok", "degraded", "reinit"):
        row[f"status_{st}"] = s["status"].get(st, 0)
    for d in s["dofs"]:
        row[f"rmse_{d['name']}"] = d["rmse"]
        row[f"max_{d['name']}"] = d["max_abs"]
        row[f"unit_{d['name']}"] = d["unit"]
        row[f"reference_{d['name']}"] = d["reference"]
    return row


@dataclass
class TruthScore:
    """One run scored against its ``truth/state`` (:func:`score_against_truth`)."""

    rmse_deg: float  #: RMSE of the scored estimates (deg)
    within: float  #: share of them with |error| <= 3σ of their own P_z
    ok: float  #: share of them whose quality is ok
    status: set[str]  #: the statuses they carried
    reinit: int  #: the backend's re-initialisations
    n: int  #: how many estimates were scored
    last_t: float  #: the last estimate's time (s), scored or not
    pipeline: Pipeline = field(repr=False)  #: the pipeline, for its counters and its backend


def score_against_truth(rig: Rig, records: list[tuple[str, bytes]], backend: str, settle_s: float = 0.1) -> TruthScore:
    """The ``(topic, payload)`` records of a simulated run through a :class:`Pipeline` with ``backend``, as
    ``rigstate estimate`` steps them, and the first DOF (an angle, rad) of every estimate later than ``settle_s`` (s) scored against the truth of its
    millisecond.  The one scoring of tools/drive_inputs.py (docs/config.md's table) and the drive tests."""
    pipe = Pipeline(rig, backend)
    truth: dict[int, float] = {}
    err: list[float] = []
    within: list[bool] = []
    ok: list[bool] = []
    status: set[str] = set()
    last = 0.0
    for topic, payload in records:
        if topic == "truth/state":
            m = schema.decode(topic, payload)
            truth[round(m["t"] * 1000)] = m["z"][0]
        for e in pipe.feed_raw(topic, payload):
            last = e["t"]
            ref = truth.get(round(e["t"] * 1000))
            if ref is not None and e["t"] > settle_s:
                d = e["z"][0] - ref
                err.append(d)
                within.append(abs(d) <= 3 * math.sqrt(e["P_z"][0]))
                ok.append(e["quality"] == "ok")
                status.add(e["status"])
    return TruthScore(rmse_deg=math.degrees(math.sqrt(np.mean(np.square(err)))), within=float(np.mean(within)),
                      ok=float(np.mean(ok)), status=status, reinit=pipe.backend.reinit_count, n=len(err), last_t=last,
                      pipeline=pipe)


# ------------------------------------------------------------------------------------------ the grid
def _str_list(f: str, field: str, v: object, allowed: tuple[str, ...] | None = None) -> list[str]:
    if not isinstance(v, list) or not v or not all(isinstance(x, str) for x in v):
        raise ConfigError(f, field, f"expected a non-empty list of strings, got {v!r}")
    for x in v:
        if allowed is not None and x not in allowed:
            raise ConfigError(f, field, f"unknown backend {x!r}; backends are {list(allowed)}")
    return list(v)


def load_grid(path: str | Path) -> list[Job]:
    """Parse and check a grid TOML (ConfigError naming file, field and value); the jobs in order."""
    path = Path(path)
    f = str(path)
    try:
        doc = tomllib.loads(path.read_text())
    except OSError as exc:
        raise ConfigError(f, "", f"cannot read: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f, "", f"TOML syntax error: {exc}") from None
    unknown = set(doc) - {"grid", "scenario", "settings"}
    if unknown:
        raise ConfigError(f, sorted(unknown)[0], "unknown table; known: ['grid', 'scenario', 'settings']")
    grid = doc.get("grid", {})
    if not isinstance(grid, dict):
        raise ConfigError(f, "grid", f"expected a table, got {grid!r}")
    bad = set(grid) - {"backends", "seeds", "duration_s"}
    if bad:
        raise ConfigError(f, f"grid.{sorted(bad)[0]}", "unknown key; known keys: ['backends', 'duration_s', 'seeds']")
    backends = _str_list(f, "grid.backends", grid.get("backends", list(BACKENDS)), BACKENDS)
    seeds = grid.get("seeds")
    if seeds is not None and (not isinstance(seeds, list) or not seeds or
                              not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in seeds)):
        raise ConfigError(f, "grid.seeds", f"expected a non-empty list of integers >= 0, got {seeds!r}")
    duration = grid.get("duration_s")
    if duration is not None and (isinstance(duration, bool) or not isinstance(duration, (int, float)) or not duration > 0):
        raise ConfigError(f, "grid.duration_s", f"expected a number > 0, got {duration!r}")
    scenarios = doc.get("scenario")
    if not isinstance(scenarios, list) or not scenarios or not all(isinstance(s, dict) for s in scenarios):
        raise ConfigError(f, "scenario", "expected at least one [[scenario]] with name and rig or log")
    settings = doc.get("settings", [{"name": "default"}])
    if not isinstance(settings, list) or not all(isinstance(s, dict) for s in settings):
        raise ConfigError(f, "settings", "expected [[settings]] tables")
    rigs: dict[int, Rig] = {}
    for i, sc in enumerate(scenarios):
        field = f"scenario[{i}]"
        bad = set(sc) - {"name", "rig", "log"}
        if bad:
            raise ConfigError(f, f"{field}.{sorted(bad)[0]}", "unknown key; known keys: ['log', 'name', 'rig']")
        if not isinstance(sc.get("name"), str) or not sc["name"]:
            raise ConfigError(f, f"{field}.name", f"expected a non-empty string, got {sc.get('name')!r}")
        if ("rig" in sc) == ("log" in sc):
            raise ConfigError(f, field, "give exactly one of rig = RIG.toml (simulated) or log = LOG")
        key = "rig" if "rig" in sc else "log"
        if not isinstance(sc[key], str):
            raise ConfigError(f, f"{field}.{key}", f"expected a path, got {sc[key]!r}")
        p = (path.parent / sc[key]).resolve()
        if not p.is_file():
            raise ConfigError(f, f"{field}.{key}", f"no such file: {p}")
        sc["_path"], sc["_kind"] = str(p), key
        try:
            rigs[i] = load_rig(p) if key == "rig" else rig_of_log(read_log(p).header, p)
        except UserError as exc:
            raise ConfigError(f, f"{field}.{key}", str(exc)) from None
    for j, st in enumerate(settings):
        field = f"settings[{j}]"
        bad = set(st) - {"name", "backends", *BACKENDS}
        if bad:
            raise ConfigError(f, f"{field}.{sorted(bad)[0]}", f"unknown key; known keys: {sorted({'name', 'backends', *BACKENDS})}")
        if not isinstance(st.get("name"), str) or not st["name"]:
            raise ConfigError(f, f"{field}.name", f"expected a non-empty string, got {st.get('name')!r}")
        st["_backends"] = _str_list(f, f"{field}.backends", st.get("backends", backends), BACKENDS)
        for b in BACKENDS:
            if b in st and not isinstance(st[b], dict):
                raise ConfigError(f, f"{field}.{b}", f"expected a table of [estimator.{b}] keys, got {st[b]!r}")
            for rig in rigs.values():  # the overrides must make a valid backend for every scenario
                if b in st and b in st["_backends"] and b in backends:
                    est = replace(rig.estimator, **{b: {**getattr(rig.estimator, b), **st[b]}})
                    try:
                        trial = copy.copy(rig)
                        trial.estimator = est
                        Pipeline(trial, b)
                    except ConfigError as exc:
                        raise ConfigError(f, f"{field}.{b}", exc.problem) from None
    jobs: list[Job] = []
    for i, sc in enumerate(scenarios):
        sim = sc["_kind"] == "rig"
        for seed in (seeds or [rigs[i].simulation.seed]) if sim else [None]:
            for b in backends:
                for st in settings:
                    if b not in st["_backends"]:
                        continue
                    jobs.append(Job(len(jobs), sc["name"], sc["_kind"], sc["_path"], seed,
                                    float(duration) if sim and duration is not None else None, b, st["name"],
                                    tuple(sorted(st.get(b, {}).items()))))
    return jobs


# ------------------------------------------------------------------------------------------ running
def run_grid(jobs: list[Job], workers: int = 1, cluster: str | None = None,
             on_result: Callable[[dict], None] | None = None) -> list[dict]:
    """Run every job on a local process pool of ``workers`` or on the Dask cluster at ``cluster``;
    rows in job order.  ``on_result`` sees each row as it completes."""
    rows: list[dict] = []
    if cluster:
        try:
            from distributed import Client, as_completed as dask_completed
        except ImportError:  # pragma: no cover - distributed is a dependency
            raise UserError("--cluster needs the 'distributed' package (pip install distributed)") from None
        try:
            client = Client(cluster, timeout=CONNECT_TIMEOUT_S)
        except (OSError, TimeoutError) as exc:
            raise UserError(f"--cluster {cluster}: cannot connect to the Dask scheduler: {exc}") from None
        with client:
            futures = client.map(run_job, jobs, pure=False)
            for fut in dask_completed(futures):
                rows.append(fut.result())
                if on_result:
                    on_result(rows[-1])
    else:
        if workers < 1:
            raise UserError(f"--workers must be >= 1, got {workers}")
        ctx = multiprocessing.get_context("spawn")  # the workers inherit one BLAS thread (estimator_service)
        with ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
            futures = [pool.submit(run_job, j) for j in jobs]
            for fut in as_completed(futures):
                rows.append(fut.result())
                if on_result:
                    on_result(rows[-1])
    return sorted(rows, key=lambda r: r["index"])


def dof_columns(rows: list[dict]) -> list[tuple[str, str]]:
    """(DOF name, unit) of every ``rmse_<dof>`` column, in first-seen order."""
    out: dict[str, str] = {}
    for r in rows:
        for k in r:
            if k.startswith("rmse_"):
                out.setdefault(k[5:], r.get(f"unit_{k[5:]}", ""))
    return list(out.items())


def write_results(rows: list[dict], out_dir: str | Path, meta: dict) -> dict[str, Path]:
    """``results.csv``, ``results.json`` (meta + rows) and the summary figures in ``out_dir``."""
    out = Path(out_dir)
    make_output_dir(out)
    cols: list[str] = []
    for r in rows:
        cols += [k for k in r if k not in cols]
    paths = {"csv": out / "results.csv", "json": out / "results.json"}
    with open(paths["csv"], "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=cols)
        w.writeheader()
        for r in rows:
            w.writerow({k: ("" if r.get(k) is None else r.get(k, "")) for k in cols})
    paths["json"].write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    if any(not r["error"] for r in rows):
        paths["rmse"] = out / "rmse-by-backend.png"
        fig_rmse_by_backend(rows).savefig(paths["rmse"], dpi=100)
        paths["accuracy_vs_time"] = out / "accuracy-vs-step-time.png"
        fig_accuracy_vs_time(rows).savefig(paths["accuracy_vs_time"], dpi=100)
    return paths


def _ok(rows: list[dict], dof: str) -> list[dict]:
    return [r for r in rows if not r["error"] and r.get(f"rmse_{dof}") is not None and math.isfinite(r[f"rmse_{dof}"])]


def fig_rmse_by_backend(rows: list[dict]) -> Figure:
    """Per DOF: distribution (box + points) of the RMSE over the grid, one box per backend."""
    dofs = dof_columns(rows) or [("-", "")]
    fig = Figure(figsize=(6.5 * len(dofs) + 1.0, 4.0), layout="constrained")
    axes = np.atleast_1d(fig.subplots(1, len(dofs)))
    for ax, (dof, unit) in zip(axes, dofs, strict=True):
        ok = _ok(rows, dof)
        backends = sorted({r["backend"] for r in ok})
        data = [[r[f"rmse_{dof}"] for r in ok if r["backend"] == b] for b in backends]
        if data:
            ax.boxplot(data, tick_labels=backends)
            for k, d in enumerate(data, start=1):
                ax.plot(np.full(len(d), k) + np.linspace(-0.08, 0.08, len(d)), d, "o", ms=4, alpha=0.6,
                        label=f"{backends[k - 1]}: {len(d)} runs, median {np.median(d):.3g} {unit}")
            ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
        ax.set_xlabel("backend")
        ax.set_ylabel(f"RMSE of {dof} ({unit})")
        ax.set_title(f"{dof}: RMSE over scenarios × seeds × settings")
        ax.grid(alpha=0.3)
    return fig


def fig_accuracy_vs_time(rows: list[dict]) -> Figure:
    """Per DOF: RMSE against p99 step time, one marker series per backend × settings."""
    dofs = dof_columns(rows) or [("-", "")]
    fig = Figure(figsize=(5.5 * len(dofs) + 1.5, 4.2), layout="constrained")
    axes = np.atleast_1d(fig.subplots(1, len(dofs)))
    markers = "osD^v<>"
    for ax, (dof, unit) in zip(axes, dofs, strict=True):
        ok = _ok(rows, dof)
        groups = sorted({(r["backend"], r["settings"]) for r in ok})
        for k, (b, st) in enumerate(groups):
            sel = [r for r in ok if (r["backend"], r["settings"]) == (b, st)]
            ax.plot([r["step_us_p99"] for r in sel], [r[f"rmse_{dof}"] for r in sel], markers[k % len(markers)],
                    ls="none", alpha=0.75, label=f"{b} / {st}")
        ax.axvline(1000.0, color="tab:red", lw=1.0, label="1 ms step")
        ax.set_xscale("log")
        ax.set_xlabel("p99 processing time per 1 ms step (µs)")
        ax.set_ylabel(f"RMSE of {dof} ({unit})")
        ax.set_title(f"{dof}: accuracy vs step time")
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
        ax.grid(alpha=0.3, which="both")
    return fig


def format_rows(rows: list[dict]) -> str:
    """A table: one line per job."""
    dofs = dof_columns(rows)
    head = f"{'scenario':14} {'seed':>4} {'backend':7} {'settings':14} " + " ".join(f"{'RMSE ' + d:>14}" for d, _ in dofs) \
        + f" {'p99 µs':>8} {'wall s':>7}"
    lines = [head, "-" * len(head)]
    for r in rows:
        if r["error"]:
            lines.append(f"{r['scenario']:14} {'-' if r['seed'] is None else r['seed']:>4} {r['backend']:7} {r['settings']:14} error: {r['error']}")
            continue
        vals = " ".join(f"{r.get('rmse_' + d):>12.4g} {u:1}" if r.get("rmse_" + d) is not None else f"{'-':>14}"
                        for d, u in dofs)
        lines.append(f"{r['scenario']:14} {'-' if r['seed'] is None else r['seed']:>4} {r['backend']:7} {r['settings']:14} {vals} "
                     f"{r['step_us_p99']:8.0f} {r['wall_s']:7.1f}")
    return "\n".join(lines)

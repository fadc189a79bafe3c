"""Benchmark of the backends: processing time per 1 ms of data and accuracy against ``truth/state``.

Scenario: the public scenario of the shipped rigs (``config/rigs/fourbar-sensors2016*.toml``), simulated
once per seed, or any log given by the user.  Accuracy: RMSE of each DOF (deg for angles, m for
translations; any DOF names) and of q over the *moving part* — samples where the norm of the truth
DOF rates, RMS over a 1 s window (shortened for shorter logs), exceeds 0.05 (rad/s or m/s); all
samples if the mechanism never moves.
Timing: each 1 ms step's processing (measurement handling + step); a smoother that updates in chunks
of C steps is charged the chunk's time spread evenly over its C steps ("per 1 ms of data").
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from estimator_service import schema
from estimator_service.dofs import Dof, dofs_of
from estimator_service.logfile import read_log
from estimator_service.offline import rig_of_log, run_log
from estimator_service.pipeline import Pipeline


@dataclass
class BenchRecord:
    """One backend × configuration result (the JSON report is a list of these)."""

    backend: str
    config: str
    steps: int
    mean_us: float
    p50_us: float
    p99_us: float
    max_us: float
    realtime_factor: float
    rmse_crank_deg: float | None
    rmse_q: float | None
    window_ms: float | None
    chunk_steps: int | None
    output_latency_ms: float
    data_s: float
    #: RMSE per DOF name in display units (deg for angular DOFs, m for translational ones)
    rmse_dof: dict[str, float] = field(default_factory=dict)
    #: display unit per DOF name: "deg" or "m"
    dof_units: dict[str, str] = field(default_factory=dict)


def per_ms_times(seconds: list[float], chunk: int) -> np.ndarray:
    """Processing time per 1 ms of data (µs): chunk updates spread over the chunk's steps."""
    s = np.asarray(seconds) * 1e6
    if chunk <= 1 or s.size == 0:
        return s
    n = (s.size // chunk) * chunk
    grouped = s[:n].reshape(-1, chunk).sum(axis=1) / chunk
    return np.repeat(grouped, chunk)


def moving_mask(t: np.ndarray, rate: np.ndarray, window_s: float = 1.0, threshold: float = 0.05) -> np.ndarray:
    """True where the RMS of ``rate`` over a centred window exceeds ``threshold`` (rad/s or m/s).

    The window is ``window_s`` long, shortened to the log's length for logs shorter than that."""
    if t.size < 2:
        return np.ones(t.size, bool)
    dt = float(np.median(np.diff(t)))
    w = min(t.size, max(1, int(round(window_s / dt))))
    kernel = np.ones(w) / w
    rms = np.sqrt(np.convolve(rate**2, kernel, mode="same"))
    return rms > threshold


def accuracy(truth: dict[int, dict], ests: list[dict], dofs: list[Dof]) -> tuple[dict[str, float], float | None]:
    """(RMSE per DOF name in display units, q RMSE) of estimates against truth matched on the 1 ms
    grid, over the moving part (all matched samples if nothing moves); ``({}, None)`` if none match."""
    by_key = {int(round(e["t"] * 1000)): e for e in ests}
    keys = sorted(k for k in by_key if k in truth)
    if not keys:
        return {}, None
    t = np.array([k / 1000 for k in keys])
    tq = np.array([truth[k]["q"] for k in keys])
    eq = np.array([by_key[k]["q"] for k in keys])
    tz = np.array([truth[k]["z"] for k in keys])
    ez = np.array([by_key[k]["z"] for k in keys])
    mask = moving_mask(t, np.linalg.norm(np.array([truth[k]["zd"] for k in keys]), axis=1))
    if not mask.any():
        mask[:] = True
    rmse_q = float(np.sqrt(np.mean((eq[mask] - tq[mask]) ** 2)))
    rmse = {d.name: float(d.shown(np.sqrt(np.mean(d.error(ez[mask, d.index], tz[mask, d.index]) ** 2)))) for d in dofs}
    return rmse, rmse_q


def bench_log(log_path: str | Path, backend: str, config_label: str, fgs_overrides: dict | None = None) -> BenchRecord:
    """Run one backend over one log; measure time per step and accuracy."""
    reader = read_log(log_path)
    rig = rig_of_log(reader.header, log_path)
    if fgs_overrides:
        rig.estimator.fgs.update(fgs_overrides)
    records = list(reader)
    pipe = Pipeline(rig, backend)
    ests: list[dict] = []
    truth: dict[int, dict] = {}
    c0 = time.perf_counter()
    for rec in run_log(pipe, iter(records)):
        if rec.topic == "est/state":
            ests.append(schema.decode("est/state", rec.payload))
    wall = time.perf_counter() - c0
    for rec in records:
        if rec.topic == "truth/state":
            msg = schema.decode("truth/state", rec.payload)
            truth[int(round(msg["t"] * 1000))] = msg
    chunk = int(getattr(pipe.backend, "params", None).chunk_steps) if backend == "fgs" else 1
    us = per_ms_times(pipe.times.seconds, chunk)
    data_s = len(pipe.times.seconds) * pipe.dt
    dofs = dofs_of(pipe.model)
    rmse, rmse_q = accuracy(truth, ests, dofs)
    crank = next((d for d in dofs if d.name == "crank" and d.angular), None)
    window = float(pipe.backend.params.window_ms) if backend == "fgs" else None
    return BenchRecord(
        backend=backend, config=config_label, steps=len(pipe.times.seconds),
        mean_us=float(us.mean()) if us.size else 0.0,
        p50_us=float(np.percentile(us, 50)) if us.size else 0.0,
        p99_us=float(np.percentile(us, 99)) if us.size else 0.0,
        max_us=float(us.max()) if us.size else 0.0,
        realtime_factor=data_s / wall if wall > 0 else math.inf,
        rmse_crank_deg=rmse.get(crank.name) if crank else None, rmse_q=rmse_q, window_ms=window,
        chunk_steps=chunk if backend == "fgs" else None,
        output_latency_ms=float(pipe.backend.output_latency_s) * 1e3, data_s=data_s,
        rmse_dof=rmse, dof_units={d.name: "deg" if d.angular else "m" for d in dofs},
    )


TABLE_HEADER = (f"{'backend':7} {'config':22} {'steps':>6} {'mean':>7} {'p50':>7} {'p99':>7} {'max':>8} {'RTF':>6} "
                f"{'q RMSE':>8} {'window':>6} {'latency':>7}  RMSE per DOF")
TABLE_NOTE = ("times are processing time per 1 ms of data (µs); RTF = real-time factor; RMSE over the moving part "
              "(° for angles, m for translations)")


def format_row(r: BenchRecord) -> str:
    """One line of the table (columns of :data:`TABLE_HEADER`)."""
    qv = f"{r.rmse_q:.2e}" if r.rmse_q is not None else "-"
    w = f"{r.window_ms:.0f}ms" if r.window_ms is not None else "-"
    dof = ", ".join(f"{name} {v:.3f}°" if r.dof_units.get(name) == "deg" else f"{name} {v:.2e} m"
                    for name, v in r.rmse_dof.items()) or "-"
    return (f"{r.backend:7} {r.config[:22]:22} {r.steps:6d} {r.mean_us:6.0f}µ {r.p50_us:6.0f}µ {r.p99_us:6.0f}µ "
            f"{r.max_us:7.0f}µ {r.realtime_factor:6.1f} {qv:>8} {w:>6} {r.output_latency_ms:5.1f}ms  {dof}")


def format_table(records: list[BenchRecord]) -> str:
    """Human-readable table of bench records."""
    return "\n".join([TABLE_HEADER, "-" * len(TABLE_HEADER), *map(format_row, records), TABLE_NOTE])


def write_json(records: list[BenchRecord], path: str | Path) -> None:
    """The machine-readable report: a JSON list of records."""
    Path(path).write_text(json.dumps([asdict(r) for r in records], indent=2) + "\n")

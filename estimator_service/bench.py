"""Benchmark of the backends: processing time per 1 ms of data and accuracy against ``truth/state``.

Scenario: the public scenario of the shipped rigs (``config/rigs/fourbar-sensors2016*.toml``), simulated
once per seed, or any log given by the user.  Accuracy: RMSE of the crank angle (deg) and of q over the
*moving part* — samples where the truth crank rate, RMS over a 1 s window, exceeds 0.05 rad/s.
Timing: each 1 ms step's processing (measurement handling + step); a smoother that updates in chunks
of C steps is charged the chunk's time spread evenly over its C steps ("per 1 ms of data").
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from estimator_service import schema
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
    max_err_crank_deg: float | None = None  #: largest crank error over the moving part (deg)
    flagged_share: float | None = None  #: share of estimates with quality "inconsistent"
    bias_err_dps: float | None = None  #: largest gyro-bias error after 5 s (deg/s), planar axes


def per_ms_times(seconds: list[float], chunk: int) -> np.ndarray:
    """Processing time per 1 ms of data (µs): chunk updates spread over the chunk's steps."""
    s = np.asarray(seconds) * 1e6
    if chunk <= 1 or s.size == 0:
        return s
    n = (s.size // chunk) * chunk
    grouped = s[:n].reshape(-1, chunk).sum(axis=1) / chunk
    return np.repeat(grouped, chunk)


def moving_mask(t: np.ndarray, rate: np.ndarray, window_s: float = 1.0, threshold: float = 0.05) -> np.ndarray:
    """True where the RMS of the crank rate over a centred window exceeds ``threshold`` (rad/s)."""
    if t.size < 2:
        return np.ones(t.size, bool)
    dt = float(np.median(np.diff(t)))
    w = max(1, int(round(window_s / dt)))
    kernel = np.ones(w) / w
    rms = np.sqrt(np.convolve(rate**2, kernel, mode="same"))
    return rms > threshold


def accuracy(truth: dict[int, dict], ests: list[dict], model_dof_crank: bool) -> tuple[float | None, float | None]:
    """(crank RMSE deg, q RMSE) of estimates against truth matched on the 1 ms grid, moving part only."""
    rmse_c, rmse_q, _ = accuracy_max(truth, ests, model_dof_crank)
    return rmse_c, rmse_q


def accuracy_max(truth: dict[int, dict], ests: list[dict], model_dof_crank: bool) -> tuple[float | None, float | None, float | None]:
    """(crank RMSE deg, q RMSE, max crank error deg) over the moving part (see :func:`accuracy`)."""
    keys = sorted(k for k in (int(round(e["t"] * 1000)) for e in ests) if k in truth)
    if not keys:
        return None, None, None
    by_key = {int(round(e["t"] * 1000)): e for e in ests}
    t = np.array([k / 1000 for k in keys])
    tq = np.array([truth[k]["q"] for k in keys])
    eq = np.array([by_key[k]["q"] for k in keys])
    if model_dof_crank:
        rate = np.array([truth[k]["crank_rate"] for k in keys])
        err_c = np.array([by_key[k]["crank"] - truth[k]["crank"] for k in keys])
        err_c = (err_c + math.pi) % (2 * math.pi) - math.pi
    else:
        rate = np.linalg.norm(np.array([truth[k]["zd"] for k in keys]), axis=1)
        err_c = None
    mask = moving_mask(t, rate)
    rmse_q = float(np.sqrt(np.mean((eq[mask] - tq[mask]) ** 2)))
    rmse_c = float(np.degrees(np.sqrt(np.mean(err_c[mask] ** 2)))) if err_c is not None else None
    max_c = float(np.degrees(np.abs(err_c[mask]).max())) if err_c is not None and mask.any() else None
    return rmse_c, rmse_q, max_c


def bias_error_dps(rig, ests: list[dict], after_s: float = 5.0) -> float | None:
    """Largest error (deg/s) of the estimated gyro biases on their estimated axes after ``after_s``,
    against the simulated biases of the rig (None without bias estimates)."""
    truth = {f"{imu.name}.gyr": imu.gyr.bias for imu in rig.imus}
    worst = None
    for e in ests:
        if e["t"] < after_s or not e.get("bias"):
            continue
        for key, b in e["bias"].items():
            if key in truth:
                est = np.asarray(b)
                on = est != 0.0
                if on.any():
                    err = float(np.degrees(np.abs(est[on] - truth[key][on]).max()))
                    worst = err if worst is None else max(worst, err)
    return worst


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
    rmse_c, rmse_q, max_c = accuracy_max(truth, ests, "crank" in pipe.model.dof_names)
    flagged = float(np.mean([e.get("quality") == "inconsistent" for e in ests])) if ests else None
    window = float(pipe.backend.params.window_ms) if backend == "fgs" else None
    return BenchRecord(
        backend=backend, config=config_label, steps=len(pipe.times.seconds),
        mean_us=float(us.mean()) if us.size else 0.0,
        p50_us=float(np.percentile(us, 50)) if us.size else 0.0,
        p99_us=float(np.percentile(us, 99)) if us.size else 0.0,
        max_us=float(us.max()) if us.size else 0.0,
        realtime_factor=data_s / wall if wall > 0 else math.inf,
        rmse_crank_deg=rmse_c, rmse_q=rmse_q, window_ms=window,
        chunk_steps=chunk if backend == "fgs" else None,
        output_latency_ms=float(pipe.backend.output_latency_s) * 1e3, data_s=data_s,
        max_err_crank_deg=max_c, flagged_share=flagged, bias_err_dps=bias_error_dps(rig, ests),
    )


def format_table(records: list[BenchRecord]) -> str:
    """Human-readable table of bench records."""
    head = (f"{'backend':7} {'config':22} {'steps':>6} {'mean':>7} {'p50':>7} {'p99':>7} {'max':>8} {'RTF':>6} {'crank°':>7} "
            f"{'q RMSE':>8} {'window':>6} {'latency':>7} {'max°':>6} {'flag':>5} {'bias°/s':>7}")
    lines = [head, "-" * len(head)]
    for r in records:
        c = f"{r.rmse_crank_deg:.3f}" if r.rmse_crank_deg is not None else "-"
        qv = f"{r.rmse_q:.2e}" if r.rmse_q is not None else "-"
        w = f"{r.window_ms:.0f}ms" if r.window_ms is not None else "-"
        lines.append(f"{r.backend:7} {r.config:22} {r.steps:6d} {r.mean_us:6.0f}µ {r.p50_us:6.0f}µ {r.p99_us:6.0f}µ "
                     f"{r.max_us:7.0f}µ {r.realtime_factor:6.1f} {c:>7} {qv:>8} {w:>6} {r.output_latency_ms:5.1f}ms "
                     f"{_opt(r.max_err_crank_deg, '6.2f')} {_opt(r.flagged_share, '5.2f')} {_opt(r.bias_err_dps, '7.3f')}")
    lines.append("times are processing time per 1 ms of data (µs); RTF = real-time factor; RMSE over the moving part; "
                 "max° = largest crank error there; flag = share of estimates flagged inconsistent; "
                 "bias°/s = largest gyro-bias error after 5 s")
    return "\n".join(lines)


def _opt(v: float | None, fmt: str) -> str:
    width = int(fmt.split(".")[0])
    return f"{v:{fmt}}" if v is not None else f"{'-':>{width}}"


def write_json(records: list[BenchRecord], path: str | Path) -> None:
    """The machine-readable report: a JSON list of records."""
    Path(path).write_text(json.dumps([asdict(r) for r in records], indent=2) + "\n")

"""Benchmark of the backends: processing time per 1 ms of data and accuracy against ``truth/state``.

Scenario: the public scenario of the shipped rigs (``config/rigs/fourbar-sensors2016*.toml``), simulated
once per seed, or any log given by the user.  Accuracy: RMSE of each DOF (deg for angles, m for
translations; any DOF names) and of q over the *moving part* — samples where the norm of the truth
DOF rates, RMS over a 1 s window (shortened for shorter logs), exceeds 0.05 (rad/s or m/s); all
samples if the mechanism never moves.  Logs are streamed: memory does not grow with the log's length
(percentiles from a fixed histogram, accuracy from running sums over one window).
Timing: each 1 ms step's processing (measurement handling + step); a smoother that updates in chunks
of C steps is charged the chunk's time spread evenly over its C steps ("per 1 ms of data").
The estimates' own reports: share flagged ``inconsistent`` and the largest gyro-bias error after 5 s
against the rig's simulated biases (:class:`SensorReport`).  Scenario figures: docs/accuracy.md.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from estimator_service import freeze_heap, kernels, schema
from estimator_service.dofs import Dof, dofs_of
from estimator_service.logfile import read_log
from estimator_service.offline import rig_of_log, run_log
from estimator_service.pipeline import Pipeline
from estimator_service.rig import Rig


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
    realtime_factor: float  #: data seconds per wall second of the whole run: replay and this bench's scoring
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
    max_err_crank_deg: float | None = None  #: largest crank error over the moving part (deg)
    flagged_share: float | None = None  #: share of estimates with quality "inconsistent"
    bias_err_dps: float | None = None  #: largest gyro-bias error after 5 s (deg/s), estimated axes
    path: str = "compiled"  #: "compiled" (kernels) or "numpy" (the reference path: kernels off or unavailable)
    #: size of the mechanism: bodies, coordinates n, constraints m, DOF g; the filters' state length L
    size: dict[str, int] = field(default_factory=dict)
    #: data seconds per wall second of the offline replay alone (reading, decoding, estimating, validating and
    #: packing the estimates): the run less the time this bench spends scoring them against truth
    replay_factor: float | None = None


@dataclass
class _Sums:
    """Running sums of :class:`Accuracy` over the samples it counts (plain floats: a sample is a few additions)."""

    ez2: list[float]  #: per DOF: sum of squared errors
    ez2_max: list[float]  #: per DOF: largest squared error
    eq2: float = 0.0  #: sum of squared q errors
    q_entries: int = 0  #: q entries summed in ``eq2``
    samples: int = 0

    def add(self, ez2: list[float], eq2: float, n: int) -> None:
        """One sample: squared DOF errors, sum of squared q errors, and its count of q entries."""
        for i, e in enumerate(ez2):
            self.ez2[i] += e
            if e > self.ez2_max[i]:
                self.ez2_max[i] = e
        self.eq2 += eq2
        self.q_entries += n
        self.samples += 1


class Accuracy:
    """Streaming RMSE per DOF and of q over the moving part, in fixed memory.

    Feed matched (estimate, truth) pairs in time order (one per ``dt``); a sample counts when the
    RMS of the norm of the truth DOF rates over a centred ``window_s`` window (zero-padded at the
    ends) exceeds ``threshold`` (rad/s or m/s); if no sample does, every sample counts.  Holds one
    window of samples, whatever the log's length.
    """

    def __init__(self, dofs: list[Dof], dt: float, window_s: float = 1.0, threshold: float = 0.05) -> None:
        self.dofs = dofs
        self.w = max(1, int(round(window_s / dt)))  #: window length (samples)
        self.half = max(1, self.w // 2)
        self.threshold = threshold
        self._buf: deque[tuple[float, list[float], float, int]] = deque()  # (rate², DOF err², q err², n)
        self._lo = 0  # index of the buffer's first sample
        self._n = 0  # samples added
        self._next = 0  # next sample to decide
        self._sum_r2 = 0.0
        k = len(dofs)
        self._moving = _Sums([0.0] * k, [0.0] * k)
        self._all = _Sums([0.0] * k, [0.0] * k)

    def add(self, est: dict, truth: dict) -> None:
        """One matched pair (est/state and truth/state dicts at the same step)."""
        eq = np.asarray(est["q"]) - np.asarray(truth["q"])
        ez = [float(d.error(est["z"][d.index], truth["z"][d.index])) for d in self.dofs]
        self.add_squared([e * e for e in ez], float(eq @ eq), eq.size, truth["zd"])

    def add_squared(self, ez2: list[float], eq2: float, n: int, zd_true) -> None:
        """One sample given as squared errors: per DOF (SI units²), the sum over q and its count of
        entries, with the true DOF rates that decide whether it is moving (:func:`bound.bound_log`
        feeds variances here)."""
        zd = np.asarray(zd_true)
        r2 = float(np.dot(zd, zd))
        self._buf.append((r2, ez2, eq2, n))
        self._sum_r2 += r2
        self._n += 1
        while self._next + self.half - 1 < self._n:
            self._decide()

    def _decide(self) -> None:
        c = self._next
        while self._lo < c - self.half:  # samples that left the window of c
            self._sum_r2 -= self._buf.popleft()[0]
            self._lo += 1
        _, ez2, eq2, n = self._buf[c - self._lo]
        self._all.add(ez2, eq2, n)
        if math.sqrt(max(self._sum_r2, 0.0) / self.w) > self.threshold:
            self._moving.add(ez2, eq2, n)
        self._next += 1

    def _counted(self) -> _Sums:
        """The sums of the moving part, or of every sample if none moved (all samples decided)."""
        while self._next < self._n:
            self._decide()
        return self._moving if self._moving.samples else self._all

    def result(self) -> tuple[dict[str, float], float | None]:
        """(RMSE per DOF name in display units, q RMSE) after the last sample; ``({}, None)`` without samples."""
        s = self._counted()
        if s.samples == 0:
            return {}, None
        rmse = {d.name: float(d.shown(math.sqrt(s.ez2[i] / s.samples))) for i, d in enumerate(self.dofs)}
        return rmse, math.sqrt(s.eq2 / s.q_entries)

    def max_error(self) -> dict[str, float]:
        """Largest error per DOF name (display units) over the same samples as :meth:`result`."""
        s = self._counted()
        return {d.name: float(d.shown(math.sqrt(s.ez2_max[i]))) for i, d in enumerate(self.dofs)} if s.samples else {}


def accuracy(truth: dict[int, dict], ests: list[dict], dofs: list[Dof], dt: float = 0.001) -> tuple[dict[str, float], float | None]:
    """(RMSE per DOF name in display units, q RMSE) of estimates against truth matched on the 1 ms
    grid, over the moving part (all matched samples if nothing moves); ``({}, None)`` if none match."""
    by_key = {int(round(e["t"] * 1000)): e for e in ests}
    acc = Accuracy(dofs, dt)
    for k in sorted(k for k in by_key if k in truth):
        acc.add(by_key[k], truth[k])
    return acc.result()


class _Matcher:
    """Pairs est/state with truth/state on the 1 ms grid as they stream by (either may come first);
    unmatched entries older than ``keep_s`` behind the newest are forgotten (fixed memory)."""

    def __init__(self, acc: Accuracy, keep_s: float = 2.0) -> None:
        self.acc, self.keep = acc, int(keep_s * 1000)
        self.truth: dict[int, dict] = {}
        self.ests: dict[int, dict] = {}
        self._newest = 0

    def add(self, kind: str, msg: dict) -> None:
        k = int(round(msg["t"] * 1000))
        mine, other = (self.truth, self.ests) if kind == "truth" else (self.ests, self.truth)
        hit = other.pop(k, None)
        if hit is None:
            mine[k] = msg
        else:
            est, truth = (hit, msg) if kind == "truth" else (msg, hit)
            self.acc.add(est, truth)
        if k > self._newest:
            self._newest = k
            if k % 500 == 0:
                for d in (self.truth, self.ests):
                    for old in [x for x in d if x < k - self.keep]:
                        del d[old]


class SensorReport:
    """Running figures of the estimates' own reports: share flagged ``inconsistent`` and the largest
    gyro-bias error (deg/s) after ``after_s`` against the rig's simulated biases, on estimated axes."""

    def __init__(self, rig: Rig, after_s: float = 5.0) -> None:
        self.truth = {f"{imu.name}.gyr": np.asarray(imu.gyr.bias, float).tolist() for imu in rig.imus}
        self.after_s = after_s
        self.count = self.flagged = 0
        self.bias_err_dps: float | None = None

    def add(self, est: dict) -> None:
        """One est/state dict."""
        self.count += 1
        self.flagged += est.get("quality") == "inconsistent"
        if est["t"] < self.after_s:
            return
        for key, b in (est.get("bias") or {}).items():
            truth = self.truth.get(key)
            if truth is None:
                continue
            errs = [abs(v - y) for v, y in zip(map(float, b), truth, strict=True) if v != 0.0]  # estimated axes
            if errs:
                worst = math.nan if math.isnan(sum(errs)) else max(errs)  # NaN if any is, as numpy's max
                err = math.degrees(worst)
                self.bias_err_dps = err if self.bias_err_dps is None else max(self.bias_err_dps, err)

    @property
    def flagged_share(self) -> float | None:
        return self.flagged / self.count if self.count else None


def bench_log(log_path: str | Path, backend: str, config_label: str, fgs_overrides: dict | None = None,
              reference: bool = False, freeze: bool = False) -> BenchRecord:
    """Run one backend over one log (streamed: memory independent of its length); time per step, accuracy.
    ``reference``: on the numpy reference path instead of the compiled kernels (estimator_service/kernels/).
    ``freeze``: :func:`estimator_service.freeze_heap` before the timed loop, as the daemon does after
    start-up (``rigstate bench``; not in a long-lived process that makes many pipelines)."""
    reader = read_log(log_path)
    rig = rig_of_log(reader.header, log_path)
    if fgs_overrides:
        rig.estimator.fgs.update(fgs_overrides)
    with kernels.reference_path() if reference else contextlib.nullcontext():
        pipe = Pipeline(rig, backend)
    compiled = pipe.backend.compiled
    dofs = dofs_of(pipe.model)
    acc = Accuracy(dofs, pipe.dt)
    match = _Matcher(acc)
    report = SensorReport(rig)
    if freeze:
        freeze_heap()
    scoring = 0.0  # s spent scoring (not part of a replay)
    clock = time.perf_counter
    c0 = clock()
    for rec in run_log(pipe, iter(reader)):
        if rec.topic == "est/state":  # this run's estimates (run_log leaves out the log's own): validated
            s0 = clock()
            match.add("est", rec.msg)
            report.add(rec.msg)
            scoring += clock() - s0
        elif rec.topic == "truth/state":
            s0 = clock()
            match.add("truth", schema.decode("truth/state", rec.payload))
            scoring += clock() - s0
    wall = clock() - c0
    chunk = pipe.times.chunk
    us = pipe.times.summary_us()
    data_s = pipe.times.count * pipe.dt
    rmse, rmse_q = acc.result()
    max_err = acc.max_error()
    crank = next((d for d in dofs if d.name == "crank" and d.angular), None)
    window = float(pipe.backend.params.window_ms) if backend == "fgs" else None
    return BenchRecord(
        backend=backend, config=config_label, steps=pipe.times.count,
        mean_us=us["mean"], p50_us=us["p50"], p99_us=us["p99"], max_us=us["max"],
        realtime_factor=data_s / wall if wall > 0 else math.inf,
        replay_factor=data_s / (wall - scoring) if wall > scoring else math.inf,
        rmse_crank_deg=rmse.get(crank.name) if crank else None, rmse_q=rmse_q, window_ms=window,
        chunk_steps=chunk if backend == "fgs" else None,
        output_latency_ms=float(pipe.backend.output_latency_s) * 1e3, data_s=data_s,
        rmse_dof=rmse, dof_units={d.name: "deg" if d.angular else "m" for d in dofs},
        max_err_crank_deg=max_err.get(crank.name) if crank else None, flagged_share=report.flagged_share,
        bias_err_dps=report.bias_err_dps, path="compiled" if compiled else "numpy",
        size={"bodies": len(rig.mechanism.bodies), "n": pipe.model.n, "m": pipe.model.m, "g": pipe.model.g,
              **({"L": pipe.backend.L} if hasattr(pipe.backend, "L") else {})},
    )


TABLE_HEADER = (f"{'backend':7} {'config':22} {'steps':>6} {'mean':>7} {'p50':>7} {'p99':>7} {'max':>8} {'RTF':>6} {'replay':>6} "
                f"{'q RMSE':>8} {'window':>6} {'latency':>7} {'max°':>6} {'flag':>5} {'bias°/s':>7}  RMSE per DOF")
TABLE_NOTE = ("times are processing time per 1 ms of data (µs); RTF = real-time factor of the run, replay = of the "
              "replay alone (without this bench's scoring); RMSE over the moving part "
              "(° for angles, m for translations); max° = largest crank error there; flag = share of estimates "
              "flagged inconsistent; bias°/s = largest gyro-bias error after 5 s")


def format_row(r: BenchRecord) -> str:
    """One line of the table (columns of :data:`TABLE_HEADER`)."""
    qv = f"{r.rmse_q:.2e}" if r.rmse_q is not None else "-"
    w = f"{r.window_ms:.0f}ms" if r.window_ms is not None else "-"
    dof = ", ".join(f"{name} {v:.3f}°" if r.dof_units.get(name) == "deg" else f"{name} {v:.2e} m"
                    for name, v in r.rmse_dof.items()) or "-"
    return (f"{r.backend:7} {r.config[:22]:22} {r.steps:6d} {r.mean_us:6.0f}µ {r.p50_us:6.0f}µ {r.p99_us:6.0f}µ "
            f"{r.max_us:7.0f}µ {r.realtime_factor:6.1f} {_opt(r.replay_factor, '6.1f')} {qv:>8} {w:>6} {r.output_latency_ms:5.1f}ms "
            f"{_opt(r.max_err_crank_deg, '6.2f')} {_opt(r.flagged_share, '5.2f')} {_opt(r.bias_err_dps, '7.3f')}  {dof}")


def _opt(v: float | None, fmt: str) -> str:
    """``v`` in format ``fmt`` (``"<width>.<precision>f"``), or a right-aligned dash if None."""
    width = int(fmt.split(".")[0])
    return f"{v:{fmt}}" if v is not None else f"{'-':>{width}}"


def write_json(records: list[BenchRecord], path: str | Path) -> None:
    """The machine-readable report: a JSON list of records."""
    Path(path).write_text(json.dumps([asdict(r) for r in records], indent=2) + "\n")

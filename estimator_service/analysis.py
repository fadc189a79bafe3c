"""Accuracy of estimates in a log, for any mechanism: per-DOF errors against a reference, status counts.

Reference of DOF i, in order of preference: ``truth/state`` (its ``z[i]``), else a non-fused encoder
(``use = false``) that measures the DOF coordinate itself (an encoder on a body whose angle *is* the
DOF, relative to ground).  An estimate is matched to the reference sample of the same millisecond
(``round(t · 1000)``, sensor time) — the estimators step at 1 ms and truth and encoders are
sampled on that grid; estimates without a reference sample at their millisecond are not scored.
Angle errors are wrapped to [−180°, 180°).  Units for people: DOFs that are angles (relative
coordinates) in degrees, DOFs that are point coordinates in metres (:func:`dof_units`).

:class:`AccuracyAccumulator` is streaming: it keeps running sums, and reference samples only until
the estimate of their millisecond has passed (bounded by ``MAX_PENDING``), so ``rigstate estimate``
can summarise a log of any length.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from estimator_service import schema
from estimator_service.angles import wrap_angle
from estimator_service.model import Model
from estimator_service.rig import Rig
from estimator_service.sensors import Encoder

MAX_PENDING = 20000  #: reference samples kept while waiting for their estimate (20 s at 1 kHz)
MAX_STATUS_CHANGES = 1000  #: status changes remembered (counts are always complete)


@dataclass(frozen=True)
class DofUnit:
    """How a DOF is shown: ``scale`` converts SI (rad or m) to ``unit`` (° or m); ``rate_unit``."""

    name: str
    angle: bool
    scale: float
    unit: str
    rate_unit: str


def dof_units(model: Model) -> list[DofUnit]:
    """Per DOF: degrees for angle coordinates (relative coordinates of q), metres for point coordinates."""
    first_angle = model.n - len(model.mech.relative_coordinates)
    out = []
    for name, k in zip(model.dof_names, model.dof, strict=True):
        angle = int(k) >= first_angle
        out.append(DofUnit(name, angle, math.degrees(1.0) if angle else 1.0, "°" if angle else "m",
                           "°/s" if angle else "m/s"))
    return out


def reference_encoders(rig: Rig, model: Model) -> dict[int, Encoder]:
    """DOF index -> the non-fused encoder that reads that DOF coordinate (first one in the rig)."""
    out: dict[int, Encoder] = {}
    dofs = [int(k) for k in model.dof]
    for s in rig.all_virtual_sensors(model):
        if not isinstance(s, Encoder) or s.coordinate is None or s.coordinate not in dofs:
            continue
        cfg = next(e for e in rig.encoders if f"enc/{e.name}" == s.topic)
        if not cfg.use:
            out.setdefault(dofs.index(s.coordinate), s)
    return out


@dataclass
class ErrorStats:
    """Running error statistics of one DOF against one reference (SI units: rad or m)."""

    n: int = 0
    sum_sq: float = 0.0
    max_abs: float = 0.0
    t_max: float = 0.0
    t: list[float] = field(default_factory=list)  #: with ``keep_series``: estimate times (s)
    err: list[float] = field(default_factory=list)  #: with ``keep_series``: errors (rad or m)

    def add(self, t: float, e: float, keep: bool) -> None:
        self.n += 1
        self.sum_sq += e * e
        if abs(e) > self.max_abs:
            self.max_abs, self.t_max = abs(e), t
        if keep:
            self.t.append(t)
            self.err.append(e)

    @property
    def rmse(self) -> float:
        return math.sqrt(self.sum_sq / self.n) if self.n else math.nan


#: est/state fields with parameters a backend learns, reported as of the last estimate
LEARNED = ("bias", "time_offset_s", "mount_deg", "model")


class AccuracyAccumulator:
    """Feed every record of a log (inputs and ``est/state``) in log order; then :meth:`summary`.

    ``keep_series`` also keeps each DOF's error time series (for figures).
    """

    def __init__(self, rig: Rig, model: Model | None = None, keep_series: bool = False) -> None:
        self.model = model or rig.model
        self.units = dof_units(self.model)
        self.keep = keep_series
        self.encoders = reference_encoders(rig, self.model)
        self._enc_topic = {s.topic: (i, s) for i, s in self.encoders.items()}
        g = self.model.g
        self.truth_stats = [ErrorStats() for _ in range(g)]
        self.enc_stats = [ErrorStats() for _ in range(g)]
        #: per DOF, of the estimates matched to its reference (truth, else its encoder): how many carried a
        #: P_z, how many of those had |error| ≤ 3σ, how many carried a quality and how many of those said ok
        self.sigma_n, self.within_3sigma = [0] * g, [0] * g
        self.quality_n, self.quality_ok = [0] * g, [0] * g
        self._truth: dict[int, list[float]] = {}
        self._enc: list[dict[int, float]] = [{} for _ in range(g)]
        self.status = Counter()
        self.status_changes: list[tuple[float, str]] = []  #: (t, new status), the first estimate's included
        self._last_status: str | None = None
        self.quality = Counter()  #: estimates by ``quality`` (ok / inconsistent), where they carry one
        self.first_inconsistent: float | None = None  #: sensor time (s) of the first estimate flagged inconsistent
        #: the last estimate's learned parameters: sensor biases, IMU time offsets, model errors (if sent)
        self.learned: dict[str, dict] = {}
        self.estimates = 0
        self.backend = ""
        self.t_first: float | None = None
        self.t_last: float | None = None

    @staticmethod
    def _key(t: float) -> int:
        return int(round(t * 1000.0))

    @staticmethod
    def _remember(buf: dict, key: int, value: object) -> None:
        buf[key] = value
        if len(buf) > MAX_PENDING:
            del buf[next(iter(buf))]

    def add_raw(self, topic: str, payload: bytes) -> None:
        """Decode and add one record; records of other topics and malformed payloads are ignored."""
        if topic != "truth/state" and topic != "est/state" and topic not in self._enc_topic:
            return
        try:
            msg = schema.decode(topic, payload)
        except schema.SchemaError:
            return
        self.add(topic, msg)

    def add(self, topic: str, msg: dict) -> None:
        """Add one validated message."""
        if topic == "truth/state":
            self._remember(self._truth, self._key(msg["t"]), msg["z"])
        elif topic in self._enc_topic:
            i, enc = self._enc_topic[topic]
            try:
                angle = float(enc.measure(msg)[0])
            except schema.SchemaError:  # counts per revolution other than the rig's: not a reference
                return
            self._remember(self._enc[i], self._key(msg["t"]), angle)
        elif topic == "est/state":
            self._estimate(msg)

    def _estimate(self, msg: dict) -> None:
        t = float(msg["t"])
        key = self._key(t)
        self.estimates += 1
        self.backend = msg.get("backend", self.backend)
        status = str(msg.get("status", "?"))
        if status != self._last_status and len(self.status_changes) < MAX_STATUS_CHANGES:
            self.status_changes.append((t, status))
        self._last_status = status
        self.status[status] += 1
        quality = msg.get("quality")
        if quality:
            self.quality[str(quality)] += 1
            if quality == "inconsistent" and self.first_inconsistent is None:
                self.first_inconsistent = t
        for k in LEARNED:
            if isinstance(msg.get(k), dict):
                self.learned[k] = msg[k]
        self.t_first = t if self.t_first is None else self.t_first
        self.t_last = t
        z = msg["z"]
        truth = self._truth.get(key)
        P = msg.get("P_z")
        g = len(self.units)
        for i, u in enumerate(self.units):
            e = None
            if truth is not None and i < len(truth):
                e = self._score(self.truth_stats[i], u, t, z[i] - truth[i])
            ref = self._enc[i].get(key)
            if ref is not None:
                e_enc = self._score(self.enc_stats[i], u, t, z[i] - ref)
                e = e_enc if e is None and not self.truth_stats[i].n else e
            if e is None:
                continue
            if P is not None and len(P) == 4 * g * g:
                self.sigma_n[i] += 1
                self.within_3sigma[i] += abs(e) <= 3.0 * math.sqrt(max(P[i * 2 * g + i], 0.0))
            if quality:
                self.quality_n[i] += 1
                self.quality_ok[i] += quality == "ok"
        # references at or before this estimate are no longer needed (estimates come in time order)
        for buf in (self._truth, *self._enc):
            while buf and next(iter(buf)) <= key:
                del buf[next(iter(buf))]

    def _score(self, st: ErrorStats, u: DofUnit, t: float, e: float) -> float:
        """Add one error (rad or m; angles wrapped) to ``st`` and return it."""
        e = float(wrap_angle(e)) if u.angle else float(e)
        st.add(t, e, self.keep)
        return e

    def stats(self, i: int) -> tuple[str | None, ErrorStats | None]:
        """(reference name, statistics) of DOF i: truth if any estimate matched truth, else its encoder."""
        if self.truth_stats[i].n:
            return "truth/state", self.truth_stats[i]
        if self.enc_stats[i].n:
            return self.encoders[i].topic, self.enc_stats[i]
        return None, None

    def summary(self, step_seconds: list[float] | np.ndarray | None = None) -> dict:
        """Plain-data summary (JSON-ready): per-DOF RMSE and max error in display units, status counts,
        status changes, quality counts and the first inconsistent estimate's time, step-time statistics (µs) when ``step_seconds`` (per 1 ms step, s) is given."""
        dofs = []
        for i, u in enumerate(self.units):
            ref, st = self.stats(i)
            dofs.append({
                "name": u.name, "unit": u.unit, "reference": ref, "matched": st.n if st else 0,
                "rmse": st.rmse * u.scale if st else None,
                "max_abs": st.max_abs * u.scale if st else None, "t_max_s": st.t_max if st else None,
                "within_3sigma": self.within_3sigma[i] / self.sigma_n[i] if self.sigma_n[i] else None,
                "ok_share": self.quality_ok[i] / self.quality_n[i] if self.quality_n[i] else None,
            })
        out = {
            "backend": self.backend, "estimates": self.estimates,
            "t_first_s": self.t_first, "t_last_s": self.t_last,
            "dofs": dofs, "status": dict(self.status),
            "status_changes": [{"t_s": t, "status": s} for t, s in self.status_changes],
            "quality": dict(self.quality), "first_inconsistent_s": self.first_inconsistent,
            "learned": self.learned,
        }
        if step_seconds is not None:
            out["step_us"] = step_time_stats(step_seconds)
        return out


def step_time_stats(step_seconds: list[float] | np.ndarray) -> dict:
    """mean, p50, p99 and max of per-step processing times, in µs (zeros when there are none)."""
    us = np.asarray(step_seconds, dtype=float) * 1e6
    if not us.size:
        return {"steps": 0, "mean": 0.0, "p50": 0.0, "p99": 0.0, "max": 0.0}
    return {"steps": int(us.size), "mean": float(us.mean()), "p50": float(np.percentile(us, 50)),
            "p99": float(np.percentile(us, 99)), "max": float(us.max())}


def quality_line(s: dict) -> str | None:
    """``inconsistent on 20 of 10000 estimates (0.2 %), first at 9.230 s`` of a :meth:`AccuracyAccumulator.summary`
    (None when no estimate carried a quality)."""
    counts = s.get("quality") or {}
    n = sum(counts.values())
    if not n:
        return None
    bad = counts.get("inconsistent", 0)
    first = f", first at {s['first_inconsistent_s']:.3f} s" if s.get("first_inconsistent_s") is not None else ""
    return f"inconsistent on {bad} of {n} estimates ({100 * bad / n:.1f} %){first}"


def format_summary(s: dict) -> str:
    """Human-readable summary of :meth:`AccuracyAccumulator.summary`."""
    lines = [f"{s['estimates']} estimates" + (f" from backend {s['backend']}" if s["backend"] else "")
             + (f", t = {s['t_first_s']:.3f} … {s['t_last_s']:.3f} s" if s["t_first_s"] is not None else "")]
    for d in s["dofs"]:
        if d["reference"] is None:
            lines.append(f"  {d['name']:>12}: no reference (no truth/state, no non-fused encoder on this DOF)")
            continue
        fmt = "{:.4f}" if d["unit"] == "°" else "{:.3e}"
        lines.append(f"  {d['name']:>12}: RMSE {fmt.format(d['rmse'])} {d['unit']}, max {fmt.format(d['max_abs'])} "
                     f"{d['unit']} at t = {d['t_max_s']:.3f} s  (vs {d['reference']}, {d['matched']} matched)")
        honest = [f"|error| ≤ 3σ on {100 * d['within_3sigma']:.1f} %" if d.get("within_3sigma") is not None else "",
                  f"quality ok on {100 * d['ok_share']:.1f} %" if d.get("ok_share") is not None else ""]
        if any(honest):
            lines.append(f"  {'':>12}  of those: " + ", ".join(h for h in honest if h))
    lines.append("  status: " + (", ".join(f"{k} {v}" for k, v in sorted(s["status"].items())) or "-")
                 + f"; {len(s['status_changes'])} change(s)")
    quality = quality_line(s)
    if quality:
        lines.append(f"  quality: {quality}")
    learned = s.get("learned") or {}
    if learned.get("model"):
        lines.append("  model errors learned (relative, the smallest change with the same dynamics): "
                     + ", ".join(f"{k} {100 * v:+.1f} %" for k, v in learned["model"].items()))
    if learned.get("bias"):
        def axes(key: str, v: list[float]) -> str:
            gyro = key.endswith(".gyr")
            return "[" + ", ".join(f"{math.degrees(x) if gyro else x:+.3f}" for x in v) + ("] °/s" if gyro else "] m/s²")
        lines.append("  sensor biases: " + ", ".join(f"{k} {axes(k, v)}" for k, v in learned["bias"].items()))
    if learned.get("time_offset_s"):
        lines.append("  IMU time offsets: " + ", ".join(f"{k} {1e3 * v:+.2f} ms" for k, v in learned["time_offset_s"].items()))
    if learned.get("mount_deg"):
        lines.append("  accelerometer mounts: " + ", ".join(f"{k} {v:+.2f}°" for k, v in learned["mount_deg"].items()))
    if "step_us" in s:
        st = s["step_us"]
        lines.append(f"  step time: p50 {st['p50']:.0f} µs, p99 {st['p99']:.0f} µs, max {st['max']:.0f} µs "
                     f"over {st['steps']} steps")
    return "\n".join(lines)

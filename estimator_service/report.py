"""``rigstate report``: figures (PNG) and one self-contained HTML page for a log with estimates.

Works for any mechanism and DOF names (units ° for angle DOFs, m for point-coordinate DOFs, see
:func:`estimator_service.analysis.dof_units`).  A log without ``est/state`` is first run through a
backend in-process (as ``rigstate estimate`` does), which also gives the per-step processing times.

Figures (each built by a ``fig_*`` function returning a :class:`matplotlib.figure.Figure`, drawn
with the Agg backend, no display needed):

- ``dofs``: every DOF's estimate against its reference (truth/state or a non-fused encoder, as in
  Sensors 2016 Figs. 5–7) with a 1σ band when ``est/state`` carries ``P_z``, and the error with RMSE;
- ``rates``: messages per second of every topic over time (1 s bins);
- ``states``: any further numeric ``est/state`` fields (e.g. sensor biases, DOF forces), with 1σ
  bands from a ``<field>_sigma`` companion when present;
- ``residuals``: per fused sensor, measured − predicted from the estimate (at the estimate of the
  same millisecond; accelerometers with q̈ from the differentiated estimated rates) and the
  normalised squared residual rᵀR⁻¹r/dim (R = the sensor's noise only, so it is an upper bound on
  the NIS); NIS series found in ``est/diag`` are drawn as well;
- ``timing``: per-step processing time histogram (when known) and the output latency: declared
  (``latency_s``) and the histogram of the observed one (receive time − estimate time);
- ``status``: estimate status over time.
"""

from __future__ import annotations

import base64
import html
import math
from dataclasses import dataclass, field
from pathlib import Path

import msgpack
import numpy as np
from matplotlib.figure import Figure

from estimator_service import schema
from estimator_service.analysis import AccuracyAccumulator, DofUnit, dof_units, quality_line, step_time_stats
from estimator_service.angles import wrap_angle
from estimator_service.errors import UserError
from estimator_service.logfile import read_log
from estimator_service.model import Model
from estimator_service.offline import rig_of_log, run_log
from estimator_service.pipeline import Pipeline
from estimator_service.rig import Rig
from estimator_service.sensors import Accelerometer, DriveCommand, Encoder, Inclination
from estimator_service.paths import make_output_dir

STANDARD_FIELDS = {"t", "seq", "q", "qd", "z", "zd", "crank", "crank_rate", "backend", "status", "P_z", "latency_s"}
STATUS_LEVELS = ["init", "ok", "degraded", "reinit"]
COLORS = {"estimate": "tab:blue", "reference": "black", "error": "tab:red"}


@dataclass
class Series:
    """A sampled signal: times (s), values (N, k) and optional 1σ (N, k)."""

    t: np.ndarray
    v: np.ndarray
    sigma: np.ndarray | None = None


@dataclass
class LogSeries:
    """Everything a report draws, read from one log (arrays in SI units)."""

    path: Path
    rig: Rig
    model: Model
    backend: str
    est_t: np.ndarray
    est_q: np.ndarray
    est_qd: np.ndarray
    est_z: np.ndarray
    est_zd: np.ndarray
    est_status: list[str]
    est_quality: list[str]  #: ``quality`` of each estimate (``ok`` / ``inconsistent``; "" where absent)
    est_recv: np.ndarray  #: receive time of the record (s)
    est_latency: np.ndarray  #: declared ``latency_s`` (NaN where absent)
    est_sigma_z: np.ndarray | None  #: 1σ of z from ``P_z`` (N, g) or None
    extras: dict[str, Series]  #: further numeric est/state fields by flattened name
    accuracy: AccuracyAccumulator
    topic_times: dict[str, np.ndarray]  #: receive-side sensor time of every message, per topic
    sensor_msgs: dict[str, list[dict]]  #: decoded imu/enc messages per topic
    truth_t: np.ndarray
    truth_z: np.ndarray  #: (N, g) truth/state z, empty when the log has no truth
    diag: list[dict]
    step_seconds: np.ndarray | None  #: per-step processing time (s) when the estimates were made here
    estimated_here: bool

    @property
    def units(self) -> list[DofUnit]:
        return self.accuracy.units


def _decode_lenient(topic: str, payload: bytes) -> dict | None:
    """A validated message, or for est/* a plain map with unknown (newer) fields; None if unusable."""
    try:
        return schema.decode(topic, payload)
    except schema.SchemaError:
        if not topic.startswith("est/"):
            return None
        try:
            msg = msgpack.unpackb(payload, raw=False, strict_map_key=True, max_ext_len=0)
        except Exception:  # noqa: BLE001 - any undecodable payload is skipped, as the pipeline does
            return None
        if isinstance(msg, dict) and isinstance(msg.get("t"), (int, float)) and \
                (topic != "est/state" or isinstance(msg.get("z"), list)):
            return msg
        return None


def _flatten(prefix: str, v: object, out: dict[str, float]) -> None:
    """Numeric leaves of a nested map/list as ``a.b[i]`` names."""
    if isinstance(v, bool):
        return
    if isinstance(v, (int, float)) and math.isfinite(v):
        out[prefix] = float(v)
    elif isinstance(v, list) and len(v) <= 64:
        for i, x in enumerate(v):
            _flatten(f"{prefix}[{i}]", x, out)
    elif isinstance(v, dict):
        for k, x in v.items():
            _flatten(f"{prefix}.{k}", x, out)


def _sigma_name(name: str) -> str:
    """Companion 1σ of a flattened name: ``bias.coupler[2]`` -> ``bias_sigma.coupler[2]``."""
    head, sep, rest = name.partition(".")
    if not sep:
        head, sep, rest = name.partition("[")
        return f"{head}_sigma{sep}{rest}"
    return f"{head}_sigma.{rest}"


def load_series(path: str | Path, backend: str | None = None, rig_path: str | Path | None = None) -> LogSeries:
    """Read a log; if it has no ``est/state`` (or ``backend`` is given) estimate it here first."""
    reader = read_log(path)
    rig = rig_of_log(reader.header, path, rig_path)
    model = rig.model
    records = list(reader)
    has_est = any(r.topic == "est/state" for r in records)
    step_seconds = None
    if backend is not None or not has_est:
        pipe = Pipeline(rig, backend)
        inputs = [r for r in records if not r.topic.startswith("est/")]
        records = list(run_log(pipe, iter(inputs)))
        step_seconds = pipe.times.recent()  # the last (up to 10 000) steps: fixed memory
    acc = AccuracyAccumulator(rig, model, keep_series=True)
    est: list[tuple[float, dict]] = []
    topic_times: dict[str, list[float]] = {}
    sensor_msgs: dict[str, list[dict]] = {}
    diag: list[dict] = []
    truth: list[dict] = []
    for rec in records:
        msg = _decode_lenient(rec.topic, rec.payload)
        if msg is None:
            continue
        topic_times.setdefault(rec.topic, []).append(float(msg["t"]))
        if rec.topic == "est/state":
            est.append((rec.t_recv, msg))
        elif rec.topic == "est/diag":
            diag.append(msg)
        elif rec.topic == "truth/state":
            truth.append(msg)
        elif schema.is_sensor_topic(rec.topic):
            sensor_msgs.setdefault(rec.topic, []).append(msg)
        acc.add(rec.topic, msg)
    if not est:
        raise UserError(f"{path}: no est/state messages and none could be produced")
    g = model.g
    est_t = np.array([m["t"] for _, m in est])
    arr = {k: np.array([m[k] for _, m in est], dtype=float) for k in ("q", "qd", "z", "zd")}
    sigma_z = None
    pz = [m.get("P_z") for _, m in est]
    if all(p is not None for p in pz):
        P = np.array(pz, dtype=float)
        var = P[:, :: 2 * g + 1][:, :g] if P.shape[1] == (2 * g) ** 2 else P[:, :g]
        sigma_z = np.sqrt(np.clip(var, 0.0, None))
    flat: list[dict[str, float]] = []
    for _, m in est:
        f: dict[str, float] = {}
        for k, v in m.items():
            if k not in STANDARD_FIELDS:
                _flatten(k, v, f)
        flat.append(f)
    names = sorted({k for f in flat for k in f})
    extras: dict[str, Series] = {}
    for name in names:
        if "_sigma" in name.split(".")[0].split("[")[0]:
            continue
        rows = [(t, f[name], f.get(_sigma_name(name), math.nan)) for t, f in zip(est_t, flat, strict=True) if name in f]
        a = np.array(rows)
        sig = a[:, 2:3] if np.isfinite(a[:, 2]).any() else None
        extras[name] = Series(a[:, 0], a[:, 1:2], sig)
    return LogSeries(
        path=Path(path), rig=rig, model=model, backend=str(est[-1][1].get("backend", "")),
        est_t=est_t, est_q=arr["q"], est_qd=arr["qd"], est_z=arr["z"], est_zd=arr["zd"],
        est_status=[str(m.get("status", "")) for _, m in est],
        est_quality=[str(m.get("quality") or "") for _, m in est],
        est_recv=np.array([r for r, _ in est]),
        est_latency=np.array([float(m.get("latency_s", math.nan)) for _, m in est]),
        est_sigma_z=sigma_z, extras=extras, accuracy=acc,
        topic_times={k: np.asarray(v) for k, v in topic_times.items()}, sensor_msgs=sensor_msgs,
        truth_t=np.array([m["t"] for m in truth]), truth_z=np.array([m["z"] for m in truth]).reshape(len(truth), g),
        diag=diag, step_seconds=step_seconds, estimated_here=step_seconds is not None,
    )


# ------------------------------------------------------------------------------------- reference
def reference_signal(ls: LogSeries, i: int) -> tuple[str | None, np.ndarray, np.ndarray]:
    """Reference of DOF i as (name, t (s), value (rad or m)); (None, [], []) when there is none."""
    ref_name, _ = ls.accuracy.stats(i)
    if ref_name is None:
        return None, np.empty(0), np.empty(0)
    if ref_name == "truth/state":
        return ref_name, ls.truth_t, ls.truth_z[:, i]
    enc = ls.accuracy.encoders[i]
    msgs = ls.sensor_msgs.get(enc.topic, [])
    return ref_name, np.array([m["t"] for m in msgs]), np.array([float(enc.measure(m)[0]) for m in msgs])


def _reference_label(name: str) -> str:
    return "truth" if name == "truth/state" else f"encoder {name.removeprefix('enc/')} (not fused)"


# ------------------------------------------------------------------------------------- figures
def fig_dofs(ls: LogSeries) -> Figure:
    """Per DOF: estimate vs reference (top, 1σ band if known) and error with its RMSE (bottom, with the
    estimator's ±2σ around zero if known)."""
    g = ls.model.g
    fig = Figure(figsize=(9, 2.6 * 2 * g), layout="constrained")
    axes = fig.subplots(2 * g, 1, sharex=True, squeeze=False)[:, 0]
    for i, u in enumerate(ls.units):
        ax, ax_e = axes[2 * i], axes[2 * i + 1]
        ref_name, rt, rv = reference_signal(ls, i)
        z = ls.est_z[:, i] * u.scale
        if ref_name is not None:
            ax.plot(rt, rv * u.scale, color=COLORS["reference"], lw=1.0, label=_reference_label(ref_name))
        ax.plot(ls.est_t, z, color=COLORS["estimate"], lw=1.0, ls="--", label=f"estimate ({ls.backend})")
        if ls.est_sigma_z is not None:
            sd = ls.est_sigma_z[:, i] * u.scale
            ax.fill_between(ls.est_t, z - sd, z + sd, color=COLORS["estimate"], alpha=0.25, label="estimate ± 1σ")
        ax.set_ylabel(f"{u.name} ({u.unit})")
        ax.set_title(f"{u.name}: estimate vs {_reference_label(ref_name) if ref_name else 'no reference in this log'}")
        ax.legend(loc="upper right", fontsize="small")
        ax.grid(alpha=0.3)
        _, st = ls.accuracy.stats(i)
        if st is not None and st.n:
            ax_e.plot(np.asarray(st.t), np.asarray(st.err) * u.scale, color=COLORS["error"], lw=0.8,
                      label=f"error (RMSE {st.rmse * u.scale:.3g} {u.unit}, max {st.max_abs * u.scale:.3g} {u.unit})")
            ax_e.axhline(0.0, color="grey", lw=0.5)
            if ls.est_sigma_z is not None:  # the estimator's own ±2σ: an error mostly inside it is consistent
                sd2 = 2.0 * ls.est_sigma_z[:, i] * u.scale
                ax_e.fill_between(ls.est_t, -sd2, sd2, color=COLORS["estimate"], alpha=0.2, label="estimator's ± 2σ")
            ax_e.legend(loc="upper right", fontsize="small")
        else:
            ax_e.text(0.5, 0.5, "no reference: error not available", transform=ax_e.transAxes, ha="center")
        ax_e.set_ylabel(f"error ({u.unit})")
        ax_e.grid(alpha=0.3)
    axes[-1].set_xlabel("time (s)")
    return fig


def fig_rates(ls: LogSeries) -> Figure:
    """Messages per second of every topic (1 s bins of sensor time)."""
    fig = Figure(figsize=(9, 3.5), layout="constrained")
    ax = fig.subplots()
    t_all = np.concatenate([v for v in ls.topic_times.values() if v.size])
    t0, t1 = float(t_all.min()), float(t_all.max())
    edges = np.arange(math.floor(t0), math.ceil(t1) + 1.0, 1.0)
    if edges.size < 2:
        edges = np.array([t0, t0 + 1.0])
    centers = 0.5 * (edges[:-1] + edges[1:])
    for topic in sorted(ls.topic_times):
        counts, _ = np.histogram(ls.topic_times[topic], bins=edges)
        mean = ls.topic_times[topic].size / max(t1 - t0, 1e-9)
        ax.step(centers, counts, where="mid", label=f"{topic} (mean {mean:.0f} Hz)")
    ax.set_yscale("log")
    ax.set_xlabel("time (s)")
    ax.set_ylabel("messages per second (Hz)")
    ax.set_title("input and output rates")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
    ax.grid(alpha=0.3, which="both")
    return fig


def fig_states(ls: LogSeries) -> Figure | None:
    """Further estimated quantities in est/state (biases, forces, …) with 1σ bands; None if there are none."""
    if not ls.extras:
        return None
    names = list(ls.extras)[:12]
    fig = Figure(figsize=(9, 2.2 * len(names)), layout="constrained")
    axes = fig.subplots(len(names), 1, sharex=True, squeeze=False)[:, 0]
    for ax, name in zip(axes, names, strict=True):
        s = ls.extras[name]
        v = s.v[:, 0]
        ax.plot(s.t, v, color=COLORS["estimate"], lw=1.0, label=name)
        if s.sigma is not None:
            sd = s.sigma[:, 0]
            ax.fill_between(s.t, v - sd, v + sd, color=COLORS["estimate"], alpha=0.25, label=f"{name} ± 1σ")
        ax.set_ylabel(f"{name}\n(SI units)")
        ax.legend(loc="upper right", fontsize="small")
        ax.grid(alpha=0.3)
    axes[0].set_title("further estimated states (est/state fields)")
    axes[-1].set_xlabel("time (s)")
    return fig


@dataclass
class Residuals:
    """Residuals of one fused sensor channel group: measured − predicted from the estimate."""

    label: str
    unit: str  #: of ``r`` after ``scale``
    scale: float
    t: np.ndarray
    r: np.ndarray  #: (N, dim), SI units
    nr2: np.ndarray  #: (N,) rᵀ R⁻¹ r / dim with R = diag(sigma²)
    channels: list[str] = field(default_factory=list)


def residuals(ls: LogSeries) -> list[Residuals]:
    """Per fused sensor: residual of each measurement against the estimate of the same millisecond."""
    model = ls.model
    sensors = ls.rig.virtual_sensors(model)
    if not sensors or ls.est_t.size < 2:
        return []
    keys = np.round(ls.est_t * 1000.0).astype(np.int64)
    zdd = np.gradient(ls.est_zd, ls.est_t, axis=0)
    out = []
    units = dof_units(model)
    for s in sensors:
        if s.is_input:  # a drive's torque: applied, not read
            continue
        msgs = ls.sensor_msgs.get(s.topic, [])
        ts, rs = [], []
        for m in msgs:
            k = int(round(float(m["t"]) * 1000.0))
            j = int(np.searchsorted(keys, k))
            if j >= keys.size or keys[j] != k:
                continue
            try:
                y = s.measure(m)
            except schema.SchemaError:
                continue
            q, qd = ls.est_q[j], ls.est_qd[j]
            qdd = model.solve_acceleration(q, qd, zdd[j]) if isinstance(s, Accelerometer) else np.zeros(model.n)
            r = y - s.h(q, qd, qdd)[0]
            if isinstance(s, (Encoder, Inclination)):
                r = np.asarray(wrap_angle(r))
            ts.append(float(m["t"]))
            rs.append(r)
        if not rs:
            continue
        r = np.array(rs)
        nr2 = np.sum((r / s.sigma) ** 2, axis=1) / s.dim
        if isinstance(s, Accelerometer):
            unit, scale = "m/s²", 1.0
        elif isinstance(s, DriveCommand):  # the DOF's position or velocity: ° or m, °/s or m/s
            angle = units[s.dof].angle
            unit = ("°" if angle else "m") + ("/s" if s.kind == "vel" else "")
            scale = math.degrees(1.0) if angle else 1.0
        elif isinstance(s, (Encoder, Inclination)):
            unit, scale = "°", math.degrees(1.0)
        else:
            unit, scale = "°/s", math.degrees(1.0)
        out.append(Residuals(f"{s.topic} {s.kind}", unit, scale, np.array(ts), r, nr2,
                             [f"{s.kind}[{c}]" for c in range(s.dim)]))
    return out


def _diag_nis(ls: LogSeries) -> dict[str, Series]:
    """Numeric est/diag entries whose name contains ``nis`` (as future backends may report them)."""
    out: dict[str, list[tuple[float, float]]] = {}
    for d in ls.diag:
        f: dict[str, float] = {}
        for k in ("inputs", "info"):
            if isinstance(d.get(k), dict):
                _flatten(k, d[k], f)
        for name, v in f.items():
            if "nis" in name.lower():
                out.setdefault(name, []).append((float(d["t"]), v))
    return {k: Series(np.array(v)[:, 0], np.array(v)[:, 1:2]) for k, v in out.items()}


def fig_residuals(ls: LogSeries, res: list[Residuals] | None = None) -> Figure | None:
    """Per fused sensor: residual channels (left) and normalised squared residual (right)."""
    res = residuals(ls) if res is None else res
    nis = _diag_nis(ls)
    rows = len(res) + (1 if nis else 0)
    if rows == 0:
        return None
    fig = Figure(figsize=(11, 2.6 * rows), layout="constrained")
    axes = fig.subplots(rows, 2, squeeze=False)
    for (ax, ax_n), rr in zip(axes, res, strict=False):
        for c, name in enumerate(rr.channels):
            if np.any(rr.r[:, c] != 0.0):
                ax.plot(rr.t, rr.r[:, c] * rr.scale, lw=0.7,
                        label=f"{name} (RMS {np.sqrt(np.mean(rr.r[:, c] ** 2)) * rr.scale:.3g} {rr.unit})")
        ax.set_ylabel(f"residual ({rr.unit})")
        ax.set_title(f"{rr.label}: measured − predicted from the estimate")
        ax.legend(loc="upper right", fontsize="small")
        ax.grid(alpha=0.3)
        ax_n.plot(rr.t, rr.nr2, lw=0.5, color="tab:purple", alpha=0.5, label=f"rᵀR⁻¹r/dim (mean {rr.nr2.mean():.2f})")
        w = max(1, min(rr.nr2.size, int(round(1.0 / max(float(np.median(np.diff(rr.t))), 1e-6))) if rr.t.size > 1 else 1))
        ax_n.plot(rr.t, np.convolve(rr.nr2, np.ones(w) / w, mode="same"), lw=1.2, color="black", label="1 s running mean")
        ax_n.axhline(1.0, color="grey", ls="--", lw=0.8, label="1 (consistent)")
        ax_n.set_yscale("log")
        ax_n.set_ylabel("normalised residual²")
        ax_n.set_title(f"{rr.label}: normalised squared residual")
        ax_n.legend(loc="upper right", fontsize="small")
        ax_n.grid(alpha=0.3)
    if nis:
        ax, ax_n = axes[-1]
        for name, s in nis.items():
            ax.plot(s.t, s.v[:, 0], lw=0.8, label=name)
        ax.set_ylabel("NIS (est/diag)")
        ax.set_title("NIS reported by the estimator (est/diag)")
        ax.legend(loc="upper right", fontsize="small")
        ax.grid(alpha=0.3)
        ax_n.set_axis_off()
    for ax in axes[-1]:
        if ax.axison:
            ax.set_xlabel("time (s)")
    return fig


def fig_timing(ls: LogSeries) -> Figure:
    """Step-time histogram (µs) and output latency (ms): declared and observed."""
    fig = Figure(figsize=(11, 3.6), layout="constrained")
    ax_h, ax_l = fig.subplots(1, 2)
    if ls.step_seconds is not None and ls.step_seconds.size:
        us = ls.step_seconds * 1e6
        st = step_time_stats(ls.step_seconds)
        us = np.clip(us, 1e-3, None)
        bins = np.geomspace(us.min() * 0.999, max(us.max() * 1.001, us.min() * 10.0), 60)
        ax_h.hist(us, bins=bins, color="tab:green", label=f"{st['steps']} steps")
        for key, ls_ in (("p50", "-"), ("p99", "--")):
            ax_h.axvline(st[key], color="black", ls=ls_, lw=1.0, label=f"{key} {st[key]:.0f} µs")
        ax_h.axvline(1000.0, color="tab:red", lw=1.0, label="1 ms step (real time)")
        ax_h.set_xscale("log")
        ax_h.set_xlabel("processing time per 1 ms step (µs)")
        ax_h.set_ylabel("steps")
        ax_h.legend(loc="upper right", fontsize="small")
    elif ls.diag:
        t = np.array([d["t"] for d in ls.diag])
        for key in ("p50", "p99", "max"):
            v = np.array([float(d.get("step_us", {}).get(key, math.nan)) for d in ls.diag])
            ax_h.plot(t, v, label=f"step time {key} (est/diag)")
        ax_h.set_yscale("log")
        ax_h.set_xlabel("time (s)")
        ax_h.set_ylabel("processing time per step (µs)")
        ax_h.legend(loc="upper right", fontsize="small")
    else:
        ax_h.text(0.5, 0.5, "no step times: the log has no est/diag\n(run rigstate report --backend B to time one)",
                  transform=ax_h.transAxes, ha="center", va="center")
        ax_h.set_xticks([])
        ax_h.set_yticks([])
        ax_h.set_xlabel("processing time per 1 ms step (µs)")
    ax_h.set_title(f"step time ({ls.backend})")
    ax_h.grid(alpha=0.3)
    observed = (ls.est_recv - ls.est_t) * 1e3
    ax_l.hist(observed, bins=50, color="tab:blue",
              label=f"observed: receive time − estimate time (median {np.median(observed):.1f} ms)")
    declared = ls.est_latency[np.isfinite(ls.est_latency)] * 1e3
    if declared.size:
        ax_l.axvline(float(np.median(declared)), color="black", ls="--", lw=1.2,
                     label=f"declared latency_s ({np.median(declared):.1f} ms)")
    ax_l.set_ylim(top=ax_l.get_ylim()[1] * 1.35)  # room for the legend
    ax_l.set_xlabel("latency (ms)")
    ax_l.set_ylabel("estimates")
    ax_l.set_title("output latency")
    ax_l.legend(loc="upper right", fontsize="small")
    ax_l.grid(alpha=0.3)
    return fig


def _levels(ax, t: np.ndarray, values: list[str], levels: list[str], name: str, title: str) -> None:
    """One step line of categorical ``values`` over time t, a level per value, counts in its label."""
    levels = levels + sorted(set(values) - set(levels))
    counts = {s: values.count(s) for s in levels if s in values}
    ax.step(t, np.array([levels.index(s) for s in values]), where="post", color="tab:blue",
            label=", ".join(f"{k}: {v}" for k, v in counts.items()))
    ax.set_yticks(range(len(levels)), levels)
    ax.set_ylim(-0.5, len(levels) - 0.5)
    ax.set_ylabel(name)
    ax.set_title(title)
    ax.legend(loc="upper right", fontsize="small")
    ax.grid(alpha=0.3)


def fig_status(ls: LogSeries) -> Figure:
    """Estimate status over time (one level per status) and, when the estimates carry it, their quality:
    ``inconsistent`` while the estimator disagrees with its sensors (backends/consistency.py)."""
    quality = [i for i, q in enumerate(ls.est_quality) if q]
    fig = Figure(figsize=(9, 4.2 if quality else 2.4), layout="constrained")
    axes = fig.subplots(2 if quality else 1, 1, sharex=True, squeeze=False)[:, 0]
    _levels(axes[0], ls.est_t, ls.est_status, list(STATUS_LEVELS), "status", "estimate status")
    if quality:
        _levels(axes[1], ls.est_t[quality], [ls.est_quality[i] for i in quality], ["ok", "inconsistent"], "quality",
                "estimate quality (inconsistent: innovations outside their bounds, docs/config.md)")
    axes[-1].set_xlabel("time (s)")
    return fig


# ------------------------------------------------------------------------------------- the page
def build_figures(ls: LogSeries) -> dict[str, Figure]:
    """Every figure of the report by name (figures without data are left out)."""
    figs = {"dofs": fig_dofs(ls), "states": fig_states(ls), "residuals": fig_residuals(ls),
            "timing": fig_timing(ls), "rates": fig_rates(ls), "status": fig_status(ls)}
    return {k: v for k, v in figs.items() if v is not None}


def write_report(ls: LogSeries, out_dir: str | Path, dpi: int = 100) -> tuple[Path, dict[str, Path]]:
    """Write ``<name>.png`` per figure and ``report.html`` (images embedded) into ``out_dir``."""
    out = Path(out_dir)
    make_output_dir(out)
    pngs: dict[str, Path] = {}
    for name, fig in build_figures(ls).items():
        pngs[name] = out / f"{name}.png"
        fig.savefig(pngs[name], dpi=dpi)
    page = out / "report.html"
    page.write_text(render_html(ls, pngs))
    return page, pngs


def render_html(ls: LogSeries, pngs: dict[str, Path]) -> str:
    """One self-contained HTML page: summary tables and the PNGs as base64 data URIs."""
    summ = ls.accuracy.summary(ls.step_seconds)
    esc = html.escape
    rows = []
    for d in summ["dofs"]:
        if d["reference"] is None:
            rows.append(f"<tr><td>{esc(d['name'])}</td><td colspan=4>no reference</td></tr>")
        else:
            rows.append(f"<tr><td>{esc(d['name'])}</td><td>{esc(_reference_label(d['reference']))}</td>"
                        f"<td>{d['rmse']:.4g} {esc(d['unit'])}</td><td>{d['max_abs']:.4g} {esc(d['unit'])}</td>"
                        f"<td>{d['matched']}</td></tr>")
    changes = "".join(f"<tr><td>{c['t_s']:.3f}</td><td>{esc(c['status'])}</td></tr>" for c in summ["status_changes"])
    timing = ""
    if "step_us" in summ:
        st = summ["step_us"]
        timing = (f"<p>Step time over {st['steps']} steps: p50 {st['p50']:.0f} µs, p99 {st['p99']:.0f} µs, "
                  f"max {st['max']:.0f} µs (estimated in this run).</p>")
    q = quality_line(summ)
    quality = f"<p>Quality: {esc(q)}.</p>" if q else ""
    imgs = "".join(
        f"<h2>{esc(name)}</h2><img alt='{esc(name)}' src='data:image/png;base64,"
        f"{base64.b64encode(p.read_bytes()).decode()}'>" for name, p in pngs.items())
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>rigstate report: {esc(ls.path.name)}</title>
<style>body{{font-family:sans-serif;max-width:1150px;margin:auto}} img{{max-width:100%}}
table{{border-collapse:collapse}} td,th{{border:1px solid #bbb;padding:2px 8px}}</style></head><body>
<h1>rigstate report: {esc(ls.path.name)}</h1>
<p>Rig {esc(ls.rig.name)}, backend {esc(ls.backend)}, {summ['estimates']} estimates,
DOFs {esc(', '.join(ls.model.dof_names))}.</p>
<table><tr><th>DOF</th><th>reference</th><th>RMSE</th><th>max |error|</th><th>matched</th></tr>{''.join(rows)}</table>
<p>Status counts: {esc(', '.join(f'{k} {v}' for k, v in summ['status'].items()))}</p>{quality}
<table><tr><th>t (s)</th><th>status from then on</th></tr>{changes}</table>
{timing}{imgs}
</body></html>
"""

"""Kinematic validation of a rig from its encoders (Sensors 2016 §5.1): do the IMUs read what the
geometry says they should?

1. **Position problem.** At every sample of the rig's encoders (all of them, fused or not) the DOFs
   z are found such that the encoders' virtual sensors read the measured angles: directly when an
   encoder reads a DOF coordinate itself, else by Gauss–Newton on z with q = q(z) (the model's
   position problem) — the encoders must determine every DOF.
2. **Velocities and accelerations** of the DOFs by smoothing differentiation: z(t) is resampled on a
   uniform grid (the encoders' median sample interval) and a Savitzky–Golay filter (cubic, window
   ``window_s``, default 0.101 s) gives ż and z̈ as the first and second derivatives of the local
   least-squares cubic.  The window trades quantisation noise (≈ σ_q·27/(N^2.5 Δt²) on z̈ for
   N samples) against the bias of a cubic over the window; samples within half a window of either
   end are not used.
3. At each IMU sample time, q, q̇, q̈ come from the velocity and acceleration problems (linear
   interpolation of z, ż, z̈ on the grid), and the rig's virtual gyro and accelerometer predict
   the readings (rad/s, m/s², sensor axes).
4. Comparison per channel: RMSE of measured − predicted; a **constant gyro bias** per channel (the
   least-squares constant: the mean residual); for the accelerometer the least-squares **in-plane
   misalignment** α and constant bias: the measured in-plane part u = A₂ᵀ m (A₂: the sensor axes of
   body x, y) is fitted as u ≈ R(−α) p + c with p the predicted body-frame proper acceleration — a
   2-D Procrustes problem with translation, solved in closed form — and the bias of the out-of-plane
   channel is its mean.  α > 0: the sensor is turned CCW about body z relative to the rig's ``axes``
   (and ``mount_deg``); add α to ``mount_deg``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure
from scipy.signal import savgol_filter

from estimator_service import schema
from estimator_service.analysis import dof_units
from estimator_service.errors import UserError
from estimator_service.logfile import Record, read_log
from estimator_service.model import Model
from estimator_service.offline import rig_of_log
from estimator_service.rig import Rig
from estimator_service.sensors import Accelerometer, Encoder, Gyro
from estimator_service.stacked import kinematics_along
from estimator_service.paths import make_output_dir

DEFAULT_WINDOW_S = 0.101  #: s (also the default of rigstate validate-kinematics --window)


@dataclass
class DofTrajectory:
    """DOF trajectory from the encoders on a uniform grid: t (N,), z, ż, z̈ (N, g) in rad or m."""

    t: np.ndarray
    z: np.ndarray
    zd: np.ndarray
    zdd: np.ndarray
    valid: tuple[float, float]  #: time span where the derivatives are not affected by the ends


@dataclass
class ImuCheck:
    """Result for one IMU (channels in sensor axes; °/s for gyros, m/s² for accelerometers)."""

    imu: str
    samples: int
    gyr_rmse_dps: list[float]
    gyr_bias_dps: list[float]
    gyr_rmse_unbiased_dps: list[float]
    acc_rmse: list[float]
    acc_bias: list[float]
    acc_misalignment_deg: float
    acc_rmse_corrected: list[float]


@dataclass
class ImuSeries:
    """Measured and predicted readings of one IMU at its sample times."""

    name: str
    t: np.ndarray
    gyr_meas: np.ndarray
    gyr_pred: np.ndarray
    acc_meas: np.ndarray
    acc_pred: np.ndarray
    gyr_axis: int  #: the channel that senses the body rate
    acc_axes: tuple[int, int]  #: the channels that carry body x and body y


def encoder_series(log_msgs: dict[str, list[dict]], encoders: list[Encoder]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per encoder topic with messages: (t, angle rad) of its readings."""
    out = {}
    for e in encoders:
        msgs = log_msgs.get(e.topic, [])
        if msgs:
            out[e.topic] = (np.array([m["t"] for m in msgs]), np.array([float(e.measure(m)[0]) for m in msgs]))
    return out


def solve_dofs(model: Model, encoders: list[Encoder], series: dict[str, tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """(t, z (N, g)) from encoder readings: directly or by Gauss–Newton (see module docstring)."""
    used = [e for e in encoders if e.topic in series]
    if not used:
        raise UserError("the log has no encoder messages of this rig's encoders")
    t = series[used[0].topic][0]
    y = np.column_stack([np.interp(t, *series[e.topic]) for e in used])
    dofs = [int(k) for k in model.dof]
    direct = {dofs.index(e.coordinate): j for j, e in enumerate(used) if e.coordinate in dofs}
    if len(direct) == model.g:
        return t, np.column_stack([y[:, direct[i]] for i in range(model.g)])
    names = [e.name for e in used]
    z = np.empty((t.size, model.g))
    q = model.q0.copy()
    zk = q[model.dof].copy()
    for k in range(t.size):
        for _ in range(20):
            q = model.solve_position(q, zk)
            R = model.R(q)
            zero = np.zeros(model.n)
            hs = [e.h(q, zero, zero) for e in used]
            H = np.array([h[1][0] @ R for h in hs])
            r = np.array([y[k, j] - h[0][0] for j, h in enumerate(hs)])
            if np.linalg.matrix_rank(H) < model.g:
                raise UserError(f"encoders {names} do not determine the DOFs {model.dof_names}")
            dz = np.linalg.lstsq(H, r, rcond=None)[0]
            zk = zk + dz
            if np.max(np.abs(dz)) < 1e-12:
                break
        z[k] = zk
    return t, z


def differentiate(t: np.ndarray, z: np.ndarray, window_s: float = DEFAULT_WINDOW_S) -> DofTrajectory:
    """Uniform resampling and Savitzky–Golay (cubic) smoothing differentiation of z(t)."""
    if t.size < 8:
        raise UserError(f"only {t.size} encoder samples; need a longer log")
    dt = float(np.median(np.diff(t)))
    grid = np.arange(t[0], t[-1] + 0.5 * dt, dt)
    n = max(5, int(round(window_s / dt)) | 1)
    if n >= grid.size:
        raise UserError(f"the log ({t[-1] - t[0]:.3f} s) is shorter than the "
                        f"differentiation window ({window_s} s)")
    zg = np.column_stack([np.interp(grid, t, z[:, i]) for i in range(z.shape[1])])
    zs = savgol_filter(zg, n, 3, axis=0, mode="interp")
    zd = savgol_filter(zg, n, 3, deriv=1, delta=dt, axis=0, mode="interp")
    zdd = savgol_filter(zg, n, 3, deriv=2, delta=dt, axis=0, mode="interp")
    half = (n // 2 + 1) * dt
    return DofTrajectory(grid, zs, zd, zdd, (float(grid[0] + half), float(grid[-1] - half)))


def trajectory_states(model: Model, traj: DofTrajectory, t: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(q, q̇, q̈), each (N, n), at the increasing times t (N,) (s): z, ż, z̈ linearly interpolated on the
    trajectory's grid, then the position, velocity and acceleration problems of every time at once
    (stacked.kinematics_along; positions on the mechanism file's assembly branch)."""
    def at_t(a: np.ndarray) -> np.ndarray:
        return np.column_stack([np.interp(t, traj.t, a[:, i]) for i in range(model.g)])

    return kinematics_along(model, at_t(traj.z), at_t(traj.zd), at_t(traj.zdd))


def predict_imus(rig: Rig, model: Model, traj: DofTrajectory, imu_msgs: dict[str, list[dict]]) -> list[ImuSeries]:
    """Measured and predicted gyro/accelerometer readings of every IMU at its samples in the valid span."""
    sensors = rig.all_virtual_sensors(model)
    lo, hi = traj.valid
    msgs = {imu.name: [m for m in imu_msgs.get(f"imu/{imu.name}", []) if lo <= m["t"] <= hi] for imu in rig.imus}
    times = np.unique([float(m["t"]) for ms in msgs.values() for m in ms])  # (the IMUs share a time's state)
    q, qd, qdd = trajectory_states(model, traj, times)
    out = []
    for imu in rig.imus:
        topic = f"imu/{imu.name}"
        gyr = next(s for s in sensors if isinstance(s, Gyro) and s.topic == topic)
        acc = next(s for s in sensors if isinstance(s, Accelerometer) and s.topic == topic)
        if not msgs[imu.name]:
            continue
        t = np.array([float(m["t"]) for m in msgs[imu.name]])
        at = np.searchsorted(times, t)
        A2 = acc.A2
        out.append(ImuSeries(
            imu.name, t, np.array([m["gyr"] for m in msgs[imu.name]], dtype=float),
            np.array([gyr.h(q[k], qd[k], qdd[k])[0] for k in at]),
            np.array([m["acc"] for m in msgs[imu.name]], dtype=float),
            np.array([acc.h(q[k], qd[k], qdd[k])[0] for k in at]),
            int(np.argmax(np.abs(gyr.col))), (int(np.argmax(np.abs(A2[:, 0]))), int(np.argmax(np.abs(A2[:, 1])))),
        ))
    return out


def fit_misalignment(A2: np.ndarray, normal: np.ndarray, meas: np.ndarray, pred: np.ndarray) -> tuple[float, np.ndarray, np.ndarray]:
    """Least-squares in-plane misalignment α (rad) and bias b (3,) with meas ≈ A2 R(α)ᵀ A2ᵀ pred + b.

    ``A2`` (3, 2): sensor components of body x, y; ``normal`` (3,): of body z; ``meas``, ``pred`` (N, 3).
    Returns (α, b, corrected prediction (N, 3)).
    """
    u = meas @ A2
    p = pred @ A2  # predicted body-frame in-plane proper acceleration
    uc, pc = u - u.mean(axis=0), p - p.mean(axis=0)
    beta = math.atan2(float(np.sum(pc[:, 0] * uc[:, 1] - pc[:, 1] * uc[:, 0])), float(np.sum(pc * uc)))
    c, s = math.cos(beta), math.sin(beta)
    Rb = np.array([[c, -s], [s, c]])
    cvec = u.mean(axis=0) - Rb @ p.mean(axis=0)
    b_out = float(np.mean(meas @ normal))
    bias = A2 @ cvec + normal * b_out
    corrected = (p @ Rb.T) @ A2.T + bias
    return -beta, bias, corrected


def _rms(x: np.ndarray) -> list[float]:
    return [float(v) for v in np.sqrt(np.mean(x**2, axis=0))]


def check_imu(rig: Rig, model: Model, s: ImuSeries) -> ImuCheck:
    """RMSE, gyro bias, accelerometer misalignment and bias of one IMU."""
    acc = next(v for v in rig.all_virtual_sensors(model) if isinstance(v, Accelerometer) and v.topic == f"imu/{s.name}")
    imu = next(i for i in rig.imus if i.name == s.name)
    eg = s.gyr_meas - s.gyr_pred
    bias_g = eg.mean(axis=0)
    alpha, bias_a, corrected = fit_misalignment(acc.A2, imu.axes[:, 2], s.acc_meas, s.acc_pred)
    d = math.degrees(1.0)
    return ImuCheck(
        imu=s.name, samples=int(s.t.size),
        gyr_rmse_dps=[v * d for v in _rms(eg)], gyr_bias_dps=[float(v) * d for v in bias_g],
        gyr_rmse_unbiased_dps=[v * d for v in _rms(eg - bias_g)],
        acc_rmse=_rms(s.acc_meas - s.acc_pred), acc_bias=[float(v) for v in bias_a],
        acc_misalignment_deg=math.degrees(alpha), acc_rmse_corrected=_rms(s.acc_meas - corrected),
    )


@dataclass
class KinematicsResult:
    """Everything validate-kinematics computed."""

    rig: Rig
    model: Model
    traj: DofTrajectory
    series: list[ImuSeries]
    checks: list[ImuCheck]
    window_s: float

    def to_json(self) -> dict:
        return {"rig": self.rig.name, "window_s": self.window_s, "dofs": self.model.dof_names,
                "valid_span_s": list(self.traj.valid), "imus": [asdict(c) for c in self.checks]}


def read_messages(log_path: str | Path, rig_path: str | Path | None = None) -> tuple[Rig, dict[str, list[dict]]]:
    """The rig (``rig_path``, else the log header's) and the decoded messages of its IMUs and encoders per
    topic, in log order (messages that fail the schema are skipped)."""
    reader = read_log(log_path)
    rig = rig_of_log(reader.header, log_path, rig_path)
    return rig, sensor_messages(reader, rig)


def sensor_messages(records: Iterable[Record], rig: Rig) -> dict[str, list[dict]]:
    """The decoded messages of the rig's IMUs and encoders among ``records``, per topic, in their order
    (messages that fail the schema are skipped)."""
    wanted = set(rig.all_sensor_topics())
    msgs: dict[str, list[dict]] = {}
    for rec in records:
        if rec.topic in wanted:
            try:
                msgs.setdefault(rec.topic, []).append(schema.decode(rec.topic, rec.payload))
            except schema.SchemaError:
                continue
    return msgs


def validate_kinematics(log_path: str | Path, rig_path: str | Path | None = None,
                        window_s: float = DEFAULT_WINDOW_S) -> KinematicsResult:
    """Run the whole check on a log (see module docstring)."""
    if not window_s > 0:
        raise UserError(f"--window must be > 0 s, got {window_s}")
    rig, msgs = read_messages(log_path, rig_path)
    model = rig.model
    encoders = [s for s in rig.all_virtual_sensors(model) if isinstance(s, Encoder)]
    if not encoders:
        raise UserError(f"{rig.path}: the rig has no encoders; kinematic validation needs them")
    t, z = solve_dofs(model, encoders, encoder_series(msgs, encoders))
    traj = differentiate(t, z, window_s)
    series = predict_imus(rig, model, traj, msgs)
    if not series:
        raise UserError(f"{log_path}: no IMU messages of this rig inside the encoders' time span")
    return KinematicsResult(rig, model, traj, series, [check_imu(rig, model, s) for s in series], window_s)


def format_result(res: KinematicsResult) -> str:
    """Table per IMU."""
    lines = [f"kinematic validation of {res.rig.name}: DOFs {', '.join(res.model.dof_names)} from the encoders; "
             f"derivatives by Savitzky–Golay (cubic, {res.window_s * 1e3:.0f} ms)"]
    for c in res.checks:
        lines.append(f"  imu {c.imu} ({c.samples} samples)")
        lines.append("    gyr  RMSE " + " ".join(f"{v:8.4f}" for v in c.gyr_rmse_dps) + " °/s   bias "
                     + " ".join(f"{v:+8.4f}" for v in c.gyr_bias_dps) + " °/s   RMSE without bias "
                     + " ".join(f"{v:7.4f}" for v in c.gyr_rmse_unbiased_dps))
        lines.append("    acc  RMSE " + " ".join(f"{v:8.4f}" for v in c.acc_rmse) + " m/s²  bias "
                     + " ".join(f"{v:+8.4f}" for v in c.acc_bias) + " m/s²  RMSE corrected "
                     + " ".join(f"{v:7.4f}" for v in c.acc_rmse_corrected))
        lines.append(f"    in-plane misalignment {c.acc_misalignment_deg:+.3f}° (add to mount_deg)")
    return "\n".join(lines)


def fig_imu(res: KinematicsResult, s: ImuSeries) -> Figure:
    """Measured vs predicted gyro (sensing channel) and accelerometer (in-plane channels), with errors."""
    c = next(x for x in res.checks if x.imu == s.name)
    fig = Figure(figsize=(12, 6.5), layout="constrained")
    axes = fig.subplots(2, 3, sharex=True)
    d = math.degrees(1.0)
    g = s.gyr_axis
    ax, ax_e = axes[0, 0], axes[1, 0]
    ax.plot(s.t, s.gyr_meas[:, g] * d, lw=0.7, color="tab:orange", label="measured")
    ax.plot(s.t, s.gyr_pred[:, g] * d, lw=1.0, color="black", label="predicted from encoders")
    ax.set_ylabel(f"gyr[{g}] (°/s)")
    ax.set_title(f"imu {s.name}: gyro channel {g}")
    ax.legend(loc="upper right", fontsize="small")
    ax_e.plot(s.t, (s.gyr_meas[:, g] - s.gyr_pred[:, g]) * d, lw=0.6, color="tab:red",
              label=f"error (RMSE {c.gyr_rmse_dps[g]:.3f} °/s, bias {c.gyr_bias_dps[g]:+.3f} °/s)")
    ax_e.axhline(c.gyr_bias_dps[g], color="black", ls="--", lw=1.0, label="estimated bias")
    ax_e.set_ylabel("error (°/s)")
    ax_e.legend(loc="upper right", fontsize="small")
    for col, a in zip((1, 2), s.acc_axes, strict=True):
        ax, ax_e = axes[0, col], axes[1, col]
        ax.plot(s.t, s.acc_meas[:, a], lw=0.7, color="tab:orange", label="measured")
        ax.plot(s.t, s.acc_pred[:, a], lw=1.0, color="black", label="predicted from encoders")
        ax.set_ylabel(f"acc[{a}] (m/s²)")
        ax.set_title(f"imu {s.name}: accelerometer channel {a}")
        ax.legend(loc="upper right", fontsize="small")
        ax_e.plot(s.t, s.acc_meas[:, a] - s.acc_pred[:, a], lw=0.6, color="tab:red",
                  label=f"error (RMSE {c.acc_rmse[a]:.3f} m/s²)")
        ax_e.set_ylabel("error (m/s²)")
        ax_e.legend(loc="upper right", fontsize="small")
    for ax in axes.flat:
        ax.grid(alpha=0.3)
    for ax in axes[1]:
        ax.set_xlabel("time (s)")
    fig.suptitle(f"imu {s.name}: in-plane misalignment {c.acc_misalignment_deg:+.3f}°, "
                 f"acc bias {', '.join(f'{v:+.3f}' for v in c.acc_bias)} m/s²")
    return fig


def fig_dofs(res: KinematicsResult) -> Figure:
    """The DOF trajectory from the encoders: position, velocity and acceleration (smoothed)."""
    units = dof_units(res.model)
    fig = Figure(figsize=(9, 6.5), layout="constrained")
    axes = fig.subplots(3, 1, sharex=True)
    tr = res.traj
    for i, u in enumerate(units):
        axes[0].plot(tr.t, tr.z[:, i] * u.scale, label=u.name)
        axes[1].plot(tr.t, tr.zd[:, i] * u.scale, label=u.name)
        axes[2].plot(tr.t, tr.zdd[:, i] * u.scale, label=u.name)
    unit = units[0].unit if len({u.unit for u in units}) == 1 else "° or m"
    for ax, (lab, suf) in zip(axes, (("position", ""), ("velocity", "/s"), ("acceleration", "/s²")), strict=True):
        ax.set_ylabel(f"DOF {lab} ({unit}{suf})")
        ax.axvspan(tr.t[0], tr.valid[0], color="grey", alpha=0.2)
        ax.axvspan(tr.valid[1], tr.t[-1], color="grey", alpha=0.2)
        ax.legend(loc="upper right", fontsize="small")
        ax.grid(alpha=0.3)
    axes[0].set_title(f"DOFs from the encoders (Savitzky–Golay, {res.window_s * 1e3:.0f} ms; grey: not used)")
    axes[2].set_xlabel("time (s)")
    return fig


def write_outputs(res: KinematicsResult, out_dir: str | Path) -> dict[str, Path]:
    """``dofs.png``, ``imu-<name>.png`` and ``kinematics.json`` in ``out_dir``."""
    out = Path(out_dir)
    make_output_dir(out)
    paths = {"dofs": out / "dofs.png"}
    fig_dofs(res).savefig(paths["dofs"], dpi=100)
    for s in res.series:
        paths[f"imu-{s.name}"] = out / f"imu-{s.name}.png"
        fig_imu(res, s).savefig(paths[f"imu-{s.name}"], dpi=100)
    paths["json"] = out / "kinematics.json"
    paths["json"].write_text(json.dumps(res.to_json(), indent=2) + "\n")
    return paths

"""What ``rigstate calibrate`` found: the printed table, the figures and the calibrated rig TOML.

The TOML is the input rig's (parsed, so its comments give way to a header that lists the calibration)
with the calibrated keys set or replaced (docs/calibrate.md); relative paths (the mechanism, ``[bus.auth]``
key files) are rewritten relative to the output file's folder.
"""

from __future__ import annotations

import json
import math
import os
import tomllib
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure

from estimator_service.analysis import dof_units
from estimator_service.calibrate import AXIS_LETTERS, Calibration, DriveCalibration, Estimate, ImuCalibration
from estimator_service.errors import UserError
from estimator_service.rig import AUTH_DEFAULTS

DEG = math.degrees(1.0)


def _pm(e: Estimate, scale: float = 1.0, fmt: str = "+.4g", axes: bool = False) -> str:
    parts = []
    for i, (v, s) in enumerate(zip(e.value, e.sigma, strict=True)):
        lab = f"{AXIS_LETTERS[i]} " if axes else ""
        parts.append(f"{lab}{v * scale:{fmt}} ± {s * scale:.2g}")
    return ", ".join(parts)


def _drive_unit(cal: Calibration, d: DriveCalibration) -> str:
    units = {u.name: u for u in dof_units(cal.rig.model)}
    return "rad/s²/√Hz" if units[d.dof].angle else "m/s²/√Hz"


def format_calibration(cal: Calibration) -> str:
    """The table ``rigstate calibrate`` prints: every value with its 1σ, and what was kept."""
    lo, hi = cal.window
    lines = [f"calibration of {cal.rig.name} from the {cal.source} ({hi - lo:.1f} s of sensor time)"]
    for c in cal.imus:
        lines.append(f"  imu {c.name}")
        same = c.axes == c.axes_before
        lines.append(f"    axes         {c.axes}  (sensor {AXIS_LETTERS[c.normal]} = {'+' if c.sign > 0 else '-'}body z"
                     + ("" if same else f"; the rig said {c.axes_before}") + ")")
        if "slopes" in c.figures:
            lines.append("    gyro slopes  " + " ".join(f"{v:+.3f}" for v in c.figures["slopes"])
                         + "  (each channel regressed on the body rate from the encoders)")
        if c.time_offset.found:
            lines.append(f"    time offset  {_pm(c.time_offset, 1e3, '+.2f')} ms  (stamp - sampling time)")
            lines.append(f"    gyro scale   {_pm(c.gyr_scale, 1.0, '.4f')}  (from the integrals; written as gyr_scale_cal where 3 sigma from 1)")
        lines.append(f"    gyr bias     {_pm(c.gyr_bias, DEG, '+.3f', axes=True)} °/s")
        lines.append(f"    gyr noise    {_pm(c.gyr_noise, DEG, '.3f', axes=True)} °/s RMS")
        if c.mount.found:
            lines.append(f"    mount        {_pm(c.mount, DEG, '+.2f')}°")
        else:
            lines.append(f"    mount        {float(c.mount.value[0]) * DEG:+.2f}° kept (not observable)")
        if c.at.found:
            lines.append(f"    lever arm    {_pm(c.at, 1e3, '+.1f', axes=True)} mm (body frame)")
        else:
            lines.append(f"    lever arm    [{', '.join(f'{v * 1e3:+.1f}' for v in c.at.value)}] mm kept (not observable)")
        if c.acc_bias.found:
            lines.append(f"    acc bias     {_pm(c.acc_bias, 1.0, '+.3f', axes=True)} m/s²")
        lines.append(f"    acc noise    {_pm(c.acc_noise, 1.0, '.3f', axes=True)} m/s² RMS")
        lines.append(f"    use          {c.use}")
    for d in cal.drives:
        verdict = ("driven: the free model explains it no better" if d.driven
                   else "not driven: the mechanism's own dynamics explain it better")
        lines.append(f"  dof {d.dof}: accel_density {_pm(d.accel_density, 1.0, '.3g')} {_drive_unit(cal, d)}; "
                     f"log-likelihood of the encoder innovations {d.loglik_drive:.1f} as a drive, {d.loglik_model:.1f} "
                     f"with the free model: {verdict}")
    for name, s in cal.encoder_sigma.items():
        lines.append(f"  encoder {name}: noise {s * DEG:.4f}° (maximum likelihood with the drive)")
    lines += [f"  note: {n}" for n in cal.notes]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------ TOML
def _value(v: object) -> str:
    """A TOML value, inline (strings as JSON strings, which TOML reads the same)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False)
    if isinstance(v, list):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{_key(k)} = {_value(x)}" for k, x in v.items()) + " }"
    raise TypeError(f"no TOML value for {v!r}")


def _key(k: str) -> str:
    return k if k and all(c.isalnum() or c in "_-" for c in k) else json.dumps(k)


def _table(path: list[str], t: dict, header: str) -> list[str]:
    """Lines of one table (``header`` its ``[a.b]`` or ``[[a]]`` line, "" at the top): its plain keys,
    then its sub-tables and arrays of tables, in order."""
    plain = [f"{_key(k)} = {_value(v)}" for k, v in t.items()
             if not isinstance(v, dict) and not (isinstance(v, list) and v and all(isinstance(x, dict) for x in v))]
    out = ([header] if header and (plain or not any(isinstance(v, (dict, list)) for v in t.values())) else []) + plain
    for k, v in t.items():
        sub = [*path, _key(k)]
        if isinstance(v, dict):
            out += [""] + _table(sub, v, f"[{'.'.join(sub)}]")
        elif isinstance(v, list) and v and all(isinstance(x, dict) for x in v):
            for x in v:
                out += [""] + _table(sub, x, f"[[{'.'.join(sub)}]]")
    return out


def dumps_rig(doc: dict) -> str:
    """A rig document as TOML text, tables in the order the rig files use ([rig], [[imu]], [[encoder]],
    [[drive]], then the rest), arrays inline."""
    order = ["rig", "imu", "encoder", "drive"]
    ordered = {k: doc[k] for k in order if k in doc} | {k: v for k, v in doc.items() if k not in order}
    text = "\n".join(_table([], ordered, "")).strip("\n") + "\n"
    while "\n\n\n" in text:
        text = text.replace("\n\n\n", "\n\n")
    return text


def _rel(target: Path, out_dir: Path) -> str:
    return os.path.relpath(target.resolve(), out_dir.resolve())


def calibrated_toml(cal: Calibration, out: str | Path, source: str) -> str:
    """The calibrated rig's TOML text (see module docstring); ``source`` names the log in the header."""
    rig = cal.rig
    out_dir = Path(out).parent
    doc = tomllib.loads(rig.toml_text)
    for k, c in enumerate(cal.imus):
        t = doc["imu"][k]
        t["axes"] = list(c.axes)
        if c.mount.found or c.axes != c.axes_before:
            t["mount_deg"] = round(float(c.mount.value[0]) * DEG, 4)
        if c.mount.found:  # the estimators' mount state starts from what the calibration knows (backends/sensor_params.py)
            t["mount_prior_deg"] = max(round(float(c.mount.sigma[0]) * DEG, 4), 1e-4)
        if c.time_offset.found:
            t["time_offset_s"] = round(float(c.time_offset.value[0]), 6)
        bias = [float(v) for v in c.gyr_bias.value]
        scale = [1.0, 1.0, 1.0]
        if abs(c.gyr_scale.value[0] - 1.0) > 3 * c.gyr_scale.sigma[0]:  # a scale error the data shows
            scale[c.normal] = round(float(c.gyr_scale.value[0]), 5)
            bias[c.normal] = c.gyr_scaled_bias
            t["gyr_scale_cal"] = scale
        else:
            t.pop("gyr_scale_cal", None)
        t["gyr_bias_cal"] = [round(v, 7) for v in bias]
        if c.acc_bias.found:
            t["acc_bias_cal"] = [round(float(v), 5) for v in c.acc_bias.value]
        if c.at.found:
            t.pop("point", None)
            t["at"] = [round(float(v), 5) for v in c.at.value]
        t.pop("gyr_sigma_dps", None)
        # one σ per gyro and accelerometer: its noisiest channel's, correlated noise by its slow part (calibrate.py)
        t["gyr_sigma"] = round(float(np.max(c.gyr_noise.value if c.gyr_sigma is None else c.gyr_sigma)), 6)
        t["acc_sigma"] = round(float(np.max(c.acc_noise.value if c.acc_sigma is None else c.acc_sigma)), 5)
        t["use"] = list(c.use)
    names = [e.name for e in rig.encoders]
    for name, s in cal.encoder_sigma.items():
        doc["encoder"][names.index(name)]["sigma"] = float(f"{s:.4g}")
    drives = doc.get("drive", [])
    for d in cal.drives:
        entry = next((x for x in drives if x.get("dof") == d.dof), None)
        if entry is None and not d.driven:
            continue
        if entry is None:
            entry = {"dof": d.dof}
            drives.append(entry)
        entry["accel_density"] = float(f"{float(d.accel_density.value[0]):.4g}")
    if drives:
        doc["drive"] = drives
    doc["rig"]["mechanism"] = _rel(Path(rig.mechanism_path), out_dir)
    auth = doc.get("bus", {}).get("auth")
    if isinstance(auth, dict):
        base = Path(rig.path).parent
        for key, default in AUTH_DEFAULTS.items():
            auth[key] = _rel(base / auth.get(key, default), out_dir)
    lo, hi = cal.window
    head = [f"# Calibrated by rigstate calibrate from {source} ({cal.source}, sensor time {lo:.3f} to {hi:.3f} s); "
            f"base: {rig.path}", "# docs/calibrate.md. Values with 1 sigma:"]
    head += ["#   " + line.strip() for line in format_calibration(cal).split("\n")[1:]]
    return "\n".join(head) + "\n\n" + dumps_rig(doc)


def write_calibrated(cal: Calibration, out: str | Path, source: str) -> Path:
    """Write :func:`calibrated_toml` to ``out``."""
    path = Path(out)
    try:
        path.write_text(calibrated_toml(cal, path, source))
    except OSError as exc:
        raise UserError(f"{path}: cannot write: {exc.strerror}") from None
    return path


# ------------------------------------------------------------------------------------ figures
def fig_imu(c: ImuCalibration) -> Figure:
    """Gyro (normal channel) against the calibrated prediction and its error; the time-offset cost; the
    in-plane accelerometer against the calibrated model."""
    f = c.figures
    fig = Figure(figsize=(13, 8), layout="constrained")
    ax = fig.subplots(2, 2)
    t = f["t"]
    ax[0, 0].plot(t, f["g"] * DEG, lw=0.5, color="tab:orange", label=f"gyro {AXIS_LETTERS[c.normal]} × {c.sign:+d}")
    ax[0, 0].plot(t, f["w"] * DEG, lw=1.0, color="black", label="body rate from the encoders at t − δ")
    ax[0, 0].set_ylabel("rate (°/s)")
    ax[0, 0].set_title(f"imu {c.name}: the channel normal to the plane, calibrated axes {c.axes}")
    e = (f["g"] - f["w"] - c.sign * c.gyr_bias.value[c.normal]) * DEG
    sig = float(c.gyr_noise.value[c.normal]) * DEG
    ax[1, 0].plot(t, e, lw=0.5, color="tab:red", label=f"error after bias (RMS {sig:.2f} °/s)")
    for k in (-3, 3):
        ax[1, 0].axhline(k * sig, color="black", ls="--", lw=0.8)
    ax[1, 0].set_ylabel("error (°/s)")
    ax[1, 0].set_xlabel("time (s)")
    grid, cost = f["cost"]
    ax[0, 1].plot(grid * 1e3, cost / cost.min(), color="tab:blue")
    ax[0, 1].axvline(c.time_offset.value[0] * 1e3, color="black", ls="--",
                     label=f"δ = {c.time_offset.value[0] * 1e3:+.2f} ± {c.time_offset.sigma[0] * 1e3:.2f} ms")
    ax[0, 1].set_xlabel("time offset δ (ms)")
    ax[0, 1].set_ylabel("gyro residual sum of squares (relative)")
    ax[0, 1].set_title("time offset: stamp − sampling time")
    u, up = f["u"], f["u_pred"]
    for i, col in enumerate(("tab:green", "tab:purple")):
        ax[1, 1].plot(t, u[:, i], lw=0.5, color=col, alpha=0.7, label=f"measured, body {'xy'[i]} axis")
        ax[1, 1].plot(t, up[:, i], lw=1.0, color="black")
    mount = (f"mount {c.mount.value[0] * DEG:+.2f} ± {c.mount.sigma[0] * DEG:.2f}°" if c.mount.found
             else "mount not observable")
    ax[1, 1].set_title(f"in-plane accelerometer (black: calibrated), {mount}", fontsize="medium")
    ax[1, 1].set_ylabel("m/s²")
    ax[1, 1].set_xlabel("time (s)")
    for a in ax.flat:
        a.grid(alpha=0.3)
        if a.get_legend_handles_labels()[0]:
            a.legend(loc="upper right", fontsize="small")
    return fig


def fig_drives(cal: Calibration) -> Figure:
    """Profile log-likelihood of the encoder innovations against the drive's density, per DOF."""
    fig = Figure(figsize=(8, 4.5), layout="constrained")
    ax = fig.subplots()
    for d in cal.drives:
        ll = d.profile - d.profile.max()
        ax.semilogx(d.q_grid, ll, marker=".", label=f"dof {d.dof}")
        ax.axvline(d.accel_density.value[0], color="black", ls="--", lw=0.8)
        ax.axhline(d.loglik_model - d.profile.max(), color="tab:red", ls=":", lw=1.0,
                   label=f"dof {d.dof}: the free model instead")
    ax.set_yscale("symlog", linthresh=1.0)
    ax.set_xlabel("accel_density (units/s²/√Hz)")
    ax.set_ylabel("log-likelihood − its maximum")
    ax.set_title("drive: likelihood of the encoder innovations (maximum over the encoder noise)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize="small")
    return fig


def write_figures(cal: Calibration, out_dir: str | Path) -> list[Path]:
    """``imu-<name>.png`` per IMU calibrated on encoders and ``drive.png``, in ``out_dir``."""
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"{out}: cannot create the figures directory: {exc.strerror}") from None
    paths = []
    for c in cal.imus:
        if "cost" in c.figures:
            paths.append(out / f"imu-{c.name}.png")
            fig_imu(c).savefig(paths[-1], dpi=100)
    if cal.drives:
        paths.append(out / "drive.png")
        fig_drives(cal).savefig(paths[-1], dpi=100)
    return paths

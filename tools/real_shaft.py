"""The real-shaft protocol of docs/real-data.md: every trial x backend x setting, one table.

    python tools/real_shaft.py DATA_DIR [--trials pitch_slow,roll_medium] [--backends fgs,ekf,ukf,errekf]
                               [--settings newcomer,calibrated] [--calibrate-s 60] [--out DIR] [--json table.json]

DATA_DIR holds one folder per trial (``pitch_*``, ``roll_*``, ``yaw_*``: the shaft axis is the IMU's y, x or z
axis), each with the source's one-file export ``raw.csv`` (or, without it, ``imu__shaft.csv`` and
``enc__shaft.csv`` in rigstate's CSV layout). Per trial:

1. ``rigstate log import --table raw.csv --map config/maps/real-shaft.toml`` (or ``--csv`` of the two CSVs);
2. **newcomer**: ``rigstate estimate`` with the shipped rig ``config/rigs/shaft-<axis>.toml`` as a newcomer
   writes it from the data's README (axes with + signs, nothing calibrated, the encoder not fused);
3. **calibrated**: ``rigstate calibrate`` of that rig on the first ``--calibrate-s`` seconds, then
   ``rigstate estimate`` over the whole recording with the calibrated rig.

No setting is per trial: the shipped defaults and what calibrate learns. Per run it reports the angle RMSE
against the encoder (deg), the share of estimates whose quality is ``ok``, the share with |error| <= 3 sigma
of the published P_z, the share of estimates more than 3 deg off that say ``inconsistent``, the
re-initialisations and the real-time factor (recorded seconds per wall-clock second of the estimate
command, start-up and any kernel compilation included: run twice for a warm figure).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
AXES = {"pitch": "shaft-pitch", "roll": "shaft-roll", "yaw": "shaft-yaw"}  #: trial prefix -> shipped rig
MAP = ROOT / "config" / "maps" / "real-shaft.toml"  #: the source's columns and units
LARGE_DEG = 3.0  #: an error this large (deg) should be flagged inconsistent


def rigstate(*args: str) -> str:
    """Run one rigstate command; its stdout (exit status checked)."""
    res = subprocess.run([sys.executable, "-m", "estimator_service.cli", *args], capture_output=True, text=True)
    if res.returncode != 0:
        raise SystemExit(f"rigstate {' '.join(args)} failed ({res.returncode}):\n{res.stderr[-2000:]}")
    return res.stdout


def scores(est_log: Path, dof: str = "shaft") -> dict:
    """Shares of honesty from an estimate log: quality ok, |error| <= 3 sigma, large errors flagged."""
    from estimator_service.logfile import read_dataframes

    d = read_dataframes(est_log)
    est, enc = d["est/state"], d["enc/shaft"]
    zc = f"z_{dof}" if f"z_{dof}" in est.columns else "z_0"
    pc = f"P_z_{dof}_{dof}" if f"P_z_{dof}_{dof}" in est.columns else "P_z_0"
    t_est = np.round(est.index.to_numpy() * 1000).astype(np.int64)
    t_enc = np.round(enc.index.to_numpy() * 1000).astype(np.int64)
    common, i_est, i_enc = np.intersect1d(t_est, t_enc, return_indices=True)
    ang = enc["count"].to_numpy()[i_enc] / enc["cpr"].to_numpy()[i_enc] * 2 * math.pi
    err = np.degrees(np.angle(np.exp(1j * (est[zc].to_numpy()[i_est] - ang))))
    ok = est["quality"].to_numpy()[i_est] == "ok"
    sigma = np.degrees(np.sqrt(np.maximum(est[pc].to_numpy()[i_est], 0.0))) if pc in est.columns else None
    large = np.abs(err) > LARGE_DEG
    return {"matched": int(common.size), "rmse_deg": float(np.sqrt(np.mean(err**2))),
            "ok_share": float(ok.mean()),
            "within_3sigma": float(np.mean(np.abs(err) <= 3 * sigma)) if sigma is not None else None,
            "large_errors": int(large.sum()),
            "large_flagged": float(np.mean(~ok[large])) if large.any() else None}


def run(trial_dir: Path, backends: list[str], cal_s: float, work: Path,
        settings: tuple[str, ...] = ("newcomer", "calibrated")) -> list[dict]:
    """The settings of one trial, every backend."""
    prefix = trial_dir.name.split("_")[0]
    rig = ROOT / "config" / "rigs" / f"{AXES[prefix]}.toml"
    log = work / f"{trial_dir.name}.log"
    if (trial_dir / "raw.csv").exists():
        rigstate("log", "import", "--table", str(trial_dir / "raw.csv"), "--map", str(MAP), "--out", str(log))
    else:
        csv_dir = work / f"{trial_dir.name}-csv"
        csv_dir.mkdir(parents=True, exist_ok=True)
        for f in ("imu__shaft.csv", "enc__shaft.csv"):
            shutil.copy(trial_dir / f, csv_dir / f)
        rigstate("log", "import", "--csv", str(csv_dir), "--out", str(log))
    cal = work / f"{trial_dir.name}-calibrated.toml"
    rigstate("calibrate", str(log), "--rig", str(rig), "--window", f"0:{cal_s:g}", "--out", str(cal))
    rows = []
    for setting, rig_path in ((s, {"newcomer": rig, "calibrated": cal}[s]) for s in settings):
        for b in backends:
            out = work / f"{trial_dir.name}-{setting}-{b}.log"
            t0 = time.perf_counter()
            summary = json.loads(rigstate("estimate", str(log), "--rig", str(rig_path), "--backend", b,
                                          "--out", str(out), "--json"))
            wall = time.perf_counter() - t0
            span = (summary["t_last_s"] or 0.0) - (summary["t_first_s"] or 0.0)
            row = {"trial": trial_dir.name, "setting": setting, "backend": b, **scores(out),
                   "reinit": summary["status"].get("reinit", 0), "rtf": span / wall}
            rows.append(row)
            print(json.dumps(row), flush=True)
            out.unlink()
    return rows


def table(rows: list[dict]) -> str:
    """The rows as a Markdown table."""
    def pct(v: float | None) -> str:
        return "—" if v is None else f"{100 * v:.1f} %"
    lines = ["| trial | setting | backend | RMSE | quality ok | \\|err\\| ≤ 3σ | > 3° flagged | re-inits | RTF |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['trial']} | {r['setting']} | {r['backend']} | {r['rmse_deg']:.2f}° | {pct(r['ok_share'])} | "
                     f"{pct(r['within_3sigma'])} | {pct(r['large_flagged'])} | {r['reinit']} | {r['rtf']:.1f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("data", type=Path, help="folder of trial folders")
    ap.add_argument("--trials", help="comma-separated trial folder names (default: every pitch_/roll_/yaw_ folder)")
    ap.add_argument("--backends", default="fgs,ekf,ukf,errekf")
    ap.add_argument("--settings", default="newcomer,calibrated", help="comma-separated: newcomer, calibrated")
    ap.add_argument("--calibrate-s", type=float, default=60.0, help="calibrate on the first this many seconds")
    ap.add_argument("--out", type=Path, help="keep the work files here (default: a temporary folder)")
    ap.add_argument("--json", type=Path, help="write the rows as JSON")
    a = ap.parse_args()
    trials = [a.data / t for t in a.trials.split(",")] if a.trials else \
        sorted(p for p in a.data.iterdir() if p.is_dir() and p.name.split("_")[0] in AXES)
    work = a.out or Path(tempfile.mkdtemp(prefix="real-shaft-"))
    work.mkdir(parents=True, exist_ok=True)
    settings = tuple(a.settings.split(","))
    if not set(settings) <= {"newcomer", "calibrated"}:
        raise SystemExit(f"--settings {a.settings}: each must be newcomer or calibrated")
    rows = [r for t in trials for r in run(t, a.backends.split(","), a.calibrate_s, work, settings)]
    print(table(rows))
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()

"""Every kind of ``[[drive]]`` input on every backend, on the simulated driven shaft (docs/config.md, [[drive]]).

    python tools/drive_inputs.py [--rig config/rigs/shaft-sim.toml] [--duration 20] [--backends ekf,ukf,errekf,fgs]

The rig's ``[[drive]]`` table is replaced by each of: the drive unknown; its controller's velocity command (250 Hz,
σ 0.01 rad/s); its position command (100 Hz, σ 0.002 rad); its torque (1 kHz, σ 1 mN·m). Each variant is simulated
with the rig's seed (the same motion and the same IMU noise) and run through every backend as ``rigstate estimate``
does (estimator_service.evaluate.score_against_truth). Per run: the shaft's RMSE against the truth after 0.1 s
(deg), the share of estimates with |error| <= 3σ of their P_z, the share whose quality is ok, and the
re-initialisations.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from estimator_service import schema
from estimator_service.evaluate import score_against_truth
from estimator_service.rig import load_rig_text
from estimator_service.simulate import simulate

ROOT = Path(__file__).resolve().parent.parent
#: the [[drive]] body (after ``dof``) of each variant
INPUTS = {
    "unknown": "",
    "velocity": 'input = "velocity"\nsigma = 0.01\nrate_hz = 250',
    "position": 'input = "position"\nsigma = 0.002\nrate_hz = 100',
    "torque": 'input = "torque"\nsigma = 0.001\nrate_hz = 1000',
}


def variant(rig_path: Path, body: str, duration: float):
    """The rig of ``rig_path`` with its [[drive]] table's keys after ``dof`` replaced by ``body``."""
    text = rig_path.read_text()
    text = re.sub(r'(\[\[drive\]\]\ndof = "[^"]+"[^\n]*\n)(?:(?!\n)[^\[][^\n]*\n)*', lambda m: m.group(1) + body + "\n", text)
    text = re.sub(r"duration_s = [0-9.]+", f"duration_s = {duration}", text)
    yaml_path = (rig_path.parent / re.search(r'mechanism = "([^"]+)"', text).group(1)).resolve()
    return load_rig_text(text, yaml_path.read_text(), str(rig_path))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rig", type=Path, default=ROOT / "config" / "rigs" / "shaft-sim.toml")
    ap.add_argument("--duration", type=float, default=20.0, help="simulated seconds (default 20)")
    ap.add_argument("--backends", default="ekf,ukf,errekf,fgs")
    args = ap.parse_args()
    print("| input | backend | RMSE | \\|err\\| ≤ 3σ | quality ok | re-inits |")
    print("|---|---|---|---|---|---|")
    for name, body in INPUTS.items():
        rig = variant(args.rig, body, args.duration)
        records = [(topic, schema.encode(topic, msg)) for topic, msg in simulate(rig)]
        for backend in args.backends.split(","):
            r = score_against_truth(rig, records, backend)
            print(f"| {name} | {backend} | {r.rmse_deg:.3f}° | {100 * r.within:.1f} % | {100 * r.ok:.1f} % | "
                  f"{r.reinit} |", flush=True)


if __name__ == "__main__":
    main()

"""The bound of one scenario with its priors tightened step by step (docs/accuracy.md, "the bound").

    python tools/bound_priors.py config/rigs/scenarios/biases-friction.toml

Levels (each adds to the one before; filter priors, [estimator.ekf]):
  0  the rig's defaults
  1  the start angle's prior σ = 1° (the public scenarios start exactly 1° off)
  2  gyro-bias priors 0.25 °/s and the viscous coefficient's 0.04 N·m·s/rad (biases-friction's values)
  3  the model known exactly (no parameter states, no model noise) and the DOF bias force b pinned
  4  no process noise at all: every unknown a constant, as in the simulation
and "nb": level 1 without sensor-parameter states (biases and time offsets known).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

from estimator_service.bound import bound_log
from estimator_service.commands.bench import default_cache_dir, simulated_log
from estimator_service.logfile import read_log
from estimator_service.offline import rig_of_log
from estimator_service.rig import Rig


def rig_at(log: Path, level: str) -> Rig:
    """The log's rig with the priors of ``level`` (module docstring)."""
    rig = rig_of_log(read_log(log).header, log)
    ekf = dict(rig.estimator.ekf)
    n = 1 if level == "nb" else int(level)
    if n >= 1:
        ekf["init_sigma_z"] = math.radians(1.0)
    if level == "nb":
        for imu in rig.imus:
            imu.gyr_bias_prior, imu.time_offset_prior_s = 0.0, 0.0
    if n >= 2:
        ekf["init_sigma_damping"] = 0.04
        for imu in rig.imus:
            imu.gyr_bias_prior = math.radians(0.25)
    if n >= 3:
        ekf["init_sigma_force"] = 1e-4
        rig.estimator.model = {"adapt": False, "mass": 0.0, "inertia": 0.0}
    if n >= 4:
        ekf.update(sigma_z=0.0, sigma_zd=0.0, sigma_damping=0.0, sigma_force=0.0)
        for imu in rig.imus:
            imu.gyr_bias_walk = 0.0
    rig.estimator.ekf = ekf
    return rig


def main(argv: list[str]) -> int:
    rig_path = Path(argv[0])
    levels = argv[1].split(",") if len(argv) > 1 else ["0", "1", "2", "3", "4", "nb"]
    log = simulated_log(rig_path, default_cache_dir(), None)
    for level in levels:
        b = bound_log(log, f"level {level}", "ekf", rig=rig_at(log, level))
        windows = "  ".join(f"{w}: {v['crank']:.3f}" for w, v in b.windows.items())
        print(f"level {level:2}  crank bound {b.rmse_dof['crank']:.3f}°  | {windows}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

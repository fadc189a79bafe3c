"""Up-front check of a rig TOML: everything the rig implies, before anything runs.

``check_rig`` loads the rig (TOML keys, mechanism file, sensors, simulation, bus endpoints), builds
the model (the mechanism assembles), every sensor channel and its topic, then every backend with its
parameter table (all of ``[estimator.ekf]``, ``[estimator.ukf]``, ``[estimator.fgs]``, not only the
selected one) and the initialiser of ``[estimator.init]``, exactly as the estimator does at start.
Problems are ``UserError``s naming file, field and value; independent parts are all checked, so
one run reports every problem it can reach.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from estimator_service import schema
from estimator_service.backends import make_backend
from estimator_service.backends.init import Initializer
from estimator_service.errors import ConfigError, UserError
from estimator_service.rig import BACKENDS, Rig, load_rig


@dataclass
class RigCheck:
    """Result of :func:`check_rig`: the rig if it loaded, and every problem found."""

    path: str
    rig: Rig | None = None
    problems: list[UserError] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def _endpoint_problems(rig: Rig) -> list[UserError]:
    """Endpoints two processes would both bind: the estimator's vs the sensors' and the simulator's."""
    sensors = {f"imu[{i}].endpoint": s.endpoint for i, s in enumerate(rig.imus)}
    sensors |= {f"encoder[{i}].endpoint": e.endpoint for i, e in enumerate(rig.encoders)}
    sensors |= {f"drive[{i}].endpoint": d.endpoint for i, d in enumerate(rig.drives) if d.measured}
    sensors["bus.sim"] = rig.bus.sim
    return [ConfigError(rig.path, "bus.estimator", f"{rig.bus.estimator!r} is also {where}: the estimator "
                        "and that publisher cannot both bind it")
            for where, ep in sensors.items() if ep == rig.bus.estimator]


def check_rig(path: str | Path) -> RigCheck:
    """Check a rig TOML file and everything it implies (see the module docstring)."""
    out = RigCheck(str(path))
    try:
        rig = load_rig(path)
        model = rig.model  # the mechanism assembles; DOFs determine it
        sensors = rig.virtual_sensors(model)
        rig.all_virtual_sensors(model)
        for topic in rig.all_sensor_topics():
            try:
                schema.schema_key(topic)
            except schema.SchemaError as exc:
                out.problems.append(ConfigError(rig.path, "topic", str(exc)))
    except UserError as exc:
        out.problems.append(exc)
        return out
    out.rig = rig
    out.problems += _endpoint_problems(rig)
    for name in BACKENDS:
        try:
            make_backend(name, model, sensors, rig.estimator)
        except UserError as exc:
            out.problems.append(exc)
    try:
        init = Initializer(model, rig, sensors)
        init.pose() if init.mode == "pose" else init.branch()  # the configured pose / branch assembles
    except UserError as exc:
        out.problems.append(exc)
    return out

"""Degrees of freedom for display: names, units and formatting of z, ż and their errors.

One home for how a DOF is shown (``bench``, ``demo``, ``watch``): an angular DOF (a relative
coordinate, rad) is shown in degrees (values wrapped to [0, 360), errors to [-180, 180)); a
translational DOF (a point coordinate, e.g. a slider's x) in metres.  ``est/state`` and
``truth/state`` carry z and ż in the order of :attr:`Model.dof_names`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from estimator_service.analysis import dof_units
from estimator_service.angles import wrap_angle
from estimator_service.model import Model


@dataclass(frozen=True)
class Dof:
    """One DOF as shown: ``name``, ``index`` into z, ``angular`` (rad, shown in °) or translational (m)."""

    name: str
    index: int
    angular: bool

    @property
    def unit(self) -> str:
        """Display unit of values and errors: ``°`` or ``m``."""
        return "°" if self.angular else "m"

    @property
    def rate_unit(self) -> str:
        """Unit of the rate as carried (not converted): ``rad/s`` or ``m/s``."""
        return "rad/s" if self.angular else "m/s"

    def error(self, estimate: np.ndarray | float, truth: np.ndarray | float) -> np.ndarray:
        """Estimate minus truth in SI units (rad or m); angles wrapped to [-π, π) (angles.wrap_angle)."""
        e = np.asarray(estimate, dtype=float) - np.asarray(truth, dtype=float)
        return wrap_angle(e) if self.angular else e

    def shown(self, value: np.ndarray | float) -> np.ndarray | float:
        """An error (or difference) in display units: degrees for angles, metres otherwise."""
        return np.degrees(value) if self.angular else value

    def fmt_value(self, value: float) -> str:
        """A coordinate value: ``123.45°`` (wrapped to [0, 360)) or ``+0.1234 m``."""
        return f"{math.degrees(value) % 360:7.2f}°" if self.angular else f"{value:+8.4f} m"

    def fmt_error(self, error: float) -> str:
        """An error given in SI units: ``+0.123°`` or ``+1.2e-04 m``."""
        return f"{math.degrees(error):+7.3f}°" if self.angular else f"{error:+.1e} m"

    def fmt_size(self, size: float) -> str:
        """A non-negative size (RMSE, max |error|) given in SI units: ``0.123°`` or ``1.2e-04 m``."""
        return f"{math.degrees(size):.3f}°" if self.angular else f"{size:.1e} m"


def dofs_of(model: Model) -> list[Dof]:
    """The DOFs of a model in the order of z (angle or translation as :func:`analysis.dof_units` decides)."""
    return [Dof(u.name, i, u.angle) for i, u in enumerate(dof_units(model))]

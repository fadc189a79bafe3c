"""The one angle wrap of the project: radians to [−π, π).

Pure Python on a float or a numpy array; :mod:`estimator_service.kernels` registers the same function for
its compiled code (``numba.extending.register_jitable``), so estimators, identification, analysis and the
kernels share one rule.
"""

from __future__ import annotations

import math

import numpy as np


def wrap_angle(a: float | np.ndarray) -> float | np.ndarray:
    """An angle (rad), or an array of them, wrapped to [−π, π)."""
    return (a + math.pi) % (2 * math.pi) - math.pi

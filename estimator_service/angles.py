"""The angle rules of the project: the one wrap, radians to [−π, π), and quadrature counts to an angle.

Pure Python on a float or a numpy array; :mod:`estimator_service.kernels` registers the same wrap for
its compiled code (``numba.extending.register_jitable``), so estimators, identification, analysis and the
kernels share one rule; the encoder drivers, the estimator's encoder sensor and ``rigstate watch`` share
:func:`counts_to_angle`.
"""

from __future__ import annotations

import math

import numpy as np


def wrap_angle(a: float | np.ndarray) -> float | np.ndarray:
    """An angle (rad), or an array of them, wrapped to [−π, π)."""
    return (a + math.pi) % (2 * math.pi) - math.pi


def counts_to_angle(count: int, cpr: int, offset: float = 0.0) -> float:
    """Angle (rad) of a continuous quadrature ``count``: ``offset + 2π count / cpr``, with ``cpr`` the counts per
    revolution (4 × lines) and ``offset`` (rad) the angle at count 0."""
    return offset + math.tau * count / cpr

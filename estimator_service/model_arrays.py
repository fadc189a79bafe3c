"""The model contract: the arrays that describe a mechanism and its sensors' geometry (:class:`ModelArrays`).

:class:`~estimator_service.model.Model` builds them once, when it is final (after the constraint-row reduction
and the drives), as ``model.arrays``; every other module that needs a table of the model (the compiled kernels,
``identify``'s stacked model, the sensor tables) reads it here instead of the model's private attributes.
Pure numpy, no I/O.  Units SI (m, rad, kg, s).

Coordinates (docs/architecture.md): ``q`` (n,) holds x, y of every non-fixed point in file order, then the
relative angles; the extended coordinates ``qe`` (ne,) append the fixed points' x, y (global frame, m), so
every constraint row is written with one index pattern.  Constraint row r (m rows, after the reduction):

- quadratic / linear rows (distances, sliders): Φ_r = ½ qeᵀ H_r qe + B_r·qe + c_r  (m², m);
- relative-angle rows (:class:`AngleRow`): Φ_r = (xb − xa) − L cos θ if |sin θ| ≥ |cos θ|, else
  (yb − ya) − L sin θ  (m); their H_r, B_r, c_r are zero.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class AngleRow:
    """A relative-angle constraint row: ``row`` its index in Φ, ``theta`` the index of its angle θ in q,
    ``xa, ya, xb, yb`` the indices in qe of its points a, b, ``length`` |b − a| (m)."""

    row: int
    theta: int
    xa: int
    ya: int
    xb: int
    yb: int
    length: float


@dataclass(frozen=True)
class ModelArrays:
    """The constant arrays of a final :class:`~estimator_service.model.Model` (read-only numpy arrays).

    Sizes: ``n`` coordinates q, ``ne`` extended coordinates qe (n + 2 per fixed point), ``m`` independent
    constraint rows, ``g`` degrees of freedom.

    - ``size`` (float, m): length scale of the mechanism, 1 + the largest |x| or |y| of its points; position
      problems converge when max |Φ| ≤ tol · size².
    - ``qe0`` (ne,): extended coordinates with q = 0 and the fixed points' coordinates (m, global frame) after
      it; ``fixed`` = ``qe0[n:]``.
    - ``H`` (m, ne, ne) (dimensionless: the Hessian of Φ_r over qe), ``B`` (m, ne), ``c`` (m,) (m² or m): the
      quadratic and linear constraint rows (module docstring); ``Hq`` (m, n, n) = ``H[:, :n, :n]`` (the fixed
      coordinates never move).
    - ``angles``: the relative-angle rows (:class:`AngleRow`), in the order of the relative coordinates.
    - ``dampers``: per joint damper (A (ne, ne), c (N·m·s/rad)): the relative rate ω_rel = qeᵀ A q̇e (rad/s)
      of its bodies and its coefficient; its generalized force is −c (Aᵀ qe)[:n] ω_rel.
    - ``Q_gravity`` (n,): generalized gravity forces (N on point coordinates, N·m on angles).
    - ``M`` (n, n): constant mass matrix (kg on point coordinates), with the drive inertia of driven DOFs (a
      read-only view of ``Model.M``).
    - ``dof`` (g,) int: indices in q of the independent coordinates z (a read-only view of ``Model.dof``);
      ``dependent`` (n − g,) int: the others, ascending; ``S`` (g, n): the selection with S q = z.
    - ``body_geom``: per body (xi, yi, xj, yj, L): the indices in qe of its first and second point and their
      distance L (m); the body frame has its origin at the first point and +x towards the second.
    - ``omega_A``: per body A (ne, ne) with its angular rate ω = qeᵀ A q̇e (rad/s, CCW), exact where
      |rj − ri| = L.
    """

    n: int
    ne: int
    m: int
    g: int
    size: float
    qe0: np.ndarray
    H: np.ndarray
    B: np.ndarray
    c: np.ndarray
    Hq: np.ndarray
    angles: tuple[AngleRow, ...]
    dampers: tuple[tuple[np.ndarray, float], ...]
    Q_gravity: np.ndarray
    M: np.ndarray
    dof: np.ndarray
    dependent: np.ndarray
    S: np.ndarray
    body_geom: tuple[tuple[int, int, int, int, float], ...]
    omega_A: tuple[np.ndarray, ...]

    def __post_init__(self) -> None:
        """Every array of the contract is made read-only (consumers copy what they change)."""
        arrays = [self.qe0, self.H, self.B, self.c, self.Hq, self.Q_gravity, self.M, self.dof, self.dependent, self.S,
                  *self.omega_A, *(A for A, _ in self.dampers)]
        for a in arrays:
            a.flags.writeable = False

    @property
    def fixed(self) -> np.ndarray:
        """The fixed points' coordinates (ne − n,) (m, global frame): ``qe0[n:]``."""
        return self.qe0[self.n :]


def read_only_view(a: np.ndarray) -> np.ndarray:
    """A read-only view of ``a`` (same memory; ``a`` itself stays writable)."""
    v = a.view()
    v.flags.writeable = False
    return v

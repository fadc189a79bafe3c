"""Mechanism description: the data read from a mechanism YAML file (mbse format + extensions).

Pure data; ``load_mechanism`` parses a file into it.  Lengths in m, masses in kg, inertias in
kg·m², angles in rad, damping in N·m·s/rad.  Frames: see docs/architecture.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Point:
    """A point of the mechanism; ``x``, ``y`` are its initial (or fixed) global coordinates in m."""

    x: float
    y: float
    fixed: bool = False


@dataclass(frozen=True)
class Body:
    """A planar rigid body through 2 or more points (indices into ``Mechanism.points``).

    ``I0`` is the moment of inertia about the first point, ``cog`` the centre of gravity in the
    body frame (origin at the first point, x towards the second).  ``lengths`` maps each
    constrained point pair ``(a, b)`` (indices into ``points``) to its distance in m.
    """

    name: str
    points: tuple[int, ...]
    mass: float
    I0: float
    cog: tuple[float, float]
    lengths: dict[tuple[int, int], float]


@dataclass(frozen=True)
class RelativeCoordinate:
    """Absolute angle (rad, from +x, CCW) of the vector from point ``a`` to point ``b``; an extra entry of q."""

    name: str
    a: int
    b: int


@dataclass(frozen=True)
class Slider:
    """Extension: point ``point`` is constrained to the fixed line through ``origin`` with ``direction``."""

    point: int
    origin: tuple[float, float]
    direction: tuple[float, float]


@dataclass(frozen=True)
class Damper:
    """Extension: viscous damping torque ``-c * (omega_a - omega_b)`` in a joint between two bodies.

    ``body_b`` is ``None`` for the ground.  ``c`` in N·m·s/rad.
    """

    body_a: int
    body_b: int | None
    c: float


@dataclass(frozen=True)
class NamedPoint:
    """Extension: a named point fixed to body ``body`` at ``local`` (m, body frame), e.g. an IMU mount."""

    name: str
    body: int
    local: tuple[float, float]


@dataclass(frozen=True)
class Dof:
    """Extension: a named degree of freedom, the coordinate ``coordinate`` (index into q)."""

    name: str
    coordinate: int


@dataclass
class Mechanism:
    """A whole mechanism as read from its file (``source`` is the path, for error messages)."""

    source: str
    points: list[Point]
    bodies: list[Body]
    relative_coordinates: list[RelativeCoordinate] = field(default_factory=list)
    sliders: list[Slider] = field(default_factory=list)
    dampers: list[Damper] = field(default_factory=list)
    named_points: list[NamedPoint] = field(default_factory=list)
    dofs: list[Dof] = field(default_factory=list)
    gravity: tuple[float, float] = (0.0, -9.81)
    parameters: dict[str, float] = field(default_factory=dict)

"""Mechanism description: the data read from a mechanism YAML file (mbse format + extensions).

Pure data; ``load_mechanism`` parses a file into it.  Lengths in m, masses in kg, inertias in
kg·m², angles in rad, damping in N·m·s/rad.  Frames: see docs/architecture.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from estimator_service.errors import ConfigError
from estimator_service.expr import ExprError, evaluate


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


# ---------------------------------------------------------------------------------------- loading
_MBSE_TOP = {"parameters", "points", "planar_bodies", "relative_coordinates"}
_EXT_TOP = {"gravity", "sliders", "dampers", "named_points", "dofs", "name", "description"}


def load_mechanism(path: str | Path) -> Mechanism:
    """Read a mechanism YAML file (mbse format + extensions, see docs/mechanism-format.md)."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(str(path), "", f"cannot read: {exc.strerror}") from None
    return parse_mechanism(text, str(path))


def parse_mechanism(text: str, source: str) -> Mechanism:
    """Parse the text of a mechanism file; ``source`` names it in error messages."""
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        raise ConfigError(source, "", f"YAML syntax error: {where}{getattr(exc, 'problem', exc)}") from None
    if not isinstance(doc, dict):
        raise ConfigError(source, "", "expected a mapping with 'points' and 'planar_bodies'")
    return _Loader(source, doc).mechanism()


class _Loader:
    def __init__(self, source: str, doc: dict) -> None:
        self.source, self.doc = source, doc
        self.env: dict[str, float] = {}

    def err(self, field: str, problem: str) -> ConfigError:
        return ConfigError(self.source, field, problem)

    def num(self, value: object, field: str, env: dict[str, float] | None = None) -> float:
        try:
            return evaluate(value, env if env is not None else self.env)  # type: ignore[arg-type]
        except ExprError as exc:
            raise self.err(field, str(exc)) from None

    def seq(self, key: str) -> list:
        value = self.doc.get(key) or []
        if not isinstance(value, list):
            raise self.err(key, f"expected a list, got {type(value).__name__}")
        return value

    def entry(self, value: object, field: str) -> dict:
        if not isinstance(value, dict):
            raise self.err(field, f"expected a mapping, got {value!r}")
        return value

    def mechanism(self) -> Mechanism:
        unknown = set(self.doc) - _MBSE_TOP - _EXT_TOP
        if unknown:
            raise self.err(sorted(unknown)[0], f"unknown top-level key; known: {sorted(_MBSE_TOP | _EXT_TOP)}")
        params = self.doc.get("parameters") or {}
        if not isinstance(params, dict):
            raise self.err("parameters", "expected a mapping name -> expression")
        for name, expr in params.items():
            self.env[str(name)] = self.num(expr, f"parameters.{name}")
        parameters = dict(self.env)
        points = self.points()
        bodies = self.bodies(points)
        mech = Mechanism(source=self.source, points=points, bodies=bodies, parameters=parameters)
        mech.relative_coordinates = self.relative_coordinates(points)
        if "gravity" in self.doc:
            g = self.doc["gravity"]
            if not isinstance(g, list) or len(g) != 2:
                raise self.err("gravity", f"expected [gx, gy] in m/s^2, got {g!r}")
            mech.gravity = (self.num(g[0], "gravity[0]"), self.num(g[1], "gravity[1]"))
        mech.sliders = self.sliders(points)
        mech.dampers = self.dampers(bodies)
        mech.named_points = self.named_points(points, bodies)
        mech.dofs = self.dofs(points, mech.relative_coordinates)
        return mech

    def points(self) -> list[Point]:
        out = []
        raw = self.seq("points")
        if not raw:
            raise self.err("points", "a mechanism needs at least one point")
        for i, p in enumerate(raw):
            p = self.entry(p, f"points[{i}]")
            for key in ("x", "y"):
                if key not in p:
                    raise self.err(f"points[{i}]", f"missing '{key}'")
            x = self.num(p["x"], f"points[{i}].x")
            y = self.num(p["y"], f"points[{i}].y")
            fixed = p.get("fixed", False)
            if not isinstance(fixed, bool):
                raise self.err(f"points[{i}].fixed", f"expected true or false, got {fixed!r}")
            self.env[f"x{i}"], self.env[f"y{i}"] = x, y
            out.append(Point(x, y, fixed))
        return out

    def point_index(self, value: object, field: str, points: list[Point]) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < len(points):
            raise self.err(field, f"unknown point index {value!r} (points are 0..{len(points) - 1})")
        return value

    def bodies(self, points: list[Point]) -> list[Body]:
        out = []
        raw = self.seq("planar_bodies")
        if not raw:
            raise self.err("planar_bodies", "a mechanism needs at least one body")
        for k, b in enumerate(raw):
            f = f"planar_bodies[{k}]"
            b = self.entry(b, f)
            idx = b.get("points")
            if not isinstance(idx, list) or len(idx) < 2:
                raise self.err(f"{f}.points", f"a body needs a list of 2 or more point indices, got {idx!r}")
            idx = [self.point_index(v, f"{f}.points", points) for v in idx]
            if len(set(idx)) != len(idx):
                raise self.err(f"{f}.points", f"repeated point in {idx}")
            dist = {}
            for a, c in self._pairs(idx):
                pa, pc = points[a], points[c]
                dist[(a, c)] = math.hypot(pc.x - pa.x, pc.y - pa.y)
            env = dict(self.env)
            for i in range(len(idx)):
                for j in range(len(idx)):
                    if i != j:
                        pa, pc = points[idx[i]], points[idx[j]]
                        env[f"length{i + 1}{j + 1}"] = math.hypot(pc.x - pa.x, pc.y - pa.y)
            if len(idx) == 2:
                length = b.get("length", "auto")
                L = dist[(idx[0], idx[1])] if length == "auto" else self.num(length, f"{f}.length", env)
                if L <= 0:
                    raise self.err(f"{f}.length", f"must be > 0, got {L}")
                dist[(idx[0], idx[1])] = L
                env["length"] = L
            for a, c in dist:
                if dist[(a, c)] <= 0:
                    raise self.err(f"{f}.points", f"points {a} and {c} coincide: a body needs distinct points")
            for key in ("mass", "I0", "cog"):
                if key not in b:
                    raise self.err(f, f"missing '{key}'")
            mass = self.num(b["mass"], f"{f}.mass", env)
            if mass < 0:
                raise self.err(f"{f}.mass", f"must be >= 0, got {mass}")
            env["mass"] = mass
            I0 = self.num(b["I0"], f"{f}.I0", env)
            if I0 < 0:
                raise self.err(f"{f}.I0", f"must be >= 0, got {I0}")
            cog = b["cog"]
            if not isinstance(cog, list) or len(cog) != 2:
                raise self.err(f"{f}.cog", f"expected [x, y] in the body frame, got {cog!r}")
            cog_xy = (self.num(cog[0], f"{f}.cog[0]", env), self.num(cog[1], f"{f}.cog[1]", env))
            name = str(b.get("name", f"body{k}"))
            if any(o.name == name for o in out):
                raise self.err(f"{f}.name", f"duplicate body name {name!r}")
            out.append(Body(name, tuple(idx), mass, I0, cog_xy, dist))
        return out

    @staticmethod
    def _pairs(idx: list[int]) -> list[tuple[int, int]]:
        """Constrained point pairs of a body: (0,1), then (0,j) and (1,j) for j >= 2."""
        pairs = [(idx[0], idx[1])]
        for j in idx[2:]:
            pairs += [(idx[0], j), (idx[1], j)]
        return pairs

    def relative_coordinates(self, points: list[Point]) -> list[RelativeCoordinate]:
        out = []
        for k, r in enumerate(self.seq("relative_coordinates")):
            f = f"relative_coordinates[{k}]"
            r = self.entry(r, f)
            if r.get("type") != "RelativeAngleAbsoluteDOF":
                raise self.err(f"{f}.type", f"unsupported type {r.get('type')!r}; supported: RelativeAngleAbsoluteDOF")
            pts = r.get("points")
            if not isinstance(pts, list) or len(pts) != 2:
                raise self.err(f"{f}.points", f"expected [a, b], got {pts!r}")
            a, b = (self.point_index(v, f"{f}.points", points) for v in pts)
            out.append(RelativeCoordinate(str(r.get("name", f"a{k}")), a, b))
        return out

    def sliders(self, points: list[Point]) -> list[Slider]:
        out = []
        for k, s in enumerate(self.seq("sliders")):
            f = f"sliders[{k}]"
            s = self.entry(s, f)
            p = self.point_index(s.get("point"), f"{f}.point", points)
            if points[p].fixed:
                raise self.err(f"{f}.point", f"point {p} is fixed; a slider moves")
            if "through" in s:
                thr = s["through"]
                if not isinstance(thr, list) or len(thr) != 2:
                    raise self.err(f"{f}.through", f"expected [a, b] fixed point indices, got {thr!r}")
                a, b = (self.point_index(v, f"{f}.through", points) for v in thr)
                if not (points[a].fixed and points[b].fixed):
                    raise self.err(f"{f}.through", "both points of the line must be fixed")
                pa, pb = points[a], points[b]
                origin, direction = (pa.x, pa.y), (pb.x - pa.x, pb.y - pa.y)
            elif "origin" in s and "angle_deg" in s:
                o = s["origin"]
                if not isinstance(o, list) or len(o) != 2:
                    raise self.err(f"{f}.origin", f"expected [x, y], got {o!r}")
                origin = (self.num(o[0], f"{f}.origin[0]"), self.num(o[1], f"{f}.origin[1]"))
                ang = math.radians(self.num(s["angle_deg"], f"{f}.angle_deg"))
                direction = (math.cos(ang), math.sin(ang))
            else:
                raise self.err(f, "give either 'through: [a, b]' or 'origin: [x, y]' with 'angle_deg'")
            if math.hypot(*direction) == 0:
                raise self.err(f, "the line's two points coincide")
            out.append(Slider(p, origin, direction))
        return out

    def body_ref(self, value: object, field: str, bodies: list[Body]) -> int:
        if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < len(bodies):
            return value
        for i, b in enumerate(bodies):
            if b.name == value:
                return i
        raise self.err(field, f"unknown body {value!r}; bodies are {[b.name for b in bodies]} (or indices)")

    def dampers(self, bodies: list[Body]) -> list[Damper]:
        out = []
        for k, d in enumerate(self.seq("dampers")):
            f = f"dampers[{k}]"
            d = self.entry(d, f)
            pair = d.get("bodies")
            if not isinstance(pair, list) or len(pair) != 2:
                raise self.err(f"{f}.bodies", f"expected [body, body or 'ground'], got {pair!r}")
            a = self.body_ref(pair[0], f"{f}.bodies[0]", bodies)
            b = None if pair[1] == "ground" else self.body_ref(pair[1], f"{f}.bodies[1]", bodies)
            if "c" not in d:
                raise self.err(f, "missing 'c' (N·m·s/rad)")
            c = self.num(d["c"], f"{f}.c")
            if c < 0:
                raise self.err(f"{f}.c", f"must be >= 0, got {c}")
            out.append(Damper(a, b, c))
        return out

    def named_points(self, points: list[Point], bodies: list[Body]) -> list[NamedPoint]:
        raw = self.doc.get("named_points") or {}
        if not isinstance(raw, dict):
            raise self.err("named_points", "expected a mapping name -> {point: i} or {body: b, at: [x, y]}")
        out = []
        for name, spec in raw.items():
            f = f"named_points.{name}"
            spec = self.entry(spec, f)
            if "point" in spec:
                p = self.point_index(spec["point"], f"{f}.point", points)
                owner = next((i for i, b in enumerate(bodies) if p in b.points), None)
                if owner is None:
                    raise self.err(f"{f}.point", f"point {p} belongs to no body")
                body = bodies[owner]
                p0, p1, pp = points[body.points[0]], points[body.points[1]], points[p]
                ux, uy = p1.x - p0.x, p1.y - p0.y
                L = math.hypot(ux, uy)
                ux, uy = ux / L, uy / L
                dx, dy = pp.x - p0.x, pp.y - p0.y
                out.append(NamedPoint(str(name), owner, (dx * ux + dy * uy, -dx * uy + dy * ux)))
            elif "body" in spec and "at" in spec:
                owner = self.body_ref(spec["body"], f"{f}.body", bodies)
                at = spec["at"]
                if not isinstance(at, list) or len(at) != 2:
                    raise self.err(f"{f}.at", f"expected [x, y] in the body frame, got {at!r}")
                out.append(NamedPoint(str(name), owner, (self.num(at[0], f"{f}.at[0]"), self.num(at[1], f"{f}.at[1]"))))
            else:
                raise self.err(f, "give 'point: i' or 'body: b' with 'at: [x, y]'")
        return out

    def dofs(self, points: list[Point], rel: list[RelativeCoordinate]) -> list[Dof]:
        names = [n for i, p in enumerate(points) if not p.fixed for n in (f"x{i}", f"y{i}")]
        names += [r.name for r in rel]
        out = []
        for k, d in enumerate(self.seq("dofs")):
            f = f"dofs[{k}]"
            d = self.entry(d, f)
            coord = d.get("coordinate")
            if isinstance(coord, int) and not isinstance(coord, bool) and 0 <= coord < len(names):
                idx = coord
            elif coord in names:
                idx = names.index(coord)
            else:
                raise self.err(f"{f}.coordinate", f"unknown coordinate {coord!r}; coordinates are {names}")
            out.append(Dof(str(d.get("name", names[idx])), idx))
        return out

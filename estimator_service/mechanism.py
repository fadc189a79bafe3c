"""Mechanism description: the data read from a mechanism YAML file (mbse format + extensions).

Pure data; ``load_mechanism`` parses a file into it.  Lengths in m, masses in kg, inertias in
kg·m², angles in rad, damping in N·m·s/rad.  Frames: see docs/architecture.md.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Hashable
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from estimator_service.errors import ConfigError
from estimator_service.expr import RESERVED, ExprError, evaluate


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


    def coordinate_names(self) -> list[str]:
        """Names of the entries of q in mbse order: ``x<i>``, ``y<i>`` of each non-fixed point, then
        the relative coordinates' names."""
        names = [n for i, p in enumerate(self.points) if not p.fixed for n in (f"x{i}", f"y{i}")]
        return names + [r.name for r in self.relative_coordinates]

    def body_index(self, ref: int | str) -> int:
        """Index of a body given by its 0-based index or its name; ``ValueError`` if there is none."""
        if isinstance(ref, int) and not isinstance(ref, bool) and 0 <= ref < len(self.bodies):
            return ref
        for i, b in enumerate(self.bodies):
            if b.name == ref:
                return i
        names = [b.name for b in self.bodies]
        raise ValueError(f"unknown body {ref!r}; bodies are {names} (or indices 0..{len(names) - 1})")


# ---------------------------------------------------------------------------------------- loading
#: top-level keys of the mbse format
MBSE_KEYS = ("parameters", "points", "planar_bodies", "relative_coordinates")
#: top-level keys added by rigstate (docs/mechanism-format.md); ``name``/``description`` are free text
EXTENSION_KEYS = ("name", "description", "gravity", "sliders", "dampers", "named_points", "dofs")
#: keys of the entries of the mbse sections; any other key is an error naming the entry.  These are
#: the keys mbse reads, plus ``visual`` of a body (mbse's drawing hints: accepted, ignored) and
#: rigstate's ``name`` of bodies and relative coordinates.
POINT_KEYS = ("x", "y", "fixed")
BODY_KEYS = ("points", "length", "mass", "I0", "cog", "visual", "name")
RELATIVE_COORDINATE_KEYS = ("type", "points", "name")


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, but a key repeated in one mapping is an error (PyYAML keeps the last)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: set = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)  # type: ignore[no-untyped-call]
            if not isinstance(key, Hashable):
                continue  # PyYAML's own construct_mapping reports it
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def load_mechanism(path: str | Path) -> Mechanism:
    """Read a mechanism YAML file (mbse format + extensions, see docs/mechanism-format.md).

    Raises ``ConfigError(file, entry, problem)`` for an unreadable or malformed file.
    """
    path = Path(path)
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(str(path), "", f"cannot read: {getattr(exc, 'strerror', None) or exc}") from None
    return parse_mechanism(text, str(path))


def parse_mechanism(text: str, source: str) -> Mechanism:
    """Parse the text of a mechanism file; ``source`` names it in error messages."""
    try:
        doc = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        raise ConfigError(source, "", f"YAML syntax error: {where}{getattr(exc, 'problem', None) or exc}") from None
    except RecursionError:
        raise ConfigError(source, "", "YAML nested too deeply") from None
    if not isinstance(doc, dict):
        raise ConfigError(source, "", f"expected a mapping with 'points' and 'planar_bodies', got {type(doc).__name__}")
    try:
        return _Loader(source, doc).mechanism()
    except RecursionError:  # e.g. quoting a value nested thousands deep in an error message
        raise ConfigError(source, "", "a value is nested too deeply") from None


def _distance(p: Point, q: Point) -> float:
    return math.hypot(q.x - p.x, q.y - p.y)


class _Loader:
    """Builds a :class:`Mechanism` from a parsed YAML document, section by section, in file order
    of dependence (parameters, points, bodies, relative coordinates, then the extensions)."""

    def __init__(self, source: str, doc: dict) -> None:
        self.source, self.doc = source, doc
        #: names visible to expressions: parameters, then x<i>, y<i> of the points
        self.env: dict[str, float] = {}

    def err(self, field: str, problem: str) -> ConfigError:
        return ConfigError(self.source, field, problem)

    def num(self, value: object, field: str, env: dict[str, float] | None = None) -> float:
        """Value of a number or expression entry."""
        try:
            return evaluate(value, self.env if env is None else env)  # type: ignore[arg-type]
        except ExprError as exc:
            raise self.err(field, str(exc)) from None

    def pair(self, value: object, field: str, what: str) -> list:
        if not isinstance(value, list) or len(value) != 2:
            raise self.err(field, f"expected {what}, got {value!r}")
        return value

    def xy(self, value: object, field: str, env: dict[str, float] | None = None) -> tuple[float, float]:
        """An ``[x, y]`` entry of two numbers or expressions."""
        v = self.pair(value, field, "[x, y]")
        return self.num(v[0], f"{field}[0]", env), self.num(v[1], f"{field}[1]", env)

    def seq(self, key: str) -> list:
        value = self.doc.get(key)
        if value is None:
            return []
        if not isinstance(value, list):
            raise self.err(key, f"expected a list, got {type(value).__name__}")
        return value

    def entry(self, value: object, field: str, allowed: tuple[str, ...]) -> dict:
        """A mapping entry whose keys are all in ``allowed`` (else an error naming the entry and key)."""
        if not isinstance(value, dict):
            raise self.err(field, f"expected a mapping, got {value!r}")
        for key in value:
            if key not in allowed:
                close = difflib.get_close_matches(str(key), allowed, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise self.err(f"{field}.{key}", f"unknown key; known: {', '.join(allowed)}{hint}")
        return value

    def name(self, value: object, field: str, taken: list[str]) -> str:
        if not isinstance(value, str) or not value:
            raise self.err(field, f"expected a non-empty name, got {value!r}")
        if value in taken:
            raise self.err(field, f"duplicate name {value!r}")
        return value

    def point_index(self, value: object, field: str, points: list[Point]) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < len(points):
            raise self.err(field, f"unknown point index {value!r} (points are 0..{len(points) - 1})")
        return value

    def mechanism(self) -> Mechanism:
        for key in self.doc:
            if key not in MBSE_KEYS + EXTENSION_KEYS:
                raise self.err(str(key), f"unknown top-level key; known: {', '.join(MBSE_KEYS + EXTENSION_KEYS)}")
        parameters = self.parameters()
        points = self.points()
        mech = Mechanism(source=self.source, points=points, bodies=self.bodies(points), parameters=parameters)
        mech.relative_coordinates = self.relative_coordinates(mech)
        if "gravity" in self.doc:
            mech.gravity = self.xy(self.doc["gravity"], "gravity")
        mech.sliders = self.sliders(points)
        mech.dampers = self.dampers(mech)
        mech.named_points = self.named_points(mech)
        mech.dofs = self.dofs(mech)
        return mech

    def parameters(self) -> dict[str, float]:
        params = self.doc.get("parameters") or {}
        if not isinstance(params, dict):
            raise self.err("parameters", "expected a mapping name -> expression")
        for name, expr in params.items():
            f = f"parameters.{name}"
            if not isinstance(name, str) or not name.isidentifier():
                raise self.err(f, "a parameter name is a letter or '_' followed by letters, digits or '_'")
            if name in RESERVED:
                raise self.err(f, f"{name!r} is a built-in name ({', '.join(sorted(RESERVED))})")
            self.env[name] = self.num(expr, f)
        return dict(self.env)

    def points(self) -> list[Point]:
        raw = self.seq("points")
        if not raw:
            raise self.err("points", "a mechanism needs at least one point")
        out = []
        for i, p in enumerate(raw):
            f = f"points[{i}]"
            p = self.entry(p, f, POINT_KEYS)
            for key in ("x", "y"):
                if key not in p:
                    raise self.err(f, f"missing '{key}'")
            x, y = self.num(p["x"], f"{f}.x"), self.num(p["y"], f"{f}.y")
            fixed = p.get("fixed", False)
            if not isinstance(fixed, bool):
                raise self.err(f"{f}.fixed", f"expected true or false, got {fixed!r}")
            self.env[f"x{i}"], self.env[f"y{i}"] = x, y
            out.append(Point(x, y, fixed))
        return out

    @staticmethod
    def constrained_pairs(idx: list[int]) -> list[tuple[int, int]]:
        """Distance-constrained point pairs of a body (as mbse): (p0,p1), then (p0,pj), (p1,pj), j >= 2."""
        pairs = [(idx[0], idx[1])]
        for j in idx[2:]:
            pairs += [(idx[0], j), (idx[1], j)]
        return pairs

    def bodies(self, points: list[Point]) -> list[Body]:
        raw = self.seq("planar_bodies")
        if not raw:
            raise self.err("planar_bodies", "a mechanism needs at least one body")
        out: list[Body] = []
        for k, b in enumerate(raw):
            f = f"planar_bodies[{k}]"
            b = self.entry(b, f, BODY_KEYS)
            idx = b.get("points")
            if not isinstance(idx, list) or len(idx) < 2:
                raise self.err(f"{f}.points", f"a body needs a list of 2 or more point indices, got {idx!r}")
            idx = [self.point_index(v, f"{f}.points", points) for v in idx]
            if len(set(idx)) != len(idx):
                raise self.err(f"{f}.points", f"repeated point in {idx}")
            lengths = {(a, c): _distance(points[a], points[c]) for a, c in self.constrained_pairs(idx)}
            for (a, c), d in lengths.items():
                if d == 0:
                    raise self.err(f"{f}.points", f"points {a} and {c} coincide in the initial coordinates")
            env = dict(self.env, index=float(k))
            for i, a in enumerate(idx):
                for j, c in enumerate(idx):
                    if i != j:
                        env[f"length{i + 1}{j + 1}"] = _distance(points[a], points[c])
            if len(idx) == 2:
                length = b.get("length", "auto")
                L = lengths[(idx[0], idx[1])] if length == "auto" else self.num(length, f"{f}.length", env)
                if L <= 0:
                    raise self.err(f"{f}.length", f"must be > 0 m, got {L:g}")
                lengths[(idx[0], idx[1])] = env["length"] = L
            for key in ("mass", "I0", "cog"):
                if key not in b:
                    raise self.err(f, f"missing '{key}'")
            mass = env["mass"] = self.num(b["mass"], f"{f}.mass", env)
            if mass < 0:
                raise self.err(f"{f}.mass", f"must be >= 0 kg, got {mass:g}")
            I0 = env["I0"] = self.num(b["I0"], f"{f}.I0", env)
            if I0 < 0:
                raise self.err(f"{f}.I0", f"must be >= 0 kg·m², got {I0:g}")
            cog = self.xy(b["cog"], f"{f}.cog", env)
            name = self.name(b.get("name", f"body{k}"), f"{f}.name", [o.name for o in out])
            out.append(Body(name, tuple(idx), mass, I0, cog, lengths))
        return out

    def relative_coordinates(self, mech: Mechanism) -> list[RelativeCoordinate]:
        out: list[RelativeCoordinate] = []
        taken = mech.coordinate_names()
        for k, r in enumerate(self.seq("relative_coordinates")):
            f = f"relative_coordinates[{k}]"
            r = self.entry(r, f, RELATIVE_COORDINATE_KEYS)
            if r.get("type") != "RelativeAngleAbsoluteDOF":
                raise self.err(f"{f}.type", f"unsupported type {r.get('type')!r}; supported: RelativeAngleAbsoluteDOF")
            pts = self.pair(r.get("points"), f"{f}.points", "[a, b] point indices")
            a, b = (self.point_index(v, f"{f}.points", mech.points) for v in pts)
            if _distance(mech.points[a], mech.points[b]) == 0:
                raise self.err(f"{f}.points", f"points {a} and {b} coincide in the initial coordinates: no angle")
            name = self.name(r.get("name", f"a{k}"), f"{f}.name", taken)
            taken.append(name)
            out.append(RelativeCoordinate(name, a, b))
        return out

    def sliders(self, points: list[Point]) -> list[Slider]:
        out = []
        for k, s in enumerate(self.seq("sliders")):
            f = f"sliders[{k}]"
            s = self.entry(s, f, ("point", "through", "origin", "angle_deg"))
            p = self.point_index(s.get("point"), f"{f}.point", points)
            if points[p].fixed:
                raise self.err(f"{f}.point", f"point {p} is fixed; a slider moves")
            if "through" in s and not {"origin", "angle_deg"} & set(s):
                a, b = (self.point_index(v, f"{f}.through", points)
                        for v in self.pair(s["through"], f"{f}.through", "[a, b] fixed point indices"))
                if not (points[a].fixed and points[b].fixed):
                    raise self.err(f"{f}.through", f"both points of the line must be fixed ({a}, {b})")
                if _distance(points[a], points[b]) == 0:
                    raise self.err(f"{f}.through", f"points {a} and {b} coincide: no line")
                origin = (points[a].x, points[a].y)
                direction = (points[b].x - points[a].x, points[b].y - points[a].y)
            elif {"origin", "angle_deg"} <= set(s) and "through" not in s:
                origin = self.xy(s["origin"], f"{f}.origin")
                angle = math.radians(self.num(s["angle_deg"], f"{f}.angle_deg"))
                direction = (math.cos(angle), math.sin(angle))
            else:
                raise self.err(f, "give either 'through: [a, b]' or 'origin: [x, y]' with 'angle_deg'")
            out.append(Slider(p, origin, direction))
        return out

    def body_ref(self, mech: Mechanism, value: object, field: str) -> int:
        try:
            return mech.body_index(value)  # type: ignore[arg-type]
        except ValueError as exc:
            raise self.err(field, str(exc)) from None

    def dampers(self, mech: Mechanism) -> list[Damper]:
        out = []
        for k, d in enumerate(self.seq("dampers")):
            f = f"dampers[{k}]"
            d = self.entry(d, f, ("bodies", "c"))
            pair = self.pair(d.get("bodies"), f"{f}.bodies", "[body, body or 'ground']")
            a = self.body_ref(mech, pair[0], f"{f}.bodies[0]")
            b = None if pair[1] == "ground" else self.body_ref(mech, pair[1], f"{f}.bodies[1]")
            if a == b:
                raise self.err(f"{f}.bodies", f"a damper joins two different bodies, got {pair!r}")
            if "c" not in d:
                raise self.err(f, "missing 'c' (N·m·s/rad)")
            c = self.num(d["c"], f"{f}.c")
            if c < 0:
                raise self.err(f"{f}.c", f"must be >= 0 N·m·s/rad, got {c:g}")
            out.append(Damper(a, b, c))
        return out

    def named_points(self, mech: Mechanism) -> list[NamedPoint]:
        raw = self.doc.get("named_points") or {}
        if not isinstance(raw, dict):
            raise self.err("named_points", "expected a mapping name -> {point: i} or {body: b, at: [x, y]}")
        out = []
        for name, spec in raw.items():
            f = f"named_points.{name}"
            spec = self.entry(spec, f, ("point", "body", "at"))
            if set(spec) == {"point"}:
                p = self.point_index(spec["point"], f"{f}.point", mech.points)
                owner = next((i for i, b in enumerate(mech.bodies) if p in b.points), None)
                if owner is None:
                    raise self.err(f"{f}.point", f"point {p} belongs to no body")
                p0, p1 = (mech.points[i] for i in mech.bodies[owner].points[:2])
                L = _distance(p0, p1)
                ux, uy = (p1.x - p0.x) / L, (p1.y - p0.y) / L
                dx, dy = mech.points[p].x - p0.x, mech.points[p].y - p0.y
                local = (dx * ux + dy * uy, -dx * uy + dy * ux)
            elif set(spec) == {"body", "at"}:
                owner = self.body_ref(mech, spec["body"], f"{f}.body")
                local = self.xy(spec["at"], f"{f}.at")
            else:
                raise self.err(f, "give either 'point: i' or 'body: b' with 'at: [x, y]'")
            out.append(NamedPoint(self.name(name, f, []), owner, local))
        return out

    def dofs(self, mech: Mechanism) -> list[Dof]:
        names = mech.coordinate_names()
        out: list[Dof] = []
        for k, d in enumerate(self.seq("dofs")):
            f = f"dofs[{k}]"
            d = self.entry(d, f, ("name", "coordinate"))
            coord = d.get("coordinate")
            if isinstance(coord, int) and not isinstance(coord, bool) and 0 <= coord < len(names):
                idx = coord
            elif isinstance(coord, str) and coord in names:
                idx = names.index(coord)
            else:
                raise self.err(f"{f}.coordinate",
                               f"unknown coordinate {coord!r}; coordinates are {names} (or indices 0..{len(names) - 1})")
            if any(o.coordinate == idx for o in out):
                raise self.err(f"{f}.coordinate", f"coordinate {names[idx]!r} is already a DOF")
            out.append(Dof(self.name(d.get("name", names[idx]), f"{f}.name", [o.name for o in out]), idx))
        return out

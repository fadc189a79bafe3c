"""Foreign tables in: one table of several sensors (a DAQ export) mapped to rigstate's sensor messages.

A *table* is named columns of equal length, one row per sample: a CSV file (first row: the column
names), a Parquet file (needs pyarrow), a MATLAB ``.mat`` file (every numeric vector variable of the
most common length is a column; needs scipy, a dependency) or a pandas DataFrame (the Python API).
A *map* (TOML; the reference is docs/data-tools.md) says which columns make which topic and in which
units::

    [time]
    column = "all_time"     # required
    unit = "s"              # s | ms
    origin = "first"        # first: t relative to the first row; recorded: as in the table
    repeats = "drop"        # drop | refuse: rows whose time does not increase

    [imu.shaft]             # topic imu/shaft: gyr and acc, three columns each (sensor x, y, z)
    gyr = ["gx", "gy", "gz"]
    gyr_unit = "deg/s"      # deg/s | rad/s
    acc = ["ax", "ay", "az"]
    acc_unit = "g"          # g | m/s^2
    g = 9.81                # m/s² per g (default 9.80665)
    gyr_scale = [1, 1, -1]  # optional factor per axis (or one number): signs, gains

    [enc.shaft]             # topic enc/shaft: count and cpr
    angle = "encoder_deg"
    unit = "deg"            # deg | rad | counts
    resolution = 0.01       # in ``unit`` per count; or cpr = 36000 (counts per revolution)
    scale = 1               # optional factor (e.g. -1: the other sense of rotation)

Every sensor table may name a ``seq`` column; without one, ``seq`` counts the imported rows from 0.
Units convert to the schema's (s, rad/s, m/s², counts); an encoder angle becomes
``count = round(angle · scale · cpr / revolution)``; times are differenced in decimal (:func:`_seconds`).  Rows whose time stamp repeats or goes back
(compared with the last row kept) are counted and dropped, or refused with their row; nothing is
dropped silently (:class:`Imported` reports it).  Every problem is a :class:`UserError` naming the
file, the key or column and the choices.
"""

from __future__ import annotations

import csv
import json
import math
import tomllib
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path

import numpy as np

from estimator_service import schema
from estimator_service.logfile import Record
from estimator_service.rig import Rig
from estimator_service.errors import ConfigError, UserError

TIME_UNITS = {"s": Decimal(1), "ms": Decimal("0.001")}  #: seconds per unit
GYR_UNITS = {"rad/s": 1.0, "deg/s": math.pi / 180.0}  #: rad/s per unit
ACC_UNITS = ("m/s^2", "g")  #: g converts by the map's ``g`` (m/s² per g)
ANGLE_UNITS = {"rad": 2.0 * math.pi, "deg": 360.0, "counts": None}  #: one revolution in the unit
STANDARD_GRAVITY = 9.80665  #: m/s² per g unless the map says ``g``
ORIGINS = ("first", "recorded")
REPEATS = ("drop", "refuse")

_TIME_KEYS = {"column", "unit", "origin", "repeats"}
_IMU_KEYS = {"gyr", "gyr_unit", "gyr_scale", "acc", "acc_unit", "acc_scale", "g", "seq"}
_ENC_KEYS = {"angle", "unit", "cpr", "resolution", "scale", "seq"}


@dataclass(frozen=True)
class Channel:
    """Columns of one message field and how they convert: SI value = cell · ``factor`` · ``scale``."""

    columns: tuple[str, ...]
    factor: float
    scale: tuple[float, ...]


@dataclass(frozen=True)
class SensorMap:
    """How one topic is made from the table: ``imu/<name>`` (gyr, acc) or ``enc/<name>`` (angle)."""

    topic: str
    channels: dict[str, Channel]  #: imu: "gyr", "acc"; enc: "angle" (factor: counts per unit)
    seq: str | None = None  #: column of the sequence number, or None: counted from 0
    cpr: int | None = None  #: enc: counts per revolution


@dataclass(frozen=True)
class TableMap:
    """A parsed map: the time column and the sensors, in the map's order."""

    source: str
    time: str
    time_unit_s: Decimal  #: seconds per time unit
    origin: str
    repeats: str
    sensors: list[SensorMap]  #: in the map's order (the sensors of one family together): each row's messages

    def columns(self) -> list[tuple[str, str]]:
        """(map key, column) of every column the map reads."""
        out = [("time.column", self.time)]
        for s in self.sensors:
            key = s.topic.replace("/", ".")
            out += [(f"{key}.{f}", c) for f, ch in s.channels.items() for c in ch.columns]
            if s.seq is not None:
                out.append((f"{key}.seq", s.seq))
        return out


def load_map(path: str | Path | None = None, settings: list[str] | None = None,
             repeats: str | None = None) -> TableMap:
    """A map from a TOML file and/or ``KEY=VALUE`` settings (TOML values, bare words as strings, e.g.
    ``time.column=all_time``, ``imu.shaft.gyr_unit=deg/s``); settings override the file; ``repeats``
    (``drop`` | ``refuse``) overrides ``time.repeats``.  ConfigError on any unknown key or bad value."""
    doc: dict = {}
    source = str(path) if path is not None else "--set"
    if path is not None:
        try:
            doc = tomllib.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError) as exc:
            raise UserError(f"{path}: cannot read the map: {exc}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(source, "", f"not valid TOML: {exc}") from None
    for item in settings or []:
        _merge(doc, _setting(item))
    if repeats is not None:
        _merge(doc, {"time": {"repeats": repeats}})
    return parse_map(doc, source)


def _setting(item: str) -> dict:
    key, eq, value = item.partition("=")
    if not eq or not key.strip():
        raise UserError(f"--set {item!r}: expected KEY=VALUE, e.g. time.column=all_time")
    for text in (value, json.dumps(value)):
        try:
            return tomllib.loads(f"{key.strip()} = {text}")
        except tomllib.TOMLDecodeError:
            continue
    raise UserError(f"--set {item!r}: {key.strip()!r} is not a TOML key (dotted names: imu.shaft.gyr_unit)")


def _merge(into: dict, new: dict) -> None:
    for k, v in new.items():
        if isinstance(v, dict) and isinstance(into.get(k), dict):
            _merge(into[k], v)
        else:
            into[k] = v


def parse_map(doc: Mapping, source: str = "<map>") -> TableMap:
    """A :class:`TableMap` from a map's TOML document (a dict); ConfigError naming the key and choices."""
    unknown = set(doc) - {"time", "imu", "enc"}
    if unknown:
        raise ConfigError(source, sorted(unknown)[0], "unknown section; sections are [time], [imu.<name>], [enc.<name>]")
    t = _table(doc, "time", source)
    _known(t, _TIME_KEYS, "time", source)
    if "column" not in t:
        raise ConfigError(source, "time.column", "required: the column of the time stamps")
    make = {"imu": _imu, "enc": _enc}
    sensors = [make[family](name, d, source) for family in doc if family in make  # in the map's order
               for name, d in _table(doc, family, source).items()]
    if not sensors:
        raise ConfigError(source, "", "maps no sensor: add an [imu.<name>] or [enc.<name>] table")
    for s in sensors:
        try:
            schema.schema_key(s.topic)
        except schema.SchemaError as exc:
            raise ConfigError(source, s.topic.replace("/", "."), str(exc)) from None
    return TableMap(source, _string(t, "column", "time", source), _choice(t, "unit", TIME_UNITS, "time", source, "s"),
                    _choice(t, "origin", ORIGINS, "time", source, "first"),
                    _choice(t, "repeats", REPEATS, "time", source, "drop"), sensors)


def _table(doc: Mapping, key: str, source: str) -> dict:
    v = doc.get(key, {})
    if not isinstance(v, dict):
        raise ConfigError(source, key, f"expected a table, got {v!r}")
    return v


def _known(d: Mapping, keys: set[str], where: str, source: str) -> None:
    for k in d:
        if k not in keys:
            raise ConfigError(source, f"{where}.{k}", f"unknown key; keys are {', '.join(sorted(keys))}")


def _string(d: Mapping, key: str, where: str, source: str) -> str:
    v = d[key]
    if not isinstance(v, str) or not v:
        raise ConfigError(source, f"{where}.{key}", f"expected a column name, got {v!r}")
    return v


def _choice(d: Mapping, key: str, choices: Mapping | tuple, where: str, source: str,
            default: str | None = None) -> object:
    """The value of a unit/choice key: the dict's value (a unit's factor) or the chosen string."""
    v = d.get(key, default)
    if v is None:
        raise ConfigError(source, f"{where}.{key}", f"required; one of {', '.join(choices)}")
    if not isinstance(v, str) or v not in choices:
        raise ConfigError(source, f"{where}.{key}", f"unknown {v!r}; one of {', '.join(choices)}")
    return choices[v] if isinstance(choices, Mapping) else v


def _number(d: Mapping, key: str, where: str, source: str, default: float) -> float:
    v = d.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v == 0:
        raise ConfigError(source, f"{where}.{key}", f"expected a finite non-zero number, got {v!r}")
    return float(v)


def _scale(d: Mapping, key: str, n: int, where: str, source: str) -> tuple[float, ...]:
    v = d.get(key, 1.0)
    values = v if isinstance(v, list) else [v] * n
    if len(values) != n:
        raise ConfigError(source, f"{where}.{key}", f"expected one number or {n}, got {v!r}")
    return tuple(_number({key: x}, key, where, source, 1.0) for x in values)


def _columns(d: Mapping, key: str, n: int, where: str, source: str) -> tuple[str, ...]:
    if key not in d:
        raise ConfigError(source, f"{where}.{key}", f"required: {n} column name(s)")
    v = d[key] if n > 1 else [d[key]]
    if not isinstance(v, list) or len(v) != n or not all(isinstance(c, str) and c for c in v):
        want = f"a list of {n} column names" if n > 1 else "a column name"
        raise ConfigError(source, f"{where}.{key}", f"expected {want}, got {d[key]!r}")
    return tuple(v)


def _seq(d: Mapping, where: str, source: str) -> str | None:
    return _string(d, "seq", where, source) if "seq" in d else None


def _imu(name: str, d: object, source: str) -> SensorMap:
    where = f"imu.{name}"
    if not isinstance(d, dict):
        raise ConfigError(source, where, f"expected a table, got {d!r}")
    _known(d, _IMU_KEYS, where, source)
    g = _number(d, "g", where, source, STANDARD_GRAVITY)
    acc_unit = _choice(d, "acc_unit", ACC_UNITS, where, source)
    channels = {
        "gyr": Channel(_columns(d, "gyr", 3, where, source), _choice(d, "gyr_unit", GYR_UNITS, where, source),
                       _scale(d, "gyr_scale", 3, where, source)),
        "acc": Channel(_columns(d, "acc", 3, where, source), g if acc_unit == "g" else 1.0,
                       _scale(d, "acc_scale", 3, where, source)),
    }
    return SensorMap(f"imu/{name}", channels, _seq(d, where, source))


def _enc(name: str, d: object, source: str) -> SensorMap:
    where = f"enc.{name}"
    if not isinstance(d, dict):
        raise ConfigError(source, where, f"expected a table, got {d!r}")
    _known(d, _ENC_KEYS, where, source)
    unit = _choice(d, "unit", tuple(ANGLE_UNITS), where, source)
    if ("cpr" in d) == ("resolution" in d):
        raise ConfigError(source, where, "give one of cpr (counts per revolution) or resolution (in its unit per count)")
    if "cpr" in d:
        cpr = d["cpr"]
        if isinstance(cpr, bool) or not isinstance(cpr, int) or cpr <= 0:
            raise ConfigError(source, f"{where}.cpr", f"expected an integer > 0, got {cpr!r}")
    else:
        if unit == "counts":
            raise ConfigError(source, f"{where}.resolution", "counts need cpr (counts per revolution)")
        res = _number(d, "resolution", where, source, 1.0)
        if res < 0:
            raise ConfigError(source, f"{where}.resolution", f"expected a number > 0, got {res!r} (a sign goes in scale)")
        cpr = round(ANGLE_UNITS[unit] / res)
        if abs(cpr * res - ANGLE_UNITS[unit]) > 1e-9 * ANGLE_UNITS[unit]:
            raise ConfigError(source, f"{where}.resolution",
                              f"{res!r} {unit} does not divide one revolution into a whole number of counts")
    turn = ANGLE_UNITS[unit]
    channel = Channel(_columns(d, "angle", 1, where, source), 1.0 if turn is None else cpr / turn,
                      _scale(d, "scale", 1, where, source))
    return SensorMap(f"enc/{name}", {"angle": channel}, _seq(d, where, source), cpr)


@dataclass(frozen=True)
class Table:
    """Named columns of equal length; ``first_row``: how the source numbers its first data row
    (a CSV file's line 2, after the names) so errors point at it."""

    source: str
    columns: dict[str, np.ndarray]
    first_row: int = 1

    def __len__(self) -> int:
        return len(next(iter(self.columns.values()))) if self.columns else 0


def read_table(path: str | Path) -> Table:
    """A table file by its suffix: ``.csv`` (exact decimal parsing: the CLI and the API read the same
    bits), ``.parquet`` (needs pyarrow), ``.mat`` (MATLAB v5–v7.2, scipy)."""
    p = Path(path)
    suffix = p.suffix.lower()
    try:
        if suffix == ".csv":
            return _read_csv(p)
        if suffix in (".parquet", ".pq"):
            return _read_parquet(p)
        if suffix == ".mat":
            return _read_mat(p)
    except OSError as exc:
        raise UserError(f"{p}: cannot read: {exc.strerror or exc}") from None
    raise UserError(f"{p}: unknown table format {suffix!r}; formats: .csv, .parquet (pyarrow), .mat")


def _read_csv(p: Path) -> Table:
    try:
        with open(p, newline="", encoding="utf-8-sig") as f:
            rows = list(csv.reader(f))
    except (UnicodeDecodeError, csv.Error) as exc:
        raise UserError(f"{p}: cannot read as CSV: {exc}") from None
    if not rows or not rows[0]:
        raise UserError(f"{p}: empty; the first row must name the columns")
    names = [n.strip() for n in rows[0]]
    body = [r for r in rows[1:] if r]
    for n, r in enumerate(body, start=2):
        if len(r) != len(names):
            raise UserError(f"{p}, row {n}: {len(r)} cells, the first row names {len(names)} columns")
    # cells stay text until a map asks for a column (other columns may hold anything)
    return Table(str(p), {name: np.array([r[i] for r in body], dtype=object) for i, name in enumerate(names)}, 2)


def _read_parquet(p: Path) -> Table:
    try:
        import pandas as pd
        frame = pd.read_parquet(p)
    except ImportError:
        raise UserError(f"{p}: reading Parquet needs pandas and pyarrow: pip install pandas pyarrow") from None
    except ValueError as exc:
        raise UserError(f"{p}: cannot read as Parquet: {exc}") from None
    return table_of_frame(frame, str(p))


def _read_mat(p: Path) -> Table:
    from scipy.io import loadmat
    from scipy.io.matlab import MatReadError

    try:
        mat = loadmat(p, squeeze_me=True)
    except (MatReadError, ValueError, NotImplementedError, TypeError) as exc:
        raise UserError(f"{p}: cannot read as a MATLAB file (v5–v7.2; save with -v7): {exc}") from None
    vectors = {k: v for k, v in mat.items() if not k.startswith("__") and isinstance(v, np.ndarray)
               and v.ndim == 1 and v.dtype.kind in "fiub"}
    if not vectors:
        raise UserError(f"{p}: no numeric vector variables (columns)")
    length = Counter(len(v) for v in vectors.values()).most_common(1)[0][0]
    return Table(str(p), {k: v for k, v in vectors.items() if len(v) == length})


def table_of_frame(frame: object, source: str = "<DataFrame>") -> Table:
    """A table of a pandas DataFrame's columns (its index is not a column: ``reset_index()`` first)."""
    return Table(source, {str(c): frame[c].to_numpy() for c in frame.columns})  # type: ignore[attr-defined]


@dataclass
class Imported:
    """Messages made from a table, and what was left out."""

    source: str
    messages: dict[str, list[dict]]  #: per topic, in the map's order: validated messages in time order
    rows: int  #: data rows of the table
    repeated: int = 0  #: rows dropped: time stamp equal to the last kept row's
    backwards: int = 0  #: rows dropped: time stamp before the last kept row's
    first_dropped: tuple[int, float] | None = None  #: (row, time in the table's unit) of the first dropped row
    counts: dict[str, int] = field(default_factory=dict)  #: messages per topic

    def describe(self) -> str:
        """One line for people: messages per topic and the rows dropped."""
        text = f"{sum(self.counts.values())} messages (" + ", ".join(f"{t} {n}" for t, n in self.counts.items()) + ")"
        text += f" from {self.rows} rows of {self.source}"
        if self.first_dropped is not None:
            row, t = self.first_dropped
            text += (f"; dropped {self.repeated + self.backwards} rows whose time stamp does not increase "
                     f"({self.repeated} repeated, {self.backwards} going back; first: row {row}, t = {t!r})")
        return text


def import_table(table: Table, tmap: TableMap) -> Imported:
    """Convert a table through a map (module docstring).  UserError naming the file, the map key and
    the column (missing, with the table's columns listed; a cell that is not a finite number, with its row)."""
    if not len(table):
        raise UserError(f"{table.source}: no rows")
    cols = {}
    for key, col in tmap.columns():
        if col not in table.columns:
            raise UserError(f"{table.source}: no column {col!r} (map {tmap.source}: {key}); "
                            f"the table's columns: {', '.join(table.columns)}")
        cols[col] = _numbers(table, col)
    t_raw = cols[tmap.time]
    keep, repeated, backwards, first = _increasing(table, tmap, t_raw)
    t = _seconds(t_raw[keep], tmap)
    out = Imported(table.source, {}, len(table), repeated, backwards, first)
    for s in tmap.sensors:
        seq = _integers(table, s.seq, cols[s.seq], keep) if s.seq is not None else list(range(t.size))
        fields = {name: np.column_stack([cols[c][keep] for c in ch.columns]) * ch.factor * np.array(ch.scale)
                  for name, ch in s.channels.items()}
        if s.topic.startswith("enc/"):
            count = np.round(fields.pop("angle")[:, 0])
            msgs = [{"t": float(ti), "seq": q, "count": int(c), "cpr": s.cpr} for ti, q, c in zip(t, seq, count, strict=True)]
        else:
            msgs = [{"t": float(ti), "seq": q, "gyr": g.tolist(), "acc": a.tolist()}
                    for ti, q, g, a in zip(t, seq, fields["gyr"], fields["acc"], strict=True)]
        out.messages[s.topic] = [_valid(table, s.topic, m) for m in msgs]
        out.counts[s.topic] = len(msgs)
    return out


def _seconds(stamps: np.ndarray, tmap: TableMap) -> np.ndarray:
    """Time stamps in s, from the first one with ``origin = "first"``.  The difference and the unit
    change are exact decimal arithmetic on each stamp's shortest round-trip form, then rounded once:
    stamps on a decimal grid stay on it (70.042 − 70.012 s is 0.03 s, not 0.030000000000001137), so a
    sample on the estimator's 1 ms grid falls in the step it names."""
    exact = [Decimal(repr(float(x))) for x in stamps]
    origin = exact[0] if tmap.origin == "first" and exact else Decimal(0)
    return np.array([float((x - origin) * tmap.time_unit_s) for x in exact], dtype=float)


def _valid(table: Table, topic: str, msg: dict) -> dict:
    try:
        return schema.validate(topic, msg)
    except schema.SchemaError as exc:
        raise UserError(f"{table.source}: at t = {msg['t']!r}: {exc}") from None


def _numbers(table: Table, col: str) -> np.ndarray:
    """A column as float64; UserError naming the row of the first cell that is not a finite number."""
    raw = table.columns[col]
    try:
        values = np.array([float(x) for x in raw], dtype=float) if raw.dtype == object else raw.astype(float)
    except (TypeError, ValueError):
        values = None
    bad = [i for i, x in enumerate(raw) if not _finite(x)] if values is None else np.flatnonzero(~np.isfinite(values))
    if len(bad):
        i = int(bad[0])
        raise UserError(f"{table.source}, row {i + table.first_row}, column {col!r}: "
                        f"expected a finite number, got {raw[i]!r}")
    return values


def _finite(x: object) -> bool:
    try:
        return math.isfinite(float(x))  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return False


def _integers(table: Table, col: str, values: np.ndarray, keep: np.ndarray) -> list[int]:
    bad = np.flatnonzero((values != np.round(values)) | (values < 0))
    if bad.size:
        i = int(bad[0])
        raise UserError(f"{table.source}, row {i + table.first_row}, column {col!r}: "
                        f"seq must be an integer >= 0, got {values[i]!r}")
    return [int(v) for v in values[keep]]


def _increasing(table: Table, tmap: TableMap, t: np.ndarray) -> tuple[np.ndarray, int, int, tuple[int, float] | None]:
    """Rows to keep (each later than the last kept one), the counts of repeated and backward stamps,
    and the first dropped (row, time); with ``repeats = "refuse"`` the first such row is an error."""
    keep = np.ones(t.size, dtype=bool)
    repeated = backwards = 0
    first = None
    last = -math.inf
    for i, ti in enumerate(t):
        if ti > last:
            last = ti
            continue
        row = i + table.first_row
        if tmap.repeats == "refuse":
            raise UserError(f"{table.source}, row {row}, column {tmap.time!r}: time {ti!r} does not increase "
                            f"(the last row kept reads {last!r}); drop such rows with repeats = \"drop\" (--repeats drop)")
        keep[i] = False
        repeated += int(ti == last)
        backwards += int(ti < last)
        first = first or (row, float(ti))
    return keep, repeated, backwards, first


def check_sensors(imported: Imported, tmap: TableMap, rig: Rig) -> None:
    """UserError unless every imported topic is a sensor of ``rig`` and every encoder's cpr is the rig's."""
    topics = rig.all_sensor_topics()
    cprs = {f"enc/{e.name}": e.cpr for e in rig.encoders}
    for topic, msgs in imported.messages.items():
        key = f"{tmap.source}: {topic.replace('/', '.')}"
        if topic not in topics:
            raise UserError(f"{key}: the rig {rig.path} has no such sensor; its sensors: {', '.join(topics)}")
        if topic in cprs and msgs and msgs[0]["cpr"] != cprs[topic]:
            raise UserError(f"{key}: {msgs[0]['cpr']} counts per revolution, the rig's [[encoder]] "
                            f"{topic[4:]!r} has {cprs[topic]} (cpr = 4 * lines)")


def merged(streams: Mapping[str, Iterable[dict]]) -> list[tuple[str, dict]]:
    """(topic, message) of per-topic message lists, merged by ``t_recv`` (else ``t``); ties in dict order."""
    keyed = [((m.get("t_recv", m["t"]), k, i), topic, m)
             for k, (topic, msgs) in enumerate(streams.items()) for i, m in enumerate(msgs)]
    keyed.sort(key=lambda e: e[0])
    return [(topic, m) for _, topic, m in keyed]


def imported_records(imported: Imported) -> list[Record]:
    """The log records of an import (receive time = message time), in the order the Python API's ``estimate``
    feeds the same messages as DataFrames (:func:`merged`)."""
    return [Record(topic, m["t"], schema.pack(m)) for topic, m in merged(imported.messages)]

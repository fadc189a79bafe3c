"""The bus message schema: one place that defines, validates, encodes and decodes every payload.

Payloads are msgpack maps.  ``encode`` validates and packs canonically (keys in schema order,
floats as float64, ints as ints), so the same message always gives the same bytes.  ``decode``
unpacks with size limits and validates.  Errors are :class:`SchemaError` naming topic, field and
value.  Units: time s, angles rad, rates rad/s, accelerations m/s², torques N·m (N on a length DOF).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import msgpack
import numpy as np

from estimator_service import names

MAX_PAYLOAD = 64 * 1024  #: bytes; larger payloads are rejected before unpacking
MAX_ARRAY = 1024  #: longest list in a payload
MAX_CACHED_TOPICS = 1024  #: topics whose schema key is remembered (an attacker may send many distinct ones)
#: largest |value| an ``act`` message may state (N·m, rad/s, rad; N, m/s, m): no drive commands more, a larger
#: one is implausible
MAX_DRIVE_VALUE = 1e6


class SchemaError(ValueError):
    """A message does not match the schema of its topic."""


# Each check returns the normalised value or raises SchemaError.  Exact-type tests first accept the
# common case (what our own publishers send: plain finite floats, ints, lists of floats), returning
# what the general tests after them would.

def _num(topic: str, name: str, v: object) -> float:
    if type(v) is float and math.isfinite(v):
        return v
    if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
        raise SchemaError(f"{topic}: field {name!r}: expected a number, got {v!r}")
    f = float(v)
    if not math.isfinite(f):
        raise SchemaError(f"{topic}: field {name!r}: expected a finite number, got {f!r}")
    return f


def _int(topic: str, name: str, v: object) -> int:
    if type(v) is int:
        return v
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise SchemaError(f"{topic}: field {name!r}: expected an integer, got {v!r}")
    return int(v)


def _vec(n: int | None) -> Callable[[str, str, object], list[float]]:
    def check(topic: str, name: str, v: object) -> list[float]:
        if type(v) is list and (len(v) == n if n is not None else len(v) <= MAX_ARRAY):
            for x in v:
                if type(x) is not float or not math.isfinite(x):
                    break
            else:
                return v[:]
        if isinstance(v, np.ndarray):
            v = v.tolist()
        if not isinstance(v, (list, tuple)) or len(v) > MAX_ARRAY or (n is not None and len(v) != n):
            want = f"{n} numbers" if n is not None else "a list of numbers"
            raise SchemaError(f"{topic}: field {name!r}: expected {want}, got {v!r}"[:300])
        return [_num(topic, f"{name}[{i}]", x) for i, x in enumerate(v)]

    check.json_type = {"type": "array", "items": {"type": "number"}}  # type: ignore[attr-defined]
    return check


def _drive_value(topic: str, name: str, v: object) -> float:
    """A drive's torque, velocity or position: a number within ±``MAX_DRIVE_VALUE``."""
    f = _num(topic, name, v)
    if abs(f) > MAX_DRIVE_VALUE:
        raise SchemaError(f"{topic}: field {name!r}: {f!r} is implausible (|value| > {MAX_DRIVE_VALUE:g})")
    return f


def _str(topic: str, name: str, v: object) -> str:
    if not isinstance(v, str) or len(v) > 256:
        raise SchemaError(f"{topic}: field {name!r}: expected a short string, got {v!r}"[:300])
    return v


def _seq(topic: str, name: str, v: object) -> int:
    s = v if type(v) is int else _int(topic, name, v)
    if s < 0:
        raise SchemaError(f"{topic}: field {name!r}: expected an integer >= 0, got {s}")
    return s


def _pos_int(topic: str, name: str, v: object) -> int:
    s = v if type(v) is int else _int(topic, name, v)
    if s <= 0:
        raise SchemaError(f"{topic}: field {name!r}: expected an integer > 0, got {s}")
    return s


def _status_str(topic: str, name: str, v: object) -> str:
    s = _str(topic, name, v)
    if s not in ESTIMATE_STATUS:
        raise SchemaError(f"{topic}: field {name!r}: expected one of {sorted(ESTIMATE_STATUS)}, got {s!r}")
    return s


def _map(topic: str, name: str, v: object) -> dict:
    """A free-form map (est/diag ``inputs``, ``step_us``, ``info``): string keys, plain values."""
    if not isinstance(v, dict) or len(v) > MAX_ARRAY:
        raise SchemaError(f"{topic}: field {name!r}: expected a map, got {v!r}"[:300])
    for k, x in v.items():
        if not isinstance(k, str):
            raise SchemaError(f"{topic}: field {name!r}: keys must be strings, got {k!r}")
        if isinstance(x, dict):
            _map(topic, f"{name}.{k}", x)
        elif isinstance(x, float) and not math.isfinite(x):
            raise SchemaError(f"{topic}: field {name}.{k}: expected a finite number, got {x!r}")
    return v


ESTIMATE_STATUS = {"init", "ok", "degraded", "reinit"}
ESTIMATE_QUALITY = {"ok", "inconsistent"}


def _quality_str(topic: str, name: str, v: object) -> str:
    s = _str(topic, name, v)
    if s not in ESTIMATE_QUALITY:
        raise SchemaError(f"{topic}: field {name!r}: expected one of {sorted(ESTIMATE_QUALITY)}, got {s!r}")
    return s


@dataclass(frozen=True)
class Field:
    name: str
    check: Callable[[str, str, object], object]
    required: bool = True


_STATE_VECTORS = [Field("q", _vec(None)), Field("qd", _vec(None)), Field("z", _vec(None)), Field("zd", _vec(None))]

SCHEMAS: dict[str, list[Field]] = {
    "imu": [
        Field("t", _num), Field("seq", _seq), Field("gyr", _vec(3)), Field("acc", _vec(3)),
        Field("quat", _vec(4), False), Field("dev_t", _num, False), Field("status", _int, False),
    ],
    "enc": [
        Field("t", _num), Field("seq", _seq), Field("count", _int), Field("cpr", _pos_int),
        Field("angle", _num, False),
    ],
    # a motor controller: what it applies (torque) or commands (velocity, position) of the DOF it drives
    "act": [
        Field("t", _num), Field("seq", _seq), Field("torque", _drive_value, False),
        Field("velocity", _drive_value, False), Field("position", _drive_value, False),
    ],
    "est/state": [
        Field("t", _num), Field("seq", _seq), *_STATE_VECTORS,
        Field("crank", _num, False), Field("crank_rate", _num, False),
        Field("backend", _str), Field("status", _status_str),
        Field("P_z", _vec(None), False), Field("latency_s", _num, False),
        Field("quality", _quality_str, False), Field("bias", _map, False), Field("time_offset_s", _map, False),
        Field("mount_deg", _map, False), Field("model", _map, False),
    ],
    "est/diag": [
        Field("t", _num), Field("seq", _seq), Field("status", _str), Field("inputs", _map),
        Field("step_us", _map), Field("info", _map, False),
    ],
    "truth/state": [
        Field("t", _num), *_STATE_VECTORS, Field("crank", _num, False), Field("crank_rate", _num, False),
    ],
}


_JSON_TYPES: dict[Callable, dict] = {
    _num: {"type": "number"}, _int: {"type": "integer"}, _seq: {"type": "integer", "minimum": 0},
    _pos_int: {"type": "integer", "exclusiveMinimum": 0}, _str: {"type": "string"},
    _status_str: {"type": "string", "enum": sorted(ESTIMATE_STATUS)}, _map: {"type": "object"},
    _quality_str: {"type": "string", "enum": sorted(ESTIMATE_QUALITY)},
    _drive_value: {"type": "number", "minimum": -MAX_DRIVE_VALUE, "maximum": MAX_DRIVE_VALUE},
}

#: per schema, fields of which a message carries at least one
ONE_OF: dict[str, tuple[str, ...]] = {"act": ("torque", "velocity", "position")}
#: the topic families of what drivers publish and the estimator consumes: ``<family>/<name>``
SENSOR_FAMILIES = ("imu", "enc", "act")
#: their topic prefixes
SENSOR_PREFIXES = tuple(f"{f}/" for f in SENSOR_FAMILIES)


def json_schema(topic: str) -> dict:
    """JSON Schema (draft 2020-12) of a topic's messages as :func:`decode` returns them.

    Used for self-describing exports (MCAP JSON channels, the Foxglove bridge).
    """
    key = schema_key(topic)
    fields = SCHEMAS[key]
    out = {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": f"rigstate {key}",
        "type": "object",
        "properties": {f.name: dict(getattr(f.check, "json_type", None) or _JSON_TYPES[f.check]) for f in fields},
        "required": [f.name for f in fields if f.required],
        "additionalProperties": False,
    }
    if key in ONE_OF:
        out["anyOf"] = [{"required": [k]} for k in ONE_OF[key]]
    return out


def schema_key(topic: str) -> str:
    """Which schema a topic uses: the ``imu``, ``enc`` and ``act`` families by prefix, the others exactly."""
    if not isinstance(topic, str):
        raise SchemaError(f"topic must be a string, got {topic!r}")
    return _schema_key(topic)


@functools.lru_cache(maxsize=MAX_CACHED_TOPICS)
def _schema_key(topic: str) -> str:
    """:func:`schema_key` of a string, remembered for the last ``MAX_CACHED_TOPICS`` valid topics
    (an invalid one raises, and is not remembered)."""
    problem = names.topic_problem(topic)
    if problem is not None:
        raise SchemaError(problem)
    family, _, name = topic.partition("/")
    if family in SENSOR_FAMILIES:
        if not name or len(topic) > 128:
            raise SchemaError(f"{topic!r}: {family} topics are '{family}/<name>'")
        return family
    if topic in SCHEMAS:
        return topic
    raise SchemaError(f"unknown topic {topic!r}; topics are imu/<name>, enc/<name>, act/<name>, "
                      f"{', '.join(k for k in SCHEMAS if '/' in k)}")



def is_sensor_topic(topic: str) -> bool:
    """True for imu/*, enc/* and act/* topics (what drivers publish and the estimator consumes)."""
    return topic.startswith(SENSOR_PREFIXES)


class _Validator:
    """A schema's fields prepared once for :func:`validate`: their names as a set and in the order
    error messages list them, and (name, check, required) in schema order."""

    def __init__(self, fields: list[Field], one_of: tuple[str, ...] = ()) -> None:
        self.known = frozenset(f.name for f in fields)
        self.listed = sorted(self.known)
        self.plan = tuple((f.name, f.check, f.required) for f in fields)
        self.one_of = one_of  #: fields of which a message carries at least one

    def __call__(self, topic: str, msg: object) -> dict:
        if not isinstance(msg, dict):
            raise SchemaError(f"{topic}: expected a map, got {type(msg).__name__}")
        if not self.known.issuperset(msg):
            extra = next(k for k in msg if k not in self.known)
            raise SchemaError(f"{topic}: unknown field {extra!r}; fields are {self.listed}")
        out = {}
        for name, check, required in self.plan:
            v = msg.get(name)
            if v is not None:
                out[name] = check(topic, name, v)
            elif required:
                raise SchemaError(f"{topic}: missing field {name!r}")
        if self.one_of and not any(k in out for k in self.one_of):
            raise SchemaError(f"{topic}: missing field: one of {list(self.one_of)} is needed")
        return out


_VALIDATORS = {key: _Validator(fields, ONE_OF.get(key, ())) for key, fields in SCHEMAS.items()}


def validate(topic: str, msg: object) -> dict:
    """Normalised copy of ``msg`` (plain floats/ints/lists, schema key order) or SchemaError."""
    return _VALIDATORS[schema_key(topic)](topic, msg)


def state_flags(msg: dict) -> list[str]:
    """What a live view shows of an est/state message's health: its ``status`` and, when it is not
    ``ok``, its ``quality`` (``["ok"]``, ``["ok", "inconsistent"]``, ``["degraded", "inconsistent"]``)."""
    return [str(msg[k]) for k in ("status", "quality") if k in msg and (k == "status" or msg[k] != "ok")]


def encode(topic: str, msg: dict) -> bytes:
    """Validate and pack canonically."""
    return pack(validate(topic, msg))


def pack(valid: dict) -> bytes:
    """The canonical bytes of a message :func:`validate` returned (what :func:`encode` sends)."""
    return msgpack.packb(valid, use_bin_type=True, use_single_float=False)


def decode(topic: str, payload: bytes) -> dict:
    """Unpack (bounded) and validate; any problem is a SchemaError."""
    validator = _VALIDATORS[schema_key(topic)]
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise SchemaError(f"{topic}: payload must be bytes")
    if len(payload) > MAX_PAYLOAD:
        raise SchemaError(f"{topic}: payload of {len(payload)} bytes exceeds {MAX_PAYLOAD}")
    try:
        msg = msgpack.unpackb(
            payload, raw=False, strict_map_key=True, max_bin_len=MAX_PAYLOAD, max_str_len=4096,
            max_array_len=MAX_ARRAY, max_map_len=MAX_ARRAY, max_ext_len=0,
        )
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError, TypeError) as exc:
        raise SchemaError(f"{topic}: not a msgpack map: {exc}") from None
    return validator(topic, msg)

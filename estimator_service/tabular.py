"""Bus messages as table rows: one home for column names (CSV, pandas) and flat rows.

List fields get one column per entry, named by what the entry is: ``gyr_x``/``acc_y`` (sensor frame),
``quat_w``..``quat_z``, the state vectors by the mechanism's coordinate names (``q_x1``, ``qd_x1``,
``z_crank``, ``zd_crank``) when the log header carries the mechanism, else by index (``q_0``).
Maps (est/diag ``inputs``, ``step_us``) are flattened with dots: ``inputs.imu/coupler.rate_hz``.
Units are those of the schema (s, rad, rad/s, m/s², m).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING

from estimator_service import schema

if TYPE_CHECKING:
    from estimator_service.model import Model

log = logging.getLogger(__name__)

FIXED_LABELS: dict[str, tuple[str, ...]] = {
    "gyr": ("x", "y", "z"),
    "acc": ("x", "y", "z"),
    "quat": ("w", "x", "y", "z"),
}


def state_labels(header: dict) -> dict[str, list[str]]:
    """Entry names of q, qd (coordinate names) and z, zd, P_z (DOF names) from a log header.

    Empty when the header has no usable mechanism (foreign logs): callers then fall back to indices.
    """
    text = header.get("mechanism_yaml") if isinstance(header, dict) else None
    if not isinstance(text, str) or not text:
        return {}
    from estimator_service.errors import UserError
    from estimator_service.mechanism import parse_mechanism
    from estimator_service.model import AssemblyError, Model

    try:
        model = Model(parse_mechanism(text, "<log header>"))
    except (UserError, AssemblyError, ValueError) as exc:
        log.warning("log header mechanism unusable (%s); columns named by index", exc)
        return {}
    return model_labels(model)


def model_labels(model: Model) -> dict[str, list[str]]:
    """Entry names of q, qd (coordinate names) and z, zd (DOF names) of a model."""
    coords, dofs = list(model.coord_names), list(model.dof_names)
    return {"q": coords, "qd": coords, "z": dofs, "zd": dofs}


def column_label(field: str, index: int, length: int, labels: dict[str, list[str]]) -> str:
    """Column name of entry ``index`` of list field ``field`` (of ``length`` entries)."""
    names = labels.get(field) or FIXED_LABELS.get(field)
    if names is not None and len(names) == length:
        return f"{field}_{names[index]}"
    return f"{field}_{index}"


def flatten(msg: dict, labels: dict[str, list[str]]) -> dict[str, object]:
    """One flat row of a decoded message: scalars as they are, lists per entry, maps by dotted path."""
    row: dict[str, object] = {}
    for key, value in msg.items():
        if isinstance(value, list):
            for i, x in enumerate(value):
                row[column_label(key, i, len(value), labels)] = x
        elif isinstance(value, dict):
            _flatten_map(key, value, row)
        else:
            row[key] = value
    return row


def unflatten(topic: str, row: Mapping[str, object], labels: dict[str, list[str]]) -> dict:
    """The message of one flat row (the inverse of :func:`flatten` for every field but maps):
    list fields from their entry columns (by name, else by index), missing or NaN cells of optional
    fields left out, whole floats of integer fields (a column with gaps is float) made integers.
    Columns that are no field (``t_recv``, the index) are ignored; the result is not validated."""
    msg: dict[str, object] = {}
    for f in schema.SCHEMAS[schema.schema_key(topic)]:
        if f.check in _LIST_CHECKS:
            value = _entries(f.name, row, labels)
        else:
            value = row.get(f.name)
            if isinstance(value, float) and f.check in _INT_CHECKS and value.is_integer():
                value = int(value)
        if value is not None and not _missing(value):
            msg[f.name] = value
    return msg


def _missing(value: object) -> bool:
    return isinstance(value, float) and value != value  # NaN: pandas' empty cell


def _entries(field: str, row: Mapping[str, object], labels: dict[str, list[str]]) -> list | None:
    names = labels.get(field) or FIXED_LABELS.get(field)
    if names and f"{field}_{names[0]}" in row:
        values = [row.get(f"{field}_{n}") for n in names]
    else:
        values = []
        while f"{field}_{len(values)}" in row:
            values.append(row[f"{field}_{len(values)}"])
    if not values or any(v is None or _missing(v) for v in values):
        return None
    return values


_LIST_CHECKS = {f.check for fields in schema.SCHEMAS.values() for f in fields
                if getattr(f.check, "json_type", {}).get("type") == "array"}
_INT_CHECKS = {f.check for f in schema.SCHEMAS["imu"] + schema.SCHEMAS["enc"] if f.name in ("seq", "count", "cpr", "status")}


def _flatten_map(prefix: str, value: dict, row: dict[str, object]) -> None:
    for k, x in value.items():
        name = f"{prefix}.{k}"
        if isinstance(x, dict):
            _flatten_map(name, x, row)
        else:
            row[name] = x


def rows_by_topic(header: dict, records: Iterable, topics: Iterable[str] | None = None) -> Iterator[tuple[str, dict]]:
    """(topic, flat row with ``t_recv``) of every valid record; invalid payloads are skipped (logged)."""
    labels = state_labels(header)
    wanted = set(topics) if topics is not None else None
    bad = 0
    for rec in records:
        if wanted is not None and rec.topic not in wanted:
            continue
        try:
            msg = schema.decode(rec.topic, rec.payload)
        except schema.SchemaError:
            bad += 1
            continue
        yield rec.topic, {"t_recv": rec.t_recv, **flatten(msg, labels)}
    if bad:
        log.warning("skipped %d records whose payload is not valid", bad)

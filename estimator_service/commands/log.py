"""``rigstate log info|export|import``: inspect logs and convert them to and from CSV.

CSV layout: one file per topic (``/`` becomes ``__``, e.g. ``imu__coupler.csv``); columns ``t``,
``t_recv``, ``log_index`` (position in the log, so the order survives), then one column per scalar:
lists flattened as ``name_0, name_1, ...``, maps (est/diag) as JSON text.  When the log header holds
the mechanism, the state vectors of ``est/state`` and ``truth/state`` are named by it instead:
``q_<coordinate>``, ``qd_<coordinate>`` (e.g. ``q_x1``, ``qd_theta``) and ``z_<dof>``, ``zd_<dof>``
(e.g. ``z_crank``); import maps them back the same way.  Floats are written with ``repr`` (shortest
round-trip form), so log -> CSV -> log reproduces the same payload bytes.  ``header.json`` holds the
log header.  Foreign CSVs need only ``t`` and scalar columns (``t_recv`` defaults to ``t``).
A foreign table in its own names and units (``--table``) goes through a map: estimator_service/tableimport.py.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import re
from collections import defaultdict
from contextlib import ExitStack
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

from estimator_service import schema
from estimator_service.errors import UserError
from estimator_service.logfile import LogWriter, Record, read_log, validate_header
from estimator_service.mcapio import McapCounts, export_mcap, import_mcap
from estimator_service.names import file_stem, printable
from estimator_service.rig import load_rig
from estimator_service.tableimport import REPEATS, check_sensors, import_table, imported_records, load_map, read_table
from estimator_service.tabular import state_labels
from estimator_service.paths import make_output_dir


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("log", help="inspect logs; convert to and from CSV", description="Log tools.")
    lsub = p.add_subparsers(dest="log_command", metavar="SUBCOMMAND")
    lsub.required = True
    i = lsub.add_parser("info", help="topics, counts, duration, rates, gaps, seq jumps",
                        description="Summary of a log: per topic count, span, mean rate, largest gap, seq jumps.")
    i.add_argument("log")
    i.set_defaults(func=_info)
    e = lsub.add_parser("export", help="write one CSV per topic, or an MCAP file",
                        description="Export a log to CSV files (--csv) or to MCAP with JSON channels (--mcap), "
                        "which Foxglove and PlotJuggler open (docs/data-tools.md).")
    e.add_argument("log")
    eo = e.add_mutually_exclusive_group(required=True)
    eo.add_argument("--csv", metavar="DIR", help="output directory (one CSV per topic)")
    eo.add_argument("--mcap", metavar="FILE", help="output MCAP file")
    e.set_defaults(func=_export)
    m = lsub.add_parser("import", help="build a log from CSV files, an MCAP file or a foreign table",
                        description="Build a log from one CSV per topic (and header.json if present; the inverse "
                        "of export), from an MCAP file with JSON channels, or from a table in its own column "
                        "names and units (--table: CSV, Parquet, MATLAB .mat; one row per sample, several "
                        "sensors) through a map (--map and/or --set; docs/data-tools.md).")
    mi = m.add_mutually_exclusive_group(required=True)
    mi.add_argument("--csv", metavar="DIR", help="directory of CSV files")
    mi.add_argument("--mcap", metavar="FILE", help="MCAP file")
    mi.add_argument("--table", metavar="FILE", help="a foreign table (.csv, .parquet, .mat) to convert with a map")
    m.add_argument("--map", metavar="TOML", help="--table: the map from its columns to topics and fields")
    m.add_argument("--set", metavar="KEY=VALUE", action="append", default=[],
                   help="--table: a map entry, overriding the map file (e.g. time.column=all_time, "
                   "imu.shaft.gyr_unit=deg/s); repeatable")
    m.add_argument("--repeats", choices=REPEATS,
                   help="--table: rows whose time stamp does not increase: drop them (default) or refuse the table")
    m.add_argument("--rig", metavar="TOML", help="--table: the rig, stored in the log header (then `rigstate "
                   "estimate` needs no --rig); the mapped sensors must be its sensors")
    m.add_argument("--out", required=True, help="output log")
    m.set_defaults(func=_import)


#: topics whose timing is taken from the receive time: est/diag is published on the wall clock
#: (its ``t`` is the estimator's sensor time, 0 before initialisation)
WALL_CLOCK_TOPICS = ("est/diag",)
#: topics whose ``seq`` is no per-message counter (est/diag carries the number of est/state published)
NO_SEQ_COUNTER_TOPICS = ("est/diag",)
STATE_TOPICS = ("est/state", "truth/state")  #: topics whose q, qd, z, zd are named by the mechanism
HOST_TIME_S = 1e8  #: a time origin beyond this (s, ~3 years) is host time since the epoch


def _info(args: argparse.Namespace) -> int:
    reader = read_log(args.log)
    stats: dict[str, dict] = {}
    for rec in reader:
        s = stats.setdefault(rec.topic, {"n": 0, "t": [], "seq_jumps": 0, "seq_back": 0, "last_seq": None, "bad": 0})
        s["n"] += 1
        try:
            msg = schema.decode(rec.topic, rec.payload)
        except schema.SchemaError:
            s["bad"] += 1
            continue
        s["t"].append(rec.t_recv if rec.topic in WALL_CLOCK_TOPICS else msg["t"])
        seq = msg.get("seq")
        if rec.topic in NO_SEQ_COUNTER_TOPICS:
            continue
        if seq is not None and s["last_seq"] is not None:
            if seq > s["last_seq"] + 1:
                s["seq_jumps"] += 1
            elif seq <= s["last_seq"]:
                s["seq_back"] += 1
        s["last_seq"] = seq if seq is not None else s["last_seq"]
    h = reader.header
    print(printable(f"{args.log}: rig {h.get('rig_path') or '-'}, mechanism {h.get('mechanism_path') or '-'}, "
                    f"created {h.get('created')}"))
    if h.get("meta"):
        print(f"  meta: {printable(json.dumps(h['meta'], default=repr))}")
    firsts = [s["t"][0] for s in stats.values() if s["t"]]
    origin = min(firsts) if firsts else 0.0
    if origin > HOST_TIME_S:
        when = datetime.fromtimestamp(origin, UTC).isoformat(timespec="milliseconds")
        print(f"  times relative to the first record: {when} (host time t = {origin:.3f} s)")
    else:
        print(f"  times relative to the first record: t = {origin:.3f} s")
    print(f"  {'topic':22s} {'count':>8s} {'start s':>10s} {'duration s':>10s} {'rate Hz':>9s} {'max gap ms':>10s} {'seq jumps':>9s} {'out of order':>12s} {'invalid':>7s}")
    for topic in sorted(stats):
        s = stats[topic]
        t = np.asarray(s["t"])
        span = float(t[-1] - t[0]) if t.size > 1 else 0.0
        rate = (t.size - 1) / span if span > 0 else 0.0
        gap = float(np.max(np.diff(t))) * 1e3 if t.size > 1 else 0.0
        start = float(t[0]) - origin if t.size else math.nan
        jumps, back = ("-", "-") if topic in NO_SEQ_COUNTER_TOPICS else (s["seq_jumps"], s["seq_back"])
        print(f"  {printable(topic)[:22]:22s} {s['n']:8d} {start:10.3f} {span:10.3f} {rate:9.1f} {gap:10.1f} "
              f"{jumps:>9} {back:>12} {s['bad']:7d}")
    if any(t in stats for t in WALL_CLOCK_TOPICS):
        print(f"  {', '.join(t for t in WALL_CLOCK_TOPICS if t in stats)}: times are receive times; seq is not a "
              "message counter (no seq jumps)")
    if reader.truncated_tail:
        print("  note: the file ends inside a record (crash or copy cut short); complete records were read")
    if reader.skipped_bytes:
        print(f"  note: {reader.skipped_bytes} damaged bytes were skipped")
    return 0


def _columns(names: dict[str, list[str]]) -> dict[str, tuple[str, int]]:
    """CSV column name -> (field, index) of the named state vector entries."""
    return {f"{k}_{n}": (k, i) for k, ns in names.items() for i, n in enumerate(ns)}


def _flatten(msg: dict, names: dict[str, list[str]]) -> dict[str, object]:
    """CSV cells of a message; list fields of ``names`` (if their lengths match) by entry name."""
    out: dict[str, object] = {}
    for k, v in msg.items():
        if k == "t":
            continue
        if isinstance(v, list):
            labels = names.get(k) if len(names.get(k, ())) == len(v) else None
            for i, x in enumerate(v):
                out[f"{k}_{labels[i] if labels else i}"] = x
        elif isinstance(v, dict):
            out[k] = json.dumps(v, sort_keys=False)
        else:
            out[k] = v
    return out


def _cell(v: object) -> str:
    if isinstance(v, float):
        return repr(v)
    return str(v)


def _report_mcap(path: str, counts: McapCounts, what: str) -> int:
    skipped = sum(counts.skipped.values())
    print(f"{path}: {sum(counts.messages.values())} messages on {len(counts.messages)} topics {what}"
          + (f"; {skipped} invalid payloads skipped" if skipped else ""))
    return 0


def csv_name(topic: str) -> str:
    """File name of a topic's CSV: ``imu/coupler`` -> ``imu__coupler.csv`` (sanitised: stays in its directory)."""
    return file_stem(topic.replace("/", "__")) + ".csv"


def _export(args: argparse.Namespace) -> int:
    if args.mcap:
        return _report_mcap(args.mcap, export_mcap(read_log(args.log), args.mcap), "written")
    reader = read_log(args.log)
    out = Path(args.csv)
    make_output_dir(out)
    # two streamed passes (memory independent of the log's length): the columns, then the rows
    cols: dict[str, set[str]] = defaultdict(set)
    invalid: dict[str, int] = defaultdict(int)
    names = state_labels(reader.header)
    columns = _columns(names)
    for rec in reader:
        try:
            named = names if rec.topic in STATE_TOPICS else {}
            flat = _flatten(schema.decode(rec.topic, rec.payload), named)
        except schema.SchemaError:
            invalid[rec.topic] += 1  # not representable as CSV columns: counted, not exported
            continue
        cols[rec.topic].update(flat)
    first = ["t", "t_recv", "log_index"]
    order = {topic: first + sorted(c - set(first), key=lambda c: _col_key(c, columns)) for topic, c in cols.items()}
    counts: dict[str, int] = defaultdict(int)
    try:
        with ExitStack() as stack:
            writers = {}
            for topic, cs in order.items():
                f = stack.enter_context(open(out / csv_name(topic), "w", newline=""))
                writers[topic] = csv.writer(f)
                writers[topic].writerow(cs)
            for index, rec in enumerate(reader):
                try:
                    msg = schema.decode(rec.topic, rec.payload)
                except schema.SchemaError:
                    continue
                named = names if rec.topic in STATE_TOPICS else {}
                r = {"t": msg["t"], "t_recv": rec.t_recv, "log_index": index, **_flatten(msg, named)}
                writers[rec.topic].writerow(["" if c not in r else _cell(r[c]) for c in order[rec.topic]])
                counts[rec.topic] += 1
        (out / "header.json").write_text(json.dumps(reader.header, indent=1, default=repr) + "\n")
    except OSError as exc:
        raise UserError(f"{exc.filename or out}: cannot write: {exc.strerror}") from None
    print(printable(f"{args.csv}: {len(counts)} topics, {sum(counts.values())} messages"
                    + (f"; invalid payloads not exported: {dict(invalid)}" if invalid else "")))
    return 0


def _col_key(c: str, columns: dict[str, tuple[str, int]]) -> tuple:
    if c in columns:
        return columns[c]
    m = re.fullmatch(r"(.*)_(\d+)", c)
    return (m.group(1), int(m.group(2))) if m else (c, -1)


def _parse_cell(text: str, where: str) -> object:
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        pass
    if text.startswith("{"):
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise UserError(f"{where}: bad JSON map: {exc}") from None
    return text


def _unflatten(row: dict[str, str], where: str, columns: dict[str, tuple[str, int]]) -> tuple[dict, float | None]:
    """(message, t_recv or None) of one CSV row; ``columns``: named state vector columns."""
    msg: dict[str, object] = {}
    lists: dict[str, dict[int, object]] = defaultdict(dict)
    t_recv = None
    for col, text in row.items():
        if col is None or text is None or text == "":
            continue
        value = _parse_cell(text, f"{where}, column {col!r}")
        if col == "t_recv":
            t_recv = float(value)  # type: ignore[arg-type]
            continue
        if col == "log_index":
            continue
        if col in columns:
            field, i = columns[col]
            lists[field][i] = value
            continue
        m = re.fullmatch(r"(.*)_(\d+)", col)
        if m and col != "t":
            lists[m.group(1)][int(m.group(2))] = value
        else:
            msg[col] = value
    for name, items in lists.items():
        msg[name] = [items[i] for i in sorted(items)]
    if "t" in msg:
        msg["t"] = float(msg["t"])  # type: ignore[arg-type]
    return _restore_types(msg), t_recv


def _restore_types(msg: dict) -> dict:
    """CSV cells lose the float/int distinction of whole numbers: floats where the schema wants numbers."""
    for k, v in msg.items():
        if k in ("seq", "count", "cpr", "status") and isinstance(v, (int, str)):
            continue
        if isinstance(v, int) and not isinstance(v, bool):
            msg[k] = float(v)
        elif isinstance(v, list):
            msg[k] = [float(x) if isinstance(x, int) else x for x in v]
    return msg


def _read_header_json(path: Path) -> dict:
    """The log header saved by ``log export`` (UserError if it is not a JSON map)."""
    try:
        header = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise UserError(f"{path}: cannot read the header: {exc}") from None
    if not isinstance(header, dict):
        raise UserError(f"{path}: expected a JSON map (the log header), got {type(header).__name__}")
    return header


def _read_csv(path: Path, order: int, columns: dict[str, tuple[str, int]]) -> list[tuple[tuple[float, int], Record]]:
    """The records of one topic's CSV with their sort keys (``order``: position of its first row;
    ``columns``: the named state vector columns of the header's mechanism)."""
    topic = path.stem.replace("__", "/")
    columns = columns if topic in STATE_TOPICS else {}
    out = []
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        if not reader.fieldnames or "t" not in reader.fieldnames:
            raise UserError(f"{path}: first row must name the columns, with a 't' column")
        for n, row in enumerate(reader, start=2):
            where = f"{path}, row {n}"
            try:
                msg, t_recv = _unflatten(row, where, columns)
                payload = schema.encode(topic, msg)
                t_r = msg["t"] if t_recv is None else t_recv
                index = row.get("log_index")
                key = (0.0, int(index)) if index not in (None, "") else (float(t_r), order)
            except (schema.SchemaError, ValueError, TypeError) as exc:
                raise UserError(printable(f"{where}: {exc}")) from None
            out.append((key, Record(topic, t_r, payload)))
            order += 1
    return out


def _import_table(args: argparse.Namespace) -> int:
    if args.map is None and not args.set:
        raise UserError("--table needs a map: --map MAP.toml and/or --set KEY=VALUE (docs/data-tools.md)")
    tmap = load_map(args.map, args.set, args.repeats)
    imported = import_table(read_table(args.table), tmap)
    meta = {"command": "log import", "imported_from": str(args.table), "map": tmap.source,
            "dropped_rows": {"repeated": imported.repeated, "backwards": imported.backwards}}
    if args.rig is not None:
        rig = load_rig(args.rig)
        check_sensors(imported, tmap, rig)
        header = rig.header(meta)
    else:
        header = {**_EMPTY_HEADER, "meta": meta}
    header["created"] = "import"  # same table and map, same bytes
    records = imported_records(imported)
    with LogWriter(args.out, header) as w:
        for rec in records:
            w.write(rec.topic, rec.t_recv, rec.payload)
    print(printable(f"{args.out}: {imported.describe()}"))
    return 0


_EMPTY_HEADER = {"format": "rigstate-log", "version": 1, "created": "import", "rig_path": "", "rig_toml": "",
                 "mechanism_path": "", "mechanism_yaml": "", "meta": {}}


def _import(args: argparse.Namespace) -> int:
    table_only = [o for o in ("map", "set", "repeats", "rig") if getattr(args, o) and not args.table]
    if table_only:
        raise UserError(f"--{table_only[0]} applies to --table only")
    if args.table:
        return _import_table(args)
    if args.mcap:
        return _report_mcap(args.out, import_mcap(args.mcap, args.out), "imported")
    src = Path(args.csv)
    files = sorted(src.glob("*.csv"))
    if not files:
        raise UserError(f"{src}: no .csv files")
    header_path = src / "header.json"
    header = _read_header_json(header_path) if header_path.exists() else {
        **_EMPTY_HEADER, "meta": {"imported_from": str(src)}}
    validate_header(header, header_path)
    columns = _columns(state_labels(header))
    records: list[tuple[tuple[float, int], Record]] = []
    for path in files:
        try:
            records += _read_csv(path, len(records), columns)
        except (OSError, UnicodeDecodeError, csv.Error) as exc:
            raise UserError(f"{path}: cannot read as CSV: {exc}") from None
    records.sort(key=lambda r: r[0])
    with LogWriter(args.out, header) as w:
        for _, rec in records:
            w.write(rec.topic, rec.t_recv, rec.payload)
    print(f"{args.out}: {len(records)} messages from {len(files)} CSV files")
    return 0

"""rigstate logs to and from MCAP with JSON channels (Foxglove, PlotJuggler and the ``mcap`` tools read it).

One MCAP channel per topic, ``message_encoding`` ``json``, with a ``jsonschema`` schema from
:func:`estimator_service.schema.json_schema`; each message is the decoded payload as JSON (floats in
their shortest round-trip form, so JSON -> canonical msgpack gives the payload bytes back).
``log_time`` is the host receive time ``t_recv`` and ``publish_time`` the message time ``t``, both in
integer ns (negative times clamp to 0; the exact ``t`` stays in the JSON).  The log header is
stored as the MCAP metadata record ``rigstate.header`` (every value as JSON text), and invalid
payloads are skipped and counted (they have no JSON form).

``import`` is the inverse: payloads are re-encoded canonically; ``t_recv`` comes back at 1 ns
resolution.  A foreign MCAP file imports when its channels are JSON with rigstate topic names and
schema-valid messages; anything else is named in a UserError.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from estimator_service import schema
from estimator_service.errors import UserError
from estimator_service.logfile import LogReader, LogWriter

HEADER_METADATA = "rigstate.header"
PROFILE = ""  #: no ROS profile: plain JSON channels
NS = 1_000_000_000


@dataclass
class McapCounts:
    """What an export or import did, per topic."""

    messages: dict[str, int] = field(default_factory=dict)
    skipped: dict[str, int] = field(default_factory=dict)


def _ns(t: float) -> int:
    return max(0, int(round(t * NS))) if math.isfinite(t) else 0


def export_mcap(reader: LogReader, out: str | Path) -> McapCounts:
    """Write every valid record of ``reader`` to the MCAP file ``out`` (overwritten)."""
    from mcap.writer import CompressionType, Writer

    counts = McapCounts()
    channels: dict[str, int] = {}
    try:
        f = open(out, "wb")
    except OSError as exc:
        raise UserError(f"{out}: cannot write: {exc.strerror}") from None
    with f:
        writer = Writer(f, compression=CompressionType.ZSTD)
        writer.start(profile=PROFILE, library="rigstate")
        writer.add_metadata(HEADER_METADATA, {str(k): json.dumps(v, default=str) for k, v in reader.header.items()})
        for rec in reader:
            try:
                msg = schema.decode(rec.topic, rec.payload)
            except schema.SchemaError:
                counts.skipped[rec.topic] = counts.skipped.get(rec.topic, 0) + 1
                continue
            if rec.topic not in channels:
                sid = writer.register_schema(schema.schema_key(rec.topic), "jsonschema",
                                             json.dumps(schema.json_schema(rec.topic)).encode())
                channels[rec.topic] = writer.register_channel(rec.topic, "json", sid)
            n = counts.messages.get(rec.topic, 0)
            writer.add_message(channels[rec.topic], log_time=_ns(rec.t_recv), data=json.dumps(msg).encode(),
                               publish_time=_ns(msg["t"]), sequence=n & 0xFFFFFFFF)
            counts.messages[rec.topic] = n + 1
        writer.finish()
    return counts


def import_mcap(path: str | Path, out: str | Path) -> McapCounts:
    """Build a rigstate log ``out`` from an MCAP file written by :func:`export_mcap` (or alike)."""
    from mcap.exceptions import McapError
    from mcap.reader import make_reader

    counts = McapCounts()
    try:
        f = open(path, "rb")
    except OSError as exc:
        raise UserError(f"{path}: cannot read: {exc.strerror}") from None
    with f:
        try:
            reader = make_reader(f)
            header = {"format": "rigstate-log", "version": 1, "created": "import", "meta": {"imported_from": str(path)}}
            for md in reader.iter_metadata():
                if md.name == HEADER_METADATA:
                    header = {k: json.loads(v) for k, v in md.metadata.items()}
            f.seek(0)
            reader = make_reader(f)
            with LogWriter(out, header) as w:
                for _schema, channel, message in reader.iter_messages(log_time_order=False):
                    where = f"{path}: channel {channel.topic!r}, message at log time {message.log_time} ns"
                    if channel.message_encoding != "json":
                        raise UserError(f"{where}: message encoding {channel.message_encoding!r} "
                                        "is not supported (expected json)")
                    try:
                        msg = json.loads(message.data)
                        payload = schema.encode(channel.topic, msg)
                    except (ValueError, schema.SchemaError) as exc:
                        raise UserError(f"{where}: {exc}") from None
                    w.write(channel.topic, message.log_time / NS, payload)
                    counts.messages[channel.topic] = counts.messages.get(channel.topic, 0) + 1
        except McapError as exc:
            raise UserError(f"{path}: not a readable MCAP file: {exc}") from None
    return counts

"""``rigstate record``: write every valid message on the bus to a log, flushed at least every 100 ms.

Each record is (topic, host receive time ``t_recv`` s, exact payload bytes).  Only payloads that
pass ``schema.decode`` are written; the others (malformed msgpack, unknown topic, wrong fields,
NaN, oversize) are counted per topic, logged at a rate limit and reported in the summary, so every
log reads cleanly with every log tool.  The header carries the rig TOML and mechanism YAML texts.

The log file is created new (``--force`` to overwrite an existing one); a symbolic link at its
path is never followed.  With ``--out-dir`` the file name is built from the rig name made safe
(:func:`estimator_service.names.file_stem`: no ``/``, no leading ``.``), so it stays in that directory.

Durability: records are handed to the OS at least every ``--flush-every`` s (default 0.1), so a
kill -9 loses at most that much; the log reads to its last complete record.  SIGTERM/SIGINT:
flush, close, print the summary, exit 0.  Under systemd: READY=1 once connected and the file is
open, WATCHDOG=1 at half of WatchdogSec, STATUS= once a second.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections import Counter
from datetime import datetime, UTC
from pathlib import Path

from estimator_service import bus, schema
from estimator_service.errors import UserError
from estimator_service.logfile import LogWriter
from estimator_service.names import file_stem, printable
from estimator_service.paths import default_rig
from estimator_service.rig import Rig, load_rig
from estimator_service.sdnotify import Notifier
from estimator_service.signals import stop_on_signals

log = logging.getLogger(__name__)

LOG_SUFFIX = ".rslog"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "record", help="record all valid bus messages to a log",
        description="Subscribe to every topic on the rig's endpoints (sim, per-sensor drivers, estimator) and "
        "append each valid message (exact bytes, receive time) to a log whose header carries the rig and "
        "mechanism configuration. Invalid payloads are counted, not written.")
    out = p.add_mutually_exclusive_group(required=True)
    out.add_argument("--out", help="log file to create")
    out.add_argument("--out-dir", help=f"create <rig>-<UTC time>{LOG_SUFFIX} in this directory (services)")
    p.add_argument("--config", default=str(default_rig()), help="rig TOML: endpoints and header (default: the shipped testbed)")
    p.add_argument("--endpoint", action="append", metavar="ENDPOINT",
                   help="connect here instead of the rig's endpoints (repeatable)")
    p.add_argument("--topic", action="append", metavar="PREFIX", help="record only these topic prefixes (default all)")
    p.add_argument("--duration", type=float, help="stop after this many seconds (default: until SIGTERM/SIGINT)")
    p.add_argument("--flush-every", type=float, default=0.1, metavar="S",
                   help="seconds between flushes to the OS (default 0.1)")
    p.add_argument("--fsync", action="store_true", help="also fsync at every flush (survives power loss, slower)")
    p.add_argument("--force", action="store_true",
                   help="overwrite an existing log file (a symbolic link is never followed, even with --force)")
    p.set_defaults(func=run)


def recorder_endpoints(rig: Rig) -> list[str]:
    """Every endpoint of a rig: sensor sources (sim + per-sensor drivers), then the estimator."""
    return list(dict.fromkeys([*rig.sensor_endpoints(), rig.bus.estimator]))


def _out_path(args: argparse.Namespace, rig: Rig) -> Path:
    if args.out:
        return Path(args.out)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    return Path(args.out_dir) / f"{file_stem(rig.name)}-{stamp}{LOG_SUFFIX}"


def run(args: argparse.Namespace) -> int:
    if args.flush_every <= 0 or args.flush_every > 0.1:
        raise UserError(f"--flush-every: must be in (0, 0.1] s, got {args.flush_every}")
    rig = load_rig(args.config)
    endpoints = args.endpoint or recorder_endpoints(rig)
    path = _out_path(args, rig)
    with stop_on_signals() as stop:
        header = rig.header({"command": "rigstate record", "argv": sys.argv[1:], "endpoints": endpoints,
                             "topics": args.topic or [""], "policy": "valid payloads only; invalid counted, not written"})
        counts: Counter[str] = Counter()
        invalid: Counter[str] = Counter()
        notifier = Notifier()
        writer = LogWriter(path, header, fsync=args.fsync, exclusive=not args.force)
        start = last_status = time.monotonic()
        last_warn = -1e9
        with bus.Subscriber(endpoints, topics=args.topic, auth=rig.bus.auth) as sub, writer:
            notifier.ready()
            log.info("recording %s from %s", path, ", ".join(endpoints))
            # recv timeout + flush period together stay within the promised 100 ms of data at risk
            timeout_s = args.flush_every / 4
            while not stop.is_set():
                got = sub.recv(timeout_s=timeout_s)
                now = time.monotonic()
                if got is not None:
                    topic, payload, t_recv = got
                    try:
                        schema.decode(topic, payload)
                    except schema.SchemaError as exc:
                        invalid[topic] += 1
                        if now - last_warn >= 1.0:
                            last_warn = now
                            log.warning("not recorded (%d invalid so far): %s", sum(invalid.values()), exc)
                    else:
                        writer.write(topic, t_recv, payload)
                        counts[topic] += 1
                writer.maybe_flush(now, args.flush_every * 0.75)
                notifier.maybe_watchdog(now)
                if now - last_status >= 1.0:
                    last_status = now
                    notifier.status(f"{writer.records} messages recorded to {path}; "
                                    f"{sum(invalid.values())} invalid, {sub.malformed} malformed dropped")
                if args.duration is not None and now - start >= args.duration:
                    break
            notifier.stopping()
        elapsed = time.monotonic() - start
        print(f"{path}: {sum(counts.values())} messages in {elapsed:.1f} s, {path.stat().st_size} bytes")
        for topic in sorted(counts.keys() | invalid.keys()):
            print(f"  {printable(topic):22s} {counts[topic]:9d}" + (f"  ({invalid[topic]} invalid, not recorded)" if invalid[topic] else ""))
        if sub.malformed:
            print(f"  {sub.malformed} malformed multipart messages dropped")
        return 0

"""``rigstate record``: write everything on the bus to a log (flushed every 100 ms).

Every message is written with its exact payload bytes, the receive time and its topic; payloads
that do not match the schema are recorded too (counted, so a faulty driver can be diagnosed from
the log) — nothing that arrived is lost.  After a crash or kill -9 the log reads to its last
complete record.  SIGTERM/SIGINT flush, close and exit 0.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
import time
from collections import Counter

from estimator_service import bus, schema
from estimator_service.logfile import LogWriter
from estimator_service.paths import default_rig
from estimator_service.rig import load_rig
from estimator_service.sdnotify import Notifier

log = logging.getLogger(__name__)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("record", help="record all bus messages to a log",
                       description="Subscribe to every topic on the rig's endpoints (sensors, sim, estimator) "
                       "and append them to LOG; the header carries the rig and mechanism configuration.")
    p.add_argument("--out", required=True, help="log file to create")
    p.add_argument("--config", default=str(default_rig()), help="rig TOML (endpoints and header)")
    p.add_argument("--endpoint", action="append", help="connect here instead of the rig's endpoints (repeatable)")
    p.add_argument("--duration", type=float, help="stop after this many seconds")
    p.add_argument("--flush-every", type=float, default=0.1, help="seconds between flushes (default 0.1)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    rig = load_rig(args.config)
    endpoints = args.endpoint or rig.sensor_endpoints() + [rig.bus.estimator]
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    counts: Counter[str] = Counter()
    invalid: Counter[str] = Counter()
    notifier = Notifier()
    start = time.monotonic()
    with bus.Subscriber(endpoints) as sub, LogWriter(args.out, rig.header({"command": "record", "endpoints": endpoints})) as w:
        notifier.ready()
        log.info("recording %s to %s", ", ".join(endpoints), args.out)
        watchdog = notifier.watchdog_interval_s()
        last_ping = start
        while not stop.is_set():
            now = time.monotonic()
            if args.duration is not None and now - start >= args.duration:
                break
            got = sub.recv(timeout_s=0.05)
            if got is not None:
                topic, payload, t_recv = got
                w.write(topic, t_recv, payload)
                counts[topic] += 1
                try:
                    schema.decode(topic, payload)
                except schema.SchemaError:
                    invalid[topic] += 1
            w.maybe_flush(time.monotonic(), args.flush_every)
            if watchdog and now - last_ping > watchdog / 2:
                notifier.watchdog()
                notifier.status(f"{sum(counts.values())} messages recorded")
                last_ping = now
        notifier.stopping()
    print(f"{args.out}: {sum(counts.values())} messages "
          + ", ".join(f"{t} {n}" for t, n in sorted(counts.items()))
          + (f"; invalid (recorded anyway): {dict(invalid)}" if invalid else ""), file=sys.stderr)
    return 0

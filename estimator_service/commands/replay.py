"""``rigstate replay``: publish the sensor messages of a log again, with their original timing.

Publishes ``imu/*``, ``enc/*`` and ``truth/*`` (not ``est/*``: the live estimator makes those anew)
with the exact recorded bytes, paced on the recorded receive times divided by ``--speed``.
``--as-fast-as-possible`` does not pace; the socket's high-water mark is set to the whole log so
nothing is dropped, but a subscriber must keep up (the estimator does at ≥ 3× real time).
"""

from __future__ import annotations

import argparse
import signal
import threading
import time

from estimator_service import bus
from estimator_service.logfile import read_log
from estimator_service.offline import rig_of_log

REPLAYED = ("imu/", "enc/", "truth/")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("replay", help="publish a recorded log's sensor messages with the original timing",
                       description="Replays imu/*, enc/* and truth/* of LOG on the bus (exact bytes) so the live "
                       "estimator runs on them unchanged.")
    p.add_argument("log")
    speed = p.add_mutually_exclusive_group()
    speed.add_argument("--speed", type=float, default=1.0, help="time scale (default 1 = real time)")
    speed.add_argument("--as-fast-as-possible", action="store_true", help="no pacing")
    p.add_argument("--endpoint", help="publish here (default: the [bus] sim endpoint of the log's rig)")
    p.add_argument("--wait", type=float, default=0.5, help="seconds to wait for subscribers before starting")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    reader = read_log(args.log)
    records = [r for r in reader if r.topic.startswith(REPLAYED)]
    endpoint = args.endpoint or rig_of_log(reader.header, args.log).bus.sim
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    with bus.Publisher(endpoint, hwm=max(1000, len(records) + 1)) as pub:
        if stop.wait(args.wait):
            return 0
        t0 = records[0].t_recv if records else 0.0
        start = time.monotonic()
        for rec in records:
            if not args.as_fast_as_possible:
                delay = start + (rec.t_recv - t0) / args.speed - time.monotonic()
                if delay > 0 and stop.wait(delay):
                    break
            elif stop.is_set():
                break
            pub.publish_raw(rec.topic, rec.payload)
        print(f"replayed {pub.sent} messages from {args.log} on {endpoint}" + (f" ({pub.dropped} dropped)" if pub.dropped else ""))
    return 0

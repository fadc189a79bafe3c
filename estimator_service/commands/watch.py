"""``rigstate watch``: live terminal view of bus topics (rate, count, latency, latest values).

Per topic: messages received, rate over the last second (Hz, by receive time), latency
``t_recv - t`` (ms; shown only when the message time ``t`` is host time, i.e. within 60 s of the
receive time — simulated streams start at t = 0), invalid payloads (failed ``schema.decode``) and
the latest values.  Redrawn about 4 times a second; on a terminal the screen is cleared (ANSI),
otherwise plain tables are appended (pipes, logs).
"""

from __future__ import annotations

import argparse
import math
import signal
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TextIO

from estimator_service import bus, schema
from estimator_service.commands.record import recorder_endpoints
from estimator_service.errors import UserError
from estimator_service.names import printable
from estimator_service.paths import default_rig
from estimator_service.rig import load_rig

REFRESH_S = 0.25
LATENCY_PLAUSIBLE_S = 60.0


@dataclass
class TopicView:
    """What is shown for one topic."""

    count: int = 0
    invalid: int = 0
    recent: deque[float] = field(default_factory=deque)  #: receive times of the last second (s)
    latency_ms: float | None = None
    latest: str = ""

    def rate_hz(self, now: float) -> int:
        """Messages received in the last second (``now``: host time, s)."""
        while self.recent and now - self.recent[0] > 1.0:
            self.recent.popleft()
        return len(self.recent)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "watch", help="live view of bus topics: rates, latency, latest values",
        description="Subscribe to the rig's endpoints (sensors, sim, estimator) and show per topic the "
        "message count and rate, the latency (receive time - message t, when t is host time), the latest "
        "values and invalid payload counts.")
    p.add_argument("--topic", action="append", metavar="PREFIX", help="topic prefix to show (repeatable; default all)")
    p.add_argument("--config", default=str(default_rig()), help="rig TOML: endpoints (default: the shipped testbed)")
    p.add_argument("--endpoint", action="append", metavar="ENDPOINT", help="connect here instead (repeatable)")
    p.add_argument("--duration", type=float, help="exit after this many seconds (default: until Ctrl-C; 1 with --once)")
    p.add_argument("--once", action="store_true", help="collect for --duration, print one table, exit")
    p.set_defaults(func=run)


def _deg(rad: float) -> str:
    return f"{math.degrees(rad) % 360:7.2f}°"


def summary(topic: str, msg: dict) -> str:
    """A compact line of the interesting values of a decoded message."""
    if topic in ("est/state", "truth/state"):
        if "crank" in msg:
            out = f"crank {_deg(msg['crank'])}  rate {msg.get('crank_rate', math.nan):+8.3f} rad/s"
        else:
            out = "z " + " ".join(f"{v:+.4f}" for v in msg["z"])
        return out + (f"  [{msg['status']}]" if "status" in msg else "")
    if topic.startswith("imu/"):
        return ("gyr " + " ".join(f"{v:+7.3f}" for v in msg["gyr"]) + " rad/s  acc "
                + " ".join(f"{v:+6.2f}" for v in msg["acc"]) + " m/s²")
    if topic.startswith("enc/"):
        angle = msg["angle"] if "angle" in msg else msg["count"] * 2 * math.pi / msg["cpr"]
        return f"count {msg['count']:>10d}  angle {_deg(angle)}"
    if topic == "est/diag":
        info = "  ".join(f"{k} {v}" for k, v in msg["step_us"].items())
        return f"{msg['status']}  step µs: {info}"[:120]
    return ""


class Watch:
    """Accumulates messages and renders the table."""

    def __init__(self) -> None:
        self.views: dict[str, TopicView] = {}

    def add(self, topic: str, payload: bytes, t_recv: float) -> None:
        v = self.views.setdefault(topic, TopicView())
        v.count += 1
        v.recent.append(t_recv)
        try:
            msg = schema.decode(topic, payload)
        except schema.SchemaError:
            v.invalid += 1
            return
        v.latest = printable(summary(topic, msg))  # est/diag strings come from the network
        lat = t_recv - msg["t"]
        v.latency_ms = lat * 1e3 if abs(lat) < LATENCY_PLAUSIBLE_S else None

    def table(self, now: float, malformed: int) -> str:
        lines = [f"{'topic':22s} {'count':>8s} {'rate Hz':>8s} {'latency ms':>10s} {'invalid':>7s}  latest"]
        for topic in sorted(self.views):
            v = self.views[topic]
            lat = f"{v.latency_ms:10.1f}" if v.latency_ms is not None else f"{'-':>10s}"
            lines.append(f"{printable(topic)[:22]:22s} {v.count:8d} {v.rate_hz(now):8d} {lat} {v.invalid:7d}  {v.latest}")
        if not self.views:
            lines.append("(no messages yet)")
        lines.append(f"malformed multipart messages dropped: {malformed}")
        return "\n".join(lines)


def _draw(out: TextIO, text: str, tty: bool) -> None:
    out.write(("\x1b[H\x1b[2J" + text + "\n") if tty else (text + "\n\n"))
    out.flush()


def run(args: argparse.Namespace) -> int:
    duration = args.duration if args.duration is not None else (1.0 if args.once else None)
    if duration is not None and duration <= 0:
        raise UserError(f"--duration: must be > 0 s, got {duration}")
    rig = load_rig(args.config)
    endpoints = args.endpoint or recorder_endpoints(rig)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    tty = sys.stdout.isatty() and not args.once
    watch = Watch()
    start = last_draw = time.monotonic()
    with bus.Subscriber(endpoints, topics=args.topic, auth=rig.bus.auth) as sub:
        while not stop.is_set():
            got = sub.recv(timeout_s=0.05)
            if got is not None:
                watch.add(*got)
            now = time.monotonic()
            if duration is not None and now - start >= duration:
                break
            if not args.once and now - last_draw >= REFRESH_S:
                last_draw = now
                _draw(sys.stdout, watch.table(time.time(), sub.malformed), tty)
        _draw(sys.stdout, watch.table(time.time(), sub.malformed), False)
    return 0

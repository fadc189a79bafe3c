"""``rigstate watch``: live terminal view of bus topics (rate, latency, latest values)."""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass, field

from estimator_service import bus, schema
from estimator_service.paths import default_rig
from estimator_service.rig import load_rig


@dataclass
class TopicView:
    count: int = 0
    invalid: int = 0
    times: list[float] = field(default_factory=list)  #: receive times of the last second
    latency_ms: float = math.nan
    latest: str = ""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("watch", help="live view of bus topics: rates, latency, latest values",
                       description="Subscribes to the rig's endpoints and shows, per topic, the message rate, "
                       "the latency (receive time - message t; meaningful when t is host time), the latest values "
                       "and invalid payload counts.")
    p.add_argument("--topic", action="append", help="topic prefix to show (repeatable; default all)")
    p.add_argument("--config", default=str(default_rig()), help="rig TOML (endpoints)")
    p.add_argument("--endpoint", action="append", help="connect here instead (repeatable)")
    p.add_argument("--duration", type=float, help="exit after this many seconds")
    p.set_defaults(func=run)


def summary(topic: str, msg: dict) -> str:
    """A compact line of the interesting values of a message."""
    if topic == "est/state" or topic == "truth/state":
        if "crank" in msg:
            out = f"crank {math.degrees(msg['crank']) % 360:7.2f}°  rate {msg['crank_rate']:+7.3f} rad/s"
        else:
            out = "z " + " ".join(f"{v:+.4f}" for v in msg["z"])
        return out + (f"  [{msg['status']}]" if "status" in msg else "")
    if topic.startswith("imu/"):
        return "gyr " + " ".join(f"{v:+.3f}" for v in msg["gyr"]) + "  acc " + " ".join(f"{v:+.2f}" for v in msg["acc"])
    if topic.startswith("enc/"):
        return f"count {msg['count']}  angle {math.degrees(msg['count'] * 2 * math.pi / msg['cpr']):.2f}°"
    if topic == "est/diag":
        return f"status {msg['status']}  step p99 {msg['step_us'].get('p99', 0):.0f} µs"
    return ""


def run(args: argparse.Namespace) -> int:
    rig = load_rig(args.config)
    endpoints = args.endpoint or rig.sensor_endpoints() + [rig.bus.estimator]
    views: dict[str, TopicView] = {}
    tty = sys.stdout.isatty()
    start = last_draw = time.monotonic()
    with bus.Subscriber(endpoints, topics=args.topic) as sub:
        try:
            while args.duration is None or time.monotonic() - start < args.duration:
                got = sub.recv(timeout_s=0.05)
                if got is not None:
                    topic, payload, t_recv = got
                    v = views.setdefault(topic, TopicView())
                    v.count += 1
                    v.times.append(t_recv)
                    try:
                        msg = schema.decode(topic, payload)
                        v.latest = summary(topic, msg)
                        lat = (t_recv - msg["t"]) * 1e3
                        v.latency_ms = lat if abs(lat) < 60e3 else math.nan  # t is not host time (simulation)
                    except schema.SchemaError:
                        v.invalid += 1
                now = time.monotonic()
                if now - last_draw >= 0.25:
                    last_draw = now
                    _draw(views, tty, sub.malformed)
        except KeyboardInterrupt:
            pass
    _draw(views, False, sub.malformed)
    return 0


def _draw(views: dict[str, TopicView], tty: bool, malformed: int) -> None:
    now = time.time()
    lines = [f"{'topic':20s} {'count':>8s} {'rate Hz':>8s} {'latency ms':>10s} {'invalid':>7s}  latest"]
    for topic in sorted(views):
        v = views[topic]
        v.times = [t for t in v.times if now - t <= 1.0]
        lines.append(f"{topic:20s} {v.count:8d} {len(v.times):8d} {v.latency_ms:10.1f} {v.invalid:7d}  {v.latest}")
    if malformed:
        lines.append(f"malformed multipart messages: {malformed}")
    text = "\n".join(lines)
    if tty:
        sys.stdout.write("\x1b[H\x1b[2J" + text + "\n")
    else:
        sys.stdout.write(text + "\n\n")
    sys.stdout.flush()

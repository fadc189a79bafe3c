"""``rigstate watch``: live terminal view of bus topics (rate, count, latency, latest values).

Per topic: messages received, rate over the last second (Hz, by receive time), latency
``t_recv - t`` (ms; shown only when the message time ``t`` is host time, i.e. within 60 s of the
receive time — simulated streams start at t = 0), invalid payloads (failed ``schema.decode``) and
the latest values.  ``est/state`` / ``truth/state`` show each DOF by its name in the rig's
mechanism (° for angles, m for translations).  The latest ``est/diag`` is shown as a sub-table: per
estimator input its rate, received, dropped, malformed and lost counts, then the step time p50/p99
and the status.  Text from the network (topic names, map keys, strings) is shown with control
characters escaped.  Redrawn about 4 times a second; on a terminal the screen is cleared (ANSI),
otherwise plain tables are appended (pipes, logs).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TextIO

from estimator_service import bus, schema
from estimator_service.angles import counts_to_angle
from estimator_service.commands.record import recorder_endpoints
from estimator_service.dofs import Dof, dofs_of
from estimator_service.errors import UserError
from estimator_service.names import printable
from estimator_service.paths import default_rig
from estimator_service.rig import load_rig
from estimator_service.signals import stop_on_signals

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
    p.add_argument("--config", help="rig TOML: endpoints and DOF names (default: the shipped testbed)")
    p.add_argument("--endpoint", action="append", metavar="ENDPOINT",
                   help="connect here instead (repeatable); DOFs are then named only with --config")
    p.add_argument("--duration", type=float, help="exit after this many seconds (default: until Ctrl-C; 1 with --once)")
    p.add_argument("--once", action="store_true", help="collect for --duration, print one table, exit")
    p.set_defaults(func=run)


def _deg(rad: float) -> str:
    return f"{math.degrees(rad) % 360:7.2f}°"


#: est/diag ``inputs`` columns: (key in the map, heading)
DIAG_COLUMNS = (("rate_hz", "rate Hz"), ("received", "received"), ("dropped", "dropped"),
                ("malformed", "malformed"), ("lost", "lost"))


def _text(v: object, width: int | None = None) -> str:
    """A value from the network as safe terminal text: numbers formatted, control characters escaped."""
    if isinstance(v, float):
        out = f"{v:.1f}"
    elif isinstance(v, (int, str)) and not isinstance(v, bool):
        out = printable(str(v))
    else:
        out = printable(repr(v))
    return out if width is None else out[:width]


def _state(msg: dict, dofs: list[Dof] | None) -> str:
    """z, ż of a state message: by DOF name with units when the DOFs are known and match."""
    if dofs and len(msg["z"]) == len(dofs):
        return "  ".join(f"{d.name} {d.fmt_value(msg['z'][d.index])} rate {msg['zd'][d.index]:+8.3f} {d.rate_unit}"
                         for d in dofs)
    if "crank" in msg:
        return f"crank {_deg(msg['crank'])}  rate {msg.get('crank_rate', math.nan):+8.3f} rad/s"
    return "z " + " ".join(f"{v:+.4f}" for v in msg["z"])


def _step_us(step: dict) -> str:
    """p50 and p99 of an est/diag ``step_us`` map."""
    return "  ".join(f"{k} {step[k]:.0f}" if isinstance(step.get(k), (int, float)) else f"{k} -"
                     for k in ("p50", "p99"))


def summary(topic: str, msg: dict, dofs: list[Dof] | None = None) -> str:
    """A compact line of the interesting values of a decoded message (``dofs``: the rig's, if known)."""
    if topic in ("est/state", "truth/state"):
        flags = [_text(f) for f in schema.state_flags(msg)]
        return _state(msg, dofs) + (f"  [{', '.join(flags)}]" if flags else "")
    if topic.startswith("imu/"):
        return ("gyr " + " ".join(f"{v:+7.3f}" for v in msg["gyr"]) + " rad/s  acc "
                + " ".join(f"{v:+6.2f}" for v in msg["acc"]) + " m/s²")
    if topic.startswith("enc/"):
        angle = msg["angle"] if "angle" in msg else counts_to_angle(msg["count"], msg["cpr"])
        return f"count {msg['count']:>10d}  angle {_deg(angle)}"
    if topic == "est/diag":
        return f"{_text(msg['status'], 12)}  step µs {_step_us(msg['step_us'])}  ({len(msg['inputs'])} inputs, below)"
    return ""


def diag_table(msg: dict) -> list[str]:
    """The latest est/diag as lines: one row per input, then step time and status."""
    head = f"  | {'est/diag input':20s}" + "".join(f" {h:>9s}" for _, h in DIAG_COLUMNS)
    lines = [head]
    for name in sorted(msg["inputs"]):
        row = msg["inputs"][name]
        cells = [_text(row.get(k, "-") if isinstance(row, dict) else "-", 9) for k, _ in DIAG_COLUMNS]
        lines.append(f"  | {_text(name, 20):20s}" + "".join(f" {c:>9s}" for c in cells))
    lines.append(f"  | step µs {_step_us(msg['step_us'])}  status {_text(msg['status'], 20)}")
    return lines


class Watch:
    """Accumulates messages and renders the table."""

    def __init__(self, dofs: list[Dof] | None = None) -> None:
        self.views: dict[str, TopicView] = {}
        self.dofs = dofs
        self.diag: dict | None = None  #: the latest valid est/diag message

    def add(self, topic: str, payload: bytes, t_recv: float) -> None:
        v = self.views.setdefault(topic, TopicView())
        v.count += 1
        v.recent.append(t_recv)
        try:
            msg = schema.decode(topic, payload)
        except schema.SchemaError:
            v.invalid += 1
            return
        v.latest = printable(summary(topic, msg, self.dofs))  # est/diag strings come from the network
        if topic == "est/diag":
            self.diag = msg
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
        if self.diag is not None:
            lines += diag_table(self.diag)
        lines.append(f"malformed multipart messages dropped: {malformed}")
        return "\n".join(lines)


def _draw(out: TextIO, text: str, tty: bool) -> None:
    out.write(("\x1b[H\x1b[2J" + text + "\n") if tty else (text + "\n\n"))
    out.flush()


def run(args: argparse.Namespace) -> int:
    duration = args.duration if args.duration is not None else (1.0 if args.once else None)
    if duration is not None and duration <= 0:
        raise UserError(f"--duration: must be > 0 s, got {duration}")
    rig = load_rig(args.config or default_rig())  # endpoints (unless --endpoint), bus authentication
    endpoints = args.endpoint or recorder_endpoints(rig)
    with stop_on_signals() as stop:
        tty = sys.stdout.isatty() and not args.once
        watch = Watch(dofs_of(rig.model) if args.config or not args.endpoint else None)
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

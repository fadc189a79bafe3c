"""``rigstate replay``: publish the sensor messages of a log again, with their original timing.

Publishes ``imu/*``, ``enc/*``, ``act/*`` and ``truth/*`` (not ``est/*``: the live estimator makes those anew)
with the exact recorded payload bytes, message ``i`` at ``(t_recv[i] - t_recv[0]) / speed`` s
after the start, so the live estimator sees what it saw when the log was recorded.

No loss: the publisher runs with ``nodrop`` (see :mod:`estimator_service.bus`): when a subscriber's
queue (``--hwm`` messages) is full the message is retried until it fits, so a subscriber slower
than the replay slows the replay down instead of losing data (the summary reports the lag).
``--as-fast-as-possible`` skips the pacing and is throttled by the slowest subscriber only.
Recorded time is checked, never trusted: the schedule advances by each record's step of ``t_recv``,
but by nothing when a record goes back in time and by at most ``--max-gap-s`` (10 s) when it jumps
ahead, so one absurd stamp (t = 1e9 in an imported table) or a long pause costs at most that much
wait; every record is still published, in log order (the summary counts the shortened gaps).
Before the first message it waits up to ``--wait-s`` for ``--subscribers`` subscriptions to a
replayed topic (ZeroMQ drops messages sent before a subscription arrives); at the end it waits
until the queued messages have left (at most 10 s).
"""

from __future__ import annotations

import argparse
import logging
import threading
import time
from collections.abc import Iterable

import zmq

from estimator_service import bus
from estimator_service.errors import UserError
from estimator_service.logfile import Record, read_log
from estimator_service.names import check_topic
from estimator_service.offline import rig_of_log
from estimator_service.signals import stop_on_signals

log = logging.getLogger(__name__)

REPLAYED = ("imu/", "enc/", "act/", "truth/")
MAX_GAP_S = 10.0  #: longest wait between two records (recorded time, s; --max-gap-s)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "replay", help="publish a log's sensor messages again with the original timing",
        description="Replay imu/*, enc/*, act/* and truth/* of LOG on the bus (exact bytes, recorded timing scaled by "
        "--speed) so the live estimator runs on them unchanged. Nothing is dropped: a slow subscriber slows "
        "the replay down.")
    p.add_argument("log", help="rigstate log (rigstate record / simulate)")
    speed = p.add_mutually_exclusive_group()
    speed.add_argument("--speed", type=float, default=1.0, help="time scale (default 1 = as recorded; 10 = ten times faster)")
    speed.add_argument("--as-fast-as-possible", action="store_true", help="no pacing; only subscribers throttle")
    p.add_argument("--endpoint", help="bind here (default: the [bus] sim endpoint of the rig)")
    p.add_argument("--config", help="rig TOML whose [bus] sim endpoint and [bus.auth] to use "
                   "(default: the rig in the log header)")
    p.add_argument("--topics", nargs="+", metavar="PREFIX", default=list(REPLAYED),
                   help=f"topic prefixes to replay (default {' '.join(REPLAYED)})")
    p.add_argument("--wait-s", type=float, default=2.0,
                   help="wait at most this long for subscribers before starting (default 2)")
    p.add_argument("--subscribers", type=int, default=1,
                   help="start as soon as this many subscriptions cover a replayed topic (default 1)")
    p.add_argument("--hwm", type=int, default=10000, help="per-subscriber queue, messages (default 10000)")
    p.add_argument("--max-gap-s", type=float, default=MAX_GAP_S,
                   help=f"wait at most this long (recorded time) between two records; a larger step of the "
                   f"recorded time, such as an absurd stamp, is shortened to it (default {MAX_GAP_S:g})")
    p.set_defaults(func=run)


def _bus(args: argparse.Namespace, header: dict) -> tuple[str, bus.CurveAuth | None]:
    """(endpoint, auth) to publish with: --endpoint / --config, else the rig in the log header."""
    try:
        rig = rig_of_log(header, args.log, args.config)
    except UserError as exc:
        if args.endpoint and not args.config:  # a log without (a valid) rig: plain bus
            return args.endpoint, None
        raise UserError(f"{exc} (or give --endpoint)") from None
    return args.endpoint or rig.bus.sim, rig.bus.auth


def replay(pub: bus.Publisher, records: Iterable[Record], speed: float | None, stop: threading.Event,
           max_gap_s: float = MAX_GAP_S) -> tuple[float, int]:
    """Publish ``records`` (streamed) paced on ``t_recv / speed`` (None: unpaced), retrying at the HWM.

    The schedule advances by each step of ``t_recv`` clipped to [0, ``max_gap_s``] (a stamp that goes
    back costs no wait, one far ahead at most ``max_gap_s``). Returns (the largest lag behind the
    schedule in s, the number of steps shortened); stops early when ``stop`` is set.
    """
    lag, shortened = 0.0, 0
    prev: float | None = None
    sched = 0.0  # recorded time elapsed on the schedule (s)
    start = time.monotonic()
    for rec in records:
        if prev is None:
            start = time.monotonic()
        else:
            step = rec.t_recv - prev
            if not step <= max_gap_s:  # NaN counts as too far
                shortened += 1
                step = max_gap_s
            sched += max(step, 0.0)
        prev = rec.t_recv
        if speed is not None:
            due = start + sched / speed
            delay = due - time.monotonic()
            if delay > 0 and stop.wait(delay):
                return lag, shortened
            lag = max(lag, -delay)
        while not pub.publish_raw(rec.topic, rec.payload):
            if stop.wait(0.0005):
                return lag, shortened
        if stop.is_set():
            return lag, shortened
    return lag, shortened


def run(args: argparse.Namespace) -> int:
    if not args.as_fast_as_possible and not args.speed > 0:
        raise UserError(f"--speed: must be > 0, got {args.speed}")
    if not args.max_gap_s > 0:
        raise UserError(f"--max-gap-s: must be > 0, got {args.max_gap_s}")
    if args.hwm < 1 or args.subscribers < 1:
        raise UserError(f"--hwm and --subscribers: must be >= 1, got {args.hwm}, {args.subscribers}")
    reader = read_log(args.log)
    prefixes = tuple(args.topics)

    def wanted(r: Record) -> bool:
        return r.topic.startswith(prefixes) and check_topic(r.topic)

    n, t_first, t_last, seen = 0, 0.0, 0.0, set()  # one pass for the summary; records are streamed
    for r in reader:
        if wanted(r):
            t_first, t_last = (r.t_recv if n == 0 else t_first), r.t_recv
            n += 1
            seen.add(r.topic)
    endpoint, auth = _bus(args, reader.header)
    topics = sorted(seen)
    with stop_on_signals() as stop:
        ctx = zmq.Context()
        try:
            pub = bus.Publisher(endpoint, hwm=args.hwm, nodrop=True, context=ctx, auth=auth)
        except BaseException:
            ctx.term()
            raise
        try:
            if not pub.wait_for_subscribers(topics, args.subscribers, args.wait_s, stop) and not stop.is_set():
                log.warning("no subscriber for %s after %.1f s on %s: replaying anyway",
                            ", ".join(topics) or "-", args.wait_s, endpoint)
            t_start = time.monotonic()
            lag, shortened = replay(pub, (r for r in reader if wanted(r)),
                                    None if args.as_fast_as_possible else args.speed, stop, args.max_gap_s)
            elapsed = time.monotonic() - t_start
        finally:
            pub.close(linger_s=0.5 if stop.is_set() else 10.0)
            ctx.term()  # returns once the queued messages have left (or the linger expired)
        span = t_last - t_first
        pace = "as fast as possible" if args.as_fast_as_possible else f"speed {args.speed:g}, max lag {lag * 1e3:.1f} ms"
        if shortened:
            pace += f"; {shortened} step(s) of recorded time beyond {args.max_gap_s:g} s shortened to it"
        print(f"replayed {pub.sent} of {n} messages ({', '.join(topics) or 'none'}) from {args.log} "
              f"on {endpoint}: {span:.2f} s of log in {elapsed:.2f} s ({pace}); {pub.dropped} retries at the HWM")
        return 0 if pub.sent == n or stop.is_set() else 1

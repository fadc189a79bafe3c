"""Simulated sensor source: the simulator's streams published on the bus in (scaled) real time.

Same schema as the hardware drivers; publishes every sensor topic of the rig plus ``truth/state``
on one endpoint (the rig's ``[bus] sim`` by default).  Pacing follows sensor time against a
monotonic clock, ``--speed`` times faster; ``--speed 0`` publishes as fast as possible.
"""

from __future__ import annotations

import argparse
import logging
import signal
import threading
import time

from estimator_service.bus import Publisher
from estimator_service.paths import default_rig
from estimator_service.rig import load_rig
from estimator_service.sdnotify import Notifier
from estimator_service.simulate import simulate

log = logging.getLogger(__name__)


def register(driver_sub: argparse._SubParsersAction) -> None:
    p = driver_sub.add_parser(
        "sim",
        help="publish simulated sensor streams (and truth/state) of a rig in real time",
        description="Runs the simulator for the rig and publishes imu/*, enc/* and truth/state on the "
        "rig's [bus] sim endpoint, paced on sensor time.",
    )
    p.add_argument("--config", default=str(default_rig()), help="rig TOML (default: the shipped testbed)")
    p.add_argument("--speed", type=float, default=1.0, help="time scale (2 = twice real time, 0 = no pacing)")
    p.add_argument("--duration", type=float, help="seconds of sensor time (default: the rig's duration_s)")
    p.add_argument("--seed", type=int, help="noise seed (default: the rig's)")
    p.add_argument("--endpoint", help="publish here instead of the rig's [bus] sim endpoint")
    p.add_argument("--emulate", action="store_true",
                   help="serve the sensors through device emulators on pseudo-terminals and run the real "
                   "Xsens and encoder drivers on them (publishing on the rig's per-sensor endpoints)")
    p.add_argument("--wait", type=float, default=2.0,
                   help="seconds to wait for a first subscriber before starting (default 2; 0 = don't)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    rig = load_rig(args.config)
    endpoint = args.endpoint or rig.bus.sim
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    notifier = Notifier()
    duration = rig.simulation.duration_s if args.duration is None else args.duration
    if args.emulate:
        from drivers.emulate import run_emulated

        return run_emulated(rig, duration, args.seed, endpoint, stop, notifier)
    with Publisher(endpoint, hwm=100000) as pub:
        log.info("driver sim: %s, %.1f s at speed %g on %s", rig.name, duration, args.speed, endpoint)
        notifier.ready()
        if args.wait > 0 and not pub.wait_for_subscribers(timeout_s=args.wait):
            log.info("driver sim: no subscriber after %.1f s; publishing anyway", args.wait)
        start = time.monotonic()
        n = 0
        for topic, msg in simulate(rig=rig, duration=duration, seed=args.seed):
            if stop.is_set():
                break
            if args.speed > 0:
                delay = start + msg["t"] / args.speed - time.monotonic()
                if delay > 0 and stop.wait(delay):
                    break
            pub.publish(topic, msg)
            n += 1
            if notifier.maybe_watchdog():
                notifier.status(f"t = {msg['t']:.1f} s, {n} messages published")
        notifier.stopping()
        log.info("driver sim: published %d messages", n)
    return 0

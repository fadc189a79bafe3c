"""Simulated sensor source: the simulator's streams as bus messages, published in (scaled) real time.

- :class:`SimSource` runs the simulator (``estimator_service.simulate``) for a rig and yields
  ``(topic, msg)`` in time order: every sensor topic of the rig plus ``truth/state``, same schema as
  the hardware drivers.  A background thread integrates ahead of the consumer (a bounded queue,
  ``lookahead`` messages), so pacing does not stall while the next 1 s segment is integrated (the
  20 s public scenario takes about 4 s to simulate, ~5× faster than real time on the lab PC; at
  ``--speed`` above that the source falls behind and publishes as fast as it is computed).
  ``driver sim --precompute`` simulates the whole run before publishing (startup delay ≈ duration / 5).
- :class:`SimRecording` holds a whole run in memory; :func:`imu_sample_fn` and
  :func:`encoder_angle_fn` turn it into sample-and-hold value sources for device emulators.
- ``rigstate driver sim`` publishes a :class:`SimSource` on the rig's ``[bus] sim`` endpoint, paced on
  sensor time against the monotonic clock, ``--speed`` times faster (``--speed 0``: no pacing).
"""

from __future__ import annotations

import argparse
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator

import numpy as np

from estimator_service.bus import Publisher
from estimator_service.errors import UserError
from estimator_service.paths import default_rig
from estimator_service.rig import Rig, load_rig
from estimator_service.sdnotify import Notifier
from estimator_service.simulate import simulate
from estimator_service.signals import stop_on_signals

log = logging.getLogger(__name__)

_END = object()  # end of the producer thread's stream


class SimSource:
    """The simulated run of ``rig`` as an iterable of ``(topic, msg)`` in time order (t in s from 0).

    ``duration`` (s) and ``seed`` default to the rig's ``[simulation]``.  Iterating runs a producer
    thread at most ``lookahead`` messages ahead of the consumer; :meth:`messages` computes in the
    calling thread.  Iterating twice simulates twice (same seed, same messages).
    """

    def __init__(self, rig: Rig, duration: float | None = None, seed: int | None = None,
                 lookahead: int = 20000) -> None:
        self.rig, self.lookahead = rig, lookahead
        self.duration = rig.simulation.duration_s if duration is None else duration
        self.seed = rig.simulation.seed if seed is None else seed

    def messages(self) -> Iterator[tuple[str, dict]]:
        """The simulator's messages, computed in this thread."""
        return simulate(rig=self.rig, duration=self.duration, seed=self.seed)

    def __iter__(self) -> Iterator[tuple[str, dict]]:
        q: queue.Queue = queue.Queue(maxsize=self.lookahead)
        stop = threading.Event()

        def put(item: object) -> bool:
            """Queue ``item`` unless the consumer has gone (then False)."""
            while not stop.is_set():
                try:
                    q.put(item, timeout=0.1)
                    return True
                except queue.Full:
                    continue
            return False

        def produce() -> None:
            try:
                for item in self.messages():
                    if not put(item):
                        return
                put(_END)
            except BaseException as exc:  # handed to the consumer, raised there
                put(exc)

        thread = threading.Thread(target=produce, name="sim-producer", daemon=True)
        thread.start()
        try:
            while (item := q.get()) is not _END:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            stop.set()
            thread.join()


class SimRecording:
    """A whole simulated run in memory: messages in time order and per-topic sample tables."""

    def __init__(self, messages: list[tuple[str, dict]]) -> None:
        self.messages = messages
        by_topic: dict[str, list[dict]] = {}
        for topic, msg in messages:
            by_topic.setdefault(topic, []).append(msg)
        self.samples = by_topic
        self.times = {topic: np.array([m["t"] for m in msgs]) for topic, msgs in by_topic.items()}
        self._tables: dict[tuple[str, tuple[str, ...]], np.ndarray] = {}

    @classmethod
    def run(cls, rig: Rig, duration: float | None = None, seed: int | None = None) -> SimRecording:
        """Simulate ``rig`` (see :class:`SimSource`) and keep every message."""
        return cls(list(SimSource(rig, duration, seed).messages()))

    def at(self, topic: str, t: float, fields: tuple[str, ...]) -> np.ndarray:
        """The ``fields`` of ``topic`` (concatenated) at time t (s), linearly interpolated between the
        samples around t: device emulators sample at their own instants, not the simulator's."""
        key = (topic, fields)
        table = self._tables.get(key)
        if table is None:
            self.latest(topic, 0.0)  # unknown topic: a clear error
            table = np.array([np.concatenate([np.atleast_1d(m[f]) for f in fields]) for m in self.samples[topic]])
            self._tables[key] = table
        ts = self.times[topic]
        if len(ts) == 1:
            return table[0]
        i = int(np.clip(np.searchsorted(ts, t) - 1, 0, len(ts) - 2))
        a = float(np.clip((t - ts[i]) / (ts[i + 1] - ts[i]), 0.0, 1.0))
        return (1 - a) * table[i] + a * table[i + 1]

    def latest(self, topic: str, t: float) -> dict:
        """The last message of ``topic`` at or before time t (s); the first one before it starts."""
        if topic not in self.samples:
            raise UserError(f"the simulation has no topic {topic!r}; it has {sorted(self.samples)}")
        i = max(0, int(np.searchsorted(self.times[topic], t, side="right")) - 1)
        return self.samples[topic][i]


def imu_sample_fn(rec: SimRecording, imu_name: str) -> Callable[[float], tuple[list[float], list[float], list[float]]]:
    """``source(t) -> (gyr [rad/s] ×3, acc [m/s²] ×3, quat [w,x,y,z])`` of IMU ``imu_name``, interpolated,
    t in s since the start of the run (the Xsens emulator's ``source``)."""
    topic = f"imu/{imu_name}"
    rec.latest(topic, 0.0)  # unknown name: error now, not in the emulator thread

    def source(t: float) -> tuple[list[float], list[float], list[float]]:
        v = rec.at(topic, t, ("gyr", "acc", "quat")).tolist()
        return v[0:3], v[3:6], v[6:10]

    return source


def encoder_angle_fn(rec: SimRecording, encoder_name: str) -> Callable[[float], float]:
    """``angle(t)`` (rad) of encoder ``encoder_name``, interpolated between its samples."""
    topic = f"enc/{encoder_name}"
    rec.latest(topic, 0.0)
    return lambda t: float(rec.at(topic, t, ("angle",))[0])


def publish_paced(source: Iterable[tuple[str, dict]], pub: Publisher, speed: float,
                  stop: threading.Event, notifier: Notifier | None = None) -> int:
    """Publish ``(topic, msg)`` items when the monotonic clock reaches ``msg["t"] / speed`` after the
    start (``speed`` 0: at once); returns the number published.  Stops early when ``stop`` is set."""
    start = time.monotonic()
    n = 0
    for topic, msg in source:
        if stop.is_set():
            break
        if speed > 0:
            delay = start + msg["t"] / speed - time.monotonic()
            if delay > 0 and stop.wait(delay):
                break
        pub.publish(topic, msg)
        n += 1
        if notifier is not None and notifier.maybe_watchdog():
            notifier.status(f"t = {msg['t']:.1f} s, {n} messages published")
    return n


def register(driver_sub: argparse._SubParsersAction) -> None:
    p = driver_sub.add_parser(
        "sim",
        help="publish simulated sensor streams (and truth/state) of a rig in real time",
        description="Runs the simulator for the rig and publishes imu/*, enc/*, act/* and truth/state on the "
        "rig's [bus] sim endpoint, paced on sensor time.",
    )
    p.add_argument("--config", default=str(default_rig()), help="rig TOML (default: the shipped testbed)")
    p.add_argument("--speed", type=float, default=1.0, help="time scale (2 = twice real time, 0 = no pacing)")
    p.add_argument("--duration", type=float, help="seconds of sensor time (default: the rig's duration_s)")
    p.add_argument("--seed", type=int, help="noise seed (default: the rig's)")
    p.add_argument("--endpoint", help="publish here instead of the rig's [bus] sim endpoint")
    p.add_argument("--precompute", action="store_true",
                   help="simulate the whole run before publishing (default: simulate ahead in a thread)")
    p.add_argument("--emulate", action="store_true",
                   help="serve the sensors through device emulators on pseudo-terminals and run the real "
                   "Xsens and encoder drivers on them (publishing on the rig's per-sensor endpoints)")
    p.add_argument("--wait", type=float, default=2.0,
                   help="seconds to wait for a subscriber of the sensor topics (e.g. the estimator) before publishing "
                   "(default 2; 0 = don't)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.speed < 0:
        raise UserError(f"--speed must be >= 0, got {args.speed}")
    if args.duration is not None and args.duration <= 0:
        raise UserError(f"--duration must be > 0, got {args.duration}")
    rig = load_rig(args.config)
    endpoint = args.endpoint or rig.bus.sim
    with stop_on_signals() as stop:
        notifier = Notifier()
        source = SimSource(rig, args.duration, args.seed)
        if args.emulate:
            from drivers.emulate import run_emulated

            return run_emulated(rig, source.duration, args.seed, endpoint, stop, notifier)
        items: Iterable[tuple[str, dict]] = source
        if args.precompute:
            log.info("driver sim: simulating %.1f s of %s first", source.duration, rig.name)
            items = list(source.messages())
        with Publisher(endpoint, hwm=100000, auth=rig.bus.auth) as pub:
            log.info("driver sim: %s, %.1f s at speed %g on %s", rig.name, source.duration, args.speed, endpoint)
            notifier.ready()
            sensors = rig.all_sensor_topics()
            if args.wait > 0 and not pub.wait_for_subscribers(sensors, timeout_s=args.wait, stop=stop) and not stop.is_set():
                log.info("driver sim: no subscriber of %s after %.1f s; publishing anyway", ", ".join(sensors), args.wait)
            n = publish_paced(items, pub, args.speed, stop, notifier)
            notifier.stopping()
            log.info("driver sim: published %d messages", n)
        return 0

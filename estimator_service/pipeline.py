"""Bus messages in, ``est/state`` messages out: the one code path of the daemon and ``rigstate estimate``.

Pure: no sockets, no clocks of its own (the daemon passes the monotonic wall clock with each
message; offline there is none).  Sensor time drives everything, and it is checked:

* The *sensor clock* is the newest accepted message time.  A message more than ``max_ahead_s``
  ahead of it (live: plus the wall time since the clock last moved) is ``future``; one more than
  ``max_behind_s`` behind it is ``past``: both are counted and dropped, so one message moves the
  clock by at most ``max_ahead_s`` + the wall time elapsed.
* Such messages are kept (a few bounded clusters of nearby times): when ``reset_messages`` of them
  from more than half of the topics that speak (at least two; one if only one speaks; a topic
  speaks while it sent one of the last ``SPEAKING_WINDOW`` messages) agree on a new time while
  nothing arrives at the current one, every source has jumped together (a new replay, a rig
  restart, a long gap): the estimator *resets* — re-initialises at the new time (status
  ``reinit``, est/diag ``info.resets``, a log line).  A source that lags (a starved driver
  delivering its backlog) or lies cannot reset the others.  The estimator initialises the same
  way, so a first message with an absurd time cannot set the clock.  Live, a jump of more than ``stale_after_s`` that the wall clock
  confirms is a reset too (the rig was silent): nothing is predicted across a gap.
* ``seq``: equal or older with no newer ``t`` is a duplicate (dropped); older with a newer ``t``, or a
  jump far beyond what the nominal rate allows, is a source restart (counted; not counted as lost).
* A sensor message at time t belongs to the 1 ms step whose interval (t_{k-1}, t_k] contains it.
  The backend is stepped up to the time every active fused topic has reached (each topic's newest
  sample plus its period less half a step: its next sample still falls in a step not yet taken; a
  topic silent for ``history_s`` no longer holds it back, a drive controller's ``act`` topic silent for its
  ``max_age_s`` neither), so data that arrives in the wrong order
  across topics is still used in order.  Live, the sensor clock runs on with the wall clock up to
  those holds: the steps between two samples of a slow topic are published as their time passes.  A measurement older than
  the backend's time but newer than :meth:`Backend.earliest_time` is used at its own time (filter
  re-run, smoother window); older ones are ``late`` (counted, dropped), and so is an ``act`` message more
  than its drive's ``max_age_s`` behind the sensor clock (a stale command is not used).
* Every exception from decoding, measuring, initialising or stepping is caught, counted per topic
  and kind (est/diag ``inputs.<topic>.errors``) and logged at a rate limit; a failed step
  re-initialises the backend.
* Memory is bounded: step times in a fixed ring plus a fixed histogram; no per-message lists.
"""

from __future__ import annotations

import bisect
import logging
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from estimator_service import schema
from estimator_service.backends import make_backend
from estimator_service.backends.base import Backend, Estimate, Measurement
from estimator_service.backends.init import Initializer
from estimator_service.model import Model
from estimator_service.rig import EstimatorConfig, Rig

log = logging.getLogger(__name__)

#: at most this many clusters of out-of-range messages are kept (each ``reset_messages`` long)
MAX_CLUSTERS = 4
#: a topic *speaks* while it sent one of the last this many messages: a reset needs more than half
#: of the speaking topics (at least two) to agree on the new time
SPEAKING_WINDOW = 2000
#: :meth:`Pipeline.feed_streams` reads each publisher's queue this many messages at a time
MERGE_CHUNK = 256
#: ... and looks again at the streams it holds nothing of every this many messages fed
MERGE_LOOK = 16


def should_log(count: int) -> bool:
    """Rate limit for repeated warnings: the 1st, 2nd, 3rd, then every power of ten."""
    return count <= 3 or (count >= 10 and 10 ** round(math.log10(count)) == count)


@dataclass
class TopicStats:
    """Counters of one input topic (all since start)."""

    received: int = 0  #: valid messages accepted
    malformed: int = 0  #: undecodable or invalid payloads (dropped)
    duplicate: int = 0  #: seq equal to or older than the last one, time not newer (dropped)
    late: int = 0  #: older than the backend can use at its own time (dropped)
    future: int = 0  #: too far ahead of the sensor clock (dropped)
    past: int = 0  #: too far behind the sensor clock (dropped)
    restarts: int = 0  #: seq went back (time forward) or jumped implausibly far: the source restarted
    lost: int = 0  #: gaps in seq (messages that never arrived)
    errors: dict[str, int] = field(default_factory=dict)  #: exceptions by kind (measure, init, step)
    last_seq: int | None = None
    last_t: float | None = None
    interval: float | None = None  #: spacing of the last two accepted samples (s, sensor time)
    first_t: float | None = None  #: first accepted time since the start or the last reset
    span_n: int = 0  #: messages accepted since ``first_t``

    def rate_hz(self) -> float:
        """Mean message rate over the topic's sensor-time span (since the last reset)."""
        if self.span_n < 2 or self.first_t is None or self.last_t is None or self.last_t <= self.first_t:
            return 0.0
        return (self.span_n - 1) / (self.last_t - self.first_t)


class LogHistogram:
    """Fixed-memory distribution of positive values (µs): count, sum, maximum and log-spaced bins
    (1.2 % wide), so percentiles are within 1.2 % however long the run."""

    EDGES_US = np.logspace(-2, 8, 2001)  #: bin edges (µs)
    _EDGES = EDGES_US.tolist()  #: the same as plain floats: bisect on a list is quicker per value than searchsorted

    def __init__(self) -> None:
        self._hist = [0] * (len(self.EDGES_US) + 1)
        self._sum_us, self._max_us = 0.0, 0.0

    @property
    def count(self) -> int:
        return sum(self._hist)

    def add(self, us: float, weight: int = 1) -> None:
        """Count ``us`` (µs) ``weight`` times."""
        self._hist[bisect.bisect_left(self._EDGES, us)] += weight
        self._sum_us += us * weight
        if us > self._max_us:
            self._max_us = us

    def summary_us(self) -> dict[str, float]:
        """mean, p50, p99, max (µs; percentiles ±1.2 %); zeros when empty."""
        n = self.count
        if n == 0:
            return {"mean": 0.0, "p50": 0.0, "p99": 0.0, "max": 0.0}
        cum = np.cumsum(self._hist)
        mids = np.concatenate([[self.EDGES_US[0]], np.sqrt(self.EDGES_US[1:] * self.EDGES_US[:-1]), [self.EDGES_US[-1]]])

        def pct(p: float) -> float:
            return float(min(mids[int(np.searchsorted(cum, p / 100 * n))], self._max_us))

        return {"mean": self._sum_us / n, "p50": pct(50), "p99": pct(99), "max": self._max_us}


class StepTimes:
    """Processing time of each 1 ms backend step (including the measurements added before it).

    Fixed memory: the last ``keep`` steps in a ring (est/diag), and for the whole run a
    :class:`LogHistogram` of the time per 1 ms of data — a smoother that updates every ``chunk`` steps
    has each chunk's time spread over its steps (``rigstate bench``).
    """

    def __init__(self, keep: int = 10000, chunk: int = 1) -> None:
        self._ring = [0.0] * keep
        self.count = 0  #: steps recorded
        self.chunk = max(1, chunk)
        self._chunk_sum, self._chunk_n = 0.0, 0
        self._per_ms = LogHistogram()

    def add(self, seconds: float) -> None:
        self._ring[self.count % len(self._ring)] = seconds
        self.count += 1
        self._chunk_sum += seconds
        self._chunk_n += 1
        if self._chunk_n == self.chunk:
            self._per_ms.add(self._chunk_sum / self.chunk * 1e6, self.chunk)
            self._chunk_sum, self._chunk_n = 0.0, 0

    def recent(self) -> np.ndarray:
        """The last (up to ``keep``) step times, s, in no particular order."""
        return np.array(self._ring[: min(self.count, len(self._ring))])

    def summary_us(self) -> dict[str, float]:
        """mean, p50, p99, max of the time per 1 ms of data over the run (µs; percentiles ±1.2 %)."""
        return self._per_ms.summary_us()


@dataclass
class _Cluster:
    """Out-of-range messages that agree on a time (candidates for a reset)."""

    t_last: float
    msgs: list[tuple[str, dict]]
    topics: set[str]
    touched: int


class Pipeline:
    """Decode, check and route sensor messages into a backend; emit ``est/state`` dicts.

    ``backend_name`` overrides the rig's ``[estimator] backend``.  ``tick``, if set, is called every
    20 steps of a catch-up; returning False interrupts it (the daemon's stop request and watchdog);
    it may publish :meth:`take_output` so a long catch-up streams its estimates.  Time-discipline settings come from the rig's ``[estimator]`` (docs/config.md).
    ``backend_factory(model, sensors, config)``, if given, builds the backend instead of the registry
    (estimator_service/bound.py passes its truth-linearised filter).
    """

    def __init__(self, rig: Rig, backend_name: str | None = None, reorder_s: float = 0.0,
                 clock: Callable[[], float] = time.perf_counter,
                 backend_factory: Callable[[Model, list, EstimatorConfig], Backend] | None = None) -> None:
        self.rig = rig
        self.model = rig.model
        cfg = rig.estimator
        self.cfg = cfg
        self.backend_name = backend_name or cfg.backend
        self.sensors = rig.virtual_sensors(self.model)
        self.backend = (backend_factory(self.model, self.sensors, cfg) if backend_factory is not None
                        else make_backend(self.backend_name, self.model, self.sensors, cfg))
        self.dt = self.backend.dt
        self._clock = clock
        self.tick: Callable[[], bool] | None = None
        self._outbox: list[dict] = []  #: estimates completed during the current call
        self.topics: dict[str, list[int]] = {}
        for i, s in enumerate(self.sensors):
            self.topics.setdefault(rig.topic_of(s), []).append(i)
        self.input_topics = sorted(set(self.topics) | set(rig.all_sensor_topics()))
        #: nominal message rate of each input topic (Hz), from the rig
        self.nominal_hz = {f"imu/{s.name}": s.rate_hz for s in rig.imus}
        self.nominal_hz.update({f"enc/{e.name}": e.rate_hz for e in rig.encoders})
        self.nominal_hz.update({d.topic: d.rate_hz for d in rig.drives if d.measured})
        self.stats: dict[str, TopicStats] = {t: TopicStats() for t in self.input_topics}
        #: per drive controller's topic, the age (s) beyond which its messages are stale (sensors.DriveSignal)
        self._max_age = {d.topic: d.max_age_s for d in rig.drives if d.measured}
        #: each fused topic's counters, nominal sampling period (s) and the silence (s) after which it no longer
        #: holds the backend back, for :meth:`_hold`
        self._fused = [(self.stats[t], 1.0 / self.nominal_hz.get(t, 1000.0),
                        min(cfg.history_s, self._max_age.get(t, math.inf))) for t in self.topics]
        chunk = int(getattr(getattr(self.backend, "params", None), "chunk_steps", 1))
        self.times = StepTimes(chunk=chunk)
        self.initializer = Initializer(self.model, rig, self.sensors)
        self._last_q: np.ndarray | None = None  #: q of the last estimate: where a re-initialisation resumes
        self.initialized = False
        self.seq = 0
        self.resets = 0  #: resets (all sources jumped in time together)
        self.last_reset = ""  #: why the last reset happened
        self.steps = 0  #: backend steps taken
        self._carry_s = 0.0
        self._crank = self.model.dof_names.index("crank") if "crank" in self.model.dof_names else None
        #: per topic, stamp minus true sampling time (s): a message stamped t measures the rig at t - offset
        self.time_offsets = rig.time_offsets()
        #: what the watermark stays below the sensor time it allows (s): the IMUs' largest stamp lag
        #: (a message stamped t measures the rig at t - offset) and ``reorder_s``
        self._lag_s = max([0.0, *self.time_offsets.values()]) + reorder_s
        self._clock_t: float | None = None  #: the sensor clock (s): newest accepted message time
        self._clock_wall: float | None = None  #: wall time (monotonic s) when it last moved
        self._last_input_wall: float | None = None
        self._clusters: list[_Cluster] = []
        self._touch = 0
        self._fed = 0  #: validated messages fed so far
        #: per topic, the value of ``_fed`` when it last sent a validated message (in range or not)
        self._heard: dict[str, int] = {}
        #: per publisher stream, messages read and not yet fed ``(t, topic, msg)`` (:meth:`feed_streams`)
        self._heads: list[deque[tuple[float, str, dict]]] = []

    # ------------------------------------------------------------------ input
    def feed_raw(self, topic: str, payload: bytes, wall: float | None = None) -> list[dict]:
        """Decode a payload from the bus or a log and feed it; malformed payloads are counted, dropped.

        ``wall``: monotonic wall-clock time of reception (s), live only.
        """
        msg = self._decode(topic, payload)
        return [] if msg is None else self.feed(topic, msg, wall)

    def feed_streams(self, streams: list[Callable[[], tuple[str, bytes, float] | None]],
                     wall: float | None = None, max_n: int = 10000) -> list[dict]:
        """Feed what the publishers have queued, merged by sensor time; returns the ``est/state``
        messages now complete.

        ``streams``: one callable per publisher returning its next queued ``(topic, payload, ...)``
        without waiting, or None (:attr:`bus.EndpointStreams.takers`).  Each publisher sends in its
        own time order; across publishers, a reader that fell behind holds seconds of one's backlog
        and fresh messages of another (ZeroMQ serves one socket's publishers in turn), so they are
        merged: the message fed next is the oldest head of the streams that hold one.  Each stream
        is read ``MERGE_CHUNK`` messages at a time (a chunk is sorted by ``t``, stable) once the
        previous chunk is fed; a stream that had nothing queued is looked at again every
        ``MERGE_LOOK`` messages (a catch-up call runs for seconds: seen, IMUs 2–5 s behind the
        encoders when it was not).  Messages read and not yet fed wait for the next call, at most
        ``MERGE_CHUNK`` per stream.  At most ``max_n`` messages are fed per call; ``tick`` is
        called after a message that completed estimates (the live daemon publishes them then, not after
        the rest of the queue) and every 200, returning False ends the call.
        """
        while len(self._heads) < len(streams):
            self._heads.append(deque())
        heads = self._heads[:len(streams)]

        def refill(i: int) -> None:
            chunk = []
            while len(chunk) < MERGE_CHUNK and (got := streams[i]()) is not None:
                if (msg := self._decode(got[0], got[1])) is not None:
                    chunk.append((float(msg["t"]), got[0], msg))
            chunk.sort(key=lambda c: c[0])
            heads[i].extend(chunk)

        for n in range(max_n):
            if n % MERGE_LOOK == 0:  # a stream that was empty may have received since
                for i, h in enumerate(heads):
                    if not h:
                        refill(i)
            held = [i for i, h in enumerate(heads) if h]
            if not held:
                break
            i = min(held, key=lambda i: heads[i][0][0])
            _t, topic, msg = heads[i].popleft()
            done = self.feed(topic, msg, wall)  # (feed replaces the outbox: call it first)
            self._outbox.extend(done)
            # estimates go out as soon as a step completes them, before the rest of what is queued is fed
            if self.tick is not None and (done or n % 200 == 199) and not self.tick():
                break
            if not heads[i]:
                refill(i)
        return self.take_output()

    @property
    def holds_input(self) -> bool:
        """Messages read by :meth:`feed_streams` wait to be fed."""
        return any(self._heads)

    def _decode(self, topic: str, payload: bytes) -> dict | None:
        """The validated message, or None for a topic this rig does not use or a malformed payload (counted)."""
        st = self.stats.get(topic)
        if st is None:
            return None
        try:
            return schema.decode(topic, payload)
        except schema.SchemaError as exc:
            st.malformed += 1
            if should_log(st.malformed):
                log.warning("dropped malformed %s message (%d so far): %s", topic, st.malformed, exc)
            return None

    def feed(self, topic: str, msg: dict, wall: float | None = None) -> list[dict]:
        """Feed one validated sensor message; returns the ``est/state`` messages now complete.

        Never raises for anything the message carries: failures are counted in ``stats[topic].errors``.
        """
        try:
            return self._feed(topic, msg, wall)
        except Exception as exc:  # the last line of defence: nothing a message carries stops the loop
            self._error(topic, "internal", exc)
            return []

    def _error(self, topic: str, kind: str, exc: BaseException) -> None:
        st = self.stats[topic]
        n = st.errors[kind] = st.errors.get(kind, 0) + 1
        if should_log(n):
            log.warning("%s: %s error (%d so far): %s: %s", topic, kind, n, type(exc).__name__, exc)

    def _drop(self, topic: str, kind: str, t: float) -> None:
        st = self.stats[topic]
        n = getattr(st, kind) + 1
        setattr(st, kind, n)
        if should_log(n):
            log.warning("%s: dropped a %s message (%d so far): t = %.6g s, sensor clock %.6g s",
                        topic, kind, n, t, self._clock_t if self._clock_t is not None else float("nan"))

    def _feed(self, topic: str, msg: dict, wall: float | None) -> list[dict]:
        t = float(msg["t"])
        self._fed += 1
        self._heard[topic] = self._fed
        if self._clock_t is None:
            return self._offer_cluster(topic, msg, wall)  # not started: wait for agreement
        ahead = t - self._clock_t
        allowed = self.cfg.max_ahead_s
        if wall is not None and self._clock_wall is not None:
            allowed += max(0.0, wall - self._clock_wall)
        if ahead > allowed or ahead < -self.cfg.max_behind_s:
            self._drop(topic, "future" if ahead > 0 else "past", t)
            return self._offer_cluster(topic, msg, wall)
        self._clusters.clear()  # the current time is alive: no reset
        if ahead > self.cfg.stale_after_s:  # live, after a silence the wall clock confirms
            self._reset(f"sensor time jumped {ahead:.3f} s ahead after a silence", t, wall)
        return self._accept(topic, msg, t, wall)

    def _offer_cluster(self, topic: str, msg: dict, wall: float | None) -> list[dict]:
        """Keep an out-of-range message; reset (or start) once enough sources agree on its time."""
        t = float(msg["t"])
        self._touch += 1
        c = next((c for c in self._clusters if abs(t - c.t_last) <= self.cfg.max_ahead_s), None)
        if c is None:
            if len(self._clusters) >= MAX_CLUSTERS:
                self._clusters.remove(min(self._clusters, key=lambda c: c.touched))
            c = _Cluster(t, [], set(), self._touch)
            self._clusters.append(c)
        c.t_last, c.touched = max(c.t_last, t), self._touch
        c.msgs.append((topic, msg))
        c.topics.add(topic)
        speaking = {tp for tp, n in self._heard.items() if self._fed - n < SPEAKING_WINDOW}
        # more than half (so at least two when two or more speak)
        if len(c.msgs) < self.cfg.reset_messages or 2 * len(c.topics & speaking) <= len(speaking):
            if len(c.msgs) > self.cfg.reset_messages:
                c.msgs.pop(0)
            return []
        self._clusters.clear()
        t0 = min(float(m["t"]) for _, m in c.msgs)
        if self._clock_t is not None:
            self._reset(f"every source jumped from t = {self._clock_t:.3f} s to t = {t0:.3f} s "
                        f"({len(c.msgs)} messages from {len(c.topics)} topics agree)", t0, wall)
        else:
            log.info("sensor clock starts at t = %.6g s (%d messages from %d topics agree)", t0, len(c.msgs), len(c.topics))
        self._clock_t, self._clock_wall = t0, wall
        out: list[dict] = []
        for tp, m in c.msgs:
            out += self.feed(tp, m, wall)
        return out

    def _reset(self, why: str, t: float, wall: float | None) -> None:
        """Start again at sensor time ``t``: the backend re-initialises from the next messages."""
        self.resets += 1
        self.last_reset = why
        log.warning("reset %d: %s; re-initialising", self.resets, why)
        self.initialized = False
        # forward (a silence: the rig moved on) resumes where it is; back in time (a new replay, a rig
        # restart) is a new run from the configured start
        forward = self._clock_t is not None and t > self._clock_t
        self.initializer = Initializer(self.model, self.rig, self.sensors, resume=self._last_q if forward else None)
        for st in self.stats.values():
            st.last_seq = st.last_t = st.first_t = st.interval = None
            st.span_n = 0
        self._clock_t, self._clock_wall = t, wall

    def _accept(self, topic: str, msg: dict, t: float, wall: float | None) -> list[dict]:
        st = self.stats[topic]
        seq = int(msg["seq"])
        if st.last_seq is not None and st.last_t is not None:
            if seq <= st.last_seq and t <= st.last_t:
                self._drop(topic, "duplicate", t)
                return []
            gap = seq - st.last_seq - 1
            expected = max(0.0, t - st.last_t) * self.nominal_hz.get(topic, 1000.0)
            if gap < 0 or gap > 10 + 2 * expected:
                st.restarts += 1
                if should_log(st.restarts):
                    log.warning("%s: source restarted (seq %d after %d; %d restarts)", topic, seq, st.last_seq, st.restarts)
            else:
                st.lost += gap
        if st.last_t is not None and t > st.last_t:
            st.interval = t - st.last_t
        st.last_seq, st.last_t = seq, t
        st.received += 1
        st.span_n += 1
        st.first_t = t if st.first_t is None else st.first_t
        if t > self._clock_t:
            self._clock_t, self._clock_wall = t, wall
        if wall is not None:
            self._last_input_wall = wall
        if not self.initialized:
            try:
                start = self.initializer.offer(topic, msg)
                if start is None:
                    return []
                t0, q, qd = start
                self.backend.initialize(t0, q, qd)
                if self.resets:
                    self.backend.mark_reinit(self.last_reset)
            except Exception as exc:
                self._error(topic, "init", exc)
                return []
            self.initialized = True
        # IMU stamps lag the true sampling instant by the rig's time_offset_s: a message stamped t
        # measures the rig at t - offset, so the backend waits for the largest lag
        out = self.advance_to(self.watermark(wall), topic)
        if not self.initialized:
            return out
        t -= self.time_offsets.get(topic, 0.0)
        if self._clock_t - t > self._max_age.get(topic, math.inf):  # a stale command: not used
            self._drop(topic, "late", t)
            return out
        try:
            ms = [Measurement(t, i, self.sensors[i].measure(msg)) for i in self.topics.get(topic, ())]
        except Exception as exc:  # passes the schema, not the rig (another cpr, no quat, ...)
            self._error(topic, "measure", exc)
            return out
        if not ms:  # a topic the backend does not fuse (counted and clocked only)
            return out
        if t < self.backend.t - 1e-12 and t <= self.backend.earliest_time():
            self._drop(topic, "late", t)
            return out
        c0 = self._clock()
        for m in ms:
            self.backend.add_measurement(m)
        self._carry_s += self._clock() - c0
        return out

    def _hold(self) -> float:
        """Sensor time (s) no fused topic that spoke within ``history_s`` (an act topic: its drive's
        ``max_age_s``, if shorter) holds the backend back from: each one's newest sample plus its period
        (nominal, or the last spacing if shorter) less half a step, so that its next sample still falls in a
        step not yet taken (never ``late``) and the steps before it are taken without waiting for it; at least
        half a period.  +inf when no fused topic spoke lately."""
        hold = math.inf
        clock = self._clock_t
        half_step = 0.5 * self.dt
        for st, period, silent in self._fused:  # (comparisons rather than min/max: this runs per message)
            last_t = st.last_t
            if last_t is not None and last_t >= clock - silent:
                if st.interval is not None and st.interval < period:
                    period = st.interval
                ahead = 0.5 * period
                if period - half_step > ahead:
                    ahead = period - half_step
                if last_t + ahead < hold:
                    hold = last_t + ahead
        return hold

    def watermark(self, wall: float | None = None) -> float:
        """Sensor time (s) the backend may step to: the sensor clock, held back by each fused topic
        (:meth:`_hold`).  Live (``wall``: monotonic s), the clock runs on with the wall time since it
        last moved, up to the holds: the steps between two samples of the slowest fused topic are
        taken as their time passes instead of when the next sample arrives (the same estimates,
        causal either way, published sooner).  Nothing runs on when no fused topic spoke lately."""
        if self._clock_t is None:
            return -math.inf
        hold = self._hold()
        now = self._clock_t
        if wall is not None and self._clock_wall is not None and hold < math.inf:
            now += max(0.0, wall - self._clock_wall)
        return min(now, hold) - self._lag_s

    def next_step_in(self, wall: float) -> float | None:
        """Wall seconds (≥ 0) until the next step that emits estimates (:meth:`Backend.steps_to_output`)
        is due by the clock running on (:meth:`watermark`), or None when it cannot be due before new
        input arrives (the live loop's wait timeout)."""
        if not self.initialized or self._clock_t is None or self._clock_wall is None:
            return None
        # that step is due once the watermark passes its end
        end = self.backend.t + self.backend.steps_to_output() * self.dt + self._lag_s
        if self._hold() <= end + 1e-9:
            return None
        return max(0.0, self._clock_wall + (end - self._clock_t) - wall)

    def advance(self, wall: float) -> list[dict]:
        """Live, without new input: take the steps the wall clock made due (:meth:`watermark`)."""
        return self.advance_to(self.watermark(wall))

    def take_output(self) -> list[dict]:
        """The estimates completed so far and not yet returned (``tick`` callers publish them early)."""
        out, self._outbox = self._outbox, []
        return out

    def advance_to(self, t: float, topic: str | None = None) -> list[dict]:
        """Step the backend while the next step ends before ``t`` (s); return the estimates emitted
        (and any :meth:`take_output` has not taken yet).

        A step that raises is counted (``errors.step`` of ``topic``) and the backend re-initialises
        from the next messages.  ``tick`` returning False interrupts a long catch-up.
        """
        if not self.initialized:
            return self.take_output()
        n = 0
        while self.backend.t + self.dt < t - 1e-9:
            c0 = self._clock()
            try:
                ests = self.backend.step()
            except Exception as exc:
                self._error(topic or self.input_topics[0], "step", exc)
                self.initialized = False
                self.initializer = Initializer(self.model, self.rig, self.sensors, resume=self._last_q)
                return self.take_output()
            # time of measurement handling is charged to the step that follows it
            self.times.add(self._clock() - c0 + self._carry_s)
            self._carry_s = 0.0
            self.steps += 1
            self._outbox.extend(self.to_message(e) for e in ests)
            if ests:
                self._last_q = ests[-1].q
            n += 1
            if self.tick is not None and n % 20 == 0 and not self.tick():
                break
        return self.take_output()

    # ------------------------------------------------------------------ output
    def to_message(self, e: Estimate) -> dict:
        """``est/state`` dict of an Estimate (schema in estimator_service/schema.py)."""
        msg = {
            "t": float(e.t),
            "seq": self.seq,
            "q": e.q.tolist(),
            "qd": e.qd.tolist(),
            "z": e.z.tolist(),
            "zd": e.zd.tolist(),
            "backend": self.backend_name,
            "status": e.status,
            "latency_s": float(self.backend.output_latency_s),
        }
        if self._crank is not None:
            msg["crank"] = float(e.z[self._crank])
            msg["crank_rate"] = float(e.zd[self._crank])
        if e.P_z is not None:  # covariance of (z, ż), row-major (every backend): the report's 1σ band
            msg["P_z"] = e.P_z.ravel().tolist()
        for key in ("quality", "bias", "time_offset_s", "mount_deg", "model"):
            value = getattr(e, key)
            if value is not None:
                msg[key] = value
        self.seq += 1
        return msg

    def stale(self, wall: float | None) -> bool:
        """True when no input was accepted for ``stale_after_s`` of wall time (live only)."""
        return wall is not None and self._last_input_wall is not None and \
            wall - self._last_input_wall > self.cfg.stale_after_s

    def status(self, wall: float | None = None) -> str:
        """``init``, ``stale`` (live: no input for ``stale_after_s``) or the backend's status."""
        if not self.initialized:
            return "init"
        return "stale" if self.stale(wall) else self.backend.status

    def diag(self, t: float, wall: float | None = None) -> dict:
        """``est/diag`` dict: per-input counters and rates, step-time statistics (µs), status, resets."""
        secs = self.times.recent() * 1e6
        step_us = {"mean": 0.0, "p50": 0.0, "p99": 0.0, "max": 0.0}
        if secs.size:
            step_us = {"mean": float(secs.mean()), "p50": float(np.percentile(secs, 50)),
                       "p99": float(np.percentile(secs, 99)), "max": float(secs.max())}
        inputs = {
            topic: {"rate_hz": st.rate_hz(), "received": st.received, "dropped": st.duplicate,
                    "malformed": st.malformed, "lost": st.lost, "late": st.late, "future": st.future,
                    "past": st.past, "restarts": st.restarts, "errors": dict(st.errors)}
            for topic, st in self.stats.items()
        }
        info = {"resets": self.resets, "last_reset": self.last_reset, "steps": self.steps}
        diagnostics = getattr(self.backend, "diagnostics", None)
        if self.initialized and diagnostics is not None:
            info.update(diagnostics())  # consistency (NIS) statistics, biases, time offsets
        return {"t": float(t), "seq": self.seq, "status": self.status(wall), "inputs": inputs, "step_us": step_us,
                "info": info}

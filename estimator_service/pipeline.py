"""Bus messages in, ``est/state`` messages out: the one code path of the daemon and ``rigstate estimate``.

Pure: no sockets, no clocks.  Sensor time drives everything.  A sensor message at time t belongs
to the 1 ms step whose interval (t_{k-1}, t_k] contains it; the backend is stepped up to the last
step that can no longer receive data (messages of one topic arrive in time order; topics are
interleaved by the bus, see ``reorder_s``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np

from estimator_service import schema
from estimator_service.backends import make_backend
from estimator_service.backends.base import Estimate, Measurement
from estimator_service.backends.init import Initializer
from estimator_service.rig import Rig

log = logging.getLogger(__name__)


@dataclass
class TopicStats:
    """Counters of one input topic (all since start)."""

    received: int = 0  #: valid messages used
    malformed: int = 0  #: undecodable or invalid payloads (dropped)
    duplicate: int = 0  #: seq equal to or older than the last one (dropped)
    late: int = 0  #: valid but older than the estimator's time (used at the current step)
    lost: int = 0  #: gaps in seq (messages that never arrived)
    last_seq: int | None = None
    last_t: float | None = None
    first_t: float | None = None

    def rate_hz(self) -> float:
        """Mean message rate over the topic's sensor-time span."""
        if self.received < 2 or self.first_t is None or self.last_t is None or self.last_t <= self.first_t:
            return 0.0
        return (self.received - 1) / (self.last_t - self.first_t)


@dataclass
class StepTimes:
    """Processing time (s) of each 1 ms backend step, including the measurements added before it."""

    seconds: list[float] = field(default_factory=list)


class Pipeline:
    """Decode, check and route sensor messages into a backend; emit ``est/state`` dicts.

    ``backend_name`` overrides the rig's ``[estimator] backend``.  ``degraded_after_s`` is the
    sensor-time silence after which estimates are flagged ``degraded``.
    """

    def __init__(self, rig: Rig, backend_name: str | None = None, reorder_s: float = 0.0,
                 clock=time.perf_counter) -> None:
        self.rig = rig
        self.model = rig.model
        self.backend_name = backend_name or rig.estimator.backend
        self.sensors = rig.virtual_sensors(self.model)
        self.backend = make_backend(self.backend_name, self.model, self.sensors, rig.estimator)
        self.dt = self.backend.dt
        self.reorder_s = reorder_s
        self._clock = clock
        self.topics: dict[str, list[int]] = {}
        for i, s in enumerate(self.sensors):
            self.topics.setdefault(rig.topic_of(s), []).append(i)
        self.input_topics = sorted(set(self.topics) | set(rig.all_sensor_topics()))
        self.stats: dict[str, TopicStats] = {t: TopicStats() for t in self.input_topics}
        self.times = StepTimes()
        self.initializer = Initializer(self.model, rig, self.sensors)
        self.initialized = False
        self.seq = 0
        self._carry_s = 0.0
        self._crank = self.model.dof_names.index("crank") if "crank" in self.model.dof_names else None

    # ------------------------------------------------------------------ input
    def feed_raw(self, topic: str, payload: bytes) -> list[dict]:
        """Decode a payload from the bus or a log and feed it; malformed payloads are counted, dropped."""
        st = self.stats.get(topic)
        if st is None:
            return []  # a topic this rig does not use
        try:
            msg = schema.decode(topic, payload)
        except schema.SchemaError as exc:
            st.malformed += 1
            if st.malformed <= 3 or st.malformed % 1000 == 0:
                log.warning("dropped malformed %s message (%d so far): %s", topic, st.malformed, exc)
            return []
        return self.feed(topic, msg)

    def feed(self, topic: str, msg: dict) -> list[dict]:
        """Feed one validated sensor message; returns the ``est/state`` messages now complete."""
        st = self.stats[topic]
        seq = int(msg["seq"])
        if st.last_seq is not None:
            if seq <= st.last_seq:
                st.duplicate += 1
                return []
            st.lost += seq - st.last_seq - 1
        st.last_seq = seq
        st.received += 1
        t = float(msg["t"])
        st.first_t = t if st.first_t is None else st.first_t
        st.last_t = t
        if not self.initialized:
            start = self.initializer.offer(topic, msg)
            if start is None:
                return []
            t0, q, qd = start
            self.backend.initialize(t0, q, qd)
            self.initialized = True
        out = self.advance_to(t - self.reorder_s)
        if t < self.backend.t - 1e-9:
            st.late += 1
            t = self.backend.t
        c0 = self._clock()
        for i in self.topics.get(topic, ()):
            y = self.sensors[i].measure(msg)
            self.backend.add_measurement(Measurement(t, i, y))
        self._carry_s += self._clock() - c0
        return out

    def advance_to(self, t: float) -> list[dict]:
        """Step the backend while the next step ends before ``t`` (s); return the estimates emitted."""
        if not self.initialized:
            return []
        out: list[dict] = []
        while self.backend.t + self.dt < t - 1e-9:
            c0 = self._clock()
            ests = self.backend.step()
            # time of measurement handling is charged to the step that follows it
            self.times.seconds.append(self._clock() - c0 + self._carry_s)
            self._carry_s = 0.0
            out.extend(self.to_message(e) for e in ests)
        return out

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
        for key in ("quality", "bias", "time_offset_s"):
            if getattr(e, key) is not None:
                msg[key] = getattr(e, key)
        self.seq += 1
        return msg

    def diag(self, t: float) -> dict:
        """``est/diag`` dict: per-input counters and rates, step-time statistics (µs), status."""
        secs = np.asarray(self.times.seconds[-10000:]) * 1e6
        step_us = {"mean": 0.0, "p50": 0.0, "p99": 0.0, "max": 0.0}
        if secs.size:
            step_us = {"mean": float(secs.mean()), "p50": float(np.percentile(secs, 50)),
                       "p99": float(np.percentile(secs, 99)), "max": float(secs.max())}
        inputs = {
            topic: {"rate_hz": st.rate_hz(), "received": st.received, "dropped": st.duplicate,
                    "malformed": st.malformed, "lost": st.lost}
            for topic, st in self.stats.items()
        }
        status = "init" if not self.initialized else self.backend.status
        out = {"t": float(t), "seq": self.seq, "status": status, "inputs": inputs, "step_us": step_us}
        info = getattr(self.backend, "diagnostics", None)
        if self.initialized and info is not None:
            out["info"] = info()  # consistency (NIS) statistics, biases, time offsets
        return out

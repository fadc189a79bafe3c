"""The estimator daemon: bus in, Pipeline, bus out.  Thin: sockets, clocks, signals, systemd.

Estimates are stepped on sensor time (the Pipeline); the wall clock is used only to keep publishing
predictions while every input is silent (flagged ``degraded``), for ``est/diag`` once a second, and
for the systemd watchdog.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from dataclasses import dataclass

from estimator_service import bus
from estimator_service.pipeline import Pipeline
from estimator_service.rig import Rig
from estimator_service.sdnotify import Notifier

log = logging.getLogger(__name__)


@dataclass
class DaemonOptions:
    """Run-time options of the daemon (command-line flags of ``rigstate estimator``)."""

    backend: str | None = None  #: override the rig's [estimator] backend
    silence_s: float = 0.1  #: wall-clock silence of all inputs after which predictions continue on their own
    diag_period_s: float = 1.0  #: est/diag period (wall clock)
    hwm: int = 1000  #: ZeroMQ high-water mark of the output socket (messages)
    duration_s: float | None = None  #: stop after this wall-clock time (tests, demo)
    sensor_endpoints: list[str] | None = None  #: subscribe here instead of the rig's sensor endpoints
    endpoint: str | None = None  #: publish here instead of the rig's [bus] estimator endpoint


class EstimatorDaemon:
    """Subscribe to the rig's sensor topics, run the Pipeline, publish ``est/state`` and ``est/diag``."""

    def __init__(self, rig: Rig, options: DaemonOptions | None = None) -> None:
        self.rig = rig
        self.opts = options or DaemonOptions()
        self.pipeline = Pipeline(rig, self.opts.backend)
        self.stop_event = threading.Event()
        self.notifier = Notifier()
        self.published = 0

    def request_stop(self, *_args: object) -> None:
        """Signal handler: ask the loop to finish (it exits within one receive timeout)."""
        self.stop_event.set()

    def run(self) -> int:
        """Main loop; returns the process exit code."""
        rig, opts, pipe = self.rig, self.opts, self.pipeline
        inputs = opts.sensor_endpoints or rig.sensor_endpoints()
        output = opts.endpoint or rig.bus.estimator
        with bus.Subscriber(inputs, topics=pipe.input_topics, auth=rig.bus.auth) as sub, \
                bus.Publisher(output, hwm=opts.hwm, auth=rig.bus.auth) as pub:
            log.info("estimator %s: backend %s, inputs %s from %s, publishing on %s",
                     rig.name, pipe.backend_name, ", ".join(pipe.input_topics), ", ".join(inputs), output)
            self.notifier.ready()
            self.notifier.status(f"waiting for sensor data ({', '.join(pipe.input_topics)})")
            start = last_diag = time.monotonic()
            last_input_wall = None
            last_input_t = None
            while not self.stop_event.is_set():
                now = time.monotonic()
                if opts.duration_s is not None and now - start >= opts.duration_s:
                    break
                got = sub.recv(timeout_s=0.02)
                now = time.monotonic()
                out: list[dict] = []
                if got is not None:
                    topic, payload, _t_recv = got
                    was_init = pipe.initialized
                    out = pipe.feed_raw(topic, payload)
                    st = pipe.stats.get(topic)
                    if st is not None and st.last_t is not None:
                        last_input_wall, last_input_t = now, st.last_t
                    if pipe.initialized and not was_init:
                        self.notifier.status(f"estimating ({pipe.backend_name})")
                elif last_input_wall is not None and now - last_input_wall > opts.silence_s:
                    # all inputs silent: keep predicting on a sensor clock extrapolated by the wall clock
                    out = pipe.advance_to(last_input_t + (now - last_input_wall))
                for msg in out:
                    if pub.publish("est/state", msg):
                        self.published += 1
                if now - last_diag >= opts.diag_period_s:
                    last_diag = now
                    t_diag = pipe.backend.t if pipe.initialized else 0.0
                    pub.publish("est/diag", pipe.diag(t_diag))
                    self.notifier.status(self._status_line())
                self.notifier.maybe_watchdog(now)
            self.notifier.stopping()
            log.info("estimator stopping: %s", self._status_line())
        return 0

    def _status_line(self) -> str:
        pipe = self.pipeline
        rates = ", ".join(f"{t} {s.rate_hz():.0f} Hz" for t, s in pipe.stats.items())
        bad = sum(s.malformed + s.duplicate for s in pipe.stats.values())
        status = pipe.backend.status if pipe.initialized else "init"
        return f"{status}; {self.published} estimates; inputs {rates}; dropped {bad}"


def run_daemon(rig: Rig, options: DaemonOptions) -> int:
    """Install SIGTERM/SIGINT handlers and run the daemon until stopped."""
    daemon = EstimatorDaemon(rig, options)
    signal.signal(signal.SIGTERM, daemon.request_stop)
    signal.signal(signal.SIGINT, daemon.request_stop)
    return daemon.run()

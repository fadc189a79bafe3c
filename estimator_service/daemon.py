"""The estimator daemon: bus in, Pipeline, bus out.  Thin: sockets, clocks, signals, systemd.

Estimates are stepped on sensor time (the Pipeline): between two samples of the slowest fused
topic, the steps whose sensor time has passed by the wall clock are taken when it passes
(:meth:`Pipeline.watermark`), never beyond what the next samples could still change.
The monotonic wall clock goes with each message into the Pipeline (its time checks and ``stale``),
paces ``est/diag`` (once a second) and the systemd watchdog.  The watchdog is pinged from this
loop, and from the Pipeline's catch-up loop through its ``tick`` hook, never from a side thread: a
loop that hangs stops the pings and systemd restarts the service.  ``tick`` also ends a long
catch-up when SIGTERM arrives, so the daemon stops within one receive timeout (20 ms) plus 20 steps.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

from estimator_service import bus, freeze_heap
from estimator_service.pipeline import Pipeline
from estimator_service.rig import Rig
from estimator_service.sdnotify import Notifier
from estimator_service.signals import stop_on_signals

log = logging.getLogger(__name__)

#: longest wait for input (s): the loop's stop, est/diag and watchdog latency
RECV_TIMEOUT_S = 0.02
#: above this busy share (:attr:`EstimatorDaemon.busy_share`) the loop no longer wakes for steps the
#: wall clock made due (Pipeline.next_step_in), only for input
EAGER_MAX_BUSY = 0.75


@dataclass
class DaemonOptions:
    """Run-time options of the daemon (command-line flags of ``rigstate estimator``)."""

    backend: str | None = None  #: override the rig's [estimator] backend
    diag_period_s: float = 1.0  #: est/diag period (wall clock)
    hwm: int = 1000  #: ZeroMQ high-water mark of the output socket (messages)
    #: input queue (messages, ~4.5 s of the public rig): bounds memory when the estimator falls behind
    input_hwm: int = 10000
    duration_s: float | None = None  #: stop after this wall-clock time (tests, demo)
    sensor_endpoints: list[str] | None = None  #: subscribe here instead of the rig's sensor endpoints
    endpoint: str | None = None  #: publish here instead of the rig's [bus] estimator endpoint


class EstimatorDaemon:
    """Subscribe to the rig's sensor topics, run the Pipeline, publish ``est/state`` and ``est/diag``."""

    def __init__(self, rig: Rig, options: DaemonOptions | None = None) -> None:
        self.rig = rig
        self.opts = options or DaemonOptions()
        self.pipeline = Pipeline(rig, self.opts.backend)
        self.pipeline.tick = self._tick
        self.stop_event = threading.Event()
        self.notifier = Notifier()
        self.published = 0
        #: share of the wall time the loop did not wait for input, over the last est/diag period
        self.busy_share = 0.0
        self._pub: bus.Publisher | None = None
        self._frozen = 0  #: objects moved out of the cyclic GC's reach at start-up (freeze_heap)

    def _tick(self) -> bool:
        """Called by the Pipeline during a catch-up: publish what is done, ping the watchdog; False
        once asked to stop."""
        self._publish(self.pipeline.take_output())
        self.notifier.maybe_watchdog(time.monotonic())
        return not self.stop_event.is_set()

    def _publish(self, msgs: list[dict]) -> None:
        for msg in msgs:
            if self._pub is not None and self._pub.publish("est/state", msg):
                self.published += 1

    def run(self) -> int:
        """Main loop; returns the process exit code."""
        rig, opts, pipe = self.rig, self.opts, self.pipeline
        inputs = opts.sensor_endpoints or rig.sensor_endpoints()
        output = opts.endpoint or rig.bus.estimator
        # after start-up, before subscribing: no full collection walks it inside a step, and the collection here
        # (0.1 s and more after a cold compile) does not hold up the first samples
        self._frozen = freeze_heap()
        with bus.EndpointStreams(inputs, topics=pipe.input_topics, hwm=opts.input_hwm, auth=rig.bus.auth) as sub, \
                bus.Publisher(output, hwm=opts.hwm, auth=rig.bus.auth) as pub:
            self._pub = pub
            log.info("estimator %s: backend %s, inputs %s from %s, publishing on %s",
                     rig.name, pipe.backend_name, ", ".join(pipe.input_topics), ", ".join(inputs), output)
            self.notifier.ready()
            self.notifier.status(f"waiting for sensor data ({', '.join(pipe.input_topics)})")
            start = last_diag = time.monotonic()
            waited = 0.0  # s spent waiting for input since last_diag
            was_stale = False
            while not self.stop_event.is_set():
                now = time.monotonic()
                if opts.duration_s is not None and now - start >= opts.duration_s:
                    break
                # wait for input, or until the wall clock makes the next step due (Pipeline.watermark);
                # a loop with little idle time left waits for input only: waking for single steps
                # would cost it the margin it lacks (measured: the ukf at 0.9 of a core fell behind)
                due = pipe.next_step_in(now) if self.busy_share < EAGER_MAX_BUSY else None
                w0 = time.monotonic()
                ready = sub.wait(0.0 if pipe.holds_input else RECV_TIMEOUT_S if due is None else min(due, RECV_TIMEOUT_S))
                now = time.monotonic()
                waited += now - w0
                out: list[dict] = []
                if ready or pipe.holds_input:
                    # what is queued, merged by sensor time, at most input_hwm messages: while the
                    # sockets are read their I/O thread refills them from the publishers' own backlogs,
                    # so an uncapped read of an estimator slower than real time grows without bound
                    # (measured: ukf RSS +217 kB/s)
                    was_init = pipe.initialized
                    out = pipe.feed_streams(sub.takers, now, max_n=opts.input_hwm)
                    if pipe.initialized and not was_init:
                        self.notifier.status(f"estimating ({pipe.backend_name})")
                # the wall clock read after feeding: a step its input made due (the sensor clock just
                # moved to a sample's time, and the step that ends there is due as soon as the wall
                # clock runs on past it) is taken now, not after another wait(0) (measured: half the
                # loop's wakes with the ekf on the public rig, 1.9k -> 1.1k wakes/s)
                out += pipe.advance(time.monotonic())
                self._publish(out)
                stale = pipe.stale(now)
                if stale != was_stale:
                    was_stale = stale
                    log.warning("inputs silent for %.1f s: stale" if stale else "inputs back after more than %.1f s of silence: estimating again",
                                pipe.cfg.stale_after_s)
                if now - last_diag >= opts.diag_period_s:
                    self.busy_share = 1.0 - waited / (now - last_diag)
                    waited = 0.0
                    last_diag = now
                    t_diag = pipe.backend.t if pipe.initialized else 0.0
                    diag = pipe.diag(t_diag, now)
                    diag["info"]["loop_busy"] = self.busy_share  # the real-time margin left: 1 - this
                    diag["info"]["gc_frozen"] = self._frozen
                    pub.publish("est/diag", diag)
                    self.notifier.status(self._status_line(now))
                self.notifier.maybe_watchdog(now)
            self.notifier.stopping()
            log.info("estimator stopping: %s", self._status_line(time.monotonic()))
        return 0

    def _status_line(self, now: float) -> str:
        pipe = self.pipeline
        rates = ", ".join(f"{t} {s.rate_hz():.0f} Hz" for t, s in pipe.stats.items())
        bad = sum(s.malformed + s.duplicate + s.late + s.future + s.past for s in pipe.stats.values())
        errors = sum(sum(s.errors.values()) for s in pipe.stats.values())
        resets = f"; {pipe.resets} resets (last: {pipe.last_reset})" if pipe.resets else ""
        return (f"{pipe.status(now)}; {self.published} estimates; loop busy {100 * self.busy_share:.0f} %; inputs {rates}; "
                f"dropped {bad}; errors {errors}{resets}")


def run_daemon(rig: Rig, options: DaemonOptions) -> int:
    """Install SIGTERM/SIGINT handlers and run the daemon until stopped."""
    daemon = EstimatorDaemon(rig, options)
    with stop_on_signals(daemon.stop_event):
        return daemon.run()

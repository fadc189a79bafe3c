"""``driver sim --emulate``: the simulated rig served through device emulators and the real drivers.

The simulation is computed first; then every IMU gets an Xsens emulator and the encoders a
counter-board emulator, each on a pseudo-terminal fed with the simulated values, and the real
drivers (``driver xsens``, ``driver encoder``) are started as child processes on those ports.  The
emulated rig holds its initial state until every driver publishes, then the simulated clock runs. They
publish on the rig's per-sensor endpoints exactly as with hardware; this process publishes
``truth/state`` on the sim endpoint, stamped on the same host clock as the drivers' messages
(t = start time + simulated time).  Every hardware path is thereby exercised without hardware.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from estimator_service.bus import Publisher, Subscriber
from estimator_service.rig import Rig
from estimator_service.sdnotify import Notifier
from drivers.sim import SimRecording, encoder_angle_fn, imu_sample_fn

log = logging.getLogger(__name__)


def _driver(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "estimator_service.cli", *args], stdin=subprocess.DEVNULL)


def _wait_for_drivers(rig: Rig, procs: list[subprocess.Popen], stop: threading.Event, timeout_s: float = 30.0) -> None:
    """Return once every IMU and encoder topic of the rig arrived from its driver (or after ``timeout_s``; a drive
    controller's act topic has no emulated device)."""
    missing = {t for t in rig.all_sensor_topics() if t.startswith(("imu/", "enc/"))}
    endpoints = [i.endpoint for i in rig.imus] + [e.endpoint for e in rig.encoders]
    end = time.monotonic() + timeout_s
    with Subscriber(list(dict.fromkeys(endpoints)), topics=["imu/", "enc/"], auth=rig.bus.auth) as sub:
        while missing and time.monotonic() < end and not stop.is_set() and all(p.poll() is None for p in procs):
            got = sub.recv(timeout_s=0.1)
            if got is not None:
                missing.discard(got[0])
    if missing:
        log.warning("driver sim --emulate: no data yet from %s; starting anyway", ", ".join(sorted(missing)))


def run_emulated(rig: Rig, duration: float, seed: int | None, endpoint: str, stop: threading.Event,
                 notifier: Notifier) -> int:
    """Run the emulated rig for ``duration`` s of real time; returns an exit code."""
    from drivers.emulators.counter_board import CounterBoardEmulator
    from drivers.emulators.xsens import XsensEmulator

    log.info("driver sim --emulate: simulating %.1f s of %s first", duration, rig.name)
    rec = SimRecording.run(rig, duration, seed)
    procs: list[subprocess.Popen] = []
    emulators: list = []
    with tempfile.TemporaryDirectory(prefix="rigstate-emulate-") as tmp, Publisher(endpoint, hwm=100000, auth=rig.bus.auth) as pub:
        clock: dict[str, float] = {}  # "start": monotonic time the simulated clock started

        def sim_time(t_mono: float) -> float:
            """Simulated time (s) at monotonic ``t_mono``: the emulated rig holds its initial state
            until the drivers run.  Emulators ask for the time of the sample they tick, not the time
            they get round to it, so values and device time stamps agree however late the thread runs."""
            return max(0.0, t_mono - clock["start"]) if "start" in clock else 0.0

        for imu in rig.imus:
            sample = imu_sample_fn(rec, imu.name)
            device: list[XsensEmulator] = []

            def source(t: float, sample=sample, device=device) -> tuple[list[float], list[float], list[float]]:
                return sample(sim_time(device[0].t0 + t))

            link = Path(tmp) / f"xsens-{imu.name}"
            device.append(XsensEmulator(link, rate_hz=imu.rate_hz, source=source))
            emulators.append(device[0].start())
            procs.append(_driver(["driver", "xsens", "--backend", "xbus", "--port", str(link), "--name", imu.name,
                                  "--rate", str(int(imu.rate_hz)), "--endpoint", imu.endpoint, "--config", rig.path]))
        if rig.encoders:
            link = Path(tmp) / "counterboard0"
            board: list[CounterBoardEmulator] = []
            angles = [lambda t, fn=encoder_angle_fn(rec, e.name): fn(sim_time(board[0].t0 + t)) for e in rig.encoders]  # noqa: B008 (bound per channel)
            board.append(CounterBoardEmulator(link, channels=len(rig.encoders), lines=[e.lines for e in rig.encoders],
                                              angles=angles, rate_hz=max(e.rate_hz for e in rig.encoders)))
            emulators.append(board[0].start())
            args = ["driver", "encoder", "--backend", "serial", "--port", str(link), "--config", rig.path]
            for i, e in enumerate(rig.encoders):
                args += ["--name", e.name, "--channel", str(i)]
            procs.append(_driver(args))
        notifier.ready()
        try:
            _wait_for_drivers(rig, procs, stop)
            clock["start"] = start = time.monotonic()
            epoch = time.time()
            for msg in rec.samples["truth/state"]:
                delay = start + msg["t"] - time.monotonic()
                if delay > 0 and stop.wait(delay):
                    break
                if any(p.poll() is not None for p in procs):
                    log.error("a driver exited early; stopping the emulation")
                    return 1
                pub.publish("truth/state", {**msg, "t": epoch + msg["t"]})
                notifier.maybe_watchdog()
        finally:
            for p in procs:
                p.terminate()
            for p in procs:
                try:
                    p.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    p.kill()
            for e in emulators:
                e.stop()
    return 0

"""``driver sim --emulate``: the simulated rig served through device emulators and the real drivers.

The simulation is computed first; then every IMU gets an Xsens emulator and the encoders a
counter-board emulator, each on a pseudo-terminal fed with the simulated values, and the real
drivers (``driver xsens``, ``driver encoder``) are started as child processes on those ports. They
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

import numpy as np

from estimator_service.bus import Publisher
from estimator_service.rig import Rig
from estimator_service.sdnotify import Notifier
from estimator_service.simulate import simulate

log = logging.getLogger(__name__)


class Recording:
    """The simulated run, sampled at 1 kHz: truth messages and per-sensor value tables."""

    def __init__(self, rig: Rig, duration: float, seed: int | None) -> None:
        self.truth: list[dict] = []
        samples: dict[str, list[tuple[float, list[float]]]] = {}
        for topic, msg in simulate(rig=rig, duration=duration, seed=seed):
            if topic == "truth/state":
                self.truth.append(msg)
            elif topic.startswith("imu/"):
                samples.setdefault(topic, []).append((msg["t"], msg["gyr"] + msg["acc"] + msg["quat"]))
            else:
                samples.setdefault(topic, []).append((msg["t"], [msg["angle"]]))
        self.t = {k: np.array([s[0] for s in v]) for k, v in samples.items()}
        self.values = {k: np.array([s[1] for s in v]) for k, v in samples.items()}

    def at(self, topic: str, t: float) -> np.ndarray:
        """The latest sample of ``topic`` at simulated time t (sample and hold, like a device)."""
        i = max(0, int(np.searchsorted(self.t[topic], t, side="right")) - 1)
        return self.values[topic][i]


def _driver(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "estimator_service.cli", *args], stdin=subprocess.DEVNULL)


def run_emulated(rig: Rig, duration: float, seed: int | None, endpoint: str, stop: threading.Event,
                 notifier: Notifier) -> int:
    """Run the emulated rig for ``duration`` s of real time; returns an exit code."""
    from drivers.emulators.counter_board import CounterBoardEmulator
    from drivers.emulators.xsens import XsensEmulator

    log.info("driver sim --emulate: simulating %.1f s of %s first", duration, rig.name)
    rec = Recording(rig, duration, seed)
    procs: list[subprocess.Popen] = []
    emulators: list = []
    with tempfile.TemporaryDirectory(prefix="rigstate-emulate-") as tmp, Publisher(endpoint, hwm=100000) as pub:
        start = time.monotonic()
        epoch = time.time()

        def now_sim() -> float:
            return time.monotonic() - start

        for imu in rig.imus:
            topic = f"imu/{imu.name}"

            def source(_t: float, topic: str = topic) -> tuple[list[float], list[float], list[float]]:
                v = rec.at(topic, now_sim())
                return list(v[0:3]), list(v[3:6]), list(v[6:10])

            link = Path(tmp) / f"xsens-{imu.name}"
            emulators.append(XsensEmulator(link, rate_hz=imu.rate_hz, source=source).start())
            procs.append(_driver(["driver", "xsens", "--port", str(link), "--name", imu.name,
                                  "--rate", str(int(imu.rate_hz)), "--endpoint", imu.endpoint]))
        if rig.encoders:
            link = Path(tmp) / "counterboard0"
            angles = [lambda _t, topic=f"enc/{e.name}": float(rec.at(topic, now_sim())[0]) for e in rig.encoders]
            emulators.append(CounterBoardEmulator(link, channels=len(rig.encoders), lines=[e.lines for e in rig.encoders],
                                                  angles=angles, rate_hz=max(e.rate_hz for e in rig.encoders)).start())
            args = ["driver", "encoder", "--backend", "serial", "--port", str(link), "--config", rig.path]
            for i, e in enumerate(rig.encoders):
                args += ["--name", e.name, "--channel", str(i)]
            procs.append(_driver(args))
        notifier.ready()
        try:
            for msg in rec.truth:
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

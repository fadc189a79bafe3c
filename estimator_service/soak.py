"""Soak test of the live pipeline (``rigstate bench --soak MINUTES``): memory growth and step times.

Runs the real processes on loopback: ``rigstate driver sim`` (the simulated rig, real time) into
``rigstate estimator`` (one backend), samples the estimator's resident memory (``VmRSS`` of
/proc/<pid>/status, Linux) once a second and listens to its ``est/diag``.  Reports the RSS slope
(kB/s, least squares over the samples after a warm-up of ``warmup_s``) and the step-time statistics
of the last est/diag (µs over the last 10 000 steps).  It also listens to the simulator's
``truth/state`` and reports the end-to-end latency of the pipeline: for each ``est/state`` at sensor
time t, its arrival here less that of ``truth/state`` at t (published by the simulator when t passes
on its clock, with the samples of t), beside the latency the backend declares (``latency_s``).
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from estimator_service import kernels, schema
from estimator_service.bus import Subscriber, free_port
from estimator_service.errors import UserError
from estimator_service.pipeline import LogHistogram


def rss_kb(pid: int) -> float:
    """Resident set size of process ``pid`` (kB), from /proc."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return float(line.split()[1])
    except OSError as exc:
        raise UserError(f"cannot read the memory of process {pid}: {exc.strerror} (soak needs Linux /proc)") from None
    raise UserError(f"/proc/{pid}/status has no VmRSS line")


def cpu_s(pid: int) -> float:
    """CPU time (user + system, s) process ``pid`` used so far, from /proc/<pid>/stat (Linux)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return math.nan
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _endpoint() -> str:
    return f"tcp://127.0.0.1:{free_port()}"


class TruthClock:
    """Arrival time (monotonic s) of each ``truth/state`` by its sensor time, for the few seconds an
    estimate of that time may still arrive (bounded)."""

    def __init__(self, keep_s: float = 5.0) -> None:
        self.keep_s = keep_s
        self._at: dict[int, float] = {}

    @staticmethod
    def key(t: float) -> int:
        return int(round(t * 1e6))

    def add(self, t: float, arrived: float) -> None:
        self._at[self.key(t)] = arrived
        if len(self._at) > 2 * self.keep_s * 1000:  # drop what no estimate will match any more
            cut = self.key(t - self.keep_s)
            self._at = {k: v for k, v in self._at.items() if k >= cut}

    def latency(self, t: float, arrived: float) -> float | None:
        """``arrived`` less the arrival of truth at t (s), or None if no truth at t was seen."""
        at = self._at.pop(self.key(t), None)
        return None if at is None else arrived - at


def slope_per_s(t: list[float], y: list[float]) -> float:
    """Least-squares slope dy/dt (units of y per s); 0 with fewer than two samples."""
    if len(t) < 2:
        return 0.0
    return float(np.polyfit(np.asarray(t) - t[0], np.asarray(y), 1)[0])


def soak(rig_path: str | Path, backend: str, minutes: float, warmup_s: float = 60.0, precompute: bool = False) -> dict:
    """Run the live pipeline for ``minutes`` with ``backend``; a JSON-ready report (see module docstring).
    ``precompute``: the simulator computes the whole run before it publishes (``driver sim
    --precompute``), so that its simulation does not compete with the estimator for the CPUs while
    it runs (a real rig's drivers only parse bytes): the latency benchmark (``bench --latency``)."""
    duration = minutes * 60.0
    sim_ep, est_ep = _endpoint(), _endpoint()
    cli = [sys.executable, "-m", "estimator_service.cli", "--log-level", "WARNING"]
    est = subprocess.Popen([*cli, "estimator", "--config", str(rig_path), "--backend", backend,
                            "--sensor-endpoint", sim_ep, "--endpoint", est_ep], stdin=subprocess.DEVNULL)
    drv = None
    samples_t: list[float] = []
    samples_kb: list[float] = []
    last_diag: dict | None = None
    n_state = 0
    statuses: dict[str, int] = {}
    latency, truth = LogHistogram(), TruthClock()  # latency in µs, memory independent of the run's length
    warm_s = min(warmup_s, duration / 2)
    declared: float | None = None
    try:
        with Subscriber([est_ep, sim_ep], topics=["est/", "truth/state"]) as sub:
            drv = subprocess.Popen([*cli, "driver", "sim", "--config", str(rig_path), "--endpoint", sim_ep,
                                    "--duration", f"{duration + (5 if precompute else 30):g}", *(["--precompute"] if precompute else [])],
                                   stdin=subprocess.DEVNULL)
            # the run starts with the simulator's first message (a precomputing one takes seconds)
            deadline = time.monotonic() + kernels.COLD_START_TIMEOUT_S
            while (got := sub.recv(timeout_s=0.1)) is None or got[0] != "truth/state":
                if time.monotonic() > deadline or est.poll() is not None or drv.poll() is not None:
                    raise UserError(f"the simulator published no truth/state within {kernels.COLD_START_TIMEOUT_S:g} s "
                                    "(or a process exited)")
            start = time.monotonic()
            next_sample = start
            cpu_start = cpu_start_at = None  # the estimator's CPU time when the warm-up ended
            while time.monotonic() - start < duration:
                if est.poll() is not None:
                    raise UserError(f"the estimator exited with code {est.returncode} during the soak")
                got = sub.recv(timeout_s=0.1)
                now = time.monotonic()
                if got is not None:
                    topic, payload, arrived = got
                    msg = schema.decode(topic, payload)
                    if topic == "truth/state":
                        truth.add(msg["t"], arrived)
                    elif topic == "est/diag":
                        last_diag = msg
                    else:
                        n_state += 1
                        statuses[msg["status"]] = statuses.get(msg["status"], 0) + 1
                        declared = msg["latency_s"]
                        lat = truth.latency(msg["t"], arrived)
                        if lat is not None and now - start >= warm_s:
                            latency.add(lat * 1e6)
                if cpu_start is None and now - start >= warm_s:
                    cpu_start, cpu_start_at = cpu_s(est.pid), now
                if now >= next_sample:
                    next_sample += 1.0
                    samples_t.append(now - start)
                    samples_kb.append(rss_kb(est.pid))
            cpu_share = None if cpu_start is None else (cpu_s(est.pid) - cpu_start) / (time.monotonic() - cpu_start_at)
    finally:
        for p in (drv, est):
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in (drv, est):
            if p is not None:
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
    warm = [i for i, t in enumerate(samples_t) if t >= warm_s]
    return {
        "backend": backend,
        "minutes": minutes,
        "rig": str(rig_path),
        "rss_kb_start": samples_kb[0] if samples_kb else None,
        "rss_kb_after_warmup": samples_kb[warm[0]] if warm else None,
        "rss_kb_end": samples_kb[-1] if samples_kb else None,
        "rss_slope_kb_per_s": slope_per_s([samples_t[i] for i in warm], [samples_kb[i] for i in warm]),
        "warmup_s": warm_s,
        "rss_kb_every_30_s": samples_kb[::30],
        "est_state_messages": n_state,
        "est_state_per_s": n_state / duration,  # 1000 = keeping up with the 1 kHz step rate
        "status_counts": statuses,
        # after the warm-up: est/state arrival less truth/state arrival at the same sensor time
        "latency_ms": {"count": latency.count, **{k: v / 1e3 for k, v in latency.summary_us().items() if k != "mean"}},
        "declared_latency_ms": None if declared is None else declared * 1e3,
        "estimator_cpu_share": cpu_share,  # CPU seconds per second after the warm-up (1 = one core)
        "precompute": precompute,
        "step_us_last_10000": last_diag["step_us"] if last_diag else None,
        "steps": (last_diag.get("info") or {}).get("steps") if last_diag else None,
        "estimator_pid": est.pid,
        "python": sys.version.split()[0],
        "cpus": os.cpu_count(),
    }

"""Soak test of the live pipeline (``rigstate bench --soak MINUTES``): memory growth and step times.

Runs the real processes on loopback: ``rigstate driver sim`` (the simulated rig, real time) into
``rigstate estimator`` (one backend), samples the estimator's resident memory (``VmRSS`` of
/proc/<pid>/status, Linux) once a second and listens to its ``est/diag``.  Reports the RSS slope
(kB/s, least squares over the samples after a warm-up of ``warmup_s``) and the step-time statistics
of the last est/diag (µs over the last 10 000 steps).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from estimator_service import schema
from estimator_service.bus import Subscriber
from estimator_service.errors import UserError


def rss_kb(pid: int) -> float:
    """Resident set size of process ``pid`` (kB), from /proc."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return float(line.split()[1])
    except OSError as exc:
        raise UserError(f"cannot read the memory of process {pid}: {exc.strerror} (soak needs Linux /proc)") from None
    raise UserError(f"/proc/{pid}/status has no VmRSS line")


def _endpoint() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def slope_per_s(t: list[float], y: list[float]) -> float:
    """Least-squares slope dy/dt (units of y per s); 0 with fewer than two samples."""
    if len(t) < 2:
        return 0.0
    return float(np.polyfit(np.asarray(t) - t[0], np.asarray(y), 1)[0])


def soak(rig_path: str | Path, backend: str, minutes: float, warmup_s: float = 60.0) -> dict:
    """Run the live pipeline for ``minutes`` with ``backend``; a JSON-ready report (see module docstring)."""
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
    try:
        with Subscriber([est_ep], topics=["est/"]) as sub:
            drv = subprocess.Popen([*cli, "driver", "sim", "--config", str(rig_path), "--endpoint", sim_ep,
                                    "--duration", f"{duration + 30:g}"], stdin=subprocess.DEVNULL)
            start = time.monotonic()
            next_sample = start
            while time.monotonic() - start < duration:
                if est.poll() is not None:
                    raise UserError(f"the estimator exited with code {est.returncode} during the soak")
                got = sub.recv(timeout_s=0.1)
                if got is not None:
                    topic, payload, _ = got
                    msg = schema.decode(topic, payload)
                    if topic == "est/diag":
                        last_diag = msg
                    else:
                        n_state += 1
                        statuses[msg["status"]] = statuses.get(msg["status"], 0) + 1
                now = time.monotonic()
                if now >= next_sample:
                    next_sample += 1.0
                    samples_t.append(now - start)
                    samples_kb.append(rss_kb(est.pid))
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
    warm = [i for i, t in enumerate(samples_t) if t >= min(warmup_s, duration / 2)]
    return {
        "backend": backend,
        "minutes": minutes,
        "rig": str(rig_path),
        "rss_kb_start": samples_kb[0] if samples_kb else None,
        "rss_kb_after_warmup": samples_kb[warm[0]] if warm else None,
        "rss_kb_end": samples_kb[-1] if samples_kb else None,
        "rss_slope_kb_per_s": slope_per_s([samples_t[i] for i in warm], [samples_kb[i] for i in warm]),
        "warmup_s": min(warmup_s, duration / 2),
        "rss_kb_every_30_s": samples_kb[::30],
        "est_state_messages": n_state,
        "est_state_per_s": n_state / duration,  # 1000 = keeping up with the 1 kHz step rate
        "status_counts": statuses,
        "step_us_last_10000": last_diag["step_us"] if last_diag else None,
        "steps": (last_diag.get("info") or {}).get("steps") if last_diag else None,
        "estimator_pid": est.pid,
        "python": sys.version.split()[0],
        "cpus": os.cpu_count(),
    }

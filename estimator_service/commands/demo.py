"""``rigstate demo``: the whole pipeline on simulated sensors, as separate processes on loopback.

Starts ``rigstate driver sim`` and ``rigstate estimator`` with the shipped testbed rig on free
loopback ports, watches ``est/state`` against ``truth/state`` live for a few seconds, prints the
achieved crank-angle RMSE and the end-to-end latency, and stops both processes.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np

from estimator_service import bus, schema
from estimator_service.paths import default_rig


def free_port() -> int:
    """A currently free TCP port on 127.0.0.1."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo",
        help="run simulated drivers + estimator on loopback and show the live estimate vs truth",
        description="The whole pipeline with no hardware: simulated sensor driver and estimator daemon "
        "as separate processes on 127.0.0.1, a live view, then the achieved RMSE.",
    )
    p.add_argument("--config", default=str(default_rig()), help="rig TOML (default: the Sensors-2016 testbed)")
    p.add_argument("--backend", choices=["ekf", "ukf", "fgs", "errekf"], help="backend (default: the rig's)")
    p.add_argument("--duration", type=float, default=10.0, help="seconds of live view (default 10)")
    p.add_argument("--speed", type=float, default=1.0, help="simulation speed factor (default real time)")
    p.set_defaults(func=run_demo)


def _spawn(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "estimator_service.cli", *args],
                            stdin=subprocess.DEVNULL, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 5
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def run_demo(args: argparse.Namespace) -> int:
    sim_ep = f"tcp://127.0.0.1:{free_port()}"
    est_ep = f"tcp://127.0.0.1:{free_port()}"
    backend = ["--backend", args.backend] if args.backend else []
    print(f"rigstate demo: rig {args.config}\n  driver sim -> {sim_ep}\n  estimator  -> {est_ep}")
    est = _spawn(["--log-level", "WARNING", "estimator", "--config", args.config, *backend,
                  "--sensor-endpoint", sim_ep, "--endpoint", est_ep])
    procs = [est]
    try:
        with bus.Subscriber([est_ep, sim_ep], topics=["est/state", "truth/state", "est/diag"]) as sub:
            time.sleep(0.5)  # let the estimator subscribe before the sensors start
            drv = _spawn(["--log-level", "WARNING", "driver", "sim", "--config", args.config,
                          "--endpoint", sim_ep, "--speed", str(args.speed),
                          "--duration", str(args.duration + 2.0), "--precompute"])
            procs.append(drv)
            return _live_view(sub, args.duration, procs)
    finally:
        _stop(procs)


def _live_view(sub: bus.Subscriber, duration: float, procs: list[subprocess.Popen]) -> int:
    truth: dict[int, tuple[float, float]] = {}  # ms -> (crank, wall time received)
    errors: list[float] = []
    latencies: list[float] = []
    n_est = 0
    status = "-"
    last_print = 0.0
    start = time.monotonic()
    first_est = None
    while time.monotonic() - start < duration + 15.0:  # startup (imports, first simulated segment) included
        if any(p.poll() not in (None, 0) for p in procs):
            print("rigstate demo: a child process failed", file=sys.stderr)
            return 1
        got = sub.recv(timeout_s=0.05)
        now = time.monotonic()
        if got is not None:
            topic, payload, _ = got
            msg = schema.decode(topic, payload)
            key = int(round(msg["t"] * 1000))
            if topic == "truth/state" and msg.get("crank") is not None:
                truth[key] = (msg["crank"], now)
            elif topic == "est/state":
                n_est += 1
                first_est = first_est or now
                status = msg["status"]
                if key in truth and msg.get("crank") is not None:
                    c_true, t_wall = truth[key]
                    err = (msg["crank"] - c_true + math.pi) % (2 * math.pi) - math.pi
                    errors.append(err)
                    latencies.append(now - t_wall)
                    if now - last_print > 0.25:
                        last_print = now
                        print(f"  t={msg['t']:6.2f} s  crank est {math.degrees(msg['crank']) % 360:7.2f}°  "
                              f"truth {math.degrees(c_true) % 360:7.2f}°  err {math.degrees(err):+6.3f}°  "
                              f"rate {msg['crank_rate']:+6.2f} rad/s  [{status}]", flush=True)
        if first_est and now - first_est > duration:
            break
    if not errors:
        print("rigstate demo: no estimates matched to truth (estimator not running?)", file=sys.stderr)
        return 1
    e = np.degrees(np.asarray(errors))
    lat = np.asarray(latencies) * 1e3
    print(f"\n{n_est} estimates; crank-angle RMSE {np.sqrt(np.mean(e**2)):.3f}° (max |err| {np.abs(e).max():.3f}°); "
          f"end-to-end latency p50 {np.percentile(lat, 50):.1f} ms, p99 {np.percentile(lat, 99):.1f} ms")
    return 0

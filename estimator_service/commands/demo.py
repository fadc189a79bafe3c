"""``rigstate demo``: the whole pipeline on simulated sensors, as separate processes on loopback.

Starts ``rigstate estimator`` and ``rigstate driver sim`` with a rig (default: the shipped testbed)
on free loopback ports, shows the preparation (estimator start-up and, at the same time, the simulation of the
sensor data, published once the estimator has subscribed)
and then the live estimate of every DOF against truth for a few seconds, prints the achieved RMSE
per DOF (° for angles, m for translations) and the end-to-end latency, and stops both processes.
On a terminal the view redraws in place (rich) with a legend; otherwise it prints plain lines.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from estimator_service import bus, kernels, schema
from estimator_service.dofs import Dof, dofs_of
from estimator_service.paths import default_rig
from estimator_service.rig import BACKENDS, load_rig

if TYPE_CHECKING:
    from rich.console import RenderableType

PLAIN_PERIOD_S = 0.25  #: seconds between plain output lines
REDRAW_PERIOD_S = 0.1  #: seconds between updates of the view
LEGEND = ("est = estimator output (est/state); truth = simulator ground truth (truth/state) at the same "
          "sensor time; err = est - truth (angles wrapped); rate = estimated DOF rate; status: ok, degraded "
          "(no fused input lately), reinit (restarted after divergence), then 'inconsistent' while the estimator "
          "disagrees with its sensors. Ctrl-C stops.")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo",
        help="run simulated drivers + estimator on loopback and show the live estimate vs truth",
        description="The whole pipeline with no hardware: simulated sensor driver and estimator daemon "
        "as separate processes on 127.0.0.1, a live view, then the achieved RMSE.",
    )
    p.add_argument("--config", default=str(default_rig()), help="rig TOML (default: the Sensors-2016 testbed)")
    p.add_argument("--backend", choices=BACKENDS, help="backend (default: the rig's)")
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
    rig = load_rig(args.config)  # a bad rig is reported here (exit 2), not by the children
    sim_ep = f"tcp://127.0.0.1:{bus.free_port()}"
    est_ep = f"tcp://127.0.0.1:{bus.free_port()}"
    backend = ["--backend", args.backend] if args.backend else []
    print(f"rigstate demo: rig {args.config}\n  driver sim -> {sim_ep}\n  estimator  -> {est_ep}", flush=True)
    est = _spawn(["--log-level", "WARNING", "estimator", "--config", args.config, *backend,
                  "--sensor-endpoint", sim_ep, "--endpoint", est_ep])
    procs = [est]
    view = DemoView(dofs_of(rig.model), args.duration, args.backend or rig.estimator.backend,
                    stage=f"starting the estimator and simulating {args.duration + 2.0:g} s of sensor data")
    if kernels.cache_is_cold():
        print("  a first run: the estimator compiles its kernels (about a minute; cached for later runs)", flush=True)
    try:
        # the simulation runs while the estimator starts (a cold start compiles for a minute): it publishes once the
        # estimator has subscribed to the sensor topics
        procs.append(_spawn(["--log-level", "WARNING", "driver", "sim", "--config", args.config, "--endpoint", sim_ep,
                             "--speed", str(args.speed), "--duration", str(args.duration + 2.0), "--precompute",
                             "--wait", str(kernels.COLD_START_TIMEOUT_S)]))
        with bus.Subscriber([est_ep, sim_ep], topics=["est/state", "truth/state", "est/diag"],
                            auth=rig.bus.auth) as sub:
            if sys.stdout.isatty():
                from rich.live import Live  # imported here: every rigstate command imports this module

                with Live(view.render(), refresh_per_second=8, transient=False) as live:
                    code = _loop(sub, view, procs, lambda: live.update(view.render()))
            else:
                code = _loop(sub, view, procs, view.plain)
    finally:
        _stop(procs)
    if code != 0:
        return code
    print(view.final_line())
    return 0


@dataclass
class DemoView:
    """State of the demo: preparation stage, latest estimate vs truth per DOF, errors, latencies."""

    dofs: list[Dof]
    duration: float
    backend: str
    stage: str = "starting the estimator"
    t0: float = field(default_factory=time.monotonic)
    truth: dict[int, tuple[list[float], float]] = field(default_factory=dict)  #: ms -> (z, wall time received)
    errors: list[list[float]] = field(default_factory=list)  #: per matched estimate, per DOF (rad or m)
    latencies: list[float] = field(default_factory=list)  #: s
    latest: tuple[dict, list[float]] | None = None  #: (est/state, truth z) of the latest match
    n_est: int = 0
    first_est: float | None = None
    _last_plain: float = 0.0
    _last_stage: str = ""
    _shown_stage: str = ""

    def add(self, topic: str, msg: dict, now: float) -> None:
        key = int(round(msg["t"] * 1000))
        if topic == "truth/state":
            self.truth[key] = (msg["z"], now)
        elif topic == "est/state":
            self.n_est += 1
            self.first_est = self.first_est or now
            if key in self.truth and len(msg["z"]) == len(self.dofs):
                z_true, t_wall = self.truth.pop(key)
                self.errors.append([float(d.error(msg["z"][d.index], z_true[d.index])) for d in self.dofs])
                self.latencies.append(now - t_wall)
                self.latest = (msg, z_true)

    def rmse(self) -> list[float]:
        """RMSE per DOF so far (rad or m)."""
        e = np.asarray(self.errors)
        return list(np.sqrt(np.mean(e**2, axis=0))) if e.size else [float("nan")] * len(self.dofs)

    def render(self) -> RenderableType:
        """The rich view: a spinner during preparation, then the table with its legend."""
        from rich.console import Group
        from rich.spinner import Spinner
        from rich.table import Table
        from rich.text import Text

        elapsed = time.monotonic() - self.t0
        if self.latest is None:
            return Group(Spinner("dots", Text(f"{self.stage} ... {elapsed:4.1f} s")))
        msg, z_true = self.latest
        rmse = self.rmse()
        table = Table(title=Text(f"t = {msg['t']:7.2f} s   backend {self.backend}   status [{', '.join(schema.state_flags(msg))}]   "
                                 f"{self.n_est} estimates"), title_justify="left")
        for col in ("DOF", "est", "truth", "err", "RMSE", "rate"):
            table.add_column(col, justify="left" if col == "DOF" else "right")
        for d, r in zip(self.dofs, rmse, strict=True):
            z = msg["z"][d.index]
            table.add_row(d.name, d.fmt_value(z), d.fmt_value(z_true[d.index]),
                          d.fmt_error(float(d.error(z, z_true[d.index]))), d.fmt_size(r),
                          f"{msg['zd'][d.index]:+7.3f} {d.rate_unit}")
        lat = np.asarray(self.latencies) * 1e3
        left = max(0.0, self.duration - (time.monotonic() - (self.first_est or time.monotonic())))
        foot = Text(f"end-to-end latency p50 {np.percentile(lat, 50):.1f} ms; {left:4.1f} s left\n{LEGEND}",
                    style="dim")
        return Group(table, foot)

    def stage_changed(self) -> bool:
        """True once after each change of the preparation stage (so every stage is shown)."""
        changed, self._shown_stage = self.stage != self._shown_stage, self.stage
        return changed

    def plain(self) -> None:
        """Plain-text output (stdout not a terminal): stage changes, then a line 4 times a second."""
        now = time.monotonic()
        if self.latest is None:
            if self.stage != self._last_stage:
                self._last_stage = self.stage
                print(f"  [{now - self.t0:5.1f} s] {self.stage} ...", flush=True)
            return
        if now - self._last_plain < PLAIN_PERIOD_S:
            return
        self._last_plain = now
        msg, z_true = self.latest
        parts = [f"{d.name} est {d.fmt_value(msg['z'][d.index])}  truth {d.fmt_value(z_true[d.index])}  "
                 f"err {d.fmt_error(float(d.error(msg['z'][d.index], z_true[d.index])))}  "
                 f"rate {msg['zd'][d.index]:+6.2f} {d.rate_unit}" for d in self.dofs]
        print(f"  t={msg['t']:6.2f} s  " + "  ".join(parts) + f"  [{', '.join(schema.state_flags(msg))}]", flush=True)

    def final_line(self) -> str:
        lat = np.asarray(self.latencies) * 1e3
        e = np.abs(np.asarray(self.errors))
        acc = "; ".join(f"{d.name}-{'angle' if d.angular else 'position'} RMSE {d.fmt_size(r)} "
                        f"(max |err| {d.fmt_size(float(e[:, d.index].max()))})"
                        for d, r in zip(self.dofs, self.rmse(), strict=True))
        return (f"\n{self.n_est} estimates; {acc}; end-to-end latency p50 {np.percentile(lat, 50):.1f} ms, "
                f"p99 {np.percentile(lat, 99):.1f} ms")


def _loop(sub: bus.Subscriber, view: DemoView, procs: list[subprocess.Popen], redraw) -> int:
    """Feed the view, redraw; returns an exit code."""
    last_redraw = 0.0
    while True:
        if any(p.poll() not in (None, 0) for p in procs):
            print("rigstate demo: a child process failed", file=sys.stderr)
            return 1
        got = sub.recv(timeout_s=0.05)
        now = time.monotonic()
        if got is not None:
            topic, payload, _ = got
            try:
                msg = schema.decode(topic, payload)
            except schema.SchemaError:
                continue
            if topic == "truth/state" and view.latest is None:  # (an estimate may come before its truth)
                view.stage = "waiting for the first estimate"
            view.add(topic, msg, now)
        if now - last_redraw >= REDRAW_PERIOD_S or view.stage_changed():
            last_redraw = now
            redraw()
        if view.first_est is not None and now - view.first_est > view.duration:
            break
        if view.first_est is None and now - view.t0 > kernels.COLD_START_TIMEOUT_S:  # (a cold compile cache)
            break
    if not view.errors:
        print("rigstate demo: no estimates matched to truth (estimator not running?)", file=sys.stderr)
        return 1
    return 0

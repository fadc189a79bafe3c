"""The live estimator against the attacks of issue 8, over real loopback sockets and real processes:
time and seq poisoning, rig-mismatched messages, a replay into a running estimator, stale inputs,
SIGTERM during a catch-up, the systemd watchdog, the emulated rig under a CPU hog and silent for seconds."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgpack
import numpy as np
import pytest

from estimator_service.bus import Subscriber
from estimator_service.logfile import read_log

from helpers import ep, rig_text, rigstate
from live_helpers import (collect, crank_errors, emulated_errors, emulated_run_checked, ended_and_counted, publish_log,
                          run_emulated_rig, stop, subscribed_publisher)

# runs backends (or estimator subprocesses): their kernels compiled before the tests start (conftest.py)
pytestmark = pytest.mark.kernels()


def rig_file(tmp_path: Path, extra: str = "", fused: bool = False, backend: str = "ekf") -> Path:
    """The public rig (absolute mechanism path), ``extra`` lines added to [estimator]."""
    text = rig_text()
    if fused:  # the crank encoder and the coupler's inclination fused too: messages the rig can refuse
        text = text.replace('use = ["gyr"]', 'use = ["gyr", "incl"]', 1).replace("use = false", "use = true", 1)
    text = text.replace('backend = "fgs"\ndt = 0.001', f'backend = "{backend}"\ndt = 0.001\n{extra}')
    path = tmp_path / "rig.toml"
    path.write_text(text)
    return path


def daemon_run(rig: Path, publish, seconds: float, topics: list[str], env: dict | None = None,
               until=None) -> tuple[list, int]:
    """Start the estimator on ``rig``, run ``publish(endpoint)`` in a thread, collect ``topics``;
    returns (messages, exit code)."""
    sim_ep, est_ep = ep(), ep()
    est = rigstate("estimator", "--config", str(rig), "--sensor-endpoint", sim_ep, "--endpoint", est_ep, env=env)
    try:
        with Subscriber([est_ep, sim_ep], topics=topics) as sub:
            ready = collect(sub, 60, until=lambda m: m[-1][0] == "est/diag")  # the estimator is up
            assert ready, "the estimator published no est/diag within 60 s"
            th = threading.Thread(target=publish, args=(sim_ep,))
            th.start()
            msgs = collect(sub, seconds, until)
            th.join()
    finally:
        code = stop(est)
    return msgs, code


def test_poisoned_time_seq_and_rig_mismatched_messages_do_not_stop_the_estimator(sim_log_4s: Path, tmp_path: Path) -> None:
    first = True

    def tamper(rec):
        nonlocal first
        frames = []
        msg = msgpack.unpackb(rec.payload) if rec.topic.startswith(("imu/", "enc/")) else None
        if first and msg is not None:  # the very first message claims t = 1e9
            first = False
            frames.append([rec.topic.encode(), msgpack.packb({**msg, "t": 1e9})])
        if rec.topic.startswith("imu/") and 1.0 <= rec.t_recv < 1.02:
            frames += [[rec.topic.encode(), msgpack.packb({**msg, "t": 1e9, "seq": msg["seq"] + 1})],  # far future
                       [rec.topic.encode(), msgpack.packb({**msg, "seq": 2**62})]]                    # seq poisoning
        if rec.topic == "imu/coupler" and 1.5 <= rec.t_recv < 1.6:
            msg.pop("quat")  # inclination fused: the rig needs quat
            return frames + [[rec.topic.encode(), msgpack.packb(msg)]]
        if rec.topic == "enc/crank" and 1.5 <= rec.t_recv < 1.6:
            return frames + [[rec.topic.encode(), msgpack.packb({**msg, "cpr": 1000})]]  # another encoder
        return frames + [[rec.topic.encode(), rec.payload]]

    msgs, code = daemon_run(rig_file(tmp_path, fused=True), lambda e: publish_log(e, sim_log_4s, 1.0, tamper), 60,
                               ["est/", "truth/"], until=ended_and_counted(3.95))
    assert code == 0
    states = [m for t, m, _ in msgs if t == "est/state"]
    assert states and max(m["t"] for m in states) > 3.9 and min(m["t"] for m in states) < 0.05
    assert all(m["status"] == "ok" for m in states if m["t"] > 2.0)
    errs = crank_errors(msgs, t_min=0.5)
    assert len(errs) > 3000 and np.sqrt(np.mean(errs**2)) < 0.3
    diag = [m for t, m, _ in msgs if t == "est/diag"][-1]  # counted after every tampered message
    coupler, crank = diag["inputs"]["imu/coupler"], diag["inputs"]["enc/crank"]
    assert coupler["future"] >= 2 and coupler["restarts"] >= 2 and coupler["lost"] < 5
    assert coupler["errors"]["measure"] >= 9 and crank["errors"]["measure"] >= 90
    assert diag["info"]["resets"] == 0 and diag["status"] != "degraded"


def test_a_second_replay_into_a_running_estimator_resets_it(sim_log_4s: Path, tmp_path: Path) -> None:
    def two_replays(endpoint: str) -> None:
        for _ in range(2):
            assert subprocess.run([sys.executable, "-m", "estimator_service.cli", "replay", str(sim_log_4s), "--endpoint",
                                   endpoint, "--speed", "2"], capture_output=True, timeout=120).returncode == 0

    reinit_seen = False
    second_run_ended = ended_and_counted(3.9)

    def done(m: list) -> bool:  # the reset, then the second run's end and an est/diag counting it
        nonlocal reinit_seen
        reinit_seen = reinit_seen or (m[-1][0] == "est/state" and m[-1][1]["status"] == "reinit")
        return reinit_seen and second_run_ended(m)

    msgs, code = daemon_run(rig_file(tmp_path), two_replays, 180, ["est/"], until=done)
    assert code == 0
    states = [m for t, m, _ in msgs if t == "est/state"]
    k = next(i for i, m in enumerate(states) if m["status"] == "reinit")
    assert states[k - 1]["t"] > 3.9 and states[k]["t"] < 0.1  # the second run starts again at its own time
    assert max(m["t"] for m in states[k:]) > 3.9
    diag = [m for t, m, _ in msgs if t == "est/diag"][-1]
    assert diag["info"]["resets"] == 1 and "jumped" in diag["info"]["last_reset"]


def test_without_input_the_estimate_goes_stale_and_resumes(sim_log_4s: Path, tmp_path: Path) -> None:
    """The sender stops after 1.5 s of data; once est/diag says stale it sends the rest."""
    recs = [r for r in read_log(sim_log_4s) if r.topic.startswith(("imu/", "enc/"))]
    stale_seen = threading.Event()

    def publish(endpoint: str) -> None:
        pub = subscribed_publisher(endpoint, {r.topic for r in recs})
        for part in ([r for r in recs if r.t_recv < 1.5], [r for r in recs if r.t_recv >= 1.5]):
            start = time.monotonic()
            for r in part:
                delay = start + (r.t_recv - part[0].t_recv) - time.monotonic()
                if delay > 0:
                    time.sleep(delay)  # paces the producer: the log's own timing
                pub.publish_raw(r.topic, r.payload)
            if not stale_seen.wait(60):
                break
        pub.close(linger_s=1.0)

    def until(m: list) -> bool:
        topic, msg, _ = m[-1]
        if topic == "est/diag" and msg["status"] == "stale":
            stale_seen.set()
        return stale_seen.is_set() and topic == "est/state" and msg["t"] > 3.9

    msgs, code = daemon_run(rig_file(tmp_path), publish, 120, ["est/"], until=until)
    assert code == 0 and stale_seen.is_set()
    order = [(t, m) for t, m, _ in msgs]
    k = next(i for i, (t, m) in enumerate(order) if t == "est/diag" and m["status"] == "stale")
    before = [m for t, m in order[:k] if t == "est/state"]
    after = [m for t, m in order[k:] if t == "est/state"]
    assert before and max(m["t"] for m in before) < 1.5  # est/state stopped with the input
    assert after and min(m["t"] for m in after) >= max(m["t"] for m in before)
    assert max(m["t"] for m in after) > 3.9 and all(m["status"] == "ok" for m in after if m["t"] > 1.8)
    assert not [m for t, m in order[k:] if t == "est/diag" and m["info"]["resets"]]


def notify_server(tmp_path: Path) -> tuple[socket.socket, str]:
    path = str(tmp_path / "notify.sock")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    srv.bind(path)
    srv.settimeout(0.05)
    return srv, path


def drain(srv: socket.socket) -> None:
    """Discard the datagrams already queued (sent before now)."""
    srv.setblocking(False)
    try:
        while True:
            srv.recv(4096)
    except BlockingIOError:
        pass
    finally:
        srv.settimeout(0.05)


def pings(srv: socket.socket, seconds: float) -> list[float]:
    """Monotonic times of the WATCHDOG=1 datagrams received during ``seconds``."""
    out = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            if srv.recv(4096) == b"WATCHDOG=1":
                out.append(time.monotonic())
        except TimeoutError:
            pass
    return out


def test_sigterm_and_the_watchdog_during_a_long_catch_up(sim_log_4s: Path, tmp_path: Path) -> None:
    """A 300 s jump of sensor time (allowed by this rig's max_ahead_s) takes minutes of steps: the
    watchdog is pinged from the catch-up loop and SIGTERM ends it within 1 s."""
    rig = rig_file(tmp_path, "max_ahead_s = 1000.0\nmax_behind_s = 1000.0\nstale_after_s = 5000.0")
    srv, path = notify_server(tmp_path)
    sim_ep, est_ep = ep(), ep()
    est = rigstate("estimator", "--config", str(rig), "--sensor-endpoint", sim_ep, "--endpoint", est_ep,
                   env={"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "400000"})
    try:
        with Subscriber([est_ep], topics=["est/"]) as sub:
            assert collect(sub, 60, until=lambda m: m[-1][0] == "est/diag"), "the estimator did not start"
            recs = [r for r in read_log(sim_log_4s) if r.topic.startswith(("imu/", "enc/"))]
            start = [(r.topic, r.payload) for r in recs if r.t_recv <= 0.2]
            jump = []
            for r in recs:
                if 0.2 < r.t_recv <= 0.21:
                    m = msgpack.unpackb(r.payload)
                    jump.append((r.topic, msgpack.packb({**m, "t": m["t"] + 300.0})))
            pub = subscribed_publisher(sim_ep, {r.topic for r in recs})
            for topic, payload in start + jump:
                pub.publish_raw(topic, payload)
            seen = collect(sub, 30, until=lambda m: m[-1][0] == "est/state" and m[-1][1]["t"] > 2.0)
            assert seen and seen[-1][1]["t"] > 2.0  # the catch-up is under way
            drain(srv)
            during = pings(srv, 1.5)
            latest = [m for t, m, _ in collect(sub, 0.3) if t == "est/state"]
            assert latest and latest[-1]["t"] < 290.0  # still catching up
    finally:
        drain(srv)
        t0 = time.monotonic()
        est.send_signal(signal.SIGTERM)
        stopping = None
        end = t0 + 20
        while stopping is None and time.monotonic() < end:
            try:
                if srv.recv(4096) == b"STOPPING=1":
                    stopping = time.monotonic() - t0
            except TimeoutError:
                pass
        code = est.wait(timeout=30)
        pub.close(linger_s=0.0)
        srv.close()
    assert len(during) >= 3  # pinged from the loop doing the work
    # SIGTERM ended the catch-up (minutes of steps left) with STOPPING=1 and exit 0; how soon is a figure
    assert code == 0 and stopping is not None


def test_a_hung_loop_trips_the_watchdog(tmp_path: Path) -> None:
    srv, path = notify_server(tmp_path)
    est = rigstate("estimator", "--config", str(rig_file(tmp_path)), "--sensor-endpoint", ep(), "--endpoint", ep(),
                   env={"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "400000"})
    try:
        before = []
        end = time.monotonic() + 30
        while len(before) < 3 and time.monotonic() < end:
            before += pings(srv, 0.2)
        assert len(before) >= 3
        est.send_signal(signal.SIGSTOP)  # the loop stops: no ping may come
        drain(srv)
        hung = pings(srv, 1.2)
        est.send_signal(signal.SIGCONT)
        after = pings(srv, 1.0)
    finally:
        code = stop(est)
        srv.close()
    assert hung == [] and len(after) >= 2 and code == 0


def test_emulated_rig_under_a_cpu_hog_keeps_its_accuracy(tmp_path: Path) -> None:
    """driver sim --emulate (device emulators, real drivers) while two busy processes (nice 5) load the
    CPUs: the daemon may fall behind (seen with the hogs at nice 0: 11 s at the end of the run) and
    reads each publisher's backlog on its own, merged by sensor time; the estimate stays within 0.3°
    of truth and ``ok``.  A driver process starved for longer than the filter's history (200 ms) delivers samples the estimator has
    passed (counted ``late``; seen: 181 of 8198 crank-encoder samples, in one burst), for longer than
    ``max_behind_s`` (2 s) samples the sensor clock has passed (counted ``past``; seen: the IMUs 4.4 s
    behind): both are dropped, never applied at the wrong time, and beyond what the sources delivered
    behind the others by more than the history, at most 5 % of a topic's samples may go that way.  Nothing resets the estimate, unless the starved emulators themselves skipped
    time (:func:`emulated_run_checked`): then the estimate is ``ok`` and within 0.3° again from 1 s
    after each such gap; the estimates cover most of the settled time (a loaded CI machine's emulators once
    skipped 3 s of an 8 s run: 2899 estimates)."""
    msgs = run_emulated_rig(tmp_path, 6.0, hogs=2)
    diag, settled, gaps = emulated_run_checked(msgs, dropped_share=0.05)
    errs = emulated_errors(msgs, keep=settled)
    rmse = float(np.sqrt(np.mean(errs**2)))
    dropped = {t: c["late"] + c["past"] + c["future"] for t, c in diag["inputs"].items()}
    print(f"emulated rig under a CPU hog: crank RMSE {rmse:.3f} deg over {len(errs)} estimates, "
          f"max {np.abs(errs).max():.3f}; late, past or future: {dropped}; resets {diag['info']['resets']}")
    est_t = [m["t"] for t, m, _ in msgs if t == "est/state"]
    release = min(m["t"] for t, m, _ in msgs if t == "truth/state")
    end = max(m["t"] for t, m, _ in msgs if t == "enc/crank")
    settled_steps = sum(settled(t) for t in np.arange(release + 1.0, end, 0.001))  # the 1 ms steps scored
    assert len(errs) > max(1000, 0.6 * settled_steps) and rmse <= 0.3, (
        len(errs), settled_steps, rmse, gaps, diag["info"], est_t[:1], est_t[-1:], len(est_t))
    t0 = min(m["t"] for t, m, _ in msgs if t == "truth/state") + 1.0
    states = [m for t, m, _ in msgs if t == "est/state" and m["t"] >= t0 and settled(m["t"])]
    assert states and all(m["status"] == "ok" for m in states)


def test_a_rig_silent_for_seconds_resets_once_and_is_right_again(tmp_path: Path) -> None:
    """The whole emulated rig (emulators and drivers) stopped for 4 s, then resuming at once with what
    it queued: a silence no estimator may predict across.  The drivers reconnect, the sources' backlog
    and the rig's new time arrive together; the estimator resets once (status ``reinit``, est/diag
    ``info.resets``), resumes from the fused crank encoder (the rig moved on meanwhile) and is ``ok``
    and within 0.3° of truth from 1 s after the silence, as before it (and after any silence the
    suite's load adds).  What a source delivered after the others had moved on by more than the
    history may be dropped as late, and 5 % more of a topic (:func:`emulated_run_checked`)."""
    msgs = run_emulated_rig(tmp_path, 12.0, freeze=(3.0, 4.0))
    diag, settled, gaps = emulated_run_checked(msgs, dropped_share=0.05)
    made = [g for g in gaps if g[1] - g[0] > 3.0]
    assert len(made) == 1, gaps  # the silence the test made
    # one reset for it, and at most one for each silence the suite's load adds (CI ci32: the starved
    # emulators added a 1.67 s one after the resume, and the estimator reset for it as designed)
    assert 1 <= diag["info"]["resets"] <= len(gaps), (diag["info"], gaps)
    states = [m for t, m, _ in msgs if t == "est/state"]
    assert [m["status"] for m in states].count("reinit") == diag["info"]["resets"]
    errs = emulated_errors(msgs, keep=settled)
    after = emulated_errors(msgs, keep=lambda t: t >= made[0][1] + 1.0 and settled(t))
    print(f"rig silent {made[0][1] - made[0][0]:.2f} s: crank RMSE {np.sqrt(np.mean(errs**2)):.3f} deg, "
          f"{len(after)} estimates after it, max error {np.abs(after).max():.3f}; reset: {diag['info']['last_reset']}")
    # at least 1 s of estimates after it, as in the device-emulator test: the suite's load may add
    # silences (and their settling seconds) or stop a driver early (seen: 1744 estimates)
    assert len(after) > 1000 and np.abs(after).max() <= 0.3, (len(after), np.abs(after).max(), gaps)
    not_ok = [(m["t"], m["status"]) for m in states if m["t"] >= made[0][1] + 1.0 and settled(m["t"]) and m["status"] != "ok"]
    assert not not_ok, (not_ok[:5], len(not_ok), gaps)

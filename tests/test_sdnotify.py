"""sd_notify against real AF_UNIX datagram sockets standing in for systemd's NOTIFY_SOCKET."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import uuid

import pytest

from estimator_service.sdnotify import Notifier


@pytest.fixture
def path_socket(tmp_path):
    path = str(tmp_path / "notify.sock")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(path)
    s.settimeout(2.0)
    yield path, s
    s.close()


def recv_lines(s: socket.socket) -> str:
    return s.recv(4096).decode()


def test_states_reach_a_path_socket(path_socket):
    path, s = path_socket
    n = Notifier({"NOTIFY_SOCKET": path})
    assert n.enabled
    assert n.ready() and recv_lines(s) == "READY=1"
    assert n.status("estimating\n(ekf)") and recv_lines(s) == "STATUS=estimating (ekf)"
    assert n.watchdog() and recv_lines(s) == "WATCHDOG=1"
    assert n.stopping() and recv_lines(s) == "STOPPING=1"
    n.close()


def test_abstract_socket():
    name = f"rigstate-test-{uuid.uuid4().hex}"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind("\0" + name)
    s.settimeout(2.0)
    try:
        n = Notifier({"NOTIFY_SOCKET": "@" + name})
        assert n.notify("READY=1\nSTATUS=up")
        assert recv_lines(s) == "READY=1\nSTATUS=up"
    finally:
        s.close()


def test_no_socket_is_a_noop_and_errors_do_not_raise(tmp_path):
    n = Notifier({})
    assert not n.enabled and not n.ready() and n.watchdog_interval_s() is None and not n.maybe_watchdog()
    gone = Notifier({"NOTIFY_SOCKET": str(tmp_path / "missing.sock")})
    assert gone.enabled and not gone.ready()
    assert not Notifier({"NOTIFY_SOCKET": "vsock:2:1234"}).enabled


def test_watchdog_interval_and_pid_check(path_socket):
    path, s = path_socket
    n = Notifier({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "5000000", "WATCHDOG_PID": str(os.getpid())})
    assert n.watchdog_interval_s() == 5.0
    assert Notifier({"WATCHDOG_USEC": "5000000", "WATCHDOG_PID": "1"}).watchdog_interval_s() is None
    assert Notifier({"WATCHDOG_USEC": "5000000"}).watchdog_interval_s() == 5.0
    assert Notifier({"WATCHDOG_USEC": "junk"}).watchdog_interval_s() is None
    # pings at half the interval
    assert n.maybe_watchdog(now=100.0) and recv_lines(s) == "WATCHDOG=1"
    assert not n.maybe_watchdog(now=102.4)
    assert n.maybe_watchdog(now=102.5) and recv_lines(s) == "WATCHDOG=1"


def test_module_notify_uses_the_process_environment(path_socket):
    path, s = path_socket
    code = "import sys; from estimator_service import sdnotify; sys.exit(0 if sdnotify.notify('READY=1') else 3)"
    env = {**os.environ, "NOTIFY_SOCKET": path}
    assert subprocess.run([sys.executable, "-c", code], env=env, timeout=60).returncode == 0
    assert recv_lines(s) == "READY=1"
    env.pop("NOTIFY_SOCKET")
    assert subprocess.run([sys.executable, "-c", code], env=env, timeout=60).returncode == 3


def test_record_speaks_the_protocol_under_a_fake_systemd(path_socket, tmp_path):
    """``rigstate record`` as a service: READY, STATUS, WATCHDOG at half the interval, STOPPING on SIGTERM."""
    from estimator_service.bus import free_port
    from helpers import RIG

    path, s = path_socket
    env = {**os.environ, "NOTIFY_SOCKET": path, "WATCHDOG_USEC": "400000"}
    proc = subprocess.Popen([sys.executable, "-m", "estimator_service.cli", "record", "--out", str(tmp_path / "x.rslog"),
                             "--config", str(RIG), "--endpoint", f"tcp://127.0.0.1:{free_port()}"],
                            env=env, stdout=subprocess.DEVNULL)
    try:
        seen = []
        s.settimeout(30)
        while seen.count("WATCHDOG=1") < 4 or not any(x.startswith("STATUS=") for x in seen):
            seen.append(recv_lines(s))
        proc.send_signal(signal.SIGTERM)
        s.settimeout(5)
        while seen[-1] != "STOPPING=1":
            seen.append(recv_lines(s))
        assert proc.wait(timeout=10) == 0
    finally:
        proc.kill()
    assert seen[0] == "READY=1"
    assert seen.count("WATCHDOG=1") >= 4  # 0.4 s watchdog, pinged every 0.2 s
    assert any(x.startswith("STATUS=") and "messages recorded" in x for x in seen)

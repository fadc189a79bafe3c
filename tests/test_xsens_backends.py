"""The two Xsens backends — Xbus over pyserial and the vendor's ``xsensdeviceapi`` (XDA) — against
the MTi emulator on real pseudo-terminals.  XDA is played by the stand-in module in
``tests/fake_xda`` (the documented API, speaking Xbus to the emulator like the real library does).
The same device data feeds both; their ``imu/<name>`` messages must be identical.  Also: backend
choice and the missing-module error, ``xsens scan`` both ways, both backends' reconnects,
low-latency mode and arrival jitter."""

from __future__ import annotations

import importlib.util
import math
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import ModuleType

import pytest

from drivers.emulators.xsens import XsensEmulator
from drivers.serial_link import low_latency
from drivers.xsens.device import XsensDriver
from drivers.xsens.mtdata2 import encode_mtdata2
from drivers.xsens.stream import ArrivalJitter
from drivers.xsens.xbus import MID, XbusParser
from drivers.xsens.xda import XdaDriver
from estimator_service import bus, schema

from estimator_service.bus import free_port
from helpers import ROOT, XBUS_CAPTURES, Collector, wait_until

FAKE_XDA = Path(__file__).resolve().parent / "fake_xda"
RIGSTATE = [sys.executable, "-m", "estimator_service.cli"]


def fake_xda() -> ModuleType:
    """The stand-in module, loaded without putting it on sys.path (other tests must not see it)."""
    spec = importlib.util.spec_from_file_location("xsensdeviceapi", FAKE_XDA / "xsensdeviceapi.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def synthetic_frames(n: int = 800, drop: tuple[int, ...] = (300, 301)) -> list[bytes]:
    """MTData2 payloads of a device at 400 Hz whose PacketCounter (16-bit) and SampleTimeFine
    (32-bit) both wrap during the stream, with the samples ``drop`` missing (lost in transport)."""
    frames = []
    for k in range(n):
        if k in drop:
            continue
        a = 0.01 * k
        frames.append(encode_mtdata2([
            ("PacketCounter", (65300 + k) & 0xFFFF), ("SampleTimeFine", (2**32 - 4000 + 25 * k) & 0xFFFFFFFF),
            ("Quaternion", [math.cos(a / 2), 0.0, 0.0, math.sin(a / 2)]),
            ("Acceleration", [0.1 * math.sin(a), 0.0, 9.81]), ("RateOfTurn", [0.0, 0.0, 0.5 + 0.1 * math.cos(a)]),
            ("StatusWord", k % 4),
        ]))
    return frames


def capture_frames() -> list[bytes]:
    """The MTData2 payloads of a real MTi-G-710 capture (100 frames, Float32, no quaternion)."""
    msgs = XbusParser().feed((XBUS_CAPTURES / "1" / "output.bin").read_bytes())
    return [m.payload for m in msgs if m.mid == MID.MTDATA2]


def without_t(msgs: list[dict]) -> list[dict]:
    """Messages without their host time (which depends on when the bytes arrived)."""
    return [{k: v for k, v in m.items() if k != "t"} for m in msgs]


def run_both(tmp_path: Path, frames: list[bytes], rate: int) -> tuple[list[dict], list[dict], XsensDriver, XdaDriver]:
    """Both backends, each on its own emulator replaying ``frames``; the messages of one replay."""
    n = len(frames)
    sinks = Collector(), Collector()
    stop = threading.Event()
    with XsensEmulator(tmp_path / "a", frames=frames) as ea, XsensEmulator(tmp_path / "b", frames=frames) as eb:
        xbus = XsensDriver(str(ea.link), "coupler", sinks[0], rate_hz=rate)
        xda = XdaDriver(str(eb.link), "coupler", sinks[1], fake_xda(), rate_hz=rate)
        threads = [threading.Thread(target=d.run, args=(stop,), daemon=True) for d in (xbus, xda)]
        for th in threads:
            th.start()
        try:
            assert sinks[0].wait(n, 30) and sinks[1].wait(n, 30)
        finally:
            stop.set()
            for th in threads:
                th.join(10)
    assert not any(th.is_alive() for th in threads)
    return sinks[0].msgs[:n], sinks[1].msgs[:n], xbus, xda


def test_both_backends_identical_messages_in_process(tmp_path: Path) -> None:
    """Same device data (wrapping counters, two lost samples; then a real MTi-G-710 capture):
    identical messages from both backends, and the same loss accounting."""
    frames = synthetic_frames()
    a, b, xbus, xda = run_both(tmp_path, frames, rate=400)
    assert without_t(a) == without_t(b)
    assert [m["seq"] for m in a] == list(range(300)) + list(range(302, 800))  # gap = the 2 dropped samples
    assert a[-1]["dev_t"] - a[0]["dev_t"] == pytest.approx(799 * 0.0025)  # SampleTimeFine unwrapped
    assert a[-1]["status"] == 799 % 4 and a[-1]["quat"] == pytest.approx([math.cos(3.995), 0, 0, math.sin(3.995)], abs=1e-6)
    assert xbus.lost == xda.lost == 2 and xbus.published >= 798 and xda.published >= 798
    for msgs in (a, b):  # the host-time mapping: never decreasing, close to now
        ts = [m["t"] for m in msgs]
        assert all(t1 >= t0 for t0, t1 in zip(ts, ts[1:], strict=False)) and abs(ts[-1] - time.time()) < 30

    real = capture_frames()
    imu = [k for k, f in enumerate(real) if b"\x80\x20" in f]  # frames with RateOfTurn (4 Hz GNSS-only ones lack it)
    a, b, _, _ = run_both(tmp_path, [real[k] for k in imu], rate=100)
    assert without_t(a) == without_t(b)
    assert [m["seq"] for m in a] == imu and "quat" not in a[0]
    assert a[0]["acc"] == pytest.approx([-0.017374228686094284, -7.255744934082031, -1.209552526473999])
    assert a[0]["status"] == 25165831 and a[1]["status"] == 5


def _start_driver(backend: str, link: Path, endpoint: str, env: dict[str, str]) -> subprocess.Popen:
    cmd = [*RIGSTATE, "driver", "xsens", "--backend", backend, "--port", str(link), "--name", "coupler",
           "--rate", "400", "--endpoint", endpoint]
    return subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def test_rigstate_driver_xsens_backends_identical_over_zeromq(tmp_path: Path) -> None:
    """Two ``rigstate driver xsens --backend auto`` processes: one without xsensdeviceapi (falls back
    to xbus and says so), one with the stand-in on PYTHONPATH (picks xda); the same device data,
    identical imu messages on real ZeroMQ sockets; the xbus one reports arrival jitter in its
    systemd STATUS and log."""
    frames = synthetic_frames(n=1200, drop=(500,))
    n = len(frames)
    endpoints = [f"tcp://127.0.0.1:{free_port()}" for _ in range(2)]
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(tmp_path / "notify"))
    notify.settimeout(10)
    base = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env_xbus = dict(base, NOTIFY_SOCKET=str(tmp_path / "notify"), WATCHDOG_USEC="400000")
    env_xda = dict(base, PYTHONPATH=os.pathsep.join([str(FAKE_XDA), str(ROOT)]))
    got: list[dict[int, dict]] = [{}, {}]  # seq -> message; subscribers may join after the first ones (slow joiner)
    last = n  # seq of the last frame: 1200 samples numbered 0..1199, sample 500 dropped, n = 1199 frames
    with XsensEmulator(tmp_path / "a", frames=frames) as ea, XsensEmulator(tmp_path / "b", frames=frames):
        subs = [bus.Subscriber([ep], topics=["imu/"]) for ep in endpoints]
        procs = [_start_driver("auto", ea.link, endpoints[0], env_xbus),
                 _start_driver("auto", tmp_path / "b", endpoints[1], env_xda)]
        try:
            deadline = time.monotonic() + 60
            while not all(last in g for g in got) and time.monotonic() < deadline:
                for sub, g in zip(subs, got, strict=False):
                    r = sub.recv(0.05)
                    while r is not None:
                        assert r[0] == "imu/coupler"
                        msg = schema.decode(r[0], r[1])
                        g[msg["seq"]] = msg
                        r = sub.recv(0)
            states: list[str] = []
            while not any(s.startswith("STATUS=") and "p99" in s for s in states):
                states += notify.recv(1000).decode().splitlines()
        finally:
            for sub in subs:
                sub.close()
            for p in procs:
                p.terminate()
            errs = [p.communicate(timeout=20)[1].decode() for p in procs]
            notify.close()
    assert [p.returncode for p in procs] == [0, 0], errs
    assert "backend auto: using xbus" in errs[0] and "xsensdeviceapi cannot be imported" in errs[0]
    assert "backend auto: using xda" in errs[1] and "through xsensdeviceapi" in errs[1]
    first = [{k: m for k, m in g.items() if k <= last} for g in got]  # the first replay
    both = sorted(set(first[0]) & set(first[1]))
    assert len(both) >= n - 200 and both[-1] == last and 500 not in first[0] and 500 not in first[1]
    assert without_t([first[0][k] for k in both]) == without_t([first[1][k] for k in both])
    status = next(s for s in states if s.startswith("STATUS=") and "p99" in s)
    assert status.startswith("STATUS=xbus: ") and "arrival interval p50" in status and "lost" in status
    assert "low latency: ASYNC_LOW_LATENCY: not set" in errs[0]  # a pty has no serial_struct: logged, not fatal
    assert "arrival interval p50" in errs[0] and "arrival interval p50" in errs[1]  # exit summary in the log


def test_backend_xda_without_the_module_exits_2_with_install_hint(tmp_path: Path, endpoint: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    for cmd in (["driver", "xsens", "--backend", "xda", "--port", str(tmp_path / "mti"), "--name", "coupler",
                 "--endpoint", endpoint], ["xsens", "scan", "--backend", "xda"]):
        r = subprocess.run([*RIGSTATE, *cmd], env=env, capture_output=True, timeout=120)
        err = r.stderr.decode()
        assert r.returncode == 2, err
        assert "--backend xda: the Python module xsensdeviceapi cannot be imported" in err
        assert "wheel shipped with the Xsens MT Software Suite" in err and "pip install" in err
        assert "Traceback" not in err


def test_set_baud_is_refused_with_xda(tmp_path: Path, endpoint: str) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(FAKE_XDA), str(ROOT)]))
    r = subprocess.run([*RIGSTATE, "driver", "xsens", "--backend", "xda", "--port", str(tmp_path / "mti"), "--name",
                        "coupler", "--endpoint", endpoint, "--set-baud", "921600"], env=env, capture_output=True,
                       timeout=120)
    assert r.returncode == 2 and b"--set-baud: only with --backend xbus" in r.stderr


def _scan_rows(stdout: bytes) -> list[list[str]]:
    lines = stdout.decode().splitlines()
    assert lines[0].split() == ["port", "device", "id", "product", "code", "firmware"]
    return [ln.split() for ln in lines[1:]]


def test_xsens_scan_xbus_probing_and_xda(tmp_path: Path) -> None:
    """``xsens scan`` finds the emulated MTi on a pty by Xbus probing (and leaves it measuring, as
    found), and through the vendor API (the stand-in, scanning the ports it is told of)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    with XsensEmulator(tmp_path / "mti") as emu:
        r = subprocess.run([*RIGSTATE, "xsens", "scan", "--port", str(emu.link), "--baud", "115200"], env=env,
                           capture_output=True, timeout=120)
        assert r.returncode == 0, r.stderr.decode()
        rows = _scan_rows(r.stdout)
        assert [str(emu.link), "03700BEE", "MTi-300-2A8G4", "1.8.2"] in rows
        assert b"backend auto: using xbus" in r.stderr and b"device(s) found (xbus)" in r.stderr
        assert emu.measuring  # probing put it back into measurement
        env_xda = dict(env, PYTHONPATH=os.pathsep.join([str(FAKE_XDA), str(ROOT)]),
                       XSENSDEVICEAPI_STANDIN_PORTS=str(emu.link))
        r = subprocess.run([*RIGSTATE, "xsens", "scan"], env=env_xda, capture_output=True, timeout=120)
        assert r.returncode == 0, r.stderr.decode()
        assert _scan_rows(r.stdout) == [[str(emu.link), "03700BEE", "MTi-300-2A8G4", "1.8.2"]]
        assert b"backend auto: using xda" in r.stderr and b"1 device(s) found (xda)" in r.stderr


@pytest.mark.parametrize("backend", ["xbus", "xda"])
def test_both_backends_reconnect_after_an_unplug_and_a_stall(tmp_path: Path, backend: str) -> None:
    """The same behaviour from either backend: an unplug (XDA: the API reports the device disconnected, before
    any silence) and a stall (silence longer than ``silence_s``) both end in a reconnect with back-off and a new
    configuration; messages resume after each, and seq keeps increasing."""
    sink = Collector()
    spin = lambda t: ([0.0, 0.0, 0.5], [0.0, 0.0, 9.81], [math.cos(t / 2), 0.0, 0.0, math.sin(t / 2)])  # noqa: E731
    with XsensEmulator(tmp_path / "mti", source=spin) as emu:
        if backend == "xda":
            drv = XdaDriver(str(emu.link), "rocker", sink, fake_xda(), rate_hz=200, silence_s=0.5)
        else:
            drv = XsensDriver(str(emu.link), "rocker", sink, rate_hz=200, silence_s=0.5)
        stop = threading.Event()
        th = threading.Thread(target=drv.run, args=(stop,), daemon=True)
        th.start()
        try:
            assert sink.wait(50, 10)
            assert emu.rate_hz == 200 and drv.info.product_code.startswith("MTi-300")
            emu.unplug()
            assert wait_until(lambda: drv.stats.vanished + drv.stats.open_failures + drv.stats.silent > 0, 30)
            if backend == "xda":
                assert drv.stats.vanished == 1  # onConnectivityChanged(XCS_Disconnected), before any silence
            time.sleep(0.3)  # paces the scenario: the device stays unplugged for 0.3 s (not a wait for an event)
            n = len(sink.msgs)
            emu.replug()
            assert sink.wait(n + 50, 15)
            silent = drv.stats.silent
            emu.stall(1.0)
            assert wait_until(lambda: drv.stats.silent > silent, 30)
            n = len(sink.msgs)
            assert drv.stats.silent == silent + 1 and sink.wait(n + 50, 15)
        finally:
            stop.set()
            th.join(10)
    assert not th.is_alive()
    assert drv.stats.connects >= 3 and drv.stats.open_failures >= 1
    seqs = [m["seq"] for m in sink.msgs]
    assert seqs == sorted(set(seqs))


def test_low_latency_on_a_pty_and_a_latency_timer(tmp_path: Path) -> None:
    """A pty has no serial_struct (TIOCGSERIAL fails): reported, not raised.  An FTDI-style
    ``latency_timer`` file for the tty (a stand-in sysfs tree) is set from 16 to 1 ms."""
    import serial

    master, slave = os.openpty()
    try:
        port = os.ttyname(slave)
        timer = tmp_path / "sys" / "bus" / "usb-serial" / "devices" / Path(port).name / "latency_timer"
        with serial.serial_for_url(port, timeout=0.05) as ser:
            lines = low_latency(ser, sysfs=tmp_path / "sys")
            assert lines[0].startswith("ASYNC_LOW_LATENCY: not set (Failed to update ASYNC_LOW_LATENCY flag")
            assert lines[1].startswith("latency_timer: none")
            timer.parent.mkdir(parents=True)
            timer.write_text("16\n")
            lines = low_latency(ser, sysfs=tmp_path / "sys")
            assert lines[1] == f"latency_timer: 16 ms -> 1 ms ({timer})" and timer.read_text() == "1"
    finally:
        os.close(master)
        os.close(slave)
    with serial.serial_for_url("loop://") as ser:
        assert low_latency(ser) == ["ASYNC_LOW_LATENCY: not available for loop:// (not a local serial device)",
                                    "latency_timer: none (not a USB serial adapter with a latency timer)"]


def test_arrival_jitter() -> None:
    """Clumped arrival (an FTDI latency timer: 4 samples of a 400 Hz stream every 10 ms) against the
    same stream arriving evenly; a reconnect gap is not an interval."""
    clumped = ArrivalJitter()
    for k in range(400):
        clumped.add(100.0 + 0.01 * (k // 4))
    p = clumped.percentiles_ms()
    assert p is not None and p["p50"] == 0.0 and p["p99"] == pytest.approx(10.0) and p["max"] == pytest.approx(10.0)
    even = ArrivalJitter()
    for k in range(400):
        even.add(100.0 + 0.0025 * k)
    even.restart()
    even.add(500.0)  # first sample after a reconnect
    p = even.percentiles_ms()
    assert p is not None and p["p50"] == pytest.approx(2.5) and p["max"] == pytest.approx(2.5)
    assert even.summary() == "arrival interval p50 2.5 ms, p99 2.5 ms, max 2.5 ms"
    assert ArrivalJitter().summary() == "arrival interval: no samples yet"

"""The two Xsens backends — Xbus over pyserial and the vendor's ``xsensdeviceapi`` (XDA) — against
the MTi emulator on real pseudo-terminals.  XDA is played by the stand-in module in
``tests/fake_xda`` (the documented API, speaking Xbus to the emulator like the real library does).
The same device data feeds both; their ``imu/<name>`` messages must be identical.  Also: backend
choice and the missing-module error, ``xsens scan`` both ways, XDA disconnect/reconnect,
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

from conftest import ROOT, XBUS_CAPTURES, free_port

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


class Collector:
    def __init__(self) -> None:
        self.msgs: list[dict] = []
        self.lock = threading.Lock()

    def __call__(self, topic: str, msg: dict) -> None:
        schema.validate(topic, msg)
        with self.lock:
            self.msgs.append(msg)

    def wait(self, n: int, timeout: float) -> bool:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if len(self.msgs) >= n:
                return True
            time.sleep(0.02)
        return False


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
        assert all(t1 >= t0 for t0, t1 in zip(ts, ts[1:])) and abs(ts[-1] - time.time()) < 30

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
    got: list[list[dict]] = [[], []]
    with XsensEmulator(tmp_path / "a", frames=frames) as ea, XsensEmulator(tmp_path / "b", frames=frames):
        procs = [_start_driver("auto", ea.link, endpoints[0], env_xbus),
                 _start_driver("auto", tmp_path / "b", endpoints[1], env_xda)]
        try:
            subs = [bus.Subscriber([ep], topics=["imu/"]) for ep in endpoints]
            try:
                deadline = time.monotonic() + 60
                while min(len(g) for g in got) < n and time.monotonic() < deadline:
                    for sub, g in zip(subs, got):
                        r = sub.recv(0.05)
                        while r is not None:
                            assert r[0] == "imu/coupler"
                            g.append(schema.decode(r[0], r[1]))
                            r = sub.recv(0)
            finally:
                for sub in subs:
                    sub.close()
            states: list[str] = []
            while not any(s.startswith("STATUS=") and "p99" in s for s in states):
                states += notify.recv(1000).decode().splitlines()
        finally:
            for p in procs:
                p.terminate()
            errs = [p.communicate(timeout=20)[1].decode() for p in procs]
            notify.close()
    assert [p.returncode for p in procs] == [0, 0], errs
    assert "backend auto: using xbus" in errs[0] and "xsensdeviceapi cannot be imported" in errs[0]
    assert "backend auto: using xda" in errs[1] and "through xsensdeviceapi" in errs[1]
    assert min(len(g) for g in got) >= n
    assert without_t(got[0][:n]) == without_t(got[1][:n])
    assert [m["seq"] for m in got[0][:n]] == list(range(500)) + list(range(501, 1200))
    assert "lost 1" in errs[0] and "lost 1" in errs[1]
    status = next(s for s in states if s.startswith("STATUS=") and "p99" in s)
    assert status.startswith("STATUS=xbus: ") and "arrival interval p50" in status and "lost" in status
    assert "low latency: ASYNC_LOW_LATENCY: not set" in errs[0]  # a pty has no serial_struct: logged, not fatal
    assert "arrival interval p50" in errs[0] and "arrival interval p50" in errs[1]  # exit summary in the log


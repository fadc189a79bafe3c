"""The Xsens driver against the MTi emulator through real pseudo-terminals: configuration
handshake, 400 Hz streaming without loss, injected faults, stall, unplug/replug."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from drivers.emulators.xsens import XsensEmulator
from drivers.xsens.device import DeviceError, XsensDriver
from drivers.xsens.xbus import MID, XbusParser, frame
from estimator_service import schema

from helpers import Collector, wait_until


def spin(t: float):
    return [0.0, 0.0, 0.5], [0.1, 0.0, 9.81], [math.cos(0.25 * t), 0.0, 0.0, math.sin(0.25 * t)]


@contextmanager
def running(driver: XsensDriver, join_s: float = 5.0) -> Iterator[threading.Thread]:
    """The driver's run loop in a thread for the block; then its stop event set and the thread joined (``join_s``)."""
    stop = threading.Event()
    th = threading.Thread(target=driver.run, args=(stop,), daemon=True)
    th.start()
    try:
        yield th
    finally:
        stop.set()
        th.join(join_s)


def test_configuration_handshake(tmp_path: Path) -> None:
    import serial

    with XsensEmulator(tmp_path / "mti", rate_hz=100) as emu:
        drv = XsensDriver(str(emu.link), "coupler", Collector(), rate_hz=400)
        with serial.serial_for_url(str(emu.link), timeout=0.05) as ser:
            info = drv.configure(ser)
        assert info.product_code.startswith("MTi-300") and info.device_id == XsensEmulator.DEVICE_ID
        assert info.firmware == "1.8.2"
        assert emu.measuring and emu.rate_hz == 400  # SetOutputConfiguration applied, back to measurement
        with serial.serial_for_url(str(emu.link), timeout=0.05) as ser:  # unsupported request: Error message
            ser.write(frame(0x7F))
            with pytest.raises(DeviceError, match="Error code"):
                drv._request(ser, 0x7F, b"", 0x80)


def test_streaming_400hz_for_4_s_without_loss_across_the_counter_wrap(tmp_path: Path) -> None:
    sink = Collector()
    emu = XsensEmulator(tmp_path / "mti", rate_hz=100, source=spin)
    emu.counter = 2**16 - 400  # the 16-bit PacketCounter wraps during the run (after ~1 s)
    with emu:
        drv = XsensDriver(str(emu.link), "coupler", sink, rate_hz=400)
        with running(drv):
            assert sink.wait(10, 5)
            first = len(sink.msgs)
            assert sink.wait(first + 1600, 120)  # 4 s of the device's time at 400 Hz
    seqs = [m["seq"] for m in sink.msgs]
    assert len(seqs) - first >= 1560  # 400 Hz for 4 s
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # contiguous across the 16-bit wrap too
    assert emu.counter > 2**16  # the device's PacketCounter wrapped during the run; seq did not
    assert drv.lost == 0 and drv.parser.errors.as_dict() == {"garbage_bytes": 0, "bad_checksum": 0, "truncated": 0, "oversize": 0}
    dev_t = [m["dev_t"] for m in sink.msgs]
    assert all(b - a == pytest.approx(0.0025, abs=1e-4) for a, b in zip(dev_t, dev_t[1:], strict=False))
    m = sink.msgs[-1]
    assert m["gyr"] == pytest.approx([0.0, 0.0, 0.5]) and m["acc"] == pytest.approx([0.1, 0.0, 9.81], rel=1e-6)


def test_faults_stall_and_replug(tmp_path: Path) -> None:
    sink = Collector()
    with XsensEmulator(tmp_path / "mti", rate_hz=100, source=spin) as emu:
        drv = XsensDriver(str(emu.link), "rocker", sink, rate_hz=200, silence_s=0.5)
        with running(drv):
            assert sink.wait(20, 5)
            emu.garbage(3)
            emu.bad_checksum(2)
            emu.truncate(2)
            errors = drv.parser.errors
            # a truncated frame followed by the next frame's bytes may be seen as a bad checksum, so count
            # the damaged frames together; wait for the parser to have seen all four
            deadline = time.monotonic() + 10
            while errors.bad_checksum + errors.truncated + errors.oversize < 4 and time.monotonic() < deadline:
                sink.wait(len(sink.msgs) + 1, 0.1)
            assert errors.bad_checksum >= 2 and errors.bad_checksum + errors.truncated + errors.oversize >= 4
            assert errors.garbage_bytes > 0
            assert drv.lost >= 4  # the corrupted samples are counted as lost by seq
            emu.stall(1.0)  # silent longer than silence_s: the driver reconnects and reconfigures
            assert wait_until(lambda: drv.stats.silent >= 1, 20)
            n = len(sink.msgs)
            assert sink.wait(n + 50, 10)
            emu.unplug()
            assert wait_until(lambda: drv.stats.vanished + drv.stats.open_failures >= 1, 20)
            n = len(sink.msgs)
            emu.replug()
            assert sink.wait(n + 50, 10)  # resumed without a restart
    assert drv.stats.connects >= 3 and drv.stats.vanished + drv.stats.open_failures >= 1
    seqs = [m["seq"] for m in sink.msgs]
    assert seqs == sorted(seqs)


def test_stall_and_unplug_show_as_lost_samples(tmp_path: Path) -> None:
    """A stall (the device runs on, its samples are never sent) and an unplug/replug (the device
    restarts) are reconnections; seq advances by the samples missed, not by one."""
    sink = Collector()
    with XsensEmulator(tmp_path / "mti", rate_hz=100, source=spin) as emu:
        drv = XsensDriver(str(emu.link), "coupler", sink, rate_hz=100, silence_s=0.3, backoff_max_s=0.2)
        with running(drv):
            assert sink.wait(50, 5)
            emu.stall(1.0)
            n = len(sink.msgs)
            assert sink.wait(n + 50, 10) and drv.stats.silent >= 1
            n = len(sink.msgs)
            emu.unplug()
            assert wait_until(lambda: drv.stats.vanished + drv.stats.open_failures > 0, 20)
            time.sleep(0.5)  # paces the scenario: the device stays unplugged for 0.5 s (not a wait for an event)
            emu.replug()
            assert sink.wait(n + 50, 10)
    msgs = sink.msgs
    jumps = [(b["seq"] - a["seq"], a, b) for a, b in zip(msgs, msgs[1:], strict=False) if b["seq"] - a["seq"] != 1]
    assert all(j > 1 for j, _, _ in jumps) and len(jumps) == 2
    (stall, a, b), (unplug, c, d) = jumps
    # the stall: the device clock ran on, so seq is its sample index: 1 s at 100 Hz (exact)
    # (the emulator's stall lasts at least the 1 s asked for; longer when the machine is loaded)
    assert stall == round((b["dev_t"] - a["dev_t"]) * 100) and stall >= 97
    # the unplug: the device restarted (its clock from 0); the host clock spans the outage (>= 0.5 s)
    assert d["dev_t"] < c["dev_t"] and unplug >= 50
    # (seq advances by host monotonic time between handling the two samples; the message times are
    # device-mapped, so a loaded machine's handling delay separates the two by a few samples)
    assert abs(unplug - (d["t"] - c["t"]) * 100) <= 10
    assert drv.lost == stall - 1 + unplug - 1


def test_a_late_read_before_a_silence_keeps_seq_on_the_device_clock(tmp_path: Path) -> None:
    """The driver reads the device's last samples before a stall late (its host starved, or they sat in
    a USB adapter): across the reconnect the device clock advanced by the stall plus that delay, more
    than the host time since those samples were handled.  The device ran on, so seq still follows its
    clock: the stall's samples are counted as lost exactly (as the encoders' board-reset check, which
    mistook the same delay for a board reset in CI)."""
    sink = Collector()
    held, release = threading.Event(), threading.Event()

    def starved(topic: str, msg: dict) -> None:
        if len(sink.msgs) == 50 and not held.is_set():
            held.set()
            release.wait(30)
        sink(topic, msg)

    with XsensEmulator(tmp_path / "mti", rate_hz=100, source=spin) as emu:
        drv = XsensDriver(str(emu.link), "coupler", starved, rate_hz=100, silence_s=0.3, backoff_max_s=0.2)
        with running(drv):
            assert held.wait(10)
            sent = emu.sent
            assert wait_until(lambda: emu.sent >= sent + 40, 30)  # the device's last samples wait in the pty
            emu.stall(60.0)
            time.sleep(0.8)  # paces the scenario: the driver starved for 0.8 s (not a wait for an event)
            release.set()
            assert wait_until(lambda: drv.stats.silent > 0, 30)  # the backlog read, then the silence seen
            n = len(sink.msgs)
            emu.stall(0.0)  # the device's samples are sent again
            assert sink.wait(n + 50, 10)
    msgs = sink.msgs
    jumps = [(b["seq"] - a["seq"], a, b) for a, b in zip(msgs, msgs[1:], strict=False) if b["seq"] - a["seq"] != 1]
    assert len(jumps) == 1
    stall, a, b = jumps[0]
    assert b["dev_t"] > a["dev_t"] + 0.8 and stall == round((b["dev_t"] - a["dev_t"]) * 100)
    assert drv.lost == stall - 1


def test_driver_ignores_noise_between_answers(tmp_path: Path) -> None:
    """A WakeUp or MTData2 frames arriving during configuration do not confuse the handshake."""
    p = XbusParser()
    stream = frame(MID.WAKEUP) + frame(MID.MTDATA2, b"") + b"\x00\x11" + frame(MID.GOTO_CONFIG_ACK)
    assert [m.mid for m in p.feed(stream)] == [MID.WAKEUP, MID.MTDATA2, MID.GOTO_CONFIG_ACK]


def test_set_baud_rate_then_reopen(tmp_path: Path) -> None:
    sink = Collector()
    with XsensEmulator(tmp_path / "mti", rate_hz=100, source=spin) as emu:
        drv = XsensDriver(str(emu.link), "coupler", sink, rate_hz=400, set_baud=921600)
        with running(drv):
            assert sink.wait(100, 10)
    assert emu.baud_code == 0x80 and drv.baudrate == 921600 and drv.stats.connects >= 2
    with pytest.raises(ValueError, match="unsupported baud rate"):
        XsensDriver("loop://", "x", sink, set_baud=123)


def test_no_answer_names_port_and_message(tmp_path: Path) -> None:
    """A pty nobody answers on: the configuration fails with the port and the unanswered message."""
    import os

    import serial

    master, slave = os.openpty()
    try:
        port = os.ttyname(slave)
        drv = XsensDriver(port, "coupler", Collector(), timeout_s=0.1)
        with serial.serial_for_url(port, timeout=0.02) as ser:
            with pytest.raises(DeviceError, match=rf"{port}: no GoToConfigAck \(0x31\) answer to GoToConfig \(0x30\)"):
                drv.configure(ser)
        assert os.read(master, 100) == frame(MID.GOTO_CONFIG) * 3  # three tries
        slow = XsensDriver(port, "coupler", Collector(), timeout_s=600.0)  # 3 tries = 30 min per request
        with running(slow, join_s=60.0) as th:  # a bound far below its tries: only the stop can end the wait
            assert os.read(master, 100).startswith(frame(MID.GOTO_CONFIG))  # it waits for an answer now
        assert not th.is_alive()
    finally:
        os.close(master)
        os.close(slave)


def test_device_restart_while_measuring(tmp_path: Path) -> None:
    """The device restarts without losing USB (WakeUp, counters from 0): the driver acknowledges the
    WakeUp, configures it again on the same connection, and seq advances by the sample periods the
    restart took (host clock: the device clock restarted), never backwards."""
    sink = Collector()
    with XsensEmulator(tmp_path / "mti", rate_hz=100, source=spin) as emu:
        drv = XsensDriver(str(emu.link), "coupler", sink, rate_hz=200)
        with running(drv):
            assert sink.wait(200, 5)
            emu.power_cycle()
            n = len(sink.msgs)
            assert sink.wait(n + 100, 5)
    assert drv.stats.board_resets == 1 and drv.stats.connects == 1  # no reconnect needed
    assert emu.injected["power_cycles"] == 1 and emu.rate_hz == 200  # configured again after the restart
    seqs = [m["seq"] for m in sink.msgs]
    dev_t = [m["dev_t"] for m in sink.msgs]
    back = [k for k in range(1, len(dev_t)) if dev_t[k] < dev_t[k - 1]]
    assert len(back) == 1 and dev_t[back[0] - 1] > 0.9 and dev_t[back[0]] < 0.2  # the device clock restarted
    k = back[0]
    assert seqs[:k] == list(range(seqs[0], seqs[0] + k)) and seqs[k:] == list(range(seqs[k], seqs[k] + len(seqs) - k))
    restart = seqs[k] - seqs[k - 1]  # >= 1; the sample periods of the restart on the host clock
    assert restart >= 1 and drv.lost == restart - 1
    # seq advanced by the silent time (host monotonic clock, taken when each sample is handled) at
    # 200 Hz; the message times are the device-mapped ones, so a loaded machine's handling delay of
    # the last sample before the restart (tens of ms) separates the two
    assert abs(restart - (sink.msgs[k]["t"] - sink.msgs[k - 1]["t"]) * 200) <= 10


def test_rigstate_driver_xsens_process(tmp_path: Path, endpoint: str) -> None:
    """``rigstate driver xsens`` as a process: publishes schema-valid imu/<name> on a real ZeroMQ
    socket, notifies systemd (READY, WATCHDOG, STATUS on a real unix socket), stops on SIGTERM."""
    import os
    import signal
    import socket
    import subprocess
    import sys

    from estimator_service import bus

    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(tmp_path / "notify"))
    notify.settimeout(5)
    env = dict(os.environ, NOTIFY_SOCKET=str(tmp_path / "notify"), WATCHDOG_USEC="200000")
    cmd = [sys.executable, "-m", "estimator_service.cli", "driver", "xsens", "--port", str(tmp_path / "mti"),
           "--name", "coupler", "--rate", "400", "--endpoint", endpoint]
    got: list[dict] = []
    with XsensEmulator(tmp_path / "mti", rate_hz=100, source=spin) as emu:
        proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            with bus.Subscriber([endpoint], topics=["imu/"]) as sub:
                deadline = time.monotonic() + 20
                while len(got) < 400 and time.monotonic() < deadline:
                    r = sub.recv(0.2)
                    if r is not None:
                        assert r[0] == "imu/coupler"
                        got.append(schema.decode(r[0], r[1]))
            states: list[str] = []
            while not ("READY=1" in states and "WATCHDOG=1" in states and any(s.startswith("STATUS=") for s in states)):
                states += notify.recv(1000).decode().splitlines()
        finally:
            proc.send_signal(signal.SIGTERM)
            _, err = proc.communicate(timeout=10)
            notify.close()
        assert emu.rate_hz == 400
    assert proc.returncode == 0, err.decode()
    assert b"published" in err and b"lost 0" in err
    assert len(got) >= 400
    seqs = [m["seq"] for m in got]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
    assert got[-1]["gyr"] == pytest.approx([0.0, 0.0, 0.5]) and len(got[-1]["quat"]) == 4
    status = next(s for s in states if s.startswith("STATUS="))
    assert "samples" in status and "lost" in status
    bad_rate = subprocess.run(cmd[:-4] + ["--rate", "1000", "--endpoint", endpoint], capture_output=True, timeout=60)
    assert bad_rate.returncode == 2 and b"--rate 1000: an MTi outputs 1 to 400 Hz" in bad_rate.stderr
    rig = Path(__file__).resolve().parents[1] / "config" / "rigs" / "fourbar-sensors2016.toml"
    bad_name = subprocess.run(cmd[:7] + ["--name", "nosuch", "--config", str(rig)], capture_output=True, timeout=60)
    assert bad_name.returncode == 2 and b"no [[imu]] named 'nosuch'" in bad_name.stderr


def test_counter_unwrapping() -> None:
    """SampleTimeFine (32-bit, 10 kHz: wraps after 119 h) and PacketCounter (16-bit) unwrap to
    continuous counts; a gap stays a gap."""
    from drivers.xsens.stream import Unwrap

    fine = Unwrap(32)
    assert [fine.update(r) for r in (2**32 - 25, 2**32 - 1, 24, 49)] == [2**32 - 25, 2**32 - 1, 2**32 + 24, 2**32 + 49]
    seq = Unwrap(16)
    assert [seq.update(r) for r in (65534, 65535, 0, 5)] == [65534, 65535, 65536, 65541]

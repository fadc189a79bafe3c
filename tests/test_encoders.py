"""Encoder drivers: counterboard v1 protocol and parser, counts -> angle, serial driver through real
pseudo-terminals (emulated board with faults, unplug/replug), Phidget22 backend logic."""

from __future__ import annotations

import argparse
import ctypes.util
import dataclasses
import functools
import math
import operator
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from drivers.emulators.counter_board import CounterBoardEmulator, steady_rotation
from drivers.encoders import cli as enc_cli
from drivers.encoders.channel import ClockMapper, CountScale, EncoderChannel
from drivers.encoders.phidget import PhidgetEncoderDriver, import_encoder_class
from drivers.encoders.protocol import (KEEP, MAX_LINE, CountLine, HelloLine, LineParser, Unwrapper,
                                       count_line, hello_line, wrap_int32)
from drivers.encoders.serial_board import SerialBoardDriver
from estimator_service import bus, schema
from estimator_service.errors import UserError

from helpers import wait_until


# ------------------------------------------------------------------ protocol
def test_line_bytes_and_checksum():
    payload = b"E 1 -2147483648 4294967295 "
    xor = functools.reduce(operator.xor, payload)
    assert count_line(1, -(2**31), 2**32 - 1) == payload + b"*%02X\n" % xor
    assert count_line(1, 2**31, 2**32 + 5) == b"E 1 -2147483648 5 *%02X\n" % functools.reduce(
        operator.xor, b"E 1 -2147483648 5 ")
    assert hello_line(2) == b"I counterboard v1 2 *%02X\n" % functools.reduce(operator.xor, b"I counterboard v1 2 ")
    assert [wrap_int32(v) for v in (2**31 - 1, 2**31, -(2**31) - 1, 2**32 + 7)] == [2**31 - 1, -(2**31), 2**31 - 1, 7]
    p = LineParser()
    assert p.feed(hello_line(2) + count_line(0, -5, 123) + b"E 1 7 9 *%02X\r\n" % functools.reduce(
        operator.xor, b"E 1 7 9 ")) == [HelloLine(1, 2), CountLine(0, -5, 123), CountLine(1, 7, 9)]
    assert p.errors == {"garbage": 0, "checksum": 0, "truncated": 0, "overlong": 0}


def test_parser_counts_each_kind_and_keeps_good_lines():
    good = [count_line(0, i * 1000 - 3, 4_000_000_000 + i) for i in range(6)]
    bad_sum = good[1][:-3] + b"%02X\n" % (int(good[1][-3:-1], 16) ^ 1)
    stream = (b"\x00\xffnoise\n" + good[0] + bad_sum + b"\n\r\n"
              + good[2][:9] + b"\n"            # truncated, with its newline
              + good[3][:7] + good[4]          # truncated, next record glued on: recovered
              + b"E 0 1 2 *ZZ\n"               # no valid tail -> truncated
              + b"x" * 300 + good[5]           # overlong, record at its end recovered
              + count_line(0, 1, 2)[:-3] + b"Q\n"  # record with a one-digit tail: truncated
              + b"E 300 1 2 *%02X\n" % functools.reduce(operator.xor, b"E 300 1 2 ")  # channel out of range
              + b"hello world*%02X\n" % functools.reduce(operator.xor, b"hello world"))  # valid sum, unknown
    p = LineParser()
    recs = p.feed(stream)
    assert recs == [CountLine(0, -3, 4_000_000_000), CountLine(0, 3997, 4_000_000_004),
                    CountLine(0, 4997, 4_000_000_005)]
    assert p.errors == {"garbage": 3, "checksum": 1, "truncated": 4, "overlong": 1}
    assert p.records == 3


def _mutate(rng: random.Random, line: bytes) -> bytes:
    b = bytearray(line)
    for _ in range(rng.randint(1, 3)):
        op = rng.randrange(5)
        i = rng.randrange(len(b) + 1)
        if op == 0 and b:
            b[min(i, len(b) - 1)] ^= 1 << rng.randrange(8)
        elif op == 1 and b:
            del b[min(i, len(b) - 1)]
        elif op == 2:
            b.insert(i, rng.randrange(256))
        elif op == 3:
            b[i:i] = b[: rng.randrange(len(b) + 1)]
        else:
            b[i:i] = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 400)))
    return bytes(b)


def test_parser_fuzz_never_raises_bounded_and_chunking_invariant():
    rng = random.Random(1234)
    parts = []
    for _ in range(3000):
        line = count_line(rng.randrange(4), rng.randrange(-(2**31), 2**31), rng.randrange(2**32))
        r = rng.random()
        parts.append(line if r < 0.5 else _mutate(rng, line) if r < 0.9
                     else bytes(rng.randrange(256) for _ in range(rng.randrange(1, 200))))
    stream = b"".join(parts)
    whole = LineParser()
    expected = whole.feed(stream)
    chunked = LineParser()
    got, pos, max_buf = [], 0, 0
    while pos < len(stream):
        n = rng.choice((1, 2, 7, 33, 500, 4096))
        got += chunked.feed(stream[pos:pos + n])
        pos += n
        max_buf = max(max_buf, chunked.buffered)
    assert got == expected and chunked.errors == whole.errors
    assert max_buf <= MAX_LINE
    assert sum(whole.errors.values()) > 1000 and len(expected) > 1400
    for rec in expected:  # every record returned is well-formed
        assert isinstance(rec, (CountLine, HelloLine))
        if isinstance(rec, CountLine):
            assert 0 <= rec.channel <= 255 and -(2**31) <= rec.count < 2**31 and 0 <= rec.micros < 2**32
    # a megabyte without newline: memory stays bounded, then parsing continues
    p = LineParser()
    for _ in range(256):
        assert p.feed(bytes(rng.randrange(256) for _ in range(4096)).replace(b"\n", b"")) == []
        assert p.buffered <= MAX_LINE
    assert p.feed(b"\n" + count_line(1, 5, 6)) == [CountLine(1, 5, 6)]
    assert p.errors["overlong"] == 1 and p.buffered == 0
    assert KEEP > len(count_line(255, -(2**31), 2**32 - 1))


def test_unwrapper_extends_wrapping_fields():
    u = Unwrapper()
    raws = [2**31 - 10, 2**31 - 1, -(2**31), -(2**31) + 100, 2**31 - 5, -3, 4]
    assert [u.update(r) for r in raws] == [2**31 - 10, 2**31 - 1, 2**31, 2**31 + 100, 2**31 - 5, -3, 4]
    m = Unwrapper()
    assert [m.update(r) for r in (2**32 - 2, 2**32 - 1, 0, 3, 2**31 + 2)] == [
        2**32 - 2, 2**32 - 1, 2**32, 2**32 + 3, 2**32 + 2**31 + 2]
    m.rebase(1000)
    assert m.update(5) == 1005 and m.update(2**32 - 1) == 999


SKETCH_DIR = Path(__file__).resolve().parents[1] / "tools" / "counter_board"


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs a C++ compiler to run the sketch on the host")
def test_sketch_speaks_the_protocol(tmp_path):
    """counter_board.ino compiled on the host with a shim of the Arduino calls, fed quadrature edges."""
    exe = tmp_path / "harness"
    subprocess.run(["g++", "-std=c++17", "-Wall", "-Werror", "-I", str(SKETCH_DIR), "-o", str(exe),
                    str(SKETCH_DIR / "host_harness.cpp")], check=True, capture_output=True)
    out = subprocess.run([str(exe), str(2**32 - 1_000_000), "30000", "10000"], check=True,
                         capture_output=True, timeout=60).stdout
    p = LineParser()
    recs = p.feed(out)
    assert p.errors == {"garbage": 0, "checksum": 0, "truncated": 0, "overlong": 0} and p.buffered == 0
    assert recs[0] == HelloLine(1, 2) and recs.count(HelloLine(1, 2)) == 2  # reset + "?" command
    for channel, final, sign in ((0, 30000, 1), (1, -10000, -1)):
        lines = [r for r in recs if isinstance(r, CountLine) and r.channel == channel]
        counts = [r.count for r in lines]
        assert counts[-1] == final and all(sign * (b - a) >= 0 for a, b in zip(counts, counts[1:], strict=False))
        u = Unwrapper()
        micros = [u.update(r.micros) for r in lines]
        assert micros[-1] > 2**32  # the board clock wrapped
        assert all(990 <= b - a <= 1010 for a, b in zip(micros[1:], micros[2:], strict=False))  # "R 1000" took effect
        assert len(lines) > 1900


# ------------------------------------------------------------------ conversion
def test_counts_to_angle_exact():
    s = CountScale(lines=1024, offset=-0.25)
    assert s.cpr == 4096
    for k in range(-3, 4):
        assert s.angle(k * 4096) == -0.25 + k * math.tau
    assert s.angle(1024) == -0.25 + math.pi / 2 and s.angle(-2048) == -0.25 - math.pi
    assert s.angle(3 * 2**33 + 5) == -0.25 + math.tau * (3 * 2**33 + 5) / 4096
    with pytest.raises(ValueError, match="lines"):
        CountScale(0)
    got = []
    ch = EncoderChannel("crank", CountScale(500, 1.0), lambda topic, msg: got.append((topic, msg)))
    ch.sample(2000, 0.0, 10.0)
    ch.sample(-1000, 0.001, 10.003)
    # t: device time on the host clock; the offset may creep by the skew bound (2e-4) of elapsed time
    assert [t for _, m in got for t in [m.pop("t")]] == [10.0, pytest.approx(10.001 + 2e-4 * 0.001, abs=1e-12)]
    assert got == [("enc/crank", {"seq": 0, "count": 2000, "cpr": 2000, "angle": 1.0 + math.tau}),
                   ("enc/crank", {"seq": 1, "count": -1000, "cpr": 2000, "angle": 1.0 - math.pi})]


def test_clock_mapper_takes_the_fastest_path_and_never_runs_ahead():
    rng = random.Random(7)
    cm = ClockMapper()
    out = []
    for k in range(4000):
        t_dev = k * 0.0025
        t_recv = 1000.0 + t_dev + 0.001 + rng.expovariate(1 / 0.004)
        t = cm.host_time(t_dev, t_recv)
        assert t <= t_recv
        out.append(t - t_dev)
    assert max(abs(o - 1000.001) for o in out[200:]) < 0.0015  # jitter up to ~30 ms removed
    ts = [k * 0.0025 + o for k, o in enumerate(out)]
    assert all(b >= a for a, b in zip(ts, ts[1:], strict=False))


# ------------------------------------------------------------------ serial driver through a pty
class Rig:
    """An emulated board on a pty and a SerialBoardDriver reading it in a thread."""

    def __init__(self, tmp_path, names=("crank", "rocker"), silence_s: float = 1.0, **emu_kw) -> None:
        self.emu = CounterBoardEmulator(tmp_path / "counterboard", record=100_000, **emu_kw).start()
        self.msgs: dict[str, list[dict]] = {n: [] for n in names}
        chans = {c: EncoderChannel(n, CountScale(1024, 0.5), self._sink) for c, n in enumerate(names)}
        self.driver = SerialBoardDriver(str(self.emu.link), chans, silence_s=silence_s, backoff_s=0.05,
                                        backoff_max_s=0.4)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.driver.run, args=(self.stop,))
        self.thread.start()
        self.wait(lambda: len(self.msgs[names[0]]) > 10)

    def _sink(self, topic: str, msg: dict) -> None:
        self.msgs[topic.removeprefix("enc/")].append(msg)

    def wait(self, cond: Callable[[], bool], timeout: float = 10.0) -> None:
        assert wait_until(cond, timeout), "timed out"

    def n(self, name: str = "crank") -> int:
        return len(self.msgs[name])

    def finish(self, drain: bool = True) -> None:
        """Silence the board, stop both; with ``drain`` first wait until the driver has read every line the
        board sent (each channel's last message is its last good line: the board's own counts, no reset)."""
        self.emu.stall(60.0)  # the emulator writes under the lock stall() takes: nothing is written after it
        if drain:
            last = {c: count for c, count, _ in self.emu.sent}
            names = list(self.msgs)

            def read_all() -> bool:
                return all(self.msgs[names[c]] and wrap_int32(self.msgs[names[c]][-1]["count"]) == count
                           for c, count in last.items())

            assert wait_until(read_all, 30), "the driver did not read the board's last lines"
        self.stats = dataclasses.replace(self.driver.stats)  # before the final unplug
        self.emu.stop()
        self.stop.set()
        self.thread.join(5)
        assert not self.thread.is_alive()

    def sent(self, channel: int) -> list[tuple[int, int]]:
        return [(count, micros) for c, count, micros in self.emu.sent if c == channel]


def _assert_seq_follows_board_clock(msgs: list[dict], micros: list[int], period_us: float) -> None:
    """seq is the board's sample index: each step is the board-clock interval in line periods."""
    steps = [(b - a) % 2**32 for a, b in zip(micros, micros[1:], strict=False)]
    assert [b["seq"] - a["seq"] for a, b in zip(msgs, msgs[1:], strict=False)] == [round(s / period_us) for s in steps]


def _assert_received_all(rig: Rig, channel: int, name: str) -> list[dict]:
    """Every good line the board sent from the first received one on arrived, in order, and converts
    exactly; lines lost to faults show as gaps in seq (by the board clock)."""
    msgs = rig.msgs[name]
    sent = rig.sent(channel)
    first = next(i for i, (count, _) in enumerate(sent) if count == wrap_int32(msgs[0]["count"]))
    assert [wrap_int32(m["count"]) for m in msgs] == [c for c, _ in sent[first:first + len(msgs)]]
    assert len(msgs) == len(sent) - first
    _assert_seq_follows_board_clock(msgs, [mu for _, mu in sent[first:]], 1e6 * rig.emu.period)
    assert msgs[-1]["seq"] - msgs[0]["seq"] == len(msgs) - 1 + rig.driver.channels[channel].lost
    for m in msgs:
        assert m["cpr"] == 4096 and m["angle"] == 0.5 + math.tau * m["count"] / 4096
    return msgs


def test_serial_streaming_400hz_4s_no_loss_across_wraparound(tmp_path):
    """4 s at 400 Hz: the int32 counter wraps after ~0.7 s (4096 counts a revolution at 1 rev/s), the board's
    microsecond clock after 2 s."""
    rig = Rig(tmp_path, rate_hz=400.0, count_start=2**31 - 3000, micros_start=2**32 - 2_000_000,
              angles=[steady_rotation(1.0), steady_rotation(-0.5)])
    rig.wait(lambda: rig.n() >= 1600, timeout=20)
    rig.finish()
    for channel, name, sign in ((0, "crank", 1), (1, "rocker", -1)):
        msgs = _assert_received_all(rig, channel, name)
        counts = [m["count"] for m in msgs]
        steps = [b - a for a, b in zip(counts, counts[1:], strict=False)]
        assert all(0 <= sign * s <= 12 for s in steps)  # 1 or 0.5 rev/s at 400 Hz: no wrap jump
        ts = [m["t"] for m in msgs]
        assert all(0 <= b - a < 0.5 for a, b in zip(ts, ts[1:], strict=False))  # board clock wrapped without a jump
        assert abs((ts[-1] - ts[0]) - (len(ts) - 1) / 400.0) < 0.05
    assert rig.msgs["crank"][-1]["count"] > 2**31  # the int32 counter wrapped, the count did not
    for m in rig.msgs["crank"]:  # valid enc/ messages, unchanged by the wire format
        assert schema.decode("enc/crank", schema.encode("enc/crank", m)) == m
    assert rig.n() >= 1600
    assert rig.driver.parser.errors == {"garbage": 0, "checksum": 0, "truncated": 0, "overlong": 0}
    assert rig.stats.vanished == 0 and rig.stats.silent == 0 and rig.stats.connects == 1


def test_serial_faults_counted_and_dropped_good_lines_pass(tmp_path):
    rig = Rig(tmp_path, rate_hz=400.0)
    for fault, n in ((rig.emu.garbage, 3), (rig.emu.bad_checksum, 2), (rig.emu.truncate, 2),
                     (rig.emu.garbage, 1), (rig.emu.truncate, 1)):
        fault(n)
        time.sleep(0.1)  # paces the producer: one kind of fault after another, about 40 lines apart
    rig.wait(lambda: rig.n() > 200)
    rig.finish()
    assert rig.emu.injected["garbage"] == 4 and rig.emu.injected["checksum"] == 2
    assert rig.driver.parser.errors == {"garbage": 4, "checksum": 2, "truncated": 3, "overlong": 0}
    crank = _assert_received_all(rig, 0, "crank")
    _assert_received_all(rig, 1, "rocker")
    # each corrupted line is one lost sample of its channel (faults hit channel 0 then 1 in turn)
    assert rig.driver.channels[0].lost + rig.driver.channels[1].lost == 2 + 3
    assert crank[-1]["seq"] == len(crank) - 1 + rig.driver.channels[0].lost


def test_serial_stall_unplug_replug_and_reset_resume(tmp_path):
    rig = Rig(tmp_path, rate_hz=400.0, silence_s=0.3)
    d = rig.driver
    # stall: reported as silence, the driver reconnects and resumes
    n = rig.n()
    rig.emu.stall(0.8)
    rig.wait(lambda: d.stats.silent >= 1)
    rig.wait(lambda: rig.n() > n + 300)
    # unplug, replug without board reset: the counter kept running, counts continue exactly
    resets = d.stats.board_resets
    rig.emu.unplug()
    rig.wait(lambda: d.stats.vanished == 1 and d.stats.open_failures >= 1)
    time.sleep(0.3)  # paces the scenario: the board stays unplugged for 0.3 s (not a wait for an event)
    rig.emu.replug(reset=False)
    n = rig.n()
    rig.wait(lambda: rig.n() > n + 100)
    assert d.stats.board_resets == resets
    # unplug, replug as a freshly reset board (its hello line is flushed on open: clock jump detects it)
    last = rig.msgs["crank"][-1]
    rig.emu.unplug()
    rig.wait(lambda: d.stats.vanished == 2)
    rig.emu.replug(reset=True)
    rig.wait(lambda: d.stats.board_resets == resets + 1 and rig.n() > n + 200)
    # reset while connected: hello line received
    rig.emu.reset()
    rig.wait(lambda: d.stats.board_resets == resets + 2 and d.board_channels == 2)
    n = rig.n()
    rig.wait(lambda: rig.n() > n + 100)
    rig.finish(drain=False)  # (counts re-based by the resets; what was read is checked for consistency)
    msgs = rig.msgs["crank"]
    seqs = [m["seq"] for m in msgs]
    jumps = [b - a for a, b in zip(seqs, seqs[1:], strict=False)]
    assert min(jumps) >= 1 and seqs[-1] - seqs[0] == len(msgs) - 1 + d.channels[0].lost
    # lost samples: the 0.8 s stall at 400 Hz (>= 320; more when the loaded emulator wakes late), then
    # the unplug (>= 0.3 s); exactly what the board clock says (checked below)
    big = [j for j in jumps if j > 5]
    assert len(big) >= 3 and 318 <= big[0] - 1 <= 360 and big[1] - 1 >= 120
    # until the first board reset seq is the board's sample index (exact, by the board clock)
    after = msgs.index(last) + 1
    by_count: dict[int, int] = {}
    for c, mu in rig.sent(0):
        by_count.setdefault(c, mu)  # the first time: raw counts repeat after the reset
    _assert_seq_follows_board_clock(msgs[:after], [by_count[m["count"]] for m in msgs[:after]], 2500.0)
    # across the reset replug the host clock spans the outage: seq agrees with it within 2 %
    gap = msgs[after]["seq"] - last["seq"]
    assert abs(gap - (msgs[after]["t"] - last["t"]) * 400) <= 0.02 * gap + 3
    counts = [m["count"] for m in msgs]
    steps = [b - a for a, b in zip(counts, counts[1:], strict=False)]
    # steady forward rotation: the count never goes back, also across the two board resets (re-based);
    # it jumps forward after the stall, the unplug (by the motion the board counted) and the reset replug
    assert min(steps) >= 0 and sum(s > 12 for s in steps) <= 3
    assert 0 <= msgs[after]["count"] - last["count"] < 4096  # re-based on the last count before the outage
    sent = {c for c, _ in rig.sent(0)}
    assert all(c in sent for c in counts[:after])  # before the first reset: the board's own counts, exactly
    assert all(0 <= b["t"] - a["t"] < 5 for a, b in zip(msgs, msgs[1:], strict=False))
    assert d.stats.connects >= 4 and d.parser.errors["overlong"] == 0


def test_a_late_read_before_a_silence_is_not_taken_for_a_board_reset(tmp_path):
    """The driver reads the board's last lines before a silence late (its host starved, or the lines
    sat in a USB adapter): across the reconnect the board clock then advances by the silence plus
    that delay, more than the host clock since those lines were received (CI: "board clock advanced
    5.173 s in 4.579 s host time" after the rig was stopped 4 s).  The board kept running: no board
    reset, the counts stay the board's own (a reset re-bases them on the last count: the angle jumped
    by the board's raw count) and the sample times follow the board clock across the silence."""
    rig = Rig(tmp_path, rate_hz=400.0, silence_s=0.3)
    d = rig.driver
    resets = d.stats.board_resets
    held, release = threading.Event(), threading.Event()

    def starved(topic: str, msg: dict) -> None:
        held.set()
        release.wait(30)
        rig._sink(topic, msg)

    d.channels[0].sink = starved
    assert held.wait(10)
    sent = len(rig.emu.sent)
    rig.wait(lambda: len(rig.emu.sent) > sent + 40)  # the board's last lines wait in the pty for the driver
    rig.emu.stall(60.0)
    time.sleep(0.8)  # paces the scenario: the driver starved for 0.8 s (not a wait for an event)
    d.channels[0].sink = rig._sink
    release.set()
    rig.wait(lambda: d.stats.silent >= 1 and d.stats.connects >= 2)  # silence seen, port reopened
    last = rig.msgs["crank"][-1]
    rig.emu.stall(0.0)  # the board's lines resume
    rig.wait(lambda: rig.msgs["crank"][-1]["seq"] > last["seq"] + 100)
    rig.finish()
    assert d.stats.board_resets == resets
    msgs = _assert_received_all(rig, 0, "crank")  # the board's counts, seq by the board clock
    _assert_received_all(rig, 1, "rocker")
    k = msgs.index(last)
    by_count = {c: mu for c, mu in rig.sent(0)}
    board_dt = ((by_count[wrap_int32(msgs[k + 1]["count"])] - by_count[wrap_int32(last["count"])]) % 2**32) * 1e-6
    assert board_dt > 1.0 and abs((msgs[k + 1]["t"] - last["t"]) - board_dt) < 0.05


def test_serial_driver_over_socket_url_reconnects(tmp_path):
    """--port takes pyserial URLs: a TCP serial server (like ser2net) that drops the connection once."""
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]
    got: list[dict] = []
    chans = {1: EncoderChannel("crank", CountScale(100), lambda t, m: got.append(m))}
    drv = SerialBoardDriver(f"socket://127.0.0.1:{port}", chans, backoff_s=0.05, rate_hz=250)
    stop = threading.Event()
    th = threading.Thread(target=drv.run, args=(stop,))
    th.start()
    commands = b""
    bases: list[int] = []
    for session in range(2):
        conn, _ = srv.accept()
        conn.settimeout(5)
        commands += conn.recv(64)  # sent after the driver's open (which flushes stale input)
        if session == 0:
            t0 = time.monotonic()
        base = round((time.monotonic() - t0) * 1e6)  # the board clock runs on during the outage
        bases.append(base)
        conn.sendall(b"".join(count_line(1, 100 * session + k, base + 1000 * k) for k in range(50)))
        assert wait_until(lambda session=session: len(got) >= 50 * (session + 1), 30)
        conn.close()
    srv.close()
    stop.set()
    th.join(5)
    assert commands == b"R 250\nR 250\n"
    assert [m["count"] for m in got] == list(range(50)) + list(range(100, 150))  # board kept running
    # the board clock says (bases[1] - 49 ms) passed between the sessions' lines at 1 kHz: lost samples
    first = 49 + round((bases[1] - bases[0] - 49_000) / 1000)
    assert [m["seq"] for m in got] == list(range(50)) + list(range(first, first + 50)) and drv.stats.vanished >= 1
    assert first > 50 and chans[1].lost == first - 50
    assert drv.stats.board_resets == 0
    with pytest.raises(UserError, match="foo://x: cannot use this port"):
        SerialBoardDriver("foo://x", chans).run(threading.Event())


# ------------------------------------------------------------------ Phidget22 backend
def test_phidget_position_events_share_the_conversion():
    got: list[tuple[str, dict]] = []
    chans = {2: EncoderChannel("crank", CountScale(360, 0.0), lambda t, m: got.append((t, m)))}
    drv = PhidgetEncoderDriver(chans, serial_number=12345, data_interval_ms=8)
    assert drv.describe(2) == "Phidget encoder serial 12345 channel 2"
    drv._handle("attach", 2)
    for k, d in enumerate((10, 20, -5, 1415)):
        drv._handle("position", 2, d, 8.0, k == 3, 100.0 + 0.008 * (k + 1) + 0.002)
    drv._handle("detach", 2)
    drv._handle("attach", 2)
    drv._handle("position", 2, 1440, 8.0, False, 200.0)
    counts = [m["count"] for _, m in got]
    assert counts == [10, 30, 25, 1440, 2880]
    assert [m["angle"] for _, m in got] == [math.tau * c / 1440 for c in counts]
    assert got[3][1]["angle"] == math.tau and got[4][1]["angle"] == 2 * math.tau
    assert [m["seq"] for _, m in got] == [0, 1, 2, 3, 4] and all(t == "enc/crank" for t, _ in got)
    assert [m["t"] for _, m in got[:4]] == pytest.approx([100.010, 100.018, 100.026, 100.034])
    assert drv.stats.attaches == 2 and drv.stats.detaches == 1 and drv.stats.index_pulses == 1


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # Phidget22's own __del__
def test_phidget_import_path_and_methods():
    try:
        import Phidget22  # noqa: F401
    except ImportError:
        with pytest.raises(UserError, match=r"pip install 'rigstate\[phidgets\]'"):
            import_encoder_class()
        return
    encoder = import_encoder_class()
    assert encoder.__module__ == "Phidget22.Devices.Encoder" and encoder.__name__ == "Encoder"
    for name in ("setDeviceSerialNumber", "setHubPort", "setChannel", "setOnAttachHandler",
                 "setOnDetachHandler", "setOnErrorHandler", "setOnPositionChangeHandler",
                 "setDataInterval", "open", "close"):
        assert callable(getattr(encoder, name)), name
    if ctypes.util.find_library("usb-1.0") is None:  # the wheel's native library cannot load here
        drv = PhidgetEncoderDriver({0: EncoderChannel("crank", CountScale(500), lambda t, m: None)})
        with pytest.raises(UserError, match="install the system package libusb-1.0-0"):
            drv.run(threading.Event())


# ------------------------------------------------------------------ command line
def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    enc_cli.register(p.add_subparsers())
    return p.parse_args(["encoder", *argv])


def test_cli_resolves_encoders_and_names_bad_values():
    specs = enc_cli.encoder_specs(_parse(["--backend", "serial", "--port", "loop://", "--name", "crank",
                                          "--name", "rocker", "--channel", "1", "--channel", "0",
                                          "--lines", "1024", "--offset", "0.1", "--offset", "-0.2",
                                          "--endpoint", "tcp://127.0.0.1:5609"]))
    assert [(s.name, s.channel, s.scale.cpr, s.scale.offset, s.endpoint) for s in specs] == [
        ("crank", 1, 4096, 0.1, "tcp://127.0.0.1:5609"), ("rocker", 0, 4096, -0.2, "tcp://127.0.0.1:5609")]
    base = ["--backend", "serial", "--port", "loop://", "--endpoint", "tcp://127.0.0.1:5609"]
    for argv, match in ((["--name", "a"], "--lines: needed"),
                        (["--name", "a", "--lines", "0"], "--lines: must be a positive integer, got 0"),
                        (["--name", "a", "--name", "b", "--lines", "1", "--lines", "2", "--lines", "3"],
                         r"--lines: give it once or once per --name \(2\), got 3"),
                        (["--name", "a", "--name", "b", "--channel", "0", "--channel", "0", "--lines", "9"],
                         "--channel: channels must be distinct"),
                        (["--name", "a", "--name", "a", "--lines", "9"], "--name: names must be unique")):
        with pytest.raises(UserError, match=match):
            enc_cli.encoder_specs(_parse(base + argv))
    with pytest.raises(UserError, match="--endpoint: needed"):
        enc_cli.encoder_specs(_parse(["--backend", "phidget", "--name", "a", "--lines", "9"]))


RIG = Path(__file__).resolve().parents[1] / "config" / "rigs" / "fourbar-sensors2016.toml"


def test_rigstate_driver_encoder_publishes_on_zmq_and_stops_on_sigterm(tmp_path, endpoint):
    """``rigstate driver encoder`` as a process with the rig's encoders, read through a real ZMQ SUB
    socket on 127.0.0.1 (``endpoint``: a free port, conftest.py); SIGTERM stops it cleanly."""
    link = tmp_path / "counterboard"
    cmd = [sys.executable, "-m", "estimator_service.cli", "driver", "encoder", "--backend", "serial",
           "--port", str(link), "--config", str(RIG), "--name", "crank", "--name", "rocker", "--endpoint", endpoint]
    got: list[tuple[str, dict]] = []
    with CounterBoardEmulator(link, rate_hz=400.0):
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            with bus.Subscriber([endpoint], topics=["enc/"]) as sub:
                deadline = time.monotonic() + 20
                while len(got) < 400 and time.monotonic() < deadline:
                    r = sub.recv(0.2)
                    if r is not None:
                        got.append((r[0], schema.decode(r[0], r[1])))
        finally:
            proc.send_signal(signal.SIGTERM)
            _, err = proc.communicate(timeout=10)
    assert proc.returncode == 0, err.decode()
    assert b"stopped; published enc/crank" in err
    assert len(got) >= 400
    for name, cpr in (("crank", 4096), ("rocker", 40000)):  # lines from the rig: 1024 and 10000
        msgs = [m for t, m in got if t == f"enc/{name}"]
        seqs = [m["seq"] for m in msgs]
        assert seqs == list(range(seqs[0], seqs[0] + len(msgs)))  # nothing lost after subscribing
        assert all(m["cpr"] == cpr and m["angle"] == math.tau * m["count"] / cpr for m in msgs)
    bad = subprocess.run(cmd[:-6] + ["--name", "nosuch", "--endpoint", endpoint], capture_output=True, timeout=60)
    assert bad.returncode == 2 and b"no [[encoder]] named 'nosuch'" in bad.stderr

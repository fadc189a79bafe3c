"""Counter-board emulator: speaks ``counterboard v1`` (docs/encoders.md) on a pseudo-terminal.

The board is reachable at a stable symlink (``link``) to the slave side of an ``os.openpty()``
pair, like a udev ``/dev/serial/by-id`` name.  ``unplug()`` removes the symlink and closes the pty
(the driver's open port fails like a yanked USB device); ``replug()`` creates a new pty behind the
same symlink, optionally as a freshly reset board (hello line, counters and clock from zero).

Counts come from one callable ``angle(t) -> rad`` per channel (t in s since the emulator started;
default: steady rotation), quantised like a quadrature encoder: ``count = floor(cpr angle / 2π)``
with ``cpr = 4 * lines``, plus ``count_start`` at power-on, reported as int32 (wraps).  The board
clock (µs, uint32, wraps) starts at ``micros_start``.  Faults are injected on request, thread-safe:
garbage lines, bad checksums, truncated lines, stalls, unplug/replug.

Run standalone: ``python -m drivers.emulators.counter_board --link /tmp/counterboard0``.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path

from drivers.emulators.pty_link import EmulatedDevice, PtyLink
from drivers.encoders.protocol import count_line, hello_line, wrap_int32

from estimator_service.signals import stop_on_signals

log = logging.getLogger(__name__)

AngleFn = Callable[[float], float]

#: garbage lines use these bytes only, so the parser classifies each one as exactly one garbage line
_GARBAGE_BYTES = bytes(b for b in range(32, 256) if b not in b"*EI\x7f")


def steady_rotation(rev_per_s: float) -> AngleFn:
    """Angle (rad) of a constant rotation at ``rev_per_s`` revolutions per second."""
    return lambda t: math.tau * rev_per_s * t


class CounterBoardEmulator(EmulatedDevice):
    """A ``channels``-channel counter board streaming at ``rate_hz`` on a pty behind ``link``.

    ``record`` > 0 keeps the last ``record`` good ``E`` lines written, as
    ``(channel, count, micros)`` raw protocol values, in :attr:`sent` (for tests).
    """

    def __init__(self, link: str | os.PathLike, *, channels: int = 2, lines: int | Sequence[int] = 1024,
                 angles: Sequence[AngleFn] | None = None, rate_hz: float = 500.0, count_start: int = 0,
                 micros_start: int = 0, seed: int = 0, record: int = 0) -> None:
        self.link = Path(link)
        self.channels = channels
        per_channel = [lines] * channels if isinstance(lines, int) else list(lines)
        if len(per_channel) != channels:
            raise ValueError(f"{len(per_channel)} line counts for {channels} channels")
        self.cprs = [4 * n for n in per_channel]  #: counts per revolution of each channel's encoder
        self.angles = list(angles) if angles is not None else [
            steady_rotation(1.0 / (1 + c)) for c in range(channels)]
        if len(self.angles) != channels:
            raise ValueError(f"{len(self.angles)} angle functions for {channels} channels")
        self.period = 1.0 / rate_hz
        self.sent: deque[tuple[int, int, int]] = deque(maxlen=record or 1)
        self._record = record > 0
        self.injected = {"garbage": 0, "checksum": 0, "truncated": 0, "stalls": 0, "unplugs": 0,
                         "dropped_ticks": 0}
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._pty = PtyLink(self.link)
        self._cmd = bytearray()
        self._pending = {"garbage": 0, "checksum": 0, "truncated": 0}
        self._stall_until = 0.0
        self._t0 = time.monotonic()
        self._boot = self._t0
        self._micros_start = micros_start
        self._count_offset = [count_start] * channels
        self._next = self._t0

    # ---------------------------------------------------------------- lifecycle
    def _power_on(self) -> None:
        """Power-on: clocks from now, hello line."""
        self._t0 = self._boot = self._next = time.monotonic()
        self._cmd.clear()
        self._write(hello_line(self.channels))

    # ---------------------------------------------------------------- faults
    def unplug(self) -> None:
        """Remove the symlink and close the pty, like pulling the USB cable."""
        with self._lock:
            self._unplug()
            self.injected["unplugs"] += 1

    def replug(self, reset: bool = True) -> None:
        """New pty behind the symlink.  ``reset``: the board rebooted (hello line, counters and
        clock restart at zero); else it kept counting (only its USB link was interrupted)."""
        with self._lock:
            self._plug()
            if reset:
                self._reset_board()

    def reset(self) -> None:
        """Reboot while plugged in (watchdog, brown-out): hello line, counters and clock from zero."""
        with self._lock:
            self._reset_board()

    # ---------------------------------------------------------------- internals
    def _plug(self) -> None:
        self._pty.plug()
        self._cmd.clear()

    def _unplug(self) -> None:
        self._pty.unplug()

    def _reset_board(self) -> None:
        """Reboot: clock from zero, counters zero at the current angles, hello line."""
        now = time.monotonic()
        self._boot = self._next = now
        self._micros_start = 0
        self._zero(now)
        self._write(hello_line(self.channels))

    def _zero(self, now: float) -> None:
        """Counters zero at the angles of monotonic time ``now``."""
        t = now - self._t0
        self._count_offset = [-self._quantise(c, self.angles[c](t)) for c in range(self.channels)]

    def _quantise(self, channel: int, angle: float) -> int:
        return math.floor(self.cprs[channel] * angle / math.tau)

    def _write(self, data: bytes) -> int:
        """Write what the pty takes now (never blocks); returns bytes written."""
        return self._pty.write(data)

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                now = time.monotonic()
                if self._pty.plugged:
                    self._commands(now)
                if now >= self._next:
                    if not self._pty.plugged or now < self._stall_until or now - self._next > 1.0:
                        self._next = now + self.period  # board hung or unplugged: ticks are lost
                    else:
                        while self._next <= now:
                            self._tick(self._next)
                            self._next += self.period
                wait = self._next - time.monotonic()
            self._stop.wait(max(0.0, min(wait, 0.01)))

    def _commands(self, now: float) -> None:
        """Execute host commands ``R <hz>``, ``Z``, ``?`` read from the pty."""
        self._cmd += self._pty.read()
        del self._cmd[:-64]
        while b"\n" in self._cmd:
            line, _, rest = bytes(self._cmd).partition(b"\n")
            self._cmd[:] = rest
            parts = line.strip().split()
            if parts[:1] == [b"R"] and len(parts) == 2 and parts[1].isdigit() and 1 <= int(parts[1]) <= 1000:
                self.period = 1.0 / int(parts[1])
                self._next = now
            elif parts == [b"Z"]:
                self._zero(now)
            elif parts == [b"?"]:
                self._write(hello_line(self.channels))

    def _tick(self, t_tick: float) -> None:
        """Write the sample lines of the tick at monotonic time ``t_tick`` (plus pending faults)."""
        micros = (self._micros_start + round((t_tick - self._boot) * 1e6)) % 2**32
        t = t_tick - self._t0
        out = bytearray()
        for _ in range(self._pending["garbage"]):
            n = self._rng.randint(1, 40)
            out += bytes(self._rng.choice(_GARBAGE_BYTES) for _ in range(n)) + b"\n"
        self.injected["garbage"] += self._pending["garbage"]
        self._pending["garbage"] = 0
        good: list[tuple[int, tuple[int, int, int]]] = []
        for c in range(self.channels):
            count = wrap_int32(self._count_offset[c] + self._quantise(c, self.angles[c](t)))
            line = count_line(c, count, micros)
            if self._pending["checksum"]:
                self._pending["checksum"] -= 1
                self.injected["checksum"] += 1
                star = line.rindex(b"*")
                line = line[:star] + b"*%02X\n" % (int(line[star + 1:star + 3], 16) ^ 0x5A)
            elif self._pending["truncated"]:
                self._pending["truncated"] -= 1
                self.injected["truncated"] += 1
                line = line[: self._rng.randint(2, line.rindex(b"*"))]
            else:
                good.append((len(out) + len(line), (c, count, micros)))
            out += line
        written = self._write(bytes(out))
        if written < len(out):
            self.injected["dropped_ticks"] += 1
        if self._record:
            self.sent.extend(sample for end, sample in good if end <= written)


def main(argv: list[str] | None = None) -> int:
    """Command line: run an emulated board with optional periodic faults until SIGINT/SIGTERM."""
    p = argparse.ArgumentParser(prog="python -m drivers.emulators.counter_board",
                                description="Emulated quadrature counter board (counterboard v1) on a pty.")
    p.add_argument("--link", default="/tmp/counterboard0", help="symlink to the pty (default %(default)s)")
    p.add_argument("--channels", type=int, default=2, help="number of channels (default 2)")
    p.add_argument("--lines", type=int, default=1024, help="encoder lines per revolution (cpr = 4 lines)")
    p.add_argument("--rate", type=float, default=500.0, help="line rate per channel, Hz (default 500)")
    p.add_argument("--rev-per-s", type=float, nargs="+", default=None,
                   help="steady rotation speed of each channel, rev/s (default 1/(1+channel))")
    p.add_argument("--count-start", type=int, default=0, help="counts at power-on (test wrap-around near 2**31)")
    p.add_argument("--micros-start", type=int, default=0, help="board clock at power-on, µs (wrap near 2**32)")
    p.add_argument("--garbage-every", type=float, metavar="S", help="inject a garbage line every S seconds")
    p.add_argument("--bad-checksum-every", type=float, metavar="S", help="corrupt a checksum every S seconds")
    p.add_argument("--truncate-every", type=float, metavar="S", help="truncate a line every S seconds")
    p.add_argument("--stall-every", type=float, metavar="S", help="stall every S seconds (see --stall-for)")
    p.add_argument("--stall-for", type=float, default=2.0, metavar="D", help="stall duration, s (default 2)")
    p.add_argument("--unplug-every", type=float, metavar="S", help="unplug every S seconds (see --unplug-for)")
    p.add_argument("--unplug-for", type=float, default=3.0, metavar="D", help="unplugged duration, s (default 3)")
    p.add_argument("--no-reset-on-replug", action="store_true", help="board keeps counting across unplugs")
    p.add_argument("--seed", type=int, default=0, help="random seed of the faults")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s: %(message)s")
    speeds = a.rev_per_s or [1.0 / (1 + c) for c in range(a.channels)]
    if len(speeds) != a.channels:
        p.error(f"--rev-per-s needs {a.channels} values, got {len(speeds)}")
    emu = CounterBoardEmulator(a.link, channels=a.channels, lines=a.lines, rate_hz=a.rate,
                               angles=[steady_rotation(s) for s in speeds], count_start=a.count_start,
                               micros_start=a.micros_start, seed=a.seed)
    with stop_on_signals() as stop:
        periodic: list[tuple[float, Callable[[], None]]] = [
            (every, action) for every, action in (
                (a.garbage_every, emu.garbage), (a.bad_checksum_every, emu.bad_checksum),
                (a.truncate_every, emu.truncate), (a.stall_every, lambda: emu.stall(a.stall_for)))
            if every]
        due = [every for every, _ in periodic]
        emu.start()
        log.info("counter board on %s -> %s (%d channels, %g Hz)", a.link, os.readlink(a.link), a.channels, a.rate)
        t0 = time.monotonic()
        replug_at: float | None = None
        next_unplug = a.unplug_every
        while not stop.wait(0.05):
            el = time.monotonic() - t0
            for i, (every, action) in enumerate(periodic):
                if el >= due[i]:
                    action()
                    due[i] += every
            if next_unplug is not None and replug_at is None and el >= next_unplug:
                emu.unplug()
                log.info("unplugged")
                replug_at = el + a.unplug_for
            if replug_at is not None and el >= replug_at:
                emu.replug(reset=not a.no_reset_on_replug)
                log.info("replugged -> %s", os.readlink(a.link))
                replug_at = None
                next_unplug = el + a.unplug_every
        emu.stop()
        log.info("stopped; injected %s", emu.injected)
        return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Serial counter-board backend: reads ``counterboard v1`` lines over pyserial, survives unplug/replug.

The port is a device path or any pyserial URL (``socket://host:port``, ``rfc2217://...``,
``loop://``).  When the port vanishes (read error, device node gone) or goes silent (no valid
record for ``silence_s``), the driver reports it, closes the port and retries opening it with
capped exponential back-off; publishing resumes when records arrive again, without a restart.

Counts stay continuous across outages: if the board kept running (its micros advanced by the
host-elapsed time) the 32-bit counter is simply unwrapped; if the board reset (hello line, or its
clock jumped) the counter restarted at zero and is re-based on the last count before the outage
(motion during the outage cannot be known and is reported).

Loss is accounted truthfully: ``seq`` advances by the number of board samples since the channel's
previous record — its board-clock interval divided by the line period (the median of the recent
intervals) — so lines lost to noise, a stall or an unplug show as a gap in ``seq`` (``lost``); after
a board reset, whose clock restarted, the host-elapsed time stands in for the board clock.
"""

from __future__ import annotations

import logging
import threading
import time
import statistics
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import serial

from drivers.encoders.channel import EncoderChannel
from drivers.encoders.protocol import VERSION, CountLine, HelloLine, LineParser, Unwrapper
from drivers.serial_link import LinkStats, keep_connected

log = logging.getLogger(__name__)

#: a board clock that disagrees with the host-elapsed time by more than this (s, plus 0.1 %)
#: across an outage is taken as a board reset
RESET_TOLERANCE_S = 0.5
#: records whose board-clock intervals give the line period (their median)
PERIOD_WINDOW = 31


@dataclass
class _ChannelState:
    """Unwrapping state of one board channel (raw int32 count, raw uint32 micros)."""

    count: Unwrapper = field(default_factory=Unwrapper)
    micros: Unwrapper = field(default_factory=Unwrapper)
    last_micros: int | None = None
    #: monotonic time (s) the last sample was latched: its board time mapped onto the host clock by the
    #: channel's clock mapping (the fastest path seen), not its receive time, which carries however
    #: long the line waited (a starved host, a USB adapter's buffer, a backlog read late)
    last_mono: float = 0.0
    reset_pending: bool = False  #: hello line seen: the counter restarted at zero
    check_continuity: bool = False  #: first sample after a reopen: did the board keep running?
    intervals: deque[int] = field(default_factory=lambda: deque(maxlen=PERIOD_WINDOW))  #: recent board µs steps


class SerialBoardDriver:
    """Reads one counter board and feeds the configured channels' :class:`EncoderChannel`.

    ``channels`` maps board channel → encoder.  ``rate_hz`` (optional) is sent as ``R <rate_hz>``
    after every open.  ``silence_s`` (s) without a valid record counts as a disconnect.  Re-open
    attempts wait ``backoff_s`` doubling up to ``backoff_max_s`` (s).  ``clock`` gives the host time (s)
    stamped on samples; durations use the monotonic clock.
    """

    def __init__(self, port: str, channels: Mapping[int, EncoderChannel], *, baudrate: int = 115200,
                 rate_hz: int | None = None, silence_s: float = 1.0, backoff_s: float = 0.1,
                 backoff_max_s: float = 5.0, clock: Callable[[], float] = time.time) -> None:
        self.port = port
        self.channels = dict(channels)
        self.baudrate = baudrate
        self.rate_hz = rate_hz
        self.silence_s = silence_s
        self.backoff_s = backoff_s
        self.backoff_max_s = backoff_max_s
        self.clock = clock
        self.parser = LineParser()
        self.stats = LinkStats()
        self.board_channels: int | None = None
        self._state = {c: _ChannelState() for c in self.channels}
        self._reported_errors = dict(self.parser.errors)

    # ---------------------------------------------------------------- main loop
    def run(self, stop: threading.Event) -> None:
        """Read, publish and reconnect until ``stop`` is set."""
        keep_connected(self.port, self.baudrate, self._serve, stop, self.stats, self.backoff_s, self.backoff_max_s)
        self._report_errors(force=True)

    def _serve(self, ser: serial.SerialBase, stop: threading.Event) -> bool:
        """Read one open connection until it fails, goes silent or ``stop``; True if records arrived."""
        self.parser.reset()
        for st in self._state.values():
            st.check_continuity = True
        got_any = False
        try:
            if self.rate_hz is not None:
                ser.write(b"R %d\n" % self.rate_hz)
            last_good = time.monotonic()
            last_report = last_good
            while not stop.is_set():
                data = ser.read(ser.in_waiting or 1)
                now = time.monotonic()
                if data:
                    t_recv = self.clock()
                    records = self.parser.feed(data)
                    if records:
                        last_good = now
                        if not got_any:
                            got_any = True
                            log.info("%s: receiving", self.port)
                        for rec in records:
                            self._record(rec, t_recv, now)
                if now - last_good > self.silence_s:
                    self.stats.silent += 1
                    log.warning("%s: silent for %.1f s; reconnecting", self.port, now - last_good)
                    return got_any
                if now - last_report > 5.0:
                    self._report_errors()
                    last_report = now
        except (serial.SerialException, OSError) as exc:
            self.stats.vanished += 1
            log.warning("%s: port lost (%s); reconnecting", self.port, exc)
        return got_any

    # ---------------------------------------------------------------- records
    def _record(self, rec: CountLine | HelloLine, t_recv: float, t_mono: float) -> None:
        """Apply one valid record received at host time ``t_recv`` (s; monotonic clock: ``t_mono``)."""
        if isinstance(rec, HelloLine):
            self._hello(rec)
            return
        enc = self.channels.get(rec.channel)
        if enc is None:
            return
        st = self._state[rec.channel]
        if st.check_continuity and st.last_micros is not None and not st.reset_pending:
            # host time from the last sample's latching (not its late receipt: a board that kept
            # running would seem to have run ahead by that delay, CI saw 0.6 s) to this one's receipt
            elapsed = t_mono - st.last_mono
            board_elapsed = ((rec.micros - st.last_micros) % 2**32) * 1e-6
            if abs(board_elapsed - elapsed) > RESET_TOLERANCE_S + 1e-3 * elapsed:
                self._board_reset(f"board clock advanced {board_elapsed:.3f} s in {elapsed:.3f} s host time")
        st.check_continuity = False
        missed = self._missed(st, rec.micros, t_mono)
        if st.reset_pending:
            st.reset_pending = False
            if st.count.value is not None:
                st.count.rebase(st.count.value)
                log.warning("%s: channel %d counter restarted; %s continues from count %d "
                            "(motion during the outage is not known)", self.port, rec.channel,
                            enc.topic, st.count.value)
            st.micros = Unwrapper()
            enc.clock.reset()
        count = st.count.update(rec.count)
        micros = st.micros.update(rec.micros)
        msg = enc.sample(count, micros * 1e-6, t_recv, missed)
        st.last_micros = rec.micros
        st.last_mono = t_mono - (t_recv - msg["t"])  # the receive delay taken off: when it was latched

    @staticmethod
    def _missed(st: _ChannelState, micros: int, t_mono: float) -> int:
        """Board samples of a channel lost before its record latched at board time ``micros`` (µs),
        received at monotonic time ``t_mono`` (s): the interval since the previous record over the
        line period, minus one.  After a board reset the host time since the previous record was
        latched gives the interval."""
        if st.last_micros is None:
            return 0
        if st.reset_pending:  # the board clock restarted: only the host clock spans the outage
            interval_us = (t_mono - st.last_mono) * 1e6
        else:
            step = (micros - st.last_micros) % 2**32
            st.intervals.append(step)
            interval_us = step
        if len(st.intervals) < 3:
            return 0
        period_us = statistics.median(st.intervals)
        return max(0, round(interval_us / period_us) - 1) if period_us > 0 else 0

    def _hello(self, rec: HelloLine) -> None:
        """The board (re)started: its counters restarted at zero."""
        self.board_channels = rec.channels
        self._board_reset(f"hello line: counterboard v{rec.version} with {rec.channels} channels")
        if rec.version != VERSION:
            log.warning("%s: board speaks protocol v%d, this driver v%d", self.port, rec.version, VERSION)
        for c in self._state:
            if c >= rec.channels:
                log.error("%s: channel %d requested but the board has %d channels", self.port, c, rec.channels)

    def _board_reset(self, reason: str) -> None:
        """The board restarted: every channel's counter and the board clock restart at zero."""
        self.stats.board_resets += 1
        running = any(st.count.value is not None for st in self._state.values())
        log.log(logging.WARNING if running else logging.INFO, "%s: board reset (%s)", self.port, reason)
        for st in self._state.values():
            st.reset_pending = True

    def _report_errors(self, force: bool = False) -> None:
        """Log the dropped-line counters when they changed."""
        if force or self.parser.errors != self._reported_errors:
            if any(self.parser.errors.values()):
                log.warning("%s: dropped lines: %s (valid records: %d)", self.port,
                            ", ".join(f"{k}={v}" for k, v in self.parser.errors.items()), self.parser.records)
            self._reported_errors = dict(self.parser.errors)

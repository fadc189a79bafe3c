"""Xsens MTi emulator: answers the Xbus configuration sequence and streams MTData2 on a pty.

Like a device it starts in measurement mode with its default output; ``GoToConfig`` stops the
stream; it answers ``ReqDID``, ``ReqProductCode`` (``MTi-300``), ``ReqFWRev``,
``SetOutputConfiguration`` (acknowledged with the configuration; the rate of RateOfTurn sets the
stream rate), ``SetBaudrate`` (acknowledged, no effect on a pty), ``Reset`` and ``GoToMeasurement``;
anything else gets an ``Error`` message.  After a reset, a replug or :meth:`XsensEmulator.power_cycle`
it sends ``WakeUp``: a ``WakeUpAck`` within 0.5 s keeps it in configuration mode, else it measures
(PacketCounter and SampleTimeFine restart from 0).  Streamed: PacketCounter, SampleTimeFine,
RateOfTurn, Acceleration, Quaternion (Float32), StatusWord, from
``source(t) -> (gyr[3], acc[3], quat[4])`` with t in s since :meth:`XsensEmulator.start`.  Faults on
request: garbage bytes, bad checksums, truncated frames, stalls (the device samples on, on its own clock's grid,
and sends nothing), unplug/replug, power cycles.  Given
``frames`` (MTData2 payloads, e.g. a recording of a real device) it streams those instead, one per
sample period from the first at every ``GoToMeasurement`` and nothing after the last: the same
device data for every host that configures it.  Run standalone: ``python -m drivers.emulators.xsens --link /tmp/xsens0``.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import random
import struct
import threading
import time
from collections.abc import Callable, Sequence

from drivers.emulators.pty_link import EmulatedDevice, PtyLink
from drivers.xsens.mtdata2 import decode_output_configuration, encode_mtdata2
from drivers.xsens.xbus import MID, XbusParser, frame

from estimator_service.signals import stop_on_signals

log = logging.getLogger(__name__)

Source = Callable[[float], tuple[list[float], list[float], list[float]]]


def still(_t: float) -> tuple[list[float], list[float], list[float]]:
    """A device lying still, z up."""
    return [0.0, 0.0, 0.0], [0.0, 0.0, 9.81], [1.0, 0.0, 0.0, 0.0]


class XsensEmulator(EmulatedDevice):
    """An MTi on a pty behind ``link`` (see the module docstring)."""

    DEVICE_ID = 0x03700BEE
    OUT_BUFFER = 64 * 1024
    PRODUCT_CODE = b"MTi-300-2A8G4   "
    WAKE_WINDOW_S = 0.5  #: after a WakeUp, time for the host's WakeUpAck before measuring

    def __init__(self, link: str | os.PathLike, rate_hz: float = 100.0, source: Source = still, seed: int = 0,
                 frames: Sequence[bytes] | None = None) -> None:
        self.rate_hz = rate_hz
        self.source = source
        self.frames = frames
        self._replayed = 0  #: frames of ``frames`` sent since the last GoToMeasurement
        self.measuring = True
        self.baud_code: int | None = None  #: last SetBaudrate code received
        self.counter = 0
        self.sent = 0
        self.injected = {"garbage": 0, "checksum": 0, "truncated": 0, "stalls": 0, "unplugs": 0, "power_cycles": 0}
        self._pty = PtyLink(link)
        self._parser = XbusParser()
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._pending = {"garbage": 0, "checksum": 0, "truncated": 0}
        self._outbuf = bytearray()
        self._stall_until = 0.0
        self._wake_until = 0.0  #: end of the WakeUp window (0: none open)
        self._t0 = self._boot = self._next = time.monotonic()  #: source time origin, device clock origin

    @property
    def link(self):
        return self._pty.link

    def _power_on(self) -> None:
        self._t0 = self._boot = self._next = time.monotonic()

    # ---------------------------------------------------------------- faults
    def unplug(self) -> None:
        with self._lock:
            self._pty.unplug()
            self._outbuf.clear()
            self.injected["unplugs"] += 1

    def replug(self) -> None:
        """Plugged in again (a new pty behind the link): powers up, see :meth:`power_cycle`."""
        with self._lock:
            self._pty.plug()
            self._power_up()

    def power_cycle(self) -> None:
        """Restart without unplugging (a power glitch): counters and clock restart from 0, a WakeUp
        is sent; answered by WakeUpAck within 0.5 s the device stays in configuration mode,
        otherwise it measures with its last output configuration."""
        with self._lock:
            self.injected["power_cycles"] += 1
            self._outbuf.clear()
            self._power_up()

    def _power_up(self) -> None:
        self._parser = XbusParser()
        self.counter = 0
        self._boot = time.monotonic()
        self.measuring = False
        self._wake_until = self._boot + self.WAKE_WINDOW_S
        self._send(MID.WAKEUP)

    # ---------------------------------------------------------------- device
    def _send(self, mid: int, payload: bytes = b"") -> None:
        self._out(frame(mid, payload))

    def _out(self, data: bytes) -> None:
        """Queue bytes for the host; like a device's USB buffers (64 KiB), a full queue drops them."""
        if len(self._outbuf) + len(data) <= self.OUT_BUFFER:
            self._outbuf += data

    def _flush(self) -> None:
        if self._outbuf and self._pty.plugged:
            del self._outbuf[: self._pty.write(bytes(self._outbuf))]

    def _handle(self, mid: int, payload: bytes) -> None:
        if mid == MID.GOTO_CONFIG:
            self.measuring = False
            self._wake_until = 0.0
            self._send(MID.GOTO_CONFIG_ACK)
        elif mid == MID.GOTO_MEASUREMENT:
            self.measuring = True
            self._next = time.monotonic()
            self._replayed = 0
            self._send(MID.GOTO_MEASUREMENT_ACK)
        elif mid == MID.REQ_DID:
            self._send(MID.DEVICE_ID, struct.pack(">I", self.DEVICE_ID))
        elif mid == MID.REQ_PRODUCT_CODE:
            self._send(MID.PRODUCT_CODE, self.PRODUCT_CODE)
        elif mid == MID.REQ_FW_REV:
            self._send(MID.FIRMWARE_REV, bytes([1, 8, 2]) + struct.pack(">II", 12345, 0))
        elif mid == MID.SET_BAUDRATE:
            self.baud_code = payload[0] if payload else None
            self._send(MID.SET_BAUDRATE_ACK)
        elif mid == MID.RESET:
            self._send(MID.RESET_ACK)
            self._power_up()
        elif mid == MID.SET_OUTPUT_CONFIGURATION and not self.measuring:
            for name, _prec, _frame, rate in decode_output_configuration(payload):
                if name == "RateOfTurn" and 0 < rate < 0xFFFF:
                    self.rate_hz = float(rate)
            self._send(MID.OUTPUT_CONFIGURATION, payload)
        elif mid == MID.WAKEUP_ACK:
            self._wake_until = 0.0  # (outside the window: ignored) stays in configuration mode
        else:
            self._send(MID.ERROR, bytes([0x04]))  # "message not valid in this state / not supported"

    def _payload(self, t_tick: float) -> bytes | None:
        """The MTData2 payload of the sample at device time ``t_tick`` (None: replay finished)."""
        if self.frames is not None:
            self._replayed += 1
            return self.frames[self._replayed - 1] if self._replayed <= len(self.frames) else None
        gyr, acc, quat = self.source(t_tick - self._t0)
        return encode_mtdata2([
            ("PacketCounter", self.counter & 0xFFFF),
            ("SampleTimeFine", int(round((t_tick - self._boot) * 10000)) & 0xFFFFFFFF),
            ("Quaternion", quat), ("Acceleration", acc), ("RateOfTurn", gyr), ("StatusWord", 0),
        ])

    def _sample(self, t_tick: float) -> None:
        payload = self._payload(t_tick)
        self.counter += 1
        if payload is None:
            return
        data = frame(MID.MTDATA2, payload)
        out = b""
        if self._pending["garbage"]:
            out += bytes(self._rng.randrange(256) for _ in range(self._rng.randint(1, 40) * self._pending["garbage"]))
            self.injected["garbage"] += self._pending["garbage"]
            self._pending["garbage"] = 0
        if self._pending["checksum"]:
            self._pending["checksum"] -= 1
            self.injected["checksum"] += 1
            data = data[:-1] + bytes([data[-1] ^ 0x5A])
        elif self._pending["truncated"]:
            self._pending["truncated"] -= 1
            self.injected["truncated"] += 1
            data = data[: self._rng.randint(2, len(data) - 2)]
        else:
            self.sent += 1
        self._out(out + data)

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                now = time.monotonic()
                if self._pty.plugged:
                    for msg in self._parser.feed(self._pty.read()):
                        self._handle(msg.mid, msg.payload)
                if self._wake_until and now >= self._wake_until:  # WakeUp not acknowledged: measure
                    self._wake_until = 0.0
                    self.measuring = True
                    self._next = now
                period = 1.0 / self.rate_hz
                if now >= self._next:
                    if self._pty.plugged and self.measuring and now < self._stall_until:
                        while self._next <= now:  # a stall: the device samples on its own grid, sends nothing
                            self.counter += 1
                            self._next += period
                    elif not self._pty.plugged or not self.measuring or now - self._next > 1.0:
                        self._next = now + period
                    else:
                        while self._next <= now:
                            self._sample(self._next)
                            self._next += period
                self._flush()
                wait = self._next - time.monotonic()
            self._stop.wait(max(0.0, min(wait, 0.002)))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m drivers.emulators.xsens", description=__doc__.split("\n\n")[0])
    p.add_argument("--link", default="/tmp/xsens0", help="symlink to the pty (default %(default)s)")
    p.add_argument("--rate", type=float, default=100.0, help="output rate, Hz (default 100)")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    with stop_on_signals() as stop:
        spin = lambda t: ([0.0, 0.0, 1.0], [0.0, 0.0, 9.81], [math.cos(t / 2), 0.0, 0.0, math.sin(t / 2)])  # noqa: E731
        with XsensEmulator(a.link, a.rate, spin):
            log.info("Xsens MTi emulator on %s -> %s at %g Hz", a.link, os.readlink(a.link), a.rate)
            stop.wait()
        return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Xsens MTi driver over Xbus: configuration sequence, MTData2 streaming, unplug/replug.

After each (re)open: GoToConfig (answering a power-up WakeUp), device id, product code and firmware,
SetOutputConfiguration (PacketCounter, SampleTimeFine, StatusWord at every sample; RateOfTurn,
Acceleration, Quaternion at ``rate_hz``), GoToMeasurement.  Then every MTData2 frame becomes an
``imu/<name>`` message: t = host time (s) of the sample — the device clock (SampleTimeFine) mapped
onto the host clock, which removes USB transport jitter —, dev_t from SampleTimeFine (10 kHz ticks,
32-bit wrap unwrapped), seq from PacketCounter (16-bit wrap unwrapped; gaps counted as ``lost``;
after a reconnect or a device restart seq advances by the sample periods the stream was silent, so
a stall or an unplug shows as lost samples, see :meth:`XsensDriver._device_seq`), gyr =
RateOfTurn (rad/s), acc = Acceleration (m/s²), quat, status = StatusWord.  When the port
disappears or goes silent the driver reconnects with back-off and configures the device again; a
WakeUp while measuring (the device restarted) is acknowledged and the device configured again on
the same connection.  Parser error counts accumulate over all connections.
"""

from __future__ import annotations

import logging
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import serial

from drivers.encoders.channel import ClockMapper
from drivers.serial_link import LinkStats, keep_connected
from drivers.xsens.mtdata2 import decode_mtdata2, encode_output_configuration
from drivers.xsens.xbus import MID, Message, XbusParser, frame, mid_name

log = logging.getLogger(__name__)

Sink = Callable[[str, dict], None]


#: SetBaudrate codes of the Xbus protocol (bps -> code)
BAUD_CODES = {4800: 0x0B, 9600: 0x09, 14400: 0x08, 19200: 0x07, 28800: 0x06, 38400: 0x05, 57600: 0x04,
              76800: 0x03, 115200: 0x02, 230400: 0x01, 460800: 0x00, 921600: 0x80}


class DeviceError(RuntimeError):
    """The device did not answer, or answered with an Error message."""


class Unwrap:
    """Unwraps a counter that wraps at ``2**bits`` into a continuous integer."""

    def __init__(self, bits: int) -> None:
        self.mod = 1 << bits
        self.value: int | None = None

    def update(self, raw: int) -> int:
        if self.value is None:
            self.value = raw
        else:
            self.value += (raw - self.value) % self.mod
        return self.value


class BaudChanged(Exception):
    """The device now talks at a new baud rate: reopen the port."""


class Stopped(Exception):
    """Stop was requested while waiting for the device."""


@dataclass
class DeviceInfo:
    device_id: int = 0
    product_code: str = ""
    firmware: str = ""


class XsensDriver:
    """Reads one MTi and feeds ``sink(topic, message)``; see the module docstring."""

    def __init__(self, port: str, name: str, sink: Sink, rate_hz: int = 100, baudrate: int = 115200,
                 silence_s: float = 1.0, timeout_s: float = 1.0, backoff_max_s: float = 5.0,
                 clock: Callable[[], float] = time.time, set_baud: int | None = None) -> None:
        self.port, self.topic, self.sink = port, f"imu/{name}", sink
        self.rate_hz, self.baudrate = rate_hz, baudrate
        self.silence_s, self.timeout_s, self.backoff_max_s = silence_s, timeout_s, backoff_max_s
        self.clock = clock
        if set_baud is not None and set_baud not in BAUD_CODES:
            raise ValueError(f"unsupported baud rate {set_baud}; supported: {sorted(BAUD_CODES)}")
        self.set_baud = set_baud
        self.stats = LinkStats()
        self.parser = XbusParser()
        self.info = DeviceInfo()
        self.published = 0
        self.lost = 0
        self.undecoded = 0
        self.device_errors = 0  #: Error messages received while measuring
        self._last_seq: int | None = None
        self._last_sample: tuple[int | None, float] = (None, 0.0)  #: (SampleTimeFine, monotonic s) of the last sample
        self._stop = threading.Event()
        self._restart_counters()

    def _restart_counters(self) -> None:
        """Forget the device's counters and clock (it may have been power-cycled)."""
        self._seq = Unwrap(16)
        self._fine = Unwrap(32)
        self._seq_base: int | None = None
        self._clock = ClockMapper()

    def run(self, stop: threading.Event) -> None:
        """Serve the port (reconnecting as needed) until ``stop`` is set."""
        self._stop = stop
        keep_connected(self.port, lambda: self.baudrate, self._serve, stop, self.stats, backoff_max_s=self.backoff_max_s)

    # ---------------------------------------------------------------- configuration
    def _request(self, ser: serial.SerialBase, mid: int, payload: bytes, answer: int, attempts: int = 3) -> Message:
        """Send a message and wait for its answer (MTData2 in between is ignored); DeviceError otherwise."""
        for _ in range(attempts):
            ser.write(frame(mid, payload))
            deadline = time.monotonic() + self.timeout_s
            while time.monotonic() < deadline:
                if self._stop.is_set():
                    raise Stopped(self.port)
                for msg in self.parser.feed(ser.read(ser.in_waiting or 1)):
                    if msg.mid == answer:
                        return msg
                    if msg.mid == MID.ERROR:
                        code = msg.payload[0] if msg.payload else -1
                        raise DeviceError(f"{self.port}: device answered {mid_name(mid)} with Error code {code}")
                    if msg.mid == MID.WAKEUP:
                        ser.write(frame(MID.WAKEUP_ACK))
        raise DeviceError(f"{self.port}: no {mid_name(answer)} answer to {mid_name(mid)} within {self.timeout_s:.1f} s "
                          f"({attempts} tries)")

    def configure(self, ser: serial.SerialBase) -> DeviceInfo:
        """The configuration sequence (see the module docstring)."""
        self.parser.clear()
        self._restart_counters()
        self._request(ser, MID.GOTO_CONFIG, b"", MID.GOTO_CONFIG_ACK)
        if self.set_baud is not None and self.set_baud != self.baudrate:
            # the device switches after a reset; the port is then reopened at the new rate
            self._request(ser, MID.SET_BAUDRATE, bytes([BAUD_CODES[self.set_baud]]), MID.SET_BAUDRATE_ACK)
            self._request(ser, MID.RESET, b"", MID.RESET_ACK)
            log.info("%s: baud rate %d -> %d; reopening", self.port, self.baudrate, self.set_baud)
            self.baudrate = self.set_baud
            raise BaudChanged(self.port)
        did = self._request(ser, MID.REQ_DID, b"", MID.DEVICE_ID).payload
        code = self._request(ser, MID.REQ_PRODUCT_CODE, b"", MID.PRODUCT_CODE).payload
        fw = self._request(ser, MID.REQ_FW_REV, b"", MID.FIRMWARE_REV).payload
        self.info = DeviceInfo(
            device_id=struct.unpack(">I", did[:4])[0] if len(did) >= 4 else 0,
            product_code=code.decode("ascii", "replace").strip(),
            firmware=".".join(str(b) for b in fw[:3]),
        )
        cfg = encode_output_configuration([("PacketCounter", 0xFFFF), ("SampleTimeFine", 0xFFFF), ("StatusWord", 0xFFFF),
                                           ("RateOfTurn", self.rate_hz), ("Acceleration", self.rate_hz),
                                           ("Quaternion", self.rate_hz)])
        self._request(ser, MID.SET_OUTPUT_CONFIGURATION, cfg, MID.OUTPUT_CONFIGURATION)
        self._request(ser, MID.GOTO_MEASUREMENT, b"", MID.GOTO_MEASUREMENT_ACK)
        log.info("%s: %s (device id %08X, firmware %s) measuring at %d Hz", self.port, self.info.product_code,
                 self.info.device_id, self.info.firmware, self.rate_hz)
        return self.info

    # ---------------------------------------------------------------- streaming
    def _serve(self, ser: serial.SerialBase, stop: threading.Event) -> bool:
        got_any = False
        try:
            self.configure(ser)
            last_good = time.monotonic()
            while not stop.is_set():
                data = ser.read(ser.in_waiting or 1)
                now = time.monotonic()
                if data:
                    t_recv = self.clock()
                    for msg in self.parser.feed(data):
                        if msg.mid == MID.MTDATA2 and self._mtdata2(msg.payload, t_recv):
                            got_any = True
                            last_good = now
                        elif msg.mid == MID.WAKEUP:  # the device restarted (power glitch, watchdog)
                            self.stats.board_resets += 1
                            log.warning("%s: device restarted (WakeUp); configuring it again", self.port)
                            ser.write(frame(MID.WAKEUP_ACK))  # keeps it in configuration mode
                            self.configure(ser)
                            last_good = time.monotonic()
                            break  # the rest of this chunk predates the new configuration
                        elif msg.mid == MID.ERROR:
                            self.device_errors += 1
                            log.warning("%s: device reported Error code %d", self.port, msg.payload[0] if msg.payload else -1)
                if now - last_good > self.silence_s:
                    self.stats.silent += 1
                    log.warning("%s: no data for %.1f s; reconnecting", self.port, now - last_good)
                    return got_any
        except BaudChanged:
            return True  # reopen at once (no back-off)
        except Stopped:
            pass
        except DeviceError as exc:
            log.warning("%s", exc)
        except (serial.SerialException, OSError) as exc:
            self.stats.vanished += 1
            log.warning("%s: port lost (%s); reconnecting", self.port, exc)
        return got_any

    def _device_seq(self, counter: int, fine: int | None) -> int:
        """``seq`` of a sample with PacketCounter ``counter`` (16 bit) and SampleTimeFine ``fine``
        (10 kHz ticks, 32 bit) of the device; counts the samples lost before it in ``lost``.

        Within one configuration seq follows the PacketCounter.  Its first sample after a reconnect
        or a device restart (the counter may have restarted) advances seq by the sample periods
        (``rate_hz``) since the previous sample: on the device clock if it ran on (it advanced by
        the host-elapsed time within 0.5 s), else on the host's monotonic clock.
        """
        now = time.monotonic()
        raw = self._seq.update(counter)
        if self._seq_base is None:  # first sample of this configuration
            advance = 0
            if self._last_seq is not None:
                last_fine, last_mono = self._last_sample
                elapsed = now - last_mono
                if fine is not None and last_fine is not None:
                    dev_elapsed = ((fine - last_fine) % 2**32) * 1e-4
                    if abs(dev_elapsed - elapsed) <= 0.5 + 1e-3 * elapsed:
                        elapsed = dev_elapsed
                advance = max(1, round(elapsed * self.rate_hz))
            self._seq_base = (self._last_seq + advance if self._last_seq is not None else 0) - raw
        seq = self._seq_base + raw
        if self._last_seq is not None and seq > self._last_seq + 1:
            self.lost += seq - self._last_seq - 1
        self._last_seq = seq
        self._last_sample = (fine, now)
        return seq

    def _mtdata2(self, payload: bytes, t_recv: float) -> bool:
        """Convert one MTData2 payload to an imu message; False if it lacks the needed fields."""
        fields, rest = decode_mtdata2(payload)
        self.undecoded += rest
        v = {f.name: f.value for f in fields}
        if "PacketCounter" not in v or "RateOfTurn" not in v or "Acceleration" not in v:
            return False
        seq = self._device_seq(int(v["PacketCounter"]), v.get("SampleTimeFine"))
        msg: dict = {"t": t_recv, "seq": seq, "gyr": [float(x) for x in v["RateOfTurn"]],
                     "acc": [float(x) for x in v["Acceleration"]], "status": int(v.get("StatusWord", 0))}
        if "SampleTimeFine" in v:
            msg["dev_t"] = self._fine.update(int(v["SampleTimeFine"])) * 1e-4
            msg["t"] = self._clock.host_time(msg["dev_t"], t_recv)
        if "Quaternion" in v:
            msg["quat"] = [float(x) for x in v["Quaternion"]]
        self.sink(self.topic, msg)
        self.published += 1
        return True

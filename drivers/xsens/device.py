"""Xsens MTi driver over Xbus: configuration sequence, MTData2 streaming, unplug/replug.

After each (re)open: the port is put in low-latency mode where the OS allows it
(:func:`~drivers.serial_link.low_latency`), then GoToConfig (answering a power-up WakeUp), device
id, product code and firmware, SetOutputConfiguration (PacketCounter, SampleTimeFine, StatusWord at
every sample; RateOfTurn, Acceleration, Quaternion at ``rate_hz``), GoToMeasurement.  Then every
MTData2 frame becomes a :class:`~drivers.xsens.stream.Sample` and an ``imu/<name>`` message through
:class:`~drivers.xsens.stream.ImuStream` (time mapping, seq and loss accounting, arrival jitter:
shared with the vendor-API backend).  When the port disappears or goes silent the driver
reconnects with back-off and configures the device again; a WakeUp while measuring (the device
restarted) is acknowledged and the device configured again on the same connection.  Parser error
counts accumulate over all connections.
"""

from __future__ import annotations

import logging
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import serial

from drivers.serial_link import LinkStats, keep_connected, low_latency
from drivers.xsens.mtdata2 import decode_mtdata2, encode_output_configuration
from drivers.xsens.stream import ImuStream, Sample, StreamCounts
from drivers.xsens.xbus import MID, Message, XbusParser, frame, mid_name

log = logging.getLogger(__name__)

Sink = Callable[[str, dict], None]

def rig_outputs(rate_hz: int) -> list[tuple[str, int]]:
    """The output configuration of the rig: PacketCounter, SampleTimeFine and StatusWord with every
    sample; RateOfTurn, Acceleration and Quaternion at ``rate_hz``: (Xsens output name, rate Hz),
    0xFFFF meaning every sample.  Both backends configure exactly these."""
    return [("PacketCounter", 0xFFFF), ("SampleTimeFine", 0xFFFF), ("StatusWord", 0xFFFF),
            ("RateOfTurn", rate_hz), ("Acceleration", rate_hz), ("Quaternion", rate_hz)]


#: SetBaudrate codes of the Xbus protocol (bps -> code)
BAUD_CODES = {4800: 0x0B, 9600: 0x09, 14400: 0x08, 19200: 0x07, 28800: 0x06, 38400: 0x05, 57600: 0x04,
              76800: 0x03, 115200: 0x02, 230400: 0x01, 460800: 0x00, 921600: 0x80}


class DeviceError(RuntimeError):
    """The device did not answer, or answered with an Error message."""


class BaudChanged(Exception):
    """The device now talks at a new baud rate: reopen the port."""


class Stopped(Exception):
    """Stop was requested while waiting for the device."""


@dataclass
class DeviceInfo:
    device_id: int = 0
    product_code: str = ""
    firmware: str = ""


class XsensDriver(StreamCounts):
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
        self.stream = ImuStream(name, sink, rate_hz)
        self.undecoded = 0
        self.device_errors = 0  #: Error messages received while measuring
        self.low_latency: list[str] = []  #: what the last (re)open achieved, see :func:`low_latency`
        self._backlog: list[Message] = []  #: messages read with the last answer, not yet handled
        self._stop = threading.Event()

    def run(self, stop: threading.Event) -> None:
        """Serve the port (reconnecting as needed) until ``stop`` is set."""
        self._stop = stop
        keep_connected(self.port, lambda: self.baudrate, self._serve, stop, self.stats, backoff_max_s=self.backoff_max_s)

    # ---------------------------------------------------------------- configuration
    def _request(self, ser: serial.SerialBase, mid: int, payload: bytes, answer: int, attempts: int = 3) -> Message:
        """Send a message and wait for its answer (MTData2 before it is ignored; messages after it in
        the same read are kept for the stream: the first samples after GoToMeasurementAck); DeviceError
        otherwise."""
        for _ in range(attempts):
            ser.write(frame(mid, payload))
            deadline = time.monotonic() + self.timeout_s
            while time.monotonic() < deadline:
                if self._stop.is_set():
                    raise Stopped(self.port)
                msgs = self.parser.feed(ser.read(ser.in_waiting or 1))
                for i, msg in enumerate(msgs):
                    if msg.mid == answer:
                        self._backlog = msgs[i + 1 :]
                        return msg
                    if msg.mid == MID.ERROR:
                        code = msg.payload[0] if msg.payload else -1
                        raise DeviceError(f"{self.port}: device answered {mid_name(mid)} with Error code {code}")
                    if msg.mid == MID.WAKEUP:
                        ser.write(frame(MID.WAKEUP_ACK))
        raise DeviceError(f"{self.port}: no {mid_name(answer)} answer to {mid_name(mid)} within {self.timeout_s:.1f} s "
                          f"({attempts} tries)")

    def identify(self, ser: serial.SerialBase) -> DeviceInfo:
        """GoToConfig, then device id, product code and firmware (also what ``xsens scan`` asks)."""
        self.parser.clear()
        self._request(ser, MID.GOTO_CONFIG, b"", MID.GOTO_CONFIG_ACK)
        did = self._request(ser, MID.REQ_DID, b"", MID.DEVICE_ID).payload
        code = self._request(ser, MID.REQ_PRODUCT_CODE, b"", MID.PRODUCT_CODE).payload
        fw = self._request(ser, MID.REQ_FW_REV, b"", MID.FIRMWARE_REV).payload
        self.info = DeviceInfo(
            device_id=struct.unpack(">I", did[:4])[0] if len(did) >= 4 else 0,
            product_code=code.decode("ascii", "replace").strip(),
            firmware=".".join(str(b) for b in fw[:3]),
        )
        return self.info

    def configure(self, ser: serial.SerialBase) -> DeviceInfo:
        """The configuration sequence (see the module docstring)."""
        self.parser.clear()
        self.stream.restart()
        if self.set_baud is not None and self.set_baud != self.baudrate:
            # the device switches after a reset; the port is then reopened at the new rate
            self._request(ser, MID.GOTO_CONFIG, b"", MID.GOTO_CONFIG_ACK)
            self._request(ser, MID.SET_BAUDRATE, bytes([BAUD_CODES[self.set_baud]]), MID.SET_BAUDRATE_ACK)
            self._request(ser, MID.RESET, b"", MID.RESET_ACK)
            log.info("%s: baud rate %d -> %d; reopening", self.port, self.baudrate, self.set_baud)
            self.baudrate = self.set_baud
            raise BaudChanged(self.port)
        self.identify(ser)
        cfg = encode_output_configuration(rig_outputs(self.rate_hz))
        self._request(ser, MID.SET_OUTPUT_CONFIGURATION, cfg, MID.OUTPUT_CONFIGURATION)
        self._request(ser, MID.GOTO_MEASUREMENT, b"", MID.GOTO_MEASUREMENT_ACK)
        log.info("%s: %s (device id %08X, firmware %s) measuring at %d Hz", self.port, self.info.product_code,
                 self.info.device_id, self.info.firmware, self.rate_hz)
        return self.info

    # ---------------------------------------------------------------- streaming
    def _serve(self, ser: serial.SerialBase, stop: threading.Event) -> bool:
        got_any = False
        first = not self.low_latency
        self.low_latency = low_latency(ser)
        (log.info if first else log.debug)("%s: low latency: %s", self.port, "; ".join(self.low_latency))
        try:
            self.configure(ser)
            last_good = time.monotonic()
            while not stop.is_set():
                data = ser.read(ser.in_waiting or 1)
                now = time.monotonic()
                msgs, self._backlog = self._backlog + self.parser.feed(data), []
                if msgs:
                    t_recv = self.clock()
                    for msg in msgs:
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

    def _mtdata2(self, payload: bytes, t_recv: float) -> bool:
        """Publish one MTData2 payload received at host time ``t_recv`` (s); False if it lacks the
        needed fields (PacketCounter, RateOfTurn, Acceleration)."""
        fields, rest = decode_mtdata2(payload)
        self.undecoded += rest
        v = {f.name: f.value for f in fields}
        if "PacketCounter" not in v or "RateOfTurn" not in v or "Acceleration" not in v:
            return False
        self.stream.publish(Sample(counter=int(v["PacketCounter"]), gyr=v["RateOfTurn"], acc=v["Acceleration"],
                                   fine=v.get("SampleTimeFine"), quat=v.get("Quaternion"),
                                   status=int(v.get("StatusWord", 0))), t_recv)
        return True

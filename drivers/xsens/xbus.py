"""Xbus framing (Xsens low-level protocol) and a streaming parser that survives any input.

Frame: preamble 0xFA, bus id (0xFF for the master device), message id, length (0xFF means a
2-byte big-endian extended length follows), payload, checksum: the sum of every byte after the
preamble, checksum included, is 0 modulo 256.
"""

from __future__ import annotations

from dataclasses import dataclass, field

PREAMBLE = 0xFA
BUS_ID = 0xFF
MAX_PAYLOAD = 4096  #: longer frames are treated as corruption (MTi messages are far shorter)
_HEADER = bytes([PREAMBLE, BUS_ID])


class MID:
    """Message identifiers used by the driver and the emulator."""

    REQ_DID, DEVICE_ID = 0x00, 0x01
    INIT_MT, INIT_MT_RESULTS = 0x02, 0x03
    GOTO_MEASUREMENT, GOTO_MEASUREMENT_ACK = 0x10, 0x11
    REQ_FW_REV, FIRMWARE_REV = 0x12, 0x13
    SET_BAUDRATE, SET_BAUDRATE_ACK = 0x18, 0x19
    REQ_PRODUCT_CODE, PRODUCT_CODE = 0x1C, 0x1D
    GOTO_CONFIG, GOTO_CONFIG_ACK = 0x30, 0x31
    MTDATA2 = 0x36
    WAKEUP, WAKEUP_ACK = 0x3E, 0x3F
    RESET, RESET_ACK = 0x40, 0x41
    ERROR = 0x42
    SET_OUTPUT_CONFIGURATION, OUTPUT_CONFIGURATION = 0xC0, 0xC1


_MID_NAMES = {
    0x00: "ReqDID", 0x01: "DeviceID", 0x02: "InitMT", 0x03: "InitMTResults", 0x10: "GoToMeasurement",
    0x11: "GoToMeasurementAck", 0x12: "ReqFWRev", 0x13: "FirmwareRev", 0x18: "SetBaudrate", 0x19: "SetBaudrateAck",
    0x1C: "ReqProductCode", 0x1D: "ProductCode", 0x30: "GoToConfig", 0x31: "GoToConfigAck", 0x36: "MTData2",
    0x3E: "WakeUp", 0x3F: "WakeUpAck", 0x40: "Reset", 0x41: "ResetAck", 0x42: "Error",
    0xC0: "SetOutputConfiguration", 0xC1: "OutputConfiguration",
}


def mid_name(mid: int) -> str:
    """Xsens name and hex id of a message id, e.g. ``GoToConfig (0x30)``, for messages and logs."""
    return f"{_MID_NAMES.get(mid, 'message')} (0x{mid:02X})"


@dataclass(frozen=True)
class Message:
    """One checked Xbus message."""

    mid: int
    payload: bytes
    bid: int = BUS_ID


def frame(mid: int, payload: bytes = b"", bid: int = BUS_ID) -> bytes:
    """The bytes of one Xbus message."""
    n = len(payload)
    head = bytes([bid, mid, n]) if n < 0xFF else bytes([bid, mid, 0xFF, n >> 8, n & 0xFF])
    body = head + payload
    return bytes([PREAMBLE]) + body + bytes([(-sum(body)) & 0xFF])


@dataclass
class ParserErrors:
    """What the parser dropped, by kind."""

    garbage_bytes: int = 0  #: bytes outside any frame (including preambles not followed by bus id 0xFF)
    bad_checksum: int = 0  #: complete frames whose checksum failed (corrupted bytes)
    truncated: int = 0  #: frames cut short: the next frame's header starts inside them
    oversize: int = 0  #: length fields beyond MAX_PAYLOAD

    def as_dict(self) -> dict[str, int]:
        return {"garbage_bytes": self.garbage_bytes, "bad_checksum": self.bad_checksum, "truncated": self.truncated,
                "oversize": self.oversize}


def _header(buf: bytearray, j: int) -> tuple[int, int] | None:
    """(header length, payload length) of the frame starting at ``j``; None until its header arrived."""
    if len(buf) - j < 4:
        return None
    if buf[j + 3] != 0xFF:
        return 4, buf[j + 3]
    if len(buf) - j < 6:
        return None
    return 6, (buf[j + 4] << 8) | buf[j + 5]


def _next_frame_inside(buf: bytearray, i: int, end: int) -> bool:
    """Whether the first frame header ``FA FF`` inside ``buf[i+1:end]`` starts a valid frame (or one
    still arriving): then the frame at ``i`` was cut short and overrun by the next one.  Only the
    first header is checked, so classifying costs no more than the checksum did."""
    j = buf.find(_HEADER, i + 1, end)
    if j < 0:
        return False
    h = _header(buf, j)
    if h is None or j + h[0] + h[1] + 1 > len(buf):
        return True
    return not sum(buf[j + 1 : j + h[0] + h[1] + 1]) & 0xFF


@dataclass
class XbusParser:
    """Feed bytes in any chunking, get the complete valid messages; never raises, bounded memory."""

    errors: ParserErrors = field(default_factory=ParserErrors)
    _buf: bytearray = field(default_factory=bytearray)

    def feed(self, data: bytes) -> list[Message]:
        self._buf += data
        out: list[Message] = []
        buf = self._buf
        i = 0
        while True:
            start = buf.find(PREAMBLE, i)
            if start < 0:
                self.errors.garbage_bytes += len(buf) - i
                i = len(buf)
                break
            self.errors.garbage_bytes += start - i
            i = start
            if len(buf) - i >= 2 and buf[i + 1] != BUS_ID:  # not a frame start (an MTi sends bus id 0xFF)
                self.errors.garbage_bytes += 1
                i += 1
                continue
            h = _header(buf, i)
            if h is None:
                break
            head, n = h
            if n > MAX_PAYLOAD:
                self.errors.oversize += 1
                i += 1
                continue
            end = i + head + n + 1
            if end > len(buf):
                break
            if sum(buf[i + 1 : end]) & 0xFF:
                if _next_frame_inside(buf, i, end):
                    self.errors.truncated += 1
                else:
                    self.errors.bad_checksum += 1
                i += 1  # resynchronise on the next preamble
                continue
            out.append(Message(buf[i + 2], bytes(buf[i + head : end - 1]), buf[i + 1]))
            i = end
        del buf[:i]  # what is left is one incomplete frame (at most MAX_PAYLOAD + 7 bytes)
        return out

    def clear(self) -> None:
        """Drop the buffered bytes (a new connection); the error counts are kept."""
        self._buf.clear()

    @property
    def buffered(self) -> int:
        """Bytes held while waiting for the rest of a frame."""
        return len(self._buf)

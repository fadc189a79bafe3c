"""The serial counter-board line protocol (``counterboard v1``, see docs/encoders.md).

Board to host, one ASCII line per record, every line ``<payload>*<XX>\\n`` where ``XX`` is the
two-digit hex XOR of all payload bytes (everything before ``*``)::

    I counterboard v1 <channels> *XX        hello, printed on reset and on the ``?`` command
    E <channel> <count> <micros> *XX        one sample: quadrature count (signed 32 bit, wraps)
                                            latched at board time micros (unsigned 32 bit µs, wraps)

Host to board (no checksum, ``\\n`` terminated): ``R <rate_hz>`` (line rate, 1..1000 Hz),
``Z`` (zero all counters), ``?`` (print the hello line again).

:class:`LineParser` is a streaming parser that never raises: it takes arbitrary byte chunks and
returns the records of the complete, valid lines; every dropped line is counted by kind in
:attr:`LineParser.errors`.  The result does not depend on how the byte stream is chunked.
:class:`Unwrapper` extends the wrapping 32-bit fields to continuous integers.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

#: protocol version spoken by this module and by tools/counter_board/counter_board.ino
VERSION = 1
#: longest line the parser keeps (bytes, without ``\n``); the longest valid line has 33
MAX_LINE = 128
#: bytes kept from the end of an overlong line (a valid record there is still recovered)
KEEP = 48
#: error kinds counted by the parser
ERROR_KINDS = ("garbage", "checksum", "truncated", "overlong")

_MARKERS = (b"E ", b"I ")
_TAIL = re.compile(rb"\*([0-9A-Fa-f]{2})\Z")
_E_LINE = re.compile(rb"E (\d{1,3}) (-?\d{1,10}) (\d{1,10}) ?\Z")
_I_LINE = re.compile(rb"I counterboard v(\d{1,3}) (\d{1,3}) ?\Z")


@dataclass(frozen=True)
class CountLine:
    """One ``E`` record: raw quadrature ``count`` (int32) of ``channel`` at board time ``micros`` (uint32, µs)."""

    channel: int
    count: int
    micros: int


@dataclass(frozen=True)
class HelloLine:
    """The ``I`` record: protocol ``version`` and number of ``channels``; the board has just reset."""

    version: int
    channels: int


Record = CountLine | HelloLine


def checksum(payload: bytes) -> int:
    """XOR of all bytes of ``payload`` (the part of a line before ``*``)."""
    x = 0
    for b in payload:
        x ^= b
    return x


def frame(payload: str) -> bytes:
    """Complete line for ``payload`` (ending in a space by convention): ``payload*XX\\n``."""
    raw = payload.encode("ascii")
    return raw + b"*%02X\n" % checksum(raw)


def count_line(channel: int, count: int, micros: int) -> bytes:
    """The ``E`` line of a sample; ``count`` and ``micros`` are reduced to int32 / uint32 (wrap)."""
    return frame(f"E {channel} {wrap_int32(count)} {micros % 2**32} ")


def hello_line(channels: int, version: int = VERSION) -> bytes:
    """The ``I`` line a board prints on reset."""
    return frame(f"I counterboard v{version} {channels} ")


def wrap_int32(value: int) -> int:
    """``value`` reduced to a signed 32-bit integer (two's complement wrap)."""
    return (value + 2**31) % 2**32 - 2**31


def _decode(line: bytes) -> Record | str:
    """The record of a complete line (no ``\\n``), or the error kind why it is invalid."""
    tail = _TAIL.search(line)
    if tail is None:
        return "truncated" if line.startswith(_MARKERS) else "garbage"
    payload = line[: tail.start()]
    if checksum(payload) != int(tail.group(1), 16):
        return "checksum"
    m = _E_LINE.match(payload)
    if m is not None:
        channel, count, micros = (int(g) for g in m.groups())
        if channel <= 255 and -(2**31) <= count < 2**31 and micros < 2**32:
            return CountLine(channel, count, micros)
        return "garbage"
    m = _I_LINE.match(payload)
    if m is not None:
        return HelloLine(int(m.group(1)), int(m.group(2)))
    return "garbage"


def _suffix_record(line: bytes, start: int) -> tuple[int, Record] | None:
    """First valid record that is a suffix of ``line`` starting at a marker at index ≥ ``start``."""
    i = start
    while True:
        hits = [j for j in (line.find(m, i) for m in _MARKERS) if j >= 0]
        if not hits:
            return None
        j = min(hits)
        rec = _decode(line[j:])
        if not isinstance(rec, str):
            return j, rec
        i = j + 1


class LineParser:
    """Streaming parser of counter-board lines; never raises, memory bounded by ``MAX_LINE``.

    A line that is not a valid record is dropped and counted in ``errors``:

    - ``checksum``: well-formed ``*XX`` tail that does not match the payload;
    - ``truncated``: starts like a record (``E ``/``I ``) but has no ``*XX`` tail, including a
      record cut short and directly followed by the next one (the next one is recovered);
    - ``overlong``: more than ``MAX_LINE`` bytes without ``\\n`` (a valid record in its last
      ``KEEP`` bytes is still recovered);
    - ``garbage``: anything else (noise, unknown record types, out-of-range fields).

    Empty lines are ignored.  ``\\r\\n`` line ends are accepted.
    """

    def __init__(self) -> None:
        self.errors: dict[str, int] = {k: 0 for k in ERROR_KINDS}
        self.records = 0  #: valid records returned so far
        self._buf = bytearray()
        self._overlong = False

    @property
    def buffered(self) -> int:
        """Bytes of the current incomplete line held (≤ ``MAX_LINE``)."""
        return len(self._buf)

    def reset(self) -> None:
        """Forget a partial line (after the port was closed and reopened); counters are kept."""
        self._buf.clear()
        self._overlong = False

    def feed(self, data: bytes) -> list[Record]:
        """Consume ``data`` (any chunking of the stream); return the records of the lines it completes."""
        out: list[Record] = []
        pos = 0
        while pos < len(data):
            nl = data.find(b"\n", pos)
            end = len(data) if nl < 0 else nl
            self._buf += data[pos:end]
            if len(self._buf) > MAX_LINE:
                self._overlong = True
                del self._buf[:-KEEP]
            if nl < 0:
                break
            rec = self._line(bytes(self._buf))
            if rec is not None:
                out.append(rec)
            self.reset()
            pos = nl + 1
        self.records += len(out)
        return out

    def _line(self, line: bytes) -> Record | None:
        """Decode one complete line, counting the error when it is dropped."""
        if line.endswith(b"\r"):
            line = line[:-1]
        if self._overlong:
            self.errors["overlong"] += 1
            hit = _suffix_record(line[-KEEP:], 0)
            return None if hit is None else hit[1]
        if not line:
            return None
        rec = _decode(line)
        if not isinstance(rec, str):
            return rec
        hit = _suffix_record(line, 1)
        if hit is not None:
            self._count_prefix(line[: hit[0]])
            return hit[1]
        self.errors[rec] += 1
        return None

    def _count_prefix(self, prefix: bytes) -> None:
        """Count what preceded a recovered record: one ``truncated`` per record start (``E ``/``I ``)
        in it, one ``garbage`` for bytes before the first record start."""
        starts = [j for j in range(len(prefix)) if prefix.startswith(_MARKERS, j)]
        self.errors["truncated"] += len(starts)
        if not starts or starts[0] > 0:
            self.errors["garbage"] += 1


class Unwrapper:
    """Extends a ``bits``-wide wrapping counter to a continuous integer (steps < 2**(bits-1)).

    The first value is taken as is; each later value moves the result by the wrapped difference
    in ``[-2**(bits-1), 2**(bits-1))``.  Works for signed and unsigned fields alike.
    """

    def __init__(self, bits: int = 32) -> None:
        self.modulus = 2**bits
        self.value: int | None = None
        self._last = 0

    def update(self, raw: int) -> int:
        """Continuous value for the next raw field value."""
        if self.value is None:
            self.value = raw
        else:
            half = self.modulus // 2
            self.value += (raw - self._last + half) % self.modulus - half
        self._last = raw
        return self.value

    def rebase(self, value: int) -> None:
        """Make the next raw value ``r`` continue as ``value + r`` (counter restarted at zero)."""
        self.value = value
        self._last = 0

"""The rigstate log: an append-only record of bus messages with the configuration in its header.

Byte layout (little endian; full description in docs/log-format.md)::

    file    = magic "RIGSTATE-LOG\\n" (13 bytes), version u16 (=1), header, record*
    header  = length u32, crc32 u32, msgpack map (length bytes)
    record  = sync b"\\xabR", length u32, crc32 u32 (of body), body
    body    = topic length u8, topic utf-8, t_recv f64 (host receive time, s), payload (the exact bytes)

Every record carries its own CRC, so a crash mid-write loses at most the last, partial record; a
damaged record in the middle is skipped by scanning for the next sync marker whose CRC checks.
"""

from __future__ import annotations

import errno
import json
import logging
import mmap
import os
import struct
import zlib
from collections.abc import Iterable, Iterator
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, BinaryIO, NamedTuple

import msgpack

from estimator_service.errors import UserError

if TYPE_CHECKING:
    import pandas

log = logging.getLogger(__name__)

MAGIC = b"RIGSTATE-LOG\n"
VERSION = 1
SYNC = b"\xabR"
_REC = struct.Struct("<2sII")  # sync, length, crc32
_HDR = struct.Struct("<II")
_T_RECV = struct.Struct("<d")
MAX_RECORD = 1 << 20
RELEASE_BYTES = 8 << 20  #: a reader releases the mapped pages it has read every this many bytes


class Record(NamedTuple):
    """One bus message as received: topic, host receive time (s) and the payload bytes.

    Immutable (a named tuple: a reader makes one per record, twice as fast as a frozen dataclass)."""

    topic: str
    t_recv: float
    payload: bytes


def _body(topic: str, t_recv: float, payload: bytes) -> bytes:
    t = topic.encode()
    if len(t) > 255:
        raise ValueError(f"topic too long: {topic!r}")
    return bytes([len(t)]) + t + _T_RECV.pack(t_recv) + bytes(payload)


#: header keys with a fixed type (docs/log-format.md); others are free
HEADER_TYPES: dict[str, type] = {
    "format": str, "version": int, "created": str, "rig_path": str, "rig_toml": str,
    "mechanism_path": str, "mechanism_yaml": str, "meta": dict,
}
_TYPE_NAMES = {str: "string", int: "integer", dict: "map"}


def open_new(path: Path, exclusive: bool) -> BinaryIO:
    """Open ``path`` for writing without following a symlink there (UserError if it is one).

    ``exclusive``: refuse an existing file (O_EXCL) instead of truncating it.  Any failure (missing
    directory, permissions) is a UserError naming the path.
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | (os.O_EXCL if exclusive else os.O_TRUNC)
    try:
        fd = os.open(path, flags, 0o644)
    except FileExistsError:
        raise UserError(f"{path}: already exists; refusing to overwrite it") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UserError(f"{path}: is a symbolic link; refusing to write through it") from None
        raise UserError(f"{path}: cannot create: {exc.strerror}") from None
    return os.fdopen(fd, "wb")


class LogWriter:
    """Append records to a new log file.  Use as a context manager; ``flush`` makes data durable.

    Never writes through a symlink at ``path``; ``exclusive`` refuses an existing file (see :func:`open_new`).
    """

    def __init__(self, path: str | Path, header: dict, fsync: bool = False, exclusive: bool = False) -> None:
        self.path = Path(path)
        self.fsync = fsync
        head = msgpack.packb(header, use_bin_type=True)
        self._f = open_new(self.path, exclusive)
        self._f.write(MAGIC + struct.pack("<H", VERSION) + _HDR.pack(len(head), zlib.crc32(head)) + head)
        self._last_flush = 0.0
        self.records = 0
        self.flush()

    def write(self, topic: str, t_recv: float, payload: bytes) -> None:
        """Append one record (buffered; see :meth:`flush`)."""
        body = _body(topic, t_recv, payload)
        self._f.write(_REC.pack(SYNC, len(body), zlib.crc32(body)) + body)
        self.records += 1

    def flush(self) -> None:
        """Hand buffered records to the OS (and to the disk when ``fsync``)."""
        self._f.flush()
        if self.fsync:
            os.fsync(self._f.fileno())

    def maybe_flush(self, now: float, every_s: float = 0.1) -> None:
        """Flush if ``every_s`` seconds (of the caller's clock ``now``) passed since the last flush."""
        if now - self._last_flush >= every_s:
            self.flush()
            self._last_flush = now

    def close(self) -> None:
        if not self._f.closed:
            self.flush()
            self._f.close()

    def __enter__(self) -> LogWriter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


class LogReader:
    """Reads a log: ``header`` and iteration over :class:`Record` s.

    After iteration: ``truncated_tail`` (the file ended inside a record) and ``skipped_bytes``
    (damaged bytes skipped in the middle).
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                # mapped, not read: memory does not grow with the log (see __iter__)
                self._data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
        except (OSError, ValueError) as exc:
            raise UserError(f"{self.path}: cannot read: {getattr(exc, 'strerror', None) or exc}") from None
        d = self._data
        if d[: len(MAGIC)] != MAGIC or len(d) < len(MAGIC) + 2 + _HDR.size:
            raise UserError(f"{self.path}: not a rigstate log (bad magic bytes)")
        (version,) = struct.unpack_from("<H", d, len(MAGIC))
        if version != VERSION:
            raise UserError(f"{self.path}: log format version {version} is not supported (expected {VERSION})")
        off = len(MAGIC) + 2
        n, crc = _HDR.unpack_from(d, off)
        off += _HDR.size
        head = d[off : off + n]
        if len(head) != n or zlib.crc32(head) != crc:
            raise UserError(f"{self.path}: log header is damaged (length or CRC mismatch)")
        self.header: dict = _check_header(head, self.path)
        self._start = off + n
        self.truncated_tail = False
        self.skipped_bytes = 0
        self.offset = self._start  #: file offset after the last record yielded (bytes)

    def __iter__(self) -> Iterator[Record]:
        off, end = self._start, len(self._data)
        self.truncated_tail, self.skipped_bytes = False, 0
        released = 0
        while off < end:
            if off - released >= RELEASE_BYTES and isinstance(self._data, mmap.mmap):
                # hand the pages already read back to the page cache: resident memory stays bounded
                released = (off - 4096) // mmap.PAGESIZE * mmap.PAGESIZE
                self._data.madvise(mmap.MADV_DONTNEED, 0, released)
            rec = self._record_at(off)
            if rec is None:
                if self._complete_at(off):  # damaged record in the middle: resynchronise
                    nxt = self._resync(off + 1)
                    if nxt is None:
                        self.truncated_tail = True
                        return
                    self.skipped_bytes += nxt - off
                    log.warning("%s: skipped %d damaged bytes at offset %d", self.path, nxt - off, off)
                    off = nxt
                    continue
                self.truncated_tail = True
                return
            record, off = rec
            self.offset = off
            yield record

    @property
    def size(self) -> int:
        """The file's length (bytes)."""
        return len(self._data)

    def _complete_at(self, off: int) -> bool:
        """True if a record header at ``off`` claims a body that lies fully inside the file."""
        if off + _REC.size > len(self._data):
            return False
        sync, n, _ = _REC.unpack_from(self._data, off)
        return sync != SYNC or n > MAX_RECORD or off + _REC.size + n <= len(self._data)

    def _record_at(self, off: int) -> tuple[Record, int] | None:
        d = self._data
        start = off + _REC.size
        if start > len(d):
            return None
        sync, n, crc = _REC.unpack_from(d, off)
        if sync != SYNC or n > MAX_RECORD or n < 9:
            return None
        body = d[start : start + n]
        if len(body) != n or zlib.crc32(body) != crc:
            return None
        tl = body[0]
        if 1 + tl + 8 > n:
            return None
        try:
            topic = body[1 : 1 + tl].decode()
        except UnicodeDecodeError:
            return None
        (t_recv,) = _T_RECV.unpack_from(body, 1 + tl)
        return Record(topic, t_recv, body[1 + tl + 8 :]), start + n

    def _resync(self, off: int) -> int | None:
        while True:
            off = self._data.find(SYNC, off)
            if off < 0:
                return None
            if self._record_at(off) is not None:
                return off
            off += 1


def _check_header(head: bytes, path: Path) -> dict:
    """The header map of a log, or UserError naming the file and the problem (docs/log-format.md)."""
    try:
        header = msgpack.unpackb(head, raw=False)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError, TypeError) as exc:
        raise UserError(f"{path}: log header is not valid msgpack: {exc}") from None
    return validate_header(header, path)


def validate_header(header: object, path: str | Path) -> dict:
    """``header`` if it is a valid log header (a map; known keys of their type), else UserError naming ``path``."""
    if not isinstance(header, dict):
        raise UserError(f"{path}: log header must be a map, got a {type(header).__name__}")
    for key, value in header.items():
        if not isinstance(key, str):
            raise UserError(f"{path}: log header keys must be strings, got {key!r}"[:300])
        want = HEADER_TYPES.get(key)
        if want is not None and (not isinstance(value, want) or isinstance(value, bool)):
            raise UserError(f"{path}: log header {key!r} must be a {_TYPE_NAMES[want]}, "
                            f"got {type(value).__name__} {value!r}"[:300])
    try:
        json.dumps(header.get("meta", {}), default=repr)
    except (TypeError, ValueError, RecursionError) as exc:
        raise UserError(f"{path}: log header 'meta' is not a plain map: {exc}") from None
    return header


def read_log(path: str | Path) -> LogReader:
    """Open a log for reading (UserError if it is not a rigstate log)."""
    return LogReader(path)


def read_dataframes(path: str | Path, topics: Iterable[str] | None = None) -> dict[str, pandas.DataFrame]:
    """One pandas DataFrame per topic of a log, indexed by message time ``t`` (s), plus ``t_recv``.

    Columns as in :mod:`estimator_service.tabular` (coordinate and DOF names from the log header,
    e.g. ``q_x1``, ``z_crank``, ``gyr_z``).  Invalid payloads are skipped.  Needs pandas
    (``pip install 'rigstate[pandas]'``).
    """
    try:
        import pandas as pd
    except ImportError:
        raise UserError("reading logs as DataFrames needs pandas: pip install 'rigstate[pandas]'") from None
    from estimator_service.tabular import rows_by_topic

    reader = read_log(path)
    rows: dict[str, list[dict]] = {}
    for topic, row in rows_by_topic(reader.header, reader, topics):
        rows.setdefault(topic, []).append(row)
    return {topic: pd.DataFrame(r).set_index("t") for topic, r in sorted(rows.items())}

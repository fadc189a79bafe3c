"""Message schema (validation, canonical bytes) and the log format (round trip, crash safety)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import msgpack
import numpy as np
import pytest

from estimator_service import schema
from estimator_service.errors import UserError
from estimator_service.logfile import LogWriter, read_log

IMU = {"t": 1.5, "seq": 3, "gyr": [0.1, -0.2, 0.3], "acc": [0.0, 9.81, 0.1], "quat": [1, 0, 0, 0], "dev_t": 1.49, "status": 7}
ENC = {"t": 1.5, "seq": 0, "count": -1234, "cpr": 4096, "angle": -1.89}
EST = {"t": 2.0, "seq": 9, "q": [0.1] * 8, "qd": [0.0] * 8, "z": [1.0], "zd": [0.5], "crank": 1.0, "crank_rate": 0.5,
       "backend": "fgs", "status": "ok"}
DIAG = {"t": 2.0, "seq": 1, "status": "ok", "inputs": {"imu/a": {"rate_hz": 100.0, "received": 10}}, "step_us": {"p99": 120.0}}
TRUTH = {"t": 0.0, "q": [0.0], "qd": [0.0], "z": [0.0], "zd": [0.0]}


@pytest.mark.parametrize("topic, msg", [("imu/coupler", IMU), ("enc/crank", ENC), ("est/state", EST),
                                        ("est/diag", DIAG), ("truth/state", TRUTH)])
def test_valid_messages_round_trip(topic: str, msg: dict) -> None:
    payload = schema.encode(topic, msg)
    out = schema.decode(topic, payload)
    assert out == {k: (float(v) if isinstance(v, int) and k not in ("seq", "count", "cpr", "status") else
                       [float(x) for x in v] if isinstance(v, list) else v) for k, v in msg.items()}
    assert schema.encode(topic, out) == payload  # canonical: same message, same bytes


def test_canonical_key_order_and_float64() -> None:
    a = schema.encode("imu/x", IMU)
    b = schema.encode("imu/x", dict(reversed(list(IMU.items()))))
    assert a == b
    assert list(msgpack.unpackb(a)) == ["t", "seq", "gyr", "acc", "quat", "dev_t", "status"]
    assert b"\xcb" in a  # float64 marker


@pytest.mark.parametrize("topic, change, words", [
    ("imu/c", {"gyr": [1, 2]}, "field 'gyr': expected 3 numbers"),
    ("imu/c", {"gyr": [1, float("nan"), 3]}, "finite"),
    ("imu/c", {"acc": [1, float("inf"), 3]}, "finite"),
    ("imu/c", {"seq": True}, "field 'seq': expected an integer"),
    ("imu/c", {"seq": -1}, ">= 0"),
    ("imu/c", {"t": "now"}, "field 't': expected a number"),
    ("imu/c", {"extra": 1}, "unknown field 'extra'"),
    ("enc/c", {"cpr": 0}, "field 'cpr'"),
    ("est/state", {"status": "happy"}, "field 'status'"),
])
def test_invalid_fields_are_named(topic: str, change: dict, words: str) -> None:
    base = {"imu": IMU, "enc": ENC, "est/state": EST}[schema.schema_key(topic)]
    with pytest.raises(schema.SchemaError) as info:
        schema.validate(topic, {**base, **change})
    assert words in str(info.value) and topic in str(info.value)


def test_missing_field_unknown_topic_and_garbage_bytes() -> None:
    msg = dict(IMU)
    del msg["gyr"]
    with pytest.raises(schema.SchemaError, match="missing field 'gyr'"):
        schema.validate("imu/c", msg)
    with pytest.raises(schema.SchemaError, match="unknown topic"):
        schema.validate("foo/bar", IMU)
    with pytest.raises(schema.SchemaError, match="imu/"):
        schema.validate("imu/", IMU)
    for payload in [b"\xc1\xc1\xc1", b"", b"\x92\x01\x02", msgpack.packb([1, 2, 3]), msgpack.packb(5),
                    b"\xdd\xff\xff\xff\xff", b"\x81" * 100000]:
        with pytest.raises(schema.SchemaError):
            schema.decode("imu/c", payload)
    with pytest.raises(schema.SchemaError, match="exceeds"):
        schema.decode("imu/c", b"\x00" * (schema.MAX_PAYLOAD + 1))


def test_normalised_whatever_the_input_types() -> None:
    """Plain floats (the fast path) and other numbers (ints, numpy scalars, tuples, arrays) give the same
    plain copy; the input is never handed back."""
    plain = {**IMU, "gyr": [0.1, -0.2, 0.3], "quat": [1.0, 0.0, 0.0, 0.0], "t": 1.5}
    other = {**IMU, "gyr": np.array([0.1, -0.2, 0.3]), "quat": (1, np.int32(0), np.float32(0.0), 0), "t": np.float64(1.5),
             "seq": np.int64(3)}
    a, b = schema.validate("imu/c", plain), schema.validate("imu/c", other)
    assert a == b and list(a) == list(b)
    assert all(type(x) is float for k in ("gyr", "acc", "quat") for x in b[k]) and type(b["t"]) is float
    assert type(b["seq"]) is int and a["gyr"] is not plain["gyr"]


def test_schema_key_memory_is_bounded() -> None:
    for i in range(schema.MAX_CACHED_TOPICS + 10):
        assert schema.schema_key(f"imu/s{i}") == "imu"
    assert schema._schema_key.cache_info().currsize <= schema.MAX_CACHED_TOPICS
    for _ in range(2):  # an invalid topic is rejected every time, with the same words
        with pytest.raises(schema.SchemaError, match="unknown topic 'foo/bar'"):
            schema.schema_key("foo/bar")
        with pytest.raises(schema.SchemaError, match="topic must be a string"):
            schema.schema_key(["imu/a"])  # type: ignore[arg-type]


def _records(n: int) -> list[tuple[str, float, bytes]]:
    return [("imu/a", 0.01 * i, schema.encode("imu/a", {**IMU, "seq": i, "t": 0.01 * i})) for i in range(n)]


def test_log_round_trip(tmp_path: Path) -> None:
    header = {"format": "rigstate-log", "version": 1, "rig_toml": "[rig]\nname='x'\n", "meta": {"seed": 3}}
    recs = _records(50)
    with LogWriter(tmp_path / "a.log", header) as w:
        for r in recs:
            w.write(*r)
    reader = read_log(tmp_path / "a.log")
    assert reader.header == header
    assert [(r.topic, r.t_recv, r.payload) for r in reader] == recs
    assert not reader.truncated_tail


def test_truncated_log_reads_every_complete_record(tmp_path: Path) -> None:
    recs = _records(5)
    path = tmp_path / "a.log"
    with LogWriter(path, {"x": 1}) as w:
        for r in recs:
            w.write(*r)
    data = path.read_bytes()
    with LogWriter(tmp_path / "b.log", {"x": 1}) as w:
        for r in recs[:4]:
            w.write(*r)
    four = len((tmp_path / "b.log").read_bytes())
    for cut in range(four, len(data)):  # every byte offset inside the last record
        (tmp_path / "cut.log").write_bytes(data[:cut])
        reader = read_log(tmp_path / "cut.log")
        got = list(reader)
        assert [r.payload for r in got] == [r[2] for r in recs[:4]]
        assert reader.truncated_tail == (cut > four)


def test_damaged_record_in_the_middle_is_skipped(tmp_path: Path) -> None:
    recs = _records(10)
    path = tmp_path / "a.log"
    with LogWriter(path, {}) as w:
        for r in recs:
            w.write(*r)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    reader = read_log(path)
    got = list(reader)
    assert 8 <= len(got) < 10 and reader.skipped_bytes > 0
    assert all(r.payload in [x[2] for x in recs] for r in got)


def test_not_a_log(tmp_path: Path) -> None:
    (tmp_path / "x.log").write_bytes(b"hello world, not a log at all")
    with pytest.raises(UserError, match="x.log: not a rigstate log"):
        read_log(tmp_path / "x.log")


WRITER = """
import sys, time
from estimator_service.logfile import LogWriter
w = LogWriter(sys.argv[1], {"k": 1})
i = 0
while True:
    w.write("imu/a", float(i), bytes(range(200)))
    i += 1
    w.maybe_flush(time.monotonic(), 0.01)
    if i == 200:
        w.flush()  # the first 200 records reach the file; the writer goes on mid-record
        print("ready", flush=True)
"""


def test_kill_9_mid_write_loses_at_most_the_last_record(tmp_path: Path) -> None:
    path = tmp_path / "k.log"
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(path)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    reader = read_log(path)
    got = list(reader)
    assert len(got) >= 200
    assert [r.t_recv for r in got] == [float(i) for i in range(len(got))]  # complete, in order
    assert all(r.payload == bytes(range(200)) for r in got)
    header_len = len(b"RIGSTATE-LOG\n") + 2 + 8 + len(msgpack.packb({"k": 1}))
    record_len = 2 + 4 + 4 + 1 + len("imu/a") + 8 + 200
    tail = os.path.getsize(path) - header_len - len(got) * record_len
    assert 0 <= tail < record_len  # at most one partial record is lost

"""Xbus framing and MTData2 decoding: the real captures of an MTi-G-710 against their golden
decodings, framing round trips, resynchronisation, and parser fuzzing."""

from __future__ import annotations

import json
import random
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from drivers.xsens.mtdata2 import decode_mtdata2, decode_output_configuration, encode_mtdata2
from drivers.xsens.xbus import MID, XbusParser, frame

from helpers import XBUS_CAPTURES as CAPTURES


def parse_golden(text: str) -> list[dict[str, object]]:
    """Golden file -> one dict per frame: 'Name(Precision)' or 'Name(Frame,Precision)' -> value."""
    frames = []
    for block in text.strip().split("\n\n"):
        cur: dict[str, object] = {}
        key = None
        for line in block.splitlines():
            if not line.startswith("  "):
                key = line.rstrip(":")
                cur[key] = []
            else:
                cur[key].append(line.strip())  # type: ignore[union-attr]
        frames.append(cur)
    return frames


def golden_value(lines: list[str]) -> object:
    if all(":" in ln for ln in lines) and len(lines) > 1:
        return {ln.split(":", 1)[0]: float(ln.split(":", 1)[1]) for ln in lines}
    return lines[0]


def decoded_key(f) -> str:
    name = "UTCTime" if f.name == "UtcTime" else f.name
    if f.precision:
        return f"{name}({f.frame + ',' if f.frame else ''}{f.precision})"
    return name


@pytest.mark.parametrize("capture", ["1", "2", "3"])
def test_real_captures_decode_exactly_as_golden(capture: str) -> None:
    d = CAPTURES / capture
    parser = XbusParser()
    msgs = parser.feed((d / "output.bin").read_bytes())
    assert len(msgs) == 100 and parser.errors.as_dict() == {"garbage_bytes": 0, "bad_checksum": 0, "truncated": 0, "oversize": 0}
    hexes = (d / "messages.golden").read_text().split()
    assert [frame(m.mid, m.payload).hex() for m in msgs] == hexes  # framing round trip, byte for byte
    golden = parse_golden((d / "output.golden").read_text())
    assert len(golden) == 100
    for msg, gold in zip(msgs, golden, strict=False):
        assert msg.mid == MID.MTDATA2
        fields, rest = decode_mtdata2(msg.payload)
        assert rest == 0
        got = {decoded_key(f): f for f in fields}
        assert set(got) == set(gold), (set(got) ^ set(gold))
        for key, lines in gold.items():
            f = got[key]
            if f.name == "StatusWord":
                assert format(f.value, "032b") == lines[0]
            elif f.name == "StatusByte":
                assert format(f.value, "08b") == lines[0]
            elif f.name == "GNSSPVTData":
                assert {k: str(v) for k, v in f.value.items()} == dict(ln.split(":", 1) for ln in lines)
            elif f.name in ("PacketCounter", "SampleTimeFine"):
                assert f.value == int(lines[0])
            elif f.name == "UtcTime":
                assert f.value == lines[0]
            elif isinstance(f.value, list):
                assert f.value == list(golden_value(lines).values())  # exact: shortest repr round-trips
            else:
                assert f.value == float(lines[0])


@pytest.mark.parametrize("capture", ["1", "2", "3"])
def test_output_configuration_as_golden(capture: str) -> None:
    d = CAPTURES / capture
    cfg = decode_output_configuration((d / "outputconfig.bin").read_bytes())
    gold = parse_golden((d / "outputconfig.golden").read_text())[0]
    assert len(cfg) == len(gold)
    for (name, prec, frm, rate), (key, lines) in zip(cfg, gold.items(), strict=False):
        label = "UTCTime" if name == "UtcTime" else name
        label += f"({frm + ',' if frm else ''}{prec})" if prec else ""
        assert label == key
        assert lines[0] == ("Max" if rate == 0xFFFF else f"{rate} Hz")


def test_framing_extended_length_and_resync() -> None:
    big = bytes(range(256)) * 2
    stream = b"\x00\xfa\x13" + frame(MID.MTDATA2, b"\x01\x02") + frame(0x42, big) + b"garbage\xfa\xff"
    bad = bytearray(frame(MID.DEVICE_ID, b"\x01\x02\x03\x04"))
    bad[-1] ^= 1
    # a false preamble with a plausible length holds frames back until enough bytes arrived to
    # check it, so the stream continues (as a live device's does) with more frames
    stream += bytes(bad) + frame(MID.GOTO_CONFIG_ACK) + frame(MID.MTDATA2, bytes(100)) * 4
    p = XbusParser()
    out = []
    for i in range(0, len(stream), 7):  # any chunking
        out += p.feed(stream[i : i + 7])
    assert [(m.mid, m.payload) for m in out][:3] == [(MID.MTDATA2, b"\x01\x02"), (0x42, big), (MID.GOTO_CONFIG_ACK, b"")]
    assert len(out) >= 6
    assert p.errors.bad_checksum >= 1 and p.errors.garbage_bytes >= 3
    assert frame(0x42, big)[3] == 0xFF  # extended length form


def test_encode_mtdata2_round_trip() -> None:
    payload = encode_mtdata2([("PacketCounter", 7), ("SampleTimeFine", 123456), ("RateOfTurn", [0.5, -0.25, 0.125]),
                              ("Acceleration", [0.0, 9.75, 0.0]), ("Quaternion", [1.0, 0.0, 0.0, 0.0]), ("StatusWord", 3)])
    fields, rest = decode_mtdata2(payload + b"\x99\x99\x02\x00\x00")  # unknown id skipped by size
    assert rest == 0
    assert {f.name: f.value for f in fields} == {"PacketCounter": 7, "SampleTimeFine": 123456, "RateOfTurn": [0.5, -0.25, 0.125],
                                                 "Acceleration": [0.0, 9.75, 0.0], "Quaternion": [1.0, 0.0, 0.0, 0.0], "StatusWord": 3}


def test_parser_fuzz_never_raises_and_stays_bounded() -> None:
    rng = random.Random(1)
    real = (CAPTURES / "1" / "output.bin").read_bytes()
    frames = [frame(m.mid, m.payload) for m in XbusParser().feed(real)]
    p = XbusParser()
    for case in range(20000):
        if case % 4 == 1:
            data = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64)))
        elif case % 4 == 3:  # header-like bytes: preambles, bus ids, extended lengths
            data = bytes(rng.choice((0xFA, 0xFF, 0x36, 0x00, 0x0F, 0x10)) for _ in range(rng.randrange(1, 64)))
        else:
            f = bytearray(rng.choice(frames))
            for _ in range(rng.randrange(1, 4)):
                if not f:
                    break
                op = rng.randrange(3)
                k = rng.randrange(len(f))
                if op == 0:
                    f[k] = rng.randrange(256)
                elif op == 1:
                    del f[k:]
                else:
                    f.insert(k, 0xFA)
            data = bytes(f)
        for m in p.feed(data):
            decode_mtdata2(m.payload)  # decoding a surviving frame never raises either
        assert p.buffered <= 4096 + 8
    good = p.feed(real)
    assert len(good) >= 99  # still in sync afterwards


def test_xbus_decode_cli() -> None:
    out = subprocess.run([sys.executable, "-m", "estimator_service.cli", "xbus", "decode",
                          str(CAPTURES / "1" / "output.bin"), "--jsonl"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    frames = [json.loads(ln) for ln in lines[:100]]
    assert frames[0]["PacketCounter"] == 43398 and frames[0]["UtcTime"] == "2019-01-20T13:47:24.1219Z"
    assert frames[0]["Acceleration"] == [-0.017374228686094284, -7.255744934082031, -1.209552526473999]
    assert json.loads(lines[100]) == {"errors": {"garbage_bytes": 0, "bad_checksum": 0, "truncated": 0, "oversize": 0}, "frames": 100}


def test_error_kinds_counted_apart() -> None:
    """A frame cut short and overrun by the next one counts as truncated, a corrupted complete frame
    as a bad checksum, a preamble without bus id 0xFF as garbage; the good frames all come through."""
    good = [frame(MID.MTDATA2, bytes([k]) * 20) for k in range(1, 5)]
    corrupt = bytearray(good[2])
    corrupt[10] ^= 0x01
    stream = good[0] + good[1][:12] + good[1] + bytes(corrupt) + b"\xfa\x01" + good[3]
    p = XbusParser()
    out = [m for k in range(0, len(stream), 5) for m in p.feed(stream[k : k + 5])]
    assert [m.payload for m in out] == [bytes([1]) * 20, bytes([2]) * 20, bytes([4]) * 20]
    assert (p.errors.truncated, p.errors.bad_checksum, p.errors.oversize) == (1, 1, 0)
    assert p.errors.garbage_bytes == (12 - 1) + (len(corrupt) - 1) + 2  # the skipped bytes of each
    assert p.buffered == 0
    p.feed(b"\xfa\xff\x36\xff\x20\x00")  # extended length 8192 > MAX_PAYLOAD
    assert p.errors.oversize == 1 and p.feed(good[0])[0].payload == bytes([1]) * 20


def test_precisions_and_coordinate_systems() -> None:
    """Float64, Fp1220 and Fp1632 (negative: 2-byte signed integer part below the 4-byte fraction)
    and the coordinate-system bits of EulerAngles, from hand-built packets."""
    f64 = struct.pack(">ddd", 0.1, -2.5, 1e-9)
    fp1220 = struct.pack(">iii", -(3 << 19), 1 << 20, 1)  # -1.5, 1, 2^-20
    fp1632 = struct.pack(">Ih", 0x80000000, -2) + struct.pack(">Ih", 0x40000000, 3) + struct.pack(">Ih", 1, 0)
    payload = (struct.pack(">HB", 0x8023, 24) + f64 + struct.pack(">HB", 0x4021, 12) + fp1220
               + struct.pack(">HB", 0x2036, 18) + fp1632 + struct.pack(">HB", 0x2038, 12) + struct.pack(">fff", 1, 2, 3)
               + struct.pack(">HB", 0x8020, 5) + bytes(5))  # size not matching the type: skipped
    fields, rest = decode_mtdata2(payload)
    assert rest == 0
    assert [(f.name, f.value, f.precision, f.frame) for f in fields] == [
        ("RateOfTurn", [0.1, -2.5, 1e-9], "Float64", None),
        ("Acceleration", [-1.5, 1.0, 2.0**-20], "FP1220", None),
        ("EulerAngles", [-1.5, 3.25, 2.0**-32], "FP1632", "NorthEastDown"),
        ("EulerAngles", [1.0, 2.0, 3.0], "Float32", "NorthWestUp"),
    ]
    assert decode_mtdata2(payload + b"\x80\x20\x0c\x00")[1] == 4  # a packet running past the end


def test_xbus_decode_from_a_serial_port_and_bad_source(tmp_path: Path) -> None:
    """``xbus decode`` on a pty (a device path, read as a port for --duration) and a missing file."""
    from drivers.emulators.xsens import XsensEmulator

    with XsensEmulator(tmp_path / "mti", rate_hz=100):
        out = subprocess.run([sys.executable, "-m", "estimator_service.cli", "xbus", "decode", str(tmp_path / "mti"),
                              "--jsonl", "--duration", "1.0"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    *frames, summary = [json.loads(ln) for ln in out.stdout.splitlines()]
    assert len(frames) >= 20 and summary["frames"] == len(frames)
    counters = [f["PacketCounter"] for f in frames]
    assert counters == list(range(counters[0], counters[0] + len(frames)))
    assert set(frames[0]) == {"PacketCounter", "SampleTimeFine", "Quaternion", "Acceleration", "RateOfTurn", "StatusWord"}
    assert frames[0]["Acceleration"] == pytest.approx([0.0, 0.0, 9.81])
    bad = subprocess.run([sys.executable, "-m", "estimator_service.cli", "xbus", "decode", str(tmp_path / "nosuch.bin")],
                         capture_output=True, text=True, timeout=30)
    assert bad.returncode == 2 and "nosuch.bin: neither a readable file nor a serial port" in bad.stderr

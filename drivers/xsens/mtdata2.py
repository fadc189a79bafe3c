"""MTData2 payloads (and output configurations) of Xsens MTi devices.

An MTData2 payload is a sequence of packets: data id (u16), size (u8), data; all big endian.  The
data id holds group and type (``id & 0xFFF0``), the coordinate system (``id & 0x000C``: ENU, NED,
NWU) and, for real-valued outputs, the precision (``id & 0x0003``: Float32, Fp1220 = int32/2^20,
Fp1632 = 48-bit fixed point with 32 fraction bits, Float64).  Unknown ids are skipped by their size.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

PRECISION = {0: "Float32", 1: "FP1220", 2: "FP1632", 3: "Float64"}
COORDINATES = {0x0: "EastNorthUp", 0x4: "NorthEastDown", 0x8: "NorthWestUp"}
_SIZE = {0: 4, 1: 4, 2: 6, 3: 8}


@dataclass(frozen=True)
class Kind:
    """How to decode one data type: ``reals`` components, or a fixed struct ``fmt``."""

    name: str
    reals: int = 0
    fmt: str = ""
    labels: tuple[str, ...] = ()
    has_frame: bool = False  #: the coordinate system is part of the output (e.g. EulerAngles)


_XYZ = ("X", "Y", "Z")
_Q = ("Q0", "Q1", "Q2", "Q3")
KINDS: dict[int, Kind] = {
    0x0810: Kind("Temperature", reals=1),
    0x1010: Kind("UtcTime", fmt=">IHBBBBBB"),
    0x1020: Kind("PacketCounter", fmt=">H"),
    0x1060: Kind("SampleTimeFine", fmt=">I"),
    0x1070: Kind("SampleTimeCoarse", fmt=">I"),
    0x2010: Kind("Quaternion", reals=4, labels=_Q, has_frame=True),
    0x2020: Kind("RotationMatrix", reals=9, has_frame=True),
    0x2030: Kind("EulerAngles", reals=3, labels=_XYZ, has_frame=True),
    0x3010: Kind("BaroPressure", fmt=">I"),
    0x4010: Kind("DeltaV", reals=3, labels=_XYZ),
    0x4020: Kind("Acceleration", reals=3, labels=_XYZ),
    0x4030: Kind("FreeAcceleration", reals=3, labels=_XYZ),
    0x4040: Kind("AccelerationHR", reals=3, labels=_XYZ),
    0x5020: Kind("AltitudeEllipsoid", reals=1),
    0x5040: Kind("LatLon", reals=2, labels=("Lat", "Lon")),
    0x7010: Kind("GNSSPVTData", fmt=">IHBBBBBBIiBBBBiiiiIIiiiiiIIi7H"),
    0x8020: Kind("RateOfTurn", reals=3, labels=_XYZ),
    0x8030: Kind("DeltaQ", reals=4, labels=_Q),
    0x8040: Kind("RateOfTurnHR", reals=3, labels=_XYZ),
    0xC020: Kind("MagneticField", reals=3, labels=_XYZ),
    0xD010: Kind("VelocityXYZ", reals=3, labels=_XYZ, has_frame=True),
    0xE010: Kind("StatusByte", fmt=">B"),
    0xE020: Kind("StatusWord", fmt=">I"),
}
NAME_TO_ID = {k.name: i for i, k in KINDS.items()}
GNSS_PVT_FIELDS = ("ITOW", "Year", "Month", "Day", "Hour", "Min", "Sec", "Valid", "TAcc", "Nano", "FixType",
                   "Flags", "NumSV", "Reserved1", "Lon", "Lat", "Height", "HMSL", "HAcc", "VAcc", "VelN", "VelE",
                   "VelD", "GSpeed", "HeadMot", "SAcc", "HeadAcc", "HeadVeh", "GDOP", "PDOP", "TDOP", "VDOP",
                   "HDOP", "NDOP", "EDOP")


@dataclass
class Field:
    """One decoded output: Xsens name, value, and for reals the precision and coordinate system."""

    name: str
    value: object
    precision: str | None = None
    frame: str | None = None


def _real(data: bytes, precision: int) -> float:
    if precision == 0:
        return float(struct.unpack(">f", data)[0])
    if precision == 1:
        return struct.unpack(">i", data)[0] / 2.0**20
    if precision == 2:
        frac, whole = struct.unpack(">Ih", data)
        return ((whole << 32) | frac) / 2.0**32
    return float(struct.unpack(">d", data)[0])


def _utc(v: tuple) -> str:
    ns, year, month, day, hour, minute, second, _flags = v
    frac = f"{ns:09d}".rstrip("0")
    return f"{year:04d}-{month:02d}-{day:02d}T{hour:02d}:{minute:02d}:{second:02d}" + (f".{frac}" if frac else "") + "Z"


def decode_mtdata2(payload: bytes) -> tuple[list[Field], int]:
    """Decoded fields of one MTData2 payload, and the number of bytes that could not be decoded.

    Unknown ids and ids whose size does not match their type are skipped by their size; a packet
    running past the payload ends decoding (its bytes are counted as undecoded).
    """
    fields: list[Field] = []
    i, n = 0, len(payload)
    while i + 3 <= n:
        did, size = struct.unpack_from(">HB", payload, i)
        data = payload[i + 3 : i + 3 + size]
        if len(data) < size:
            return fields, n - i
        i += 3 + size
        kind = KINDS.get(did & 0xFFF0)
        if kind is None:
            continue
        if kind.reals:
            prec = did & 0x3
            width = _SIZE[prec]
            if size != kind.reals * width:
                continue
            vals = [_real(data[k * width : (k + 1) * width], prec) for k in range(kind.reals)]
            frame = COORDINATES.get(did & 0xC) if kind.has_frame else None
            fields.append(Field(kind.name, vals if kind.reals > 1 else vals[0], PRECISION[prec], frame))
        else:
            if size != struct.calcsize(kind.fmt):
                continue
            v = struct.unpack(kind.fmt, data)
            if kind.name == "UtcTime":
                fields.append(Field(kind.name, _utc(v)))
            elif kind.name == "GNSSPVTData":
                fields.append(Field(kind.name, dict(zip(GNSS_PVT_FIELDS, v, strict=False))))
            else:
                fields.append(Field(kind.name, v[0]))
    return fields, n - i


def as_json(fields: list[Field]) -> dict:
    """A frame as a JSON-ready dict keyed by Xsens field names (vectors as lists)."""
    return {f.name: f.value for f in fields}


def decode_output_configuration(payload: bytes) -> list[tuple[str, str | None, str | None, int]]:
    """(name, precision, coordinate system, rate Hz; 0xFFFF = max) of each configured output."""
    out = []
    for i in range(0, len(payload) - len(payload) % 4, 4):
        did, rate = struct.unpack_from(">HH", payload, i)
        kind = KINDS.get(did & 0xFFF0)
        name = kind.name if kind else f"0x{did:04X}"
        prec = PRECISION[did & 3] if kind and kind.reals else None
        frame = COORDINATES.get(did & 0xC) if kind and kind.has_frame else None
        out.append((name, prec, frame, rate))
    return out


def encode_output_configuration(items: list[tuple[str, int]], precision: int = 0) -> bytes:
    """SetOutputConfiguration payload for (name, rate Hz) items (reals in ``precision``, ENU)."""
    out = b""
    for name, rate in items:
        did = NAME_TO_ID[name]
        if KINDS[did].reals:
            did |= precision
        out += struct.pack(">HH", did, rate)
    return out


def encode_mtdata2(values: list[tuple[str, object]]) -> bytes:
    """An MTData2 payload (Float32 reals, ENU) of (name, value) pairs; for emulators and tests."""
    out = b""
    for name, value in values:
        did = NAME_TO_ID[name]
        kind = KINDS[did]
        if kind.reals:
            vals = list(value) if isinstance(value, (list, tuple)) else [value]  # type: ignore[arg-type]
            data = struct.pack(">" + "f" * len(vals), *vals)
        else:
            data = struct.pack(kind.fmt, value)
        out += struct.pack(">HB", did, len(data)) + data
    return out

"""Fuzz the CLI's file inputs: log headers, rig TOML and mechanism YAML, mutated (truncations, type
swaps, deep nesting, random bytes; seeded, a bounded count).  Every run must end in exit 0 (the
input happened to be valid) or exit 2 with a message naming the file — never a traceback.

Most cases run the real ``rigstate`` entry point in-process (helpers.run_main, output captured; an
escaping exception fails the test with its traceback); a sample runs as real processes.
"""

from __future__ import annotations

import random
import re
import struct
import zlib
from pathlib import Path

import msgpack
import pytest

from estimator_service import schema
from estimator_service.logfile import MAGIC, VERSION
from estimator_service.rig import load_rig
from estimator_service.simulate import simulate

from estimator_service.bus import free_port
from helpers import RIG, cli, rig_text, run_main

# runs backends (or estimator subprocesses): their kernels compiled before the tests start (conftest.py)
pytestmark = pytest.mark.kernels()

SEED = 20261123
N_YAML, N_TOML, N_HEADER = 40, 40, 40  #: mutated inputs per kind (in-process)

VALUES_TOML = ['"text"', "[1, 2]", "{ a = 1 }", "true", "-1", "0", "1e400", "nan", "[[1], [2]]", '""',
               '"../x"', '"\\u001b[31m"', "99999", '"tcp://127.0.0.1:99999"']
VALUES_YAML = ["[1, 2]", "{a: 1}", "true", '"x"', "-1", "0", ".nan", "null", "~", "[[[1]]]", "*nothere",
               "1/0", "sqrt(-1)", "'\\x00'", "!!binary aGVsbG8=", "[" * 3000 + "]" * 3000,
               "(" * 3000 + "1" + ")" * 3000, "-" * 3000 + "1"]


# ------------------------------------------------------------------------------------------ mutations
def mutate_bytes(rng: random.Random, data: bytes) -> bytes:
    """Truncate, overwrite or insert random bytes."""
    op = rng.randrange(3)
    i = rng.randrange(len(data) + 1)
    if op == 0:
        return data[:i]
    junk = bytes(rng.randrange(256) for _ in range(rng.randint(1, 16)))
    return data[:i] + junk + data[i + (len(junk) if op == 1 else 0):]


def swap_value(rng: random.Random, text: str, sep: str, values: list[str]) -> str:
    """Replace the value of one ``key <sep> value`` line by a value of another type."""
    lines = text.split("\n")
    candidates = [k for k, line in enumerate(lines) if re.match(rf"\s*-?\s*[A-Za-z_][\w.]*\s*{re.escape(sep)}\s*\S", line)]
    k = rng.choice(candidates)
    key = lines[k].split(sep, 1)[0]
    lines[k] = f"{key}{sep} {rng.choice(values)}"
    return "\n".join(lines)


def mutate_text(rng: random.Random, text: str, kind: str) -> bytes:
    """One mutation of a TOML (``kind`` "toml") or YAML text: bytes, value swap or deep nesting."""
    op = rng.randrange(4)
    if op == 0:
        return mutate_bytes(rng, text.encode())
    if op == 1 or op == 2:
        sep, values = ("=", VALUES_TOML) if kind == "toml" else (":", VALUES_YAML)
        return swap_value(rng, text, sep, values).encode()
    depth = rng.choice([50, 500, 3000])
    if kind == "toml":
        return (text.split("[[imu]]")[0] + f"\n[simulation]\nx = {'[' * depth}{']' * depth}\n").encode()
    return text.replace("mass: 11.10", "mass: " + "(" * depth + "11.1" + ")" * depth).encode() if rng.random() < 0.5 \
        else (text + "\nsliders: " + "[" * depth + "]" * depth + "\n").encode()


def mutate_header(rng: random.Random, header: dict) -> bytes:
    """The msgpack bytes of a mutated log header."""
    op = rng.randrange(6)
    if op == 0:  # not a map at all
        return msgpack.packb(rng.choice([[1, 2, 3], 7, "header", b"\x00\x01", None, [[header]], 1.5]))
    if op == 1:  # one key of another type
        h = dict(header)
        h[rng.choice(sorted(h))] = rng.choice([5, [1], {"a": 1}, b"bytes", None, True, 2.5, "text"])
        return msgpack.packb(h, use_bin_type=True)
    if op == 2:  # the rig texts mutated
        h = dict(header)
        key = rng.choice(["rig_toml", "mechanism_yaml"])
        raw = mutate_text(rng, h[key], "toml" if key == "rig_toml" else "yaml")
        h[key] = raw.decode("utf-8", errors="replace")
        return msgpack.packb(h, use_bin_type=True)
    if op == 3:  # deeply nested meta (packed by hand: msgpack's packer refuses such depth)
        h = dict(header)
        h.pop("meta")
        body = msgpack.packb(h, use_bin_type=True)
        depth = rng.choice([100, 3000])
        return bytes([body[0] + 1]) + body[1:] + msgpack.packb("meta") + b"\x91" * depth + b"\xc0"
    if op == 4:  # non-string keys
        return msgpack.packb({**header, 7: "x"} if rng.random() < 0.5 else {**header, b"k": 1}, use_bin_type=True)
    return mutate_bytes(rng, msgpack.packb(header, use_bin_type=True))


def write_log(path: Path, head: bytes, records: list[tuple[str, float, bytes]]) -> Path:
    """A log with exactly these header bytes (CRC made valid) and records."""
    from estimator_service.logfile import SYNC, _REC, _body

    out = MAGIC + struct.pack("<H", VERSION) + struct.pack("<II", len(head), zlib.crc32(head)) + head
    for topic, t, payload in records:
        body = _body(topic, t, payload)
        out += _REC.pack(SYNC, len(body), zlib.crc32(body)) + body
    path.write_bytes(out)
    return path


# ------------------------------------------------------------------------------------------ running
def run(argv: list[str], process: bool = False) -> tuple[int, str]:
    """``rigstate ARGV`` (exit code, stderr): in this process (helpers.run_main; an escaping exception fails the
    test with its traceback), or as a real process."""
    out = cli(*argv) if process else run_main(*argv)
    return out.returncode, out.stderr


def check(rc: int, err: str, names: list[str], what: str) -> None:
    """Exit 0, or exit 2 with a one-line message naming one of ``names``; never a traceback."""
    assert "Traceback" not in err, f"{what}: traceback\n{err}"
    assert rc in (0, 2), f"{what}: exit {rc}\n{err}"
    if rc == 2:
        assert "error:" in err and any(n in err for n in names), f"{what}: message names no file\n{err}"


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Valid inputs: the shipped rig (absolute mechanism path), its mechanism, a short simulated log."""
    d = tmp_path_factory.mktemp("fuzz-src")
    rig = load_rig(RIG)
    toml = rig_text()
    yaml_text = Path(rig.mechanism_path).read_text()
    header = rig.header({"command": "fuzz"})
    header["rig_path"] = str(d / "header-rig.toml")
    records = [(t, m["t"], schema.encode(t, m)) for t, m in simulate(rig=rig, duration=0.05, seed=1)]
    return {"toml": toml, "yaml": yaml_text, "header": header, "records": records}


def test_fuzz_mechanism_yaml(tmp_path: Path, sources: dict) -> None:
    rng = random.Random(SEED)
    outcomes = {0: 0, 2: 0}
    for i in range(N_YAML):
        path = tmp_path / f"mech{i}.yaml"
        path.write_bytes(mutate_text(rng, sources["yaml"], "yaml"))
        rc, err = run(["model", "check", str(path)])
        check(rc, err, [path.name], f"model check {path} ({path.read_bytes()[:200]!r})")
        outcomes[rc] += 1
    assert outcomes[2] >= N_YAML // 3  # most mutations are errors, and were reported as such


def test_fuzz_rig_toml(tmp_path: Path, sources: dict) -> None:
    rng = random.Random(SEED + 1)
    outcomes = {0: 0, 2: 0}
    for i in range(N_TOML):
        path = tmp_path / f"rig{i}.toml"
        path.write_bytes(mutate_text(rng, sources["toml"], "toml"))
        rc, err = run(["simulate", "--rig", str(path), "--duration", "0.01", "--out", str(tmp_path / f"o{i}.log")])
        check(rc, err, [path.name, "fourbar-sensors2016.yaml"], f"simulate --rig {path} ({path.read_bytes()[:200]!r})")
        outcomes[rc] += 1
    assert outcomes[2] >= N_TOML // 3


def test_fuzz_log_headers(tmp_path: Path, sources: dict) -> None:
    rng = random.Random(SEED + 2)
    outcomes = {0: 0, 2: 0}
    names = ["header-rig.toml"]
    for i in range(N_HEADER):
        log = write_log(tmp_path / f"h{i}.rslog", mutate_header(rng, sources["header"]), sources["records"])
        argv = [["log", "info", str(log)],
                ["estimate", str(log), "--out", str(tmp_path / f"e{i}.rslog")],
                ["replay", str(log), "--as-fast-as-possible", "--wait-s", "0",
                 "--endpoint", f"tcp://127.0.0.1:{free_port()}"]][i % 3]
        rc, err = run(argv)
        check(rc, err, [log.name, *names], " ".join(argv))
        outcomes[rc] += 1
    assert outcomes[2] >= N_HEADER // 3


def test_named_attacks(tmp_path: Path, sources: dict) -> None:
    """The inputs of issue 8 (some through real ``rigstate`` processes): exit 2, a message naming the
    file and the problem; topics with NUL and escape codes are exported and printed escaped."""
    head = sources["header"]
    recs = sources["records"]
    cases: list[tuple[list[str], str, str, bool]] = []  # argv, file named, problem, as a real process
    as_list = write_log(tmp_path / "list.rslog", msgpack.packb([1, 2, 3]), recs)
    for k, argv in enumerate((["log", "info", str(as_list)], ["estimate", str(as_list), "--out", str(tmp_path / "o.rslog")],
                              ["replay", str(as_list), "--wait-s", "0"])):
        cases.append((argv, "list.rslog", "log header must be a map", k == 0))
    wrong = write_log(tmp_path / "types.rslog", msgpack.packb({**head, "rig_toml": 5}), recs)
    for argv in (["log", "info", str(wrong)], ["estimate", str(wrong), "--out", str(tmp_path / "o.rslog")],
                 ["replay", str(wrong), "--wait-s", "0"]):
        cases.append((argv, "types.rslog", "'rig_toml' must be a string", False))
    (tmp_path / "latin1.toml").write_bytes(sources["toml"].replace("coupler", "coupl\xe9r").encode("latin-1"))
    cases.append((["simulate", "--rig", str(tmp_path / "latin1.toml"), "--out", str(tmp_path / "x.rslog")],
                  "latin1.toml", "not UTF-8", True))
    (tmp_path / "deep.yaml").write_text("points: " + "[" * 3000 + "]" * 3000 + "\n")
    cases.append((["model", "check", str(tmp_path / "deep.yaml")], "deep.yaml", "nested too deeply", True))
    (tmp_path / "deepexpr.yaml").write_text(sources["yaml"].replace("LA1: 0.120", "LA1: " + "(" * 3000 + "0.12" + ")" * 3000))
    cases.append((["model", "check", str(tmp_path / "deepexpr.yaml")], "deepexpr.yaml", "nested more than", False))
    good = write_log(tmp_path / "good.rslog", msgpack.packb(head, use_bin_type=True), recs)
    cases.append((["estimate", str(good), "--out", str(tmp_path / "missing" / "o.rslog")], "missing/o.rslog",
                  "No such file or directory", False))
    (tmp_path / "port.toml").write_text(sources["toml"].replace('sim = "tcp://127.0.0.1:5599"', 'sim = "tcp://127.0.0.1:99999"'))
    cases.append((["simulate", "--rig", str(tmp_path / "port.toml"), "--out", str(tmp_path / "p.rslog")], "port.toml",
                  "bus.sim: port must be a number from 1 to 65535, got '99999'", False))
    nul = write_log(tmp_path / "nul.rslog", msgpack.packb(head, use_bin_type=True),
                    recs[:3] + [("imu/a\x00b", 0.01, recs[0][2]), ("imu/\x1b[2J", 0.02, recs[0][2])])
    export = run_main("log", "export", str(nul), "--csv", str(tmp_path / "csv"))
    assert export.returncode == 0 and "\\x00" in export.stdout and "\x1b" not in export.stdout, export.stderr
    assert sorted(p.name for p in (tmp_path / "csv").iterdir()) == sorted(
        {"header.json"} | {t.replace("/", "__") + ".csv" for t, _, _ in recs[:3]})
    info = run_main("log", "info", str(nul))
    assert info.returncode == 0 and "imu/a\\x00b" in info.stdout and "imu/\\x1b[2J" in info.stdout
    assert "\x1b" not in info.stdout and "\x00" not in info.stdout
    for argv, name, problem, process in cases:
        rc, err = run(argv, process)
        assert rc == 2 and "Traceback" not in err, f"{argv}: exit {rc}\n{err}"
        assert name in err and problem in err, f"{argv}:\n{err}"

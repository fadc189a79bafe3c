"""Files and names: topics checked at the bus, control characters escaped wherever printed, record never
overwrites or follows a symlink, names in file names cannot leave their directory, bad ports are config errors."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import zmq

from estimator_service import bus, schema
from estimator_service.commands.watch import Watch
from estimator_service.errors import ConfigError
from estimator_service.names import file_stem, printable, topic_problem
from estimator_service.rig import load_rig

from estimator_service.bus import free_port
from helpers import RIG, rig_text, run_main


def imu(i: int) -> dict:
    return {"t": 0.01 * i, "seq": i, "gyr": [0.0, 0.0, 0.1], "acc": [0.0, 0.0, 9.81]}



def test_names_rules() -> None:
    assert printable("imu/a\x00b\x1b[2J\u202e") == "imu/a\\x00b\\x1b[2J\\u202e" and printable("crank 90°") == "crank 90°"
    assert [file_stem(s) for s in ("../x", "imu__coupler", "a/b\x00c", "", ".hidden", "..")] == \
        ["_._x", "imu__coupler", "a_b_c", "_", "_hidden", "_."]
    assert topic_problem("imu/coupler") is None and topic_problem("est/state") is None
    assert "characters" in topic_problem("imu/a b") and "longer" in topic_problem("imu/" + "x" * 200)
    with pytest.raises(schema.SchemaError, match="characters other than"):
        schema.encode("imu/\x1b[31m", imu(0))


def test_bus_drops_and_counts_invalid_topics() -> None:
    ep = f"tcp://127.0.0.1:{free_port()}"
    ctx = zmq.Context.instance()
    raw = ctx.socket(zmq.XPUB)
    raw.bind(ep)
    try:
        with bus.Subscriber(ep, topics=[""]) as sub:
            assert raw.poll(10_000) and raw.recv() == b"\x01"  # the subscription arrived
            good = schema.encode("imu/ok", imu(0))
            for topic in (b"imu/\x1b[2J", b"imu/a\x00b", b"imu/" + b"x" * 200, b"imu/sp ace", b"imu/ok"):
                raw.send_multipart([topic, good])
            got = sub.recv(timeout_s=10)
            assert got is not None and got[0] == "imu/ok"
            assert sub.malformed == 4 and sub.received == 1
    finally:
        raw.close(0)
    with bus.Publisher(f"tcp://127.0.0.1:{free_port()}") as pub, pytest.raises(schema.SchemaError):
        pub.publish_raw("imu/\x07", good)


def test_watch_escapes_strings_from_the_network() -> None:
    w = Watch()
    w.add("est/diag", schema.encode("est/diag", {"t": 1.0, "seq": 0, "status": "\x1b[2Jowned", "inputs": {},
                                                 "step_us": {"\x1b]0;x\x07": 1.0}}), time.time())
    table = w.table(time.time(), 0)
    assert "\x1b" not in table and "\x07" not in table and "\\x1b[2Jowned" in table


def test_record_never_overwrites_nor_follows_a_symlink(tmp_path: Path) -> None:
    ep = f"tcp://127.0.0.1:{free_port()}"
    existing = tmp_path / "existing.rslog"
    existing.write_bytes(b"precious")
    target = tmp_path / "target"
    target.write_bytes(b"not yours")
    link = tmp_path / "link.rslog"
    link.symlink_to(target)
    for out, extra in ((existing, []), (link, []), (link, ["--force"])):
        p = run_main("record", "--out", str(out), "--endpoint", ep, "--duration", "0.1", *extra)
        assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
        assert out.name in p.stderr and ("already exists" in p.stderr or "symbolic link" in p.stderr)
    assert existing.read_bytes() == b"precious" and target.read_bytes() == b"not yours" and link.is_symlink()
    p = run_main("record", "--out", str(existing), "--endpoint", ep, "--duration", "0.1", "--force")
    assert p.returncode == 0, p.stderr
    assert existing.read_bytes().startswith(b"RIGSTATE-LOG\n")
    p = run_main("record", "--out", str(tmp_path / "no" / "dir.rslog"), "--endpoint", ep, "--duration", "0.1")
    assert p.returncode == 2 and "no/dir.rslog: cannot create: No such file or directory" in p.stderr


def test_record_out_dir_keeps_a_hostile_rig_name_inside(tmp_path: Path) -> None:
    rig = tmp_path / "rigs" / "evil.toml"
    rig.parent.mkdir()
    rig.write_text(rig_text(RIG, [('name = "fourbar-sensors2016"', 'name = "../../escaped"')]))
    out = tmp_path / "logs" / "deep"
    out.mkdir(parents=True)
    p = run_main("record", "--config", str(rig), "--out-dir", str(out), "--endpoint", f"tcp://127.0.0.1:{free_port()}",
            "--duration", "0.1")
    assert p.returncode == 0, p.stderr
    written = list(out.iterdir())
    assert len(written) == 1 and written[0].name.startswith("_._.._escaped-") and written[0].suffix == ".rslog"
    assert sorted(q.name for q in tmp_path.rglob("*") if q.is_file()) == sorted(["evil.toml", written[0].name])


@pytest.mark.parametrize("port", ["99999", "0", "http", ""])
def test_endpoint_with_an_invalid_port_is_a_config_error(tmp_path: Path, port: str) -> None:
    path = tmp_path / "rig.toml"
    path.write_text(rig_text(RIG, [('endpoint = "tcp://127.0.0.1:5602"', f'endpoint = "tcp://127.0.0.1:{port}"')]))
    with pytest.raises(ConfigError) as err:
        load_rig(path)
    assert str(err.value).startswith(f"{path}: imu[1].endpoint: ") and f"tcp://127.0.0.1:{port}" in str(err.value)
    p = run_main("watch", "--once", "--endpoint", f"tcp://127.0.0.1:{port}")
    assert p.returncode == 2 and "Traceback" not in p.stderr and f"tcp://127.0.0.1:{port}" in p.stderr


def test_sensor_names_are_topic_safe(tmp_path: Path) -> None:
    path = tmp_path / "rig.toml"
    path.write_text(rig_text(RIG, [('name = "coupler"', 'name = "coup ler\\u001b"')]))
    with pytest.raises(ConfigError, match=r"imu\[0\]\.name: expected 1 to 64 characters .*coup ler\\x1b"):
        load_rig(path)


def test_log_import_names_file_and_row_for_bad_cells(tmp_path: Path) -> None:
    d = tmp_path / "csv"
    d.mkdir()
    (d / "imu__arm.csv").write_text("t,t_recv,seq,gyr_0,gyr_1,gyr_2,acc_0,acc_1,acc_2\n0.0,soon,0,0,0,0,0,0,9.8\n")
    p = run_main("log", "import", "--csv", str(d), "--out", str(tmp_path / "x.rslog"))
    assert p.returncode == 2 and "imu__arm.csv, row 2" in p.stderr and "Traceback" not in p.stderr
    (d / "imu__arm.csv").write_bytes(b"t,seq\n\xff\xfe,0\n")
    p = run_main("log", "import", "--csv", str(d), "--out", str(tmp_path / "y.rslog"))
    assert p.returncode == 2 and "imu__arm.csv" in p.stderr and "Traceback" not in p.stderr
    (d / "imu__arm.csv").write_text("t,seq\n0.0,0\n")
    (d / "header.json").write_text("[1, 2]")
    p = run_main("log", "import", "--csv", str(d), "--out", str(tmp_path / "z.rslog"))
    assert p.returncode == 2 and "header.json" in p.stderr and "Traceback" not in p.stderr
    assert not os.path.exists(tmp_path / "z.rslog")

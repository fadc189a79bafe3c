"""Data in users' tools: MCAP export/import (JSON channels with JSON Schemas), pandas DataFrames with
named columns, and the live Foxglove WebSocket bridge tested with a real WebSocket client."""

from __future__ import annotations

import asyncio
import json
import signal
import struct
import subprocess
import threading
from pathlib import Path

import msgpack
import pytest
from mcap.reader import make_reader
from mcap.writer import Writer

from estimator_service import schema
from estimator_service.bus import Publisher
from estimator_service.logfile import read_dataframes, read_log

from estimator_service.bus import free_port
from helpers import RIG, rigstate, run_main, write_sim_log

# runs backends (or estimator subprocesses): their kernels compiled before the tests start (conftest.py)
pytestmark = pytest.mark.kernels("ekf")


@pytest.fixture(scope="module")
def est_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("tools")
    sim = write_sim_log(d / "sim.log", RIG, 1.5, seed=3)
    out = d / "est.log"
    r = run_main("estimate", str(sim), "--backend", "ekf", "--out", str(out))
    assert r.returncode == 0, r.stderr
    return out


def test_mcap_export_has_json_channels_with_schemas_and_imports_back_byte_for_byte(est_log: Path, tmp_path: Path) -> None:
    mcap_path, back = tmp_path / "run.mcap", tmp_path / "back.log"
    r = run_main("log", "export", str(est_log), "--mcap", str(mcap_path))
    assert r.returncode == 0, r.stderr
    original = list(read_log(est_log))
    with open(mcap_path, "rb") as f:
        reader = make_reader(f)
        summary = reader.get_summary()
        assert summary is not None
        channels = {c.topic: c for c in summary.channels.values()}
        assert set(channels) == {rec.topic for rec in original}
        for ch in channels.values():
            assert ch.message_encoding == "json"
            sch = summary.schemas[ch.schema_id]
            assert sch.encoding == "jsonschema"
            js = json.loads(sch.data)
            assert js["type"] == "object" and set(js["required"]) <= set(js["properties"])
        header = {md.name: md.metadata for md in reader.iter_metadata()}["rigstate.header"]
        assert json.loads(header["mechanism_yaml"]) == read_log(est_log).header["mechanism_yaml"]
        f.seek(0)
        n = 0
        for sch, _channel, m in make_reader(f).iter_messages(log_time_order=False):
            msg = json.loads(m.data)
            js = json.loads(sch.data)
            assert set(js["required"]) <= set(msg) <= set(js["properties"])  # every message fits its schema
            assert m.publish_time == max(0, round(msg["t"] * 1e9))
            n += 1
        assert n == len(original)
    r = run_main("log", "import", "--mcap", str(mcap_path), "--out", str(back))
    assert r.returncode == 0, r.stderr
    again = list(read_log(back))
    assert [(a.topic, a.payload) for a in again] == [(o.topic, o.payload) for o in original]
    assert max(abs(a.t_recv - o.t_recv) for a, o in zip(again, original, strict=True)) < 1e-6
    assert read_log(back).header == read_log(est_log).header


def test_mcap_import_names_what_it_cannot_take(tmp_path: Path) -> None:
    bad = tmp_path / "ros.mcap"
    with open(bad, "wb") as f:
        w = Writer(f)
        w.start()
        sid = w.register_schema("x", "ros2msg", b"float64 a")
        cid = w.register_channel("imu/coupler", "cdr", sid)
        w.add_message(cid, log_time=1, data=b"\x00" * 8, publish_time=1)
        w.finish()
    r = run_main("log", "import", "--mcap", str(bad), "--out", str(tmp_path / "x.log"))
    assert r.returncode == 2 and "imu/coupler" in r.stderr and "cdr" in r.stderr and "Traceback" not in r.stderr
    (tmp_path / "junk.mcap").write_bytes(b"not an mcap file at all")
    r = run_main("log", "import", "--mcap", str(tmp_path / "junk.mcap"), "--out", str(tmp_path / "y.log"))
    assert r.returncode == 2 and "junk.mcap" in r.stderr and "Traceback" not in r.stderr


def test_dataframes_per_topic_with_coordinate_and_dof_names(est_log: Path) -> None:
    frames = read_dataframes(est_log)
    assert {"est/state", "truth/state", "imu/coupler", "enc/crank"} <= set(frames)
    est = frames["est/state"]
    assert est.index.name == "t"
    for col in ("z_crank", "zd_crank", "q_x1", "q_y1", "qd_x1", "status", "t_recv"):
        assert col in est.columns, col
    assert not any(c.startswith("q_0") for c in est.columns)
    imu = frames["imu/coupler"]
    assert {"gyr_x", "gyr_y", "gyr_z", "acc_x", "acc_y", "acc_z"} <= set(imu.columns)
    # the values are the messages' values
    first = schema.decode("est/state", next(r for r in read_log(est_log) if r.topic == "est/state").payload)
    assert est["z_crank"].iloc[0] == first["z"][0] and est.index[0] == first["t"]
    assert len(est) == sum(1 for r in read_log(est_log) if r.topic == "est/state")
    only = read_dataframes(est_log, topics=["enc/crank"])
    assert list(only) == ["enc/crank"] and "count" in only["enc/crank"].columns


async def _foxglove_client(url: str, want_topic: str) -> tuple[dict, dict, bytes]:
    import websockets

    async with websockets.connect(url, subprotocols=["foxglove.sdk.v1", "foxglove.websocket.v1"]) as ws:
        server_info = None
        while True:
            frame = await asyncio.wait_for(ws.recv(), 60)
            if isinstance(frame, str):
                op = json.loads(frame)
                if op["op"] == "serverInfo":
                    server_info = op
                elif op["op"] == "advertise":
                    for ch in op["channels"]:
                        if ch["topic"] == want_topic:
                            await ws.send(json.dumps({"op": "subscribe",
                                                      "subscriptions": [{"id": 7, "channelId": ch["id"]}]}))
                            channel = ch
            elif frame[0] == 0x01:  # message data: opcode, subscription id u32, log time u64, payload
                sub_id, _log_time = struct.unpack_from("<IQ", frame, 1)
                assert sub_id == 7
                assert server_info is not None
                return server_info, channel, frame[13:]


def test_foxglove_bridge_serves_bus_topics_to_a_websocket_client() -> None:
    bus_ep, ws_port = f"tcp://127.0.0.1:{free_port()}", free_port()
    proc = rigstate("foxglove", "--endpoint", bus_ep, "--port", str(ws_port), stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE, text=True)
    stop = threading.Event()
    sent = {"t": 0.5, "seq": 0, "gyr": [0.1, -0.2, 0.3], "acc": [0.0, 9.81, 0.0]}

    def publish() -> None:
        with Publisher(bus_ep) as pub:
            seq = 0
            while not stop.wait(0.01):
                pub.publish_raw("imu/coupler", schema.encode("imu/coupler", {**sent, "seq": seq}))
                pub.publish_raw("imu/coupler", msgpack.packb({"t": "bad"}))  # invalid: dropped by the bridge
                seq += 1

    pub_thread = threading.Thread(target=publish, daemon=True)
    pub_thread.start()
    try:
        line = proc.stdout.readline()  # the bridge says it serves once the server is up
        assert f":{ws_port}" in line, (line, proc.stderr.read() if proc.poll() is not None else "")
        info, channel, payload = asyncio.run(_foxglove_client(f"ws://127.0.0.1:{ws_port}", "imu/coupler"))
    finally:
        stop.set()
        pub_thread.join()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=20)
    assert code == 0
    assert info["name"] == "rigstate"
    assert channel["encoding"] == "json" and channel["schemaEncoding"] == "jsonschema"
    assert json.loads(channel["schema"]) == schema.json_schema("imu/coupler")
    msg = json.loads(payload)
    assert {k: msg[k] for k in ("t", "gyr", "acc")} == {k: sent[k] for k in ("t", "gyr", "acc")}


def test_foxglove_bridge_rejects_a_bad_port() -> None:
    r = run_main("foxglove", "--port", "99999")
    assert r.returncode == 2 and "--port" in r.stderr and "Traceback" not in r.stderr


"""record / replay / watch as real processes on real loopback sockets and real files."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from estimator_service import bus, schema
from estimator_service.logfile import LogWriter, read_log
from estimator_service.rig import load_rig
from estimator_service.bus import free_port
from helpers import RIG, read_pty, rigstate, wait_until


def imu(seq: int, t: float) -> dict:
    return {"t": t, "seq": seq, "gyr": [0.01 * seq, -0.5, 0.25], "acc": [0.1, 9.81, -0.2]}


def enc(seq: int, t: float) -> dict:
    return {"t": t, "seq": seq, "count": 7 * seq - 100, "cpr": 4096}


def est(seq: int, t: float) -> dict:
    return {"t": t, "seq": seq, "q": [0.1, 0.2], "qd": [0.0, 0.0], "z": [0.1], "zd": [0.3],
            "crank": 1.0, "crank_rate": 0.3, "backend": "ekf", "status": "ok"}


def test_record_kill9_reads_back_every_flushed_message(tmp_path, endpoint):
    out = tmp_path / "run.rslog"
    proc = rigstate("record", "--out", str(out), "--config", str(RIG), "--endpoint", endpoint)
    try:
        with bus.Publisher(endpoint, hwm=100000) as pub:
            assert pub.wait_for_subscribers("imu/a", timeout_s=60), "recorder did not subscribe"
            sent = []
            for i in range(300):
                topic, msg = ("imu/a", imu(i, i * 0.01)) if i % 3 else ("enc/crank", enc(i, i * 0.01))
                pub.publish(topic, msg)
                sent.append((topic, schema.encode(topic, msg)))
                if i % 50 == 0:  # invalid payloads: counted by the recorder, not written
                    pub.publish_raw("imu/a", b"\xc1 not msgpack")
                    pub.publish_raw("imu/a", schema.encode("enc/x", enc(i, 0.0)))
                    pub.publish_raw("bogus/topic", schema.encode("imu/a", imu(i, 0.0)))
            flushed = len(sent)  # on disk within the 100 ms flush guarantee, while the stream goes on:
            assert wait_until(lambda: len(list(read_log(out))) >= flushed, 60), "the recorder did not flush"
            for i in range(300, 3000):  # still streaming when the recorder is killed
                pub.publish("imu/a", imu(i, i * 0.01))
                sent.append(("imu/a", schema.encode("imu/a", imu(i, i * 0.01))))
                if i == 1000:
                    proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        proc.kill()
    reader = read_log(out)
    got = [(r.topic, r.payload) for r in reader]
    assert flushed <= len(got) <= len(sent)
    assert got == sent[: len(got)]  # exact bytes, in order, nothing invalid, nothing lost before the kill
    assert reader.header["rig_toml"] == RIG.read_text()
    assert reader.header["mechanism_yaml"] == Path(load_rig(RIG).mechanism_path).read_text()
    assert reader.header["format"] == "rigstate-log" and reader.header["meta"]["endpoints"] == [endpoint]


def test_record_sigterm_exits_zero_with_summary(tmp_path, endpoint):
    out = tmp_path / "logs"
    out.mkdir()
    proc = rigstate("record", "--out-dir", str(out), "--config", str(RIG), "--endpoint", endpoint,
                    stdout=subprocess.PIPE, text=True)
    try:
        with bus.Publisher(endpoint) as pub:
            assert pub.wait_for_subscribers("est/state", timeout_s=60)
            pub.publish_raw("est/state", b"\x81\xa1t\xcb\x7f\xf8\x00\x00\x00\x00\x00\x00")  # {"t": nan}
            for i in range(100):
                pub.publish("est/state", est(i, 0.001 * i))
            # the last of them on disk: the recorder has taken every message (in order) before the signal
            assert wait_until(lambda: [len(list(read_log(f))) for f in out.iterdir()] == [100], 60)
            proc.send_signal(signal.SIGTERM)
            stdout, _ = proc.communicate(timeout=10)
    finally:
        proc.kill()
    assert proc.returncode == 0
    (log_path,) = out.iterdir()
    assert log_path.name.startswith("fourbar-sensors2016-") and log_path.suffix == ".rslog"
    records = list(read_log(log_path))
    assert [schema.decode(r.topic, r.payload)["seq"] for r in records] == list(range(100))
    assert "100 messages" in stdout and "(1 invalid, not recorded)" in stdout


def _sensor_log(path: Path, sim_endpoint: str) -> list[tuple[str, bytes, float]]:
    """A 2 s log of imu/enc/truth/est messages; returns the records replay must publish."""
    rig = load_rig(RIG)
    header = rig.header({"test": True})
    header["rig_toml"] = header["rig_toml"].replace('sim = "tcp://127.0.0.1:5599"', f'sim = "{sim_endpoint}"')
    assert sim_endpoint in header["rig_toml"]
    expected = []
    with LogWriter(path, header) as w:
        for i in range(400):
            t = 1000.0 + i * 0.005
            for topic, msg in (("imu/coupler", imu(i, t)), ("enc/crank", enc(i, t)), ("est/state", est(i, t))):
                if topic == "enc/crank" and i % 2:
                    continue
                payload = schema.encode(topic, msg)
                w.write(topic, t, payload)
                if not topic.startswith("est/"):
                    expected.append((topic, payload, t))
    return expected


def _receive(sub: bus.Subscriber, n: int, proc: subprocess.Popen, timeout_s: float = 60) -> list[tuple[str, bytes, float]]:
    got: list[tuple[str, bytes, float]] = []
    deadline = time.monotonic() + timeout_s
    while len(got) < n and time.monotonic() < deadline:
        m = sub.recv(0.2)
        if m is not None:
            got.append(m)
        elif proc.poll() not in (None, 0):
            break
    return got


def test_replay_exact_bytes_and_order_on_the_header_endpoint(tmp_path):
    """``replay --speed 10`` publishes every sensor message (no est/*) with its recorded bytes, in order, on the
    header's sim endpoint.  (How closely it keeps the log's timing is a figure, not a test.)"""
    sim = f"tcp://127.0.0.1:{free_port()}"
    log_path = tmp_path / "in.rslog"
    expected = _sensor_log(log_path, sim)
    with bus.Subscriber(sim, topics=["imu/", "enc/", "est/"]) as sub:  # connects before replay binds
        proc = rigstate("replay", str(log_path), "--speed", "10", stdout=subprocess.PIPE, text=True)
        try:
            got = _receive(sub, len(expected), proc)
            assert sub.recv(0.3) is None  # nothing else (no est/*)
            stdout, _ = proc.communicate(timeout=30)
        finally:
            proc.kill()
    assert proc.returncode == 0
    assert [(t, p) for t, p, _ in got] == [(t, p) for t, p, _ in expected]
    assert f"replayed {len(expected)} of {len(expected)} messages" in stdout


def test_replay_as_fast_as_possible_loses_nothing_with_a_slow_subscriber(tmp_path, endpoint):
    log_path = tmp_path / "big.rslog"
    rig = load_rig(RIG)
    n = 20000
    with LogWriter(log_path, rig.header()) as w:
        for i in range(n):
            w.write("imu/coupler", i * 0.001, schema.encode("imu/coupler", imu(i, i * 0.001)))
    with bus.Subscriber(endpoint, topics=["imu/"], hwm=50) as sub:
        proc = rigstate("replay", str(log_path), "--as-fast-as-possible", "--endpoint", endpoint, "--hwm", "50",
                        stdout=subprocess.PIPE, text=True)
        try:
            seqs = []
            deadline = time.monotonic() + 120
            while len(seqs) < n and time.monotonic() < deadline:
                m = sub.recv(0.5)
                if m is not None:
                    seqs.append(schema.decode(m[0], m[1])["seq"])
                    if len(seqs) % 2000 == 0:
                        time.sleep(0.05)  # paces the producer: a stalling subscriber holds replay back (not a wait)
            stdout, _ = proc.communicate(timeout=30)
        finally:
            proc.kill()
    assert proc.returncode == 0
    assert seqs == list(range(n))
    assert f"replayed {n} of {n}" in stdout


def _publish_mix(pub: bus.Publisher, seconds: float) -> None:
    t_end = time.monotonic() + seconds
    i = 0
    while time.monotonic() < t_end:
        now = time.time()
        pub.publish("imu/coupler", imu(i, now))
        pub.publish("enc/crank", enc(i, now))
        pub.publish("est/state", est(i, now))
        if i % 20 == 0:
            pub.publish_raw("enc/crank", b"\x00garbage")
        i += 1
        time.sleep(0.01)  # paces the producer: 100 messages a second per topic


def test_watch_plain_output_shows_topics_values_and_invalid(endpoint):
    with bus.Publisher(endpoint) as pub:
        proc = rigstate("watch", "--endpoint", endpoint, "--duration", "3", stdout=subprocess.PIPE, text=True)
        try:
            assert pub.wait_for_subscribers("imu/coupler", timeout_s=60)
            _publish_mix(pub, 1.0)
            stdout, _ = proc.communicate(timeout=30)
        finally:
            proc.kill()
    assert proc.returncode == 0
    final = stdout.strip().split("\n\n")[-1]
    rows = {line.split()[0]: line.split() for line in final.splitlines()[1:] if line.split()}
    assert {"imu/coupler", "enc/crank", "est/state"} <= rows.keys()
    assert int(rows["imu/coupler"][1]) > 20  # count
    assert int(rows["enc/crank"][4]) >= 1  # invalid payloads counted
    assert "gyr" in final and "crank   57.30°" in final  # est crank = 1 rad
    assert "\x1b[" not in stdout


def test_watch_on_a_terminal_clears_and_redraws(endpoint):
    master, slave = os.openpty()
    with bus.Publisher(endpoint) as pub:
        proc = rigstate("watch", "--endpoint", endpoint, "--topic", "est/", "--duration", "2.5", stdout=slave)
        os.close(slave)
        try:
            assert pub.wait_for_subscribers("est/state", timeout_s=60)
            _publish_mix(pub, 1.0)
            out = read_pty(master, 10)
            assert proc.wait(timeout=30) == 0
        finally:
            proc.kill()
            os.close(master)
    text = out.decode()
    assert text.count("\x1b[H\x1b[2J") >= 3  # redrawn about 4 times a second
    assert "est/state" in text and "imu/coupler" not in text

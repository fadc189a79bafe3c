"""Authenticated bus (ZeroMQ CURVE, ``[bus.auth]``): key generation, real sockets, the estimator process.

An unauthenticated publisher (no CURVE, or another server key) never reaches an authenticated
subscriber — not even its subscription reaches the publisher — while the rig's publishers do; a
subscriber whose key is not allowed gets nothing.  No mocks: real sockets on 127.0.0.1, real processes.
"""

from __future__ import annotations

import logging
import re
import signal
import stat
import subprocess
import time
from pathlib import Path

import pytest
import zmq.auth

from estimator_service import bus, schema
from estimator_service.commands.keys import generate
from estimator_service.errors import ConfigError
from estimator_service.rig import load_rig

from estimator_service.bus import free_port
from helpers import RIG, ep, rig_text, rigstate, run_main, write_sim_log

# runs backends (or estimator subprocesses): their kernels compiled before the tests start (conftest.py)
pytestmark = pytest.mark.kernels()


def imu(i: int) -> dict:
    return {"t": 0.01 * i, "seq": i, "gyr": [0.0, 0.0, 0.1], "acc": [0.0, 0.0, 9.81]}


def auth_of(keys: Path, client: str = "client", source: str = "test.toml") -> bus.CurveAuth:
    return bus.CurveAuth(source, keys / "server.key", keys / "server.key_secret", keys / f"{client}.key_secret",
                         keys / "clients")


def auth_rig(tmp_path: Path) -> Path:
    """The shipped rig on free loopback ports with ``[bus.auth]`` and keys from ``rigstate keys generate``."""
    text = re.sub(r"tcp://127\.0\.0\.1:\d+", lambda _m: ep(), rig_text())
    path = tmp_path / "rig.toml"
    path.write_text(text + "\n[bus.auth]\n")  # the defaults: keys/ next to the rig file
    assert run_main("keys", "generate", str(tmp_path / "keys")).returncode == 0
    return path


def test_keys_generate_writes_zmq_key_files_private_and_never_overwrites(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    out = run_main("keys", "generate", str(keys))
    assert out.returncode == 0, out.stderr
    assert "[bus.auth]" in out.stdout
    mode = lambda p: stat.S_IMODE(p.stat().st_mode)  # noqa: E731
    for name in ("server", "client"):
        public, secret = zmq.auth.load_certificate(keys / f"{name}.key_secret")
        assert zmq.auth.load_certificate(keys / f"{name}.key") == (public, None) and len(public) == len(secret) == 40
        assert mode(keys / f"{name}.key_secret") == 0o600 and mode(keys / f"{name}.key") == 0o644
    assert zmq.auth.load_certificates(keys / "clients") == {zmq.auth.load_certificate(keys / "client.key")[0]: True}
    assert mode(keys) == 0o700
    before = (keys / "server.key_secret").read_bytes()
    again = run_main("keys", "generate", str(keys))
    assert again.returncode == 2 and "already exists" in again.stderr and "Traceback" not in again.stderr
    assert (keys / "server.key_secret").read_bytes() == before
    laptop = run_main("keys", "generate", str(keys), "--client", "laptop")
    assert laptop.returncode == 0 and (keys / "clients" / "laptop.key").exists()
    assert mode(keys / "laptop.key_secret") == 0o600
    bad = run_main("keys", "generate", str(keys), "--client", "../evil")
    assert bad.returncode == 2 and not (tmp_path / "evil.key").exists()


def test_only_authenticated_publishers_reach_an_authenticated_subscriber(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    generate(keys)
    generate(keys, "laptop")
    other = tmp_path / "other"  # a second, unrelated key set: another server key
    generate(other)
    auth = auth_of(keys)
    good_ep, plain_ep, foreign_ep = ep(), ep(), ep()
    with bus.Publisher(good_ep, auth=auth) as good, bus.Publisher(plain_ep) as plain, \
            bus.Publisher(foreign_ep, auth=auth_of(other)) as foreign, \
            bus.Subscriber([plain_ep, foreign_ep, good_ep], topics=["imu/"], auth=auth) as sub:
        assert good.wait_for_subscribers("imu/good", timeout_s=10)
        # the handshakes with the impostors failed: their subscription never arrived
        assert plain.subscribers() == 0 and foreign.subscribers() == 0
        got: list[str] = []
        for i in range(200):
            plain.publish("imu/plain", imu(i))
            foreign.publish("imu/foreign", imu(i))
            good.publish("imu/good", imu(i))
        while len(got) < 200:
            m = sub.recv(timeout_s=10)
            assert m is not None, f"only {len(got)} of 200 authenticated messages arrived"
            got.append(m[0])
            assert schema.decode(m[0], m[1])["seq"] == len(got) - 1
        assert set(got) == {"imu/good"}
        assert sub.recv(timeout_s=0.2) is None  # and nothing else is queued
        assert plain.subscribers() == 0 and foreign.subscribers() == 0
    # subscribers: an allowed second client is served; an unknown key or no CURVE at all is not
    pub_ep = ep()
    with bus.Publisher(pub_ep, auth=auth) as pub, \
            bus.Subscriber(pub_ep, topics=["imu/a"], auth=auth_of(other, "client")) as unknown, \
            bus.Subscriber(pub_ep, topics=["imu/b"]) as no_curve, \
            bus.Subscriber(pub_ep, topics=["imu/c"], auth=auth_of(keys, "laptop")) as laptop:
        assert pub.wait_for_subscribers("imu/c", timeout_s=10)
        assert pub.subscribers("imu/a") == 0 and pub.subscribers("imu/b") == 0
        for topic in ("imu/a", "imu/b", "imu/c"):
            pub.publish(topic, imu(1))
        m = laptop.recv(timeout_s=10)
        assert m is not None and m[0] == "imu/c"
        assert unknown.recv(timeout_s=0.2) is None and no_curve.recv(timeout_s=0.2) is None


def test_estimator_process_ignores_an_unauthenticated_publisher(tmp_path: Path) -> None:
    rig_path = auth_rig(tmp_path)
    rig = load_rig(rig_path)
    assert rig.bus.auth is not None and rig.bus.auth.allowed_clients == tmp_path / "keys" / "clients"
    log = write_sim_log(tmp_path / "sim.rslog", rig_path, 3.0)
    est = rigstate("estimator", "--config", str(rig_path))
    try:
        with bus.Subscriber(rig.bus.estimator, topics=["est/"], auth=rig.bus.auth) as sub:
            # phase 1: an impostor binds the sim endpoint without CURVE and streams valid sensor data
            with bus.Publisher(rig.bus.sim) as impostor:
                diags, states, i = 0, 0, 0
                while diags < 3:  # est/diag comes once a second: >= 2 s of impostor traffic
                    for _ in range(20):
                        impostor.publish("imu/coupler", imu(i))
                        impostor.publish("imu/rocker", imu(i))
                        i += 1
                    m = sub.recv(timeout_s=0.01)
                    if m is not None:
                        diags += m[0] == "est/diag"
                        states += m[0] == "est/state"
                    assert est.poll() is None
                assert states == 0 and impostor.subscribers() == 0
            # phase 2: the recorded rig replayed by an authenticated publisher (a real process; the
            # keys come from [bus.auth] of the rig in the log header)
            rep = rigstate("replay", str(log), "--speed", "5", stdout=subprocess.PIPE, text=True)
            got_state = False
            end = time.monotonic() + 60
            while not got_state and time.monotonic() < end:
                m = sub.recv(timeout_s=0.2)
                got_state = m is not None and m[0] == "est/state"
            out, _ = rep.communicate(timeout=60)
            assert got_state, "no estimate from the authenticated replay"
            assert rep.returncode == 0 and "replayed" in out
    finally:
        est.send_signal(signal.SIGTERM)
        assert est.wait(timeout=20) == 0


def test_bus_auth_config_errors_name_file_field_and_value(tmp_path: Path) -> None:
    rig_path = auth_rig(tmp_path)
    text = rig_path.read_text()
    bad = tmp_path / "bad.toml"
    bad.write_text(text.replace("[bus.auth]\n", '[bus.auth]\nserver_secret_key = "nowhere/server.key_secret"\n'))
    rig = load_rig(bad)  # files are read only when a socket needs them
    with pytest.raises(ConfigError, match=r"bad\.toml: bus\.auth\.server_secret_key: .*nowhere/server\.key_secret"):
        bus.Publisher(ep(), auth=rig.bus.auth)
    out = run_main("replay", str(write_sim_log(tmp_path / "x.rslog", RIG, 0.1)), "--config", str(bad), "--wait-s", "0")
    assert out.returncode == 2 and "bus.auth.server_secret_key" in out.stderr and "Traceback" not in out.stderr
    (tmp_path / "typo.toml").write_text(text.replace("[bus.auth]\n", '[bus.auth]\nserver_keys = "x"\n'))
    with pytest.raises(ConfigError, match=r"typo\.toml: bus\.auth\.server_keys: unknown key"):
        load_rig(tmp_path / "typo.toml")
    empty = tmp_path / "empty"
    empty.mkdir()
    (tmp_path / "noclients.toml").write_text(text.replace("[bus.auth]\n", '[bus.auth]\nallowed_clients = "empty"\n'))
    with pytest.raises(ConfigError, match=r"bus\.auth\.allowed_clients: .*none found"):
        bus.Publisher(ep(), auth=load_rig(tmp_path / "noclients.toml").bus.auth)


def test_binding_beyond_loopback_without_auth_warns(caplog: pytest.LogCaptureFixture, tmp_path: Path) -> None:
    port = free_port()
    with caplog.at_level(logging.WARNING, logger="estimator_service.bus"):
        with bus.Publisher(f"tcp://127.0.0.1:{free_port()}"):
            pass
        assert not caplog.records
        with bus.Publisher(f"tcp://*:{port}"):
            pass
    assert len(caplog.records) == 1 and "WITHOUT authentication" in caplog.records[0].getMessage()
    keys = tmp_path / "keys"
    generate(keys)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="estimator_service.bus"):
        with bus.Publisher(f"tcp://*:{free_port()}", auth=auth_of(keys)):
            pass
    assert not caplog.records
    (keys / "server.key_secret").chmod(0o644)  # a secret others can read: said so
    with caplog.at_level(logging.WARNING, logger="estimator_service.bus"):
        with bus.Publisher(f"tcp://127.0.0.1:{free_port()}", auth=auth_of(keys)):
            pass
    assert [r.getMessage() for r in caplog.records] == [
        f"{keys / 'server.key_secret'}: secret key readable by other users (chmod 600 {keys / 'server.key_secret'})"]


def test_hardware_drivers_publish_with_the_rig_keys(tmp_path: Path) -> None:
    """``driver xsens`` and ``driver encoder`` (real processes on the pty emulators) with ``--config``
    of a rig with ``[bus.auth]``: an authenticated subscriber gets their messages, a plain one nothing."""
    from drivers.emulators.counter_board import CounterBoardEmulator
    from drivers.emulators.xsens import XsensEmulator

    rig_path = auth_rig(tmp_path)
    rig = load_rig(rig_path)
    coupler = next(i for i in rig.imus if i.name == "coupler")
    crank = next(e for e in rig.encoders if e.name == "crank")
    with XsensEmulator(tmp_path / "mti", rate_hz=100), \
            CounterBoardEmulator(tmp_path / "board", channels=1, lines=1024, rate_hz=200):
        procs = [rigstate(*args)
                 for args in (["driver", "xsens", "--port", str(tmp_path / "mti"), "--name", "coupler",
                               "--config", str(rig_path)],
                              ["driver", "encoder", "--backend", "serial", "--port", str(tmp_path / "board"),
                               "--name", "crank", "--channel", "0", "--config", str(rig_path)])]
        try:
            with bus.Subscriber([coupler.endpoint, crank.endpoint], topics=["imu/", "enc/"]) as plain, \
                    bus.Subscriber([coupler.endpoint, crank.endpoint], topics=["imu/", "enc/"],
                                   auth=rig.bus.auth) as sub:
                seen: dict[str, int] = {}
                end = time.monotonic() + 60
                while min(seen.get("imu/coupler", 0), seen.get("enc/crank", 0)) < 20 and time.monotonic() < end:
                    m = sub.recv(timeout_s=0.2)
                    if m is not None:
                        schema.decode(m[0], m[1])
                        seen[m[0]] = seen.get(m[0], 0) + 1
                    assert all(p.poll() is None for p in procs)
                assert seen.get("imu/coupler", 0) >= 20 and seen.get("enc/crank", 0) >= 20, seen
                assert plain.recv(timeout_s=0.5) is None  # after >= 0.2 s of both streams
                assert plain.handshake_failures >= 1  # it tried, and was refused
        finally:
            for p in procs:
                p.send_signal(signal.SIGTERM)
            assert [p.wait(timeout=20) for p in procs] == [0, 0]

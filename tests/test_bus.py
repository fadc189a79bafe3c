"""The bus over real ZeroMQ sockets on 127.0.0.1 (free ports)."""

from __future__ import annotations

import threading
import time

import msgpack
import pytest
import zmq

from estimator_service import bus, schema
from estimator_service.errors import UserError

from helpers import wait_until


def free_endpoint() -> str:
    return f"tcp://127.0.0.1:{bus.free_port()}"


def imu_msg(seq: int) -> dict:
    return {"t": seq * 0.01, "seq": seq, "gyr": [0.1, -0.2, 0.3 + seq], "acc": [0.0, 9.81, 0.0]}


def recv_all(sub: bus.Subscriber, n: int, timeout_s: float = 5.0) -> list[tuple[str, bytes, float]]:
    out = []
    deadline = time.monotonic() + timeout_s
    while len(out) < n and time.monotonic() < deadline:
        got = sub.recv(0.1)
        if got is not None:
            out.append(got)
    return out


def test_round_trip_exact_bytes_and_decoded_values():
    ep = free_endpoint()
    with bus.Publisher(ep) as pub, bus.Subscriber([ep], topics=["imu/"]) as sub:
        assert pub.wait_for_subscribers("imu/a", timeout_s=5)
        t0 = time.time()
        for i in range(50):
            assert pub.publish("imu/a", imu_msg(i))
        got = recv_all(sub, 50)
    assert [g[0] for g in got] == ["imu/a"] * 50
    for i, (topic, payload, t_recv) in enumerate(got):
        assert payload == schema.encode(topic, imu_msg(i))
        assert schema.decode(topic, payload)["gyr"] == [0.1, -0.2, 0.3 + i]
        assert t0 - 1 < t_recv < time.time() + 1
    assert pub.sent == 50 and pub.dropped == 0 and sub.received == 50


def test_endpoint_streams_read_each_publishers_queue_on_its_own():
    """A reader that fell behind holds a fast publisher's backlog and a slow one's messages; read per
    endpoint, each stream comes in its publisher's order, whatever the other holds."""
    fast_ep, slow_ep = free_endpoint(), free_endpoint()
    with bus.Publisher(fast_ep, hwm=10000) as fast, bus.Publisher(slow_ep) as slow, \
            bus.EndpointStreams([fast_ep, slow_ep, fast_ep], topics=["enc/", "imu/"]) as streams:
        assert len(streams.takers) == 2  # one per endpoint, however often it is listed
        assert fast.wait_for_subscribers("enc/a") and slow.wait_for_subscribers("imu/b")
        for i in range(1000):
            fast.publish("enc/a", {"t": i * 1e-3, "seq": i, "count": i, "cpr": 4096})
        for i in range(11):
            slow.publish("imu/b", imu_msg(i))
        got: list[list] = [[], []]
        deadline = time.monotonic() + 30
        while (len(got[0]), len(got[1])) != (1000, 11):
            assert time.monotonic() < deadline, (len(got[0]), len(got[1]))
            streams.wait(0.1)
            for k, take in enumerate(streams.takers):
                while (m := take()) is not None:
                    got[k].append(m)
        assert not streams.wait(0.05) and streams.takers[0]() is None
    assert [t for t, _, _ in got[0]] == ["enc/a"] * 1000 and [t for t, _, _ in got[1]] == ["imu/b"] * 11
    assert [schema.decode(t, p)["seq"] for t, p, _ in got[0]] == list(range(1000))
    assert [schema.decode(t, p)["seq"] for t, p, _ in got[1]] == list(range(11))


def test_topic_prefix_filtering_and_two_publishers():
    ep1, ep2 = free_endpoint(), free_endpoint()
    with bus.Publisher(ep1) as p1, bus.Publisher(ep2) as p2, \
            bus.Subscriber([ep1, ep2], topics=["imu/", "est/state"]) as sub:
        assert p1.wait_for_subscribers("imu/x") and p2.wait_for_subscribers("est/state")
        assert p1.subscribers("enc/crank") == 0 and p1.subscribers("est/state") == 1
        p1.publish("enc/crank", {"t": 0.0, "seq": 0, "count": 5, "cpr": 4096})
        p1.publish("imu/x", imu_msg(1))
        p2.publish_raw("est/diag", b"\x80")
        p2.publish_raw("est/state", b"raw bytes")
        got = recv_all(sub, 2)
        assert sub.recv(0.2) is None
    assert sorted((t, p) for t, p, _ in got) == [("est/state", b"raw bytes"),
                                                ("imu/x", schema.encode("imu/x", imu_msg(1)))]


def test_subscription_count_follows_subscribers():
    ep = free_endpoint()
    with bus.Publisher(ep) as pub:
        assert not pub.wait_for_subscribers("imu/a", timeout_s=0.2)
        with bus.Subscriber(ep, topics=[""]), bus.Subscriber(ep, topics=["imu/"]):
            assert pub.wait_for_subscribers("imu/a", count=2)
            assert pub.subscribers("enc/b") == 1
        assert wait_until(lambda: pub.subscribers("imu/a") == 0, 60)


def test_invalid_message_is_schema_error_before_sending():
    ep = free_endpoint()
    with bus.Publisher(ep) as pub:
        with pytest.raises(schema.SchemaError, match="gyr"):
            pub.publish("imu/a", {"t": 0.0, "seq": 0, "gyr": [1.0, float("nan"), 0.0], "acc": [0, 0, 0]})
        assert pub.sent == 0


def test_bind_conflict_and_bad_endpoint_are_user_errors():
    ep = free_endpoint()
    with bus.Publisher(ep):
        with pytest.raises(UserError, match=ep):
            bus.Publisher(ep)
    with pytest.raises(UserError, match="nonsense"):
        bus.Subscriber(["nonsense://x"])


def test_stalled_subscriber_never_blocks_nodrop_publisher_counts_drops():
    """A SUB that never reads: the nodrop publisher refuses (and counts) instead of blocking."""
    ep = free_endpoint()
    payload = bytes(4000)
    n = 20000  # 80 MB offered: far more than the queues (hwm 100 each side) + TCP buffers hold
    with bus.Publisher(ep, hwm=100, nodrop=True) as pub, bus.Subscriber(ep, hwm=100):
        assert pub.wait_for_subscribers("est/state")
        results = [pub.publish_raw("est/state", payload) for _ in range(n)]  # returns: never blocks
    assert pub.sent + pub.dropped == n
    assert pub.dropped > n // 2 and pub.sent >= 100
    assert results.count(False) == pub.dropped


def test_stalled_subscriber_does_not_starve_a_healthy_one():
    """Default policy: the stalled subscriber loses messages, the reading one gets every message."""
    ep = free_endpoint()
    payload = bytes(4000)
    n = 5000
    with bus.Publisher(ep, hwm=100) as pub, bus.Subscriber(ep, hwm=100) as stalled, \
            bus.Subscriber(ep, topics=["est/"], hwm=n + 10) as good:
        assert pub.wait_for_subscribers("est/state", count=2)
        got = []
        for i in range(n):  # lock step: the healthy reader takes each message before the next
            assert pub.publish_raw("est/state", i.to_bytes(4, "little") + payload)
            msg = good.recv(5.0)
            assert msg is not None, f"message {i} did not arrive"
            got.append(int.from_bytes(msg[1][:4], "little"))
        stalled_got = 0
        while stalled.recv(0.5) is not None:
            stalled_got += 1
    assert pub.sent == n and pub.dropped == 0
    assert got == list(range(n))
    assert stalled_got < n  # the stalled subscriber lost its own messages


def test_malformed_multipart_is_counted_and_dropped():
    ep = free_endpoint()
    ctx = zmq.Context.instance()
    raw = ctx.socket(zmq.PUB)
    raw.setsockopt(zmq.LINGER, 0)
    raw.bind(ep)
    try:
        with bus.Subscriber(ep, topics=[""]) as sub:
            good = msgpack.packb({"x": 1})
            # slow joiner without XPUB: repeat a probe until the subscriber sees one
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                raw.send_multipart([b"probe", good])
                if sub.recv(0.05) is not None:
                    break
            while sub.recv(0.1) is not None:
                pass
            before = sub.received
            raw.send_multipart([b"imu/a"])  # one frame
            raw.send_multipart([b"imu/a", good, b"extra"])  # three frames
            raw.send_multipart([b"imu/\xff\xfe", good])  # topic not UTF-8
            raw.send_multipart([b"imu/a", good])
            got = sub.recv(2.0)
            assert got is not None and got[:2] == ("imu/a", good)
            assert sub.malformed == 3 and sub.received == before + 1
    finally:
        raw.close()


def test_close_is_prompt_with_unsent_messages_to_a_dead_peer():
    ep = free_endpoint()
    pub = bus.Publisher(ep, hwm=10000)
    with bus.Subscriber(ep, hwm=1):
        assert pub.wait_for_subscribers()
        for _ in range(2000):
            pub.publish_raw("est/state", bytes(10000))
    closing = threading.Thread(target=pub.close)
    closing.start()
    closing.join(timeout=60)  # a bound for a broken close (ZeroMQ's default linger waits for ever), not a figure
    assert not closing.is_alive()


def test_free_port_is_bindable_and_never_an_ephemeral_port() -> None:
    """A subscriber retrying a connect to an ephemeral port can connect to itself and take the port
    its publisher is about to bind (CI: "Address already in use"): test ports come from below the range."""
    low, _high = bus._ephemeral_range()
    ports = {bus.free_port() for _ in range(50)}
    assert all(1024 <= p < low for p in ports) and len(ports) > 40
    with bus.Publisher(f"tcp://127.0.0.1:{ports.pop()}") as pub:
        assert pub is not None

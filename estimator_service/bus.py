"""The message bus: ZeroMQ PUB/SUB with multipart frames [topic, msgpack payload].

Every publisher binds its own endpoint; subscribers connect to a list of endpoints (ZeroMQ
reconnects by itself, so start order does not matter).  Sends never block: at the high-water
mark a message is dropped and counted (a stalled subscriber cannot stall a publisher).  Binding
``tcp://*:port`` or a non-loopback address exposes the bus to the network; the defaults are loopback.
"""

from __future__ import annotations

import time
from types import TracebackType

import zmq

from estimator_service import schema


class Publisher:
    """Bind ``endpoint`` and publish validated messages without ever blocking."""

    def __init__(self, endpoint: str, hwm: int = 1000, context: zmq.Context | None = None) -> None:
        self.endpoint = endpoint
        self._ctx = context or zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.PUB)
        self._sock.setsockopt(zmq.SNDHWM, hwm)
        self._sock.setsockopt(zmq.LINGER, 200)
        self._sock.bind(endpoint)
        self.sent = 0
        self.dropped = 0

    def publish(self, topic: str, msg: dict) -> bool:
        """Validate (schema.encode) and send; False if dropped at the high-water mark."""
        return self.publish_raw(topic, schema.encode(topic, msg))

    def publish_raw(self, topic: str, payload: bytes) -> bool:
        """Send exact payload bytes (replay); False if dropped at the high-water mark."""
        try:
            self._sock.send_multipart([topic.encode(), payload], flags=zmq.NOBLOCK)
        except zmq.Again:
            self.dropped += 1
            return False
        self.sent += 1
        return True

    def close(self) -> None:
        self._sock.close()

    def __enter__(self) -> "Publisher":
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


class Subscriber:
    """Connect to endpoints and receive (topic, payload, t_recv) for the given topic prefixes.

    Malformed multipart messages (not two frames, non-UTF-8 topic) are counted in ``malformed`` and
    dropped.
    """

    def __init__(self, endpoints: list[str] | str, topics: list[str] | None = None, hwm: int = 100000,
                 context: zmq.Context | None = None) -> None:
        self._ctx = context or zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.RCVHWM, hwm)
        self._sock.setsockopt(zmq.LINGER, 0)
        for t in topics if topics is not None else [""]:
            self._sock.setsockopt(zmq.SUBSCRIBE, t.encode())
        self.endpoints = [endpoints] if isinstance(endpoints, str) else list(endpoints)
        for ep in self.endpoints:
            self._sock.connect(ep)
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        self.received = 0
        self.malformed = 0

    def recv(self, timeout_s: float = 0.1) -> tuple[str, bytes, float] | None:
        """The next message, or None after ``timeout_s`` seconds without one."""
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if not self._poller.poll(max(0, int(left * 1000))):
                return None
            frames = self._sock.recv_multipart(flags=zmq.NOBLOCK)
            t_recv = time.time()
            if len(frames) != 2:
                self.malformed += 1
                continue
            try:
                topic = frames[0].decode()
            except UnicodeDecodeError:
                self.malformed += 1
                continue
            self.received += 1
            return topic, frames[1], t_recv

    def close(self) -> None:
        self._sock.close()

    def __enter__(self) -> "Subscriber":
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

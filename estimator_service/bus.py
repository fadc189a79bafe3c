"""The message bus: ZeroMQ PUB/SUB with multipart frames ``[topic utf-8, msgpack payload]``.

Every publisher BINDS its own endpoint; subscribers CONNECT to a list of endpoints (ZeroMQ
reconnects by itself, so start order does not matter).

Sends never block.  Two drop policies (ZeroMQ queues per subscriber, ``hwm`` messages each):

* ``nodrop=False`` (default, drivers and the estimator): a subscriber whose queue is full loses
  the message, the others still get it; ``publish`` returns True.  Subscribers see such losses
  as gaps in ``seq``.  A stalled client (say a suspended ``rigstate watch``) costs nobody else.
* ``nodrop=True`` (replay): if ANY matching subscriber's queue is full the message is not sent
  at all and ``publish`` returns False (counted in ``dropped``); the caller may retry later, which
  paces the sender on its slowest subscriber without loss.

Slow joiners: a subscription reaches the publisher some milliseconds after ``connect``; messages
sent before that are lost (ZeroMQ PUB/SUB semantics).  The publisher socket is an XPUB, so it
sees the subscriptions: :meth:`Publisher.wait_for_subscribers` blocks until ``count``
subscriptions cover a topic.  Use it in tests and in ``replay``; live drivers just start.

Security: the defaults are loopback (``tcp://127.0.0.1:<port>``).  Binding ``tcp://*:<port>``
or a LAN address exposes the bus, unauthenticated, to every host that can reach that port.
"""

from __future__ import annotations

import math
import time
from types import TracebackType

import zmq

from estimator_service import names, schema
from estimator_service.errors import UserError


def endpoint_problem(endpoint: str) -> str | None:
    """Why ``endpoint`` is not a usable ZeroMQ endpoint, or None.

    Accepted: ``tcp://<host>:<port>`` with a port 1..65535 (``*`` as host binds every interface),
    ``ipc://<path>``, ``inproc://<name>``.  ZeroMQ itself would bind port 99999 as another port.
    """
    if not isinstance(endpoint, str) or not endpoint.startswith(("tcp://", "ipc://", "inproc://")):
        return f"expected a ZeroMQ endpoint like tcp://127.0.0.1:5601, got {endpoint!r}"
    if not endpoint.startswith("tcp://"):
        return None if endpoint.partition("://")[2] else f"missing the address after :// in {endpoint!r}"
    host, sep, port = endpoint[len("tcp://"):].rpartition(":")
    if not sep or not host:
        return f"expected tcp://<host>:<port>, got {endpoint!r}"
    if not (port.isascii() and port.isdigit()) or not 1 <= int(port) <= 65535:
        return f"port must be a number from 1 to 65535, got {port!r} in {endpoint!r}"
    return None


def _check_endpoint(endpoint: str) -> None:
    problem = endpoint_problem(endpoint)
    if problem is not None:
        raise UserError(f"bus endpoint: {problem}")


def _socket(kind: int, endpoint_for_error: str, context: zmq.Context | None) -> zmq.Socket:
    ctx = context or zmq.Context.instance()
    try:
        return ctx.socket(kind)
    except zmq.ZMQError as exc:  # e.g. too many open files
        raise UserError(f"{endpoint_for_error}: cannot create a ZeroMQ socket: {exc}") from None


class Publisher:
    """Bind ``endpoint`` and publish messages without ever blocking.

    ``hwm``: per-subscriber send queue, messages.  ``sent`` / ``dropped`` count messages handed to
    ZeroMQ / refused at the high-water mark (only with ``nodrop=True``, see the module docstring).
    """

    def __init__(self, endpoint: str, hwm: int = 1000, nodrop: bool = False,
                 context: zmq.Context | None = None) -> None:
        self.endpoint = endpoint
        _check_endpoint(endpoint)
        self._sock = _socket(zmq.XPUB, endpoint, context)
        self._sock.setsockopt(zmq.SNDHWM, hwm)
        self._sock.setsockopt(zmq.LINGER, 100)  # ms: close() never hangs on a dead subscriber
        self._sock.setsockopt(zmq.XPUB_VERBOSER, 1)  # every (un)subscription, so they can be counted
        self._sock.setsockopt(zmq.XPUB_NODROP, int(nodrop))
        try:
            self._sock.bind(endpoint)
        except zmq.ZMQError as exc:
            self._sock.close(0)
            raise UserError(f"cannot bind bus endpoint {endpoint!r}: {exc}") from None
        self.sent = 0
        self.dropped = 0
        self._subscriptions: dict[bytes, int] = {}  # prefix -> number of live subscriptions

    def publish(self, topic: str, msg: dict) -> bool:
        """Validate and pack (``schema.encode``, SchemaError on a bad message), then send.

        Returns False if the message was refused at the high-water mark (``nodrop=True``).
        """
        return self.publish_raw(topic, schema.encode(topic, msg))

    def publish_raw(self, topic: str, payload: bytes) -> bool:
        """Send exact payload bytes (replay); False if refused at the high-water mark.

        SchemaError if ``topic`` is not a valid topic name (:func:`names.topic_problem`).
        """
        problem = names.topic_problem(topic)
        if problem is not None:
            raise schema.SchemaError(problem)
        self._drain_subscriptions()
        try:
            self._sock.send_multipart([topic.encode(), payload], flags=zmq.NOBLOCK)
        except zmq.Again:
            self.dropped += 1
            return False
        self.sent += 1
        return True

    def subscribers(self, topic: str = "") -> int:
        """Live subscriptions whose prefix matches ``topic`` (one subscriber may hold several)."""
        self._drain_subscriptions()
        t = topic.encode()
        return sum(n for prefix, n in self._subscriptions.items() if t.startswith(prefix))

    def wait_for_subscribers(self, topic: str = "", count: int = 1, timeout_s: float = 5.0) -> bool:
        """Block until ``count`` subscriptions match ``topic`` or ``timeout_s`` s pass; True if reached."""
        deadline = time.monotonic() + timeout_s
        while self.subscribers(topic) < count:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self._sock.poll(min(50, max(1, int(left * 1000))), zmq.POLLIN)
        return True

    def _drain_subscriptions(self) -> None:
        """Read the (un)subscription messages the XPUB socket queued (cheap when there are none)."""
        while self._sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            frame = self._sock.recv(zmq.NOBLOCK)
            if not frame or frame[0] not in (0, 1):
                continue  # not a subscription message (a peer sent data to a PUB): ignore
            prefix, n = frame[1:], self._subscriptions.get(frame[1:], 0)
            n = n + 1 if frame[0] == 1 else max(0, n - 1)
            if n:
                self._subscriptions[prefix] = n
            else:
                self._subscriptions.pop(prefix, None)

    def close(self, linger_s: float = 0.1) -> None:
        """Close the socket; queued messages get at most ``linger_s`` s to leave.

        The messages leave from ZeroMQ's I/O thread: a process that must deliver everything before
        it exits (``replay``) uses its own context and terminates it after ``close`` (that waits).
        """
        self._sock.close(linger=int(linger_s * 1000))

    def __enter__(self) -> "Publisher":
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


class Subscriber:
    """Connect to ``endpoints`` and receive ``(topic, payload, t_recv)`` for the topic prefixes.

    ``topics``: prefixes (``"imu/"``, ``"est/state"``); None or ``[""]`` = everything.  ``hwm``:
    receive queue, messages.  Malformed multipart messages (not exactly two frames, topic not UTF-8,
    or not a valid topic name: charset and length, :func:`names.topic_problem`) are counted in
    ``malformed`` and dropped; payloads are not decoded here (``schema.decode``).
    """

    def __init__(self, endpoints: list[str] | str, topics: list[str] | None = None, hwm: int = 100000,
                 context: zmq.Context | None = None) -> None:
        self.endpoints = [endpoints] if isinstance(endpoints, str) else list(endpoints)
        self.topics = list(topics) if topics is not None else [""]
        for ep in self.endpoints:
            _check_endpoint(ep)
        self._sock = _socket(zmq.SUB, ", ".join(self.endpoints), context)
        self._sock.setsockopt(zmq.RCVHWM, hwm)
        self._sock.setsockopt(zmq.LINGER, 0)
        for t in self.topics:
            self._sock.setsockopt(zmq.SUBSCRIBE, t.encode())
        for ep in self.endpoints:
            try:
                self._sock.connect(ep)
            except zmq.ZMQError as exc:
                self._sock.close(0)
                raise UserError(f"cannot connect to bus endpoint {ep!r}: {exc}") from None
        self.received = 0
        self.malformed = 0

    def recv(self, timeout_s: float = 0.1) -> tuple[str, bytes, float] | None:
        """The next well-formed message, or None after ``timeout_s`` s without one.

        ``t_recv`` is the host clock (``time.time()``, s) when the message was taken off the socket.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                frames = self._sock.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                left = deadline - time.monotonic()
                if left <= 0 or not self._sock.poll(math.ceil(left * 1000), zmq.POLLIN):
                    return None
                continue
            t_recv = time.time()
            if len(frames) != 2:
                self.malformed += 1
                continue
            try:
                topic = frames[0].decode()
            except UnicodeDecodeError:
                self.malformed += 1
                continue
            if not names.check_topic(topic):
                self.malformed += 1
                continue
            self.received += 1
            return topic, frames[1], t_recv

    def close(self) -> None:
        self._sock.close()

    def __enter__(self) -> "Subscriber":
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

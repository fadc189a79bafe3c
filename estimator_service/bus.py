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
subscriptions cover a topic.  Use it in tests, ``replay`` and ``driver sim``; live drivers just start.

Security: the defaults are loopback (``tcp://127.0.0.1:<port>``) without authentication; binding
``tcp://*:<port>`` or a LAN address that way exposes the bus to every host that can reach the port
(a warning is logged).  With :class:`CurveAuth` (``[bus.auth]`` of the rig, keys from
``rigstate keys generate``) every socket speaks ZeroMQ CURVE: publishers are CURVE servers holding
the rig's server key pair and accept only the client public keys in ``allowed_clients`` (a ZAP
handler, one per ZeroMQ context); subscribers are CURVE clients with their own key pair that trust
only the server public key.  A publisher without the server secret key cannot reach a subscriber,
and a subscriber whose key is not allowed receives nothing; traffic is encrypted.
"""

from __future__ import annotations

import hashlib
import logging
import math
import random
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import recv_monitor_message

from estimator_service import names, schema
from estimator_service.errors import ConfigError, UserError

log = logging.getLogger(__name__)

#: hosts of tcp:// endpoints that are reachable from this machine only
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "[::1]", "::1", "lo")


@dataclass(frozen=True)
class CurveAuth:
    """``[bus.auth]``: ZeroMQ CURVE key files (zmq certificate format, ``rigstate keys generate``).

    ``server_key``: the rig's server public key (every subscriber trusts it).  ``server_secret_key``:
    the server key pair (every publisher presents it).  ``client_secret_key``: this host's client
    key pair (its subscribers present it).  ``allowed_clients``: directory of client public keys
    (``*.key``) the publishers accept, read when a publisher starts.  ``source``: the rig file, for
    errors.  Files are read only when a socket needs them (a driver host needs no client key).
    """

    source: str
    server_key: Path
    server_secret_key: Path
    client_secret_key: Path
    allowed_clients: Path

    def _cert(self, field_name: str, path: Path, secret: bool) -> tuple[bytes, bytes | None]:
        err = lambda problem: ConfigError(self.source, f"bus.auth.{field_name}", f"{path}: {problem}")  # noqa: E731
        try:
            public, secret_key = zmq.auth.load_certificate(path)
        except (OSError, ValueError) as exc:
            raise err(f"cannot read a CURVE key file: {getattr(exc, 'strerror', None) or exc}") from None
        if secret and secret_key is None:
            raise err("has no secret key (give the .key_secret file)")
        if secret and path.stat().st_mode & 0o077:
            log.warning("%s: secret key readable by other users (chmod 600 %s)", path, path)
        return public, secret_key

    def server_pair(self) -> tuple[bytes, bytes]:
        """(public, secret) key of the publishers."""
        public, secret = self._cert("server_secret_key", self.server_secret_key, True)
        assert secret is not None
        return public, secret

    def server_public(self) -> bytes:
        """The server public key subscribers trust."""
        return self._cert("server_key", self.server_key, False)[0]

    def client_pair(self) -> tuple[bytes, bytes]:
        """(public, secret) key of this host's subscribers."""
        public, secret = self._cert("client_secret_key", self.client_secret_key, True)
        assert secret is not None
        return public, secret

    def check_allowed_clients(self) -> None:
        """ConfigError unless ``allowed_clients`` is a directory with at least one ``*.key`` file."""
        d = self.allowed_clients
        if not d.is_dir() or not any(d.glob("*.key")):
            raise ConfigError(self.source, "bus.auth.allowed_clients",
                              f"{d}: expected a directory of client public keys (*.key); none found")


class _Zap:
    """One ZAP handler (pyzmq's ThreadAuthenticator) per ZeroMQ context, shared by its CURVE publishers.

    The handler of the process-wide context lives as long as the process (a daemon thread; starting
    a new one right after stopping one fails while ZeroMQ still holds the old one's address); that
    of a private context stops with its last publisher, so the context can be terminated.
    """

    _lock = threading.Lock()
    _by_context: dict[int, tuple[ThreadAuthenticator, int]] = {}  # id(context) -> (handler, users)

    @classmethod
    def acquire(cls, ctx: zmq.Context, auth: CurveAuth) -> str:
        """Start (or reuse) the context's handler and allow ``auth.allowed_clients``; returns the ZAP domain."""
        auth.check_allowed_clients()
        location = str(auth.allowed_clients.resolve())
        domain = "rigstate-" + hashlib.sha1(location.encode()).hexdigest()[:16]  # ZAP domains are short
        with cls._lock:
            handler, users = cls._by_context.get(id(ctx), (None, 0))
            if handler is None:
                handler = ThreadAuthenticator(ctx, log=logging.getLogger(__name__ + ".zap"))
                handler.start()
            handler.configure_curve(domain=domain, location=location)
            cls._by_context[id(ctx)] = (handler, users + 1)
        return domain

    @classmethod
    def release(cls, ctx: zmq.Context) -> None:
        """One publisher of ``ctx`` closed; the last one stops the handler."""
        with cls._lock:
            handler, users = cls._by_context.pop(id(ctx), (None, 0))
            if handler is None:
                return
            if users > 1 or ctx is zmq.Context.instance():
                cls._by_context[id(ctx)] = (handler, users - 1)
            else:
                handler.stop()


#: where :func:`free_port` looks when the kernel's ephemeral range is unknown (Linux's default)
_EPHEMERAL_DEFAULT = (32768, 60999)


def _ephemeral_range() -> tuple[int, int]:
    """The kernel's range of ports for outgoing connections (``ip_local_port_range``)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return _EPHEMERAL_DEFAULT


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now and outside the kernel's ephemeral range.

    A subscriber connects before its publisher binds (ZeroMQ retries every ~100 ms); were the port
    an ephemeral one, a retry's own local port could be that same port and TCP connects the socket
    to itself, so the publisher's bind fails with "Address already in use" (seen in CI).  Ports
    below the ephemeral range are never chosen by the kernel for outgoing connections.  Free is
    checked by binding, so two callers racing for the same port remain possible but unlikely
    (a random pick among ~20000)."""
    rng = random.SystemRandom()
    low = _ephemeral_range()[0]
    lowest = 20000 if low > 21024 else 1024
    for _ in range(200):
        port = rng.randrange(lowest, low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # every pick taken: let the kernel choose
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def is_loopback(endpoint: str) -> bool:
    """True for endpoints other hosts cannot reach: tcp:// on a loopback host, ipc://, inproc://."""
    if not endpoint.startswith("tcp://"):
        return True
    host = endpoint[len("tcp://"):].rpartition(":")[0].rpartition(";")[2]  # "iface;host" connects
    return host in LOOPBACK_HOSTS or host.startswith("127.")


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
    ``auth``: CURVE server with the rig's keys (None: no authentication).
    """

    def __init__(self, endpoint: str, hwm: int = 1000, nodrop: bool = False,
                 context: zmq.Context | None = None, auth: CurveAuth | None = None) -> None:
        self.endpoint = endpoint
        _check_endpoint(endpoint)
        if auth is None and not is_loopback(endpoint):
            log.warning("binding %s WITHOUT authentication: any host that reaches it can subscribe; "
                        "set [bus.auth] in the rig (docs/config.md)", endpoint)
        self._ctx = context or zmq.Context.instance()
        self._zap = False
        self._sock = _socket(zmq.XPUB, endpoint, self._ctx)
        if auth is not None:
            try:
                public, secret = auth.server_pair()
                self._sock.zap_domain = _Zap.acquire(self._ctx, auth).encode()
            except BaseException:
                self._sock.close(0)
                raise
            self._zap = True
            self._sock.curve_server = True
            self._sock.curve_publickey, self._sock.curve_secretkey = public, secret
        self._sock.setsockopt(zmq.SNDHWM, hwm)
        self._sock.setsockopt(zmq.LINGER, 100)  # ms: close() never hangs on a dead subscriber
        self._sock.setsockopt(zmq.XPUB_VERBOSER, 1)  # every (un)subscription, so they can be counted
        self._sock.setsockopt(zmq.XPUB_NODROP, int(nodrop))
        try:
            self._sock.bind(endpoint)
        except zmq.ZMQError as exc:
            self.close(0)
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

    def wait_for_subscribers(self, topic: str | Sequence[str] = "", count: int = 1, timeout_s: float = 5.0,
                             stop: threading.Event | None = None) -> bool:
        """Block until ``count`` subscriptions match ``topic`` (a list: any one of them), ``timeout_s`` s pass or
        ``stop`` is set; True if reached.  A subscriber of a prefix (or of everything) matches every topic under it;
        one of a whole topic only that topic (a topic-wise subscriber, e.g. the estimator, is not counted by "")."""
        topics = [topic] if isinstance(topic, str) else list(topic)
        deadline = time.monotonic() + timeout_s
        while not any(self.subscribers(t) >= count for t in topics):
            left = deadline - time.monotonic()
            if left <= 0 or (stop is not None and stop.is_set()):
                return False
            self._sock.poll(min(50, max(1, int(left * 1000))), zmq.POLLIN)  # (a subscription wakes it)
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
        if self._zap:
            self._zap = False
            _Zap.release(self._ctx)

    def __enter__(self) -> Publisher:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


class Subscriber:
    """Connect to ``endpoints`` and receive ``(topic, payload, t_recv)`` for the topic prefixes.

    ``topics``: prefixes (``"imu/"``, ``"est/state"``); None or ``[""]`` = everything.  ``hwm``:
    receive queue, messages.  Malformed multipart messages (not exactly two frames, topic not UTF-8,
    or not a valid topic name: charset and length, :func:`names.topic_problem`) are counted in
    ``malformed`` and dropped; payloads are not decoded here (``schema.decode``).  ``auth``: CURVE
    client with this host's key pair, trusting only the rig's server key (None: no authentication).

    A failed handshake (an impostor without the server key bound the endpoint, or a CURVE mismatch)
    makes ZeroMQ give up on that endpoint for good; the subscriber watches its socket's events,
    counts such failures in ``handshake_failures`` and connects again after ``RETRY_S`` s, so the
    real publisher is picked up once it is back.
    """

    RETRY_S = 0.5  #: wait before connecting again to an endpoint whose handshake failed (s)
    WARN_EVERY_S = 10.0  #: at most one handshake warning per endpoint in this time (s)
    _HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
                         | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)

    def __init__(self, endpoints: list[str] | str, topics: list[str] | None = None, hwm: int = 100000,
                 context: zmq.Context | None = None, auth: CurveAuth | None = None) -> None:
        self.endpoints = [endpoints] if isinstance(endpoints, str) else list(endpoints)
        self.topics = list(topics) if topics is not None else [""]
        for ep in self.endpoints:
            _check_endpoint(ep)
        self._sock = _socket(zmq.SUB, ", ".join(self.endpoints), context)
        self._sock.setsockopt(zmq.RCVHWM, hwm)
        self._sock.setsockopt(zmq.LINGER, 0)
        if auth is not None:
            try:
                server, (public, secret) = auth.server_public(), auth.client_pair()
            except BaseException:
                self._sock.close(0)
                raise
            self._sock.curve_serverkey = server
            self._sock.curve_publickey, self._sock.curve_secretkey = public, secret
        for t in self.topics:
            self._sock.setsockopt(zmq.SUBSCRIBE, t.encode())
        self._monitor = self._sock.get_monitor_socket(self._HANDSHAKE_FAILED)
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)
        for ep in self.endpoints:
            try:
                self._sock.connect(ep)
            except zmq.ZMQError as exc:
                self.close()
                raise UserError(f"cannot connect to bus endpoint {ep!r}: {exc}") from None
        self.received = 0
        self.malformed = 0
        self.handshake_failures = 0
        self._retry: dict[str, float] = {}  # endpoint -> monotonic time to connect again
        self._warned: dict[str, float] = {}  # endpoint -> monotonic time of the last warning

    def _reconnect_failed(self) -> None:
        """Connect again to endpoints whose handshake failed ``RETRY_S`` s ago (see the class docstring)."""
        while self._monitor.poll(0):
            event = recv_monitor_message(self._monitor)
            endpoint = event["endpoint"].decode(errors="replace")
            if event["event"] & self._HANDSHAKE_FAILED and endpoint in self.endpoints:
                self.handshake_failures += 1
                now = time.monotonic()
                if now - self._warned.get(endpoint, -math.inf) >= self.WARN_EVERY_S:
                    self._warned[endpoint] = now
                    log.warning("%s: bus handshake failed (%s: not the rig's keys?); %d failures so far, "
                                "connecting again every %.1f s", endpoint, zmq.Event(event["event"]).name,
                                self.handshake_failures, self.RETRY_S)
                self._retry[endpoint] = now + self.RETRY_S
        now = time.monotonic()
        for endpoint, due in list(self._retry.items()):
            if now >= due:
                del self._retry[endpoint]
                try:
                    self._sock.disconnect(endpoint)
                except zmq.ZMQError:
                    pass  # ZeroMQ already dropped it
                self._sock.connect(endpoint)

    def recv(self, timeout_s: float = 0.1) -> tuple[str, bytes, float] | None:
        """The next well-formed message, or None after ``timeout_s`` s without one.

        ``t_recv`` is the host clock (``time.time()``, s) when the message was taken off the socket.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            got = self.take()
            if got is not None:
                return got
            self._reconnect_failed()
            now = time.monotonic()
            left = deadline - now
            if left <= 0:
                return None
            left = min(left, self.retry_in(now))  # wake up for the next reconnection too
            self._poller.poll(math.ceil(left * 1000))

    def take(self) -> tuple[str, bytes, float] | None:
        """The next well-formed queued message without waiting, or None (malformed ones are counted, skipped)."""
        while True:
            try:
                frames = self._sock.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return None
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

    def retry_in(self, now: float) -> float:
        """Seconds until the next reconnection is due (inf: none pending)."""
        return max(0.0, min(self._retry.values()) - now) if self._retry else math.inf

    def close(self) -> None:
        self._sock.disable_monitor()
        self._monitor.close(0)
        self._sock.close()

    def __enter__(self) -> Subscriber:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


class EndpointStreams:
    """One :class:`Subscriber` per endpoint: each publisher's queue is read on its own.

    A single SUB socket hands its publishers' queues out in turn, one message each: a reader that
    fell behind gets ten seconds of a 100 Hz publisher's backlog (an IMU) for every second of a
    1 kHz one's (the encoder board), so its fresh IMU samples come seconds before the encoders'
    backlog.  Read per endpoint, the streams can be merged by sensor time however far behind the
    reader is (:meth:`Pipeline.feed_streams`).  ``topics``, ``hwm`` (per endpoint) and ``auth`` as
    for :class:`Subscriber`.
    """

    def __init__(self, endpoints: list[str], topics: list[str] | None = None, hwm: int = 100000,
                 auth: CurveAuth | None = None) -> None:
        self.subs: list[Subscriber] = []
        try:
            for ep in dict.fromkeys(endpoints):
                self.subs.append(Subscriber([ep], topics, hwm, auth=auth))
        except BaseException:
            self.close()
            raise
        self._poller = zmq.Poller()
        for sub in self.subs:
            self._poller.register(sub._sock, zmq.POLLIN)

    @property
    def takers(self) -> list[Callable[[], tuple[str, bytes, float] | None]]:
        """Per endpoint, the non-blocking :meth:`Subscriber.take` of its queue."""
        return [sub.take for sub in self.subs]

    def wait(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` s (less if a reconnection is due) until any endpoint has a
        message queued; True if one has."""
        now = time.monotonic()
        for sub in self.subs:
            sub._reconnect_failed()
        left = min([timeout_s, *(sub.retry_in(now) for sub in self.subs)])
        return bool(self._poller.poll(math.ceil(left * 1000)))

    def close(self) -> None:
        for sub in self.subs:
            sub.close()

    def __enter__(self) -> EndpointStreams:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

"""``rigstate foxglove``: serve the live bus to Foxglove over its WebSocket protocol.

Subscribes to the rig's endpoints (sensor sources and the estimator, as ``record`` and ``watch``
do) and publishes every valid message on a Foxglove channel of the same topic name: JSON message
encoding with the topic's JSON Schema (:func:`estimator_service.schema.json_schema`), log time =
host receive time.  Channels appear when their topic first arrives.  Invalid payloads and topics
are counted and dropped.  Open Foxglove, "Open connection", ``ws://HOST:PORT``.  The WebSocket
server is the ``foxglove-sdk`` package's (a regular dependency); it binds 127.0.0.1 unless told
otherwise.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import logging
import time

from estimator_service import bus, schema
from estimator_service.commands.record import recorder_endpoints
from estimator_service.errors import UserError
from estimator_service.paths import default_rig
from estimator_service.rig import load_rig
from estimator_service.signals import stop_on_signals

log = logging.getLogger(__name__)

NS = 1_000_000_000


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "foxglove", help="serve the live bus to Foxglove (WebSocket)",
        description="Bridge the bus to Foxglove's WebSocket protocol: one JSON channel per topic, with its "
        "JSON Schema.  Connect Foxglove to ws://HOST:PORT (docs/data-tools.md).")
    p.add_argument("--config", default=str(default_rig()), help="rig TOML: endpoints (default: the shipped testbed)")
    p.add_argument("--endpoint", action="append", metavar="ENDPOINT", help="connect here instead (repeatable)")
    p.add_argument("--topic", action="append", metavar="PREFIX", help="topic prefix to serve (repeatable; default all)")
    p.add_argument("--host", default="127.0.0.1", help="address the WebSocket server binds (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8765, help="WebSocket port (default 8765; 0 = any free port)")
    p.set_defaults(func=run)


class FoxgloveBridge:
    """Turns bus messages into Foxglove channel messages (channels made on first use)."""

    def __init__(self) -> None:
        import foxglove

        self._foxglove = foxglove
        self.channels: dict[str, object] = {}
        self.forwarded = 0
        self.invalid = 0

    def add(self, topic: str, payload: bytes, t_recv: float) -> None:
        try:
            msg = schema.decode(topic, payload)
        except schema.SchemaError:
            self.invalid += 1
            return
        channel = self.channels.get(topic)
        if channel is None:
            fg = self._foxglove
            channel = fg.Channel(topic, message_encoding="json", schema=fg.Schema(
                name=schema.schema_key(topic), encoding="jsonschema",
                data=json.dumps(schema.json_schema(topic)).encode()))
            self.channels[topic] = channel
        channel.log(json.dumps(msg).encode(), log_time=max(0, int(t_recv * NS)))
        self.forwarded += 1


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def run(args: argparse.Namespace) -> int:
    if not 0 <= args.port <= 65535:
        raise UserError(f"--port: expected 0..65535, got {args.port}")
    endpoints = args.endpoint or recorder_endpoints(load_rig(args.config))
    if not _is_loopback(args.host):
        log.warning("serving the bus to %s: every host that reaches it can read all topics", args.host)
    bridge = FoxgloveBridge()
    try:
        server = bridge._foxglove.start_server(name="rigstate", host=args.host, port=args.port)
    except Exception as exc:  # the SDK raises its own error types for bind failures
        raise UserError(f"cannot serve Foxglove on {args.host}:{args.port}: {exc}") from None
    with stop_on_signals() as stop:
        print(f"foxglove: serving ws://{args.host}:{server.port} from {', '.join(endpoints)}", flush=True)
        last_report = time.monotonic()
        try:
            with bus.Subscriber(endpoints, topics=args.topic) as sub:
                while not stop.is_set():
                    got = sub.recv(timeout_s=0.1)
                    if got is not None:
                        bridge.add(*got)
                    if time.monotonic() - last_report > 60:
                        last_report = time.monotonic()
                        log.info("forwarded %d messages on %d channels; %d invalid payloads, %d malformed dropped",
                                 bridge.forwarded, len(bridge.channels), bridge.invalid, sub.malformed)
        finally:
            server.stop()
        return 0

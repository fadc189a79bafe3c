"""``rigstate driver encoder``: publish quadrature encoders as ``enc/<name>`` on the bus.

Registered by the ``driver`` command (drivers/commands.py) through :func:`register`.
"""

from __future__ import annotations

import argparse
import logging
import threading
from dataclasses import dataclass

from drivers.encoders.channel import CountScale, EncoderChannel
from estimator_service.bus import CurveAuth, Publisher
from estimator_service.errors import UserError
from estimator_service.sdnotify import Notifier
from estimator_service.signals import stop_on_signals

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EncoderSpec:
    """What one published encoder needs: topic name, board/Phidget channel, scale, bus endpoint."""

    name: str
    channel: int
    scale: CountScale
    endpoint: str


def register(driver_sub: argparse._SubParsersAction) -> None:
    """Add the ``encoder`` subcommand to the ``driver`` subparsers."""
    p = driver_sub.add_parser(
        "encoder",
        help="quadrature encoders (serial counter board or Phidget22) -> enc/<name>",
        description="Read quadrature encoders and publish enc/<name> messages (t, seq, count, cpr, angle) "
        "on the bus.  Several encoders of one board: repeat --name and --channel in pairs.  "
        "Unplug/replug is handled (report, retry with back-off, resume).  See docs/encoders.md.",
    )
    p.add_argument("--backend", choices=["serial", "phidget"], required=True,
                   help="serial: counter board speaking counterboard v1; phidget: Phidget22 Encoder channels")
    p.add_argument("--name", action="append", required=True,
                   help="encoder name (topic enc/<name>; with --config: the rig's [[encoder]] name)")
    p.add_argument("--channel", type=int, action="append",
                   help="board / Phidget channel of each --name (default 0, 1, ... in order)")
    p.add_argument("--lines", type=int, action="append",
                   help="encoder lines per revolution (cpr = 4 lines); once or per --name (default: rig)")
    p.add_argument("--offset", type=float, action="append",
                   help="angle at count 0, rad; once or per --name (default: rig, else 0)")
    p.add_argument("--endpoint", help="ZeroMQ endpoint to bind (default: the rig's endpoint of the encoder)")
    p.add_argument("--config", help="rig TOML: lines, offset and endpoint of each named encoder, and [bus.auth]")
    s = p.add_argument_group("serial backend")
    s.add_argument("--port", help="device path or pyserial URL (socket://, rfc2217://, loop://)")
    s.add_argument("--baud", type=int, default=115200, help="baud rate (default 115200)")
    s.add_argument("--rate", type=int, help="ask the board for this line rate, Hz (R command)")
    s.add_argument("--silence", type=float, default=1.0,
                   help="seconds without a valid line that count as a disconnect (default 1)")
    s.add_argument("--backoff-max", type=float, default=5.0, help="longest reconnect back-off, s (default 5)")
    ph = p.add_argument_group("phidget backend")
    ph.add_argument("--serial", type=int, help="device serial number (default: any)")
    ph.add_argument("--hub-port", type=int, help="VINT hub port (ENC1000); omit for USB boards like the 1047")
    ph.add_argument("--data-interval-ms", type=int, default=8, help="event period, ms (default 8)")
    p.set_defaults(func=run_encoder)


def _per_name(option: str, values: list | None, n: int) -> list | None:
    """``values`` given once (applies to all) or once per --name; None if not given."""
    if values is None:
        return None
    if len(values) == 1:
        return values * n
    if len(values) != n:
        raise UserError(f"{option}: give it once or once per --name ({n}), got {len(values)} values")
    return values


def _rig_encoders(path: str) -> dict[str, tuple[int, float, str]]:
    """``name -> (lines, offset, endpoint)`` of the rig's ``[[encoder]]`` entries."""
    from estimator_service.rig import load_rig

    rig = load_rig(path)
    return {e.name: (e.lines, e.offset, e.endpoint) for e in rig.encoders}


def _rig_auth(path: str) -> CurveAuth | None:
    """The rig's ``[bus.auth]`` (None: the bus is not authenticated)."""
    from estimator_service.rig import load_rig

    return load_rig(path).bus.auth


def encoder_specs(args: argparse.Namespace) -> list[EncoderSpec]:
    """Resolve the command line (and rig) into one spec per encoder; UserError on bad values."""
    names: list[str] = args.name
    n = len(names)
    if len(set(names)) != n:
        raise UserError(f"--name: names must be unique, got {names}")
    channels = list(range(n)) if args.channel is None else args.channel
    if len(channels) != n:
        raise UserError(f"--channel: give one per --name ({n}), got {len(channels)}")
    lines = _per_name("--lines", args.lines, n)
    offsets = _per_name("--offset", args.offset, n)
    rig = _rig_encoders(args.config) if args.config else {}
    specs = []
    for i, name in enumerate(names):
        if args.config and name not in rig:
            raise UserError(f"{args.config}: encoder: no [[encoder]] named {name!r} (has {sorted(rig)})")
        r_lines, r_offset, r_endpoint = rig.get(name, (None, 0.0, None))
        n_lines = lines[i] if lines else r_lines
        if n_lines is None:
            raise UserError(f"--lines: needed for encoder {name!r} (or --config with its [[encoder]] entry)")
        if n_lines <= 0:
            raise UserError(f"--lines: must be a positive integer, got {n_lines}")
        if channels[i] < 0:
            raise UserError(f"--channel: must be >= 0, got {channels[i]}")
        endpoint = args.endpoint or r_endpoint
        if not endpoint:
            raise UserError("--endpoint: needed (or --config, whose [[encoder]] entries give the endpoints)")
        specs.append(EncoderSpec(name, channels[i], CountScale(n_lines, offsets[i] if offsets else r_offset),
                                 endpoint))
    if len({s.channel for s in specs}) != n:
        raise UserError(f"--channel: channels must be distinct, got {[s.channel for s in specs]}")
    return specs


def run_encoder(args: argparse.Namespace) -> int:
    """Run the selected backend until SIGINT/SIGTERM."""
    specs = encoder_specs(args)
    if args.backend == "serial" and not args.port:
        raise UserError("--port: needed with --backend serial (device path or pyserial URL)")
    auth = _rig_auth(args.config) if args.config else None
    publishers = {ep: Publisher(ep, auth=auth) for ep in dict.fromkeys(s.endpoint for s in specs)}
    dropped = {s.name: 0 for s in specs}

    def sink_of(spec: EncoderSpec):
        pub = publishers[spec.endpoint]

        def sink(topic: str, msg: dict) -> None:
            if not pub.publish(topic, msg):
                dropped[spec.name] += 1
                if dropped[spec.name] in (1, 10, 100) or dropped[spec.name] % 1000 == 0:
                    log.warning("%s: %d messages dropped (no subscriber keeping up)", topic, dropped[spec.name])
        return sink

    channels = {s.channel: EncoderChannel(s.name, s.scale, sink_of(s)) for s in specs}
    if args.backend == "serial":
        from drivers.encoders.serial_board import SerialBoardDriver

        driver = SerialBoardDriver(args.port, channels, baudrate=args.baud, rate_hz=args.rate,
                                   silence_s=args.silence, backoff_max_s=args.backoff_max)
    else:
        from drivers.encoders.phidget import PhidgetEncoderDriver

        driver = PhidgetEncoderDriver(channels, serial_number=args.serial, hub_port=args.hub_port,
                                      data_interval_ms=args.data_interval_ms)
    with stop_on_signals() as stop:
        for s in specs:
            log.info("enc/%s: channel %d, cpr %d, offset %g rad -> %s", s.name, s.channel, s.scale.cpr,
                     s.scale.offset, s.endpoint)
        notifier = Notifier()
        notifier.ready()
        notifier.status("publishing " + ", ".join(f"enc/{s.name}" for s in specs))
        threading.Thread(target=notifier.keep_alive, args=(stop,), daemon=True).start()
        try:
            driver.run(stop)
        finally:
            stop.set()
            notifier.stopping()
            for pub in publishers.values():
                pub.close()
        log.info("stopped; published %s", ", ".join(f"{c.topic}: {c.seq}" for c in channels.values()))
        return 0

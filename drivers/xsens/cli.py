"""``rigstate driver xsens`` (publish an MTi as ``imu/<name>``) and ``rigstate xbus decode``."""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import serial

from drivers.xsens.device import XsensDriver
from drivers.xsens.mtdata2 import as_json, decode_mtdata2
from drivers.xsens.xbus import MID, XbusParser
from estimator_service.errors import UserError
from estimator_service.sdnotify import Notifier

log = logging.getLogger(__name__)

MAX_RATE_HZ = 400  #: highest output rate of the MTi 1-, 10-, 100-series for these outputs
FRAME_BYTES = 73  #: bytes of one configured MTData2 frame (6 outputs, Float32), header and checksum included


def register_driver(driver_sub: argparse._SubParsersAction) -> None:
    p = driver_sub.add_parser(
        "xsens", help="Xsens MTi over Xbus: configure it and publish imu/<name>",
        description="Configures an Xsens MTi (GoToConfig, output configuration, GoToMeasurement) and "
        "publishes every MTData2 sample as imu/<name>. Survives unplug/replug (reconnects, reconfigures).",
    )
    p.add_argument("--port", required=True, help="device path (/dev/ttyUSB0, /dev/xsens-coupler) or pyserial URL")
    p.add_argument("--name", required=True, help="sensor name: publishes imu/<name>")
    p.add_argument("--rate", type=int, default=100, help="output rate, Hz (100 or 400; 400 Hz needs 921600 baud)")
    p.add_argument("--baud", type=int, default=115200, help="serial baud rate of the device (default 115200)")
    p.add_argument("--set-baud", type=int, help="switch the device to this baud rate (e.g. 921600 for 400 Hz), then reopen")
    p.add_argument("--endpoint", help="publish here (default: the rig's [[imu]] endpoint with --config)")
    p.add_argument("--config", help="rig TOML: the endpoint of the [[imu]] named --name, and [bus.auth]")
    p.set_defaults(func=run_driver)


def register_xbus(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("xbus", help="Xbus tools", description="Xsens Xbus protocol tools.")
    xsub = p.add_subparsers(dest="xbus_command", metavar="SUBCOMMAND")
    xsub.required = True
    d = xsub.add_parser("decode", help="decode a raw Xbus byte capture (or a serial port) frame by frame",
                        description="Prints one JSON object per MTData2 frame keyed by Xsens field names, then "
                        "the parser's error counts.")
    d.add_argument("source", help="capture file, or a serial device / pyserial URL")
    d.add_argument("--jsonl", action="store_true", help="one compact JSON object per line")
    d.add_argument("--duration", type=float, default=10.0, help="seconds to read from a serial source")
    d.set_defaults(func=run_decode)


def _read_source(source: str, duration: float) -> Iterator[bytes]:
    """Chunks of bytes from a regular file, or else from a serial port / pyserial URL for
    ``duration`` seconds (a device path is a port, not a file: reading it would never end)."""
    if Path(source).is_file():
        with open(source, "rb") as f:
            while chunk := f.read(65536):
                yield chunk
        return
    try:
        ser = serial.serial_for_url(source, timeout=0.1)
    except (ValueError, serial.SerialException) as exc:
        raise UserError(f"{source}: neither a readable file nor a serial port: {exc}") from None
    end = time.monotonic() + duration
    with ser:
        while time.monotonic() < end:
            yield ser.read(ser.in_waiting or 1)


def run_decode(args: argparse.Namespace) -> int:
    parser = XbusParser()
    frames = 0
    for chunk in _read_source(args.source, args.duration):
        for msg in parser.feed(chunk):
            if msg.mid != MID.MTDATA2:
                continue
            fields, _ = decode_mtdata2(msg.payload)
            obj = as_json(fields)
            print(json.dumps(obj) if args.jsonl else json.dumps(obj, indent=1))
            frames += 1
    summary = {"errors": parser.errors.as_dict(), "frames": frames}
    print(json.dumps(summary) if args.jsonl else json.dumps(summary, indent=1))
    return 0


def run_driver(args: argparse.Namespace) -> int:
    from estimator_service.bus import Publisher

    endpoint, auth = args.endpoint, None
    if args.config:
        from estimator_service.rig import load_rig

        rig = load_rig(args.config)
        auth = rig.bus.auth
        imu = next((i for i in rig.imus if i.name == args.name), None)
        if imu is None and endpoint is None:
            raise UserError(f"{args.config}: no [[imu]] named {args.name!r}")
        endpoint = endpoint or imu.endpoint
    if endpoint is None:
        raise UserError("--endpoint: needed (or --config with an [[imu]] of this --name)")
    if not 1 <= args.rate <= MAX_RATE_HZ:
        raise UserError(f"--rate {args.rate}: an MTi outputs 1 to {MAX_RATE_HZ} Hz")
    baud = args.set_baud or args.baud
    if args.rate * FRAME_BYTES * 10 > baud:  # 10 bits per byte on the wire
        log.warning("%s: %d Hz needs about %d baud, more than %d: samples will be lost (see --set-baud)",
                    args.port, args.rate, args.rate * FRAME_BYTES * 10, baud)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    notifier = Notifier()
    with Publisher(endpoint, auth=auth) as pub:
        try:
            driver = XsensDriver(args.port, args.name, lambda topic, msg: pub.publish(topic, msg), rate_hz=args.rate,
                                 baudrate=args.baud, set_baud=args.set_baud)
        except ValueError as exc:
            raise UserError(f"--set-baud: {exc}") from None
        notifier.ready()
        status = lambda: f"{driver.published} samples, {driver.lost} lost, {driver.stats.connects} connects"  # noqa: E731
        threading.Thread(target=notifier.keep_alive, args=(stop, status), daemon=True).start()
        driver.run(stop)
        notifier.stopping()
    print(f"{args.port}: published {driver.published} samples, lost {driver.lost}, parser errors "
          f"{driver.parser.errors.as_dict()}, reconnects {max(0, driver.stats.connects - 1)}", file=sys.stderr)
    return 0


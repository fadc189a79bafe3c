"""``rigstate driver xsens`` (publish an MTi as ``imu/<name>``), ``rigstate xsens scan`` and
``rigstate xbus decode``.

Two backends publish identical messages: ``xbus`` (the Xsens low-level protocol over pyserial,
:mod:`drivers.xsens.device`) and ``xda`` (the vendor's ``xsensdeviceapi``, :mod:`drivers.xsens.xda`,
imported only when chosen); ``auto`` takes ``xda`` when that module imports, else ``xbus``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import serial

from drivers.xsens.device import DeviceError, Stopped, XsensDriver
from drivers.xsens.mtdata2 import as_json, decode_mtdata2
from drivers.xsens.xbus import MID, XbusParser
from drivers.xsens.xda import MODULE, XdaDriver, device_path, import_xda, load_xda
from estimator_service.errors import UserError
from estimator_service.sdnotify import Notifier
from estimator_service.signals import stop_on_signals

log = logging.getLogger(__name__)

MAX_RATE_HZ = 400  #: highest output rate of the MTi 1-, 10-, 100-series for these outputs
FRAME_BYTES = 73  #: bytes of one configured MTData2 frame (6 outputs, Float32), header and checksum included
BACKENDS = ("auto", "xbus", "xda")
JITTER_LOG_S = 60.0  #: period of the driver's arrival-jitter log line, s
SCAN_BAUDS = (115200, 921600, 460800)  #: baud rates ``xsens scan`` tries on each port (Xbus probing)
LISTEN_S = 0.15  #: ``xsens scan`` listens this long (s) for a measuring device before asking


def register_driver(driver_sub: argparse._SubParsersAction) -> None:
    p = driver_sub.add_parser(
        "xsens", help="Xsens MTi (Xbus or the vendor's xsensdeviceapi): configure it and publish imu/<name>",
        description="Configures an Xsens MTi (GoToConfig, output configuration, GoToMeasurement) and "
        "publishes every sample as imu/<name>. Survives unplug/replug (reconnects, reconfigures). See docs/xsens.md.",
    )
    p.add_argument("--backend", choices=BACKENDS, default="auto",
                   help="xbus: Xsens low-level protocol over pyserial; xda: the vendor's xsensdeviceapi (MT Software "
                   "Suite wheel); auto (default): xda when xsensdeviceapi imports, else xbus")
    p.add_argument("--port", required=True, help="device path (/dev/ttyUSB0, /dev/xsens-coupler); with xbus also a pyserial URL")
    p.add_argument("--name", required=True, help="sensor name: publishes imu/<name>")
    p.add_argument("--rate", type=int, default=100, help="output rate, Hz (100 or 400; 400 Hz needs 921600 baud)")
    p.add_argument("--baud", type=int, default=115200, help="xbus: serial baud rate of the device (default 115200)")
    p.add_argument("--set-baud", type=int, help="xbus: switch the device to this baud rate (e.g. 921600 for 400 Hz), then reopen")
    p.add_argument("--endpoint", help="publish here (default: the rig's [[imu]] endpoint with --config)")
    p.add_argument("--config", help="rig TOML: the endpoint of the [[imu]] named --name, and [bus.auth]")
    p.set_defaults(func=run_driver)


def register_xsens(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("xsens", help="Xsens MTi tools", description="Xsens MTi tools (docs/xsens.md).")
    xsub = p.add_subparsers(dest="xsens_command", metavar="SUBCOMMAND")
    xsub.required = True
    s = xsub.add_parser("scan", help="list connected MTi devices (port, device id, product code, firmware)",
                        description="Lists the connected MTi devices: through the vendor's xsensdeviceapi when it "
                        "imports (XsScanner), else by probing serial ports with Xbus (GoToConfig, ReqDID, "
                        "ReqProductCode, ReqFWRev; a device found measuring is put back into measurement).")
    s.add_argument("--backend", choices=BACKENDS, default="auto", help="as for driver xsens (default auto)")
    s.add_argument("--port", action="append", default=[],
                   help="also probe this port (repeatable): udev symlinks, pseudo-terminals, ports not enumerated")
    s.add_argument("--baud", type=int, action="append",
                   help=f"xbus: baud rates to try on each port (repeatable; default {', '.join(map(str, SCAN_BAUDS))})")
    s.add_argument("--timeout", type=float, default=0.3, help="xbus: seconds to wait for each answer (default 0.3)")
    s.set_defaults(func=run_scan)


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


def choose_backend(backend: str) -> tuple[str, ModuleType | None]:
    """(backend, vendor module or None) for ``--backend``; ``auto`` logs which one and why."""
    if backend == "xbus":
        return "xbus", None
    if backend == "xda":
        return "xda", import_xda()
    module, where = load_xda()
    if module is None:
        log.info("backend auto: using xbus (Xsens low-level protocol over pyserial): %s cannot be imported (%s)",
                 MODULE, where)
        return "xbus", None
    log.info("backend auto: using xda: %s imports (%s)", MODULE, where)
    return "xda", module


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
    backend, xda = choose_backend(args.backend)
    if backend == "xda" and args.set_baud:
        raise UserError("--set-baud: only with --backend xbus (the vendor API picks the baud rate itself)")
    baud = args.set_baud or args.baud
    if backend == "xbus" and args.rate * FRAME_BYTES * 10 > baud:  # 10 bits per byte on the wire
        log.warning("%s: %d Hz needs about %d baud, more than %d: samples will be lost (see --set-baud)",
                    args.port, args.rate, args.rate * FRAME_BYTES * 10, baud)
    with stop_on_signals() as stop:
        notifier = Notifier()
        with Publisher(endpoint, auth=auth) as pub:
            sink = lambda topic, msg: pub.publish(topic, msg)  # noqa: E731
            driver: XsensDriver | XdaDriver
            if xda is not None:
                driver = XdaDriver(args.port, args.name, sink, xda, rate_hz=args.rate)
            else:
                try:
                    driver = XsensDriver(args.port, args.name, sink, rate_hz=args.rate, baudrate=args.baud,
                                         set_baud=args.set_baud)
                except ValueError as exc:
                    raise UserError(f"--set-baud: {exc}") from None
            notifier.ready()
            status = lambda: f"{backend}: {driver.stream.status()}, {driver.stats.connects} connects"  # noqa: E731
            threading.Thread(target=notifier.keep_alive, args=(stop, status), daemon=True).start()
            threading.Thread(target=_log_jitter, args=(driver, stop), daemon=True).start()
            driver.run(stop)
            notifier.stopping()
        errors = f", parser errors {driver.parser.errors.as_dict()}" if isinstance(driver, XsensDriver) else ""
        print(f"{args.port} ({backend}): published {driver.published} samples, lost {driver.lost}{errors}, reconnects "
              f"{max(0, driver.stats.connects - 1)}, {driver.stream.jitter.summary()}", file=sys.stderr)
        return 0


def _log_jitter(driver: XsensDriver | XdaDriver, stop: threading.Event) -> None:
    """Log the arrival jitter every :data:`JITTER_LOG_S` while samples flow (thread target)."""
    while not stop.wait(JITTER_LOG_S):
        if driver.published:
            log.info("%s: %s", driver.stream.topic, driver.stream.status())


@dataclass
class Found:
    """One device ``xsens scan`` found."""

    port: str
    device_id: int
    product_code: str
    firmware: str


def probe_xbus(port: str, bauds: Sequence[int], timeout_s: float) -> Found | None:
    """The MTi answering on ``port`` at one of ``bauds`` (GoToConfig, ReqDID, ReqProductCode, ReqFWRev),
    None if none does.  A device that was measuring is put back into measurement."""
    for baud in bauds:
        drv = XsensDriver(port, "scan", lambda topic, msg: None, baudrate=baud, timeout_s=timeout_s)
        try:
            with serial.serial_for_url(port, baudrate=baud, timeout=LISTEN_S) as ser:
                measuring = bool(ser.read(4096))  # an MTi in measurement streams MTData2 unasked
                ser.timeout = 0.02
                drv._request(ser, MID.GOTO_CONFIG, b"", MID.GOTO_CONFIG_ACK, attempts=1)  # anyone there?
                info = drv.identify(ser)
                if measuring:
                    drv._request(ser, MID.GOTO_MEASUREMENT, b"", MID.GOTO_MEASUREMENT_ACK)
        except (DeviceError, Stopped):
            continue
        except (serial.SerialException, OSError, ValueError) as exc:
            log.debug("%s: cannot open (%s)", port, exc)
            return None
        return Found(port, info.device_id, info.product_code, info.firmware)
    return None


def scan_xbus(ports: Sequence[str], bauds: Sequence[int], timeout_s: float) -> list[Found]:
    """Probe the machine's serial ports and ``ports`` with Xbus (each device once, under the name
    given in ``ports`` when that is a symlink to it)."""
    from serial.tools import list_ports

    candidates = {device_path(p.device): p.device for p in list_ports.comports()}
    candidates.update({device_path(p): p for p in ports})
    return [f for f in (probe_xbus(p, bauds, timeout_s) for p in candidates.values()) if f is not None]


def scan_xda(xda: ModuleType, ports: Sequence[str]) -> list[Found]:
    """``XsScanner_scanPorts`` plus ``XsScanner_scanPort`` for each of ``ports``; each device is
    opened for its product code and firmware, then closed."""
    infos = list(xda.XsScanner_scanPorts())
    known = {i.portName() for i in infos}
    for port in ports:
        path = device_path(port)
        if path not in known:
            info = xda.XsScanner_scanPort(path, xda.XBR_Invalid)
            if not info.empty():
                infos.append(info)
    control = xda.XsControl_construct()
    found = []
    try:
        for info in infos:
            name = next((p for p in ports if device_path(p) == info.portName()), info.portName())
            if not control.openPort(info.portName(), info.baudrate()):
                log.warning("%s: found but cannot be opened", name)
                continue
            dev = control.device(info.deviceId())
            found.append(Found(name, int(info.deviceId().toInt()), str(dev.productCode()).strip(),
                               str(dev.firmwareVersion().toXsString())))
            control.closePort(info.portName())
    finally:
        control.close()
        control.destruct()
    return found


def run_scan(args: argparse.Namespace) -> int:
    backend, xda = choose_backend(args.backend)
    if xda is not None:
        found = scan_xda(xda, args.port)
    else:
        found = scan_xbus(args.port, args.baud or SCAN_BAUDS, args.timeout)
    print(f"{'port':<24} {'device id':<10} {'product code':<20} firmware")
    for f in found:
        print(f"{f.port:<24} {f.device_id:08X}   {f.product_code:<20} {f.firmware}")
    print(f"{len(found)} device(s) found ({backend})", file=sys.stderr)
    return 0

"""Open a serial port (device path or any pyserial URL) and keep it open: unplug/replug handling.

``keep_connected`` opens the port, hands it to ``serve`` until that returns (port lost, device
silent, or stop), closes it and reopens with capped exponential back-off, until ``stop`` is set;
``keep_serving`` is the same loop for any kind of connection (the Xsens vendor API's).
``low_latency`` asks the OS to pass received bytes on at once (USB adapters' latency timer).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import serial

from estimator_service.errors import UserError

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass
class LinkStats:
    """Connection events since start."""

    connects: int = 0  #: successful opens
    open_failures: int = 0  #: failed open attempts
    vanished: int = 0  #: read errors / port disappeared
    silent: int = 0  #: no valid data for the driver's silence limit
    board_resets: int = 0  #: device restarts detected by the driver


def keep_serving(what: str, connect: Callable[[], T], serve: Callable[[T, threading.Event], bool],
                 close: Callable[[T], None], stop: threading.Event, stats: LinkStats, backoff_s: float = 0.1,
                 backoff_max_s: float = 5.0) -> None:
    """Connect, serve, close and connect again with capped exponential back-off until ``stop``.

    ``connect`` returns a connection or raises OSError (transient: retried after back-off);
    ``serve(connection, stop)`` returns True when the connection delivered data (the back-off then
    starts again from ``backoff_s``); ``what`` names the device in log messages.
    """
    backoff = backoff_s
    down_since: float | None = None
    while not stop.is_set():
        try:
            conn = connect()
        except OSError as exc:  # serial.SerialException is an OSError
            stats.open_failures += 1
            log.warning("%s: cannot open (%s); retrying in %.1f s", what, exc, backoff)
            down_since = down_since or time.monotonic()
            stop.wait(backoff)
            backoff = min(2 * backoff, backoff_max_s)
            continue
        stats.connects += 1
        if down_since is not None:
            log.warning("%s: reopened after %.1f s", what, time.monotonic() - down_since)
        try:
            if serve(conn, stop):
                backoff = backoff_s
        finally:
            close(conn)
        if not stop.is_set():
            down_since = time.monotonic()
            stop.wait(backoff)
            backoff = min(2 * backoff, backoff_max_s)


def keep_connected(port: str, baudrate: int | Callable[[], int], serve: Callable[[serial.SerialBase, threading.Event], bool],
                   stop: threading.Event, stats: LinkStats, backoff_s: float = 0.1, backoff_max_s: float = 5.0,
                   read_timeout_s: float = 0.05) -> None:
    """Serve serial ``port`` until ``stop``; ``serve`` returns True when the connection delivered data.

    ``baudrate`` may be a callable, read at every (re)open (a driver that changed the device's rate).
    """

    def connect() -> serial.SerialBase:
        rate = baudrate() if callable(baudrate) else baudrate
        try:
            return serial.serial_for_url(port, baudrate=rate, timeout=read_timeout_s)
        except ValueError as exc:  # not transient: unknown URL scheme, bad baud rate
            raise UserError(f"{port}: cannot use this port: {exc}") from exc

    keep_serving(port, connect, serve, lambda ser: ser.close(), stop, stats, backoff_s, backoff_max_s)


def low_latency(ser: serial.SerialBase, sysfs: Path = Path("/sys")) -> list[str]:
    """Ask the OS to deliver received bytes at once; one line per step saying what happened.

    USB serial adapters collect bytes before passing them on: an FTDI chip waits up to its
    latency timer (16 ms by default) unless the buffer fills, so a 400 Hz stream arrives in clumps.
    Two Linux mechanisms, each tried, neither fatal: the ``ASYNC_LOW_LATENCY`` flag
    (``TIOCSSERIAL``; the ftdi_sio driver then sets its latency timer to 1 ms), and writing 1 (ms)
    to ``<sysfs>/bus/usb-serial/devices/<tty>/latency_timer`` where that file exists and is
    writable.  A pseudo-terminal, a network URL or another OS has neither: the lines say so.
    """
    done: list[str] = []
    setter = getattr(ser, "set_low_latency_mode", None)  # pyserial's posix Serial only
    if setter is None:
        done.append(f"ASYNC_LOW_LATENCY: not available for {ser.port} (not a local serial device)")
    else:
        try:
            setter(True)
            done.append("ASYNC_LOW_LATENCY: set")
        except (ValueError, OSError) as exc:
            done.append(f"ASYNC_LOW_LATENCY: not set ({exc})")
    device = Path(os.path.realpath(ser.port)) if ser.port and not _is_url(ser.port) else None
    timer = sysfs / "bus" / "usb-serial" / "devices" / device.name / "latency_timer" if device else None
    if timer is None or not timer.exists():
        done.append("latency_timer: none (not a USB serial adapter with a latency timer)")
    else:
        try:
            before = timer.read_text().strip()
            if before != "1":
                timer.write_text("1")
            done.append(f"latency_timer: {before} ms -> 1 ms ({timer})")
        except OSError as exc:
            done.append(f"latency_timer: cannot write {timer} ({exc}); see docs/xsens.md for the udev rule")
    return done


def _is_url(port: str) -> bool:
    return "://" in port

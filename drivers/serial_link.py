"""Open a serial port (device path or any pyserial URL) and keep it open: unplug/replug handling.

``keep_connected`` opens the port, hands it to ``serve`` until that returns (port lost, device
silent, or stop), closes it and reopens with capped exponential back-off, until ``stop`` is set.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import serial

from estimator_service.errors import UserError

log = logging.getLogger(__name__)


@dataclass
class LinkStats:
    """Connection events since start."""

    connects: int = 0  #: successful opens
    open_failures: int = 0  #: failed open attempts
    vanished: int = 0  #: read errors / port disappeared
    silent: int = 0  #: no valid data for the driver's silence limit
    board_resets: int = 0  #: device restarts detected by the driver


def keep_connected(port: str, baudrate: int | Callable[[], int], serve: Callable[[serial.SerialBase, threading.Event], bool],
                   stop: threading.Event, stats: LinkStats, backoff_s: float = 0.1, backoff_max_s: float = 5.0,
                   read_timeout_s: float = 0.05) -> None:
    """Serve ``port`` until ``stop``; ``serve`` returns True when the connection delivered data.

    ``baudrate`` may be a callable, read at every (re)open (a driver that changed the device's rate).
    """
    backoff = backoff_s
    down_since: float | None = None
    while not stop.is_set():
        try:
            rate = baudrate() if callable(baudrate) else baudrate
            ser = serial.serial_for_url(port, baudrate=rate, timeout=read_timeout_s)
        except ValueError as exc:  # not transient: unknown URL scheme, bad baud rate
            raise UserError(f"{port}: cannot use this port: {exc}") from exc
        except (serial.SerialException, OSError) as exc:
            stats.open_failures += 1
            log.warning("%s: cannot open (%s); retrying in %.1f s", port, exc, backoff)
            down_since = down_since or time.monotonic()
            stop.wait(backoff)
            backoff = min(2 * backoff, backoff_max_s)
            continue
        stats.connects += 1
        if down_since is not None:
            log.warning("%s: reopened after %.1f s", port, time.monotonic() - down_since)
        try:
            if serve(ser, stop):
                backoff = backoff_s
        finally:
            ser.close()
        if not stop.is_set():
            down_since = time.monotonic()
            stop.wait(backoff)
            backoff = min(2 * backoff, backoff_max_s)

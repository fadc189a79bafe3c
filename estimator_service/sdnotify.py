"""Minimal sd_notify client for systemd ``Type=notify`` services (no dependency).

State lines (``READY=1``, ``STATUS=...``, ``WATCHDOG=1``, ``STOPPING=1``) go as one AF_UNIX
datagram to ``$NOTIFY_SOCKET``: a filesystem path, or an abstract socket written ``@name``.
Without ``$NOTIFY_SOCKET`` (not started by systemd) every call is a no-op returning False, so
the same code runs as a plain foreground process.  Sending never raises and never blocks (a
datagram the receiver has no room for is dropped: the main loop must not hang on its watchdog).

Watchdog: with ``WatchdogSec=`` systemd sets ``$WATCHDOG_USEC`` (and ``$WATCHDOG_PID``, the
process meant to ping).  Ping at half the interval: :meth:`Notifier.maybe_watchdog` does that.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable
import threading
import time

log = logging.getLogger(__name__)


class Notifier:
    """Talks to systemd's notification socket; ``env`` defaults to ``os.environ``."""

    def __init__(self, env: dict[str, str] | None = None) -> None:
        env = dict(os.environ) if env is None else env
        address = env.get("NOTIFY_SOCKET") or None
        if address is not None and not address.startswith(("/", "@")):
            log.warning("NOTIFY_SOCKET=%r is not a unix socket path or @abstract name: not notifying", address)
            address = None
        self.address = address
        self._watchdog_s: float | None = None
        usec, pid = env.get("WATCHDOG_USEC", ""), env.get("WATCHDOG_PID", "")
        if usec.isdigit() and int(usec) > 0 and (not pid or pid == str(os.getpid())):
            self._watchdog_s = int(usec) / 1e6
        self._last_ping: float | None = None
        self._sock: socket.socket | None = None

    @property
    def enabled(self) -> bool:
        """True when running under systemd with a notification socket."""
        return self.address is not None

    def notify(self, state: str) -> bool:
        """Send one datagram of newline-separated ``KEY=value`` lines; False if not sent."""
        if self.address is None:
            return False
        addr = "\0" + self.address[1:] if self.address.startswith("@") else self.address
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
                # never block the caller: a reader that does not read (queue of 10 datagrams) costs a ping
                self._sock.setblocking(False)
            self._sock.sendto(state.encode(), addr)
        except OSError as exc:
            log.debug("sd_notify %r to %s failed: %s", state, self.address, exc)
            return False
        return True

    def ready(self) -> bool:
        """``READY=1``: start-up finished (sockets bound/connected, configuration loaded)."""
        return self.notify("READY=1")

    def status(self, text: str) -> bool:
        """``STATUS=<text>``: one line shown by ``systemctl status``."""
        return self.notify("STATUS=" + " ".join(text.splitlines()))

    def watchdog(self, now: float | None = None) -> bool:
        """``WATCHDOG=1``: the main loop is alive (``now``: monotonic s, for :meth:`maybe_watchdog`)."""
        self._last_ping = time.monotonic() if now is None else now
        return self.notify("WATCHDOG=1")

    def stopping(self) -> bool:
        """``STOPPING=1``: shutdown has begun."""
        return self.notify("STOPPING=1")

    def watchdog_interval_s(self) -> float | None:
        """The watchdog period systemd expects pings within (s), or None without a watchdog."""
        return self._watchdog_s

    def maybe_watchdog(self, now: float | None = None) -> bool:
        """Ping if half the watchdog interval passed since the last ping (``now``: monotonic s)."""
        if self._watchdog_s is None:
            return False
        now = time.monotonic() if now is None else now
        if self._last_ping is not None and now - self._last_ping < self._watchdog_s / 2:
            return False
        return self.watchdog(now)

    def keep_alive(self, stop: threading.Event, status: Callable[[], str] | None = None) -> None:
        """Ping the watchdog (and refresh STATUS) every half interval until ``stop``; for drivers
        whose read loop blocks in the serial library and handles reconnection itself (thread target)."""
        interval = self.watchdog_interval_s()
        while interval and not stop.wait(interval / 2):
            self.watchdog()
            if status is not None:
                self.status(status())

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def notify(state: str) -> bool:
    """One-shot ``sd_notify(state)`` using the process environment; False when not under systemd."""
    n = Notifier()
    try:
        return n.notify(state)
    finally:
        n.close()

"""Minimal sd_notify client (systemd ``Type=notify``): READY, STATUS, WATCHDOG, STOPPING.

Without ``$NOTIFY_SOCKET`` every call is a no-op, so the same code runs as a plain foreground
process.  ``$NOTIFY_SOCKET`` may be a path or an abstract socket (``@name``).
"""

from __future__ import annotations

import os
import socket


class Notifier:
    """Sends state lines to systemd's notification socket."""

    def __init__(self, env: dict[str, str] | None = None) -> None:
        env = dict(os.environ) if env is None else env
        self.address = env.get("NOTIFY_SOCKET") or None
        usec = env.get("WATCHDOG_USEC")
        pid = env.get("WATCHDOG_PID")
        self._watchdog_s = None
        if usec and usec.isdigit() and (not pid or pid == str(os.getpid())):
            self._watchdog_s = int(usec) / 1e6
        self._sock: socket.socket | None = None

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def notify(self, state: str) -> bool:
        """Send one notification (e.g. ``"READY=1"``); False when not under systemd or on error."""
        if self.address is None:
            return False
        addr = "\0" + self.address[1:] if self.address.startswith("@") else self.address
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            self._sock.sendto(state.encode(), addr)
        except OSError:
            return False
        return True

    def ready(self) -> bool:
        return self.notify("READY=1")

    def status(self, text: str) -> bool:
        return self.notify("STATUS=" + text.replace("\n", " "))

    def watchdog(self) -> bool:
        return self.notify("WATCHDOG=1")

    def stopping(self) -> bool:
        return self.notify("STOPPING=1")

    def watchdog_interval_s(self) -> float | None:
        """The watchdog period systemd expects pings within (s), or None; ping at half of it."""
        return self._watchdog_s

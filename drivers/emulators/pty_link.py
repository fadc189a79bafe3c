"""A device's end of a pseudo-terminal behind a stable symlink: what a USB serial device looks like.

``plug()`` opens a new pty pair and points ``link`` at its slave (like a udev by-id name);
``unplug()`` removes the link and closes the pty, so a driver's open port fails like a pulled cable.
"""

from __future__ import annotations

import os
import threading
import time
import tty
from pathlib import Path


class PtyLink:
    """Non-blocking master side of a pty whose slave is reachable at ``link``."""

    def __init__(self, link: str | os.PathLike) -> None:
        self.link = Path(link)
        self.master: int | None = None
        self._slave: int | None = None

    @property
    def plugged(self) -> bool:
        return self.master is not None

    def plug(self) -> None:
        """New pty behind the symlink (raw mode, non-blocking master)."""
        self.master, self._slave = os.openpty()
        tty.setraw(self._slave)
        os.set_blocking(self.master, False)
        tmp = self.link.with_name(self.link.name + ".tmp")
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(os.ttyname(self._slave))
        os.replace(tmp, self.link)

    def unplug(self) -> None:
        """Remove the symlink and close both sides."""
        self.link.unlink(missing_ok=True)
        for fd in (self.master, self._slave):
            if fd is not None:
                os.close(fd)
        self.master = self._slave = None

    def write(self, data: bytes) -> int:
        """Write what the pty takes now (never blocks); bytes written (0 when unplugged or full)."""
        if self.master is None:
            return 0
        try:
            return os.write(self.master, data)
        except (BlockingIOError, OSError):
            return 0

    def read(self, n: int = 256) -> bytes:
        """Bytes the host wrote, without blocking (b"" if none or unplugged)."""
        if self.master is None:
            return b""
        try:
            return os.read(self.master, n)
        except (BlockingIOError, OSError):
            return b""


class FaultInjection:
    """Faults a device emulator injects on request, thread-safe: pending garbage, bad checksums and
    truncations (applied to the next samples by the emulator), and stalls.  Subclasses set
    ``_lock``, ``_pending`` (keys garbage, checksum, truncated), ``injected`` and ``_stall_until``."""

    _lock: threading.Lock
    _pending: dict[str, int]
    injected: dict[str, int]
    _stall_until: float

    def garbage(self, n: int = 1) -> None:
        """Write ``n`` bursts of random garbage before the next sample."""
        with self._lock:
            self._pending["garbage"] += n

    def bad_checksum(self, n: int = 1) -> None:
        """Corrupt the checksum of the next ``n`` samples (those samples are lost)."""
        with self._lock:
            self._pending["checksum"] += n

    def truncate(self, n: int = 1) -> None:
        """Cut the next ``n`` samples short (those samples are lost)."""
        with self._lock:
            self._pending["truncated"] += n

    def stall(self, seconds: float) -> None:
        """Write nothing for ``seconds`` (the samples of that time are never sent)."""
        with self._lock:
            self._stall_until = time.monotonic() + seconds
            self.injected["stalls"] += 1


class EmulatedDevice(FaultInjection):
    """A device emulator's life cycle: ``start`` plugs its pty in and runs ``_run`` in a thread
    until ``stop``, which also unplugs it.  Subclasses set ``_pty``, ``_lock``, ``_stop``, ``_thread``
    and implement ``_power_on`` (clocks, greeting) and ``_run`` (the device loop)."""

    _pty: PtyLink
    _stop: threading.Event
    _thread: threading.Thread | None
    _t0: float

    @property
    def t0(self) -> float:
        """Monotonic time (s) of source time 0: a sample ticked at monotonic ``t_tick`` is computed
        from the source at ``t_tick - t0`` (the device clock restarts with it at power-on)."""
        return self._t0

    def _power_on(self) -> None:
        raise NotImplementedError

    def _run(self) -> None:
        raise NotImplementedError

    def start(self):  # noqa: ANN201 (returns the subclass)
        """Plug in, power on and start the device loop in a background thread."""
        self._pty.plug()
        self._power_on()
        self._thread = threading.Thread(target=self._run, name=type(self).__name__, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the device loop and unplug."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        with self._lock:
            self._pty.unplug()

    def __enter__(self):  # noqa: ANN204
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

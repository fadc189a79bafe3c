"""The one rule for stopping a long-running command: SIGTERM (systemd, ``kill``) and SIGINT (Ctrl-C) set a stop
event the command's loop watches, and the handlers that were installed before come back when it ends (a
command run in-process, e.g. by a test or by ``rigstate demo``, leaves its caller's handlers as it found them).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

#: the signals that ask a command to stop
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


@contextlib.contextmanager
def stop_on_signals(stop: threading.Event | None = None) -> Iterator[threading.Event]:
    """While the block runs, SIGTERM and SIGINT set ``stop`` (a new event if None), which the block gets; the
    previous handlers are restored when it ends.  Call from the main thread (Python's rule for handlers)."""
    event = threading.Event() if stop is None else stop
    previous = {sig: signal.signal(sig, lambda *_: event.set()) for sig in STOP_SIGNALS}
    try:
        yield event
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

"""The one SIGTERM/SIGINT -> stop-event rule (estimator_service/signals.py) every long-running command uses."""

from __future__ import annotations

import os
import signal

import pytest

from estimator_service.signals import STOP_SIGNALS, stop_on_signals


@pytest.mark.parametrize("sig", STOP_SIGNALS)
def test_a_stop_signal_sets_the_event_and_the_previous_handlers_come_back(sig: signal.Signals) -> None:
    seen: list[int] = []
    before = {s: signal.signal(s, lambda signum, _frame: seen.append(signum)) for s in STOP_SIGNALS}
    try:
        mine = {s: signal.getsignal(s) for s in STOP_SIGNALS}
        with stop_on_signals() as stop:
            assert not stop.is_set()
            os.kill(os.getpid(), sig)  # delivered to the main thread before kill returns to Python code
            assert stop.wait(10)
        assert {s: signal.getsignal(s) for s in STOP_SIGNALS} == mine  # restored
        assert seen == []  # the command's handler had it, not the previous one
        os.kill(os.getpid(), sig)
        assert seen == [sig]
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)

"""Where the test suite's time goes: a pytest plugin that writes each test's CPU time (docs/performance.md).

    PYTHONPATH=tools pytest -p pytest_cpu [pytest's usual arguments]

After the run, ``test-cpu.tsv`` in the current directory (or ``$RIGSTATE_TEST_CPU``) holds a line per test: CPU
seconds of the test process (set-up, call and tear-down), CPU seconds of the processes it started and waited for
(an estimator daemon, a driver, a CLI command), wall seconds and the test's id; then a line ``SESSION <worker>`` per
pytest process with the same for its whole session (the kernels compiled at session start included).  Under xdist
every worker appends to the one file.  The suite is CPU-bound on 2 cores: the sum of the first two columns over
the number of cores is about its wall time, so the CPU columns (not the wall one, which the other worker's load
inflates) say which tests to make cheaper.

    sort -t$'\\t' -k1,1 -gr test-cpu.tsv | head    # the costliest tests, by their own CPU
"""

from __future__ import annotations

import os
import resource
import time
from pathlib import Path

import pytest

#: (own CPU, children's CPU, monotonic time) at the session's start
_START = pytest.StashKey[tuple[float, float, float]]()


def _cpu() -> tuple[float, float]:
    """(this process's, its waited-for children's) user + system CPU seconds."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, kids.ru_utime + kids.ru_stime


def _write(own: float, kids: float, wall: float, what: str) -> None:
    path = Path(os.environ.get("RIGSTATE_TEST_CPU", "test-cpu.tsv"))
    with path.open("a") as f:  # (one short line per write: workers' lines do not interleave)
        f.write(f"{own:.2f}\t{kids:.2f}\t{wall:.2f}\t{what}\n")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    own, kids, wall = *_cpu(), time.monotonic()
    yield
    own2, kids2 = _cpu()
    _write(own2 - own, kids2 - kids, time.monotonic() - wall, item.nodeid)


def pytest_sessionstart(session: pytest.Session) -> None:
    session.stash[_START] = (*_cpu(), time.monotonic())


def pytest_sessionfinish(session: pytest.Session) -> None:
    own, kids, wall = session.stash[_START]
    own2, kids2 = _cpu()
    worker = getattr(session.config, "workerinput", {}).get("workerid", "main")  # (xdist's, not an inherited variable)
    _write(own2 - own, kids2 - kids, time.monotonic() - wall, f"SESSION {worker}")


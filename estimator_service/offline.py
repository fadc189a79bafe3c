"""Run a recorded log through a backend exactly as the daemon does (same Pipeline)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

from estimator_service import schema
from estimator_service.errors import UserError
from estimator_service.logfile import LogWriter, read_log
from estimator_service.pipeline import Pipeline
from estimator_service.rig import Rig, load_rig, load_rig_text


def rig_of_log(header: dict, log_path: str | Path, rig_path: str | Path | None = None) -> Rig:
    """The rig that produced a log: ``rig_path`` if given, else rebuilt from the log header."""
    if rig_path is not None:
        return load_rig(rig_path)
    if not header.get("rig_toml") or not header.get("mechanism_yaml"):
        raise UserError(f"{log_path}: header has no rig configuration (rig_toml); pass --rig RIG.toml")
    return load_rig_text(header["rig_toml"], header["mechanism_yaml"], name=str(header.get("rig_path") or log_path))


@dataclass
class EstimateRecord:
    """One input record or one produced estimate, in output order."""

    topic: str
    t_recv: float
    payload: bytes
    #: of an estimate this run produced: the validated message ``payload`` packs (:func:`schema.validate`;
    #: decoding ``payload`` gives the same values) — so a consumer in this process need not decode it
    msg: dict | None = None


ESTIMATOR_OUTPUT_PREFIX = "est/"  #: topics the estimator publishes (est/state, est/diag)


def run_log(pipe: Pipeline, records: Iterator, progress: Callable[[float], None] | None = None,
            keep_estimates: bool = False) -> Iterator[EstimateRecord]:
    """Yield every input record, each followed by the ``est/state`` records it completed.

    The input's own estimator output (``est/*``, e.g. of a live recording) is dropped unless
    ``keep_estimates``, so the output's estimates are this run's only.  Estimates carry the receive
    time of the input that completed them, so the output is deterministic (same input, same bytes).
    """
    for rec in records:
        if not keep_estimates and rec.topic.startswith(ESTIMATOR_OUTPUT_PREFIX):
            continue
        yield EstimateRecord(rec.topic, rec.t_recv, rec.payload)
        if rec.topic not in pipe.stats:
            continue
        for msg in pipe.feed_raw(rec.topic, rec.payload):
            valid = schema.validate("est/state", msg)
            yield EstimateRecord("est/state", rec.t_recv, schema.pack(valid), valid)
        if progress is not None:
            progress(rec.t_recv)


class Progress:
    """A one-line progress bar on stderr (only when stderr is a terminal): ``t`` from ``t_start`` to ``t_end``
    (any unit: seconds, bytes)."""

    def __init__(self, t_start: float, t_end: float, label: str) -> None:
        self.t_start, self.span, self.label = t_start, max(t_end - t_start, 1e-9), label
        self.enabled = sys.stderr.isatty()
        self._last = 0.0

    def __call__(self, t: float) -> None:
        now = time.monotonic()
        if not self.enabled or now - self._last < 0.2:
            return
        self._last = now
        frac = min(1.0, max(0.0, (t - self.t_start) / self.span))
        bar = "#" * int(frac * 40)
        sys.stderr.write(f"\r{self.label} [{bar:<40}] {frac * 100:5.1f}%")
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")


def estimate_log(log_path: str | Path, out_path: str | Path | None, backend: str | None = None,
                 rig_path: str | Path | None = None, keep_estimates: bool = False,
                 watch: Callable[[Pipeline], Callable[[EstimateRecord], None]] | None = None,
                 rig: Rig | None = None, progress: bool = True) -> Pipeline:
    """``rigstate estimate``: copy the input log to ``out_path`` (None: write nothing) and add
    ``est/state`` messages from ``backend`` (the input's own ``est/*`` records are left out unless
    ``keep_estimates``).  The rig: ``rig``, else loaded from ``rig_path``, else the log header's.

    ``watch(pipe)``, if given, returns a callback that sees every written record (e.g. a summary).
    ``progress``: a progress bar on stderr when it is a terminal.
    """
    reader = read_log(log_path)
    rig = rig if rig is not None else rig_of_log(reader.header, log_path, rig_path)
    bar = Progress(0.0, float(reader.size), f"estimate {backend or rig.estimator.backend}") if progress else None
    return estimate_records(iter(reader), reader.header, rig, backend, out_path, keep_estimates, watch,
                            None if bar is None else lambda _t: bar(float(reader.offset)),
                            str(Path(log_path).name), None if bar is None else bar.close)


#: the header keys that describe a rig (Rig.header), written into an estimate's output
RIG_HEADER_KEYS = ("rig_path", "rig_toml", "mechanism_path", "mechanism_yaml")


def estimate_records(records: Iterator, header: dict, rig: Rig, backend: str | None = None,
                     out_path: str | Path | None = None, keep_estimates: bool = False,
                     watch: Callable[[Pipeline], Callable[[EstimateRecord], None]] | None = None,
                     progress: Callable[[float], None] | None = None, source: str = "",
                     done: Callable[[], None] | None = None) -> Pipeline:
    """Run ``records`` (a log's, in log order) through a new :class:`Pipeline` of ``rig``: what
    :func:`estimate_log` does for a log file, for records from anywhere (the Python API's DataFrames).

    ``out_path``: write the output log there (``header`` with ``meta.estimated_from = source`` and
    ``meta.backend``), or None: write nothing.  ``progress(t_recv)`` is called after every input
    record, ``done()`` at the end.
    """
    pipe = Pipeline(rig, backend)
    header = dict(header)
    # the rig that made the estimates (a --rig, or the input's own): what report, export and a later
    # estimate read from the output (an imported table's log has no rig of its own)
    header.update({k: v for k, v in rig.header().items() if k in RIG_HEADER_KEYS})
    header["meta"] = {**(header.get("meta") or {}), "estimated_from": source, "backend": pipe.backend_name}
    observe = watch(pipe) if watch is not None else None
    with ExitStack() as stack:  # streamed: memory does not grow with the log
        writer = stack.enter_context(LogWriter(out_path, header)) if out_path is not None else None
        for rec in run_log(pipe, records, progress, keep_estimates):
            if writer is not None:
                writer.write(rec.topic, rec.t_recv, rec.payload)
            if observe is not None:
                observe(rec)
    if done is not None:
        done()
    return pipe

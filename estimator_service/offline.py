"""Run a recorded log through a backend exactly as the daemon does (same Pipeline)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
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


def estimate_log(log_path: str | Path, out_path: str | Path, backend: str | None = None,
                 rig_path: str | Path | None = None, keep_estimates: bool = False,
                 watch: Callable[[Pipeline], Callable[[EstimateRecord], None]] | None = None) -> Pipeline:
    """``rigstate estimate``: copy the input log and add ``est/state`` messages from ``backend``
    (the input's own ``est/*`` records are left out unless ``keep_estimates``).

    ``watch(pipe)``, if given, returns a callback that sees every written record (e.g. a summary).
    """
    reader = read_log(log_path)
    rig = rig_of_log(reader.header, log_path, rig_path)
    pipe = Pipeline(rig, backend)
    header = dict(reader.header)
    meta = dict(header.get("meta") or {})
    meta.update({"estimated_from": str(Path(log_path).name), "backend": pipe.backend_name})
    header["meta"] = meta
    progress = Progress(0.0, float(reader.size), f"estimate {pipe.backend_name}")
    observe = watch(pipe) if watch is not None else None
    with LogWriter(out_path, header) as writer:  # streamed: memory does not grow with the log
        for rec in run_log(pipe, iter(reader), lambda _t: progress(float(reader.offset)), keep_estimates):
            writer.write(rec.topic, rec.t_recv, rec.payload)
            if observe is not None:
                observe(rec)
    progress.close()
    return pipe

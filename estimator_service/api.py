"""rigstate from Python: rigs, simulation, foreign tables and estimates as pandas DataFrames.

The stable import path is ``from estimator_service import api`` (reference and a worked example:
docs/python-api.md).  Nothing here needs the bus or a file: a run is the same :class:`Pipeline` as
``rigstate estimate`` (which is built on :func:`estimate`), fed the same records, so it gives the
same ``est/state`` to the last bit.  Needs pandas (``pip install 'rigstate[pandas]'``).

DataFrames of messages (``simulate``, ``import_table``, ``read_log``) are one per topic, indexed by
the message time ``t`` (s, sensor time), with a ``t_recv`` column (host receive time, s) and one
column per scalar, named as in :mod:`estimator_service.tabular` (``gyr_x``, ``acc_z``, ``count``,
``q_x1``, ``z_crank``), in the schema's units (rad, rad/s, m/s², counts).  As input to
:func:`estimate` they are merged into one stream by ``t_recv``; at equal times in the order of the
dict (the order every function here returns them in).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from estimator_service import logfile, schema
from estimator_service.analysis import AccuracyAccumulator, dof_units
from estimator_service.errors import UserError
from estimator_service.offline import EstimateRecord, Progress, estimate_log, estimate_records
from estimator_service.pipeline import Pipeline
from estimator_service.rig import Rig, load_rig_text
from estimator_service.rig import load_rig as _load_rig
from estimator_service.tableimport import Imported, TableMap, check_sensors, load_map, merged, read_table, table_of_frame
from estimator_service.tableimport import import_table as _import_table
from estimator_service.tabular import flatten, model_labels, unflatten

if TYPE_CHECKING:
    import pandas

    from estimator_service.calibrate import Calibration

__all__ = ["Calibrated", "Estimates", "ImportedTable", "calibrate", "estimate", "import_table", "load_map", "load_rig",
           "read_log", "simulate", "records_of_frames"]

Frames = Mapping[str, "pandas.DataFrame"]  #: topic -> DataFrame (module docstring)


def load_rig(path: str | Path) -> Rig:
    """A rig TOML (docs/config.md) with its mechanism; ConfigError naming file, field and value."""
    return _load_rig(path)


def _rig(rig: Rig | str | Path) -> Rig:
    return rig if isinstance(rig, Rig) else _load_rig(rig)


def _pandas():
    try:
        import pandas as pd
    except ImportError:
        raise UserError("the Python API needs pandas: pip install 'rigstate[pandas]'") from None
    return pd


def _frames(rows: Iterable[tuple[str, dict]]) -> dict[str, pandas.DataFrame]:
    """One DataFrame per topic (in order of first appearance) of (topic, flat row with ``t``)."""
    pd = _pandas()
    by_topic: dict[str, list[dict]] = {}
    for topic, row in rows:
        by_topic.setdefault(topic, []).append(row)
    return {topic: pd.DataFrame(r).set_index("t") for topic, r in by_topic.items()}


def read_log(path: str | Path, topics: Iterable[str] | None = None) -> dict[str, pandas.DataFrame]:
    """A log's messages, one DataFrame per topic (:func:`estimator_service.logfile.read_dataframes`)."""
    return logfile.read_dataframes(path, topics)


def simulate(rig: Rig | str | Path, duration: float | None = None, seed: int | None = None) -> dict[str, pandas.DataFrame]:
    """``rigstate simulate`` to DataFrames: ``truth/state`` and every sensor of the rig (duration s and
    seed default to the rig's ``[simulation]``).  Same rig, duration and seed: the same values as the log."""
    from estimator_service.simulate import simulate as _simulate

    rig = _rig(rig)
    labels = model_labels(rig.model)
    return _frames((topic, {"t_recv": msg["t"], **flatten(msg, labels)})
                   for topic, msg in _simulate(rig=rig, duration=duration, seed=seed))


@dataclass
class ImportedTable:
    """:func:`import_table`'s result: the messages as DataFrames and what the import left out."""

    frames: dict[str, pandas.DataFrame]  #: per topic, in the map's order (module docstring)
    report: Imported  #: rows read, rows dropped (``repeated``, ``backwards``, ``first_dropped``); ``describe()``


def import_table(table: str | Path | pandas.DataFrame, mapping: TableMap | str | Path,
                 rig: Rig | str | Path | None = None) -> ImportedTable:
    """A foreign table (a CSV, Parquet or MATLAB file, or a DataFrame whose columns are the table's)
    through a map (:func:`load_map`, or the path of a map TOML) to rigstate messages: the same
    messages ``rigstate log import --table`` writes.  With ``rig``, every mapped sensor must be one of
    its sensors (encoders with its counts per revolution)."""
    tmap = mapping if isinstance(mapping, TableMap) else load_map(mapping)
    tab = read_table(table) if isinstance(table, (str, Path)) else table_of_frame(table)
    imported = _import_table(tab, tmap)
    if rig is not None:
        check_sensors(imported, tmap, _rig(rig))
    return ImportedTable(_frames((topic, {"t_recv": m["t"], **flatten(m, {})})
                                 for topic, m in merged(imported.messages)), imported)


def records_of_frames(frames: Frames, labels: dict[str, list[str]]) -> list[logfile.Record]:
    """Log records of DataFrames (module docstring); ``labels``: :func:`tabular.model_labels` of the
    mechanism, naming the state vectors' columns.  UserError naming topic and time of a bad row."""
    streams = {}
    for topic, frame in frames.items():
        try:
            schema.schema_key(topic)
        except schema.SchemaError as exc:
            raise UserError(f"DataFrame {topic!r}: {exc}") from None
        rows = frame.reset_index().to_dict("records")
        if rows and "t" not in rows[0]:
            raise UserError(f"DataFrame {topic!r}: no time: index it (or a column) by t, the message time in s")
        streams[topic] = [{**unflatten(topic, r, labels), "t_recv": r.get("t_recv", r["t"])} for r in rows]
    out = []
    for topic, m in merged(streams):
        t_recv = float(m.pop("t_recv"))
        try:
            out.append(logfile.Record(topic, t_recv, schema.encode(topic, m)))
        except schema.SchemaError as exc:
            raise UserError(f"DataFrame {topic!r}, t = {m.get('t')!r}: {exc}") from None
    return out


@dataclass
class Estimates:
    """:func:`estimate`'s result."""

    #: one row per ``est/state``, indexed by its time ``t`` (s, sensor time): per DOF ``<dof>_rad`` and
    #: ``<dof>_rate_rad_s`` (angles) or ``<dof>_m`` and ``<dof>_rate_m_s`` (translations), ``status``,
    #: ``quality`` (where the backend sends it), ``latency_s``; units also in ``states.attrs["units"]``.
    #: None with ``keep_states=False``
    states: pandas.DataFrame | None
    #: plain values, as ``rigstate estimate --json`` prints them (docs/report.md): ``dofs`` (per DOF
    #: ``rmse``, ``max_abs`` in ° or m against ``reference``), ``status``, ``quality`` counts, ``step_us``,
    #: ``dropped_inputs``, ``resets``
    summary: dict
    pipeline: Pipeline  #: the pipeline that ran (its counters: ``stats``, ``times``, ``resets``, ``last_reset``)

    @property
    def rmse(self) -> dict[str, float | None]:
        """Per DOF: RMSE against truth or a non-fused encoder on it, in :attr:`rmse_units` (None: no reference)."""
        return {d["name"]: d["rmse"] for d in self.summary["dofs"]}

    @property
    def rmse_units(self) -> dict[str, str]:
        """Per DOF: ``"°"`` (angles) or ``"m"``."""
        return {d["name"]: d["unit"] for d in self.summary["dofs"]}

    @property
    def quality_shares(self) -> dict[str, float]:
        """Share (0–1) of the estimates per ``quality`` (``ok``, ``inconsistent``); empty when none carried one."""
        counts = self.summary["quality"]
        n = sum(counts.values())
        return {k: v / n for k, v in counts.items()} if n else {}


def estimate(source: str | Path | Frames, rig: Rig | str | Path | None = None, backend: str | None = None,
             out: str | Path | None = None, keep_estimates: bool = False, progress: bool = False,
             keep_states: bool = True) -> Estimates:
    """Run a log file or DataFrames (module docstring) through ``backend`` (``ekf``, ``ukf``, ``errekf``,
    ``fgs``; default the rig's) exactly as ``rigstate estimate`` does.

    ``rig``: a Rig or a rig TOML path; a log's default is the rig in its header; DataFrames need one.
    ``out``: also write the output log there (the input records plus ``est/state``), else no file.
    ``keep_estimates``: keep the input's own ``est/*`` records (not scored).  ``progress``: a progress bar
    on stderr (when it is a terminal).  ``keep_states=False``: do not keep the estimates in memory (a
    long log with ``out``): ``states`` is None.
    """
    found: list[Callable[[], tuple[dict, list[dict]]]] = []
    watch = _watcher(found, keep_states)
    if isinstance(source, (str, Path)):
        pipe = estimate_log(source, out, backend, None if isinstance(rig, Rig) else rig, keep_estimates, watch,
                            rig=rig if isinstance(rig, Rig) else None, progress=progress)
    else:
        if rig is None:
            raise UserError("estimating DataFrames needs a rig (a Rig or the path of its TOML)")
        r = _rig(rig)
        records = records_of_frames(source, model_labels(r.model))
        bar = Progress(records[0].t_recv, records[-1].t_recv, f"estimate {backend or r.estimator.backend}") \
            if progress and records else None
        pipe = estimate_records(iter(records), r.header({"command": "api"}), r, backend, out, keep_estimates, watch,
                                bar, "DataFrames", None if bar is None else bar.close)
    summary, states = found[0]()
    summary["step_us"] = {"steps": pipe.times.count, **pipe.times.summary_us()}
    summary["backend"] = pipe.backend_name
    summary["out"] = None if out is None else str(out)
    kinds = ("malformed", "duplicate", "late", "future", "past")
    bad = {t: {k: getattr(s, k) for k in kinds if getattr(s, k)} | dict(s.errors) for t, s in pipe.stats.items()}
    summary["dropped_inputs"] = {t: d for t, d in bad.items() if d}
    summary["resets"] = pipe.resets
    return Estimates(_states(pipe, states) if keep_states else None, summary, pipe)


def _watcher(found: list, keep_states: bool) -> Callable[[Pipeline], Callable[[EstimateRecord], None]]:
    """The ``watch`` of :func:`estimate_records`: scores every record, keeps this run's estimates;
    appends to ``found`` a function returning (summary, estimates)."""
    def watch(pipe: Pipeline) -> Callable[[EstimateRecord], None]:
        acc = AccuracyAccumulator(pipe.rig, pipe.model)
        states: list[dict] = []
        found.append(lambda: (acc.summary(), states))

        def observe(rec: EstimateRecord) -> None:
            if rec.topic == "est/state":
                # this run's estimates carry their message; est/state copied from the input
                # (--keep-estimates of a recorded live run) is not scored
                if rec.msg is None:
                    return
                acc.add("est/state", rec.msg)
                if keep_states:
                    states.append(rec.msg)
                return
            acc.add_raw(rec.topic, rec.payload)
        return observe
    return watch


def _states(pipe: Pipeline, msgs: list[dict]) -> pandas.DataFrame:
    """The estimates as a DataFrame (:attr:`Estimates.states`)."""
    pd = _pandas()
    units: dict[str, str] = {}
    columns: dict[str, list] = {}
    for i, u in enumerate(dof_units(pipe.model)):
        base = "rad" if u.angle else "m"
        for name, unit, key in ((f"{u.name}_{base}", base, "z"), (f"{u.name}_rate_{base}_s", f"{base}/s", "zd")):
            units[name] = unit
            columns[name] = [m[key][i] for m in msgs]
    for key in ("status", "quality", "latency_s"):
        if any(key in m for m in msgs):
            columns[key] = [m.get(key) for m in msgs]
            units[key] = "s" if key == "latency_s" else ""
    frame = pd.DataFrame(columns, index=pd.Index([m["t"] for m in msgs], name="t"))
    frame.attrs["units"] = units
    return frame


@dataclass
class Calibrated:
    """What :func:`calibrate` found: ``calibration`` (every value with its 1σ: estimator_service.calibrate),
    ``text`` (the report ``rigstate calibrate`` prints), ``rig_toml`` (the calibrated rig as it writes it) and
    ``rig`` (that rig, ready for :func:`estimate`)."""

    calibration: Calibration
    text: str
    rig_toml: str
    rig: Rig


def calibrate(source: str | Path | Frames, rig: Rig | str | Path | None = None,
              window: tuple[float | None, float | None] = (None, None), out: str | Path | None = None) -> Calibrated:
    """``rigstate calibrate`` of a log file or DataFrames (module docstring): each IMU's axes and signs, mount,
    time offset, biases, gyro scale, lever arm and noise, and the drive's density, from a recording with
    encoders (or a rest), within ``window`` (s from the first sensor message; None: its start or end).
    ``rig``: a Rig or a rig TOML path (a log's default: the rig in its header; DataFrames need one).
    ``out``: also write the calibrated rig TOML there (paths in it relative to its folder), else no file."""
    from estimator_service.calibrate import calibrate as _calibrate
    from estimator_service.calibrate_report import calibrated_toml, format_calibration, write_calibrated
    from estimator_service.kinematics_check import read_messages, sensor_messages

    if isinstance(source, (str, Path)):
        if isinstance(rig, Rig):
            r, msgs = rig, sensor_messages(logfile.read_log(source), rig)
        else:
            r, msgs = read_messages(source, rig)
        name = str(source)
    else:
        if rig is None:
            raise UserError("calibrating DataFrames needs a rig (a Rig or the path of its TOML)")
        r = _rig(rig)
        msgs = sensor_messages(records_of_frames(source, model_labels(r.model)), r)
        name = "DataFrames"
    cal = _calibrate(r, msgs, window)
    if out is not None:
        write_calibrated(cal, out, name)
    where = Path(out) if out is not None else Path(r.path).with_name(Path(r.path).stem + "-calibrated.toml")
    text = calibrated_toml(cal, where, name)
    return Calibrated(cal, format_calibration(cal), text, load_rig_text(text, r.mechanism_yaml, str(where)))


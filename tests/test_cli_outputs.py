"""CLI outputs for any mechanism: bench, log info on live recordings, estimate over a log that holds
estimates, CSV column names, watch's est/diag sub-table — the entry point in the test process (helpers.run_main),
``watch`` and the latency bench's driver and estimator as real processes; real files and sockets."""

from __future__ import annotations

import csv
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from estimator_service import bus, schema
from estimator_service.logfile import LogWriter, read_log
from estimator_service.offline import rig_of_log
from estimator_service.pipeline import Pipeline

from helpers import RIG, run_main, write_rig, write_sim_log

# runs backends (or estimator subprocesses): their kernels compiled before the tests start (conftest.py)
pytestmark = pytest.mark.kernels()

HOST_T0 = 1_795_000_000.0  #: a host clock reading (s since the epoch), as in a live recording


@pytest.fixture(scope="module")
def rigs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("rigs")
    return {k: write_rig(d, k) for k in ("pendulum", "incline")}


@pytest.fixture(scope="module")
def live_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A log as ``rigstate record`` writes it next to a running estimator: host-clock times, sensor and
    truth messages, est/state from the daemon's Pipeline and est/diag once a second (t = 0 until the
    estimator has initialised, then its sensor time; seq = est/state published so far)."""
    d = tmp_path_factory.mktemp("live")
    sim = write_sim_log(d / "sim.log", RIG, 2.5)
    reader = read_log(sim)
    pipe = Pipeline(rig_of_log(reader.header, sim), "ekf")
    path = d / "live.log"
    next_diag = HOST_T0 - 0.5  # the estimator published a diag before the sensors started
    with LogWriter(path, reader.header) as w:
        for rec in reader:
            msg = schema.decode(rec.topic, rec.payload)
            msg["t"] += HOST_T0
            t_recv = msg["t"] + 0.002
            if t_recv >= next_diag:
                w.write("est/diag", next_diag, schema.encode("est/diag", pipe.diag(pipe.backend.t if pipe.initialized else 0.0)))
                next_diag += 1.0
            w.write(rec.topic, t_recv, schema.encode(rec.topic, msg))
            for est in pipe.feed(rec.topic, msg) if rec.topic in pipe.stats else []:
                w.write("est/state", t_recv, schema.encode("est/state", est))
    return path


# --------------------------------------------------------------------------------------- bench
def test_bench_short_scenario_prints_its_table_once(tmp_path: Path) -> None:
    out = run_main("bench", "--duration", "1", "--backends", "ekf", "--scenarios", "gyros", "--cache-dir", str(tmp_path))
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert sum(line.startswith("backend ") for line in lines) == 1
    rows = [line for line in lines if line.startswith("ekf ")]
    assert len(rows) == 1 and " gyros " in rows[0] and "crank " in rows[0] and rows[0].endswith("°")
    assert " 999 " in rows[0] or " 1000 " in rows[0]  # 1 s of 1 ms steps
    assert list(tmp_path.glob("*.log"))  # the scenario went to the given cache


def test_bench_help_names_the_default_cache() -> None:
    out = run_main("bench", "--help")
    assert out.returncode == 0 and "~/.cache/rigstate" in out.stdout and "RIGSTATE_CACHE" in out.stdout


def _independent_rmse(log: Path, out: Path, dof: str, angular: bool) -> float:
    """RMSE of the estimate of the DOF against truth, from an estimated log, by hand (all matched samples)."""
    assert run_main("estimate", str(log), "--backend", "ekf", "--out", str(out)).returncode == 0
    truth, est = {}, {}
    for rec in read_log(out):
        if rec.topic in ("truth/state", "est/state"):
            m = schema.decode(rec.topic, rec.payload)
            (truth if rec.topic == "truth/state" else est)[round(m["t"] * 1000)] = m["z"][0]
    keys = sorted(set(truth) & set(est))
    e = np.array([est[k] - truth[k] for k in keys])
    if angular:
        e = np.degrees((e + math.pi) % (2 * math.pi) - math.pi)
    return float(np.sqrt(np.mean(e**2)))


@pytest.mark.parametrize("kind, dof, unit", [("pendulum", "swing", "deg"), ("incline", "slide", "m")])
def test_bench_on_given_logs_only_reports_any_dof_with_units(rigs: dict[str, Path], tmp_path: Path, kind: str,
                                                              dof: str, unit: str) -> None:
    log = tmp_path / f"{kind}.log"
    assert run_main("simulate", "--rig", str(rigs[kind]), "--duration", "2", "--out", str(log)).returncode == 0
    cache = tmp_path / "cache"
    out = run_main("bench", str(log), "--backends", "ekf", "--cache-dir", str(cache), "--json", str(tmp_path / "b.json"))
    assert out.returncode == 0, out.stderr
    assert not cache.exists()  # logs given: no public scenario simulated
    row = next(line for line in out.stdout.splitlines() if line.startswith("ekf "))
    rec = json.loads((tmp_path / "b.json").read_text())
    assert len(rec) == 1 and rec[0]["dof_units"] == {dof: unit} and rec[0]["rmse_crank_deg"] is None
    assert f"{dof} " in row and row.endswith("°" if unit == "deg" else " m")
    # the moving part is the whole run for these rigs: bench's RMSE is the plain RMSE over matched samples
    expected = _independent_rmse(log, tmp_path / "est.log", dof, unit == "deg")
    assert rec[0]["rmse_dof"][dof] == pytest.approx(expected, rel=1e-9)
    assert 0 < expected < (1.0 if unit == "deg" else 0.05)


# -------------------------------------------------------------------------- log info, estimate
def _info_rows(stdout: str) -> dict[str, list[str]]:
    lines = stdout.splitlines()
    head = next(i for i, line in enumerate(lines) if line.strip().startswith("topic "))
    return {line.split()[0]: line.split() for line in lines[head + 1:] if len(line.split()) == 9}


def test_log_info_on_a_live_recording_shows_relative_times(live_log: Path) -> None:
    out = run_main("log", "info", str(live_log))
    assert out.returncode == 0, out.stderr
    assert "times relative to the first record: 2026-" in out.stdout and f"host time t = {HOST_T0 - 0.5:.3f} s" in out.stdout
    rows = _info_rows(out.stdout)
    assert {"imu/coupler", "est/state", "est/diag", "truth/state"} <= rows.keys()
    for topic, r in rows.items():
        start, duration = float(r[2]), float(r[3])
        assert 0 <= start < 1.0 and 0 <= duration < 4.0, (topic, r)  # no epoch times, no 1.8e9 s spans
    n_diag = sum(r.topic == "est/diag" for r in read_log(live_log))
    assert int(rows["est/diag"][1]) == n_diag >= 3
    assert float(rows["est/diag"][3]) == pytest.approx(n_diag - 1.0)  # one a second (receive time)
    assert rows["est/diag"][6:8] == ["-", "-"]  # its seq counts est/state messages: no "seq jumps"
    assert rows["est/state"][6:8] == ["0", "0"] and rows["imu/coupler"][6:8] == ["0", "0"]


def test_estimate_replaces_the_estimates_of_a_live_recording(live_log: Path, tmp_path: Path) -> None:
    old = [r for r in read_log(live_log) if r.topic == "est/state"]
    out = run_main("estimate", str(live_log), "--backend", "ekf", "--out", str(tmp_path / "new.log"))
    assert out.returncode == 0, out.stderr
    recs = list(read_log(tmp_path / "new.log"))
    seqs = [schema.decode("est/state", r.payload)["seq"] for r in recs if r.topic == "est/state"]
    assert not any(r.topic == "est/diag" for r in recs)
    assert seqs == list(range(len(seqs))) and len(seqs) > 2000  # this run's only: no jumps, none out of order
    assert f"{len(seqs)} est/state messages" in out.stdout
    inputs = [(r.topic, r.payload) for r in read_log(live_log) if not r.topic.startswith("est/")]
    assert [(r.topic, r.payload) for r in recs if not r.topic.startswith("est/")] == inputs
    kept = run_main("estimate", str(live_log), "--backend", "ekf", "--keep-estimates", "--out", str(tmp_path / "k.log"))
    assert kept.returncode == 0, kept.stderr
    recs = list(read_log(tmp_path / "k.log"))
    assert sum(r.topic == "est/state" for r in recs) == len(seqs) + len(old)
    assert sum(r.topic == "est/diag" for r in recs) == sum(r.topic == "est/diag" for r in read_log(live_log)) >= 3


# ---------------------------------------------------------------------------------------- CSV
def test_csv_export_names_coordinates_and_dofs_by_the_mechanism(rigs: dict[str, Path], tmp_path: Path) -> None:
    log = tmp_path / "p.log"
    assert run_main("simulate", "--rig", str(rigs["pendulum"]), "--duration", "0.3", "--out", str(log)).returncode == 0
    assert run_main("estimate", str(log), "--backend", "ekf", "--out", str(tmp_path / "e.log")).returncode == 0
    assert run_main("log", "export", str(tmp_path / "e.log"), "--csv", str(tmp_path / "csv")).returncode == 0
    for name in ("truth__state.csv", "est__state.csv"):
        with open(tmp_path / "csv" / name, newline="") as f:
            head = next(csv.reader(f))
        assert head[:3] == ["t", "t_recv", "log_index"]
        for field in ("q", "qd"):
            assert [c for c in head if c.startswith(field + "_")] == [f"{field}_x1", f"{field}_y1", f"{field}_theta"]
        assert "z_swing" in head and "zd_swing" in head and not any(c.startswith("q_0") for c in head)
    imu = (tmp_path / "csv" / "imu__arm.csv").read_text().splitlines()[0]
    assert imu.startswith("t,t_recv,log_index,acc_0,acc_1,acc_2")  # other lists keep their indices
    out = run_main("log", "import", "--csv", str(tmp_path / "csv"), "--out", str(tmp_path / "back.log"))
    assert out.returncode == 0, out.stderr
    a, b = read_log(tmp_path / "e.log"), read_log(tmp_path / "back.log")
    assert [(r.topic, r.t_recv, r.payload) for r in a] == [(r.topic, r.t_recv, r.payload) for r in b]


# -------------------------------------------------------------------------------------- watch
def test_watch_shows_est_diag_as_a_table_and_dofs_with_units(rigs: dict[str, Path], endpoint: str) -> None:
    diag = {"t": 12.0, "seq": 1234, "status": "ok", "step_us": {"mean": 300.123456, "p50": 251.98765, "p99": 1234.5678,
                                                               "max": 5000.1},
            "inputs": {"imu/block": {"rate_hz": 99.87654321, "received": 1200, "dropped": 1, "malformed": 2, "lost": 3},
                       "imu/\x1b[2Jevil": {"rate_hz": 0.0, "received": 0, "dropped": 0, "malformed": 0, "lost": 0}}}
    state = {"t": 12.0, "seq": 7, "q": [0.1, 0.2, 0.3, 0.4], "qd": [0.0] * 4, "z": [0.4321], "zd": [-0.25],
             "backend": "ekf", "status": "ok"}
    with bus.Publisher(endpoint) as pub:
        proc = subprocess.Popen([sys.executable, "-m", "estimator_service.cli", "watch", "--config",
                                 str(rigs["incline"]), "--endpoint", endpoint, "--duration", "3"],
                                stdout=subprocess.PIPE, text=True)
        try:
            assert pub.wait_for_subscribers("est/diag", timeout_s=60)
            end = time.monotonic() + 1.0
            while time.monotonic() < end:
                pub.publish("est/diag", diag)
                pub.publish("est/state", state)
                # a topic with a control character, sent around the Publisher's own checks
                pub._sock.send_multipart([b"imu/\x07bell", schema.encode("est/state", state)])
                time.sleep(0.05)  # paces the producer: 20 rounds a second for 1 s
            stdout, _ = proc.communicate(timeout=60)
        finally:
            proc.kill()
    assert proc.returncode == 0
    final = stdout.strip().split("\n\n")[-1]
    lines = final.splitlines()
    assert all(len(line) <= 160 for line in lines)  # no raw float maps that wrap
    assert "slide  +0.4321 m rate   -0.250 m/s  [ok]" in final
    sub = [line for line in lines if line.startswith("  | ")]
    assert sub[0].split()[1:] == ["est/diag", "input", "rate", "Hz", "received", "dropped", "malformed", "lost"]
    assert sub[2].split()[1:] == ["imu/block", "99.9", "1200", "1", "2", "3"]
    assert sub[-1] == "  | step µs p50 252  p99 1235  status ok"
    assert "imu/\\x1b[2Jevil" in final  # control characters of network text escaped
    assert "bell" not in final and int(lines[-1].split(": ")[1]) >= 1  # a bad topic name: dropped, counted
    assert "\x1b" not in stdout and "\x07" not in stdout


def test_bench_reference_runs_both_paths_side_by_side(tmp_path: Path) -> None:
    js = tmp_path / "bench.json"
    out = run_main("bench", "--duration", "1", "--backends", "ekf", "--scenarios", "gyros", "--cache-dir", str(tmp_path),
              "--reference", "--json", str(js))
    assert out.returncode == 0, out.stderr
    records = json.loads(js.read_text())
    assert [(r["backend"], r["config"], r["path"]) for r in records] == [("ekf", "gyros", "compiled"),
                                                                          ("ekf", "gyros numpy", "numpy")]
    # the same estimates on both paths (kernels vs reference to round-off)
    assert records[0]["rmse_crank_deg"] == pytest.approx(records[1]["rmse_crank_deg"], rel=1e-6)
    # the replay's own speed leaves the bench's scoring out: never slower than the whole run's
    assert all(r["replay_factor"] >= r["realtime_factor"] > 0 for r in records)


def test_bench_scaling_reports_every_mechanism_with_its_size(tmp_path: Path) -> None:
    """``bench --scaling``: one record per mechanism of growing size, the size in the record and the
    label, the generated ladders written to the cache beside the simulated logs."""
    js = tmp_path / "scaling.json"
    out = run_main("bench", "--scaling", "--duration", "0.3", "--backends", "ekf", "--cache-dir", str(tmp_path),
              "--json", str(js))
    assert out.returncode == 0, out.stderr
    records = json.loads(js.read_text())
    sizes = {r["config"].split()[0]: r["size"] for r in records}
    assert list(sizes) == ["four-bar", "slider-crank", "ladder-5", "ladder-11", "ladder-21"]
    assert [sizes[k]["n"] for k in sizes] == [8, 5, 9, 21, 41] and [sizes[k]["bodies"] for k in sizes] == [3, 2, 5, 11, 21]
    assert all(s["g"] == 1 and s["m"] == s["n"] - 1 and s["L"] >= 2 for s in sizes.values())
    assert all(r["steps"] >= 299 and r["rmse_crank_deg"] is not None for r in records)
    assert (tmp_path / "ladder-21.yaml").is_file() and (tmp_path / "ladder-21.toml").is_file()


def test_bench_latency_reports_the_live_pipelines_end_to_end_latency(tmp_path: Path) -> None:
    """``bench --latency``: real driver and estimator processes; per backend, est/state arrival less
    truth/state arrival at the same sensor time, beside the declared latency (no timing asserted)."""
    js = tmp_path / "latency.json"
    out = run_main("bench", "--latency", "2", "--backends", "ekf", "--json", str(js))
    assert out.returncode == 0, out.stderr
    (rec,) = json.loads(js.read_text())
    lat = rec["latency_ms"]
    assert rec["backend"] == "ekf" and rec["precompute"] is True and rec["declared_latency_ms"] == 0.0
    assert lat["count"] >= 1000 and 0 < lat["p50"] <= lat["p99"] <= lat["max"] + 0.05
    assert set(rec["status_counts"]) == {"ok"} and rec["estimator_cpu_share"] > 0


def test_latency_histogram_percentiles_and_the_truth_clock_stay_bounded() -> None:
    """The latency's fixed-memory histogram (the step times' one, pipeline.LogHistogram) against
    numpy's percentiles, and the truth clock's bound."""
    from estimator_service.pipeline import LogHistogram
    from estimator_service.soak import TruthClock

    rng = np.random.default_rng(3)
    x = rng.exponential(4000.0, 20000)  # µs
    h = LogHistogram()
    for v in x:
        h.add(float(v))
    s = h.summary_us()
    for p in (50, 99):
        assert s[f"p{p}"] == pytest.approx(np.percentile(x, p), rel=0.012)
    assert h.count == len(x) and s["max"] == pytest.approx(x.max()) and s["mean"] == pytest.approx(x.mean())
    clock = TruthClock(keep_s=1.0)
    for k in range(20000):  # 20 s of 1 kHz truth
        clock.add(k * 1e-3, 100.0 + k * 1e-3)
    assert len(clock._at) <= 2001
    assert clock.latency(19.5, 119.5005) == pytest.approx(0.0005) and clock.latency(19.5, 120.0) is None
    assert clock.latency(2.0, 103.0) is None  # long dropped


def test_watch_shows_an_inconsistent_estimate_beside_its_status() -> None:
    """`rigstate watch`'s est/state line: the status always, the quality only when it is not ok."""
    from estimator_service.commands.watch import summary

    msg = {"t": 1.0, "crank": 0.5, "crank_rate": 1.0, "status": "ok", "quality": "ok"}
    assert summary("est/state", msg).endswith("[ok]")
    assert summary("est/state", {**msg, "quality": "inconsistent"}).endswith("[ok, inconsistent]")
    assert summary("est/state", {**msg, "status": "degraded", "quality": "inconsistent"}).endswith("[degraded, inconsistent]")

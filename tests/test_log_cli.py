"""rigstate log info / export / import: summaries, lossless CSV round trip, foreign CSVs, bad cells."""

from __future__ import annotations

from pathlib import Path

from estimator_service import schema
from estimator_service.logfile import LogWriter, read_log

from helpers import RIG, run_main, write_sim_log


def test_info_export_import_round_trip_is_lossless(tmp_path: Path) -> None:
    log = write_sim_log(tmp_path / "a.log", RIG, 0.3)
    # add estimator output and diagnostics, so every schema goes through CSV
    with LogWriter(tmp_path / "b.log", read_log(log).header) as w:
        for i, rec in enumerate(read_log(log)):
            w.write(rec.topic, rec.t_recv, rec.payload)
            if rec.topic == "truth/state":
                msg = schema.decode("truth/state", rec.payload)
                w.write("est/state", rec.t_recv, schema.encode("est/state", {**msg, "seq": i, "backend": "fgs", "status": "ok"}))
        w.write("est/diag", 0.3, schema.encode("est/diag", {"t": 0.3, "seq": 0, "status": "ok",
                                                            "inputs": {"imu/coupler": {"rate_hz": 100.0, "lost": 0}},
                                                            "step_us": {"p99": 1.5}}))
    info = run_main("log", "info", str(tmp_path / "b.log"))
    assert info.returncode == 0, info.stderr
    assert "imu/coupler" in info.stdout and "truth/state" in info.stdout and "100.0" in info.stdout
    assert run_main("log", "export", str(tmp_path / "b.log"), "--csv", str(tmp_path / "csv")).returncode == 0
    assert (tmp_path / "csv" / "imu__coupler.csv").read_text().splitlines()[0].startswith("t,t_recv,log_index,acc_0")
    out = run_main("log", "import", "--csv", str(tmp_path / "csv"), "--out", str(tmp_path / "c.log"))
    assert out.returncode == 0, out.stderr
    a, c = read_log(tmp_path / "b.log"), read_log(tmp_path / "c.log")
    assert a.header == c.header
    assert [(r.topic, r.t_recv, r.payload) for r in a] == [(r.topic, r.t_recv, r.payload) for r in c]


def test_import_foreign_csv_and_report_bad_cells(tmp_path: Path) -> None:
    d = tmp_path / "csv"
    d.mkdir()
    (d / "imu__arm.csv").write_text("t,seq,gyr_0,gyr_1,gyr_2,acc_0,acc_1,acc_2\n"
                                    "0.00,0,0.1,0.2,0.3,0,9.81,0\n0.01,1,0.1,0.2,0.3,0,9.81,0\n")
    (d / "enc__crank.csv").write_text("t,seq,count,cpr\n0.005,0,12,4096\n")
    out = run_main("log", "import", "--csv", str(d), "--out", str(tmp_path / "x.log"))
    assert out.returncode == 0, out.stderr
    recs = list(read_log(tmp_path / "x.log"))
    assert [r.topic for r in recs] == ["imu/arm", "enc/crank", "imu/arm"]  # merged by time
    assert schema.decode("imu/arm", recs[2].payload)["acc"] == [0.0, 9.81, 0.0]
    (d / "enc__crank.csv").write_text("t,seq,count,cpr\n0.005,0,twelve,4096\n")
    bad = run_main("log", "import", "--csv", str(d), "--out", str(tmp_path / "y.log"))
    assert bad.returncode == 2
    assert "enc__crank.csv, row 2" in bad.stderr and "count" in bad.stderr

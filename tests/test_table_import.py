"""rigstate log import --table and the Python API's import_table: the real-shaft exports (raw.csv in the
source's own names and units) through config/maps/real-shaft.toml give the messages a hand conversion
gives (built here from raw.csv on its own), repeated stamps are reported, bad maps are exit 2."""

from __future__ import annotations

import csv
import math
import re
from pathlib import Path

import pytest
from scipy.io import savemat

from estimator_service import api, schema
from estimator_service.errors import UserError
from estimator_service.logfile import read_log
from estimator_service.paths import config_dir
from estimator_service.tableimport import import_table, load_map, read_table

from helpers import DATA, run_main

SHAFT = DATA / "real-shaft"
TRIALS = ("pitch_slow", "roll_medium", "yaw_slow")
MAP = config_dir() / "maps" / "real-shaft.toml"
RIG = config_dir() / "rigs" / "shaft-pitch.toml"


def expected(raw: Path) -> tuple[list[dict], list[dict], int]:
    """The hand conversion: rows whose time repeats the previous one dropped, t from the first row (on
    the source's 1 ms grid), seq from 0, deg/s -> rad/s, g -> m/s² with g = 9.81, encoder count =
    round(deg · 100) of cpr 36000."""
    with open(raw, newline="") as f:
        rows = list(csv.DictReader(f))
    kept = [r for i, r in enumerate(rows) if i == 0 or r["all_time"] != rows[i - 1]["all_time"]]
    t0 = float(kept[0]["all_time"])
    imu, enc = [], []
    for seq, r in enumerate(kept):
        t = round(float(r["all_time"]) - t0, 3)
        imu.append({"t": t, "seq": seq, "gyr": [math.radians(float(r[f"all_gyro_2_{a}"])) for a in "xyz"],
                    "acc": [9.81 * float(r[f"all_accel_2_{a}"]) for a in "xyz"]})
        enc.append({"t": t, "seq": seq, "count": round(float(r["all_encoder"]) * 100), "cpr": 36000})
    return imu, enc, len(rows) - len(kept)


def close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-12, abs_tol=0.0) or a == b


def messages(log: Path) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for rec in read_log(log):
        out.setdefault(rec.topic, []).append(schema.decode(rec.topic, rec.payload))
    return out


@pytest.mark.parametrize("trial", TRIALS)
def test_raw_export_imports_as_the_hand_conversion(tmp_path: Path, trial: str) -> None:
    raw = SHAFT / trial / "raw.csv"
    out = run_main("log", "import", "--table", str(raw), "--map", str(MAP), "--out", str(tmp_path / "a.log"))
    assert out.returncode == 0, out.stderr
    imu, enc, repeats = expected(raw)
    got = messages(tmp_path / "a.log")
    assert list(got) == ["enc/shaft", "imu/shaft"] and len(got["imu/shaft"]) == len(imu) and len(got["enc/shaft"]) == len(enc)
    for g, e in zip(got["imu/shaft"], imu, strict=True):
        assert g["seq"] == e["seq"] and g["t"] == e["t"]
        assert all(close(x, y) for x, y in zip(g["gyr"] + g["acc"], e["gyr"] + e["acc"], strict=True)), (g, e)
    for g, e in zip(got["enc/shaft"], enc, strict=True):
        assert (g["t"], g["seq"], g["count"], g["cpr"]) == (e["t"], e["seq"], e["count"], e["cpr"])
    if repeats:
        assert f"dropped {repeats} rows whose time stamp does not increase ({repeats} repeated, 0 going back" in out.stdout
    else:
        assert "dropped" not in out.stdout
    assert read_log(tmp_path / "a.log").header["meta"]["dropped_rows"] == {"repeated": repeats, "backwards": 0}


def test_units_scales_seq_and_recorded_times(tmp_path: Path) -> None:
    (tmp_path / "daq.csv").write_text("time_ms,n,wx,wy,wz,ax,ay,az,ticks,other\n"
                                      "1000,7,0.1,0.2,0.3,1,2,3,-5,x\n1010,8,0.1,0.2,0.3,1,2,3,4095,y\n"
                                      "1005,9,0,0,0,0,0,0,0,z\n")
    (tmp_path / "map.toml").write_text(
        '[time]\ncolumn = "time_ms"\nunit = "ms"\norigin = "recorded"\n'
        '[imu.arm]\ngyr = ["wx", "wy", "wz"]\ngyr_unit = "rad/s"\ngyr_scale = [1, 1, -1]\n'
        'acc = ["ax", "ay", "az"]\nacc_unit = "m/s^2"\nacc_scale = 2\nseq = "n"\n'
        '[enc.crank]\nangle = "ticks"\nunit = "counts"\ncpr = 4096\nscale = -1\n')
    out = run_main("log", "import", "--table", str(tmp_path / "daq.csv"), "--map", str(tmp_path / "map.toml"),
              "--out", str(tmp_path / "a.log"))
    assert out.returncode == 0, out.stderr
    assert "dropped 1 rows whose time stamp does not increase (0 repeated, 1 going back; first: row 4, t = 1005.0)" in out.stdout
    got = messages(tmp_path / "a.log")
    assert got["imu/arm"] == [{"t": 1.0, "seq": 7, "gyr": [0.1, 0.2, -0.3], "acc": [2.0, 4.0, 6.0]},
                              {"t": 1.01, "seq": 8, "gyr": [0.1, 0.2, -0.3], "acc": [2.0, 4.0, 6.0]}]
    assert got["enc/crank"] == [{"t": 1.0, "seq": 0, "count": 5, "cpr": 4096}, {"t": 1.01, "seq": 1, "count": -4095, "cpr": 4096}]


def test_repeated_stamps_refused_with_their_row(tmp_path: Path) -> None:
    raw = SHAFT / "roll_medium" / "raw.csv"
    lines = raw.read_text().splitlines()
    first = next(n for n in range(2, len(lines)) if lines[n].split(",")[0] == lines[n - 1].split(",")[0])
    out = run_main("log", "import", "--table", str(raw), "--map", str(MAP), "--repeats", "refuse", "--out", str(tmp_path / "a.log"))
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert f"raw.csv, row {first + 1}, column 'all_time'" in out.stderr and "does not increase" in out.stderr
    assert not (tmp_path / "a.log").exists()


def test_map_on_the_command_line_and_wrong_names(tmp_path: Path) -> None:
    raw = SHAFT / "yaw_slow" / "raw.csv"
    sets = ["time.column=all_time", "enc.shaft.angle=all_encoder", "enc.shaft.unit=deg", "enc.shaft.cpr=36000",
            "imu.shaft.gyr=[\"all_gyro_2_x\", \"all_gyro_2_y\", \"all_gyro_2_z\"]", "imu.shaft.gyr_unit=deg/s",
            "imu.shaft.acc=[\"all_accel_2_x\", \"all_accel_2_y\", \"all_accel_2_z\"]", "imu.shaft.acc_unit=g",
            "imu.shaft.g=9.81"]  # the map file's order: the encoder first
    a = run_main("log", "import", "--table", str(raw), "--map", str(MAP), "--out", str(tmp_path / "a.log"))
    b = run_main("log", "import", "--table", str(raw), *[x for s in sets for x in ("--set", s)], "--out", str(tmp_path / "b.log"))
    assert a.returncode == 0 and b.returncode == 0, b.stderr
    assert [tuple(r) for r in read_log(tmp_path / "a.log")] == [tuple(r) for r in read_log(tmp_path / "b.log")]
    column = run_main("log", "import", "--table", str(raw), "--map", str(MAP), "--set", "enc.shaft.angle=all_encodr",
                 "--out", str(tmp_path / "c.log"))
    assert column.returncode == 2 and "Traceback" not in column.stderr
    assert "raw.csv: no column 'all_encodr'" in column.stderr and "enc.shaft.angle" in column.stderr
    assert "all_encoder" in column.stderr  # the table's columns are listed
    unit = run_main("log", "import", "--table", str(raw), "--map", str(MAP), "--set", "imu.shaft.gyr_unit=dps",
               "--out", str(tmp_path / "c.log"))
    assert unit.returncode == 2 and "real-shaft.toml: imu.shaft.gyr_unit: unknown 'dps'; one of rad/s, deg/s" in unit.stderr
    key = run_main("log", "import", "--table", str(raw), "--map", str(MAP), "--set", "imu.shaft.gyro=x", "--out", str(tmp_path / "c.log"))
    assert key.returncode == 2 and "imu.shaft.gyro: unknown key" in key.stderr
    rig = run_main("log", "import", "--table", str(raw), "--map", str(MAP), "--set", "enc.shaft.resolution=0.1",
              "--rig", str(RIG), "--out", str(tmp_path / "c.log"))
    assert rig.returncode == 2 and "3600 counts per revolution, the rig's [[encoder]] 'shaft' has 36000" in rig.stderr


def test_bad_cell_named_with_row_and_column(tmp_path: Path) -> None:
    lines = (SHAFT / "pitch_slow" / "raw.csv").read_text().splitlines()[:5]
    cells = lines[3].split(",")
    cells[2] = "n/a"
    lines[3] = ",".join(cells)
    (tmp_path / "bad.csv").write_text("\n".join(lines) + "\n")
    out = run_main("log", "import", "--table", str(tmp_path / "bad.csv"), "--map", str(MAP), "--out", str(tmp_path / "a.log"))
    assert out.returncode == 2 and "bad.csv, row 4, column 'all_gyro_2_x': expected a finite number, got 'n/a'" in out.stderr


def test_api_import_of_csv_mat_and_dataframe_gives_the_cli_records(tmp_path: Path) -> None:
    import pandas as pd

    raw = SHAFT / "roll_medium" / "raw.csv"
    assert run_main("log", "import", "--table", str(raw), "--map", str(MAP), "--out", str(tmp_path / "a.log")).returncode == 0
    records = [tuple(r) for r in read_log(tmp_path / "a.log")]
    imported = api.import_table(raw, MAP)
    assert imported.report.repeated == 7 and imported.report.backwards == 0 and imported.report.rows == 2995
    assert [tuple(r) for r in api.records_of_frames(imported.frames, {})] == records
    with open(raw, newline="") as f:
        rows = list(csv.DictReader(f))
    columns = {k: [float(r[k]) for r in rows] for k in rows[0]}  # exact decimal parsing, as the CSV reader
    savemat(tmp_path / "raw.mat", columns)
    from_mat = api.import_table(tmp_path / "raw.mat", MAP)
    from_frame = api.import_table(pd.DataFrame(columns), MAP)
    for other in (from_mat, from_frame):
        assert [tuple(r) for r in api.records_of_frames(other.frames, {})] == records
    assert from_mat.report.describe().endswith("(7 repeated, 0 going back; first: row 61, t = 31.981)")
    assert "first: row 61," in from_frame.report.describe()  # rows count from 1 (a CSV file: its line, from 2)


def test_parquet_reads_as_the_csv_or_says_what_it_needs(tmp_path: Path) -> None:
    import pandas as pd

    raw = SHAFT / "yaw_slow" / "raw.csv"
    with open(raw, newline="") as f:
        rows = list(csv.DictReader(f))
    frame = pd.DataFrame({k: [float(r[k]) for r in rows] for k in rows[0]})
    try:
        frame.to_parquet(tmp_path / "raw.parquet")
    except ImportError:  # no pyarrow here: the import says what it needs (exit 2)
        (tmp_path / "raw.parquet").write_bytes(b"PAR1")
        out = run_main("log", "import", "--table", str(tmp_path / "raw.parquet"), "--map", str(MAP), "--out", str(tmp_path / "p.log"))
        assert out.returncode == 2 and "raw.parquet: reading Parquet needs pandas and pyarrow" in out.stderr
        return
    out = run_main("log", "import", "--table", str(tmp_path / "raw.parquet"), "--map", str(MAP), "--out", str(tmp_path / "p.log"))
    assert out.returncode == 0, out.stderr
    assert run_main("log", "import", "--table", str(raw), "--map", str(MAP), "--out", str(tmp_path / "c.log")).returncode == 0
    assert [tuple(r) for r in read_log(tmp_path / "p.log")] == [tuple(r) for r in read_log(tmp_path / "c.log")]


def test_every_bad_map_value_and_table_is_a_user_error(tmp_path: Path) -> None:
    """Each key of the shipped map set to values of every type: a UserError naming the map (or the import
    works), never another exception; and damaged tables name their file."""
    values = ['"text"', "[1, 2]", "{ a = 1 }", "true", "-1", "0", "1e400", "nan", "[[1], [2]]", '""', "99999",
              '["a", "b", "c"]', "-0.01", '"counts"']
    keys = ["time.column", "time.unit", "time.origin", "time.repeats", "time.other", "enc.shaft.angle", "enc.shaft.unit",
            "enc.shaft.resolution", "enc.shaft.cpr", "enc.shaft.scale", "enc.shaft.seq", "imu.shaft.gyr",
            "imu.shaft.gyr_unit", "imu.shaft.gyr_scale", "imu.shaft.acc", "imu.shaft.acc_unit", "imu.shaft.g",
            "imu.shaft.seq", "imu", "other"]
    table = read_table(SHAFT / "pitch_slow" / "raw.csv")
    refused = 0
    for key in keys:
        for value in values:
            try:
                import_table(table, load_map(MAP, [f"{key}={value}"]))
            except UserError as exc:
                refused += 1
                assert str(exc).startswith((str(MAP), str(table.source))), (key, value, exc)
    assert refused >= len(keys) * len(values) - 10  # a few values are valid (a number where a number goes)
    for name, content in (("a.csv", b""), ("b.csv", b"\xc0\xff\x00"), ("c.mat", b"x"), ("d.parquet", b"PAR1"),
                          ("e.csv", (SHAFT / "pitch_slow" / "raw.csv").read_bytes()[:300])):
        (tmp_path / name).write_bytes(content)
        with pytest.raises(UserError, match=re.escape(str(tmp_path / name))):
            import_table(read_table(tmp_path / name), load_map(MAP))


@pytest.mark.kernels("ekf")
def test_an_estimate_with_a_rig_writes_that_rig_into_its_output(tmp_path: Path) -> None:
    """A table imported without a rig, estimated with --rig: the output's header holds that rig, so its
    estimates are named by the mechanism (z_shaft) and report, export and calibrate read it."""
    from estimator_service.logfile import read_dataframes

    raw = tmp_path / "raw.csv"  # the first 5 s of the pitch trial
    raw.write_text("".join((SHAFT / "pitch_slow" / "raw.csv").read_text().splitlines(keepends=True)[:501]))
    assert run_main("log", "import", "--table", str(raw), "--map", str(MAP), "--out", str(tmp_path / "in.log")).returncode == 0
    assert not read_log(tmp_path / "in.log").header.get("rig_toml")  # (no --rig at the import)
    out = run_main("estimate", str(tmp_path / "in.log"), "--rig", str(RIG), "--backend", "ekf", "--out", str(tmp_path / "est.log"))
    assert out.returncode == 0, out.stderr
    header = read_log(tmp_path / "est.log").header
    assert header["rig_toml"] == RIG.read_text() and header["mechanism_yaml"]
    assert {"z_shaft", "zd_shaft"} <= set(read_dataframes(tmp_path / "est.log")["est/state"].columns)

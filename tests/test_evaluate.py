"""``rigstate evaluate``: grid parsing and errors, runs on the local process pool and on a local Dask
cluster (a real scheduler and worker process on 127.0.0.1) give the same numbers as ``estimate``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from estimator_service.bus import free_port
from helpers import RIG
from estimator_service.cli import main
from estimator_service.evaluate import fig_accuracy_vs_time, fig_rmse_by_backend, load_grid, run_grid

# runs backends (or estimator subprocesses): their kernels compiled before the tests start (conftest.py)
pytestmark = pytest.mark.kernels("ekf", "ukf")

GRID = f"""
[grid]
backends = ["ekf", "ukf"]
seeds = [1, 2]
duration_s = 0.6

[[scenario]]
name = "public"
rig = "{RIG}"

[[settings]]
name = "default"

[[settings]]
name = "rk4"
backends = ["ekf"]
ekf = {{ integrator = "rk4" }}
"""


@pytest.fixture(scope="module")
def grid(tmp_path_factory: pytest.TempPathFactory) -> Path:
    p = tmp_path_factory.mktemp("grid") / "grid.toml"
    p.write_text(GRID)
    return p


@pytest.fixture(scope="module")
def pool_rows(grid: Path) -> list[dict]:
    return run_grid(load_grid(grid), workers=1)  # a worker process (its start-up: ~3 s of imports and kernel loading)


def test_grid_expands_scenarios_seeds_backends_settings(grid: Path) -> None:
    jobs = load_grid(grid)
    assert [(j.seed, j.backend, j.settings) for j in jobs] == [
        (1, "ekf", "default"), (1, "ekf", "rk4"), (1, "ukf", "default"),
        (2, "ekf", "default"), (2, "ekf", "rk4"), (2, "ukf", "default")]
    assert jobs[1].overrides == (("integrator", "rk4"),) and jobs[0].overrides == ()
    assert all(j.duration_s == 0.6 and j.kind == "rig" for j in jobs)


@pytest.mark.parametrize("text, field", [
    ('[grid]\nbackends = ["kalman"]\n[[scenario]]\nname = "a"\nrig = "{rig}"', "grid.backends"),
    ('[grid]\nseeds = [-1]\n[[scenario]]\nname = "a"\nrig = "{rig}"', "grid.seeds"),
    ('[[scenario]]\nname = "a"\nrig = "nope.toml"', "scenario[0].rig"),
    ('[[scenario]]\nname = "a"\nrig = "{rig}"\nlog = "x.log"', "scenario[0]"),
    ('[[scenario]]\nname = "a"\nrig = "{rig}"\n[[settings]]\nname = "s"\nekf = {{ sigma_zz = 1 }}', "settings[0].ekf"),
])
def test_grid_errors_name_file_and_field(tmp_path: Path, capsys, text: str, field: str) -> None:
    p = tmp_path / "g.toml"
    p.write_text(text.format(rig=RIG))
    assert main(["evaluate", str(p), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert f"{p}: {field}" in err and "Traceback" not in err


def test_pool_results_equal_estimate_on_the_same_simulation(pool_rows: list[dict], tmp_path: Path, capsys) -> None:
    assert [r["error"] for r in pool_rows] == [""] * 6
    assert all(r["unit_crank"] == "°" and r["reference_crank"] == "truth/state" for r in pool_rows)
    assert all(0.0 < r["rmse_crank"] < 2.0 and r["status_ok"] == r["estimates"] > 500 for r in pool_rows)
    # independent: simulate the same scenario with the CLI and estimate it
    log = tmp_path / "sim.log"
    assert main(["simulate", "--rig", str(RIG), "--duration", "0.6", "--seed", "2", "--out", str(log)]) == 0
    assert main(["estimate", str(log), "--backend", "ukf", "--out", str(tmp_path / "e.log"), "--json"]) == 0
    out = capsys.readouterr().out
    summary = json.loads(out[out.index("{"):])
    row = next(r for r in pool_rows if (r["seed"], r["backend"]) == (2, "ukf"))
    assert row["rmse_crank"] == pytest.approx(summary["dofs"][0]["rmse"], rel=1e-12)
    assert row["max_crank"] == pytest.approx(summary["dofs"][0]["max_abs"], rel=1e-12)


def test_summary_figures_have_one_series_per_backend_and_setting(pool_rows: list[dict]) -> None:
    ax = fig_rmse_by_backend(pool_rows).axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["ekf", "ukf"]
    assert ax.get_ylabel() == "RMSE of crank (°)"
    points = [ln for ln in ax.get_lines() if ln.get_label().startswith(("ekf:", "ukf:"))]
    assert [len(ln.get_ydata()) for ln in points] == [4, 2]
    ax = fig_accuracy_vs_time(pool_rows).axes[0]
    series = {ln.get_label(): sorted(ln.get_ydata()) for ln in ax.get_lines() if "/" in ln.get_label()}
    assert set(series) == {"ekf / default", "ekf / rk4", "ukf / default"}
    assert series["ukf / default"] == sorted(r["rmse_crank"] for r in pool_rows if r["backend"] == "ukf")
    assert ax.get_xlabel() == "p99 processing time per 1 ms step (µs)"


@pytest.mark.slow
def test_dask_cluster_gives_the_pool_results(grid: Path, pool_rows: list[dict], tmp_path: Path, capsys) -> None:
    from distributed import LocalCluster

    with LocalCluster(n_workers=1, threads_per_worker=1, processes=True, host="127.0.0.1",
                      dashboard_address=":0") as cluster:  # (any free port: suites side by side)
        out = tmp_path / "out"
        assert main(["evaluate", str(grid), "--cluster", cluster.scheduler_address, "--out", str(out)]) == 0
    doc = json.loads((out / "results.json").read_text())
    assert doc["meta"]["cluster"] == cluster.scheduler_address and len(doc["rows"]) == 6
    for a, b in zip(doc["rows"], pool_rows, strict=True):
        assert (a["seed"], a["backend"], a["settings"]) == (b["seed"], b["backend"], b["settings"])
        assert a["rmse_crank"] == b["rmse_crank"] and a["estimates"] == b["estimates"]
    assert {p.name for p in out.iterdir()} == {"results.csv", "results.json", "rmse-by-backend.png",
                                              "accuracy-vs-step-time.png"}
    csv_lines = (out / "results.csv").read_text().splitlines()
    assert len(csv_lines) == 7 and "rmse_crank" in csv_lines[0].split(",")


def test_unreachable_cluster_is_a_clear_error(grid: Path, tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing listening: exit 2 and the message, after the connect timeout (1 s here: its default 10 s only
    waits longer for the same refusal)."""
    from estimator_service import evaluate

    monkeypatch.setattr(evaluate, "CONNECT_TIMEOUT_S", 1)
    port = free_port()  # nothing listening
    assert main(["evaluate", str(grid), "--cluster", f"tcp://127.0.0.1:{port}", "--out", str(tmp_path)]) == 2
    assert "cannot connect to the Dask scheduler" in capsys.readouterr().err

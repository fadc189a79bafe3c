"""The estimate summary and ``rigstate report``: numbers against an independent computation, figures
with the expected axes and series, any mechanism and DOF names (° and m), encoder references."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from helpers import RIG, write_sim_log
from estimator_service import schema
from estimator_service.cli import main
from estimator_service.logfile import LogWriter, read_log
from estimator_service.offline import estimate_log
from estimator_service.report import (
    fig_dofs,
    fig_rates,
    fig_residuals,
    fig_states,
    fig_status,
    fig_timing,
    load_series,
    write_report,
)

# runs backends (or estimator subprocesses): their kernels compiled before the tests start (conftest.py)
pytestmark = pytest.mark.kernels("ekf", "ukf")

CART_YAML = """%YAML 1.2
---
# A pendulum hanging from a cart that slides freely along x: DOFs cart (m) and swing (rad).
parameters:
  L: 0.5
points:
  - {x: 0, y: 0}
  - {x: L*cos(deg2rad(-60)), y: L*sin(deg2rad(-60))}
planar_bodies:
  - {name: rod, points: [0, 1], length: L, mass: 1.0, I0: mass*L^2/3, cog: [L/2, 0]}
sliders:
  - {point: 0, origin: [0, 0], angle_deg: 0}
relative_coordinates:
  - {type: RelativeAngleAbsoluteDOF, points: [0, 1], name: th}
dofs:
  - {name: cart, coordinate: x0}
  - {name: swing, coordinate: th}
"""

CART_TOML = """
[rig]
name = "cart-pendulum"
mechanism = "cart.yaml"

[[imu]]
name = "bob"
body = "rod"
at = [0.4, 0.0]
rate_hz = 100
use = ["gyr", "acc"]

[[encoder]]
name = "swing"
body = "rod"
relative_to = "ground"
lines = 2048
use = false

[simulation]
duration_s = 1.5
seed = 3

[simulation.initial]
swing_deg = -60.0

[estimator]
backend = "ekf"

[estimator.init]
swing_deg = -60.0
"""


def _messages(path: Path) -> dict[str, list[tuple[float, dict]]]:
    out: dict[str, list[tuple[float, dict]]] = {}
    for rec in read_log(path):
        out.setdefault(rec.topic, []).append((rec.t_recv, schema.decode(rec.topic, rec.payload)))
    return out


def _independent_errors(est_log: Path, dof: int, angle: bool, reference: str = "truth") -> np.ndarray:
    """Errors of est/state z[dof] against truth z[dof] (or the encoder angle) at the same millisecond."""
    msgs = _messages(est_log)
    if reference == "truth":
        ref = {round(m["t"] * 1000): m["z"][dof] for _, m in msgs["truth/state"]}
    else:
        ref = {round(m["t"] * 1000): m["count"] * 2 * math.pi / m["cpr"] for _, m in msgs[reference]}
    err = np.array([m["z"][dof] - ref[round(m["t"] * 1000)] for _, m in msgs["est/state"] if round(m["t"] * 1000) in ref])
    return (err + math.pi) % (2 * math.pi) - math.pi if angle else err


@pytest.fixture(scope="module")
def fourbar(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(raw log, log estimated by ekf): 3 s of the public scenario."""
    d = tmp_path_factory.mktemp("report")
    raw = write_sim_log(d / "raw.log", RIG, 3.0)
    estimate_log(raw, d / "est.log", "ekf")
    return raw, d / "est.log"


def _estimate_json(raw: Path, est: Path, capsys: pytest.CaptureFixture[str], backend: str = "ekf",
                   *extra: str) -> dict:
    assert main(["estimate", str(raw), "--backend", backend, "--out", str(est), "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out)


def test_estimate_summary_matches_independent_rmse(fourbar, capsys: pytest.CaptureFixture[str]) -> None:
    raw, est = fourbar
    est = est.with_name("est-cli.log")
    s = _estimate_json(raw, est, capsys)
    (crank,) = s["dofs"]
    assert crank["name"] == "crank" and crank["unit"] == "°" and crank["reference"] == "truth/state"
    err = np.degrees(_independent_errors(est, 0, angle=True))
    assert crank["matched"] == err.size == s["estimates"] > 2900
    assert crank["rmse"] == pytest.approx(float(np.sqrt(np.mean(err**2))), rel=1e-12)
    assert crank["max_abs"] == pytest.approx(float(np.abs(err).max()), rel=1e-12)
    assert 0.0 < crank["rmse"] < 1.0  # the filter tracks (public scenario, ekf)
    statuses = [m["status"] for _, m in _messages(est)["est/state"]]
    assert s["status"] == {k: statuses.count(k) for k in set(statuses)}
    assert s["step_us"]["steps"] >= s["estimates"] and 0 < s["step_us"]["p50"] <= s["step_us"]["p99"] <= s["step_us"]["max"]
    # the human form carries the same numbers
    assert main(["estimate", str(raw), "--backend", "ekf", "--out", str(est.with_name("est-text.log"))]) == 0
    text = capsys.readouterr().out
    assert f"RMSE {crank['rmse']:.4f} °" in text and "vs truth/state" in text and "p99" in text


def test_report_figures_have_the_expected_axes_and_series(fourbar, tmp_path: Path, capsys) -> None:
    raw, est = fourbar
    ls = load_series(est)
    assert not ls.estimated_here and ls.backend == "ekf"
    fig = fig_dofs(ls)
    ax, ax_e = fig.axes[:2]
    assert ax.get_ylabel() == "crank (°)" and ax_e.get_ylabel() == "error (°)" and ax_e.get_xlabel() == "time (s)"
    assert [ln.get_label() for ln in ax.get_lines()] == ["truth", "estimate (ekf)"]
    _, st = ls.accuracy.stats(0)
    (err_line,) = ax_e.get_lines()[:1]
    assert f"RMSE {st.rmse * 180 / math.pi:.3g} °" in err_line.get_label()
    np.testing.assert_allclose(err_line.get_ydata(), np.degrees(_independent_errors(est, 0, angle=True)), atol=1e-9)
    res = fig_residuals(ls)
    titles = [a.get_title() for a in res.axes]
    assert "imu/coupler gyr: measured − predicted from the estimate" in titles
    assert "imu/rocker gyr: normalised squared residual" in titles
    nr2_labels = [ln.get_label() for a in res.axes for ln in a.get_lines() if ln.get_label().startswith("rᵀR⁻¹r")]
    means = [float(lab.split("mean ")[1].rstrip(")")) for lab in nr2_labels]
    assert len(means) == 2 and all(0.5 < m < 2.0 for m in means)  # residuals consistent with 0.5 °/s gyros
    rates = fig_rates(ls)
    labels = {ln.get_label().split(" ")[0] for ln in rates.axes[0].get_lines()}
    assert labels == {"enc/crank", "enc/rocker", "imu/coupler", "imu/rocker", "truth/state", "est/state"}
    assert "imu/coupler (mean 100 Hz)" in [ln.get_label() for ln in rates.axes[0].get_lines()]
    status = fig_status(ls)
    assert status.axes[0].get_lines()[0].get_label() == f"ok: {ls.est_status.count('ok')}"
    # the estimates' quality below it, with counts, summarised on the page
    quality = {q: ls.est_quality.count(q) for q in ("ok", "inconsistent") if q in ls.est_quality}
    assert sum(quality.values()) == ls.est_t.size and status.axes[1].get_ylabel() == "quality"
    assert status.axes[1].get_lines()[0].get_label() == ", ".join(f"{k}: {v}" for k, v in quality.items())
    timing = fig_timing(ls)
    ax_l = timing.axes[1]
    assert ax_l.get_xlabel() == "latency (ms)" and sum(p.get_height() for p in ax_l.patches) == ls.est_t.size
    page, pngs = write_report(ls, tmp_path / "rep")
    html = page.read_text()
    # dofs, states (the default bias and time-offset estimates), residuals, rates, status, timing
    assert html.count("data:image/png;base64,") == len(pngs) == 6 and "states" in pngs
    assert all(p.read_bytes().startswith(b"\x89PNG") for p in pngs.values())
    assert "crank" in html and "truth" in html
    assert f"Quality: inconsistent on {quality.get('inconsistent', 0)} of {ls.est_t.size} estimates" in html


def test_a_log_without_quality_gets_the_status_figure_alone(fourbar) -> None:
    """Logs recorded before est/state carried ``quality``: one status track, no quality line."""
    from dataclasses import replace

    from estimator_service.analysis import quality_line

    ls = load_series(fourbar[1])
    old = replace(ls, est_quality=[""] * ls.est_t.size)
    assert len(fig_status(old).axes) == 1 and quality_line({**ls.accuracy.summary(), "quality": {}}) is None
    assert len(fig_status(ls).axes) == 2 and quality_line(ls.accuracy.summary()).startswith("inconsistent on ")


def test_report_on_a_raw_log_estimates_and_times_the_steps(fourbar, tmp_path: Path, capsys) -> None:
    raw, _ = fourbar
    assert main(["report", str(raw), "--backend", "ukf", "--out", str(tmp_path / "rep")]) == 0
    out = capsys.readouterr().out
    assert "from backend ukf" in out and "step time: p50" in out
    ls = load_series(raw, "ukf")
    assert ls.estimated_here and ls.step_seconds.size >= ls.est_t.size
    ax_h = fig_timing(ls).axes[0]
    assert ax_h.get_xlabel() == "processing time per 1 ms step (µs)"
    assert sum(p.get_height() for p in ax_h.patches) == ls.step_seconds.size
    assert {ln.get_label().split(" ")[0] for ln in ax_h.get_lines()} >= {"p50", "p99"}


def test_encoder_reference_when_the_log_has_no_truth(fourbar, tmp_path: Path, capsys) -> None:
    raw, _ = fourbar
    reader = read_log(raw)
    no_truth = tmp_path / "no-truth.log"
    with LogWriter(no_truth, reader.header) as w:
        for rec in reader:
            if rec.topic != "truth/state":
                w.write(rec.topic, rec.t_recv, rec.payload)
    est = tmp_path / "est.log"
    s = _estimate_json(no_truth, est, capsys)
    (crank,) = s["dofs"]
    assert crank["reference"] == "enc/crank"
    err = np.degrees(_independent_errors(est, 0, angle=True, reference="enc/crank"))
    assert crank["rmse"] == pytest.approx(float(np.sqrt(np.mean(err**2))), rel=1e-12)
    ls = load_series(est)
    assert fig_dofs(ls).axes[0].get_lines()[0].get_label() == "encoder crank (not fused)"


def test_any_mechanism_and_dof_names_with_units(tmp_path: Path, capsys) -> None:
    (tmp_path / "cart.yaml").write_text(CART_YAML)
    (tmp_path / "cart.toml").write_text(CART_TOML)
    raw = write_sim_log(tmp_path / "cart.log", tmp_path / "cart.toml", 1.5)
    est = tmp_path / "est.log"
    s = _estimate_json(raw, est, capsys)
    cart, swing = s["dofs"]
    assert (cart["name"], cart["unit"], swing["name"], swing["unit"]) == ("cart", "m", "swing", "°")
    e_cart = _independent_errors(est, 0, angle=False)
    e_swing = np.degrees(_independent_errors(est, 1, angle=True))
    assert cart["rmse"] == pytest.approx(float(np.sqrt(np.mean(e_cart**2))), rel=1e-12)
    assert swing["rmse"] == pytest.approx(float(np.sqrt(np.mean(e_swing**2))), rel=1e-12)
    assert cart["rmse"] < 0.02 and swing["rmse"] < 1.0
    fig = fig_dofs(load_series(est))
    assert [a.get_ylabel() for a in fig.axes] == ["cart (m)", "error (m)", "swing (°)", "error (°)"]
    assert main(["report", str(est), "--out", str(tmp_path / "rep")]) == 0
    assert "cart: RMSE" in capsys.readouterr().out


def test_report_errors_are_clear(tmp_path: Path, capsys) -> None:
    bad = tmp_path / "x.log"
    bad.write_bytes(b"not a log")
    assert main(["report", str(bad), "--out", str(tmp_path / "r")]) == 2
    assert "not a rigstate log" in capsys.readouterr().err


def test_covariance_and_further_states_are_drawn_with_1sigma_bands(fourbar, tmp_path: Path) -> None:
    """est/state with P_z and fields of newer backends (a bias map with its sigma) are drawn."""
    import msgpack

    _, est = fourbar
    reader = read_log(est)
    richer = tmp_path / "richer.log"
    with LogWriter(richer, reader.header) as w:
        for rec in reader:
            payload = rec.payload
            if rec.topic == "est/state":
                m = msgpack.unpackb(rec.payload)
                m["P_z"] = [1e-4, 0.0, 0.0, 4e-4]  # (2g)² = 4 values: var z = 1e-4 rad² → σ = 0.573°
                m["bias"] = {"coupler": [0.0, 0.004, 0.0]}
                m["bias_sigma"] = {"coupler": [0.001, 0.001, 0.001]}
                payload = msgpack.packb(m)
            w.write(rec.topic, rec.t_recv, payload)
    ls = load_series(richer)
    np.testing.assert_allclose(ls.est_sigma_z, 0.01)
    band = [c for c in fig_dofs(ls).axes[0].collections if c.get_label() == "estimate ± 1σ"]
    assert len(band) == 1
    # the bias map written here, the estimator's own rocker time offset and model parameter errors (default states)
    model = {f"model.{b}.{k}" for b in ("crank", "coupler", "rocker") for k in ("mass", "inertia")}
    assert set(ls.extras) == {"bias.coupler[0]", "bias.coupler[1]", "bias.coupler[2]", "time_offset_s.rocker"} | model
    states = fig_states(ls)
    assert [a.get_ylabel().split("\n")[0] for a in states.axes] == sorted(ls.extras)
    ax = states.axes[1]
    np.testing.assert_allclose(ax.get_lines()[0].get_ydata(), 0.004)
    assert [c.get_label() for c in ax.collections] == ["bias.coupler[1] ± 1σ"]
    page, pngs = write_report(ls, tmp_path / "rep")
    assert "states" in pngs and page.read_text().count("data:image/png;base64,") == 6


def test_estimate_summary_scores_only_its_own_estimates(fourbar, tmp_path: Path, capsys) -> None:
    """Estimating a log that already has est/state (e.g. a recorded live run) drops those by default;
    with --keep-estimates it copies them, but the summary scores only the new backend's estimates."""
    _, est = fourbar  # ekf estimates inside
    s = _estimate_json(est, tmp_path / "again.log", capsys, "ukf", "--keep-estimates")
    msgs = _messages(tmp_path / "again.log")["est/state"]
    assert {m["backend"] for _, m in msgs} == {"ekf", "ukf"}
    n_ukf = sum(1 for _, m in msgs if m["backend"] == "ukf")
    assert s["estimates"] == n_ukf == s["dofs"][0]["matched"] and s["backend"] == "ukf"
    dropped = _estimate_json(est, tmp_path / "fresh.log", capsys, "ukf")
    fresh = _messages(tmp_path / "fresh.log")["est/state"]
    assert {m["backend"] for _, m in fresh} == {"ukf"} and dropped["estimates"] == len(fresh) == n_ukf

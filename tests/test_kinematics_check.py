"""Kinematic validation (Sensors 2016 §5.1): a known gyro bias and a known in-plane mounting angle
simulated into a log are recovered from the encoders alone; smoothing differentiation and the
closed-form misalignment fit are checked against exact references."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from helpers import RIG, rig_text, write_sim_log
from estimator_service.cli import main
from estimator_service.kinematics_check import differentiate, fig_imu, fit_misalignment, validate_kinematics
from estimator_service.rig import load_rig

GYR_BIAS = [0.0, 0.005, -0.002]  # rad/s: 0.2865 °/s on the sensing channel (sensor y reads −ω)
MOUNT_DEG = 2.5


def _rig_text(mount: bool) -> str:
    """The public rig with lower gyro noise, optionally with the coupler IMU's bias and mounting angle."""
    text = rig_text(RIG, [("gyr_sigma_dps = 0.5", "gyr_sigma_dps = 0.1")])
    if mount:
        text = text.replace('point = "imu1"\naxes = ["+x", "-z", "+y"]',
                            f'point = "imu1"\naxes = ["+x", "-z", "+y"]\nmount_deg = {MOUNT_DEG}\n'
                            f'gyr_bias = {GYR_BIAS}\nacc_bias = [0.05, 0.0, -0.03]')
        assert "mount_deg" in text
    return text


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(log simulated with the biased, turned coupler IMU; the nominal rig TOML the lab believes in)."""
    d = tmp_path_factory.mktemp("kin")
    (d / "true.toml").write_text(_rig_text(True))
    (d / "nominal.toml").write_text(_rig_text(False))
    return write_sim_log(d / "sim.log", d / "true.toml", 5.0), d / "nominal.toml"


def test_mount_angle_turns_only_the_in_plane_accelerometer_axes(tmp_path: Path) -> None:
    (tmp_path / "a.toml").write_text(_rig_text(False))
    (tmp_path / "b.toml").write_text(_rig_text(True))
    a, b = load_rig(tmp_path / "a.toml").imus[0], load_rig(tmp_path / "b.toml").imus[0]
    c, s = math.cos(math.radians(MOUNT_DEG)), math.sin(math.radians(MOUNT_DEG))
    # body x now reads on sensor x with cos, sensor "body y" axis (sensor z here) with −sin
    np.testing.assert_allclose(b.sensor_axes[:, 0], c * a.sensor_axes[:, 0] - s * a.sensor_axes[:, 1], atol=1e-15)
    np.testing.assert_allclose(b.sensor_axes[:, 2], a.sensor_axes[:, 2], atol=1e-15)  # the gyro axis is unchanged
    assert abs(np.linalg.det(b.sensor_axes) - 1.0) < 1e-12


def test_known_gyro_bias_and_mounting_angle_are_recovered(logs: tuple[Path, Path], tmp_path: Path, capsys) -> None:
    log, nominal = logs
    res = validate_kinematics(log, nominal)
    coupler = next(c for c in res.checks if c.imu == "coupler")
    rocker = next(c for c in res.checks if c.imu == "rocker")
    true_bias_dps = np.degrees(GYR_BIAS)
    assert np.max(np.abs(np.array(coupler.gyr_bias_dps) - true_bias_dps)) < 0.02
    assert abs(coupler.acc_misalignment_deg - MOUNT_DEG) < 0.2
    np.testing.assert_allclose(coupler.acc_bias, [0.05, 0.0, -0.03], atol=0.02)
    # the untouched IMU: no bias, no misalignment
    assert np.max(np.abs(rocker.gyr_bias_dps)) < 0.02 and abs(rocker.acc_misalignment_deg) < 0.2
    # after the corrections the residuals are the sensor noise (0.05 m/s², 0.1 °/s)
    assert max(coupler.acc_rmse_corrected) < 0.07 and max(coupler.acc_rmse) > 0.2
    assert max(coupler.gyr_rmse_unbiased_dps) < 0.15
    # CLI: JSON and figures
    out = tmp_path / "out"
    assert main(["validate-kinematics", str(log), "--rig", str(nominal), "--out", str(out), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["imus"][0]["acc_misalignment_deg"] == pytest.approx(coupler.acc_misalignment_deg)
    assert {p.name for p in out.iterdir()} == {"dofs.png", "imu-coupler.png", "imu-rocker.png", "kinematics.json"}
    fig = fig_imu(res, res.series[0])
    gyr_ax = fig.axes[0]
    assert gyr_ax.get_ylabel() == "gyr[1] (°/s)"  # axes +x, -z, +y: sensor y senses body z
    assert [ln.get_label() for ln in gyr_ax.get_lines()] == ["measured", "predicted from encoders"]
    assert [a.get_ylabel() for a in fig.axes[3:6]] == ["error (°/s)", "error (m/s²)", "error (m/s²)"]
    assert f"in-plane misalignment {coupler.acc_misalignment_deg:+.3f}°" in fig.get_suptitle()


def test_the_log_header_rig_sees_no_misalignment(logs: tuple[Path, Path]) -> None:
    log, _ = logs
    res = validate_kinematics(log)  # the rig that simulated it knows the mounting angle and nothing else
    coupler = next(c for c in res.checks if c.imu == "coupler")
    assert abs(coupler.acc_misalignment_deg) < 0.2


def test_smoothing_differentiation_of_a_smooth_and_a_quantised_angle() -> None:
    t = np.arange(0.0, 4.0, 0.001)
    z = 1.0 + 0.8 * np.sin(2.1 * t)
    step = 2 * math.pi / 4096  # a 1024-line encoder
    zd, zdd = 0.8 * 2.1 * np.cos(2.1 * t), -0.8 * 2.1**2 * np.sin(2.1 * t)
    for signal, tol_zd, tol_zdd in ((z, 1e-6, 5e-3), (np.round(z / step) * step, 0.01, 0.3)):
        tr = differentiate(t, signal[:, None])
        np.testing.assert_allclose(tr.t, t, atol=1e-12)
        sel = (tr.t >= tr.valid[0]) & (tr.t <= tr.valid[1])
        assert tr.valid[0] - t[0] == pytest.approx(0.051) and t[-1] - tr.valid[1] == pytest.approx(0.051)
        assert np.sqrt(np.mean((tr.zd[sel, 0] - zd[sel]) ** 2)) < tol_zd  # rad/s
        assert np.sqrt(np.mean((tr.zdd[sel, 0] - zdd[sel]) ** 2)) < tol_zdd  # rad/s²


def test_misalignment_fit_is_exact_without_noise() -> None:
    rng = np.random.default_rng(4)
    A = np.array([[1.0, 0, 0], [0, 0, -1.0], [0, 1.0, 0]])  # axes +x, -z, +y (rows: sensor axes)
    A2, normal = A[:, :2], A[:, 2]
    p = rng.normal(size=(200, 2)) * 3.0 + [0.0, 9.81]
    alpha = math.radians(-1.7)
    c, s = math.cos(alpha), math.sin(alpha)
    bias = np.array([0.1, -0.2, 0.05])
    meas = (p @ np.array([[c, -s], [s, c]])) @ A2.T + bias  # rows: R(α)ᵀ p = R(−α) p
    got_alpha, got_bias, corrected = fit_misalignment(A2, normal, meas, p @ A2.T)
    assert got_alpha == pytest.approx(alpha, abs=1e-12)
    np.testing.assert_allclose(got_bias, bias, atol=1e-12)
    np.testing.assert_allclose(corrected, meas, atol=1e-12)


def test_bad_input_is_a_clear_error(tmp_path: Path, capsys) -> None:
    assert main(["validate-kinematics", str(tmp_path / "missing.log")]) == 2
    assert "cannot read" in capsys.readouterr().err
    rig = load_rig(RIG)
    assert rig.encoders  # the public rig has encoders; a window longer than the log is refused
    short = write_sim_log(tmp_path / "short.log", RIG, 0.05)
    assert main(["validate-kinematics", str(short), "--window", "0.2"]) == 2
    assert "shorter than the differentiation window" in capsys.readouterr().err

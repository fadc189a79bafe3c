"""rigstate calibrate: a simulated shaft with known axes (one sign flipped), mount, lever arm, time offset,
biases and noise is recovered within 3σ; the real pitch excerpt's normal axis, mount and delay; the
CLI's rig passes `config check`; a rest without encoders; bad input is exit 2."""

from __future__ import annotations

import math
import tomllib
from pathlib import Path

import numpy as np
import pytest

from estimator_service.calibrate import Calibration, calibrate
from estimator_service.calibrate_report import dumps_rig
from estimator_service.cli import main
from estimator_service.kinematics_check import read_messages
from estimator_service.paths import config_dir
from estimator_service.rig import load_rig
from estimator_service.sensors import axes_matrix, mount_axes

from helpers import write_sim_log

DATA = Path(__file__).parent / "data" / "real-shaft"
SHAFT = config_dir() / "mechanisms" / "shaft.yaml"
VERTICAL = config_dir() / "mechanisms" / "shaft-vertical-axis.yaml"

TRUE_IMU = """[[imu]]
name = "shaft"
body = "shaft"
axes = ["-x", "-z", "-y"]
mount_deg = 25.0
at = [0.05, 0.02]
gyr_sigma_dps = 2.0
acc_sigma = 0.1
gyr_bias = [0.01, -0.02, 0.015]
acc_bias = [0.1, -0.2, 0.05]
"""
ENCODER = """[[encoder]]
name = "shaft"
body = "shaft"
lines = 4096
rate_hz = 200
"""


def _rig(path: Path, mechanism: Path, body: str, sim: str = "") -> Path:
    path.write_text(f'[rig]\nname = "{path.stem}"\nmechanism = "{mechanism}"\n{body}\n{sim}')
    return path


def _equivalent_mount(calibrated_axes: list[str], true_axes: np.ndarray, true_mount: float) -> float:
    """The mount angle (rad) about ``calibrated_axes`` that gives the true sensor axes."""
    M = axes_matrix(calibrated_axes).T @ mount_axes(true_axes, true_mount)
    return math.atan2(M[0, 1], M[0, 0])


@pytest.fixture(scope="module")
def sim(shared) -> tuple[Path, Path, Path]:
    """(log, true rig, the rig as a user writes it) of a 1 m shaft swinging freely from 60°, 20 s: written once per
    session (conftest.shared), read only by the tests."""

    def make(d: Path) -> None:
        d.mkdir()
        mech = Path("shaft1m.yaml")  # beside the rigs (the folder is renamed when made)
        (d / mech).write_text(SHAFT.read_text().replace("  L: 0.1 ", "  L: 1.0 "))  # slow enough for the encoder's derivatives
        true = _rig(d / "true.toml", mech, TRUE_IMU + ENCODER,
                    "[simulation]\nseed = 3\n[simulation.initial]\nshaft_deg = 60\n[simulation.stamp_offset_s]\nshaft = 0.008\n")
        _rig(d / "user.toml", mech, '[[imu]]\nname = "shaft"\nbody = "shaft"\naxes = ["+x", "+z", "-y"]\n' + ENCODER)
        write_sim_log(d / "sim.log", true, 20.0)

    d = shared("calsim", make)
    return d / "sim.log", d / "true.toml", d / "user.toml"


@pytest.fixture(scope="module")
def sim_cal(sim: tuple[Path, Path, Path]) -> Calibration:
    log, _, user = sim
    rig, msgs = read_messages(log, user)
    return calibrate(rig, msgs)


def test_simulated_axes_sign_mount_offset_lever_biases_and_noise_within_3_sigma(sim, sim_cal: Calibration) -> None:
    true = load_rig(sim[1]).imus[0]
    c = sim_cal.imus[0]
    assert (c.normal, c.sign) == (1, -1)  # sensor y = -body z: the sign the user's rig has wrong
    assert c.axes != c.axes_before and axes_matrix(c.axes)[1, 2] == -1
    checks = [("mount", c.mount, [_equivalent_mount(c.axes, true.axes, true.mount)]),
              ("time offset", c.time_offset, [0.008]), ("lever arm", c.at, list(true.at)),
              ("gyr bias", c.gyr_bias, true.gyr.bias), ("acc bias", c.acc_bias, true.acc.bias),
              ("gyr noise", c.gyr_noise, true.gyr.sigma), ("acc noise", c.acc_noise, true.acc.sigma)]
    for name, est, truth in checks:
        assert est.found, name
        err = np.abs(est.value - np.asarray(truth))
        assert np.all(err <= 3 * est.sigma), (name, est.value, truth, est.sigma)
        assert np.all(est.sigma < 0.1 * np.maximum(np.abs(truth), 0.01)), (name, est.sigma)  # and informative
    assert c.use == ["gyr", "acc"]  # gravity turns in the plane
    (drive,) = sim_cal.drives
    assert not drive.driven and drive.loglik_model > drive.loglik_drive  # a free pendulum: its model explains it
    assert sim_cal.notes == []


def test_cli_writes_a_rig_that_config_check_accepts_and_loads_the_values(sim, sim_cal: Calibration, tmp_path: Path,
                                                                        capsys) -> None:
    log, _, user = sim
    out = tmp_path / "elsewhere" / "cal.toml"
    out.parent.mkdir()
    assert main(["calibrate", str(log), "--rig", str(user), "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "time offset  +7.9" in text or "time offset  +8.0" in text
    assert (tmp_path / "elsewhere" / "cal-figures" / "imu-shaft.png").stat().st_size > 10_000
    assert main(["config", "check", str(out)]) == 0
    text = out.read_text()
    assert text.startswith("# Calibrated by rigstate calibrate from ") and 'axes = ["-y", "-z", "+x"]\n' in text
    rig = load_rig(out)
    imu, c = rig.imus[0], sim_cal.imus[0]
    assert Path(rig.mechanism_path) == Path(load_rig(user).mechanism_path)
    assert np.array_equal(imu.axes, axes_matrix(c.axes))
    assert imu.mount == pytest.approx(c.mount.value[0], abs=1e-5)
    assert imu.mount_prior == pytest.approx(c.mount.sigma[0], abs=1e-5)  # the mount state's prior: the 1σ found
    assert imu.time_offset_s == pytest.approx(c.time_offset.value[0], abs=1e-6)
    assert imu.at == pytest.approx(tuple(c.at.value), abs=1e-5)
    assert np.allclose(imu.gyr_bias_cal, c.gyr_bias.value, atol=1e-6)
    assert list(imu.gyr_scale_cal) == [1.0, 1.0, 1.0]  # the slope is not written
    assert np.allclose(imu.acc_bias_cal, c.acc_bias.value, atol=1e-5)
    assert imu.gyr.sigma[0] == pytest.approx(max(c.gyr_sigma), rel=1e-4) and max(c.gyr_sigma) >= max(c.gyr_noise.value)
    assert imu.acc.sigma[0] == pytest.approx(max(c.acc_sigma), rel=1e-4) and max(c.acc_sigma) >= max(c.acc_noise.value)
    assert imu.use == ("gyr", "acc")
    assert rig.drives == ()  # not driven
    assert rig.encoders[0].sigma == pytest.approx(sim_cal.encoder_sigma["shaft"], rel=1e-3)


def test_real_pitch_excerpt_normal_axis_mount_and_delay(tmp_path: Path) -> None:
    log = tmp_path / "real.log"  # the source's export through the shipped map of its columns and units
    assert main(["log", "import", "--table", str(DATA / "pitch_slow" / "raw.csv"),
                 "--map", str(config_dir() / "maps" / "real-shaft.toml"), "--out", str(log)]) == 0
    # the README's pitch axes with the normal's sign wrong: the first mistake a user makes
    user = _rig(tmp_path / "pitch.toml", SHAFT, '[[imu]]\nname = "shaft"\nbody = "shaft"\naxes = ["+x", "-z", "+y"]\n'
                '[[encoder]]\nname = "shaft"\nbody = "shaft"\nlines = 9000\n')
    rig, msgs = read_messages(log, user)
    cal = calibrate(rig, msgs)
    c = cal.imus[0]
    assert (c.normal, c.sign) == (1, 1)  # sensor y along +body z
    # the mount about the README's axes ["+x", "+z", "-y"]: the sensor turned a quarter turn in the plane
    readme = _equivalent_mount(["+x", "+z", "-y"], axes_matrix(c.axes), float(c.mount.value[0]))
    assert 80 < math.degrees(readme) < 100 and c.mount.sigma[0] < math.radians(1)
    assert 0.005 < c.time_offset.value[0] < 0.02 and c.time_offset.sigma[0] < 0.003
    assert math.radians(5) < c.gyr_noise.value[1] < math.radians(25)  # the stepper's vibration
    assert c.use == ["gyr", "acc"]
    (drive,) = cal.drives
    assert drive.driven and 0.5 < drive.accel_density.value[0] < 50


def test_rest_without_encoders_gives_gyro_biases_and_noise(tmp_path: Path) -> None:
    true = _rig(tmp_path / "true.toml", SHAFT, TRUE_IMU, "[simulation.initial]\nshaft_deg = -90\n")  # hanging still
    log = write_sim_log(tmp_path / "rest.log", true, 5.0, seed=2)
    user = _rig(tmp_path / "user.toml", SHAFT, '[[imu]]\nname = "shaft"\nbody = "shaft"\n')
    rig, msgs = read_messages(log, user)
    cal = calibrate(rig, msgs)
    assert cal.source == "rest" and cal.drives == []
    c, t = cal.imus[0], load_rig(true).imus[0]
    assert np.all(np.abs(c.gyr_bias.value - t.gyr.bias) <= 3 * c.gyr_bias.sigma)
    assert np.all(np.abs(c.gyr_noise.value - t.gyr.sigma) <= 3 * c.gyr_noise.sigma)
    assert not (c.mount.found or c.time_offset.found or c.at.found)
    out = tmp_path / "cal.toml"
    assert main(["calibrate", str(log), "--rig", str(user), "--out", str(out)]) == 0
    assert main(["config", "check", str(out)]) == 0


def test_bad_input_is_exit_2_naming_what_is_wrong(sim, tmp_path: Path, capsys) -> None:
    log, _, user = sim
    out = str(tmp_path / "x.toml")
    cases = [(["--window", "12:3"], "--window 12:3: the window is empty"),
             (["--window", "100:200"], "no sensor message in it"),
             (["--window", "a:b"], "expected START:END")]
    for extra, msg in cases:
        assert main(["calibrate", str(log), "--rig", str(user), "--out", out, *extra]) == 2
        assert msg in capsys.readouterr().err
    bad_dof = _rig(tmp_path / "bad.toml", SHAFT, '[[imu]]\nname = "shaft"\nbody = "shaft"\n'
                   '[[drive]]\ndof = "crank"\n')
    assert main(["calibrate", str(log), "--rig", str(bad_dof), "--out", out]) == 2
    assert "drive[0].dof: unknown dof 'crank'" in capsys.readouterr().err
    # no encoder and never at rest: a shaft spinning about a vertical axis
    spin = _rig(tmp_path / "spin.toml", VERTICAL, TRUE_IMU, "[simulation.initial]\nshaft_rate = 2.0\n")
    spin_log = write_sim_log(tmp_path / "spin.log", spin, 3.0, seed=1)
    nothing = _rig(tmp_path / "none.toml", VERTICAL, '[[imu]]\nname = "shaft"\nbody = "shaft"\n')
    assert main(["calibrate", str(spin_log), "--rig", str(nothing), "--out", out]) == 2
    assert "no encoder readings and the rig never rests" in capsys.readouterr().err
    assert not Path(out).exists()


def test_the_rig_writer_round_trips_every_shipped_rig() -> None:
    rigs = sorted((config_dir() / "rigs").rglob("*.toml"))
    assert len(rigs) >= 5
    for path in rigs:
        doc = tomllib.loads(path.read_text())
        assert tomllib.loads(dumps_rig(doc)) == doc, path

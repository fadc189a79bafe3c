"""rigstate --version, config check and model check on a rig TOML: the entry point in the test process
(helpers.run_main), real files; what a process imports, in real processes."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

from estimator_service.rig import BACKENDS

from helpers import RIG, RIG_ACC, rig_text, run_main, subcommands, write_rig, write_rig_copy


def test_version_comes_from_the_package_metadata() -> None:
    out = run_main("--version")
    assert out.returncode == 0, out.stderr
    assert out.stdout == f"rigstate {importlib.metadata.version('rigstate')}\n"


def test_config_check_summarises_a_good_rig(tmp_path: Path) -> None:
    out = run_main("config", "check", str(RIG))
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"{RIG}: ok\n")
    assert "DOF crank (°)" in out.stdout and "imu/coupler (gyr, 100 Hz" in out.stdout
    assert f"parameters of {', '.join(BACKENDS)} valid" in out.stdout and "init mode pose" in out.stdout
    incline = run_main("config", "check", str(write_rig(tmp_path, "incline")))
    assert incline.returncode == 0, incline.stderr
    assert "DOF slide (m)" in incline.stdout


def _bad_rig(tmp_path: Path) -> Path:
    """The shipped rig with four independent mistakes, none in the selected backend (fgs)."""
    text = rig_text()
    text = text.replace('mode = "pose"', 'mode = "pose"\ncrank_dg = 3')  # typo in [estimator.init]
    text = text.replace('sim = "tcp://127.0.0.1:5599"', 'sim = "tcp://127.0.0.1:5600"')  # = the estimator's
    text += "\n[estimator.ukf]\nalpah = 0.5\n\n[estimator.ekf]\nsigma_z = -1\n"
    path = tmp_path / "bad.toml"
    path.write_text(text)
    return path


def test_config_check_lists_every_problem_with_file_field_and_value(tmp_path: Path) -> None:
    bad = _bad_rig(tmp_path)
    out = run_main("config", "check", str(bad))
    assert out.returncode == 2 and out.stdout == ""
    assert "Traceback" not in out.stderr
    lines = out.stderr.splitlines()
    assert f"rigstate: error: {bad}: estimator.init.crank_dg: unknown key for mode 'pose'" in out.stderr
    assert f"rigstate: error: {bad}: estimator.ukf.alpah: unknown key" in out.stderr
    assert f"rigstate: error: {bad}: estimator.ekf.sigma_z: must be >= 0, got -1" in out.stderr
    assert f"rigstate: error: {bad}: bus.estimator: 'tcp://127.0.0.1:5600' is also bus.sim" in out.stderr
    assert lines[-1] == f"{bad}: 4 problem(s)"
    # model check on the same rig TOML: the same check, not a YAML syntax error
    model = run_main("model", "check", str(bad))
    assert model.returncode == 2 and "YAML" not in model.stderr
    assert model.stderr == out.stderr


def test_config_check_names_the_mechanism_entry_of_a_typo(tmp_path: Path) -> None:
    mech = (RIG.parent.parent / "mechanisms" / "fourbar-sensors2016.yaml").read_text()
    for typo, field in (("fixed: true", "fixd: true"), ("mass:", "mas:")):
        (tmp_path / "m.yaml").write_text(mech.replace(typo, field, 1))
        rig = tmp_path / "r.toml"
        rig.write_text(RIG.read_text().replace("../mechanisms/fourbar-sensors2016.yaml", "m.yaml"))
        out = run_main("config", "check", str(rig))
        assert out.returncode == 2 and "Traceback" not in out.stderr
        key = field.split(":")[0]
        assert f"{tmp_path / 'm.yaml'}: " in out.stderr and f".{key}: unknown key; known:" in out.stderr


def test_config_check_init_and_an_unassemblable_pose(tmp_path: Path) -> None:
    text = rig_text()
    enc = tmp_path / "enc.toml"
    enc.write_text(text.replace('mode = "pose"', 'mode = "encoder"\nencoder = "crnak"')
                   .replace("crank_deg = 90.0\n", "").replace("crank_error_deg = 1.0", ""))
    out = run_main("config", "check", str(enc))
    assert out.returncode == 2
    assert f"{enc}: estimator.init.encoder: unknown encoder 'crnak'; encoders: ['crank', 'rocker']" in out.stderr


def test_model_check_describes_the_mechanism_of_a_good_rig() -> None:
    out = run_main("model", "check", str(RIG))
    assert out.returncode == 0, out.stderr
    assert f"{RIG}: ok" in out.stdout and "coordinates q (n = 8)" in out.stdout
    assert "degrees of freedom: 1 (crank)" in out.stdout


def test_the_command_table_names_every_subcommand_and_a_process_loads_only_its_own() -> None:
    """``COMMANDS`` is the whole command line; a driver or the recorder starts without numba, gtsam or scipy's
    signal processing (the estimator's and identification's imports), no process imports scipy.stats (~0.8 s of
    CPU at every start: estimator_service.tails has the quantiles), and ``--help`` still lists everything."""
    from estimator_service.cli import COMMANDS, build_parser, command_of

    assert set(subcommands(build_parser())) == set(COMMANDS)
    for name in COMMANDS:
        assert name in subcommands(build_parser(name))
    assert command_of(["--log-level", "WARNING", "driver", "sim"]) == "driver"
    assert command_of(["--log-level=DEBUG", "record", "--help"]) == "record"
    assert command_of(["--help"]) is None and command_of(["bogus"]) is None and command_of([]) is None
    probe = ("import sys; from estimator_service.cli import build_parser, command_of; "
             "build_parser(command_of(sys.argv[1:])); "
             "print(sorted(m for m in ('numba', 'gtsam', 'scipy.signal', 'scipy.stats') if m in sys.modules))")
    for argv in (["driver", "sim"], ["--log-level", "WARNING", "record"], ["replay"], ["keys"]):
        out = subprocess.run([sys.executable, "-c", probe, *argv], capture_output=True, text=True, check=True)
        assert out.stdout.strip() == "[]", (argv, out.stdout, out.stderr)
    for argv in (["estimator"], ["estimate"], ["demo"]):
        out = subprocess.run([sys.executable, "-c", probe, *argv], capture_output=True, text=True, check=True)
        assert "scipy.stats" not in out.stdout and out.stdout.startswith("["), (argv, out.stdout, out.stderr)
    listed = run_main("--help")
    assert listed.returncode == 0 and all(name in listed.stdout for name in COMMANDS)


def test_an_output_delay_the_window_cannot_hold_is_refused_with_its_limit(tmp_path: Path) -> None:
    """An update emits its chunk's steps ``output_delay_ms`` back; a step already out of the window was
    marginalised unseen (a delay of 19 ms at the default window of 20 ms and chunk of 10 steps emitted 4 000 of
    20 000 estimates).  The largest delay the window holds is accepted; one step more is refused, naming the field,
    the limit and the value."""
    text = rig_text()
    for delay, code in ((11, 0), (12, 2)):
        rig = tmp_path / f"delay{delay}.toml"
        rig.write_text(text.replace("[estimator.init]", f"[estimator.fgs]\noutput_delay_ms = {delay}\n\n[estimator.init]", 1))
        out = run_main("config", "check", str(rig))
        assert out.returncode == code, out.stderr
        if code:
            assert "Traceback" not in out.stderr
            assert (f"rigstate: error: {rig}: estimator.fgs.output_delay_ms: must be <= window_ms less chunk_steps - 1 "
                    "steps (11 ms with window_ms 20, chunk_steps 10, dt 1 ms), got 12") in out.stderr


def test_a_bad_mount_prior_or_simulated_mount_exits_2_naming_file_field_and_value(tmp_path: Path) -> None:
    """``[[imu]] mount_prior_deg`` beyond 45° (a wrong axes assignment, not a mount error) and a simulated mount of an
    IMU the rig does not have: exit 2, the file, the field and the value, no traceback."""
    for edit, message in (
            (("acc_sigma = 0.05", "acc_sigma = 0.05\nmount_prior_deg = 90", 1),
             "imu[0].mount_prior_deg: must be <= 45 deg (a larger error is a wrong axes assignment), got 90"),
            (("truth_rate_hz = 1000", "truth_rate_hz = 1000\n\n[simulation.mount_deg]\nelbow = 3.0"),
             "simulation.mount_deg.elbow: unknown key; known keys: ['coupler', 'rocker']")):
        rig = write_rig_copy(tmp_path / "bad.toml", RIG_ACC, [edit])
        out = run_main("config", "check", str(rig))
        assert out.returncode == 2 and "Traceback" not in out.stderr
        assert f"rigstate: error: {rig}: {message}" in out.stderr

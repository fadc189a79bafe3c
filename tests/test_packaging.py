"""Packaging: a built wheel carries the shipped configs and systemd units as package data, and the
installed package (not the source tree) runs the demo from another directory."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from helpers import ROOT

# slow; runs the demo: the estimator's kernels compiled before the tests start (conftest.py)
pytestmark = [pytest.mark.slow, pytest.mark.kernels()]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out), str(ROOT)],
                   check=True, capture_output=True, text=True)
    (whl,) = out.glob("rigstate-*.whl")
    return whl


def test_wheel_holds_every_shipped_config_and_unit(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = [p.relative_to(ROOT) for p in (ROOT / "config").rglob("*")
               if p.suffix in (".toml", ".yaml", ".md") or p.name.startswith("LICENSE")]  # with their licences
    shipped += [p.relative_to(ROOT) for p in (ROOT / "systemd").rglob("*")
                if p.suffix in (".service", ".target", ".env")]
    assert len(shipped) >= 10
    for rel in shipped:
        assert f"estimator_service/{rel.as_posix()}" in names, rel


def test_installed_wheel_runs_the_demo_from_another_directory(wheel: Path, tmp_path: Path) -> None:
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
                   check=True, capture_output=True, text=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    # the numpy reference path: this fresh copy of the package has no numba cache, and compiling the kernels
    # (~35 s idle, minutes beside the other test worker) is measured by hand, not inside a test's timeouts
    # (docs/performance.md); the kernels are tested in tests/test_kernels.py
    env = {**os.environ, "PYTHONPATH": str(site), "RIGSTATE_KERNELS": "numpy"}
    env.pop("RIGSTATE_CONFIG_DIR", None)
    where = subprocess.run(
        [sys.executable, "-c", "import estimator_service.paths as p; print(p.__file__); print(p.default_rig())"],
        cwd=elsewhere, env=env, check=True, capture_output=True, text=True).stdout.split()
    assert all(Path(w).is_relative_to(site) for w in where), where  # the installed copy, not the source tree
    assert Path(where[1]).is_file()
    demo = subprocess.run([sys.executable, "-m", "estimator_service.cli", "--log-level", "WARNING", "demo",
                           "--backend", "ekf", "--duration", "2"],
                          cwd=elsewhere, env=env, capture_output=True, text=True, timeout=240)
    assert demo.returncode == 0, demo.stderr[-2000:]
    assert "RMSE" in demo.stdout

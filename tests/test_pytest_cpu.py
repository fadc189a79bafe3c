"""tools/pytest_cpu.py, the plugin that says where the suite's CPU time goes (docs/performance.md)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from helpers import ROOT


def test_the_plugin_writes_each_tests_own_and_childrens_cpu(tmp_path: Path) -> None:
    """A test that burns CPU itself and one whose child process does: their lines name them and put the CPU in the
    right column; a SESSION line closes the run."""
    (tmp_path / "test_burn.py").write_text(
        "import subprocess, sys\n"
        "def spin():\n    import time\n    t = time.process_time()\n    while time.process_time() - t < 0.3: pass\n"
        "def test_own():\n    spin()\n"
        "def test_child():\n    subprocess.run([sys.executable, '-c', 'import time\\nt = time.process_time()\\n"
        "while time.process_time() - t < 0.3: pass'], check=True)\n")
    out = tmp_path / "cpu.tsv"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "tools"), "RIGSTATE_TEST_CPU": str(out)}
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "pytest_cpu", "-p", "no:cacheprovider",
                    "test_burn.py"], cwd=tmp_path, env=env, check=True, capture_output=True, timeout=120)
    rows = {line.split("\t")[3]: [float(v) for v in line.split("\t")[:3]] for line in out.read_text().splitlines()}
    own, child = rows["test_burn.py::test_own"], rows["test_burn.py::test_child"]
    assert own[0] >= 0.3 and own[1] < 0.1, own
    assert child[1] >= 0.3 and child[0] < 0.3, child
    assert rows["SESSION main"][0] >= 0.3 and rows["SESSION main"][1] >= 0.3

"""tools/compiled_floor.py (the filters' compiled floor, docs/performance.md): it records every compiled call a step
makes from Python and replays them; checked here for what it records, not for its times."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

# runs backends (or estimator subprocesses): their kernels compiled before the tests start (conftest.py)
pytestmark = pytest.mark.kernels()

TOOL = Path(__file__).resolve().parents[1] / "tools" / "compiled_floor.py"


@pytest.mark.parametrize("backend", ["ekf", "ukf"])
def test_the_floor_replays_every_step_of_the_run_with_its_compiled_calls(public_log, tmp_path: Path, backend: str) -> None:
    log = public_log(2.0)
    out = subprocess.run([sys.executable, str(TOOL), "--backends", backend, "--log", str(log), "--json",
                          str(tmp_path / "floor.json")], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    (r,) = json.loads((tmp_path / "floor.json").read_text())
    steps = r["steps"]
    assert steps == r["run_with_recording_us"]["n"] == r["replayed_step_us"]["n"] > 1900  # one per 1 ms
    each = r["replayed_entry_us"]
    # every step advances the mean in one compiled call (an update step's is inside its update kernel)
    assert each["advance_flat"]["n"] + each[f"{backend}_update_prepare"]["n"] >= steps - 1
    # the IMUs' 100 Hz samples: one prepared and one finished update each (two IMUs, one group), 2 s
    assert each[f"{backend}_update_finish"]["n"] == pytest.approx(200, abs=3)
    assert set(r["in_place_us"]) == set(each)
    assert all(v["warm"] > 0 and v["dispatch"] > 0 for v in r["in_place_us"].values())
    assert f"{backend}: {steps} steps" in out.stdout

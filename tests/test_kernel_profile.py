"""tools/kernel_profile.py (where a backend's compiled time goes, docs/performance.md): its map of the kernels' machine
code, the names it gives numba's symbols and how it sorts perf's samples.  The whole tool (perf sampling a child that
compiles every kernel from nothing) is not run here: it takes minutes of compiling."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


from helpers import ROOT

_spec = importlib.util.spec_from_file_location("kernel_profile", ROOT / "tools" / "kernel_profile.py")
kernel_profile = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(kernel_profile)

# symbols as numba writes them (copied from a perf report of the ekf)
DOT = "_ZN17estimator_service7kernels6linalg3dotB2v1B38c8tJTIeFIjxB2IKSgI4CrvQClQZ6FczSBAA_3dE5ArrayIdLi1E1C7mutable7alignedE"
WRAPPER = ("_ZN7cpython17estimator_service7kernels10transition12advance_flatB3v58B38c8tJTIeFIjxB2IKSgI4CrvQClQZ6FczSBAA_"
           "3dEdx5ArrayIdLi1E1C7mutable7alignedE")


def test_numba_symbols_read_as_the_kernels_dotted_names() -> None:
    assert kernel_profile.demangle(DOT) == "estimator_service.kernels.linalg.dot"
    assert kernel_profile.demangle(WRAPPER) == "cpython.estimator_service.kernels.transition.advance_flat"
    assert kernel_profile.demangle("NRT_incref") == "NRT_incref"
    assert kernel_profile.demangle("_PyEval_EvalFrameDefault") == "_PyEval_EvalFrameDefault"


def test_samples_are_sorted_by_the_kind_of_code_they_hit() -> None:
    report = f"""# Samples: 31K of event 'cpu-clock'
#
    26.06%  [JIT] tid 5533                              [.] NRT_decref
    25.50%  [JIT] tid 5533                              [.] NRT_incref
     5.01%  [JIT] tid 5533                              [.] {DOT}
     3.02%  [JIT] tid 5533                              [.] NRT_MemInfo_alloc_aligned
     2.71%  libc.so.6                                   [.] _int_free
     1.00%  [JIT] tid 5533                              [.] {WRAPPER}
     0.51%  _dispatcher.cpython-311-x86_64-linux-gnu.so  [.] TypeManager::_selectOverload
     4.44%  libpython3.11.so.1.0                        [.] _PyEval_EvalFrameDefault
     0.75%  [kernel.kallsyms]                           [k] clear_page_erms
     0.40%  _multiarray_umath.cpython-311-x86_64-linux-gnu.so  [.] PyArray_NewFromDescr_int
"""
    rows = kernel_profile.parse_report(report)
    assert len(rows) == 10
    out = kernel_profile.summarize(rows)
    assert out["categories"] == {"kernels": 5.01, "reference counting": 51.56, "allocation": 5.73, "dispatch": 1.51,
                                 "python": 4.44, "numpy": 0.4, "os": 0.75}
    assert out["kernels"] == {"linalg.dot": 5.01}


def _dot_in_a_fresh_process(cache: Path) -> dict:
    """A fresh process's perf map (its lines) and compile times after it called the dot kernel, with numba's cache in
    ``cache``."""
    code = ("import json, sys, numpy as np; sys.path.insert(0, sys.argv[1]); import kernel_profile; "
            "times = kernel_profile.listen_to_compiles(); "
            "from estimator_service.kernels import linalg; linalg.dot(np.ones(3), np.ones(3)); "
            "print(json.dumps({'map': kernel_profile.perf_map_lines(), 'compile': times.summary()}))")
    out = subprocess.run([sys.executable, "-c", code, str(ROOT / "tools")], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "NUMBA_CACHE_DIR": str(cache)})
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout)


def test_the_map_names_the_machine_code_of_kernels_compiled_in_the_process(tmp_path: Path) -> None:
    cold = _dot_in_a_fresh_process(tmp_path)
    assert cold["compile"]["compiles"] >= 1 and "linalg.dot" in cold["compile"]["own_s"]  # (its compile was heard)
    lines = [ln.split() for ln in cold["map"]]
    names = {kernel_profile.demangle(sym): (int(a, 16), int(s, 16)) for a, s, sym in lines}
    address, size = names["estimator_service.kernels.linalg.dot"]
    assert address > 0 and 0 < size <= 1 << 16
    assert "cpython.estimator_service.kernels.linalg.dot" in names  # (numba's wrapper of it for calls from Python)
    starts = sorted(a for a, _ in names.values())
    assert len(starts) == len(set(starts))  # one name per address
    # the same kernel loaded from numba's cache in the next process: machine code without a module, not in the map
    warm = _dot_in_a_fresh_process(tmp_path)
    assert not any("linalg" in line for line in warm["map"])


def test_compile_times_are_each_functions_own_and_add_up_to_the_wall_time() -> None:
    """Nested compiles (a kernel compiles the kernels it calls first): each one's own time excludes those inside it."""
    times = kernel_profile.CompileTimes()
    times.start("outer")
    times.start("inner")
    times.end()
    times.start("inner")
    times.end()
    times.end()
    assert times.count == {"outer": 1, "inner": 2}
    assert times.own["outer"] >= 0.0 and times.own["inner"] >= 0.0
    assert times.own["outer"] + times.own["inner"] == pytest.approx(times.wall, rel=1e-9, abs=1e-12)
    assert times.summary()["compiles"] == 3


def test_a_missing_log_is_a_clear_error() -> None:
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "kernel_profile.py"), "--log", "/nonexistent/run.log"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "/nonexistent/run.log" in out.stderr and "Traceback" not in out.stderr

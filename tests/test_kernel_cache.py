"""numba's cache of the kernels is keyed by all the kernels' sources (estimator_service/kernels/jit.py): a kernel whose
callee in another file was edited is compiled again, not loaded stale, and earlier sources' directories do not pile up.

The package under test is built the way estimator_service/kernels/ is: a copy of its jit.py and two files of kernels,
the caller in one and its callee in the other, each process a fresh Python with its own numba cache directory.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from estimator_service import kernels
from estimator_service.kernels import jit

#: the caller's file: a kernel that calls a kernel of the other file
CALLER = """
from kpkg.callee import bump
from kpkg.jit import kernel


@kernel
def twice_bumped(x):
    return 2.0 * bump(x)
"""

#: the callee's file, with the step it adds
CALLEE = """
from kpkg.jit import kernel


@kernel
def bump(x):
    return x + {step}
"""

#: a fresh process: the caller's result, whether it was loaded from numba's cache, and where that cache is
RUN = """
import json
from kpkg import jit
from kpkg.caller import twice_bumped

value = twice_bumped(1.0)
print(json.dumps({"value": value, "loaded": sum(twice_bumped.stats.cache_hits.values()), "dir": jit.cache_dir()}))
"""


def _run(root: Path, cache: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(root), "NUMBA_CACHE_DIR": str(cache)}
    out = subprocess.run([sys.executable, "-c", RUN], env=env, capture_output=True, text=True, timeout=300, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_an_edited_callee_in_another_file_is_compiled_again(tmp_path: Path) -> None:
    """Compiled and cached, loaded from the cache by the next process; the callee edited in its own file, the caller
    (whose file did not change) gives the new result in a new cache directory.  After more edits the cache keeps the
    current directory and :data:`~jit.KEEP_EARLIER` earlier ones."""
    root, cache = tmp_path / "src", tmp_path / "numba"
    pkg = root / "kpkg"
    pkg.mkdir(parents=True)
    shutil.copy(jit.__file__, pkg / "jit.py")
    (pkg / "__init__.py").write_text("")
    (pkg / "caller.py").write_text(CALLER)
    (pkg / "callee.py").write_text(CALLEE.format(step=1.0))

    first, again = _run(root, cache), _run(root, cache)
    assert first["value"] == 4.0 and first["loaded"] == 0
    assert again["value"] == 4.0 and again["loaded"] == 1 and again["dir"] == first["dir"]  # the cache is used
    assert Path(first["dir"]).is_relative_to(cache) and Path(first["dir"]).name.startswith("sources-")

    (pkg / "callee.py").write_text(CALLEE.format(step=2.0))  # the caller's file is as it was
    edited = _run(root, cache)
    assert edited["value"] == 6.0 and edited["loaded"] == 0 and edited["dir"] != first["dir"]

    for step in (3.0, 4.0, 5.0):
        (pkg / "callee.py").write_text(CALLEE.format(step=step))
        last = _run(root, cache)
        assert last["value"] == 2.0 * (1.0 + step)
    kept = sorted(p.name for p in Path(last["dir"]).parent.iterdir())
    assert Path(last["dir"]).name in kept and len(kept) == 1 + jit.KEEP_EARLIER
    assert Path(first["dir"]).name not in kept and Path(edited["dir"]).name not in kept  # the oldest ones deleted


def test_the_packages_kernels_are_cached_by_their_sources() -> None:
    """The project's kernels are cached in the directory named by the hash of their sources, and the modules without
    compiled code, which that hash leaves out, hold no kernel."""
    assert kernels.cache_dir() is not None and Path(kernels.cache_dir()).name == jit.SOURCES_DIR
    if os.environ.get("NUMBA_CACHE_DIR"):
        assert Path(kernels.cache_dir()).is_relative_to(os.environ["NUMBA_CACHE_DIR"])
    homes = {f.py_func.__module__.rpartition(".")[2] + ".py" for f in kernels.compiled_functions().values()}
    assert homes and not homes & set(jit.PYTHON_ONLY)

"""numba for the kernels: whether it is on, the two decorators every kernel module uses, and its cache.

- :func:`enabled`, :data:`ENV_SWITCH`, :func:`reference_path`: ``RIGSTATE_KERNELS=numpy`` (or numba missing) keeps the
  numpy reference path everywhere.
- :func:`kernel` compiles a kernel with numba's on-disk cache (``@njit(cache=True)``); :func:`runtime_value` passes a constant as a
  run-time value.
- The cache.  numba keys a function's cache entry by its own file alone (a hash of its content): a kernel whose callee
  in another file of this package was edited would load its stale machine code.  So every kernel of the package is
  cached in one directory named by a hash of all the sources its compiled code is made of (:func:`sources_hash`):
  ``sources-<hash>`` in numba's usual place for the package's files (``$NUMBA_CACHE_DIR/kernels_<hash of the path>``
  when that is set, else ``__pycache__`` beside these files, else the user's cache directory; :func:`cache_dir`).  An
  edit of any of them starts a new directory; of the earlier ones the :data:`KEEP_EARLIER` most recently written are
  kept (a process of an earlier version may still be loading from one) and the rest deleted, once per process, when
  the first kernel is defined.  Modules without compiled code (:data:`PYTHON_ONLY`) are left out of the hash: editing
  them does not recompile.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import sys
from pathlib import Path

from estimator_service import angles
from estimator_service.angles import wrap_angle
from estimator_service.model import CONTINUATION_STEP

#: environment switch: ``numpy`` keeps the reference implementation
ENV_SWITCH = "RIGSTATE_KERNELS"

try:
    from numba import njit, types
    from numba.core import caching
    from numba.core.registry import CPUDispatcher
    from numba.extending import intrinsic, register_jitable
except ImportError:  # pragma: no cover - numba is a dependency; the reference path still works without it
    njit = None
else:
    register_jitable(wrap_angle)  # (the compiled code's angle wrap is the project's one rule)


def enabled() -> bool:
    """True when numba is importable and ``RIGSTATE_KERNELS`` is not ``numpy``."""
    return njit is not None and os.environ.get(ENV_SWITCH, "numba").strip().lower() != "numpy"


@contextlib.contextmanager
def reference_path():
    """Within this block, models compiled by :func:`compile_model` keep the numpy reference
    (``rigstate bench --reference`` runs both paths side by side in one process)."""
    old = os.environ.get(ENV_SWITCH)
    os.environ[ENV_SWITCH] = "numpy"
    try:
        yield
    finally:
        if old is None:
            del os.environ[ENV_SWITCH]
        else:
            os.environ[ENV_SWITCH] = old


#: the directory of this package
PACKAGE_DIR = Path(__file__).resolve().parent
#: the package's modules that hold no compiled code: left out of :func:`sources_hash`
PYTHON_ONLY = ("__init__.py", "model_kernels.py", "warmup.py")
#: directories of earlier sources kept beside the current one (:func:`_prune`)
KEEP_EARLIER = 2


def sources_hash() -> str:
    """16 hex digits of the SHA-256 of what the compiled code is made of: every module of this package but
    :data:`PYTHON_ONLY`, the angle wrap's module (estimator_service/angles.py, compiled in) and the one constant the
    kernels take from elsewhere (model.CONTINUATION_STEP, frozen into the machine code)."""
    h = hashlib.sha256()
    for path in [*sorted(p for p in PACKAGE_DIR.glob("*.py") if p.name not in PYTHON_ONLY), Path(angles.__file__)]:
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    h.update(repr(CONTINUATION_STEP).encode())
    return h.hexdigest()[:16]


#: the name of this source's cache directory (in numba's usual place for the package's files)
SOURCES_DIR = f"sources-{sources_hash()}"
#: where this process's kernels are cached (:func:`cache_dir`), once the first one is defined
_cache_dirs: set[str] = set()


def cache_dir() -> str | None:
    """The directory numba's cache of this package's kernels is in for these sources and this process's
    ``$NUMBA_CACHE_DIR`` (``…/sources-<hash>``), or None when nothing can be cached (numba missing, no writable
    place)."""
    return next(iter(_cache_dirs), None)


def _prune(base: str) -> None:
    """Delete the directories of earlier sources in ``base`` but the :data:`KEEP_EARLIER` most recently written."""
    stamped = []
    with contextlib.suppress(OSError):
        for entry in os.scandir(base):
            if entry.name.startswith("sources-") and entry.name != SOURCES_DIR and entry.is_dir(follow_symlinks=False):
                with contextlib.suppress(OSError):  # (gone meanwhile: another process pruned it)
                    stamped.append((entry.stat(follow_symlinks=False).st_mtime, entry.path))
    for _, path in sorted(stamped, reverse=True)[KEEP_EARLIER:]:
        shutil.rmtree(path, ignore_errors=True)


def compiled_functions() -> dict:
    """Every compiled kernel of the package by name (numba dispatchers, each from the module that defines it), for
    the tests and tools that count their signatures."""
    prefix = __name__.rpartition(".")[0] + "."
    return {name: f for mod_name, mod in list(sys.modules.items()) if mod_name.startswith(prefix)
            for name, f in vars(mod).items() if isinstance(f, CPUDispatcher) and f.py_func.__module__ == mod_name}


def kernel(fn):
    return njit(cache=True)(fn) if njit is not None else fn


def inlined(fn):
    """A kernel whose body numba inlines into each kernel that calls it (``inline="always"``), for a kernel with few
    callers that itself calls large ones: compiled on its own only when Python calls it.  A kernel called from
    another is otherwise compiled as its own unit, with every kernel it calls linked in and optimised again, and
    then once more inside each caller: a chain of thin wrappers over the integrator's stages compiles the stages once
    per wrapper (see docs/performance.md, the compile).  numba inlines a call of at most 30 arguments (a longer one
    is made with ``*args``, which its inliner refuses)."""
    return njit(cache=True, inline="always")(fn) if njit is not None else fn


if njit is not None:

    class _SourcesLocator(caching._CacheLocator):
        """numba's cache locator for the functions of this package's files: the first of numba's own locators that
        takes the file (:data:`_NUMBA_LOCATORS`), its directory extended by :data:`SOURCES_DIR`.  Registered first in
        numba's list; it takes no other file."""

        def __init__(self, inner: caching._CacheLocator) -> None:
            self._inner = inner
            self._path = os.path.join(inner.get_cache_path(), SOURCES_DIR)

        def get_cache_path(self) -> str:
            return self._path

        def get_source_stamp(self):
            return self._inner.get_source_stamp()

        def get_disambiguator(self) -> str:
            return self._inner.get_disambiguator()

        @classmethod
        def from_function(cls, py_func, py_file: str):
            if Path(py_file).resolve().parent != PACKAGE_DIR:
                return None
            for numbas in _NUMBA_LOCATORS:
                inner = numbas.from_function(py_func, py_file)
                if inner is None:
                    continue
                self = cls(inner)
                try:
                    self.ensure_cache_path()
                except OSError:  # (not writable: the next of numba's places)
                    continue
                if self._path not in _cache_dirs:  # (once per process)
                    _cache_dirs.add(self._path)
                    _prune(inner.get_cache_path())
                return self
            return None

    #: numba's list of cache locators, tried in order (``_CacheImpl`` before numba 0.61)
    _LOCATORS = getattr(caching, "CacheImpl", None) or caching._CacheImpl
    #: numba's own locators, in numba's order
    _NUMBA_LOCATORS = tuple(_LOCATORS._locator_classes)
    _LOCATORS._locator_classes.insert(0, _SourcesLocator)

    @intrinsic
    def runtime_value(typingctx, v):
        """v as a run-time value in compiled code.  numba types a constant argument (``True``, ``0``) as a literal
        and compiles the callee again for each one: the manifold point was compiled five times (~600 KB each in
        numba's cache), the integrator's stages three times, their transitions four.  A flag passed through ``runtime_value``
        shares the callee's one specialization with every other caller, Python's included."""
        def codegen(context, builder, signature, args):
            return context.cast(builder, args[0], signature.args[0], signature.return_type)

        return types.unliteral(v)(v), codegen
else:  # pragma: no cover - without numba there is nothing to specialise

    def runtime_value(v):
        return v

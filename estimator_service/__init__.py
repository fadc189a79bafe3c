"""rigstate estimator service: multibody model, estimation backends, bus, daemon and logs."""

import gc
import os

__version__ = "0.1.0"

#: one BLAS/OpenMP thread per process unless the environment says otherwise (set here, before numpy loads
#: OpenBLAS): the estimators' matrices are small, and OpenBLAS's second thread spinning on a busy 2-core
#: machine made one 81×81 inverse take 23 ms instead of 0.2 ms (measured); pool workers inherit it
SINGLE_THREAD_ENV = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
for _name in SINGLE_THREAD_ENV:
    os.environ.setdefault(_name, "1")


def freeze_heap() -> int:
    """Collect once, then move every object alive now out of the cyclic garbage collector's reach
    (``gc.freeze``): the modules, the compiled kernels and the model a long run starts with.  Without
    it, each full collection walks them all: 64–67 ms inside one 1 ms step of the ekf on the public
    scenario (measured), a stall of the live loop every few tens of seconds.  Reference counting still
    frees them.  Call once per process, after start-up (the daemon, the benchmark's timed runs).
    Returns the number of objects frozen so far (est/diag ``gc_frozen``)."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()

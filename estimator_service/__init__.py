"""rigstate estimator service: multibody model, estimation backends, bus, daemon and logs."""

import os

__version__ = "0.1.0"

#: one BLAS/OpenMP thread per process unless the environment says otherwise (set here, before numpy loads
#: OpenBLAS): the estimators' matrices are small, and OpenBLAS's second thread spinning on a busy 2-core
#: machine made one 81×81 inverse take 23 ms instead of 0.2 ms (measured); pool workers inherit it
SINGLE_THREAD_ENV = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
for _name in SINGLE_THREAD_ENV:
    os.environ.setdefault(_name, "1")

"""Compiled kernels of the estimators' hot path (numba), over the model's own arrays.

The EKF, UKF and error-state EKF spend most of a step finding the point of the constraint manifold at a state (z, ż):
the position problem Φ(q) = 0 with q[dof] = z (Newton from a second-order predictor), then the R-matrix dynamics
q̇ = R ż, z̈ = (RᵀMR)⁻¹ Rᵀ(Q − M Jm γ), q̈ = R z̈ + Jm γ.  In numpy that is some fifty small calls (~90–140 µs on the
development machine); the compiled point does it in one call (~15 µs).  The smoother's per-step dynamics factor
(forward dynamics with its Jacobians, integrator and constraint rows) and the filters' state Jacobians, transitions,
measurement model and update algebra are compiled likewise.  docs/performance.md lists the figures.

The modules, each beside its numpy reference (named in its docstring), in the order they build on each other:

- ``jit.py``: numba on or off (:func:`enabled`, :func:`reference_path`), the decorators, the cache keyed by the
  kernels' sources;
- ``linalg.py``: small dense linear algebra as loops (products, elimination, Cholesky);
- ``manifold.py``: the constraint rows, the position problem and the manifold point (:func:`~.manifold.point`);
- ``dynamics.py``: the forward dynamics with its Jacobians, a filter state's forces and ∂q̈/∂x;
- ``transition.py``: the integrator's stages, the filters' transitions and the mean's step over buffers;
- ``measurement.py``: :class:`SensorTable` and every sensor's readings with H;
- ``kalman.py``: the EKF's and UKF's update algebra, NIS and gate, numpy functions with their compiled loop twins;
- ``fused_update.py``: an update of a group of sensors in two compiled calls;
- ``smoother.py``: the smoothers' dynamics rows and the independent smoother's model;
- ``model_kernels.py``: :class:`ModelKernels`, a model's arrays and the entries Python calls (no compiled code);
- ``warmup.py``: :func:`compile_model` and the warm-up at a backend's start (no compiled code).

The numpy code stays the reference path: ``RIGSTATE_KERNELS=numpy`` (or numba missing) keeps it, and
tests/test_kernels.py checks every kernel against it on every shipped mechanism.

Compilation: the first use compiles (about a minute for the ekf's kernels on an idle 2-core machine, half that for
the smoother's: docs/performance.md) and writes numba's cache (jit.py says where); later processes load it (~0.5 s).
:func:`compile_model` compiles the kernels of the kind a backend uses (its ``kernel_kind``: :data:`KINDS`) at its
construction, never inside a step.  This module holds no code: it gathers the names the rest of the project uses.
"""

from estimator_service.kernels.jit import ENV_SWITCH, cache_dir, compiled_functions, enabled, reference_path
from estimator_service.kernels.kalman import (ERROR_MODEL_CODES, block_nis, compiled_or_python, ekf_correct, ekf_innovation_cov,
                                              gate_stats, interval_jacobian, ukf_correct, ukf_covariance,
                                              ukf_innovation, ukf_sigma_points)
from estimator_service.kernels.measurement import (ACCELEROMETER, COMMAND_POSITION, COMMAND_VELOCITY, ENCODER, GYRO,
                                                   INCLINATION, NOT_COMPILED, SensorTable, sparse_forms)
from estimator_service.kernels.model_kernels import ModelKernels, contiguous
from estimator_service.kernels.transition import ADVANCE_FAILED, INTEGRATOR_CODES
from estimator_service.kernels.warmup import (COLD_START_TIMEOUT_S, KINDS, cache_is_cold, compile_model,
                                              warm_transition_jacobian)

__all__ = ["ACCELEROMETER", "ADVANCE_FAILED", "COLD_START_TIMEOUT_S", "COMMAND_POSITION", "COMMAND_VELOCITY",
           "ENCODER", "ENV_SWITCH", "ERROR_MODEL_CODES", "GYRO", "INCLINATION", "INTEGRATOR_CODES", "KINDS", "NOT_COMPILED", "ModelKernels",
           "SensorTable", "block_nis", "cache_dir", "cache_is_cold", "compile_model", "compiled_functions",
           "compiled_or_python", "contiguous", "ekf_correct", "ekf_innovation_cov", "enabled", "gate_stats",
           "interval_jacobian", "reference_path", "sparse_forms", "ukf_correct", "ukf_covariance", "ukf_innovation",
           "ukf_sigma_points", "warm_transition_jacobian"]

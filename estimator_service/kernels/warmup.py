"""What a backend compiles at its start: :func:`compile_model` of a kind (:data:`KINDS`), the warm-up calls, the
helper process of a cold compile, and whether the cache is cold.

Each kernel a backend's steps call is called once at its construction (:func:`warm_up`): compiled there or loaded from
numba's cache (~0.5 s), never inside a step.  On a cold cache and when the process may use more than one CPU
(:func:`usable_cpus`), the filters' and the independent smoother's kernels compile in two processes
(:func:`warm_in_helper`, started as ``python -c "from estimator_service.kernels.warmup import warm_in_helper; …"``):
a helper compiles the state Jacobians, the measurement model and the update algebra while this process compiles
the manifold point, which most kernels contain; for a filter a second helper then compiles the update's second
call while this process compiles the transitions.  No compiled code in this module.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
from types import SimpleNamespace

import numpy as np

from estimator_service.kernels.jit import enabled
from estimator_service.kernels.manifold import point_full, position
from estimator_service.kernels.transition import INTEGRATOR_CODES
from estimator_service.kernels.fused_update import ekf_update_prepare, ukf_update_prepare
from estimator_service.kernels.measurement import GYRO, SensorTable
from estimator_service.kernels.kalman import (block_nis_compact, ekf_correct_compact, ekf_innovation_cov_compact,
                                              gate_stats_compact, interval_jacobian_compact, ukf_correct_compact,
                                              ukf_covariance_compact, ukf_innovation_compact,
                                              ukf_sigma_points_compact)
from estimator_service.kernels.smoother import smoother_point, smoother_step_rows
from estimator_service.kernels.model_kernels import ModelKernels


log = logging.getLogger(__name__)

#: how long a process may take to its first output on a cold compile cache (s): compiling a backend's kernels
#: takes 35–100 s on an idle 2-core machine (docs/performance.md, "The cold start") and much longer on a loaded
#: one (the systemd unit's TimeoutStartSec matches)
COLD_START_TIMEOUT_S = 300.0

#: the filters' kinds (:data:`KINDS`): the manifold point, state Jacobians, measurement model and transitions, with
#: the EKF's update (the error-state EKF's too) or the UKF's
FILTER_KINDS = ("ekf", "ukf")

#: the position solver's settings in the warm-up's calls: (tolerance, quadratic residual, max Newton steps)
_SOLVER = (1e-10, 1e-7, 6)


def _warm_up_table(k: ModelKernels) -> SensorTable:
    """A table of one gyro that reads nothing (zero rate form), for :func:`warm_up`: the measurement kernels'
    argument types."""
    table = SensorTable.empty(1, k.model.ne, k.model.gravity)
    table.kind[0], table.dims[0] = GYRO, 3
    return table


def usable_cpus() -> int:
    """How many CPUs this process may run on: its affinity (``taskset``, systemd's ``CPUAffinity=``), not the machine's
    count; the machine's where affinity is not known (not Linux)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def _start_helper(kind: str, stage: int = 1) -> subprocess.Popen | None:
    """A process compiling its part of ``kind`` into numba's cache (:func:`warm_in_helper`: stage 1 while this one
    compiles the point, stage 2 of a filter while this one compiles the transitions), or None: no part to hand
    over, one usable CPU (:func:`usable_cpus`: two processes pinned to one CPU take turns, no faster than one), or the
    cache holds its kernels already (then loading them takes ~0.5 s: a helper would only cost its start-up)."""
    if kind not in HELPED_KINDS or usable_cpus() < 2 or not cache_is_cold(HELPED_KINDS[kind]):
        return None
    try:
        return subprocess.Popen([sys.executable, "-c", f"from estimator_service.kernels.warmup import warm_in_helper; "
                                 f"warm_in_helper({kind!r}, {stage})"], stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL)
    except OSError as exc:  # (compiled here instead)
        log.info("no helper process for the cold compile (%s)", exc)
        return None


def warm_helper_part(k: ModelKernels, kind: str) -> None:
    """The helper's part of a cold compile of ``kind`` (:data:`HELPED_KINDS`; argument types only: any model's
    kernels compile the same code), none of it inside the manifold point: the state Jacobians and the measurement
    model, which the independent smoother's point kernel and its sample factors call; for a filter also its update
    algebra."""
    model = k.model
    n, g, m = model.n, model.g, model.m
    q = np.ascontiguousarray(model.q0, dtype=np.float64)
    qd, R, Jm = np.zeros(n), np.zeros((n, g)), np.zeros((n, m))
    xf = np.concatenate([q[model.dof], np.zeros(3 * g + 1)])  # [z, ż, c, b, p], as warm_up's
    ids, table = np.zeros(1, np.int64), _warm_up_table(k)
    k.filter_jacobians(xf, (q, qd, R, Jm), True, np.zeros((n, 0)), 4 * g)  # (the smoother's G has one column: same type)
    for jac in (None, (R, R, np.zeros((n, xf.size)))):
        k.measure_sensors(ids, q, qd, qd, xf[4 * g :], table, jac, 4 * g)
    if kind in FILTER_KINDS:
        _warm_update_algebra(xf, ids, kind)


def _warm_point(k: ModelKernels, kind: str) -> None:
    """The manifold point of ``kind`` (its longest kernel, inside most others), compiled while the helper compiles
    its part: a filter's (``point``, as :func:`_warm_all` calls it first) or the independent smoother's."""
    model = k.model
    q = np.ascontiguousarray(model.q0, dtype=np.float64)
    z, zd, e2 = q[model.dof].copy(), np.zeros(model.g), np.zeros((0, 0))
    if kind in FILTER_KINDS:
        k.point(z, zd, None, None, None, None, None, q, *_SOLVER)
    else:
        point_full(z, zd, np.zeros(model.n), False, z, q, e2, e2, q, *_SOLVER, k.qe0, k.H, k.B, k.c, k.Hq,
                    k.ang, k.angL, k.dof, k.M, k.Qg, k.DA, k.Dc)


def _warm_update_algebra(xf: np.ndarray, ids: np.ndarray, kind: str) -> tuple:
    """The update algebra in loop form (compiled_or_python's _TWINS) of the filter ``kind`` at a filter state ``xf``
    with one reading: the NIS, the EKF's innovation covariance and correction (every filter's reference path), and
    the EKF's interval Jacobian or the UKF's sigma-point algebra.  Returns (P, e, the UKF's weights or None) for the
    update kernels' warm-up."""
    P, Hm, e = np.eye(xf.size), np.ones((1, xf.size)), np.ones(1)
    PHt, S = ekf_innovation_cov_compact(P, Hm, e)
    block_nis_compact(e, S, ids + 1)
    ekf_correct_compact(xf, P, Hm, PHt, S, e, e, ids)
    if kind == "ekf":
        interval_jacobian_compact(P, P, 1e-3, INTEGRATOR_CODES["heun"])
        return P, e, None
    X, _ = ukf_sigma_points_compact(xf, P, 1.0)
    w = np.full(X.shape[0], 1.0 / X.shape[0])
    ukf_covariance_compact(X, w, w)
    Y = X[:, :1].copy()
    _, dY, S1, e1 = ukf_innovation_compact(Y, w, w, np.zeros(1, np.bool_), e, e)
    ukf_correct_compact(X, xf, P, w, dY, S1, e1, ids)
    return P, e, w


def warm_up(k: ModelKernels, kind: str) -> None:
    """Call the kernels of ``kind`` (:data:`KINDS`) once at the initial configuration: compiled (or
    loaded from numba's cache) here, at start-up, never inside a time step; on a cold cache with a helper
    process (:func:`_start_helper`).  Once per :class:`ModelKernels` (compile_model makes one per backend)."""
    helpers = [h for h in (_start_helper(kind),) if h is not None]
    try:
        if helpers:  # the point here meanwhile; the rest then loads the helper's part
            _warm_point(k, kind)
            _join_helper(helpers[0])
            second = _start_helper(kind, 2) if kind in FILTER_KINDS else None
            if second is not None:  # the transitions here meanwhile, the update's second call there
                helpers.append(second)
                if (a := _filter_args(k)) is not None:
                    _warm_transitions(k, a)
                _join_helper(second)
        _warm_all(k, kind)
    finally:
        for helper in helpers:  # (ended by now, unless this process was interrupted or the helper overran)
            helper.kill()
            helper.wait()


def _warm_all(k: ModelKernels, kind: str) -> None:
    """:func:`warm_up`'s calls (each compiles, or loads what numba's cache holds)."""
    if kind in FILTER_KINDS:
        _warm_filter(k, kind)
    elif kind == "manifold":
        _warm_independent_smoother(k)
    else:
        _warm_smoother(k)


def _finish_args(ids: np.ndarray) -> tuple:
    """(y, angle rows, variances, rows per sensor, gate) of a fused update's finish in the warm-up."""
    return np.zeros(3), np.zeros(3, np.bool_), np.ones(3), ids + 3, 30.0


def _filter_args(k: ModelKernels) -> SimpleNamespace | None:
    """The warm-up's filter state at the model's initial configuration and its point (compiled or loaded here), or
    None when the point is not found there: x = [z, ż, c, b, p] with one parameter, no parameter forces, one gyro."""
    model = k.model
    g, n = model.g, model.n
    q = np.ascontiguousarray(model.q0, dtype=np.float64)
    z, zd, qd = q[model.dof].copy(), np.zeros(g), np.zeros(n)
    status, q1, _, _, _, R, Jm, _ = k.point(z, zd, None, None, None, None, None, q, *_SOLVER)
    if status != 0:
        return None
    start = SimpleNamespace(z=z, q=q1, qd=qd, qdd=qd, zdd=np.zeros(g), R=R, Jm=Jm, residual=0.0)
    return SimpleNamespace(g=g, n=n, z=z, q1=q1, qd=qd, R=R, Jm=Jm, xf=np.concatenate([z, zd, np.zeros(2 * g + 1)]),
                           G=np.zeros((n, 0)), ids=np.zeros(1, np.int64), table=_warm_up_table(k), start=start,
                           ref=(z, q1, qd, R, Jm, np.zeros(g)), pt=k.point_buffer(start))


def _warm_transitions(k: ModelKernels, a: SimpleNamespace) -> None:
    """The mean's transition (:func:`_filter_args`' state ``a``); the transition with its Jacobian only when a
    backend asks for it (:func:`warm_transition_jacobian`)."""
    g, n = a.g, a.n
    k.advance_flat(a.xf, 1e-3, INTEGRATOR_CODES["heun"], True, a.G, 4 * g, a.start, (a.G, np.zeros((n, 0, n))),
                   *_SOLVER)


def warm_transition_jacobian(k: ModelKernels) -> None:
    """Compile (or load) the filter transition with its Jacobian (``ModelKernels.filter_transition``), which only the
    EKF's covariance with RK4 calls (ManifoldDynamics.transition_jacobian): that backend calls this at its
    construction, after :func:`compile_model`; no kind compiles it, a heun or euler EKF does not need it."""
    a = _filter_args(k)
    if a is not None:
        k.filter_transition(a.xf, 1e-3, INTEGRATOR_CODES["heun"], True, a.G, 4 * a.g, a.ref, True, True, *_SOLVER)


def _warm_update_finish(k: ModelKernels, kind: str, a: SimpleNamespace) -> None:
    """The second call of a fused update of the filter ``kind`` (and for the UKF its sigma points' readings), from a
    prepared part of the types the first call returns: compiled by a cold start's second helper
    (:func:`warm_up`) while the process compiles the transitions, which the first call contains."""
    g, xf, L = a.g, a.xf, a.xf.size
    P, w = np.eye(L), np.full(2 * L + 1, 1.0 / (2 * L + 1))  # (argument types: the algebra is the first helper's)
    if kind == "ekf":
        prepared = (0, np.zeros(3), np.zeros((3, L)), np.zeros((L, 3)), np.eye(3), a.G, xf, P, a.pt)
        k.ekf_update_finish(prepared, *_finish_args(a.ids), True, 4 * g, *_SOLVER)
        return
    X = np.vstack([xf] * (2 * L + 1))
    k.filter_sigma_readings(X[:2], xf, 4 * g, a.ids, True, a.G, 4 * g, (a.z, a.q1, a.qd, a.qd, a.R, a.Jm), *_SOLVER,
                            a.table)
    prepared = (0, np.zeros(3), X, np.zeros((2 * L + 1, 3)), np.eye(3), a.G, xf, P, a.pt)
    k.ukf_update_finish(prepared, *_finish_args(a.ids), w, True, 4 * g, *_SOLVER)


def _warm_filter(k: ModelKernels, kind: str) -> None:
    """The calls of a filter of ``kind`` (:data:`FILTER_KINDS`): the point (from a guess, from a reference point),
    the state Jacobians, the measurement model, the transitions (:func:`_warm_transitions`) and the update's kernels
    and algebra."""
    a = _filter_args(k)
    if a is None:
        return
    g, n, xf, G, ids, table, pt = a.g, a.n, a.xf, a.G, a.ids, a.table, a.pt
    k.point(a.z, np.zeros(g), None, a.z, a.q1, a.R, a.Jm, None, *_SOLVER)
    k.filter_jacobians(xf, (a.q1, a.qd, a.R, a.Jm), True, G, 4 * g)
    for jac in (None, (a.R, a.R, np.zeros((n, xf.size)))):  # the measurement model, with and without H
        k.measure_sensors(ids, a.q1, a.qd, a.qd, xf[4 * g :], table, jac, 4 * g)
    _warm_transitions(k, a)
    P, e, w = _warm_update_algebra(xf, ids, kind)
    # the mean's transition to the update's time: (h, integrator, G0, T); the point as a buffer
    advance = (1e-3, INTEGRATOR_CODES["heun"], G, np.zeros((n, 0, n)))
    if kind == "ekf":
        for interval in (None, (xf, pt, G, 1e-3, INTEGRATOR_CODES["heun"], P)):
            prepared = k.ekf_update_prepare(xf, P, pt, ids, np.ones(3), 4 * g, True, G, 4 * g, table, *_SOLVER,
                                            interval, advance)
            k.ekf_update_finish(prepared, *_finish_args(ids), True, 4 * g, *_SOLVER)
        return
    k.filter_sigma_transitions(np.vstack([xf, xf]), xf, 4 * g, 1e-3, INTEGRATOR_CODES["heun"], True, G, 4 * g, a.ref,
                               *_SOLVER)
    k.filter_sigma_readings(np.vstack([xf, xf]), xf, 4 * g, ids, True, G, 4 * g, (a.z, a.q1, a.qd, a.qd, a.R, a.Jm),
                            *_SOLVER, table)
    for interval in (None, (xf, P, pt, G, 1e-3, INTEGRATOR_CODES["heun"], P)):
        prepared = k.ukf_update_prepare(xf, P, pt, ids, np.ones(3), 4 * g, (w, w, 1.0), True, G, 4 * g, table,
                                        *_SOLVER, interval, advance)
        k.ukf_update_finish(prepared, *_finish_args(ids), w, True, 4 * g, *_SOLVER)


def _warm_independent_smoother(k: ModelKernels) -> None:
    """The independent smoother's model at a state (the point and state Jacobians inside: one η), from a reference
    point at a Taylor step, a chunk's positions, a step's rows, the measurement model and the gate's statistics."""
    model = k.model
    g, n = model.g, model.n
    q = np.ascontiguousarray(model.q0, dtype=np.float64)
    z, zd, qd = q[model.dof].copy(), np.zeros(g), np.zeros(n)
    xf = np.concatenate([z, zd, np.zeros(2 * g + 1)])  # the x layout [z, ż, c, b, p] with one parameter
    ids, table = np.zeros(1, np.int64), _warm_up_table(k)
    layout, solver = (g, 4 * g, 4 * g + 1), _SOLVER
    terms = (np.zeros((1, n, n)), np.zeros((1, n)))
    out = k.smoother_point(xf, layout, None, q, True, terms, solver)
    status, q1, R, Jm = out[0], out[2], out[6], out[7]
    if status == 0:
        k.smoother_point(xf, layout, (z, q1, R, Jm), q1, True, terms, solver, (zd, 1e-3))
        k.smoother_positions(np.vstack([xf, xf]), layout, (z, q1, R, Jm), terms, solver)
        J0 = np.zeros((xf.size, xf.size))
        smoother_step_rows(xf, xf, zd, zd, out[11], out[11], 1e-3, k.dof, J0, J0, True)
        for jac in (None, (R, R, np.zeros((n, xf.size)))):
            k.measure_sensors(ids, q1, qd, qd, xf[4 * g :], table, jac, 4 * g)
    gate_stats_compact(np.ones(1), np.ones((1, 2)), np.eye(2), np.ones(1))  # (compiled_or_python's _TWINS)


def _warm_smoother(k: ModelKernels) -> None:
    """The dependent-coordinate smoother's dynamics (q̈ with and without ∂q̈/∂x), a step's rows, the measurement
    factors' and the gate's model (with and without H over x = [q, q̇, …]) and the gate's statistics."""
    model = k.model
    n = model.n
    q = np.ascontiguousarray(model.q0, dtype=np.float64)
    qd = np.zeros(n)
    x = np.concatenate([q, qd, np.zeros(2 * model.g)])
    no_params = (np.zeros((0, n, n)), np.zeros((0, n)))  # no ε: same compiled types
    with contextlib.suppress(np.linalg.LinAlgError):  # (compiled; singular at this configuration)
        k.fgs_accel(x, *no_params)
    with contextlib.suppress(np.linalg.LinAlgError):
        cur = k.fgs_dynamics(x, *no_params)
        J0 = np.zeros((4 * model.g + 2 * model.m, len(x)))
        k.fgs_step(x, x, 1e-3, cur, cur, J0, J0, True)
    ids, table = np.zeros(1, np.int64), _warm_up_table(k)
    for jac in (None, (np.eye(n), np.zeros((n, n)), np.zeros((n, x.size)))):
        k.measure_sensors(ids, q, qd, qd, x[2 * n :], table, jac, 2 * n)
    gate_stats_compact(np.ones(1), np.ones((1, 2)), np.eye(2), np.ones(1))  # (compiled_or_python's _TWINS)


#: the kinds (:data:`KINDS`) whose cold compile a helper process shares (:func:`_start_helper`), each with the
#: kernel whose absence from numba's cache means a cold compile of the kind
HELPED_KINDS = {"manifold": smoother_point, "ekf": ekf_update_prepare, "ukf": ukf_update_prepare}


def cache_is_cold(dispatcher=None) -> bool:
    """Whether numba's cache holds nothing for ``dispatcher`` (default: the manifold point, which every backend uses)
    for this source and numba version: the next start compiles.  False when kernels are off or that cannot be told."""
    if not enabled():
        return False
    try:
        return not (dispatcher or position)._cache._cache_file._load_index()
    except Exception:  # (numba's cache internals: a changed layout means "don't know", nothing worse)
        return False


def _join_helper(helper: subprocess.Popen) -> None:
    """Wait for the helper process: its part is in numba's cache then (unless it failed: compiled here instead).
    One that outlives :data:`COLD_START_TIMEOUT_S` is left to :func:`warm_up`, which stops it."""
    try:
        helper.wait(timeout=COLD_START_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        log.warning("the kernels' helper process took over %g s; stopped", COLD_START_TIMEOUT_S)


def warm_in_helper(kind: str, stage: int = 1) -> None:
    """A helper process's work (:func:`_start_helper`) on the shipped rig's model: :func:`warm_helper_part` of
    ``kind`` (stage 1) or a filter's :func:`_warm_update_finish` (stage 2)."""
    from estimator_service.paths import default_rig
    from estimator_service.rig import load_rig

    k = ModelKernels(load_rig(str(default_rig())).model)
    if stage == 1:
        warm_helper_part(k, kind)
    elif (a := _filter_args(k)) is not None:
        _warm_update_finish(k, kind, a)


#: which kernels a backend uses (its ``kernel_kind``): a filter's (:data:`FILTER_KINDS`), the dependent-coordinate
#: smoother's, or the independent one's ("manifold": the point, the filters' state Jacobians and measurement model)
KINDS = (*FILTER_KINDS, "smoother", "manifold")


def compile_model(model, kind: str) -> ModelKernels | None:
    """The kernels of ``kind`` (:data:`KINDS`) for ``model``, compiled (or loaded from the cache) and warmed up: the
    dynamics provider a backend is handed (:class:`ModelKernels`, with the methods of the model's numpy reference
    and the compiled entries), or None when kernels are off (:func:`enabled`), the constraint system is not square,
    or compiling failed on this machine (the backend then takes the model itself, the numpy reference).  The model
    is left as it was."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if not enabled() or model.m + model.g != model.n:
        return None
    k = ModelKernels(model)
    try:
        warm_up(k, kind)
    except Exception as exc:  # a numba or LLVM failure on this machine: the numpy path still works
        log.warning("compiled kernels unavailable (%s: %s); using the numpy reference path", type(exc).__name__, exc)
        return None
    return k

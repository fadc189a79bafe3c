"""The machinery the independent-coordinate filters share (EKF, UKF, error-state EKF): their
parameters, the transition and measurement models over the consistent point of the constraint manifold
(backends/manifold.py), stepping, late data and divergence.  Each backend adds its covariance propagation
and its update; a group of sensors is fused by the backend's compiled kernel (backends/fused_update.py).
State x = [z, ż, c, b, ε, p]: independent coordinates and rates, an unknown generalized force
on the DOF, τ = b − c ⊙ ż (viscous coefficient c, bias b; random walks), which absorbs bearing
friction the model does not know (set ``estimate_force = false`` for the paper's plain [z, ż]),
the model's parameter errors (the identifiable combinations η = Vᵀε of every body's mass and I0
errors ε, adding the generalized force G(q̈) η with q̈ of the current point: backends/uncertainty.py,
``[estimator.model] adapt``), then the sensor parameters p (gyro/accelerometer biases, IMU time
offsets: backends/sensor_params.py).  ``ε`` in the code below stands for η.  A drive's torque (``[[drive]] input =
"torque"``) moves b at its message's time (backends/drive_inputs.py).

A run of ``jump_after`` gated samples of one sensor (each within ``nis_limit``) is taken for a jump of
the unknown DOF force (a crank held or released by hand): b's variance grows by ``jump_sigma_force``²
instead of the sensor being rejected until the divergence rule resets the filter.

Process noise: the configured densities, plus the model error's acceleration noise on ż at the
interval's start point when it is not (only) learned as ε (backends/uncertainty.py).  Each update records
every sensor's NIS in the consistency window (backends/consistency.py) and drops the sensors whose
NIS exceeds ``gate_nis`` per row (outlier gate).

Transition: ż and z̈ = M̄⁻¹Q̄ (R-matrix formulation, backends/manifold.py ``ManifoldDynamics``) integrated by
Heun's method (``integrator = "heun"``, default), classical RK4 (``"rk4"``) or explicit Euler
(``"euler"``, as in the paper; measurably less accurate).  The transition Jacobian F is the exact
derivative of the integrator map, chained through its stages (Heun: F = I + h/2 (A₁ + A₂(I + hA₁))),
with A = ∂ẋ/∂x from the model's analytic state Jacobians.  The full q of the current state is
carried along: every position problem starts from a nearby consistent point (second-order
predictor, then Newton), so the assembly branch is kept and one Newton step usually suffices.

Measurements: y = h(q, q̇, q̈) of the virtual sensors, with q̈ from the model, and H = ∂y/∂x
(backends/manifold.py ``measure_independent``).  A measurement at t_m inside a step is used at t_m:
predict to t_m, update, predict the rest (the grid stays on multiples of dt).  A measurement older than
the current step (late data, up to ``history_s``) is used at its own time too: the filter keeps a
snapshot of its state at every step boundary of the last ``history_s`` and the measurements it used
since; at the next step it restores the snapshot before the late measurement and re-runs the steps to
the present with it (robot_localization's lagged-data smoothing).

The mean advances every step; the covariance over intervals of up to ``covariance_step_s`` (and
always up to each measurement), with one transition Jacobian of the interval's length (each backend's
``covariance_over``; the EKF's from A at the interval's two ends).

Compiled (estimator_service/kernels/; the numpy code here stays the reference path): the manifold
point, the transition with its next point and its Jacobian F, the state Jacobians, the measurement model of
every kind of sensor with H, the UKF's sigma-point transitions and readings, and the EKF's and UKF's update
algebra.
"""

from __future__ import annotations

import logging
from abc import abstractmethod
from collections import deque
from dataclasses import dataclass

import numpy as np

from estimator_service import kernels
from estimator_service.angles import wrap_angle
from estimator_service.backends.base import (DRIVE_JUMP_SIGMA, Backend, DivergenceMonitor, Estimate, Measurement, dof_force,
                                           drive_jump_cov, drive_rate_sigma, params_from_dict, rate_jump_statistic,
                                           rate_jump_threshold)
from estimator_service.backends.consistency import ConsistencyMonitor
from estimator_service.backends.drive_inputs import HeldTorques
from estimator_service.backends.fused_update import FusedUpdates
from estimator_service.backends.manifold import (ManifoldDynamics, Point, compiled_sensor_ids, dqdd_dx,
                                                measure_independent)
from estimator_service.backends.mount_test import MountTest
from estimator_service.backends.sensor_params import SensorParams
from estimator_service.backends.uncertainty import ModelUncertainty, parse_uncertainty
from estimator_service.errors import ConfigError
from estimator_service.model import AssemblyError, Model
from estimator_service.tails import chi2_ppf

log = logging.getLogger(__name__)

INTEGRATORS = tuple(kernels.INTEGRATOR_CODES)


@dataclass
class FilterParams:
    """Parameters shared by the EKF and the UKF (rig TOML ``[estimator.ekf]`` / ``[estimator.ukf]``).

    Process noise values are continuous-time spectral densities (per √s): over an interval of
    h seconds the covariance grows by σ² h.  Units: rad for angular DOFs, m for linear ones.
    """

    integrator: str = "heun"  #: "heun" (2nd order), "rk4" (4th order) or "euler" (the paper's; costs accuracy)
    sigma_z: float = 1e-4  #: process noise density on z (rad/√s or m/√s)
    sigma_zd: float = 0.004  #: process noise density on ż (rad/s/√s or m/s/√s): unmodelled forces beyond [estimator.model]
    estimate_force: bool = True  #: augment the state with the unknown DOF force (c, b)
    sigma_damping: float = 1e-4  #: random walk density of c (N·m·s/rad per √s)
    sigma_force: float = 1e-4  #: random walk density of b (N·m/√s or N/√s)
    init_sigma_z: float = 0.03  #: initial standard deviation of z (rad or m)
    init_sigma_zd: float = 0.05  #: initial standard deviation of ż (rad/s or m/s)
    init_sigma_damping: float = 0.05  #: initial standard deviation of c (N·m·s/rad)
    init_sigma_force: float = 0.01  #: initial standard deviation of b (N·m or N)
    reinit_sigma_zd: float = 2.0  #: standard deviation of ż after a re-initialisation (rad/s or m/s)
    reinit_sigma_z: float = 0.5  #: standard deviation of z after a re-initialisation without a fresh encoder reading (rad or m): the last good pose is old
    nis_limit: float = 100.0  #: normalised innovation squared per measurement row counted as an outlier
    outliers_to_reinit: int = 20  #: consecutive outlier updates that mean divergence
    max_constraint_residual: float = 1e-3  #: max |Φ| above this (or NaN) means divergence (m² / m)
    max_rate: float = 100.0  #: |ż| above this means divergence (rad/s or m/s)
    degraded_after_ms: float = 200.0  #: sensor-time silence after which estimates are "degraded" (ms)
    position_tol: float = 1e-10  #: position-problem tolerance on max |Φ|, relative to (1 + mechanism size)²
    covariance_step_s: float = 0.01  #: longest interval the covariance is propagated over at once (s)
    gate_nis: float = 30.0  #: a sensor's NIS above this (per row) rejects its sample (outlier gate; 0 = off)
    jump_after: int = 3  #: consecutive gated samples of one sensor (NIS per row up to ``nis_limit``) that mean the DOF force jumped (0 = never)
    jump_sigma_force: float = 1.0  #: std of such a jump of b (N·m or N): a crank held or released by hand, a knock
    consistency_window_s: float = 0.5  #: sliding window of the NIS consistency check (s)
    drive_jump_sigma: float = DRIVE_JUMP_SIGMA  #: a driven DOF's rate jumped when the update's innovation along it is this many σ off (0 = never)

    @classmethod
    def from_dict(cls, file: str, section: str, d: dict):
        """Build from a TOML table (ConfigError naming file, key and value on unknown keys and bad values)."""
        out = params_from_dict(cls, file, section, d,
                               frozenset({"alpha", "position_tol", "covariance_step_s", "degraded_after_ms",
                                          "outliers_to_reinit", "nis_limit", "max_rate", "max_constraint_residual"}),
                               {"integrator": INTEGRATORS})
        return out


class IndependentFilter(FusedUpdates, Backend):
    """Shared machinery of the EKF and UKF: state, transition, measurement model, stepping, divergence."""

    section = ""
    params_class: type[FilterParams] = FilterParams
    kernel_kind = "ekf"

    def __init__(self, model: Model, sensors: list, config) -> None:
        super().__init__(model, sensors, config)
        self.params = self.params_class.from_dict(config.source, f"estimator.{self.section}",
                                                  getattr(config, self.section, {}) or {})
        p, g = self.params, model.g
        self.degraded_after_s = p.degraded_after_ms * 1e-3
        self.uncertainty = ModelUncertainty(model, parse_uncertainty(config.source, getattr(config, "model", {}) or {}, model))
        K = self.uncertainty.dim
        self.nd = (4 * g if p.estimate_force else 2 * g) + K  # dynamic part [z, ż, (c, b), ε]
        #: the model-parameter errors ε (backends/uncertainty.py) in x
        self._eps = slice(self.nd - K, self.nd)
        self.sp = SensorParams(sensors)
        self.mounts = MountTest(self.sp)  #: the accelerometers' mounts, held until contradicted
        self.L = self.nd + self.sp.dim
        #: the drives' torques, held between their messages (b carries them)
        self.held = HeldTorques(g, sensors)
        if self.held and not p.estimate_force:
            raise ConfigError(config.source, f"estimator.{self.section}.estimate_force",
                              'a drive with input = "torque" moves the DOF force state: it must be true')
        table = getattr(config, self.section, {}) or {}
        #: prior std of the damping coefficient: the key if given, else the model's friction range
        self._sigma_c0 = p.init_sigma_damping if "init_sigma_damping" in table else self.uncertainty.params.friction_max
        # a driven DOF's unknown acceleration (white, density ρ) adds to ż's noise
        q_cont = [p.sigma_z] * g + np.hypot(p.sigma_zd, model.drive_density).tolist()
        if p.estimate_force:
            q_cont += [p.sigma_damping] * g + [p.sigma_force] * g
        q_cont += [self.uncertainty.params.walk] * K
        self._Qc = np.diag(np.concatenate([np.square(q_cont), np.square(self.sp.walk)]))
        self.consistency = ConsistencyMonitor([f"{s.name}.{s.kind}" for s in sensors], p.consistency_window_s)
        self._I = np.eye(self.L)
        self.dynamics = ManifoldDynamics(model, p.position_tol, kernels.compile_model(model, self.kernel_kind))
        self.compiled = self.dynamics.kernel is not None
        self.monitor = DivergenceMonitor(p.nis_limit, p.outliers_to_reinit, p.max_constraint_residual, p.max_rate)
        self._pending: list[Measurement] = []
        self.t_update = 0.0  # time of the update in progress (s): stamps the consistency window
        self._t_last_update = 0.0  # time of the update before it (s): a drive's jump happened in between
        self._driven = np.flatnonzero(model.driven)  #: the DOFs a drive moves (their rates may jump)
        #: the driven rates' jump test's threshold (:meth:`_drive_jumped`; inf: never)
        self._jump_threshold = rate_jump_threshold(p.drive_jump_sigma, len(self._driven)) if len(self._driven) else np.inf
        self.x = np.zeros(self.L)
        self.P = np.eye(self.L)
        self.point: Point | None = None
        self._good_q = model.q0.copy()
        #: snapshots (t, state) at step boundaries over the last ``history_s``, oldest first
        self._history: deque[tuple[float, tuple]] = deque()
        #: measurements used by the steps after the oldest snapshot, in order of use
        self._used: deque[Measurement] = deque()
        self._late: list[Measurement] = []
        self._G: np.ndarray | None = None
        self._G_point: Point | None = None
        #: the point whose parameter forces G the transitions take while a covariance interval is propagated
        self._interval_forces: Point | None = None
        #: (x0, P0, its point, G(q̈) there) where the open covariance interval started, or None
        self._interval_start: tuple[np.ndarray, np.ndarray, Point, np.ndarray] | None = None
        self._no_eps = np.zeros((model.n, 0))
        #: (G0, T) of the parameter forces G(q̈) = G0 − T q̈ (ModelUncertainty.force_terms), for the fused updates
        self._force_terms = self.uncertainty.force_terms() if self._eps.start != self._eps.stop else \
            (self._no_eps, np.zeros((model.n, 0, model.n)))
        self._base_var = [np.square(s.sigma) for s in sensors]  # configured measurement variances per sensor
        self._var = list(self._base_var)  # ... times the consistency monitor's noise scale (noise adaptation)
        self._dims = np.array([s.dim for s in sensors], dtype=np.int64)  # rows per sensor
        self._angle_rows: dict[tuple[int, ...], np.ndarray] = {}  # :meth:`angle_rows` per sensor combination
        #: per sensor combination: (its indices as an array, rows per sensor) when the compiled update covers it,
        #: else (None, None)
        self._compiled_groups: dict[tuple[int, ...], tuple] = {}
        #: the next update's part that needs no readings, computed ahead for every sensor (:meth:`_prepare_update`)
        self._prepared: tuple | None = None
        #: per group of sensors: the rows of its readings among those of all of them (:meth:`_finish_prepared`)
        self._prepared_rows: dict[tuple[int, ...], np.ndarray] = {}
        self._block_nis = kernels.compiled_or_python(kernels.block_nis, self.compiled)
        #: the EKF update's algebra (backends/ekf.py), compiled with the kernels
        self._innovation_cov = kernels.compiled_or_python(kernels.ekf_innovation_cov, self.compiled)
        self._correct = kernels.compiled_or_python(kernels.ekf_correct, self.compiled)
        #: the sensors' arrays for the compiled measurement model (None: kernels off)
        self._table = self.sp.sensor_table() if self.compiled else None
        #: the sensors the compiled update covers, all of them: the group prepared ahead,
        #: with their indices as an array and their readings' variances
        self._all_compiled = tuple(i for i in range(len(sensors)) if self._table is not None and self._table.covers(i))
        self._all_compiled_terms = (np.array(self._all_compiled, dtype=np.int64),
                                    self.measurement_var(list(self._all_compiled))) if self._all_compiled else None
        self._gated_run = [0] * len(sensors)  # consecutive gated samples per sensor (:meth:`gate_and_record`)
        self.jumps = 0  #: force jumps assumed so far (:meth:`_force_jump`; est/diag)
        #: ‖η‖² beyond which the parameter errors are implausible (:meth:`_check_parameters`)
        self._eta_bound = float(chi2_ppf(1 - 1e-4, K)) if K else np.inf

    # ------------------------------------------------------------------ model pieces
    def tau(self, x: np.ndarray, pt: Point | None = None) -> np.ndarray | None:
        """Generalized forces (n,) of the unknown DOF force τ = b − c ⊙ ż in state x (None without), plus
        the parameter errors' G η with G at the point ``pt`` (:meth:`_param_forces`)."""
        g = self.model.g
        tau = dof_force(self.model, x[2 * g : 3 * g], x[3 * g : 4 * g], x[g : 2 * g]) if self.params.estimate_force else None
        if self._eps.start == self._eps.stop:
            return tau
        f = self._param_forces(pt) @ x[self._eps]
        return f if tau is None else tau + f

    def tau_terms(self, pt: Point | None = None) -> tuple[bool, np.ndarray, int]:
        """(force on, G (n, K) at the point ``pt`` (:meth:`_param_forces`), start of ε in x): what :meth:`tau`
        needs besides x, for the compiled transitions (ManifoldDynamics.advance); G is (n, 0) without ε."""
        G = self._param_forces(pt) if self._eps.start != self._eps.stop else self._no_eps
        return self.params.estimate_force, G, self._eps.start

    def _param_forces(self, pt: Point | None = None) -> np.ndarray:
        """G (n, K), C-contiguous for the kernels: generalized force per unit parameter error ε
        (backends/uncertainty.py) at the q̈ of the point ``pt``; by default of the point a transition starts
        from: the current one (q̈ changes little within a 1 ms step), or over a covariance interval its start
        (:meth:`_propagated`).  The current point's is computed once, the interval start's kept with it."""
        pt = self._forces_point(pt)
        start = self._interval_start
        if start is not None and pt is start[2]:
            return start[3]
        if pt is not self.point:
            return self.uncertainty.forces(pt.qdd)
        if self._G is None or self._G_point is not pt:
            self._G = self.uncertainty.forces(pt.qdd if pt is not None else np.zeros(self.model.n))
            self._G_point = pt
        return self._G

    def _forces_point(self, pt: Point | None) -> Point | None:
        """The point whose G :meth:`_param_forces` gives for ``pt``: pt itself, else the point the transitions
        start from (a covariance interval's start while it is propagated, else the current point)."""
        return pt if pt is not None else (self._interval_forces or self.point)

    def point_of(self, x: np.ndarray, ref: Point | None, q_guess: np.ndarray | None = None, light: bool = False) -> Point:
        """Consistent point of state x, from a nearby reference point (keeps its branch); ``light`` as
        :meth:`ManifoldDynamics.point` (its Jm is the reference's)."""
        g = self.model.g
        return self.dynamics.point(x[:g], x[g : 2 * g], self.tau(x), ref, q_guess, light=light)

    def xdot(self, x: np.ndarray, pt: Point) -> np.ndarray:
        """ẋ = [ż, z̈, 0, 0] at state x with its point."""
        g = self.model.g
        out = np.zeros(self.L)
        out[:g] = x[g : 2 * g]
        out[g : 2 * g] = pt.zdd
        return out

    def _state_jacobians(self, x: np.ndarray, pt: Point, forces_at: Point | None = None):
        return self.model.state_jacobians(pt.q, pt.qd, self.tau(x, forces_at))

    def _dqdd_dx(self, x: np.ndarray, j, forces_at: Point | None = None) -> np.ndarray:
        """∂q̈/∂x (n, L) from the model's state Jacobians (:func:`dqdd_dx`), G at ``forces_at``."""
        G = self._param_forces(forces_at) if self._eps.start != self._eps.stop else self._no_eps
        return dqdd_dx(j, x, self.model.dof, self.params.estimate_force, G, self._eps.start, self.L)

    def jacobians(self, x: np.ndarray, pt: Point, forces_at: Point | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(R = ∂q/∂z, ∂q̇/∂z at fixed ż, ∂q̈/∂x (n, L)) at state x with its point, the parameter forces G of
        the point ``forces_at`` (:meth:`_param_forces`; by default the transition's): compiled, or the
        reference path (:meth:`_state_jacobians`, :meth:`_dqdd_dx`)."""
        out = self.dynamics.jacobians(x, pt, self.tau_terms(forces_at))
        if out is None:
            j = self._state_jacobians(x, pt, forces_at)
            out = j.R, j.dqd_dz, self._dqdd_dx(x, j, forces_at)
        return out

    def A(self, x: np.ndarray, pt: Point, forces_at: Point | None = None) -> np.ndarray:
        """A = ∂ẋ/∂x (L, L), analytic; G as :meth:`jacobians`."""
        g = self.model.g
        out = np.zeros((self.L, self.L))
        out[:g, g : 2 * g] = np.eye(g)
        out[g : 2 * g] = self.jacobians(x, pt, forces_at)[2][self.model.dof]
        return out

    def transition_jacobian(self, x: np.ndarray, h: float, pt: Point) -> np.ndarray:
        """F = ∂x⁺/∂x of :meth:`transition` (compiled in one call, or the reference path)."""
        F = self.dynamics.transition_jacobian(x, h, self.params.integrator, self.tau_terms(), pt)
        return F if F is not None else self.transition(x, h, pt, jac=True)[1]

    def transition(self, x: np.ndarray, h: float, pt: Point, jac: bool, share: list[Point] | None = None,
                   record: list[Point] | None = None) -> tuple[np.ndarray, np.ndarray | None, Point]:
        """(x after h seconds, F = ∂x⁺/∂x or None, the point of the last stage evaluated).

        F is the exact Jacobian of the integrator map, chained through its stages:
        Euler F = I + hA₁; Heun F = I + h/2 (A₁ + A₂(I + hA₁)); RK4 F = I + h/6 (D₁ + 2D₂ + 2D₃ + D₄)
        with D₁ = A₁, D₂ = A₂(I + h/2 D₁), D₃ = A₃(I + h/2 D₂), D₄ = A₄(I + h D₃).

        ``share``: the points of the stages after the first of another transition (the mean's, in
        :meth:`sigma_transitions`): each stage is found from its counterpart there, light (the position
        problem's reference and the inverse R and s are refined with: :meth:`ManifoldDynamics.point`; at
        the same z, that position and its inverse).  ``record``: a list to append this transition's stage
        points to.  As kernels.transition._transition_stages.
        """
        integ, I = self.params.integrator, self._I
        k1 = self.xdot(x, pt)
        D1 = self.A(x, pt) if jac else None
        if integ == "euler":
            return x + h * k1, (I + h * D1) if jac else None, pt

        def stage(i: int, xs: np.ndarray, prev: Point) -> Point:
            light = share is not None and i < len(share)
            out = self.point_of(xs, share[i] if light else prev, light=light)
            if record is not None:
                record.append(out)
            return out

        if integ == "heun":
            x2 = x + h * k1
            p2 = stage(0, x2, pt)
            k2 = self.xdot(x2, p2)
            F = I + 0.5 * h * (D1 + self.A(x2, p2) @ (I + h * D1)) if jac else None
            return x + 0.5 * h * (k1 + k2), F, p2
        x2 = x + 0.5 * h * k1
        p2 = stage(0, x2, pt)
        k2 = self.xdot(x2, p2)
        x3 = x + 0.5 * h * k2
        p3 = stage(1, x3, p2)
        k3 = self.xdot(x3, p3)
        x4 = x + h * k3
        p4 = stage(2, x4, p3)
        k4 = self.xdot(x4, p4)
        F = None
        if jac:
            D2 = self.A(x2, p2) @ (I + 0.5 * h * D1)
            D3 = self.A(x3, p3) @ (I + 0.5 * h * D2)
            D4 = self.A(x4, p4) @ (I + h * D3)
            F = I + h / 6 * (D1 + 2 * D2 + 2 * D3 + D4)
        return x + h / 6 * (k1 + 2 * k2 + 2 * k3 + k4), F, p4

    def predict_measurement(self, x: np.ndarray, pt: Point, sensor_ids: list[int],
                            jac: bool) -> tuple[np.ndarray, np.ndarray | None]:
        """Stacked predicted readings of the given sensors at state x (point ``pt``), and H = ∂y/∂x
        (:func:`measure_independent`)."""
        return measure_independent(self.sp, self._table, self.dynamics.kernel, sensor_ids, pt, x[self.nd :],
                                   self.jacobians(x, pt) if jac else None, self.nd)

    def sigma_transitions(self, X: np.ndarray, x0: np.ndarray, pt0: Point, h: float) -> np.ndarray:
        """Each row of X (sigma points around x0, whose point is ``pt0``) through the mean transition of h
        seconds from its own point; rows that differ from x0 only in the sensor parameters share x0's
        dynamics, and the parameters are constant over a transition; a row (or a stage) at x0's z (its
        stage's) shares that position and its inverse (with the lower-triangular square root of
        UnscentedKalmanFilter.sigma_points only the rows along z and ż solve position problems of their
        own): one compiled call, else the reference path."""
        nd = self.nd
        out = self.dynamics.advance_sigma(X, x0, nd, h, self.params.integrator, self.tau_terms(), pt0)
        if out is None:  # the reference path (kernels off, or a position problem that needs the fallback)
            stages: list[Point] = []
            base = self.transition(x0, h, pt0, jac=False, record=stages)[0][:nd]
            out = X.copy()
            for k, x in enumerate(X):
                out[k, :nd] = base if np.array_equal(x[:nd], x0[:nd]) else \
                    self.transition(x, h, self.point_of(x, pt0, light=True), jac=False, share=stages)[0][:nd]
        return out

    def sigma_readings(self, X: np.ndarray, sensor_ids: list[int]) -> np.ndarray:
        """Stacked predicted readings (rows of X, readings) of the given sensors at each row of X (sigma
        points around the current state), each from its own point found from the current one (rows equal
        to the state in [:nd] use it): one compiled call, else the reference path."""
        ids = compiled_sensor_ids(self._table, sensor_ids)
        pt, nd = self.point, self.nd
        if ids is not None:
            st, Y = self.dynamics.kernel.filter_sigma_readings(
                X, self.x, nd, ids, *self.tau_terms(), kernels.contiguous(pt.z, pt.q, pt.qd, pt.qdd, pt.R, pt.Jm),
                self.dynamics.tol, self.dynamics.quadratic_res, self.dynamics.max_newton, self._table)
            if st == 0:
                return Y
        return np.array([self.predict_measurement(
            x, pt if np.array_equal(x[:nd], self.x[:nd]) else self.point_of(x, pt, light=True), sensor_ids,
            jac=False)[0] for x in X])

    def innovation(self, y_meas: np.ndarray, y_pred: np.ndarray, sensor_ids: list[int]) -> np.ndarray:
        """y − h(x), with angles (encoders, inclinations) wrapped to [−π, π); readings along the last axis
        (a stack of them: one row per sigma point)."""
        e = y_meas - y_pred
        angle = self.angle_rows(sensor_ids)
        if angle.any():
            e[..., angle] = wrap_angle(e[..., angle])
        return e

    def angle_rows(self, sensor_ids: list[int]) -> np.ndarray:
        """Which rows of the stacked readings of ``sensor_ids`` are angles (encoders, inclinations: wrapped
        in innovations), as a boolean mask; kept per combination of sensors."""
        key = tuple(sensor_ids)
        out = self._angle_rows.get(key)
        if out is None:
            out = np.concatenate([np.full(self.sensors[i].dim, self.sensors[i].kind in ("enc", "incl")) for i in sensor_ids])
            self._angle_rows[key] = out
        return out

    def measurement_var(self, sensor_ids: list[int]) -> np.ndarray:
        """Measurement variances of the stacked sensors (their σ², sensor units²; a diagonal covariance)."""
        return np.concatenate([self._var[i] for i in sensor_ids])

    def sensor_nis(self, ids: list[int], e: np.ndarray, S: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """NIS of one update's innovation e with covariance S, counted by the divergence monitor; returns
        each sensor's own NIS (its rows against its block of S) and every row's standardised innovation
        e_i/√S_ii, for :meth:`gate_and_record`."""
        total, each = self._block_nis(e, S, self._dims[ids])
        self.monitor.innovation(float(total), len(e))
        return each, e / np.sqrt(np.diag(S))

    # ------------------------------------------------------------------ Backend interface
    def initialize(self, t0: float, q: np.ndarray, qd: np.ndarray) -> None:
        """Start at t0 (s) from (q, q̇) with the configured initial standard deviations."""
        super().initialize(t0, q, qd)
        m, g, p = self.model, self.model.g, self.params
        self.x = np.zeros(self.L)
        self.x[:g], self.x[g : 2 * g] = q[m.dof], qd[m.dof]
        sig = [p.init_sigma_z] * g + np.hypot(p.init_sigma_zd, drive_rate_sigma(m)).tolist()
        if p.estimate_force:
            sig += [self._sigma_c0] * g + [p.init_sigma_force] * g
        sig += [1.0] * self.uncertainty.dim
        self.P = np.diag(np.square(np.concatenate([sig, self.mounts.prior()])))
        self.mounts.reset()
        self.x[self._eps.start :] = getattr(self, "_p_keep", np.zeros(self.L - self._eps.start))
        if self.held:  # b holds the drives' torques (backends/drive_inputs.py)
            u, var = self.held.prior()
            self.x[3 * g : 4 * g] += u
            self.P[3 * g : 4 * g, 3 * g : 4 * g] += np.diag(var)
        self._gated_run = [0] * len(self.sensors)
        self.point = None  # (the parameter forces G(q̈) of the first point use q̈ = 0, not a point before a reset)
        self.point = self.point_of(self.x, None, q)
        self._pending = []
        self.monitor.reset()
        self.consistency.reset()
        self._good_q = self.point.q.copy()
        self._interval_h = 0.0
        self._interval_start = None
        #: (h, P) of the open interval propagated ahead of its end for the expected length h
        #: (:meth:`_precompute_interval`), or None
        self._interval_pre: tuple[float, np.ndarray] | None = None
        self._interval_expect = self.params.covariance_step_s  # (s) the last closed interval's length
        self._prepared = None
        self._history.clear()
        self._used.clear()
        self._late = []

    def earliest_time(self) -> float:
        """The oldest snapshot's time (s): measurements after it can still be used at their own time."""
        return self._history[0][0] if self._history else self.t

    def add_measurement(self, m: Measurement) -> None:
        """Buffer a measurement; it is used at its own time by the next step (re-running the steps
        since the snapshot before it when it is late, i.e. not after the current time)."""
        if m.t <= self.t + 1e-12 and m.t > self.earliest_time():
            self._late.append(m)
        else:
            self._pending.append(m)
        self.note_measurement(m)

    def _snapshot(self) -> tuple:
        """The filter state that one step changes (arrays are replaced, never modified in place)."""
        return (self.t, self.x, self.P, self.point, self._interval_h, self._interval_start, self._interval_pre,
                self._interval_expect, self.monitor.outliers, self._good_q, self._last_measurement_t, self.last_encoder,
                self.status, list(self._gated_run), self.held.state(), self.mounts.state())

    def _restore(self, s: tuple) -> None:
        (self.t, self.x, self.P, self.point, self._interval_h, self._interval_start, self._interval_pre,
         self._interval_expect, self.monitor.outliers, self._good_q, self._last_measurement_t, self.last_encoder,
         self.status, gated_run, held, mounts) = s
        self._gated_run = list(gated_run)
        self.held.restore(held)
        self.mounts.restore(mounts)

    def _rerun_with_late(self) -> None:
        """Restore the snapshot before the oldest late measurement and re-run to the present with it."""
        late, self._late = sorted(self._late, key=lambda m: m.t), []
        t_now, last_t = self.t, self._last_measurement_t
        while self._history and self._history[-1][0] >= late[0].t - 1e-12:
            self._history.pop()
        if not self._history:  # (cannot happen: add_measurement checked earliest_time)
            return
        t_snap, state = self._history.pop()
        redo = [m for m in self._used if m.t > t_snap + 1e-12]
        while self._used and self._used[-1].t > t_snap + 1e-12:
            self._used.pop()
        self._restore(state)
        self.consistency.rewind(t_snap)
        self._pending = redo + late + self._pending
        while self.t < t_now - 1e-9:
            self._step_once()
        self._last_measurement_t = last_t

    def step(self) -> list[Estimate]:
        """Advance dt (after re-running with any late measurement); see :meth:`_step_once`."""
        if self._late:
            self._rerun_with_late()
        return self._step_once()

    def _step_once(self) -> list[Estimate]:
        """Advance dt: predict to each buffered measurement time in the step, update, predict the rest."""
        if self.history_s > 0:
            self._history.append((self.t, self._snapshot()))
            while self._history and self._history[0][0] < self.t - self.history_s - 1e-12:
                self._history.popleft()
            t_old = self._history[0][0]
            while self._used and self._used[0].t <= t_old + 1e-12:
                self._used.popleft()
        t_end = self.t + self.dt
        updated = False
        try:
            t = self.t
            if self.held:
                self._expire_inputs()
            if self._pending:
                due = sorted((m for m in self._pending if m.t <= t_end + 1e-12), key=lambda m: m.t)
                self._pending = [m for m in self._pending if m.t > t_end + 1e-12]
                if self.history_s > 0:
                    self._used.extend(due)
                i = 0
                while i < len(due):
                    t_m = max(due[i].t, t)
                    group = [mm for mm in due[i:] if max(mm.t, t) - t_m < 1e-9]
                    i += len(group)
                    h = t_m - t if t_m > t + 1e-12 else 0.0
                    t = max(t, t_m)
                    if self.held and any(self.sensors[mm.sensor].is_input for mm in group):
                        if h > 0.0:
                            self.predict(h, propagate=False)
                            h = 0.0
                        self._apply_inputs([mm for mm in group if self.sensors[mm.sensor].is_input])
                        group = [mm for mm in group if not self.sensors[mm.sensor].is_input]
                        if not group:
                            continue
                    self.t_update = t
                    self.update(group, h)  # (the mean's transition to t_m included; the covariance's first)
                    self._check_parameters()
                    updated = True
            if t_end > t + 1e-12:
                self.predict(t_end - t)
            if not updated and self._interval_start is not None:
                if self._interval_pre is None and self.precomputes_interval():
                    self._precompute_interval()
                else:
                    self._prepare_update()
            self.t = t_end
            g = self.model.g
            problem = self.monitor.problem(self.monitor.finite(self.x, self.P), self.point.residual, self.x[g : 2 * g])
            if problem is not None:
                raise FloatingPointError(problem)
        except (FloatingPointError, AssemblyError, np.linalg.LinAlgError) as exc:
            return [self._reinitialize(str(exc), t_end)]
        if self.monitor.outliers == 0:  # a pose the sensors agree with: the restart point after a divergence
            self._good_q = self.point.q
        return [self._estimate(self.t)]

    def _estimate(self, t: float) -> Estimate:
        """The current estimate with its quality, biases and time offsets."""
        g = self.model.g
        e = self.make_estimate(t, self.point.q, self.point.qd, self.P[: 2 * g, : 2 * g].copy())
        e.quality = self.consistency.quality()
        e.bias, e.time_offset_s, e.mount_deg = self.sp.report(self.x[self.nd :])
        e.model = self.uncertainty.report(self.x[self._eps])
        return e

    def diagnostics(self) -> dict:
        """est/diag ``info``: NIS statistics per sensor, biases, time offsets and accelerometer mounts, the sensor
        parameters' std."""
        bias, offs, mounts = self.sp.report(self.x[self.nd :])
        sd = np.sqrt(np.diag(self.P))
        out = {"consistency": self.consistency.stats(), "bias": bias, "time_offset_s": offs,
               "param_std": dict(zip(self.sp.names, sd[self.nd :].tolist(), strict=True)), "force_jumps": self.jumps}
        if mounts:
            out["mount_deg"] = mounts
        if self.uncertainty.dim:
            out["model"] = self.uncertainty.report(self.x[self._eps])
            out["model_std"] = self.uncertainty.report_std(self.P[self._eps, self._eps])
        return out

    def _reinitialize(self, why: str, t: float) -> Estimate:
        """Restart at rest from the latest encoder reading or the last good pose; ż uncertain."""
        log.warning("%s: divergence (%s); re-initialising", self.name, why)
        from_encoder = self.fresh_encoder() is not None
        q, qd = self.restart_pose(self._good_q)
        pending = self._pending
        p_keep = self.x[self._eps.start :].copy()
        p_keep[: self._eps.stop - self._eps.start] = 0.0  # the model's parameter errors may be what diverged: learned anew
        self._p_keep = p_keep if np.all(np.isfinite(p_keep)) else np.zeros(len(p_keep))  # sensor parameters survive
        self.initialize(t, q, qd)
        del self._p_keep
        g = self.model.g
        self.P[g : 2 * g, g : 2 * g] = np.eye(g) * self.params.reinit_sigma_zd**2
        if not from_encoder:
            self.P[:g, :g] = np.eye(g) * max(self.params.init_sigma_z, self.params.reinit_sigma_z) ** 2
        self._pending = pending
        self.mark_reinit(why)
        return self._estimate(t)

    def predict(self, h: float, propagate: bool = True) -> None:
        """Advance the mean by h seconds; the covariance follows once per interval (``propagate``: when the
        interval is ``covariance_step_s`` long; else it stays open for the update that follows, which
        propagates it first: the same interval either way, and the EKF's update does it in the same
        compiled call)."""
        self._open_interval()
        fast = self.dynamics.advance(self.x, h, self.params.integrator, self.tau_terms(), self.point, self._force_terms)
        if fast is None:
            x, _, last = self.transition(self.x, h, self.point, jac=False)
            self.x, self.point = x, self.point_of(x, last)
        else:
            self.x, self.point, G = fast
            if G.shape[1]:  # (:meth:`_param_forces` of the new point)
                self._G, self._G_point = G, self.point
        self._interval_h += h
        if propagate and self._interval_h >= self.params.covariance_step_s - 1e-12:
            self.propagate_covariance()

    def _open_interval(self) -> None:
        """Start a covariance interval at the current state, unless one is open."""
        if self._interval_start is None:
            self._interval_start = (self.x.copy(), self.P, self.point, self.tau_terms()[1])

    def propagate_covariance(self) -> None:
        """Propagate P over the open interval (since ``_interval_start``, ``_interval_h`` s); closes it.  The
        propagation computed ahead (:meth:`_precompute_interval`) is taken when its length is the interval's."""
        if self._interval_start is None:
            return
        P = self._precomputed(self._interval_h)
        self._close_interval(self._propagated(self._interval_h) if P is None else P, self._interval_h)

    def _propagated(self, h: float) -> np.ndarray:
        """P propagated over h seconds of the open interval, process noise included; transitions from its
        start take the parameter forces G at its start point (:meth:`_param_forces`)."""
        x0, P0, pt0, _ = self._interval_start
        self._interval_forces = pt0
        try:
            return self.covariance_over(x0, P0, pt0, h) + self.interval_noise(pt0, h)
        finally:
            self._interval_forces = None

    def _close_interval(self, P: np.ndarray, h: float) -> None:
        """The open interval of h seconds ends here with the propagated covariance P."""
        self.P, self._interval_expect = P, h
        self._interval_start, self._interval_h, self._interval_pre = None, 0.0, None

    def precomputes_interval(self) -> bool:
        """Whether the open covariance interval is propagated ahead of its end (:meth:`_precompute_interval`):
        when the propagation needs only the interval's start and length (the ukf's sigma points), not its
        end (the ekf's F)."""
        return False

    def _precompute_interval(self) -> None:
        """Propagate the open interval's covariance for the expected length (the last interval's: an IMU's
        period) in a step without an update, so that the update step, the longest, does not (it takes the
        result when the interval has that length, else propagates as before).  A failure here is left to
        the update, which may not meet it (a shorter interval)."""
        h = self._interval_expect
        x0, P0, pt0, _ = self._interval_start
        self._interval_forces = pt0  # (as :meth:`_propagated`)
        try:
            P = self.covariance_ahead(x0, P0, pt0, h)
            if P is None:  # (the rest in the next step)
                return
            P = P + self.interval_noise(pt0, h)
        except (FloatingPointError, AssemblyError, np.linalg.LinAlgError):
            return
        finally:
            self._interval_forces = None
        self._interval_pre = (h, P)

    def covariance_ahead(self, x0: np.ndarray, P0: np.ndarray, pt0: Point, h: float) -> np.ndarray | None:
        """:meth:`covariance_over` computed ahead of the update (:meth:`_precompute_interval`), or None when the
        backend spreads it over several steps and this one did a part of it."""
        return self.covariance_over(x0, P0, pt0, h)

    def _precomputed(self, h: float) -> np.ndarray | None:
        """The covariance propagated ahead for the open interval, if it was for h seconds (to 1 ns)."""
        pre = self._interval_pre
        return pre[1] if pre is not None and abs(pre[0] - h) <= 1e-9 else None

    def interval_noise(self, pt0: Point, h: float) -> np.ndarray:
        """Process noise (L×L) over a covariance interval of h seconds that started at the point ``pt0``; a stale
        drive torque's b walks (backends/drive_inputs.py)."""
        Q = self.process_noise(pt0) * h
        if self.held:
            g = self.model.g
            Q[3 * g : 4 * g, 3 * g : 4 * g] += np.diag(self.held.walk() * h)
        return Q

    def process_noise(self, pt: Point) -> np.ndarray:
        """Process noise density Qc (L×L, per s) at a point: the configured densities plus the model
        error's acceleration noise on ż (backends/uncertainty.py)."""
        if not self.uncertainty.noise_enabled:
            return self._Qc
        g = self.model.g
        Q = self._Qc.copy()
        Q[g : 2 * g, g : 2 * g] += self.uncertainty.accel_density2(pt.qdd, pt.R)
        return Q

    def _adapt_noise(self) -> None:
        """Take the consistency monitor's new noise scales (backends/consistency.py): the variances, the compiled
        update's, and nothing prepared ahead with the old ones."""
        self.consistency.scale_changed = False
        self._var = [v * lam for v, lam in zip(self._base_var, self.consistency.noise_scale, strict=True)]
        if self._all_compiled_terms is not None:
            self._all_compiled_terms = (self._all_compiled_terms[0], self.measurement_var(list(self._all_compiled)))
        self._prepared = None

    def gate_and_record(self, ids: list[int], stats: tuple[np.ndarray, np.ndarray]) -> list[int]:
        """Per-sensor NIS and standardised rows of one update (:meth:`sensor_nis`): the rows (into its
        innovation) of the sensors that pass the outlier gate are returned, and they are counted in the
        consistency window."""
        nis_each, z = stats
        keep, r = [], 0
        for i, nis in zip(ids, nis_each.tolist(), strict=True):
            d = self.sensors[i].dim
            if self.params.gate_nis > 0 and not nis <= self.params.gate_nis * d:
                self.consistency.reject(self.t_update, i, nis, d)  # not fused; counted in the consistency window
                # a run of moderate disagreements is a force the model lacks; a wild value is a faulty sample
                self._gated_run[i] = self._gated_run[i] + 1 if nis <= self.params.nis_limit * d else 0
                if self.params.estimate_force and 0 < self.params.jump_after <= self._gated_run[i]:
                    self._force_jump()
            else:
                self.consistency.add(self.t_update, i, nis, d, z[r : r + d])
                self._gated_run[i] = 0
                keep.extend(range(r, r + d))
            r += d
        return keep

    def _check_parameters(self) -> None:
        """The model's parameter errors η are implausible under their prior N(0, I) (‖η‖² above the χ²
        quantile 1 − 1e-4 of their count): an external force, not a wrong model, is being explained (a
        crank held by hand pushes them 5σ within 0.2 s).  Forget them (back to the prior) and let the DOF
        force jump instead; counted in ``force_jumps``."""
        eta = self.x[self._eps]
        if not eta.size or not float(eta @ eta) > self._eta_bound:
            return
        x, P = self.x.copy(), self.P.copy()
        x[self._eps] = 0.0
        P[self._eps, :] = 0.0
        P[:, self._eps] = 0.0
        P[self._eps, self._eps] = np.eye(eta.size)
        self.x, self.P = x, P
        self.point = self.point_of(self.x, self.point)
        if self.params.estimate_force:
            self._force_jump()
        else:
            self.jumps += 1

    def _drive_jumped(self, ids: list[int], terms: tuple, nis_each: np.ndarray, t_last: float) -> bool:
        """A driven DOF's rate jumped (a motor's reversal, start or stop) when the update's innovation (``terms``:
        S and e at [2] and [3]) points along the readings' sensitivity to its rate beyond ``drive_jump_sigma``
        (:func:`rate_jump_statistic`; computed only when the update's NIS could exceed that) while no sample is
        a fault (NIS up to ``nis_limit`` per row): (z, ż) widen by :func:`drive_jump_cov` over the time since
        the update before, before the samples are fused.  Counted in ``force_jumps``."""
        if self._jump_threshold == np.inf or not float(np.sum(nis_each)) > self._jump_threshold:
            return False
        if any(nis > self.params.nis_limit * self.sensors[i].dim for i, nis in zip(ids, nis_each.tolist(), strict=True)):
            return False
        g = self.model.g
        H = self.predict_measurement(self.x, self.point, ids, jac=True)[1]
        if not rate_jump_statistic(terms[3], terms[2], H[:, g + self._driven]) > self._jump_threshold:
            return False
        self.P = self.P.copy()
        self.P[: 2 * g, : 2 * g] += drive_jump_cov(self.model, self.t_update - t_last)
        self.jumps += 1
        return True

    def _apply_inputs(self, inputs: list[Measurement]) -> None:
        """Hold the drives' torques of ``inputs`` (at the current time): b moves by their changes, and the point
        with it (backends/drive_inputs.py)."""
        g = self.model.g
        x = self.x.copy()
        for m in inputs:
            x[3 * g : 4 * g] += self.held.apply(m)
        self.x = x
        self.point = self.point_of(self.x, self.point)

    def _expire_inputs(self) -> None:
        """The drives' torques held longer than their ``max_age_s`` now go stale: b walks (:meth:`interval_noise`;
        backends/drive_inputs.py); nothing propagated ahead with the old noise is used."""
        if self.held.expire(self.t):
            self._interval_pre = self._prepared = None

    def _force_jump(self) -> None:
        """A sensor keeps disagreeing with the dynamics (a crank held or released by hand, a knock): the
        unknown DOF force b may have jumped, so its variance grows by ``jump_sigma_force``² and the next
        samples move it to the new force instead of being rejected against a model that is wrong now."""
        g = self.model.g
        b = slice(3 * g, 4 * g)
        self.P = self.P.copy()
        self.P[b, b] += np.eye(g) * self.params.jump_sigma_force**2
        # a driven DOF's force is the drive's (b moves it no more): its rate may have jumped instead
        self.P[g : 2 * g, g : 2 * g] += np.diag(np.square(drive_rate_sigma(self.model)))
        self._gated_run = [0] * len(self.sensors)
        self.jumps += 1

    @abstractmethod
    def covariance_over(self, x0: np.ndarray, P0: np.ndarray, pt0: Point, h: float) -> np.ndarray:
        """Covariance after propagating (x0, P0) through one transition of h seconds (no process noise)."""

    def update(self, group: list[Measurement], h: float = 0.0) -> None:
        """Advance the mean h seconds to the measurements' time (:meth:`predict`, the covariance interval left
        open) and fuse them, after propagating the covariance over the open interval: a group of sensors in
        one compiled call, the mean's transition included (:meth:`_fused`), else step by step
        (:meth:`propagate_covariance`, :meth:`innovation_terms`, the gate, :meth:`correct`, the new point)."""
        ids = [m.sensor for m in group]
        y = group[0].y if len(group) == 1 else np.concatenate([m.y for m in group])
        if self.consistency.scale_changed:
            self._adapt_noise()
        rvar = self.measurement_var(ids)
        t_last, self._t_last_update = self._t_last_update, self.t_update
        fused = self._fused(ids, y, rvar, h)
        if fused is None:
            self.propagate_covariance()
            terms, stats = self.innovation_terms(ids, y, rvar)
        else:
            status, total, each, zr, *rest = fused
            terms, stats = tuple(rest[:4]), (each, zr)
        jumped = self._drive_jumped(ids, terms, stats[0], t_last)
        released = self._mounts_contradicted(ids, y, terms, stats[0]) if self.mounts.columns and not jumped else []
        if jumped or released:  # the rate widened, a mount is free: the update again against the wider prior
            fused = None
            terms, stats = self.innovation_terms(ids, y, rvar)
        elif fused is not None:
            self.monitor.innovation(float(total), len(zr))
        keep = self.gate_and_record(ids, stats)
        if fused is not None and status != 3:  # corrected (every sensor passed the gate, as gate_and_record found too)
            xn, Pn, point = rest[4:7]
            self.x, self.P = xn, Pn
            self.point = point if status == 0 else self.point_of(self.x, self.point)  # (else the reference path)
        elif keep:
            self.x, self.P = self.correct(terms, rvar, np.array(keep, dtype=np.int64))
            self.point = self.point_of(self.x, self.point)

    def _mounts_contradicted(self, ids: list[int], y: np.ndarray, terms: tuple, nis_each: np.ndarray) -> list[int]:
        """The held accelerometer mounts (indices into p) this update's samples within the outlier gate release
        (backends/mount_test.py): per such sample, its innovation (``terms``: S and e at [2] and [3]) and ∂y/∂μ
        from its predicted reading less its bias.  A released mount's variance grows by its prior², before the
        update is fused."""
        out, r = [], 0
        e, S, gate = terms[3], terms[2], self.params.gate_nis
        for i, nis in zip(ids, nis_each.tolist(), strict=True):
            s, d, k = self.sensors[i], self.sensors[i].dim, self.sp.mount_index[i]
            rows = slice(r, r + d)
            r += d
            if k is None or k in self.mounts.released or gate > 0 and not nis <= gate * d:
                continue
            y_hat = y[rows] - e[rows]
            idx, axes = self.sp.bias[i]
            if len(idx):
                y_hat = y_hat.copy()
                y_hat[axes] -= self.x[self.nd + idx]
            if self.mounts.add(k, self.t_update, e[rows], S[rows, rows], s.mount_jacobian(y_hat)):
                out.append(k)
        if out:
            self.P = self.P.copy()
            for k in out:
                self.P[self.nd + k, self.nd + k] += self.sp.prior[k] ** 2
        return out

    @abstractmethod
    def innovation_terms(self, ids: list[int], y: np.ndarray, rvar: np.ndarray) -> tuple[tuple, tuple]:
        """(the four terms :meth:`correct` takes, (NIS per sensor, standardised rows) by :meth:`sensor_nis`)
        of the readings y of the sensors ``ids`` at the current state (the step-by-step update)."""

    @abstractmethod
    def correct(self, terms: tuple, rvar: np.ndarray, keep: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(x⁺, P⁺): the correction by the innovation's rows ``keep`` (the others gated)."""



"""Fixed-lag factor-graph smoother on gtsam (factor-graph paper §5–6): the gtsam machinery shared by both
layouts of its variables (``[estimator.fgs] coordinates``: :func:`make_smoother`), and the dependent-coordinate
layout described here (the paper's; the default, over independent coordinates, is backends/fgs_independent.py).

One variable per 1 ms step: x_k = [q_k, q̇_k, c_k, b_k, ε_k, p_k] (2n + 2g + K + P), ε the model's
parameter errors (the K identifiable combinations η = Vᵀε of every body's mass and I0 errors: the
dynamics use M(ε) and Q(ε), backends/uncertainty.py; constant unless ``[estimator.model] walk`` is
set), p the sensor parameters
(gyro/accelerometer biases and IMU time offsets, random walks: backends/sensor_params.py).  c and b describe a generalized
force on the independent coordinates that the model does not know, τ = b − c ⊙ ż (e.g. bearing
friction: c a viscous coefficient, b a slowly varying torque), both estimated jointly with the
state as random walks (the joint state/parameter idea of the later paper).  The accelerations are not variables: q̈ = f(q, q̇, Sᵀτ) is the KKT forward
dynamics of the model, substituted into the trapezoidal integrator (the dynamics factor and the
velocity integrator of the paper merged into one residual, which keeps the system small and well
conditioned).  One *fused* CustomFactor per step joins x_{k-1} and x_k and stacks the residuals
of the step's dynamics, each row with its own sigma; each sensor sample has a factor of its own on
the same two variables, with a Huber loss (``huber_k``) on its whitened residual:

=========================== ===================================================== ===========
residual                    definition                                            rows
=========================== ===================================================== ===========
trapezoidal, positions      S (q_k − q_{k−1} − Δt/2 (q̇_{k−1} + q̇_k))            g
trapezoidal, dynamics       S (q̇_k − q̇_{k−1} − Δt/2 (f_{k−1} + f_k))            g
position constraints        Φ(q_k)                                                m
velocity constraints        Φ_q(q_k) q̇_k                                         m
parameter random walks      [c, b, ε, p]_k − [c, b, ε, p]_{k−1}                   2g + K + P
each measurement j          h_j(x(t_j)) − y_j,  x(t_j) = (1−α) x_{k−1} + α x_k    dim_j
=========================== ===================================================== ===========

with S the selection of the independent coordinates z = S q and α = (t_j − t_{k−1})/Δt, so a
sample between two steps is used at its own time.  Integrating only z while Φ = 0 and Φ_q q̇ = 0
fix the dependent coordinates keeps the step's equations consistent: integrating every coordinate
as well as enforcing the constraints over-determines the step, and the least-squares compromise
makes the trajectory drift from the true dynamics (measured here: 1° in 1 s without sensors).  The
integrator sigmas follow from an acceleration noise σ_acc (unmodelled forces):
σ_q = σ_acc Δt²/2, σ_q̇ = σ_acc Δt.  When the model uncertainty of ``[estimator.model]`` is not (only)
learned as ε (``adapt = false`` or ``adapt_noise``), it adds its state-dependent acceleration noise to
the integrator rows instead (backends/uncertainty.py); each new sample's innovation against the step's
predicted state, with the newest smoothed variable's marginal covariance, feeds the consistency window
(backends/consistency.py) that sets the estimates' ``quality``.
A drive's torque (``[[drive]] input = "torque"``) is held in b: the random walk of b of the step that holds a new
value is offset by its change (backends/drive_inputs.py); one that arrives after its step joined the graph is
applied at the next step.
A run of ``jump_after`` samples of one sensor far off the prediction (but not wildly: a fault) is taken
for a jump of the DOF force (a crank held or released by hand): that step's random walk of b widens by
``jump_sigma_force``, like the filters' force jump (backends/filter.py).
The graph is solved by gtsam's ISAM2 with marginalisation of the variables older than the window
(backends/fixed_lag.py).  Several steps are added per ISAM2 update (``chunk_steps``), which amortises the
update cost; the declared output latency is the chunk length plus ``output_delay_ms``.
"""

from __future__ import annotations

import logging
import math
from collections import OrderedDict, deque
from dataclasses import dataclass, fields

import gtsam
import numpy as np

from estimator_service import kernels
from estimator_service.angles import wrap_angle
from estimator_service.backends.base import (Backend, Estimate, Measurement, dof_force, drive_jump_cov,
                                           drive_rate_sigma, params_from_dict, rate_jump_statistic, rate_jump_threshold)
from estimator_service.backends.consistency import ConsistencyMonitor
from estimator_service.backends.drive_inputs import HeldTorques
from estimator_service.backends.fixed_lag import FixedLag, fixed_lag_smoother
from estimator_service.backends.mount_test import MountTest
from estimator_service.backends.sensor_params import SensorParams
from estimator_service.backends.uncertainty import ModelUncertainty, parse_uncertainty
from estimator_service.errors import ConfigError
from estimator_service.model import AssemblyError, Model

log = logging.getLogger(__name__)


@dataclass
class FgsParams:
    """Parameters of the smoother (rig TOML table ``[estimator.fgs]``).

    Sigmas are standard deviations of the residual rows listed in the module docstring, in the
    residual's units (m or rad per coordinate kind; constraints in m² for distances, m for angles).
    """

    #: the variables: "independent" (x = [z, ż, c, b, ε, p] on the constraint manifold:
    #: backends/fgs_independent.py; as accurate, ~10x cheaper on a 20-body mechanism) or "dependent"
    #: (x = [q, q̇, c, b, ε, p] with the constraints as factor rows: the factor-graph paper's formulation)
    coordinates: str = "independent"
    window_ms: float = 20.0  #: smoother lag (ms); variables older than this are marginalised
    chunk_steps: int = 10  #: 1 ms steps added per ISAM2 update (10 = once per 100 Hz IMU sample)
    output_delay_ms: float = 0.0  #: emit the estimate this far behind the newest step (≤ window_ms less chunk_steps − 1 steps)
    sigma_acc: float = 0.1  #: unmodelled acceleration (m/s² or rad/s²) → integrator sigmas
    sigma_pc: float = 1e-6  #: position constraints Φ(q)
    sigma_vc: float = 1e-5  #: velocity constraints Φ_q q̇
    prior_sigma_q: float = 0.02  #: prior on q at initialisation (m / rad)
    prior_sigma_qd: float = 0.05  #: prior on q̇ at initialisation (m/s / rad/s)
    #: estimate the unknown DOF force τ = b − c ⊙ ż; false: c = b = 0, pinned (no force jumps either), as the
    #: filters' ``estimate_force = false``
    estimate_force: bool = True
    sigma_damping_rw: float = 0.0001  #: random walk of the unknown viscous coefficient c (N·m·s/rad per √s)
    prior_sigma_damping: float = 0.05  #: prior on c at initialisation (N·m·s/rad), mean 0
    sigma_force_rw: float = 0.0001  #: random walk of the unknown DOF force b (N·m/√s or N/√s)
    prior_sigma_force: float = 0.01  #: prior on b at initialisation (N·m or N), mean 0 (mass/inertia errors: the ε states)
    relinearize_threshold: float = 0.5  #: ISAM2 relinearisation threshold
    max_constraint_residual: float = 1e-3  #: |Φ| above this is divergence (→ re-initialisation)
    consistency_window_s: float = 0.5  #: sliding window of the innovation consistency check (s)
    outliers_to_reinit: int = 20  #: consecutive gated samples of one sensor that mean divergence
    gate_sigma: float = 10.0  #: outlier gate: a sample off the step's prediction by more than this many σ on a row is not used (0 = off)
    jump_after: int = 3  #: consecutive samples of one sensor off the step's prediction by ``jump_min_sigma``..``jump_max_sigma`` that mean the DOF force jumped (0 = never)
    jump_min_sigma: float = 10.0  #: a sample off by more than this many σ (on its worst row) counts towards a force jump
    jump_max_sigma: float = 100.0  #: a sample further off than this is a fault, not a force jump
    jump_sigma_force: float = 1.0  #: std of such a jump of b (N·m or N): a crank held or released by hand, a knock
    #: a driven DOF's rate jumped when a sample's innovation along it is this many σ off (0 = never, the default: the
    #: smoother follows a reversal over its window anyway, and on a gyro-only angle its jumps drifted the real yaw
    #: trial from 0.93° to 1.90° over 300 s; the filters' default is DRIVE_JUMP_SIGMA)
    drive_jump_sigma: float = 0.0
    huber_k: float = 3.0  #: Huber threshold (whitened units) of every sensor factor's robust loss (0 = plain least squares)

    @classmethod
    def from_dict(cls, file: str, section: str, d: dict) -> FgsParams:
        """Build from a TOML table (ConfigError on unknown keys and bad values)."""
        zero_ok = {"output_delay_ms", "sigma_force_rw", "sigma_damping_rw", "gate_sigma", "huber_k", "jump_after", "drive_jump_sigma"}
        out = params_from_dict(cls, file, section, d, frozenset(f.name for f in fields(cls)) - zero_ok,
                               {"coordinates": COORDINATES})
        return out  # (output_delay_ms against the window: FixedLagSmoother, which knows dt)


#: force jumps one sensor makes in a row, none of its samples fused in between, that mean it is locked out: the
#: jumps did not bring the prediction back within the gate (a window of 10 or 19 steps after a held crank: the
#: crank encoder 1.5° off for good, a jump every 6 ms).  Its moderate disagreements (up to ``jump_max_sigma``) are
#: then fused, their pull bounded by the Huber loss, until a sample is back within the gate or ADMIT_STEPS have
#: passed.  A release makes ~10 jumps in a row at the default window; 5 here broke that case, 12 and 20 did not.
LOCKOUT_JUMPS = 20
ADMIT_STEPS = 500
#: fewest steps between two force jumps.  A release made a jump every 3 steps (~10 in 30 ms), each widening b's
#: walk by ``jump_sigma_force`` on its step; a window of 29 or 30 steps held them all at once, b fitted the noise
#: and the smoother diverged 1.9 s later (31 re-initialisations, 198° off).  With 4: every window from 10 to 30
#: steps recovers (0.02° 2 s after the release), the release's largest error 0.39 → 0.48° at the default window
#: (6: 0.58°, 10: 0.80°).
JUMP_SPACING_STEPS = 4

#: the sigma of a parameter held constant (a zero random walk) or pinned (a zero prior): gtsam's noise
#: models need a positive sigma
PINNED_SIGMA = 1e-9

#: the smoother's choices of variables (FgsParams.coordinates)
COORDINATES = ("independent", "dependent")


def make_smoother(model: Model, sensors: list, config) -> FixedLagSmoother:
    """The fixed-lag smoother of ``[estimator.fgs] coordinates``: over independent coordinates
    (backends/fgs_independent.py, the default) or over the dependent ones with constraint rows."""
    source = getattr(config, "source", "rig")
    params = FgsParams.from_dict(source, "estimator.fgs", getattr(config, "fgs", {}) or {})
    if params.coordinates == "independent":
        from estimator_service.backends.fgs_independent import IndependentSmoother

        return IndependentSmoother(model, sensors, config)
    return FixedLagSmoother(model, sensors, config)


#: the model-noise density of the dynamics factors is re-evaluated every this many seconds of steps
#: (half the default model-error correlation time ``error_time_s``)
MODEL_NOISE_EVERY_S = 0.01
#: longest interval (s) between two refreshes of the newest variable's marginal covariance for the
#: consistency check; after a (re)start the interval is half the time since, up to this (the posterior
#: shrinks fast at first, then follows the configuration slowly).  Each refresh costs ~0.1 ms on the generational
#: smoother (the newest key is the root: backends/fixed_lag.py), ~0.3 ms on gtsam's (ISAM2's shortcuts through
#: the Bayes tree), 0.1–0.3 µs per 1 ms of data at this rate (26 refreshes in a 20 s run); refreshing every 50 ms flags
#: the same runs (crank inertia 50 % off: first flag 0.38 s either way; the 20 s public scenario: 20
#: against 10 of 20000 estimates flagged, one excursion of the NIS either way)
COVARIANCE_EVERY_S = 1.0


def _X(k: int) -> int:
    return gtsam.symbol("x", k)


#: entries of a smoother's per-state cache (neighbouring factors and the gate share their variables'
#: model evaluations; the window and a chunk hold ~30 distinct states)
STATE_CACHE = 256


def remember(cache: OrderedDict, key: bytes, value) -> None:
    """Insert into a per-state cache of at most ``STATE_CACHE`` entries, forgetting the oldest: one entry
    at a time (clearing all 256 at once freed their arrays in one go, ~1.6 ms profiled: a p99 step).  An
    OrderedDict: a plain dict finds its oldest entry past the slots of the ones deleted before it
    (~5 µs per insert measured here)."""
    if len(cache) >= STATE_CACHE:
        cache.popitem(last=False)
    cache[key] = value


def _innovation_cov(H: np.ndarray, P: np.ndarray, sigma: np.ndarray) -> np.ndarray:
    """Covariance of one sample's innovation: rows ∂y/∂x ``H``, the prediction's covariance ``P``, row sigmas."""
    return H @ P @ H.T + np.diag(np.square(sigma))


class FixedLagSmoother(Backend):
    """gtsam fixed-lag smoother over x = [q, q̇, c, b, ε, p] at every step; see the module docstring."""

    name = "fgs"
    kernel_kind = "smoother"

    def __init__(self, model: Model, sensors: list, config) -> None:
        super().__init__(model, sensors, config)
        source = getattr(config, "source", "rig")
        self.params = FgsParams.from_dict(source, "estimator.fgs", getattr(config, "fgs", {}) or {})
        #: the residuals' dynamics compiled (kernels.compile_model), or None: the model's numpy reference
        self.kernel = kernels.compile_model(model, self.kernel_kind)
        self.compiled = self.kernel is not None
        p, n = self.params, model.n
        self._n = n
        self.sp = SensorParams(sensors)
        self.mounts = MountTest(self.sp)  #: the accelerometers' mounts, held until contradicted
        self.held = HeldTorques(model.g, sensors)  #: the drives' torques, held between their messages (b carries them)
        #: the sensors' arrays for the compiled measurement model (kernels.measurement.measure_sensors; None: kernels
        #: off), with H over the smoother's x = [q, q̇, …]: ∂q/∂x = [I, 0, …], ∂q̇/∂x = [0, I, …], ∂q̈/∂x = F
        self._table = self.sp.sensor_table() if self.compiled else None
        self._id_arrays = [np.array([i], dtype=np.int64) for i in range(len(sensors))]
        self._eye_n, self._zero_nn = np.eye(model.n), np.zeros((model.n, model.n))
        #: (worst row in σ, NIS, standardised rows) of a sample against the step's prediction (the gate)
        self._gate_stats = kernels.compiled_or_python(kernels.gate_stats, self.compiled)
        self.uncertainty = ModelUncertainty(model, parse_uncertainty(source, getattr(config, "model", {}) or {}, model))
        #: the model's parameter-error directions of ε (backends/uncertainty.py)
        self._dMs, self._dQs = (np.ascontiguousarray(a) for a in self.uncertainty.directions())
        table = getattr(config, "fgs", {}) or {}
        #: prior std of the damping coefficient: the key if given, else the model's friction range
        self._sigma_c0 = p.prior_sigma_damping if "prior_sigma_damping" in table else self.uncertainty.params.friction_max
        self._sigma_b0 = p.prior_sigma_force
        if not p.estimate_force:  # c and b held at 0 by priors and walks at the floor of a constant
            self._sigma_c0 = self._sigma_b0 = PINNED_SIGMA
        self.consistency = ConsistencyMonitor([f"{s.name}.{s.kind}" for s in sensors], p.consistency_window_s)
        self.jumps = 0  #: force jumps assumed so far (:meth:`_gate`; est/diag)
        self._window_steps = max(2, int(round(p.window_ms * 1e-3 / self.dt)))
        self._delay_steps = int(round(p.output_delay_ms * 1e-3 / self.dt))
        # an update emits its chunk's steps output_delay_ms back: the oldest of them must still be in the window
        # (else it is marginalised unseen: a delay of 19 ms at the default window and chunk emitted 2 in 10)
        latest = self._window_steps - p.chunk_steps + 1
        if self._delay_steps > 0 and self._delay_steps > latest:
            raise ConfigError(source, "estimator.fgs.output_delay_ms",
                              f"must be <= window_ms less chunk_steps - 1 steps ({max(0, latest) * self.dt * 1e3:g} ms "
                              f"with window_ms {p.window_ms:g}, chunk_steps {p.chunk_steps}, dt {self.dt * 1e3:g} ms), "
                              f"got {p.output_delay_ms:g}")
        self.output_latency_s = (p.chunk_steps - 1) * self.dt + self._delay_steps * self.dt
        self._setup_layout()
        self._pending: list[Measurement] = []
        self._smoother: FixedLag | None = None
        self._f_cache: OrderedDict[bytes, tuple[np.ndarray, np.ndarray]] = OrderedDict()
        #: model-noise density² (g,) and the step it was evaluated at (see :meth:`_model_noise`)
        self._q2: np.ndarray | None = None
        self._q2_k = 0
        self._q2_every = max(1, int(round(MODEL_NOISE_EVERY_S / self.dt)))
        #: (first step?, the model-noise density it used, the noise model) of the last step factor (:meth:`_make_factor`)
        self._dyn_noise: tuple | None = None
        #: each sensor's sample noise model (with the Huber loss), made at its first sample
        self._sample_noise: list[gtsam.noiseModel.Base | None] = [None] * len(sensors)

    # ------------------------------------------------------------------ state layout
    def _walk_sigmas(self) -> np.ndarray:
        """Per-step sigmas of the random walks of [c, b, ε, p] (a zero walk: a nearly constant parameter)."""
        p, g, dt = self.params, self.model.g, self.dt
        force = 1.0 if p.estimate_force else 0.0
        return np.concatenate([np.full(g, max(force * p.sigma_damping_rw * np.sqrt(dt), PINNED_SIGMA)),
                               np.full(g, max(force * p.sigma_force_rw * np.sqrt(dt), PINNED_SIGMA)),
                               np.full(self.uncertainty.dim, max(self.uncertainty.params.walk * np.sqrt(dt), PINNED_SIGMA)),
                               np.maximum(self.sp.walk * np.sqrt(dt), PINNED_SIGMA)])

    def _blocks(self) -> tuple[np.ndarray, int]:
        """(which of q the variable holds, constraint rows per kind in a step factor): here all of q, with the
        position and velocity constraints as rows (m each)."""
        return np.arange(self._n), self.model.m

    def _setup_layout(self) -> None:
        """The layout of x and of a step factor's rows: x = [q_c, q̇_c, c, b, ε, p] with q_c the coordinates
        of :meth:`_blocks` (nc of them); rows = integrator of the DOF (2g), constraints (2 × its rows),
        random walks of [c, b, ε, p].  Sets the indices of ε and p (``_e0``, ``_p0``), the size ``_dim``, the
        rows' base sigmas, where the walks start (``_walk0``) and b's rows (``_b_rows``), and the constant
        part of the step factor's Jacobians."""
        p, model, g, dt = self.params, self.model, self.model.g, self.dt
        coords, mc = self._blocks()
        nc, K = len(coords), self.uncertainty.dim
        self._coords = coords
        self._e0, self._p0 = 2 * nc + 2 * g, 2 * nc + 2 * g + K
        P = K + self.sp.dim  # parameters after [c, b]: random walks
        self._dim = 2 * nc + 2 * g + P
        self._walk0 = 2 * g + 2 * mc
        self._b_rows = slice(self._walk0 + g, self._walk0 + 2 * g)
        #: columns of x holding the driven DOFs' rates, and their jump test's threshold (:meth:`_drive_jumped`)
        driven = np.flatnonzero(model.driven)
        self._rate_cols = nc + np.array([int(np.flatnonzero(coords == d)[0]) for d in model.dof[driven]], dtype=np.int64)
        self._jump_threshold = rate_jump_threshold(p.drive_jump_sigma, len(driven)) if len(driven) else np.inf
        self._b_at = slice(2 * nc + g, 2 * nc + 2 * g)  #: where b is in x
        # a driven DOF's unknown acceleration (white, density ρ): σ_q² += ρ² Δt³/3, σ_v² += ρ² Δt, as the model noise
        rho2 = np.square(model.drive_density)
        self._base_sigmas = np.concatenate([
            np.sqrt((p.sigma_acc * dt * dt / 2) ** 2 + rho2 * dt**3 / 3), np.sqrt((p.sigma_acc * dt) ** 2 + rho2 * dt),
            np.full(mc, p.sigma_pc), np.full(mc, p.sigma_vc), self._walk_sigmas()])
        # Constant part of the Jacobians (integrator and random-walk rows); S selects the DOF from q_c.
        nb = self._walk0 + 2 * g + P
        #: where the DOF coordinates are in q_c
        self._dof_at = np.array([int(np.flatnonzero(coords == d)[0]) for d in model.dof], dtype=np.int64)
        S = np.eye(nc)[self._dof_at]
        self._J_prev0 = np.zeros((nb, self._dim))
        self._J_prev0[:g, :nc] = -S
        self._J_prev0[:g, nc : 2 * nc] = -dt / 2 * S
        self._J_prev0[g : 2 * g, nc : 2 * nc] = -S
        self._J_prev0[self._walk0 :, 2 * nc :] = -np.eye(2 * g + P)
        self._J_cur0 = -self._J_prev0
        self._J_cur0[:g, nc : 2 * nc] = -dt / 2 * S

    def _initial_state(self, q: np.ndarray, qd: np.ndarray, params: np.ndarray) -> np.ndarray:
        """x at a start from (q, q̇) with c = b = 0 and the parameters [ε, p] = ``params``."""
        return np.concatenate([q[self._coords], qd[self._coords], np.zeros(2 * self.model.g), params])

    def _prior_sigmas(self) -> np.ndarray:
        """Sigmas of the prior on the first variable, in the layout of x."""
        p, nc, g = self.params, len(self._coords), self.model.g
        qd = np.full(nc, p.prior_sigma_qd)
        qd[self._dof_at] = np.hypot(qd[self._dof_at], drive_rate_sigma(self.model))  # a drive may be running
        var = self.held.prior()[1]  # (a stale drive torque: uncertain by the largest stated)
        b = np.where(var > 0, np.sqrt(self._sigma_b0**2 + var), self._sigma_b0)
        return np.concatenate([np.full(nc, p.prior_sigma_q), qd, np.full(g, self._sigma_c0), b,
                               np.ones(self.uncertainty.dim), self.mounts.prior()])

    def _first_prior(self) -> gtsam.PriorFactorVector:
        """The prior factor on the first variable (:meth:`_prior_sigmas`; the mounts held or released as now)."""
        return gtsam.PriorFactorVector(_X(self._k0), self._prior_mean,
                                       gtsam.noiseModel.Diagonal.Sigmas(self._prior_sigmas()))

    def _q_qd(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(q, q̇) of a state x."""
        return x[: self._n], x[self._n : 2 * self._n]

    def _positions(self, xs: list[np.ndarray]) -> list[tuple[np.ndarray, np.ndarray]]:
        """(q, q̇) of each state of a chunk's estimates (:meth:`_q_qd`)."""
        return [self._q_qd(x) for x in xs]

    def _state_problem(self, x: np.ndarray) -> str | None:
        """Why a finite smoothed state means divergence (the constraints broken beyond ``max_constraint_residual``),
        or None."""
        if np.max(np.abs(self.model.Phi(x[: self._n]))) > self.params.max_constraint_residual:
            return "constraint residual blow-up in the smoother estimate"
        return None

    def _restart_pose(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(q, q̇) to restart from at a last good state x, projected on the constraints."""
        n = self._n
        q = self.model.solve_position(x[:n], x[:n][self.model.dof])
        return q, self.model.solve_velocity(q, x[n : 2 * n][self.model.dof])

    def _qdd_R(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(q̈, R = ∂q/∂z) at x, for the model error's acceleration noise."""
        return self._accel(x), self.model.R(x[: self._n])

    def _step_noise(self, x: np.ndarray, s2: np.ndarray) -> np.ndarray:
        """Covariance (dim, dim) that one step adds to the predicted state at x, from the step factor's
        squared row sigmas ``s2``: the integrator rows' noise on q and q̇ through R(q), the random walks."""
        n, g = self._n, self.model.g
        R = self.model.R(x[:n])
        Q = np.zeros((self._dim, self._dim))
        Q[:n, :n] = (R * s2[:g]) @ R.T
        Q[n : 2 * n, n : 2 * n] = (R * s2[g : 2 * g]) @ R.T
        Q[2 * n :, 2 * n :] = np.diag(s2[self._walk0 :])
        return Q

    # ------------------------------------------------------------------ residuals
    def _dynamics(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(q̈, ∂q̈/∂x) at x = [q, q̇, c, b, ε, p]; cached, since neighbouring factors share their variable."""
        key = x.tobytes()
        hit = self._f_cache.get(key)
        if hit is not None:
            return hit
        if self.kernel is not None:
            out = self.kernel.fgs_dynamics(x, self._dMs, self._dQs)
        else:
            model, n, g, dof = self.model, self._n, self.model.g, self.model.dof
            qd = x[n : 2 * n]
            c = x[2 * n : 2 * n + g]
            tau, M = self._forces_and_mass(x)
            f, df_dq, df_dqd, df_dtau = model.forward_dynamics_jac_tau(x[:n], qd, tau, M)
            G = df_dtau[:, dof]  # ∂q̈/∂τ_dof
            df_dqd[:, dof] -= G * c
            df_deps = df_dtau @ (self._dQs - self._dMs @ f).T  # ∂q̈/∂ε_k = ∂q̈/∂τ (dQ_k − dM_k q̈)
            out = (f, np.hstack([df_dq, df_dqd, -G * qd[dof], G, df_deps, np.zeros((n, self.sp.dim))]))
        remember(self._f_cache, key, out)
        return out

    def _step_residual(self, xp: np.ndarray | None, xc: np.ndarray,
                       want_jac: bool) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
        """Residual of one step's dynamics rows (see module docstring) and its Jacobians w.r.t. x_{k-1}
        and x_k.  ``xp`` is None for the first step: its integrator and random-walk rows are zero.
        """
        model, n, m, g, dt = self.model, self._n, self.model.m, self.model.g, self.dt
        if self.kernel is not None:
            return self.kernel.fgs_step(xp, xc, dt, None if xp is None else self._dynamics(xp), self._dynamics(xc),
                                          self._J_prev0, self._J_cur0, want_jac)
        q, qd = xc[:n], xc[n : 2 * n]
        fc, Fc = self._dynamics(xc)
        Phi_q = model.Phi_q(q)
        dof = model.dof
        if xp is not None:
            fp, Fp = self._dynamics(xp)
            head = [(q - xp[:n] - dt / 2 * (xp[n : 2 * n] + qd))[dof],
                    (qd - xp[n : 2 * n] - dt / 2 * (fp + fc))[dof]]
            walk = xc[2 * n :] - xp[2 * n :]
        else:
            head, walk = [np.zeros(2 * g)], np.zeros(self._dim - 2 * n)
        rows = head + [model.Phi(q), Phi_q @ qd, walk]
        Jp = Jc = None
        if want_jac:
            if xp is not None:
                Jp, Jc = self._J_prev0.copy(), self._J_cur0.copy()
                Jp[g : 2 * g] -= dt / 2 * Fp[dof]
                Jc[g : 2 * g] -= dt / 2 * Fc[dof]
            else:
                Jp, Jc = np.zeros_like(self._J_prev0), np.zeros_like(self._J_cur0)
            r = 2 * g
            Jc[r : r + m, :n] = Phi_q
            Jc[r + m : r + 2 * m, :n] = model.hess_contract(q, qd)
            Jc[r + m : r + 2 * m, n : 2 * n] = Phi_q
        return np.concatenate(rows), Jp, Jc

    def _measurement_residual(self, xp: np.ndarray | None, xc: np.ndarray, meas: list[tuple[float, Measurement]],
                              want_jac: bool) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
        """Measurement rows h_j(x(t_j), p) − y_j of one step (sensor parameters p: backends/sensor_params.py),
        angles (encoders, inclinations) wrapped to [−π, π), and their Jacobians w.r.t. x_{k-1}, x_k."""
        rows = [self._sample_rows(xp, xc, alpha, mm, want_jac) for alpha, mm in meas]
        if len(rows) == 1:  # (a sample's own factor, the gate)
            return rows[0]
        e = np.concatenate([r[0] for r in rows])
        if not want_jac:
            return e, None, None
        return e, None if xp is None else np.vstack([r[1] for r in rows]), np.vstack([r[2] for r in rows])

    def _sample_rows(self, xp: np.ndarray | None, xc: np.ndarray, alpha: float, mm: Measurement,
                     want_jac: bool) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
        """One sample's rows of :meth:`_measurement_residual` at x(t) = (1 − α) x_{k−1} + α x_k (x_k alone at the
        first step and for the gate: ``xp`` None) and their Jacobians w.r.t. x_{k−1} (None without x_{k−1}) and x_k."""
        a = 1.0 if xp is None else alpha
        y, H = self._measure(xc if a == 1.0 else (1.0 - a) * xp + a * xc, mm.sensor, want_jac)
        e = y - mm.y
        if self.sensors[mm.sensor].kind in ("enc", "incl"):  # angles
            e = wrap_angle(e)
        if not want_jac:
            return e, None, None
        return (e, None, H) if xp is None else (e, H * (1.0 - a), H * a)

    def _measure(self, x: np.ndarray, sensor: int, want_jac: bool) -> tuple[np.ndarray, np.ndarray | None]:
        """(y, H = ∂y/∂x or None): sensor ``sensor``'s predicted reading at x = [q, q̇, …, p]."""
        n = self._n
        f, F = self._dynamics(x)
        if self._table is not None and self._table.covers(sensor):  # compiled: H over x = [q, q̇, …] directly
            return self.kernel.measure_sensors(
                self._id_arrays[sensor], np.ascontiguousarray(x[:n]), np.ascontiguousarray(x[n : 2 * n]), f,
                x[self._p0 :], self._table, (self._eye_n, self._zero_nn, F) if want_jac else None, self._p0)
        y, H_q, H_qd, H_qdd, H_p = self.sp.measure(sensor, x[:n], x[n : 2 * n], f, x[self._p0 :], want_jac)
        if not want_jac:
            return y, None
        return y, np.hstack([H_q, H_qd, np.zeros((len(y), self._p0 - 2 * n)), H_p]) + H_qdd @ F

    def _sigmas(self, first: bool, x_guess: np.ndarray) -> np.ndarray:
        """Row sigmas of a step's dynamics factor; the integrator rows add the model error's acceleration
        noise (backends/uncertainty.py) at the step's predicted state ``x_guess``."""
        s = self._base_sigmas.copy()
        g, dt = self.model.g, self.dt
        if first:  # no integrator or random-walk rows at the first step (residual is 0)
            s[: 2 * g] = 1.0
            s[self._walk0 :] = 1.0
        elif self.uncertainty.noise_enabled:
            q2 = self._model_noise(x_guess)
            s[:g] = np.sqrt(s[:g] ** 2 + q2 * dt**3 / 3)
            s[g : 2 * g] = np.sqrt(s[g : 2 * g] ** 2 + q2 * dt)
        return s

    def _model_noise(self, x: np.ndarray) -> np.ndarray:
        """Diagonal (g,) of the model error's acceleration noise density² at x ((rad/s²)²·s).

        Evaluated at most once per ``MODEL_NOISE_EVERY_S`` of steps (it follows the motion, which
        changes little within the model error's correlation time) and reused in between.
        """
        if self._q2 is None or self._k - self._q2_k >= self._q2_every:
            self._q2 = np.diag(self.uncertainty.accel_density2(*self._qdd_R(x))).copy()
            self._q2_k = self._k
        return self._q2

    def _make_factor(self, k: int, x_guess: np.ndarray, inputs: tuple | None = None) -> gtsam.CustomFactor | None:
        """Step k's dynamics factor (integrator, constraints, random walks; b's walk widened by
        ``jump_sigma_force`` on a step where the sensors said the DOF force jumped); None when the first
        step has no rows of its own (a layout without constraint rows).  ``inputs`` = (Δu, variance) (g,) of the
        drives' torques on this step (:meth:`_step_inputs`): b's walk offset by Δu, widened by the variance."""
        first = k == self._k0
        g = self.model.g
        du, var = inputs if inputs is not None and not first else (None, None)
        if (self._jump_pending or self._drive_jump_h is not None or self._mount_release or var is not None and var.any()) \
                and not first:
            sigmas = self._sigmas(first, x_guess)
            b = self._b_rows
            if self._jump_pending:
                sigmas[b] = np.hypot(sigmas[b], self.params.jump_sigma_force)
                # a driven DOF's force is the drive's: its rate may have jumped instead
                sigmas[g : 2 * g] = np.hypot(sigmas[g : 2 * g], drive_rate_sigma(self.model))
            if self._drive_jump_h is not None:  # a drive's jump since the sample before (:meth:`_gate`)
                jump = np.sqrt(np.diag(drive_jump_cov(self.model, self._drive_jump_h)))
                sigmas[: 2 * g] = np.hypot(sigmas[: 2 * g], jump)
            if var is not None:  # a stale drive torque's b walks
                sigmas[b] = np.sqrt(sigmas[b] ** 2 + var)
            for j in self._mount_release:  # a held mount the readings contradict: free from here on
                row = self._walk0 + 2 * g + self.uncertainty.dim + j
                sigmas[row] = np.hypot(sigmas[row], self.sp.prior[j])
            self._jump_pending, self._drive_jump_h, self._mount_release = False, None, []
            noise = gtsam.noiseModel.Diagonal.Sigmas(sigmas)
        else:  # the same sigmas until the model noise is re-evaluated (:meth:`_model_noise`): one noise model
            q2 = self._model_noise(x_guess) if not first and self.uncertainty.noise_enabled else None
            cached = self._dyn_noise
            if cached is None or cached[0] != first or cached[1] is not q2:
                cached = self._dyn_noise = (first, q2, gtsam.noiseModel.Diagonal.Sigmas(self._sigmas(first, x_guess)))
            noise = cached[2]
        if du is None or not du.any():
            return self._custom_factor(k, noise, self._step_residual)
        rows = self._b_rows

        def offset(xp: np.ndarray | None, xc: np.ndarray, want_jac: bool) -> tuple:
            e, Jp, Jc = self._step_residual(xp, xc, want_jac)
            e[rows] -= du  # b_k − b_{k−1} − Δu (a fresh array)
            return e, Jp, Jc

        return self._custom_factor(k, noise, offset)

    def _measurement_factor(self, k: int, alpha: float, m: Measurement) -> gtsam.CustomFactor:
        """One sample's factor on step k (its interval), with the Huber loss of ``huber_k`` on its
        whitened residual (a sample off by more than that many σ counts linearly, not quadratically)."""
        noise = self._sample_noise[m.sensor]
        if noise is None:  # (one per sensor)
            noise = gtsam.noiseModel.Diagonal.Sigmas(self._sigma(m.sensor))
            if self.params.huber_k > 0:
                noise = gtsam.noiseModel.Robust.Create(gtsam.noiseModel.mEstimator.Huber.Create(self.params.huber_k), noise)
            self._sample_noise[m.sensor] = noise
        meas = [(alpha, m)]
        return self._custom_factor(k, noise, lambda xp, xc, jac: self._measurement_residual(xp, xc, meas, jac))

    def _custom_factor(self, k: int, noise: gtsam.noiseModel.Base, residual) -> gtsam.CustomFactor:
        """A gtsam CustomFactor on step k's state (and step k-1's, except at the window's first step)
        for ``residual(x_prev or None, x_k, jac) -> (e, J_prev, J_k)``."""
        key_c = _X(k)  # (the factor's keys: closed over, not asked of gtsam at every linearisation)
        if k == self._k0:
            def unary(this: gtsam.CustomFactor, values: gtsam.Values, H: list | None) -> np.ndarray:
                e, _, Jc = residual(None, values.atVector(key_c), H is not None)
                if H is not None:
                    H[0] = Jc
                return e

            return gtsam.CustomFactor(noise, [key_c], unary)

        key_p = _X(k - 1)

        def binary(this: gtsam.CustomFactor, values: gtsam.Values, H: list | None) -> np.ndarray:
            e, Jp, Jc = residual(values.atVector(key_p), values.atVector(key_c), H is not None)
            if H is not None:
                H[0] = Jp
                H[1] = Jc
            return e

        return gtsam.CustomFactor(noise, [key_p, key_c], binary)

    # ------------------------------------------------------------------ Backend interface
    def initialize(self, t0: float, q: np.ndarray, qd: np.ndarray) -> None:
        """Start a new graph at time ``t0`` (s) from (q, q̇); q̈ from the model."""
        super().initialize(t0, q, qd)
        p = self.params
        params = gtsam.ISAM2Params()
        params.setRelinearizeThreshold(p.relinearize_threshold)
        params.relinearizeSkip = 1
        # reuse the slots of marginalised factors: ISAM2 otherwise keeps every slot it ever filled (~1000
        # more per second here), and its memory and update cost grow with run time
        params.findUnusedFactorSlots = True
        params.setFactorization("QR")  # Cholesky loses the weakly determined DOF (sigmas span 1e-7..1)
        self._smoother = fixed_lag_smoother(self._window_steps, p.chunk_steps, self.dt, params)
        self._k0 = self._k = self._k_updated = 0
        self._q2, self._dyn_noise = None, None
        # measurements buffered before t0 belong to the time before a reset: never fused at the new start
        self._pending = [m for m in self._pending if m.t >= t0 - 1e-9]
        self._t0 = t0
        self._step_inputs(t0)  # (the drives' torques up to t0 are held from the start: b's prior)
        self._x_last = self._initial_state(q, qd, getattr(self, "_p_keep", np.zeros(self._dim - self._e0)))
        self._x_last[self._b_at] += self.held.prior()[0]
        self._chunk_graph = gtsam.NonlinearFactorGraph()
        self._chunk_values = gtsam.Values()
        self._chunk_stamps: dict[int, float] = {}
        self._chunk_keys: list[int] = []
        #: the first variable's prior (mean; its slot in ISAM2, None while it is factor 0 of the chunk graph)
        self._prior_mean, self._prior_slot = self._x_last.copy(), None
        self._reprior = False  #: the next update replaces that prior (a mount released while it is in the window)
        self._chunk_graph.add(self._first_prior())
        self._jump_pending = False  # the next step's factor lets the DOF force b jump (:meth:`_gate`)
        #: the next step's factor lets a driven DOF's rate jump, at an unknown time within this many s (:meth:`_gate`)
        self._drive_jump_h: float | None = None
        #: indices into p of the mounts the next step's factor frees (:meth:`_mount_contradicted`)
        self._mount_release: list[int] = []
        self.mounts.reset()
        self._t_sample = [t0] * len(self.sensors)  # time of each sensor's last sample (s)
        self._x_last = self._add_step_variable(0, self._x_last)
        self._recent: deque[tuple[int, np.ndarray]] = deque(maxlen=self._window_steps + 1)
        self._recent.append((0, self._x_last.copy()))
        # covariance of the newest variable: the prior's until ISAM2 gives the first marginal, so the gate and the
        # consistency check see how uncertain the start is (gating against the sensor σ alone rejected a driven
        # rig's every sample after a start: a storm of re-initialisations)
        self._P_newest: np.ndarray | None = np.diag(self._prior_sigmas() ** 2)
        self._P_k = 0  # its step
        self._Q_step = self._step_noise(self._x_last, self._sigmas(False, self._x_last) ** 2)
        self._gated_run = [0] * len(self.sensors)  # consecutive gated samples per sensor
        self._off_run = [0] * len(self.sensors)  # consecutive samples off by jump_min_sigma..jump_max_sigma
        #: per sensor, the last step until which its moderate disagreements are fused after force jumps (:meth:`_gate`)
        self._admit_until = [-1] * len(self.sensors)
        self._jump_run = [0] * len(self.sensors)  # force jumps a sensor made in a row without being fused in between
        self._last_jump_k = -JUMP_SPACING_STEPS  # the step of the last force jump
        self.consistency.reset()

    def _add_step_variable(self, k: int, x_guess: np.ndarray) -> np.ndarray:
        """Step k's variable with the guess ``x_guess``, its dynamics factor and the factors of its samples that
        pass the gate; returns the guess, its b moved by the drives' torques held from this step."""
        inputs = self._step_inputs(self._t0 + k * self.dt) if k != self._k0 else None
        if inputs is not None and inputs[0].any():
            x_guess = x_guess.copy()
            x_guess[self._b_at] += inputs[0]
        meas = self._gate(self._take_measurements(k), x_guess)
        factor = self._make_factor(k, x_guess, inputs)
        if factor is not None:
            self._chunk_graph.add(factor)
        for alpha, mm in meas:
            self._chunk_graph.add(self._measurement_factor(k, alpha, mm))
        self._chunk_values.insert(_X(k), x_guess)
        self._chunk_stamps[_X(k)] = self._t0 + k * self.dt
        self._chunk_keys.append(k)
        return x_guess

    def _step_inputs(self, t_k: float) -> tuple[np.ndarray, np.ndarray] | None:
        """The drives' torques of the pending messages up to the step at ``t_k`` (s) held (taken from the pending
        ones), and those held longer than their age gone stale: (Δu (g,), the variance (g,) a stale torque's b walks
        by in the step), or None without torque drives (backends/drive_inputs.py)."""
        if not self.held:
            return None
        due = sorted((m for m in self._pending if self.sensors[m.sensor].is_input and m.t <= t_k + 1e-9),
                     key=lambda m: m.t)
        du = np.zeros(self.model.g)
        if due:
            self._pending = [m for m in self._pending if not (self.sensors[m.sensor].is_input and m.t <= t_k + 1e-9)]
            for m in due:
                du += self.held.apply(m)
        self.held.expire(t_k)
        return du, self.held.walk() * self.dt

    def _gate(self, meas: list[tuple[float, Measurement]], x: np.ndarray) -> list[tuple[float, Measurement]]:
        """The samples whose whitened residual at the step's predicted state ``x`` stays within
        ``gate_sigma`` on every row; the others are counted as gated (est/diag) and not used.  Each kept
        sample's NIS against the prediction (:meth:`_predicted_cov`) feeds the consistency window."""
        if not meas or self._k == self._k0:
            return meas
        if self.consistency.scale_changed:  # noise adaptation (backends/consistency.py): new sample noise models
            self.consistency.scale_changed = False
            self._sample_noise = [None] * len(self.sensors)
        p, P = self.params, self._predicted_cov()
        gate = p.gate_sigma
        out = []
        for alpha, mm in meas:
            e, _, H = self._sample_rows(None, x, 1.0, mm, P is not None)
            sigma = self._sigma(mm.sensor)
            # r: the worst row in the sensor's σ (force jumps, admission); r_gate: in σ of its innovation, the
            # prediction's uncertainty included (the gate: a driven DOF's rate is uncertain by tens of sensor σ)
            if P is not None:
                r, nis, z = self._gate_stats(e, H, P, sigma)
                r_gate = float(np.max(np.abs(z)))
            else:
                r = r_gate = float(np.max(np.abs(e) / sigma))
            # a sensor locked out by its own force jumps (LOCKOUT_JUMPS): its moderate disagreement is fused
            admitted = self._k <= self._admit_until[mm.sensor] and gate < r <= p.jump_max_sigma
            if gate <= 0 or r_gate <= gate or admitted:
                out.append((alpha, mm))
                self._gated_run[mm.sensor] = 0
                if not admitted:
                    self._admit_until[mm.sensor] = -1  # (back within the gate: settled)
                    self._jump_run[mm.sensor] = 0
                if P is not None:
                    self.consistency.add(mm.t, mm.sensor, float(nis), len(e), z)
                    self._drive_jumped(mm, e, H, P, sigma, float(nis), r)
                    self._mount_contradicted(mm, e, H, P, sigma)
                if gate <= 0 or admitted:
                    self._off_run[mm.sensor] = 0
                    continue
            else:
                self.consistency.reject(mm.t, mm.sensor, float(nis) if P is not None else None, len(e))
                self._gated_run[mm.sensor] += 1
            # a run of moderate disagreements is a force the model lacks (a crank held or released by hand):
            # let b jump on this step rather than reject the sensor until the divergence rule resets the graph
            self._off_run[mm.sensor] = self._off_run[mm.sensor] + 1 if p.jump_min_sigma < r <= p.jump_max_sigma else 0
            if p.estimate_force and 0 < p.jump_after <= self._off_run[mm.sensor] and \
                    self._k - self._last_jump_k >= JUMP_SPACING_STEPS:
                self._jump_pending = True
                self._last_jump_k = self._k
                self._jump_run[mm.sensor] += 1
                if self._jump_run[mm.sensor] >= LOCKOUT_JUMPS:
                    self._admit_until[mm.sensor] = self._k + ADMIT_STEPS
                self._gated_run = [0] * len(self.sensors)
                self._off_run = [0] * len(self.sensors)
                self.jumps += 1
        return out

    def _drive_jumped(self, mm: Measurement, e: np.ndarray, H: np.ndarray, P: np.ndarray, sigma: np.ndarray,
                      nis: float, r: float) -> None:
        """A driven DOF's rate jumped (a motor's reversal, start or stop) when a fused sample's innovation ``e``
        (rows ∂y/∂x ``H``, the prediction's covariance ``P``, its row sigmas) points along the reading's sensitivity
        to that rate beyond ``drive_jump_sigma`` (:func:`rate_jump_statistic`, computed only when its NIS could
        exceed that) and is no fault (``r``, in sensor σ, up to ``jump_max_sigma``): this step's factor widens (z, ż)
        by :func:`drive_jump_cov` over the time since the sensor's sample before.  Counted in ``force_jumps``."""
        t_prev, self._t_sample[mm.sensor] = self._t_sample[mm.sensor], mm.t
        if self._drive_jump_h is not None or not nis > self._jump_threshold or r > self.params.jump_max_sigma:
            return
        if rate_jump_statistic(e, _innovation_cov(H, P, sigma), H[:, self._rate_cols]) > self._jump_threshold:
            self._drive_jump_h = mm.t - t_prev
            self.jumps += 1

    def _mount_contradicted(self, mm: Measurement, e: np.ndarray, H: np.ndarray, P: np.ndarray, sigma: np.ndarray) -> None:
        """A fused sample of an accelerometer whose mount is held feeds its test (backends/mount_test.py): its
        innovation ``e`` against the prediction (rows ∂y/∂x ``H``, covariance ``P``, row sigmas); a release frees
        the mount on the next step's factor."""
        k = self.sp.mount_index[mm.sensor]
        if k is None or k in self.mounts.released:
            return
        if self.mounts.add(k, mm.t, e, _innovation_cov(H, P, sigma), H[:, self._p0 + k]):
            # while the first variable's prior is in the window, it is replaced by one with the mount free (as if
            # started so); after, the mount's walk widens on the next step.  (Widened beside that prior, the step
            # made gtsam's system indeterminate: the combined scenario's release at 4 ms.)
            if self._prior_slot is None or self._smoother.holds(_X(self._k0)):
                self._reprior = True
            else:
                self._mount_release.append(k)
            # the gate's prediction knows at once (the newest marginal is refreshed only every COVARIANCE_EVERY_S)
            self._P_newest = self._P_newest.copy()
            self._P_newest[self._p0 + k, self._p0 + k] += self.sp.prior[k] ** 2

    def _sigma(self, sensor: int) -> np.ndarray:
        """A sensor's row sigmas: configured, times the square root of its noise scale (backends/consistency.py)."""
        lam = self.consistency.noise_scale[sensor]
        sigma = np.asarray(self.sensors[sensor].sigma, float)
        return sigma if lam == 1.0 else sigma * np.sqrt(lam)

    def _predicted_cov(self) -> np.ndarray | None:
        """Covariance of the current step's predicted state: the newest smoothed variable's marginal
        (refreshed as ``COVARIANCE_EVERY_S`` says) plus the steps' process noise since the last ISAM2 update
        (the integrator rows' acceleration noise on q̇ through R(q), the random walks of c, b, ε, p); the
        transition's own spreading over these few ms is neglected.  None before the first marginal."""
        if self._P_newest is None:
            return None
        steps = self._k - self._k_updated
        return self._P_newest + steps * self._Q_step

    def _covariance_z(self) -> np.ndarray | None:
        """Covariance (2g, 2g) of (z, ż) published with the estimates: the newest variable's (:meth:`_predicted_cov`,
        a filtering covariance: at least the smoothed one of the emitted, older steps), None before the first."""
        P = self._predicted_cov()
        if P is None:
            return None
        idx = np.concatenate([self._dof_at, len(self._coords) + self._dof_at])
        return P[np.ix_(idx, idx)].copy()

    def _note_covariance(self, k: int, x: np.ndarray) -> None:
        """Marginal covariance of the newest smoothed variable x_k and the process noise of one step at
        it, for :meth:`_predicted_cov`, refreshed as ``COVARIANCE_EVERY_S`` says (None if gtsam cannot give
        the marginal), from the Bayes tree of ISAM2."""
        if self._P_newest is not None and (k - self._P_k) * self.dt < min(COVARIANCE_EVERY_S, k * self.dt / 2) - 1e-9:
            return
        try:
            self._P_newest = self._smoother.marginal_covariance(_X(k))
        except (RuntimeError, IndexError):  # an indeterminate system; a key ISAM2 does not hold (IndexError)
            self._P_newest = None  # the check pauses; the estimate goes on
            return
        self._P_k = k
        self._Q_step = self._step_noise(x, self._sigmas(False, x) ** 2)

    def _take_measurements(self, k: int) -> list[tuple[float, Measurement]]:
        """Pending measurements with t in (t_{k-1}, t_k] (all with t <= t_k for the first step)."""
        t_k = self._t0 + k * self.dt
        keep, out = [], []
        for mm in self._pending:
            if mm.t <= t_k + 1e-9:
                alpha = 1.0 if k == self._k0 else min(1.0, max(0.0, (mm.t - (t_k - self.dt)) / self.dt))
                out.append((alpha, mm))
            else:
                keep.append(mm)
        self._pending = keep
        return out

    def earliest_time(self) -> float:
        """Start (s) of the oldest step whose variables are still in the window: a measurement after
        it joins the graph at its own step (a step's factor links x_{k-1} and x_k)."""
        if self._smoother is None:
            return self.t
        k_oldest = max(self._k0, self._k_updated - self._window_steps + 2)
        return self._t0 + k_oldest * self.dt

    def add_measurement(self, m: Measurement) -> None:
        """Buffer a measurement; it enters the factor of the step whose interval contains its time
        (late ones, of steps already in the graph, a factor of their own at that step; a drive's torque that late
        is held from the next step)."""
        if m.t <= self.t + 1e-9 and self._smoother is not None and not self.sensors[m.sensor].is_input:
            k = max(self._k0, math.ceil((m.t - self._t0) / self.dt - 1e-9))
            alpha = 1.0 if k == self._k0 else min(1.0, max(0.0, (m.t - (self._t0 + (k - 1) * self.dt)) / self.dt))
            self._chunk_graph.add(self._measurement_factor(k, alpha, m))
        else:
            self._pending.append(m)
        self.note_measurement(m)

    def _forces_and_mass(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """(generalized forces added to the model's, mass matrix or None for the model's) at x (either layout of
        q_c): the DOF force τ = b − c ⊙ ż plus the parameter errors' gravity forces Σ ε_k dQs[k], and
        M + Σ ε_k dMs[k]."""
        nc, g = len(self._coords), self.model.g
        tau = dof_force(self.model, x[2 * nc : 2 * nc + g], x[2 * nc + g : 2 * nc + 2 * g], x[nc : 2 * nc][self._dof_at])
        eps = x[self._e0 : self._p0]
        if not eps.size:
            return tau, None
        return tau + eps @ self._dQs, self.model.M + np.tensordot(eps, self._dMs, 1)

    def _accel(self, x: np.ndarray) -> np.ndarray:
        """q̈ = f(q, q̇, τ) at x = [q, q̇, c, b, ε, p] without Jacobians."""
        if self.kernel is not None:
            return self.kernel.fgs_accel(x, self._dMs, self._dQs)
        n = self._n
        return self.model.forward_dynamics(x[:n], x[n : 2 * n], *self._forces_and_mass(x))

    def _predict(self, x: np.ndarray) -> np.ndarray:
        """Initial guess for the next step: a Taylor step of the model from x = [q, q̇, c, b, ε, p]
        (q + Δt q̇ + Δt²/2 q̈, q̇ + Δt q̈); the smoother's own iteration refines it."""
        n, dt = self._n, self.dt
        f0 = self._accel(x)
        x1 = x.copy()
        x1[:n] += dt * x[n : 2 * n] + 0.5 * dt * dt * f0
        x1[n : 2 * n] += dt * f0
        return x1

    def step(self) -> list[Estimate]:
        """Advance one Δt; every ``chunk_steps`` steps run one ISAM2 update and emit estimates."""
        self._k += 1
        self.t = self._t0 + self._k * self.dt
        try:
            self._x_last = self._add_step_variable(self._k, self._predict(self._x_last))
        except (AssemblyError, np.linalg.LinAlgError) as exc:  # no consistent point at the prediction
            return [self._reinitialize(f"model: {exc}")]
        if len(self._chunk_keys) < self.params.chunk_steps:
            return []
        return self._update()

    def steps_to_output(self) -> int:
        """Steps until the chunk is complete and its ISAM2 update emits estimates."""
        return max(1, self.params.chunk_steps - len(self._chunk_keys))

    def _update(self) -> list[Estimate]:
        assert self._smoother is not None
        keys = self._chunk_keys
        try:
            remove, at = [], None
            if self._reprior:  # a mount released while the first prior is in the window (:meth:`_mount_contradicted`)
                if self._prior_slot is None:
                    self._chunk_graph.replace(0, self._first_prior())
                else:
                    remove, at = [self._prior_slot], self._chunk_graph.size()
                    self._chunk_graph.add(self._first_prior())
                self._reprior = False
            slots = self._smoother.update(self._chunk_graph, self._chunk_values, self._chunk_stamps, remove)
            if self._prior_slot is None or at is not None:
                self._prior_slot = slots[0 if at is None else at]
            values = self._smoother.calculate_estimate()
            xs = [values.atVector(_X(k)) for k in keys]
        except RuntimeError as exc:  # gtsam IndeterminantLinearSystem and friends
            return [self._reinitialize(f"gtsam: {exc}")]
        except (AssemblyError, np.linalg.LinAlgError) as exc:  # a factor's model evaluation failed
            return [self._reinitialize(f"model: {exc}")]
        self._chunk_graph = gtsam.NonlinearFactorGraph()
        self._chunk_values = gtsam.Values()
        self._chunk_stamps = {}
        self._chunk_keys = []
        self._k_updated = keys[-1]
        newest = xs[-1]
        run = max(self._gated_run, default=0)
        if run >= self.params.outliers_to_reinit:
            worst = self._gated_run.index(run)
            return [self._reinitialize(f"{self._gated_run[worst]} consecutive samples of "
                                       f"{self.sensors[worst].name}.{self.sensors[worst].kind} far from the prediction")]
        if self._delay_steps == 0:
            emit = list(zip(keys, xs, strict=False))
        else:
            # re-read the delayed steps from the smoothed window (they have seen newer data)
            emit = []
            for k in keys:
                kd = k - self._delay_steps
                if kd >= 0 and values.exists(_X(kd)):
                    emit.append((kd, values.atVector(_X(kd))))
        if not np.all(np.isfinite(newest)):
            return [self._reinitialize("NaN in the smoother estimate")]
        try:  # (before the check: the independent layout finds the newest state's point among them, for it)
            positions = self._positions([x for _, x in emit])
        except (AssemblyError, np.linalg.LinAlgError) as exc:
            return [self._reinitialize(f"no consistent point at the smoother estimate: {exc}")]
        problem = self._state_problem(newest)
        if problem is not None:
            return [self._reinitialize(problem)]
        self._x_last = newest
        for k, x in zip(keys, xs, strict=False):
            self._recent.append((k, x))
        self._note_covariance(keys[-1], newest)
        out = []
        quality = self.consistency.quality()
        bias, offs, mounts = self.sp.report(newest[self._p0 :])
        model_err = self.uncertainty.report(newest[self._e0 : self._p0])
        P_z = self._covariance_z()
        for (k, _), (q, qd) in zip(emit, positions, strict=True):
            e = self.make_estimate(self._t0 + k * self.dt, q, qd, P_z)
            e.quality, e.bias, e.time_offset_s, e.mount_deg, e.model = quality, bias, offs, mounts, model_err
            out.append(e)
        return out

    def factor_slots(self) -> int:
        """The graph's memory: :meth:`FixedLag.factor_slots` of the smoother (0 before a start)."""
        return 0 if self._smoother is None else self._smoother.factor_slots()

    def diagnostics(self) -> dict:
        """est/diag ``info``: innovation consistency statistics per sensor, biases, time offsets and accelerometer
        mounts, with the sensor parameters' std from the newest variable's marginal (:meth:`_note_covariance`)."""
        bias, offs, mounts = self.sp.report(self._x_last[self._p0 :])
        out = {"consistency": self.consistency.stats(), "bias": bias, "time_offset_s": offs, "force_jumps": self.jumps}
        if mounts:
            out["mount_deg"] = mounts
        if self._P_newest is not None:
            out["param_std"] = dict(zip(self.sp.names, np.sqrt(np.diag(self._P_newest)[self._p0 :]).tolist(), strict=True))
        if self.uncertainty.dim:
            out["model"] = self.uncertainty.report(self._x_last[self._e0 : self._p0])
        return out

    def _reinitialize(self, why: str) -> Estimate:
        """Restart the graph from the last good state (projected on the constraints)."""
        log.warning("fgs: divergence (%s); re-initialising", why)
        k_good, x_good = self._recent[-1]
        q, qd = self._restart_pose(x_good)
        t = self.t
        pending = self._pending
        p_keep = x_good[self._e0 :]
        self._p_keep = p_keep if np.all(np.isfinite(p_keep)) else np.zeros(len(p_keep))  # model and sensor parameters survive
        self.initialize(t, q, qd)
        del self._p_keep
        self._pending = pending
        self.mark_reinit(why)
        return self.make_estimate(t, q, qd)

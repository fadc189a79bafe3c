"""Inverse dynamics: the generalized forces that make a mechanism follow imposed coordinate trajectories.

Pure numpy/scipy/gtsam, no I/O.  Units SI: coordinates in m or rad, forces in N or N·m, time in s.

Problem.  Some coordinates of q, the *imposed* ones (indices ``I`` into q, as many as the mechanism
has degrees of freedom), follow a sampled trajectory x(t).  Imposing them adds the constraint rows
``q_I − x(t) = 0`` to Φ(q) = 0; the equations of motion then read

    M q̈ + Φ_qᵀ λ + S_Iᵀ μ = Q(q, q̇),        S_I = rows I of the identity (k×n),

and the multipliers μ of the imposed rows are the generalized forces with which the prescribed
motion acts on the mechanism.  The **actuator force** returned here is ``τ = −μ``: the generalized
force (N·m on an angle coordinate, N on a length coordinate) that, added to Q on the imposed
coordinates (``Model.Q(q, q̇, tau)``, ``Model.forward_dynamics``), makes the free mechanism move
along x(t).  Positive τ pushes the coordinate towards larger values.  mbse's Adams results
(``InverseDynamics_4bars_MSC.tab``) give the joint *reaction* ``μ = −τ``.

Derivatives of the trajectory.  ẋ and ẍ come from a local least-squares polynomial fit
(Savitzky–Golay): at each sample a polynomial of degree ``order`` (default 5) is fitted to the
``window`` samples (default 31) centred on it — the window is shifted inwards at both ends — and
differentiated there.  Trajectory files are written with ~8 significant digits; an interpolating
spline through them amplifies that rounding into ẍ errors of ~0.1 % (5 ms steps), the fit removes
it (measured on mbse's four-bar trajectory: ẍ RMS error 1.6e-5 rad/s² of 4.8).  Samples need not
be uniform in time.

Two methods compute the same result:

- ``model`` — sample by sample: the position problem with q_I = x(t_k), warm-started from the
  previous sample (so the assembly branch of the file's initial configuration is kept), the
  velocity and acceleration problems with q̇_I = ẋ, q̈_I = ẍ, then [Φ_qᵀ S_Iᵀ][λ; μ] = Q − M q̈.
- ``fg`` — one gtsam factor graph over the whole trajectory, as the factor-graph paper (§5.3, §7.2)
  and mbse's ``mbse-fg-inverse-dynamics``: variables q_k, q̇_k, q̈_k, λ_k, τ_k per sample, one
  CustomFactor per residual (trajectory priors on q_I, q̇_I, q̈_I; Φ = 0, Φ_q q̇ = 0, Φ_q q̈ = γ; the
  equations of motion, see :data:`RESIDUALS`), solved by Levenberg–Marquardt in two stages like
  the paper's staged solution: (1) positions only (priors and Φ = 0), chunk by chunk along the
  trajectory, each chunk started at the previous chunk's last configuration so that every sample
  stays on the file's assembly branch; (2) all variables and factors at once.  Every residual of
  stage 2 can be exactly zero, so its optimum is the exact inverse-dynamics solution whatever the
  sigmas, and it agrees with ``model`` to the solver tolerance.

  Differences from the paper, and why: the dynamics factor is written with the multipliers,
  M q̈ + Φ_qᵀ λ − Q − S_Iᵀ τ = 0, instead of the paper's q̈(q, q̇, Q) − q̈, whose forward dynamics
  inverts the KKT matrix, singular near singular configurations.  (Dependent constraint rows, as in
  mbse's pick-and-place robot, are dropped by the model: :meth:`Model._drop_redundant_constraints`.)
  The paper links samples by trapezoidal-integration factors
  q_k ↔ q̇_k ↔ q̈_k and mbse starts every q_k at the first configuration with weak between-factors;
  here q̇ and q̈ are tied to the imposed trajectory's fitted derivatives (integrating every
  coordinate and imposing the constraints over-determines each step, see backends/fgs.py, and would
  leave an O(Δt²) difference between the two methods), and stage 1 proceeds by continuation.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import gtsam
import numpy as np

from estimator_service.errors import UserError
from estimator_service.mechanism import Dof, Mechanism
from estimator_service.model import AssemblyError, Model

#: default Savitzky–Golay window (samples) and polynomial degree for the trajectory derivatives
WINDOW = 31
ORDER = 5

METHODS = ("model", "fg")


# ---------------------------------------------------------------------------------------- setup
def imposed_model(mech: Mechanism, imposed: Sequence[int], gravity: tuple[float, float] | None = None) -> Model:
    """A :class:`Model` of ``mech`` whose independent coordinates are the imposed ones.

    ``imposed``: 0-based indices into q (as mbse's ``--imposed-coordinates``); ``gravity`` (m/s²,
    global x, y) replaces the file's.  Then ``solve_position/velocity/acceleration`` impose
    q_I and the model's ``dof`` is ``imposed``.  Raises :class:`UserError` when the indices are out of
    range, repeated, or do not determine the mechanism (their number must equal its DOF count).
    """
    names = mech.coordinate_names()
    n = len(names)
    imposed = [int(i) for i in imposed]
    if not imposed:
        raise UserError(f"{mech.source}: no imposed coordinate given")
    for i in imposed:
        if not 0 <= i < n:
            raise UserError(f"{mech.source}: imposed coordinate index {i} out of range: "
                            f"q has {n} coordinates, 0..{n - 1} ({_listing(names)})")
    if len(set(imposed)) != len(imposed):
        raise UserError(f"{mech.source}: imposed coordinate indices repeat: {imposed}")
    free = Model(dataclasses.replace(mech, dofs=[]))  # the file's assembly and its true DOF count
    if len(imposed) != free.g:
        raise UserError(
            f"{mech.source}: the mechanism has {free.g} degree(s) of freedom, but {len(imposed)} "
            f"coordinate(s) are imposed ({[names[i] for i in imposed]}); impose exactly {free.g}")
    dofs = [Dof(names[i], i) for i in imposed]
    g = mech.gravity if gravity is None else (float(gravity[0]), float(gravity[1]))
    try:
        return Model(dataclasses.replace(mech, dofs=dofs, gravity=g))
    except AssemblyError:
        raise UserError(
            f"{mech.source}: imposed coordinates {[names[i] for i in imposed]} do not determine the "
            f"mechanism at its initial configuration (choose coordinates that can drive it)") from None


def _listing(names: list[str]) -> str:
    return ", ".join(f"{i}={name}" for i, name in enumerate(names))


def local_polynomial_derivatives(t: np.ndarray, x: np.ndarray, window: int = WINDOW,
                                 order: int = ORDER) -> tuple[np.ndarray, np.ndarray]:
    """First and second time derivatives of sampled signals by local polynomial fits (Savitzky–Golay).

    ``t`` (N,) strictly increasing times (s), ``x`` (N, k) samples.  At sample i a degree-``order``
    polynomial is fitted by least squares to the ``window`` samples centred on i (the window is
    shifted to stay inside the data at both ends) and differentiated at t_i.  On uniform samples
    this equals ``scipy.signal.savgol_filter(x, window, order, deriv=d, delta=Δt, mode="interp")``.
    Returns (ẋ, ẍ), each (N, k), in units of x per s and per s².
    """
    t = np.asarray(t, dtype=float)
    x = np.asarray(x, dtype=float).reshape(len(t), -1)
    N = len(t)
    if window > N or window <= order or window % 2 == 0:
        raise ValueError(f"window {window} must be odd, > order {order} and <= the {N} samples")
    lo = np.clip(np.arange(N) - window // 2, 0, N - window)
    idx = lo[:, None] + np.arange(window)[None, :]  # (N, w) sample indices of each window
    h = (t[-1] - t[0]) / (N - 1)  # time scale keeping the Vandermonde matrices well conditioned
    s = (t[idx] - t[:, None]) / h  # (N, w)
    V = s[:, :, None] ** np.arange(order + 1)  # (N, w, order+1)
    coeff = np.linalg.pinv(V)[:, 1:3, :]  # rows giving c1, c2 of the fit at s = 0
    c = np.einsum("nrw,nwk->nrk", coeff, x[idx])  # (N, 2, k)
    return c[:, 0] / h, 2.0 * c[:, 1] / (h * h)


# ---------------------------------------------------------------------------------------- result
@dataclass
class InverseDynamicsResult:
    """Inverse-dynamics solution at the trajectory's samples.

    ``t`` (N,) s; ``imposed`` indices into q; ``tau`` (N, k) actuator generalized forces on the
    imposed coordinates (N·m or N; τ = −μ, see the module docstring); ``q``, ``qd``, ``qdd`` (N, n);
    ``info``: method details (stage iterations, final errors, run time in s).
    """

    t: np.ndarray
    imposed: tuple[int, ...]
    tau: np.ndarray
    q: np.ndarray
    qd: np.ndarray
    qdd: np.ndarray
    method: str
    info: dict

    @property
    def reaction(self) -> np.ndarray:
        """The multipliers μ = −τ of the imposed-coordinate constraints (the sign of Adams' reaction)."""
        return -self.tau


def inverse_dynamics(model: Model, t: np.ndarray, x: np.ndarray, method: str = "model",
                     window: int = WINDOW, order: int = ORDER,
                     progress: Callable[[str], None] | None = None) -> InverseDynamicsResult:
    """Actuator forces on ``model.dof`` (the imposed coordinates, see :func:`imposed_model`) along
    the samples ``x`` (N, k) at times ``t`` (N,); ``method`` is ``model`` or ``fg``."""
    t = np.asarray(t, dtype=float)
    x = np.asarray(x, dtype=float).reshape(len(t), -1)
    if x.shape[1] != model.g:
        raise ValueError(f"x has {x.shape[1]} columns, the model {model.g} imposed coordinates")
    t0 = time.perf_counter()
    xd, xdd = local_polynomial_derivatives(t, x, window, order)
    if method == "model":
        q, qd, qdd = imposed_kinematics(model, t, x, xd, xdd)
        tau = np.array([imposed_forces(model, q[k], qd[k], qdd[k]) for k in range(len(t))])
        info: dict = {}
    elif method == "fg":
        q, qd, qdd, tau, info = FactorGraphInverseDynamics(model, t, x, xd, xdd).solve(progress)
    else:
        raise ValueError(f"unknown method {method!r}; methods: {', '.join(METHODS)}")
    info["run_time_s"] = time.perf_counter() - t0
    return InverseDynamicsResult(t, tuple(int(i) for i in model.dof), tau, q, qd, qdd, method, info)


# ---------------------------------------------------------------------------------------- model method
def imposed_kinematics(model: Model, t: np.ndarray, x: np.ndarray, xd: np.ndarray,
                       xdd: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """q, q̇, q̈ (N, n) with the imposed coordinates ``model.dof`` at x, ẋ, ẍ (N, k).

    The first sample starts from the file's assembly ``model.q0``; each next one from the previous
    sample extrapolated by q̇ Δt + ½ q̈ Δt², which keeps the assembly branch.
    """
    N, n = len(t), model.n
    q, qd, qdd = np.empty((N, n)), np.empty((N, n)), np.empty((N, n))
    guess = model.q0
    for k in range(N):
        if k:
            dt = t[k] - t[k - 1]
            guess = q[k - 1] + dt * qd[k - 1] + 0.5 * dt * dt * qdd[k - 1]
        try:
            q[k] = model.solve_position(guess, x[k])
            qd[k] = model.solve_velocity(q[k], xd[k])
            qdd[k] = model.solve_acceleration(q[k], qd[k], xdd[k])
        except AssemblyError as exc:
            raise UserError(f"sample {k} (t = {t[k]:.6g} s): {exc}") from None
        except np.linalg.LinAlgError:
            raise UserError(f"sample {k} (t = {t[k]:.6g} s): singular configuration: the imposed coordinates "
                            f"do not determine the velocities there") from None
    return q, qd, qdd


def imposed_forces(model: Model, q: np.ndarray, qd: np.ndarray, qdd: np.ndarray) -> np.ndarray:
    """Actuator forces τ = −μ (k,) on ``model.dof`` from M q̈ + Φ_qᵀ λ + S_Iᵀ μ = Q(q, q̇) (least
    squares when [Φ_q; S_I] is not square).  N·m on angles, N on lengths."""
    S = np.eye(model.n)[model.dof]
    A = np.vstack([model.Phi_q(q), S]).T  # (n, m + k)
    rhs = model.Q(q, qd) - model.M @ qdd
    mult = np.linalg.solve(A, rhs) if A.shape[0] == A.shape[1] else np.linalg.lstsq(A, rhs, rcond=None)[0]
    return -mult[model.m :]


# ---------------------------------------------------------------------------------------- factor graph
# Residuals of the factor graph and their analytic Jacobians: each returns (e, [∂e/∂var...]), or
# (e, None) with ``jac=False`` (gtsam evaluates errors without Jacobians while it searches a step).
def res_position(model: Model, q: np.ndarray, jac: bool = True) -> tuple[np.ndarray, list[np.ndarray] | None]:
    """Position constraints Φ(q) (m,); variables (q,)."""
    return model.Phi(q), [model.Phi_q(q)] if jac else None


def res_velocity(model: Model, q: np.ndarray, qd: np.ndarray,
                 jac: bool = True) -> tuple[np.ndarray, list[np.ndarray] | None]:
    """Velocity constraints Φ_q q̇ (m,); variables (q, q̇)."""
    Jq = model.Phi_q(q)
    return Jq @ qd, [model.hess_contract(q, qd), Jq] if jac else None


def res_acceleration(model: Model, q: np.ndarray, qd: np.ndarray, qdd: np.ndarray,
                     jac: bool = True) -> tuple[np.ndarray, list[np.ndarray] | None]:
    """Acceleration constraints Φ_q q̈ − γ(q, q̇) (m,); variables (q, q̇, q̈)."""
    Jq = model.Phi_q(q)
    e = Jq @ qdd - model.gamma(q, qd)
    if not jac:
        return e, None
    g_q, g_qd = model.gamma_jac(q, qd)
    return e, [model.hess_contract(q, qdd) - g_q, -g_qd, Jq]


def res_imposed(model: Model, v: np.ndarray, target: np.ndarray,
                jac: bool = True) -> tuple[np.ndarray, list[np.ndarray] | None]:
    """Trajectory prior v_I − target (k,) on q, q̇ or q̈; variables (v,)."""
    return v[model.dof] - target, [np.eye(model.n)[model.dof]] if jac else None


def res_dynamics(model: Model, q: np.ndarray, qd: np.ndarray, qdd: np.ndarray, lam: np.ndarray, tau: np.ndarray,
                 jac: bool = True) -> tuple[np.ndarray, list[np.ndarray] | None]:
    """Equations of motion M q̈ + Φ_qᵀ λ − Q(q, q̇) − S_Iᵀ τ (n,) with the multipliers λ (m,) and the
    unknown actuator forces τ (k,) on the imposed coordinates; variables (q, q̇, q̈, λ, τ)."""
    Jq = model.Phi_q(q)
    e = model.M @ qdd + Jq.T @ lam - model.Q(q, qd)
    e[model.dof] -= tau
    if not jac:
        return e, None
    Q_q, Q_qd = model.Q_jac(q, qd)
    return e, [model.lambda_hessian(q, lam) - Q_q, -Q_qd, model.M.copy(), Jq.T.copy(), -np.eye(model.n)[:, model.dof]]


#: name -> (residual function, variable kinds, rows: "m" constraints, "n" coordinates) of the factors
#: of stage 2 besides the trajectory priors (res_imposed on q, q̇, q̈; k rows each)
RESIDUALS: dict[str, tuple[Callable, tuple[str, ...], str]] = {
    "position": (res_position, ("q",), "m"),
    "velocity": (res_velocity, ("q", "v"), "m"),
    "acceleration": (res_acceleration, ("q", "v", "a"), "m"),
    "dynamics": (res_dynamics, ("q", "v", "a", "l", "f"), "n"),
}


def _key(kind: str, k: int) -> int:
    return gtsam.symbol(kind, k)


def custom_factor(model: Model, residual: Callable, keys: list[int], dim: int, sigma: float,
                  *extra: np.ndarray) -> gtsam.CustomFactor:
    """A gtsam CustomFactor of ``residual(model, *values of keys, *extra)`` (``dim`` rows) with
    isotropic ``sigma``."""
    def error(this: gtsam.CustomFactor, values: gtsam.Values, H: list | None) -> np.ndarray:
        e, J = residual(model, *(values.atVector(key) for key in this.keys()), *extra, jac=H is not None)
        if J is not None:
            for i, Ji in enumerate(J):
                H[i] = Ji
        return e

    return gtsam.CustomFactor(gtsam.noiseModel.Isotropic.Sigma(dim, sigma), keys, error)


class FactorGraphInverseDynamics:
    """The ``fg`` method (module docstring): a batch factor graph over the whole trajectory.

    Variables per sample k: ``q``k, ``v``k = q̇, ``a``k = q̈ (n each), ``l``k = λ (multipliers of the
    independent constraint rows), ``f``k = τ (k imposed).
    """

    #: samples per chunk of stage 1 (all sigmas are 1: every residual reaches zero at the optimum)
    CHUNK = 25
    #: Levenberg–Marquardt: initial damping λ of stage 1 (stage 2 starts at 0); stop when an accepted step is below STEP_TOL (largest
    #: component, relative to the largest value), when it decreases the total error (½ Σ whitened e²)
    #: by less than REL_TOL of itself, when no step with λ ≤ LAMBDA_MAX decreases it, or after MAX_ITER
    LAMBDA0, LAMBDA_MAX, STEP_TOL, REL_TOL, MAX_ITER = 1e-5, 1e10, 1e-11, 1e-13, 100
    #: stage 2's final error per sample above this is a failure (converged runs end at 1e-30..1e-24)
    MAX_FINAL_ERROR = 1e-12

    def __init__(self, model: Model, t: np.ndarray, x: np.ndarray, xd: np.ndarray, xdd: np.ndarray) -> None:
        self.model, self.t, self.x, self.xd, self.xdd = model, t, x, xd, xdd

    @staticmethod
    def _record(stage: str, stats: dict, info: dict, progress: Callable[[str], None] | None) -> None:
        info[stage] = stats
        if progress:
            progress(f"fg {stage}: {stats['factors']} factors, {stats['iterations']} LM iterations, "
                     f"error {stats['error_start']:.3g} -> {stats['error']:.3g}")

    def _optimize(self, graph: gtsam.NonlinearFactorGraph, values: gtsam.Values,
                  lam0: float) -> tuple[gtsam.Values, dict]:
        """Levenberg–Marquardt on ``graph`` from ``values`` (damping λ·I from ``lam0``, ×10 on a
        rejected step, ÷10 on an accepted one; λ = 0 is a Gauss–Newton step, and a rejected one
        continues with λ = 1e-9), using gtsam's linearisation and sparse multifrontal solver with
        QR elimination (Cholesky squares the condition number, which the forces in N·m and the
        constraints in m² make large: it left errors of 0.1 in q on the pick-and-place robot).

        Stage 2 starts undamped: its position rows are already satisfied, so an undamped step
        leaves q in place, whereas a damped one moves q a little.  Started damped, stage 2 stalled
        on 1000 samples of the Sensors-2016 four-bar (the likely cause: samples whose relative
        angle sits near the 45° switch between the x and y forms of its constraint, model.py, which
        changes the meaning of that row's multiplier); started undamped it converges in 4 steps.

        The loop is written here rather than using ``gtsam.LevenbergMarquardtOptimizer`` because
        that optimizer hands each Python CustomFactor a copy of all the Values, which makes an
        iteration quadratic in the trajectory length (measured: 200 samples of the four-bar, 10×
        slower than this loop; 2000 samples did not finish stage 2 in 10 min).
        """
        keys = list(values.keys())
        dims = [len(values.atVector(key)) for key in keys]
        err0 = err = graph.error(values)
        lam, it, small = lam0, 0, False
        while it < self.MAX_ITER and not small:
            lin = graph.linearize(values)
            while True:
                damped = gtsam.GaussianFactorGraph()
                damped.push_back(lin)
                for key, dim in zip(keys, dims, strict=False) if lam > 0 else ():
                    damped.add(gtsam.JacobianFactor(key, np.sqrt(lam) * np.eye(dim), np.zeros(dim),
                                                    gtsam.noiseModel.Unit.Create(dim)))
                try:
                    delta = damped.optimize(gtsam.EliminateQR)
                except RuntimeError:  # gtsam: indeterminant (singular) undamped system
                    delta, trial_err = None, np.inf
                else:
                    trial = values.retract(delta)
                    trial_err = graph.error(trial)
                if delta is not None and trial_err < err:
                    scale = max(1.0, max(float(np.max(np.abs(values.atVector(key)))) for key in keys))
                    small = (err - trial_err < self.REL_TOL * err
                             or float(np.max(np.abs(delta.vector()))) < self.STEP_TOL * scale)
                    values, err, lam = trial, trial_err, lam / 10.0 if lam > 1e-12 else 0.0
                    break
                lam = lam * 10.0 if lam > 0 else 1e-9
                if lam > self.LAMBDA_MAX:
                    break
            it += 1
            if lam > self.LAMBDA_MAX:
                break
        return values, {"factors": graph.size(), "iterations": it, "error_start": err0, "error": err}

    def solve(self, progress: Callable[[str], None] | None = None
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, dict]:
        """Run the two stages; returns (q, q̇, q̈, τ, info)."""
        model, N, n = self.model, len(self.t), self.model.n
        info: dict = {}
        # Stage 1: positions, chunk by chunk along the trajectory, each chunk started at the previous
        # chunk's last configuration (keeps the assembly branch).
        try:
            q_start = model.solve_position(model.q0, self.x[0])
        except AssemblyError as exc:
            raise UserError(f"sample 0 (t = {self.t[0]:.6g} s): {exc}") from None
        values = gtsam.Values()
        last, stats = q_start, {"factors": 0, "iterations": 0, "error_start": 0.0, "error": 0.0}
        for c0 in range(0, N, self.CHUNK):
            graph, init = gtsam.NonlinearFactorGraph(), gtsam.Values()
            for k in range(c0, min(c0 + self.CHUNK, N)):
                qk = _key("q", k)
                init.insert(qk, last)
                graph.add(custom_factor(model, res_imposed, [qk], model.g, 1.0, self.x[k]))
                graph.add(custom_factor(model, res_position, [qk], model.m, 1.0))
            sol, st = self._optimize(graph, init, self.LAMBDA0)
            for key in init.keys():
                values.insert(key, sol.atVector(key))
            last = sol.atVector(_key("q", min(c0 + self.CHUNK, N) - 1))
            for name in stats:
                stats[name] += st[name]
        self._record("stage 1 (positions)", stats, info, progress)
        # Stage 2: everything; every residual can reach zero.
        graph, init = gtsam.NonlinearFactorGraph(), gtsam.Values()
        for k in range(N):
            keys = {kind: _key(kind, k) for kind in "qvalf"}
            init.insert(keys["q"], values.atVector(keys["q"]))
            init.insert(keys["v"], np.zeros(n))
            init.insert(keys["a"], np.zeros(n))
            init.insert(keys["l"], np.zeros(model.m))
            init.insert(keys["f"], np.zeros(model.g))
            for kind, target in (("q", self.x[k]), ("v", self.xd[k]), ("a", self.xdd[k])):
                graph.add(custom_factor(model, res_imposed, [keys[kind]], model.g, 1.0, target))
            for residual, kinds, dim in RESIDUALS.values():
                graph.add(custom_factor(model, residual, [keys[kind] for kind in kinds],
                                        model.m if dim == "m" else model.n, 1.0))
        values, stats = self._optimize(graph, init, 0.0)
        self._record("stage 2 (all)", stats, info, progress)
        if stats["error"] > self.MAX_FINAL_ERROR * N:
            raise UserError(f"fg: the factor graph did not converge (final error {stats['error']:.3g}, expected ~0; "
                            f"singular configuration on the trajectory?); try --method model")
        out = [np.array([values.atVector(_key(kind, k)) for k in range(N)]) for kind in "qvaf"]
        return out[0], out[1], out[2], out[3], info

"""The fixed-lag smoother over independent coordinates (``[estimator.fgs] coordinates = "independent"``,
the default): backends/fgs.py's gtsam machinery (window, chunks, gate, force jumps, Huber loss, late
samples, consistency, output delay) over the filters' state instead of the paper's dependent one.

One variable per 1 ms step: x_k = [z_k, ż_k, c_k, b_k, η_k, p_k] (4g + K + P: the DOF coordinates and rates,
the unknown DOF force τ = b − c ⊙ ż, the model's parameter errors η, the sensor parameters), as in the
filters (backends/filter.py).  The dependent coordinates are not variables: every evaluation finds the
point of the constraint manifold at (z, ż) (q by Newton from the last point found, q̇ = R ż) and the
R-matrix dynamics there (ManifoldDynamics), with the model's parameter errors exact: M + Σ η_j dMs[j] and
gravity forces + Σ η_j dQs[j] (backends/uncertainty.py).  So there are no constraint rows, and a step's
variable has 4g + K + P entries instead of 2n + 2g + K + P (11 against 25 on the four-bar; 17 against 97
on a 21-body ladder): ISAM2's cost falls with it.

=========================== ===================================================== ===========
residual                    definition                                            rows
=========================== ===================================================== ===========
trapezoidal, positions      z_k − z_{k−1} − Δt/2 (ż_{k−1} + ż_k)                 g
trapezoidal, dynamics       ż_k − ż_{k−1} − Δt/2 (z̈_{k−1} + z̈_k)                g
parameter random walks      [c, b, η, p]_k − [c, b, η, p]_{k−1}                   2g + K + P
each measurement j          h_j(x(t_j)) − y_j,  x(t_j) = (1−α) x_{k−1} + α x_k    dim_j
=========================== ===================================================== ===========

with z̈ = M̄⁻¹Q̄ of the point; ∂z̈/∂x are the filters' analytic state Jacobians (kernels._filter_jacobians),
the measurement model and H the filters' (backends/filter.py ``measure_independent``).  The first step
has no factor of its own: the prior holds it.  The row sigmas are the dependent smoother's integrator
and random-walk sigmas (``sigma_acc`` …), the model error's acceleration noise added alike;
``sigma_pc``/``sigma_vc`` have no rows here, ``prior_sigma_q``/``prior_sigma_qd`` set the prior of z/ż.
"""

from __future__ import annotations

import numpy as np

from estimator_service.backends.base import dof_force
from estimator_service.backends.filter import FilterParams, ManifoldDynamics, Point, _arrays, dqdd_dx, measure_independent
from estimator_service.backends.fgs import FixedLagSmoother, remember
from estimator_service.model import AssemblyError

class IndependentSmoother(FixedLagSmoother):
    """gtsam fixed-lag smoother over x = [z, ż, c, b, η, p]; see the module docstring."""

    kernel_kind = "manifold"  # the manifold point, state Jacobians and gyro model of the filters

    def __init__(self, model, sensors: list, config) -> None:
        super().__init__(model, sensors, config)
        self.dynamics = ManifoldDynamics(model, FilterParams.position_tol, kind=self.kernel_kind)
        self._Qg = model.kernels.Qg if self.dynamics.kernel is not None else None
        self._ref: Point | None = None  # the last point found: the next Newton starts there (keeps the branch)
        self._q_start = model.q0.copy()  # where the first Newton of a run starts (the initial pose)
        #: x (bytes) -> [point, its state Jacobians or None until asked for, DOF force τ (n,), M(η) or None,
        #: gravity forces of η or None] (fgs.remember bounds it)
        self._points: dict[bytes, list] = {}
        n, K = model.n, self.uncertainty.dim
        self._dMs_flat = np.ascontiguousarray(self._dMs.reshape(K, n * n))  # M(η) = M + (η dMs_flat) as (n, n)

    # ------------------------------------------------------------------ state layout
    def _blocks(self) -> tuple[np.ndarray, int]:
        """The variable holds the DOF coordinates z = q[dof] only; no constraint rows."""
        return self.model.dof, 0

    def _initial_state(self, q: np.ndarray, qd: np.ndarray, params: np.ndarray) -> np.ndarray:
        """x at a start from (q, q̇); the point search starts afresh from q (no reference, cache emptied)."""
        self._ref, self._q_start = None, np.array(q, dtype=float)
        self._points.clear()
        return super()._initial_state(q, qd, params)

    def _q_qd(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        pt = self._point(x)
        return pt.q, pt.qd

    def _state_problem(self, x: np.ndarray) -> str | None:
        """NaN, or no point of the manifold at the smoothed (z, ż) (an assembly failure)."""
        if not np.all(np.isfinite(x)):
            return "NaN in the smoother estimate"
        try:
            self._point(x)
        except (AssemblyError, np.linalg.LinAlgError) as exc:
            return f"no consistent point at the smoother estimate: {exc}"
        return None

    def _restart_pose(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        pt = self._point(x)
        return pt.q.copy(), pt.qd.copy()

    def _qdd_R(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        pt = self._point(x)
        return pt.qdd, pt.R

    def _step_noise(self, x: np.ndarray, s2: np.ndarray) -> np.ndarray:
        return np.diag(s2)

    def _accel(self, x: np.ndarray) -> np.ndarray:
        return self._point(x).qdd

    def _predict(self, x: np.ndarray) -> np.ndarray:
        """A Taylor step of the model from x (z + Δt ż + Δt²/2 z̈, ż + Δt z̈); the smoother refines it."""
        g, dt = self.model.g, self.dt
        zdd = self._point(x).zdd
        x1 = x.copy()
        x1[:g] += dt * x[g : 2 * g] + 0.5 * dt * dt * zdd
        x1[g : 2 * g] += dt * zdd
        return x1

    # ------------------------------------------------------------------ model at a state
    def _entry(self, x: np.ndarray) -> list:
        """The cache entry of x (:attr:`_points`): the consistent point at (z, ż) under the DOF force and
        the model with parameter errors η.  AssemblyError or LinAlgError when there is none (the caller
        re-initialises)."""
        key = x.tobytes()
        hit = self._points.get(key)
        if hit is not None:
            return hit
        model, g, e0, p0 = self.model, self.model.g, self._e0, self._p0
        eta = x[e0:p0]
        tau = dof_force(model, x[2 * g : 3 * g], x[3 * g : 4 * g], x[g : 2 * g])
        M, Qg_eta = None, None
        if eta.size:
            Qg_eta = eta @ self._dQs
            M = model.M + (eta @ self._dMs_flat).reshape(model.n, model.n)
        pt = self.dynamics.point(x[:g], x[g : 2 * g], tau if Qg_eta is None else tau + Qg_eta, self._ref,
                                 self._q_start, M)
        self._ref = pt
        entry = [pt, None, tau, M, Qg_eta]
        remember(self._points, key, entry)
        return entry

    def _point(self, x: np.ndarray) -> Point:
        """The consistent point of x (cached; see :meth:`_entry`)."""
        return self._entry(x)[0]

    def _at(self, x: np.ndarray) -> tuple[Point, tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """(point of x, (R, ∂q̇/∂z, ∂q̈/∂x (n, dim))), both cached by x."""
        entry = self._entry(x)
        if entry[1] is None:
            pt, _, tau, M, Qg_eta = entry
            entry[1] = self._jacobians(x, pt, tau, M, Qg_eta)
        return entry[0], entry[1]

    def _jacobians(self, x: np.ndarray, pt: Point, tau: np.ndarray, M: np.ndarray | None,
                   Qg_eta: np.ndarray | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(R, ∂q̇/∂z, ∂q̈/∂x) at x's point: ∂q̈/∂η_j = ∂q̈/∂τ (dQs[j] − dMs[j] q̈) with the perturbed model's
        ∂q̈/∂τ; compiled (the filters' kernel with the perturbed M and gravity forces), else the model's
        KKT Jacobians chained as the filters' reference path."""
        model, e0, p0 = self.model, self._e0, self._p0
        G = (self._dQs - self._dMs @ pt.qdd).T if p0 > e0 else np.zeros((model.n, 0))
        kernel = self.dynamics.kernel
        if kernel is not None:
            x0 = x.copy()
            x0[e0:p0] = 0.0  # η enters through M and the gravity forces, not as a force G η
            R, dqd_dz, D, ok = kernel.filter_jacobians(
                x0, _arrays(pt.q, pt.qd, pt.R, pt.Jm), True, np.ascontiguousarray(G), e0,
                None if M is None else np.ascontiguousarray(M),
                None if Qg_eta is None else np.ascontiguousarray(self._Qg + Qg_eta))
            if not ok:
                raise np.linalg.LinAlgError("singular reduced mass matrix")
            return R, dqd_dz, D
        j = model.state_jacobians(pt.q, pt.qd, tau if Qg_eta is None else tau + Qg_eta, M)
        return j.R, j.dqd_dz, dqdd_dx(j, x, model.dof, True, G, e0, self._dim)

    # ------------------------------------------------------------------ residuals
    def _make_factor(self, k: int, x_guess: np.ndarray):
        """Step k's dynamics factor; none at the first step (its rows would all be zero)."""
        return None if k == self._k0 else super()._make_factor(k, x_guess)

    def _step_residual(self, xp: np.ndarray | None, xc: np.ndarray,
                       want_jac: bool) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
        """Residual of one step's rows (module docstring) and its Jacobians w.r.t. x_{k-1} and x_k."""
        g, dt, dof = self.model.g, self.dt, self.model.dof
        r = xc - xp
        r[:g] -= dt / 2 * (xp[g : 2 * g] + xc[g : 2 * g])
        r[g : 2 * g] -= dt / 2 * (self._point(xp).zdd + self._point(xc).zdd)
        if not want_jac:
            return r, None, None
        Dp, Dc = self._at(xp)[1][2], self._at(xc)[1][2]
        Jp, Jc = self._J_prev0.copy(), self._J_cur0.copy()
        Jp[g : 2 * g] -= dt / 2 * Dp[dof]
        Jc[g : 2 * g] -= dt / 2 * Dc[dof]
        return r, Jp, Jc

    def _measure(self, x: np.ndarray, sensor: int, want_jac: bool) -> tuple[np.ndarray, np.ndarray | None]:
        """(y, H = ∂y/∂x or None) at x = [z, ż, …, p]: the filters' measurement model at x's point."""
        pt, jac = self._at(x) if want_jac else (self._point(x), None)
        return measure_independent(self.sp, self._gyros, self.dynamics.kernel, [sensor], pt, x[self._p0 :], jac,
                                   self._p0)

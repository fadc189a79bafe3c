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

with z̈ = M̄⁻¹Q̄ of the point; ∂z̈/∂x are the filters' analytic state Jacobians
(kernels.dynamics.filter_jacobians), the measurement model and H the filters' (backends/manifold.py
``measure_independent``).  The first step has no factor of its own: the prior holds it.  The row sigmas are
the dependent smoother's integrator and random-walk sigmas (``sigma_acc`` …), the model error's acceleration
noise added alike; ``sigma_pc``/``sigma_vc`` have no rows here, ``prior_sigma_q``/``prior_sigma_qd`` set the
prior of z/ż.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from estimator_service import kernels
from estimator_service.backends.fgs import FixedLagSmoother, remember
from estimator_service.backends.filter import FilterParams
from estimator_service.backends.manifold import ManifoldDynamics, Point, dqdd_dx, measure_independent
from estimator_service.kernels.smoother import smoother_step_rows
from estimator_service.model import AssemblyError

class IndependentSmoother(FixedLagSmoother):
    """gtsam fixed-lag smoother over x = [z, ż, c, b, η, p]; see the module docstring."""

    kernel_kind = "manifold"  # the manifold point, state Jacobians and measurement model of the filters

    def __init__(self, model, sensors: list, config) -> None:
        super().__init__(model, sensors, config)
        self.dynamics = ManifoldDynamics(model, FilterParams.position_tol, self.kernel)
        self._ref: Point | None = None  # the last point found: the next Newton starts there (keeps the branch)
        self._q_start = model.q0.copy()  # where the first Newton of a run starts (the initial pose)
        #: x (bytes) -> [point, its state Jacobians or None until asked for] (fgs.remember bounds it)
        self._points: OrderedDict[bytes, list] = OrderedDict()
        #: the compiled model's arguments (ModelKernels.smoother_point): x's layout (g, e0, p0), η's directions,
        #: the position solver's settings
        self._layout = (model.g, self._e0, self._p0)
        self._terms = (self._dMs, self._dQs)
        self._solver = (self.dynamics.tol, self.dynamics.quadratic_res, self.dynamics.max_newton)
        self._no_jac = np.zeros((0, 0))

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

    def _positions(self, xs: list[np.ndarray]) -> list[tuple[np.ndarray, np.ndarray]]:
        """(q, q̇) of each state of a chunk's estimates: compiled in one call, each point found from the one before
        (the first from the last point found; kernels.smoother.smoother_positions), else (and from a state that needs
        the fallback on) point by point as :meth:`_q_qd`.  Without an output delay the estimates end with the chunk's
        newest state, whose point is remembered: the divergence check and the next step's guess take it."""
        kernel, ref = self.dynamics.kernel, self._ref
        if kernel is None or ref is None or not xs:
            return super()._positions(xs)
        st, Q, QD, *last = kernel.smoother_positions(np.array(xs), self._layout, kernels.contiguous(ref.z, ref.q, ref.R, ref.Jm),
                                                     self._terms, self._solver)
        done = int(np.argmax(st != 0)) if st.any() else len(xs)
        if done == len(xs) and self._delay_steps == 0 and (key := xs[-1].tobytes()) not in self._points:
            self._ref = Point(xs[-1][: self.model.g].copy(), Q[-1], QD[-1], *last[:4], float(last[4]))
            remember(self._points, key, [self._ref, None])
        return list(zip(Q[:done], QD[:done], strict=True)) + super()._positions(xs[done:])

    def _state_problem(self, x: np.ndarray) -> str | None:
        """No point of the manifold at the smoothed (z, ż) (an assembly failure)."""
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
        """A Taylor step of the model from x (z + Δt ż + Δt²/2 z̈, ż + Δt z̈); the smoother refines it.  Compiled,
        the guess's point and Jacobians come in the same call (kernels.smoother.smoother_point) and are cached for
        the gate and the step's factors."""
        g, dt = self.model.g, self.dt
        pt = self._point(x)
        kernel, zdd = self.dynamics.kernel, pt.zdd
        if kernel is not None:  # the guess and its model with the Jacobians (its factors need them), in one call
            out = kernel.smoother_point(x, self._layout, kernels.contiguous(pt.z, pt.q, pt.R, pt.Jm), pt.q, True, self._terms,
                                        self._solver, (zdd, dt))
            x1, entry = out[1], self._compiled_entry(out[1], pt, True, out)
            self._ref = entry[0]
            remember(self._points, x1.tobytes(), entry)
            return x1
        x1 = x.copy()
        x1[:g] += dt * x[g : 2 * g] + 0.5 * dt * dt * zdd
        x1[g : 2 * g] += dt * zdd
        return x1

    # ------------------------------------------------------------------ model at a state
    def _entry(self, x: np.ndarray, jac: bool = False) -> list:
        """The cache entry [point, its (R, ∂q̇/∂z, ∂q̈/∂x) or None until asked for (``jac``)] of x (:attr:`_points`):
        the consistent point at (z, ż) under the DOF force and the model with parameter errors η.
        AssemblyError or LinAlgError when there is none (the caller re-initialises)."""
        key = x.tobytes()
        hit = self._points.get(key)
        if hit is not None:
            if jac and hit[1] is None:
                hit[1] = self._jacobians(x, hit[0])
            return hit
        entry = self._evaluate(x, jac)
        self._ref = entry[0]
        remember(self._points, key, entry)
        return entry

    def _evaluate(self, x: np.ndarray, jac: bool) -> list:
        """A new cache entry of x (:meth:`_entry`): the point from the last one found (or, after a start,
        from the initial pose), with its Jacobians if ``jac``; compiled in one call
        (kernels.smoother.smoother_point), else the reference path.  Newton that does not converge falls back to
        the model's continuation solver."""
        kernel, ref = self.dynamics.kernel, self._ref
        if kernel is None:
            tau, M = self._forces_and_mass(x)
            pt = self.dynamics.point(x[: self.model.g], x[self.model.g : 2 * self.model.g], tau, ref, self._q_start, M)
            return [pt, self._jacobians(x, pt) if jac else None]
        out = kernel.smoother_point(x, self._layout, None if ref is None else kernels.contiguous(ref.z, ref.q, ref.R, ref.Jm),
                                    self._q_start, jac, self._terms, self._solver)
        return self._compiled_entry(x, ref, jac, out)

    def _compiled_entry(self, x: np.ndarray, ref: Point | None, jac: bool, out: tuple) -> list:
        """The cache entry of x from kernels.smoother.smoother_point's result ``out`` (x's point found from
        ``ref``); LinAlgError when singular, the continuation solver when Newton did not converge."""
        status, g = out[0], self.model.g
        if status == 0:
            return [Point(x[:g].copy(), *out[2:8], float(out[8])), out[9:] if jac else None]
        if status != 1:
            raise np.linalg.LinAlgError("singular configuration (constraint Jacobian or reduced mass matrix)")
        tau, M = self._forces_and_mass(x)
        pt = self.dynamics.continuation(x[:g].copy(), x[g : 2 * g].copy(), tau, self._q_start if ref is None else ref.q,
                                        M)
        return [pt, self._jacobians(x, pt) if jac else None]

    def _point(self, x: np.ndarray) -> Point:
        """The consistent point of x (cached; see :meth:`_entry`)."""
        return self._entry(x)[0]

    def _at(self, x: np.ndarray) -> tuple[Point, tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """(point of x, (R, ∂q̇/∂z, ∂q̈/∂x (n, dim))), both cached by x."""
        entry = self._entry(x, True)
        return entry[0], entry[1]

    def _jacobians(self, x: np.ndarray, pt: Point) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(R, ∂q̇/∂z, ∂q̈/∂x) at x's point: ∂q̈/∂η_j = ∂q̈/∂τ (dQs[j] − dMs[j] q̈) with the perturbed model's
        ∂q̈/∂τ; compiled (kernels.smoother.smoother_point: the filters' kernel with the perturbed M and gravity
        forces), else the model's KKT Jacobians chained as the filters' reference path."""
        kernel = self.dynamics.kernel
        if kernel is not None:  # (the point again from itself: no search, no inversion)
            out = kernel.smoother_point(x, self._layout, kernels.contiguous(pt.z, pt.q, pt.R, pt.Jm), pt.q, True, self._terms,
                                        self._solver)
            if out[0] != 0:
                raise np.linalg.LinAlgError("singular configuration (state Jacobians)")
            return out[9:]
        model, e0, p0 = self.model, self._e0, self._p0
        G = (self._dQs - self._dMs @ pt.qdd).T if p0 > e0 else np.zeros((model.n, 0))
        tau, M = self._forces_and_mass(x)
        j = model.state_jacobians(pt.q, pt.qd, tau, M)
        return j.R, j.dqd_dz, dqdd_dx(j, x, model.dof, True, G, e0, self._dim)

    # ------------------------------------------------------------------ residuals
    def _make_factor(self, k: int, x_guess: np.ndarray, inputs: tuple | None = None):
        """Step k's dynamics factor; none at the first step (its rows would all be zero)."""
        return None if k == self._k0 else super()._make_factor(k, x_guess, inputs)

    def _step_residual(self, xp: np.ndarray | None, xc: np.ndarray,
                       want_jac: bool) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
        """Residual of one step's rows (module docstring) and its Jacobians w.r.t. x_{k-1} and x_k."""
        g, dt, dof = self.model.g, self.dt, self.model.dof
        if self.dynamics.kernel is not None:
            (pp, jp), (pc, jc) = self._entry(xp, want_jac), self._entry(xc, want_jac)
            Dp, Dc = (jp[2], jc[2]) if want_jac else (self._no_jac, self._no_jac)
            e, Jp, Jc = smoother_step_rows(xp, xc, pp.zdd, pc.zdd, Dp, Dc, dt, self.dynamics.kernel.dof,
                                            self._J_prev0, self._J_cur0, want_jac)
            return (e, Jp, Jc) if want_jac else (e, None, None)
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
        return measure_independent(self.sp, self._table, self.dynamics.kernel, [sensor], pt, x[self._p0 :], jac,
                                   self._p0)

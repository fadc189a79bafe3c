"""The consistent point of the constraint manifold and the measurement model at it, for every backend over
independent coordinates (the filters: backends/filter.py; the independent smoother: backends/fgs_independent.py).

:class:`Point`: a consistent state (q, q̇, q̈, z̈, R, Jm) at (z, ż) and the DOF forces; :class:`BufferPoint`: the same
held in one buffer, as the compiled transitions return it.  :class:`ManifoldDynamics` finds the point (position
problem, then the R-matrix dynamics z̈ = M̄⁻¹Q̄, q̈ = R z̈ + Jm γ) and runs the compiled transitions and state
Jacobians of a filter state x = [z, ż, c, b, ε, p] (:func:`dqdd_dx`: their reference path).
:func:`measure_independent`: the readings y = h(q, q̇, q̈) of the virtual sensors and H = ∂y/∂x, chaining
q = q(z) (∂q/∂z = R), q̇ = R ż (∂q̇/∂z exact, not neglected) and q̈(x).  SI units; z, q in rad or m.

Compiled (estimator_service/kernels/: manifold.py, dynamics.py, transition.py, measurement.py); the numpy code here
stays the reference path.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
from scipy.linalg.lapack import dgesv

from estimator_service import kernels
from estimator_service.backends.sensor_params import SensorParams
from estimator_service.kernels.linalg import SMALL_N
from estimator_service.kernels.model_kernels import ModelKernels
from estimator_service.kernels.manifold import CHORD_RATE, REFINE_MAX, REFINE_RATE, REFINE_TOL
from estimator_service.kernels.transition import point_views
from estimator_service.model import CONTINUATION_STEP, Model


@dataclass
class Point:
    """A consistent state on the constraint manifold: what the filters reuse of one evaluation.

    ``q``, ``qd``, ``qdd`` (n,); ``zdd`` (g,); ``R`` = ∂q/∂z (n, g); ``Jm`` = the first m columns of
    [Φ_q; S]⁻¹ (n, m), which map constraint residuals to corrections of the dependent coordinates;
    ``residual`` = max |Φ(q)| (m² for distance rows, m for angle rows).
    """

    z: np.ndarray
    q: np.ndarray
    qd: np.ndarray
    qdd: np.ndarray
    zdd: np.ndarray
    R: np.ndarray
    Jm: np.ndarray
    residual: float


@functools.cache
def point_layout(n: int, m: int, g: int) -> dict[str, tuple[int, int, tuple[int, ...] | None]]:
    """Where each field of a :class:`Point` lies in its buffer (kernels.transition.point_views, the one definition,
    read on a probe buffer): field → (start, stop, shape of an array field, or None for the scalar ``residual``)."""
    probe = np.arange(g + 3 * n + g + n * g + n * m + 1, dtype=float)
    out = {}
    for key, v in zip(Point.__dataclass_fields__, point_views.py_func(probe, n, m, g), strict=True):
        if np.ndim(v) == 0:
            out[key] = (int(v), int(v) + 1, None)
        else:  # (its offset from the address: a field may be empty, e.g. Jm without constraints)
            start = (v.ctypes.data - probe.ctypes.data) // probe.itemsize
            out[key] = (start, start + v.size, v.shape)
    return out


class BufferPoint(Point):
    """A :class:`Point` held as one buffer (the compiled mean transition's output: kernels.transition.point_views),
    each field made (a view; ``residual`` a float) when first asked: a step asks for two or three of them.  ``buf``
    is what the next compiled transition takes."""

    def __init__(self, buf: np.ndarray, n: int, m: int, g: int) -> None:  # (not the dataclass's fields)
        self.buf, self._layout = buf, point_layout(n, m, g)

    def __getattr__(self, name: str):
        where = self.__dict__["_layout"].get(name)
        if where is None:
            raise AttributeError(name)
        a, b, shape = where
        buf = self.__dict__["buf"]
        value = float(buf[a]) if shape is None else buf[a:b] if len(shape) == 1 else buf[a:b].reshape(shape)
        setattr(self, name, value)
        return value


class ManifoldDynamics:
    """z, ż, τ → consistent q, q̇, q̈ and z̈ with few small-matrix operations (the filters' hot path).

    Position problem: from a consistent reference point, q ≈ q_ref + R Δz + ½ q″ (second order,
    q″ = Jm γ(q_ref, R Δz)), then Newton with q[dof] = z fixed until max |Φ| ≤ tol.  Velocity:
    q̇ = R ż.  Dynamics, R-matrix form: M̄ = RᵀMR, Q̄ = Rᵀ(Q − M s), z̈ = M̄⁻¹Q̄, q̈ = R z̈ + s, with
    s = Jm γ(q, q̇) = Ṙż.  Equals the model's forward dynamics (augmented Lagrangian) for
    non-redundant constraints; redundant ones use the pseudo-inverse.
    """

    def __init__(self, model: Model, position_tol: float, kernel: ModelKernels | None, max_newton: int = 6) -> None:
        """``kernel``: the compiled dynamics provider (kernels.compile_model of the filters' or the independent
        smoother's kind), or None for the numpy reference."""
        self.model = model
        n, m, g = model.n, model.m, model.g
        self._J = np.zeros((n, n) if m + g == n else (m + g, n))
        self._J[m + np.arange(g), model.dof] = 1.0
        self._square = m + g == n
        self.position_tol = position_tol
        size = 1.0 + max(max(abs(p.x), abs(p.y)) for p in model.mech.points)  # m, as Model.solve_position
        self.tol = position_tol * size**2
        #: a Newton step from below this residual is final (see :meth:`point`)
        self.quadratic_res = 1e-2 * math.sqrt(self.tol)
        self.max_newton = max_newton
        self._eye = np.eye(n)
        self._g1 = g == 1
        #: the compiled point (estimator_service/kernels/), or None for the numpy reference
        self.kernel = kernel

    def _inverse(self, q: np.ndarray) -> np.ndarray:
        """[Φ_q(q); S]⁻¹ (LAPACK gesv against a stored identity: no checks or copies of numpy.linalg)."""
        self._J[: self.model.m] = self.model.Phi_q(q)
        if not self._square:
            return np.linalg.pinv(self._J)
        _, _, Jinv, info = dgesv(self._J, self._eye)
        if info != 0:
            raise np.linalg.LinAlgError(f"singular configuration (constraint Jacobian, LAPACK info {info})")
        return Jinv

    def point(self, z: np.ndarray, zd: np.ndarray, tau: np.ndarray | None, ref: Point | None,
              q_guess: np.ndarray | None = None, M: np.ndarray | None = None, light: bool = False) -> Point:
        """The consistent point at (z, ż) with generalized forces ``tau`` (n,) added to Q; ``M`` (n, n)
        replaces the model's mass matrix (a model with parameter errors: the independent smoother).

        Starts from ``ref`` (second-order predictor) or, without one, from ``q_guess``.  From ``ref``,
        chord steps first: q −= Jm_ref Φ(q) with the reference's Jm (no inversion per step; each must
        shrink the residual by ``CHORD_RATE``), [Φ_q; S] inverted once at the solution for R and
        Jm, unless the solution is the reference's q itself (z = ref.z: the predictor is ref.q), whose
        inverse [Jm, R] the reference holds.  ``light`` (the UKF's sigma points, which need no Jm of their
        own): at the chord's solution R and s = Jm γ are refined with the reference's inverse instead
        (:meth:`_light`; for n > ``SMALL_N``: a smaller matrix is inverted faster); the point then
        holds the reference's Jm.  Otherwise (or when the chord stalls) Newton: a step taken from a residual below
        ``quadratic_res`` is final (convergence is quadratic: the next residual is ~C·res² ≪ tol), which
        saves re-evaluating Φ; the reported residual is then the one before that step (an upper bound).
        Falls back to the model's continuation solver for large steps; raises AssemblyError if that
        fails too.  A change of z larger than ``model.CONTINUATION_STEP`` from ``ref`` is solved by that
        continuation from the start (in steps, on ref's assembly branch: one Newton solve over it may converge
        to the mirrored point of a relative-angle row, whose readings differ: a UKF's sigma points far along
        an angle that only a gyro sees).
        """
        if self.kernel is not None:
            return self._point_compiled(z, zd, tau, ref, q_guess, M, light)
        model, m = self.model, self.model.m
        if ref is not None and z.size and float(np.max(np.abs(z - ref.z))) > CONTINUATION_STEP:
            return self.continuation(z, zd, tau, ref.q, M)  # one step so far may land on another assembly branch
        if ref is not None:
            if np.array_equal(z, ref.z):  # the predictor's v = 0: ref.q itself
                q = ref.q.copy()
            else:
                v = ref.R @ (z - ref.z)
                q = ref.q + v + 0.5 * (ref.Jm @ model.gamma(ref.q, v))
            start = ref.q
        else:
            q = np.array(q_guess, dtype=float)
            start = q
        q[model.dof] = z
        if ref is not None:  # chord steps with the reference's Jm, [Φ_q; S] inverted once at the solution
            prev = np.inf
            for _ in range(self.max_newton):
                phi = model.Phi(q)
                res = float(np.abs(phi).max())
                if res <= self.tol:
                    # the reference's own q (the predictor from the same z): its [Φ_q; S]⁻¹ is the one at q
                    if np.array_equal(q, ref.q):
                        return self._dynamics(z, zd, tau, q, np.hstack([ref.Jm, ref.R]), res, M)
                    out = self._light(z, zd, tau, q, res, ref, M) if light and model.n > SMALL_N else None
                    return out if out is not None else self._dynamics(z, zd, tau, q, self._inverse(q), res, M)
                if not res < CHORD_RATE * prev:  # too slow (or NaN): Newton from here
                    break
                prev = res
                q = q - ref.Jm @ phi
        for _ in range(self.max_newton):
            phi = model.Phi(q)
            res = float(np.abs(phi).max())
            if not res < np.inf:
                break
            Jinv = self._inverse(q)
            if res <= self.tol:
                return self._dynamics(z, zd, tau, q, Jinv, res, M)
            q -= Jinv[:, :m] @ phi
            if res <= self.quadratic_res:
                return self._dynamics(z, zd, tau, q, self._inverse(q), res, M)
        return self.continuation(z, zd, tau, start, M)

    def _refine(self, J: np.ndarray, Y: np.ndarray, top: np.ndarray, bottom: np.ndarray, ref: Point) -> np.ndarray | None:
        """The solution of [Φ_q; S] Y = [top; bottom] (J = Φ_q at the point) by iterative refinement from the
        guess Y with the nearby ``ref``'s inverse, or None when it does not converge (``REFINE_*``)."""
        prev, dof = np.inf, self.model.dof
        for _ in range(REFINE_MAX):
            d = ref.Jm @ (J @ Y - top) + ref.R @ (Y[dof] - bottom)
            Y = Y - d
            dmax, ymax = np.abs(d).max(), np.abs(Y).max()
            if dmax <= REFINE_TOL * ymax:
                return Y
            if not dmax <= REFINE_RATE * prev:
                break
            prev = dmax
        return None

    def _light(self, z: np.ndarray, zd: np.ndarray, tau: np.ndarray | None, q: np.ndarray, res: float, ref: Point,
               M: np.ndarray | None) -> Point | None:
        """The light point at a solved q near ``ref`` (:meth:`point`): R and s = Jm γ refined with ref's
        inverse, ref's Jm in the point's place; None when refining does not converge (then: inverted)."""
        model, m, g = self.model, self.model.m, self.model.g
        J = model.Phi_q(q)
        R = self._refine(J, ref.R.copy(), np.zeros((m, g)), np.eye(g), ref)
        if R is None:
            return None
        qd = R @ zd
        gam = model.gamma(q, qd)
        s = self._refine(J, (ref.Jm @ gam)[:, None], gam[:, None], np.zeros((g, 1)), ref)
        if s is None:
            return None
        s = s[:, 0]
        M = model.M if M is None else M
        Q = model.Q(q, qd, tau) - M @ s
        zdd = np.linalg.solve(R.T @ M @ R, R.T @ Q)
        return Point(z.copy(), q, qd, R @ zdd + s, zdd, R, ref.Jm, res)

    def _transition(self, x: np.ndarray, h: float, integrator: str, tau_terms: tuple, ref: Point,
                    want_point: bool, want_jac: bool) -> tuple | None:
        """The compiled transition (kernels.transition.filter_transition), or None when the kernels are off or a
        position problem needs the fallback: the caller then takes the reference path, which handles it."""
        if self.kernel is None:
            return None
        st, *out = self.kernel.filter_transition(
            x, h, kernels.INTEGRATOR_CODES[integrator], *tau_terms, kernels.contiguous(ref.z, ref.q, ref.qd, ref.R, ref.Jm, ref.zdd),
            want_point, want_jac, self.tol, self.quadratic_res, self.max_newton)
        return out if st == 0 else None

    def advance(self, x: np.ndarray, h: float, integrator: str, tau_terms: tuple, ref: Point,
                force_terms: tuple) -> tuple[np.ndarray, Point, np.ndarray] | None:
        """(x⁺, its point, G there): the filter's mean transition of h seconds from x (point ``ref``), the
        point of the result and the parameter forces G(q̈) = G0 − T q̈ at it, in one compiled call
        (IndependentFilter.transition, point_of, ModelUncertainty.forces); ``tau_terms`` as
        IndependentFilter.tau_terms, ``force_terms`` = (G0, T).  None as :meth:`_transition`."""
        if self.kernel is None:
            return None
        out = self.kernel.advance_flat(x, h, kernels.INTEGRATOR_CODES[integrator], *tau_terms, ref, force_terms,
                                       self.tol, self.quadratic_res, self.max_newton)
        if out is None:
            return None
        m = self.model
        return out[0], BufferPoint(out[1], m.n, m.m, m.g), out[2]

    def advance_sigma(self, X: np.ndarray, x0: np.ndarray, nd: int, h: float, integrator: str, tau_terms: tuple,
                      ref: Point) -> np.ndarray | None:
        """Each row of X through the mean transition of h seconds from its own point, found from ``ref``
        (x0's point); rows equal to x0 in [:nd] share x0's; entries [nd:] unchanged.  One compiled call
        (UnscentedKalmanFilter.covariance_over); None as :meth:`_transition`."""
        if self.kernel is None:
            return None
        st, out = self.kernel.filter_sigma_transitions(
            X, x0, nd, h, kernels.INTEGRATOR_CODES[integrator], *tau_terms,
            kernels.contiguous(ref.z, ref.q, ref.qd, ref.R, ref.Jm, ref.zdd), self.tol, self.quadratic_res, self.max_newton)
        return out if st == 0 else None

    def transition_jacobian(self, x: np.ndarray, h: float, integrator: str, tau_terms: tuple,
                            ref: Point) -> np.ndarray | None:
        """F = ∂x⁺/∂x of the filter's transition of h seconds from x (point ``ref``) in one compiled call
        (IndependentFilter.transition with jac=True); None as :meth:`_transition`."""
        out = self._transition(x, h, integrator, tau_terms, ref, False, True)
        return None if out is None else out[1]

    def jacobians(self, x: np.ndarray, pt: Point, tau_terms: tuple) -> tuple | None:
        """(R, ∂q̇/∂z, ∂q̈/∂x (n, L)) of filter state x at its point in one compiled call
        (IndependentFilter.jacobians); None when the kernels are off or the configuration is singular."""
        if self.kernel is None:
            return None
        R, dqd_dz, D, ok = self.kernel.filter_jacobians(x, kernels.contiguous(pt.q, pt.qd, pt.R, pt.Jm), *tau_terms)
        return (R, dqd_dz, D) if ok else None

    def continuation(self, z: np.ndarray, zd: np.ndarray, tau: np.ndarray | None, start: np.ndarray,
                      M: np.ndarray | None) -> Point:
        """The fallback of :meth:`point` when Newton does not converge: the model's continuation solver."""
        q = self.model.solve_position(start, z, tol=self.position_tol)
        return self._dynamics(z, zd, tau, q, self._inverse(q), float(np.abs(self.model.Phi(q)).max()), M)

    def _point_compiled(self, z: np.ndarray, zd: np.ndarray, tau: np.ndarray | None, ref: Point | None,
                        q_guess: np.ndarray | None, M: np.ndarray | None, light: bool = False) -> Point:
        """:meth:`point` by the compiled kernel (kernels.manifold.point); the same fallback."""
        if ref is not None:
            out = self.kernel.point(z, zd, tau, ref.z, ref.q, ref.R, ref.Jm, None, self.tol, self.quadratic_res,
                                    self.max_newton, M, light)
        else:
            out = self.kernel.point(z, zd, tau, None, None, None, None, q_guess, self.tol, self.quadratic_res,
                                    self.max_newton, M)
        status, q, qd, qdd, zdd, R, Jm, res = out
        if status == 2:
            raise np.linalg.LinAlgError("singular configuration (constraint Jacobian or reduced mass matrix)")
        if status == 0:
            return Point(np.array(z, dtype=float), q, qd, qdd, zdd, R, Jm, float(res))
        return self.continuation(z, zd, tau, ref.q if ref is not None else np.array(q_guess, dtype=float), M)

    def _dynamics(self, z: np.ndarray, zd: np.ndarray, tau: np.ndarray | None, q: np.ndarray, Jinv: np.ndarray,
                  res: float, M: np.ndarray | None) -> Point:
        model, m = self.model, self.model.m
        M = model.M if M is None else M
        R, Jm = Jinv[:, m:], Jinv[:, :m]
        qd = R @ zd
        s = Jm @ model.gamma(q, qd)
        Q = model.Q(q, qd, tau) - M @ s
        if self._g1:
            r = R[:, 0]
            zdd = np.array([(r @ Q) / (r @ M @ r)])
            qdd = r * zdd[0] + s
        else:
            zdd = np.linalg.solve(R.T @ M @ R, R.T @ Q)
            qdd = R @ zdd + s
        return Point(z.copy(), q, qd, qdd, zdd, R, Jm, res)


def dqdd_dx(j, x: np.ndarray, dof: np.ndarray, force: bool, G: np.ndarray, e0: int, L: int) -> np.ndarray:
    """∂q̈/∂x (n, L) of an independent-coordinate state x = [z, ż, c, b, ε, …] from the model's state
    Jacobians ``j`` (Model.state_jacobians at x's point): q = q(z), q̇ = R ż, the DOF force τ = b − c ⊙ ż
    (if ``force``) and the parameter errors ε at ``e0`` entering as the forces G ε (G (n, K), maybe empty).
    The reference path of kernels.dynamics.filter_jacobians."""
    g = dof.shape[0]
    out = np.zeros((j.R.shape[0], L))
    out[:, :g] = j.dqdd_dq @ j.R + j.dqdd_dqd @ j.dqd_dz
    out[:, g : 2 * g] = j.dqdd_dqd @ j.R
    if force:
        Gd = j.dqdd_dtau[:, dof]
        out[:, g : 2 * g] -= Gd * x[2 * g : 3 * g]
        out[:, 2 * g : 3 * g] = -Gd * x[g : 2 * g]
        out[:, 3 * g : 4 * g] = Gd
    if G.shape[1]:
        out[:, e0 : e0 + G.shape[1]] = j.dqdd_dtau @ G
    return out


def compiled_sensor_ids(table, sensor_ids: list[int]) -> np.ndarray | None:
    """The sensor indices as an array when the compiled measurement model (``table``: SensorParams.sensor_table,
    None when kernels are off) covers them all, else None."""
    if table is None or not all(table.covers(i) for i in sensor_ids):
        return None
    return np.array(sensor_ids, dtype=np.int64)


def measure_independent(sp: SensorParams, table, kernel, sensor_ids: list[int], pt: Point, p: np.ndarray,
                        jac: tuple | None, nd: int) -> tuple[np.ndarray, np.ndarray | None]:
    """Stacked predicted readings of the given sensors at a point of an independent-coordinate state
    x = [z, ż, …, p] (sensor parameters p from index ``nd``), and, with ``jac`` = (R, ∂q̇/∂z, ∂q̈/∂x (n, L))
    of the state, H = ∂y/∂x = H_q R + H_q̇ (∂q̇/∂z, R) + H_q̈ ∂q̈/∂x + H_p, every term exact: compiled in one
    call (``table``, ``kernel``: the filters' compiled model, or None), else the reference path."""
    ids = compiled_sensor_ids(table, sensor_ids)
    if ids is not None:
        return kernel.measure_sensors(ids, *kernels.contiguous(pt.q, pt.qd, pt.qdd), p, table, jac, nd)
    if jac is not None:
        R, dqd_dz, dqdd = jac
        n, g, L = R.shape[0], R.shape[1], dqdd.shape[1]
        dq = np.zeros((n, L))
        dq[:, :g] = R
        dqd = np.zeros((n, L))
        dqd[:, :g] = dqd_dz
        dqd[:, g : 2 * g] = R
    ys, Hs = [], []
    for i in sensor_ids:
        y, H_q, H_qd, H_qdd, H_p = sp.measure(i, pt.q, pt.qd, pt.qdd, p, jac is not None)
        ys.append(y)
        if jac is not None:
            H = H_q @ dq + H_qd @ dqd + H_qdd @ dqdd
            H[:, nd:] += H_p
            Hs.append(H)
    return np.concatenate(ys), (np.vstack(Hs) if jac is not None else None)

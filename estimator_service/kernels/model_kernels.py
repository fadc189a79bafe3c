"""A model's compiled kernels: :class:`ModelKernels`, the model's arrays and the entries Python calls.

:class:`ModelKernels` turns a ``Model`` into the kernels' arrays (manifold.py describes them) and wraps each kernel a
backend calls in a method that supplies them (C-contiguous float64: one compiled signature).  A backend is handed it
(warmup.compile_model) as its dynamics provider; the model is not changed.  No compiled code in this module: an edit
here does not invalidate numba's cache (jit.py).

numpy reference: ``Model.forward_dynamics``, ``forward_dynamics_jac_tau`` and ``state_jacobians``
(estimator_service/model.py), and each method's named counterpart in the backends.
"""

from __future__ import annotations

import numpy as np

from estimator_service.kernels import dynamics, fused_update, manifold, measurement, smoother, transition


def contiguous(*arrays: np.ndarray) -> tuple[np.ndarray, ...]:
    """C-contiguous float64 arrays for the kernels (a point from the reference path may hold views): one compiled
    signature, never a compilation inside a step."""
    return tuple(np.ascontiguousarray(a, dtype=np.float64) for a in arrays)


def _nonzeros(T: np.ndarray) -> np.ndarray:
    """The nonzeros of a constant array as rows (indices…, value): of a stack of Hessians (m, a, a) as
    (r, i, j, value) (nnz, 4), of a matrix (m, a) as (r, j, value) (nnz, 3).  A distance row's Hessian
    has 8, so evaluating Φ, Φ_q and the contractions costs O(m), not O(m·n²)."""
    idx = np.argwhere(T != 0.0)
    return np.ascontiguousarray(np.column_stack([idx.astype(np.float64), T[tuple(idx.T)]]).reshape(len(idx), T.ndim + 1))


class ModelKernels:
    """A model's arrays for the kernels and the compiled entries a backend calls: the dynamics provider that
    compile_model hands a backend (filterpy-style: passed in, not patched into the model).  ``forward_dynamics``,
    ``forward_dynamics_jac_tau`` and ``state_jacobians`` take the arguments of the :class:`~estimator_service.model.Model`
    methods of the same names, the numpy reference they are tested against; the model itself stays pure numpy.
    Only for square systems (m + g = n, no redundant constraints).
    """

    def __init__(self, model) -> None:
        f64 = np.float64
        self.model = model
        a = model.arrays
        # writable copies: the contract's arrays are read-only, and numba compiles read-only arrays as another type
        self.qe0 = np.array(a.qe0, dtype=f64, order="C")
        self.H = _nonzeros(a.H)
        self.B = _nonzeros(a.B)
        self.c = np.array(a.c, dtype=f64, order="C")
        self.Hq = _nonzeros(a.Hq)
        self.ang = np.array([(r.row, r.theta, r.xa, r.ya, r.xb, r.yb) for r in a.angles],
                            dtype=np.int64).reshape(len(a.angles), 6)
        self.angL = np.array([r.length for r in a.angles], dtype=f64)
        self.dof = np.array(a.dof, dtype=np.int64, order="C")
        self.M = np.array(a.M, dtype=f64, order="C")
        self.Qg = np.array(a.Q_gravity, dtype=f64, order="C")
        ne = a.ne
        self.DA = np.array([A for A, _ in a.dampers], dtype=f64).reshape(len(a.dampers), ne, ne)
        self.Dc = np.array([cc for _, cc in a.dampers], dtype=f64)
        self.mf, self.mi = self._model_buffers()
        #: entries of a point buffer (point_views)
        self.point_size = 2 * model.g + 3 * model.n + model.n * model.g + model.n * model.m + 1
        self._zero_tau = np.zeros(model.n)
        self._empty = np.zeros((0, 0))
        self._empty1 = np.zeros(0)

    def _model_buffers(self) -> tuple[np.ndarray, np.ndarray]:
        """(mf, mi): the model's arrays in two buffers (:func:`model_views`), for the flat entries."""
        floats = [self.qe0, self.H, self.B, self.c, self.Hq, self.angL, self.M, self.Qg, self.DA, self.Dc]
        assert len(floats) == transition.MODEL_FLOATS
        starts = np.cumsum([0] + [a.size for a in floats])
        head = [v for k, a in enumerate(floats) for v in (starts[k], a.size)]
        model = self.model
        counts = [model.n, self.qe0.size, model.m, model.g, len(self.H), len(self.B), len(self.Hq), len(self.ang),
                  len(self.DA)]
        mi = np.concatenate([np.array(head + counts, dtype=np.int64), self.ang.ravel(), self.dof]).astype(np.int64)
        return np.concatenate([a.ravel() for a in floats]).astype(np.float64), mi

    def point_buffer(self, pt) -> np.ndarray:
        """The point ``pt`` (z, q, q̇, q̈, z̈, R, Jm, residual) as one buffer (:func:`point_views`): its own when it
        came from a flat entry, else packed once and kept on it."""
        buf = getattr(pt, "buf", None)
        if buf is None:
            buf = np.empty(self.point_size)
            transition.pack_point(buf, *contiguous(pt.z, pt.q, pt.qd, pt.qdd, pt.zdd, pt.R, pt.Jm), float(pt.residual))
            pt.buf = buf
        return buf

    def advance_flat(self, x: np.ndarray, h: float, integ: int, force: bool, G: np.ndarray, e0: int, pt,
                     force_terms: tuple, tol: float, quad_res: float, max_newton: int) -> tuple | None:
        """(x⁺, the buffer of its point, G⁺ (n, K) = G0 − T q̈ there): the filter mean's transition of h seconds
        from x with its point ``pt`` (z, q, q̇, q̈, z̈, R, Jm, residual) by the integrator ``integ``, the point it
        reaches and the parameter forces at it (:func:`~.transition.advance_buffers`; ``force_terms`` = (G0, T)), by the flat
        entry :func:`~.transition.advance_flat`; None when it needs the reference path."""
        x_out, pt_out, G_out = np.empty(x.shape[0]), np.empty(self.point_size), np.empty(force_terms[0].shape)
        st = transition.advance_flat(h, integ, x, self.point_buffer(pt), force, G, e0, *force_terms, tol, quad_res, max_newton,
                           self.mf, self.mi, x_out, pt_out, G_out)
        return None if st != 0 else (x_out, pt_out, G_out)

    def _tau(self, tau: np.ndarray | None) -> np.ndarray:
        return self._zero_tau if tau is None else np.ascontiguousarray(tau, dtype=np.float64)

    def forward_dynamics_jac_tau(self, q: np.ndarray, qd: np.ndarray, tau: np.ndarray | None = None,
                                 M: np.ndarray | None = None) -> tuple:
        """Model.forward_dynamics_jac_tau, compiled."""
        qdd, dq, dqd, dtau, ok = dynamics.fdjt(np.ascontiguousarray(q, dtype=np.float64), np.ascontiguousarray(qd, dtype=np.float64),
                                       self._tau(tau), self.qe0, self.H, self.B, self.c, self.Hq, self.ang, self.angL,
                                       self.M if M is None else np.ascontiguousarray(M, dtype=np.float64),
                                       self.Qg, self.DA, self.Dc)
        if not ok:
            raise np.linalg.LinAlgError("singular KKT matrix (constraint Jacobian rank-deficient)")
        return qdd, dq, dqd, dtau

    def forward_dynamics(self, q: np.ndarray, qd: np.ndarray, tau: np.ndarray | None = None,
                         M: np.ndarray | None = None) -> np.ndarray:
        """Model.forward_dynamics, compiled."""
        qdd, ok = dynamics.fd(np.ascontiguousarray(q, dtype=np.float64), np.ascontiguousarray(qd, dtype=np.float64),
                      self._tau(tau), self.qe0, self.H, self.B, self.c, self.Hq, self.ang, self.angL,
                      self.M if M is None else np.ascontiguousarray(M, dtype=np.float64),
                      self.Qg, self.DA, self.Dc)
        if not ok:
            raise np.linalg.LinAlgError("singular KKT matrix (constraint Jacobian rank-deficient)")
        return qdd

    def fgs_dynamics(self, x: np.ndarray, dMs: np.ndarray, dQs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(q̈, ∂q̈/∂x) of the smoother's state x = [q, q̇, c, b, ε, p] (FixedLagSmoother._dynamics) with
        the parameter error directions ``dMs`` (K, n, n), ``dQs`` (K, n) of its ε."""
        f, F, ok = smoother.fgs_dynamics(np.ascontiguousarray(x, dtype=np.float64), self.qe0, self.H, self.B, self.c, self.Hq,
                                 self.ang, self.angL, self.dof, self.M, self.Qg, self.DA, self.Dc, dMs, dQs)
        if not ok:
            raise np.linalg.LinAlgError("singular KKT matrix (constraint Jacobian rank-deficient)")
        return f, F

    def fgs_accel(self, x: np.ndarray, dMs: np.ndarray, dQs: np.ndarray) -> np.ndarray:
        """q̈ at the smoother's state x (FixedLagSmoother._accel), see :func:`~.smoother.fgs_accel`."""
        f, ok = smoother.fgs_accel(np.ascontiguousarray(x, dtype=np.float64), self.qe0, self.H, self.B, self.c, self.Hq,
                           self.ang, self.angL, self.dof, self.M, self.Qg, self.DA, self.Dc, dMs, dQs)
        if not ok:
            raise np.linalg.LinAlgError("singular KKT matrix (constraint Jacobian rank-deficient)")
        return f

    def fgs_step(self, xp: np.ndarray | None, xc: np.ndarray, dt: float, prev: tuple | None, cur: tuple,
                 J_prev0: np.ndarray, J_cur0: np.ndarray, want_jac: bool) -> tuple:
        """(e, J_prev or None, J_cur or None) of the smoother's dynamics rows (FixedLagSmoother._step_residual);
        ``prev`` and ``cur`` are :meth:`fgs_dynamics` of x_{k-1} (None at the first step) and x_k."""
        xc = np.ascontiguousarray(xc, dtype=np.float64)
        has_prev = xp is not None
        fp, Fp = prev if has_prev else cur
        e, Jp, Jc = smoother.fgs_step(np.ascontiguousarray(xp, dtype=np.float64) if has_prev else xc, xc, has_prev, dt,
                              fp, Fp, cur[0], cur[1], J_prev0, J_cur0, want_jac, self.qe0, self.H, self.B, self.c,
                              self.Hq, self.ang, self.angL, self.dof)
        return e, (Jp if want_jac else None), (Jc if want_jac else None)

    def state_jacobians(self, q: np.ndarray, qd: np.ndarray, tau: np.ndarray | None = None,
                        M: np.ndarray | None = None):
        """Model.state_jacobians, compiled."""
        from estimator_service.model import StateJacobians

        *out, ok = dynamics.state_jacobians(np.ascontiguousarray(q, dtype=np.float64), np.ascontiguousarray(qd, dtype=np.float64),
                                    self._tau(tau), self.qe0, self.H, self.B, self.c, self.Hq, self.ang, self.angL,
                                    self.dof, self.M if M is None else np.ascontiguousarray(M, dtype=np.float64),
                                    self.Qg, self.DA, self.Dc)
        if not ok:
            raise np.linalg.LinAlgError("singular configuration (constraint Jacobian rank-deficient)")
        return StateJacobians(*out)

    def point(self, z: np.ndarray, zd: np.ndarray, tau: np.ndarray | None, ref_z: np.ndarray | None,
              ref_q: np.ndarray | None, ref_R: np.ndarray | None, ref_Jm: np.ndarray | None,
              q_guess: np.ndarray | None, tol: float, quad_res: float, max_newton: int,
              M: np.ndarray | None = None, light: bool = False) -> tuple:
        """(status, q, q̇, q̈, z̈, R, Jm, residual) of the manifold point: see :func:`~.manifold.point`; ``M`` replaces
        the model's mass matrix (a model with parameter errors)."""
        has_ref = ref_z is not None
        z = np.ascontiguousarray(z, dtype=np.float64)
        zd = np.ascontiguousarray(zd, dtype=np.float64)
        if has_ref:
            ref_q, ref_z = np.ascontiguousarray(ref_q, dtype=np.float64), np.ascontiguousarray(ref_z, dtype=np.float64)
            ref_R, ref_Jm = np.ascontiguousarray(ref_R, dtype=np.float64), np.ascontiguousarray(ref_Jm, dtype=np.float64)
            guess = ref_q
        else:
            guess = np.ascontiguousarray(q_guess, dtype=np.float64)
            ref_z, ref_q, ref_R, ref_Jm = z, guess, self._empty, self._empty
        return manifold.point(z, zd, self._tau(tau), has_ref, ref_z, ref_q, ref_R, ref_Jm, guess, tol, quad_res, max_newton,
                      light and has_ref, self.qe0, self.H, self.B, self.c, self.Hq, self.ang, self.angL, self.dof,
                      self.M if M is None else M, self.Qg, self.DA, self.Dc)

    def filter_transition(self, x: np.ndarray, h: float, integ: int, force: bool, G: np.ndarray, e0: int,
                          ref: tuple, want_point: bool, want_jac: bool, tol: float, quad_res: float,
                          max_newton: int) -> tuple:
        """(status, x⁺, F, q, q̇, q̈, z̈, R, Jm, residual): the filter's transition of h seconds, its Jacobian
        and the point of its result, see :func:`~.transition.filter_transition`; ``ref`` = (z, q, q̇, R, Jm, z̈) of x's point."""
        z0, q0, qd0, R0, Jm0, zdd0 = ref
        return transition.filter_transition(np.ascontiguousarray(x, dtype=np.float64), h, integ, self.dof.shape[0], force, G, e0,
                                  z0, q0, qd0, R0, Jm0, zdd0, want_point, want_jac, tol, quad_res, max_newton, self.qe0,
                                  self.H, self.B, self.c, self.Hq, self.ang, self.angL, self.dof, self.M, self.Qg,
                                  self.DA, self.Dc)

    def filter_sigma_transitions(self, X: np.ndarray, x0: np.ndarray, nd: int, h: float, integ: int, force: bool,
                                 G: np.ndarray, e0: int, ref: tuple, tol: float, quad_res: float,
                                 max_newton: int) -> tuple[int, np.ndarray]:
        """(status, X⁺): sigma points through the filter's mean transition, see :func:`~.transition.filter_sigma_transitions`;
        ``ref`` = (z, q, q̇, R, Jm, z̈) of x0's point."""
        z0, q0, qd0, R0, Jm0, zdd0 = ref
        return transition.filter_sigma_transitions(np.ascontiguousarray(X, dtype=np.float64),
                                         np.ascontiguousarray(x0, dtype=np.float64), nd, h, integ, self.dof.shape[0], force,
                                         G, e0, z0, q0, qd0, R0, Jm0, zdd0, tol, quad_res, max_newton, self.qe0, self.H,
                                         self.B, self.c, self.Hq, self.ang, self.angL, self.dof, self.M, self.Qg,
                                         self.DA, self.Dc)

    def filter_jacobians(self, x: np.ndarray, point: tuple, force: bool, G: np.ndarray, e0: int,
                         M: np.ndarray | None = None, Qg: np.ndarray | None = None) -> tuple:
        """(R, ∂q̇/∂z, ∂q̈/∂x, ok) of a filter state at its point ``point`` = (q, q̇, R, Jm), see
        :func:`~.dynamics.filter_jacobians`; ``M`` and ``Qg`` replace the model's mass matrix and gravity forces."""
        q, qd, R, Jm = point
        return dynamics.filter_jacobians(np.ascontiguousarray(x, dtype=np.float64), q, qd, R, Jm, x.shape[0],
                                 self.dof.shape[0], force, G, e0, self.qe0, self.Hq, self.ang, self.angL, self.dof,
                                 self.M if M is None else M, self.Qg if Qg is None else Qg, self.DA, self.Dc)

    def measure_sensors(self, ids: np.ndarray, q: np.ndarray, qd: np.ndarray, qdd: np.ndarray, p: np.ndarray, table,
                        jac: tuple | None, nd: int) -> tuple[np.ndarray, np.ndarray]:
        """(y, H or an empty array) of the sensors ``ids`` (SensorParams.sensor_table ``table``), see
        :func:`~.measurement.measure_sensors`; ``jac`` = (R, ∂q̇/∂z, ∂q̈/∂x) for H, or None."""
        R, dqd_dz, D = jac if jac is not None else (self._empty, self._empty, self._empty)
        return measurement.measure_sensors(ids, q, qd, qdd, np.ascontiguousarray(p, dtype=np.float64), table, self.qe0,
                                jac is not None, R, dqd_dz, D, nd)

    def smoother_point(self, x: np.ndarray, layout: tuple, ref: tuple | None, q_guess: np.ndarray, want_jac: bool,
                       terms: tuple, solver: tuple, step: tuple | None = None) -> tuple:
        """(status, x⁺, q, q̇, q̈, z̈, R, Jm, residual, R, ∂q̇/∂z, ∂q̈/∂x) of the independent smoother's state x, see
        :func:`~.smoother.smoother_point`; ``layout`` = (g, e0, p0) of x, ``ref`` = (z, q, R, Jm) of the reference point
        or None (Newton from ``q_guess``), ``terms`` = (dMs (K, n, n), dQs (K, n)) of η, ``solver`` = (tol,
        quadratic residual, max Newton steps); ``step`` = (z̈, Δt): at x's Taylor step instead (x⁺)."""
        zdd, dt = (self._empty1, 0.0) if step is None else step
        if ref is None:
            e2 = self._empty
            ref, has_ref = (x[: layout[0]], q_guess, e2, e2), False
        else:
            has_ref = True
        return smoother.smoother_point(x, zdd, dt, *layout, has_ref, *ref, q_guess, want_jac, *terms, *solver, self.qe0, self.H,
                               self.B, self.c, self.Hq, self.ang, self.angL, self.dof, self.M, self.Qg, self.DA, self.Dc)

    def smoother_positions(self, X: np.ndarray, layout: tuple, ref: tuple, terms: tuple, solver: tuple) -> tuple:
        """(status, q, q̇, and the last row's q̈, z̈, R, Jm, residual) of the independent smoother's states X (N, len(x)),
        see :func:`~.smoother.smoother_positions`;
        ``ref`` = (z, q, R, Jm) of the point the first search starts from."""
        return smoother.smoother_positions(np.ascontiguousarray(X, dtype=np.float64), *layout, *ref, *terms, *solver, self.qe0,
                                   self.H, self.B, self.c, self.Hq, self.ang, self.angL, self.dof, self.M, self.Qg,
                                   self.DA, self.Dc)

    def ekf_update_prepare(self, x: np.ndarray, P: np.ndarray, pt: np.ndarray, ids: np.ndarray, rvar: np.ndarray,
                           nd: int, force: bool, G: np.ndarray, e0: int, table, tol: float, quad_res: float,
                           max_newton: int, interval: tuple | None, advance: tuple) -> tuple:
        """The part of an EKF update with the sensors ``ids`` (SensorParams.sensor_table ``table``) that needs no
        readings (:func:`~.fused_update.ekf_update_prepare`); :meth:`ekf_update_finish` does the rest (FusedUpdates.fused_call:
        the two in a row; one compiled function for both would compile their call trees again, ~25 s on a fresh
        install).  ``pt`` is x's point as a buffer (:meth:`point_buffer`); ``rvar`` the readings' variances;
        ``interval`` = (x0, its point's buffer, G there, h, integrator code, process noise over h) of a covariance to
        propagate first (from x0's P), or None; ``advance`` = (h, integrator code, G0, T) of the mean's transition to
        the update's time (h = 0: none).

        In order: the mean's transition of h seconds to the update's time from x with its point, by the
        advance's integrator (:func:`~.transition.advance_buffers`, G from G0 and T at the point reached); status
        ADVANCE_FAILED when it needs the reference path (nothing done).  With an interval, the covariance over
        it: P = sym(F P0 Fᵀ) + Qh with F from x0 to the advanced x (:func:`interval_jacobian`, Euler or Heun);
        status 4 when x0's Jacobian is singular (nothing else done).  Then H and the readings at the point of x
        (:func:`~.dynamics.filter_jacobians`, :func:`~.measurement.measure_sensors`) and S; status 2 when x's Jacobian is singular.
        Returns (status, y_p, H, P Hᵀ, S, G, the advanced x, the propagated P, the buffer of the advanced x's
        point)."""
        pt_adv = np.empty(self.point_size)
        prop, x0, pt0, G_int, h, integ, Qh = self._interval_args(x, interval)
        return fused_update.ekf_update_prepare(np.ascontiguousarray(x, dtype=np.float64), P, pt, ids, rvar, nd, force, G, e0, table,
                                   tol, quad_res, max_newton, prop, x0, pt0, G_int, h, integ, Qh, *advance, self.mf,
                                   self.mi, pt_adv) + (pt_adv,)

    def ekf_update_finish(self, prepared: tuple, y: np.ndarray, angle: np.ndarray, rvar: np.ndarray, dims: np.ndarray,
                          gate: float, force: bool, e0: int, tol: float, quad_res: float, max_newton: int) -> tuple:
        """The rest of an EKF update from :meth:`ekf_update_prepare`'s output and the readings y (angles: the rows
        ``angle``; :func:`~.fused_update.ekf_update_finish`): the innovation e, the NIS of all rows and of each sensor (rows
        ``dims``), the standardised rows e_i/√S_ii; then, when every sensor passes the outlier gate (NIS ≤ ``gate`` ×
        its rows; gate 0: off), the Joseph-form correction with every row and the point of the corrected state found
        from the advanced mean's.  Returns (status, total NIS, NIS per sensor, standardised rows, e, x⁺, P⁺, the
        buffer of x⁺'s point): status 0 = corrected, 3 = a sensor failed the gate (not corrected: x⁺ and P⁺ empty;
        the caller gates and corrects), 1 or 2 from the corrected state's point (x⁺ and P⁺ given, the point not: the
        caller finds it on the reference path), else the prepared part's."""
        pt_new = np.empty(self.point_size)
        return fused_update.ekf_update_finish(prepared[:8], prepared[8], y, angle, rvar, dims, gate, force, e0, tol, quad_res,
                                  max_newton, self.mf, self.mi, pt_new) + (pt_new,)

    def ukf_update_prepare(self, x: np.ndarray, P: np.ndarray, pt: np.ndarray, ids: np.ndarray, rvar: np.ndarray,
                           nd: int, weights: tuple, force: bool, G: np.ndarray, e0: int, table, tol: float,
                           quad_res: float, max_newton: int, interval: tuple | None, advance: tuple) -> tuple:
        """The part of a UKF update with the sensors ``ids`` that needs no readings (:func:`~.fused_update.ukf_update_prepare`);
        :meth:`ukf_update_finish` does the rest, as :meth:`ekf_update_prepare`.  ``weights`` = (wm, wc, scale);
        ``interval`` = (x0, P0, its point's buffer, G there, h, integrator code, process noise over h) or None; the
        others as there.

        After the mean's transition: with an interval, the sigma points of (x0, P0) through the mean transition
        of its h seconds (:func:`~.transition.filter_sigma_transitions`), their covariance plus Qh.  Then the sigma points of
        (x, P) (Merwe's weights, spread ``scale``), their readings (:func:`~.measurement.filter_sigma_readings`), ȳ, dY and S.
        Returns (status, ȳ, X, dY, S, G, the advanced x, the prior P, the buffer of the advanced x's point):
        status 0, 4 = the propagation needs the reference path (nothing done), 5 = a covariance not positive
        definite, 6 = a sigma point's reading needs the reference path (the propagation done), ADVANCE_FAILED as
        there."""
        pt_adv = np.empty(self.point_size)
        if interval is None:
            prop, x0, P0, pt0, G_int, h, integ, Qh = False, x, P, pt, G, 0.0, 0, self._empty
        else:
            prop, (x0, P0, pt0, G_int, h, integ, Qh) = True, interval
        return fused_update.ukf_update_prepare(np.ascontiguousarray(x, dtype=np.float64), P, pt, ids, rvar, nd, *weights, force, G,
                                   e0, table, tol, quad_res, max_newton, prop,
                                   np.ascontiguousarray(x0, dtype=np.float64), P0, pt0, G_int, h, integ, Qh, *advance,
                                   self.mf, self.mi, pt_adv) + (pt_adv,)

    def ukf_update_finish(self, prepared: tuple, y: np.ndarray, angle: np.ndarray, rvar: np.ndarray, dims: np.ndarray,
                          gate: float, wc: np.ndarray, force: bool, e0: int, tol: float, quad_res: float,
                          max_newton: int) -> tuple:
        """The rest of a UKF update (:func:`~.fused_update.ukf_update_finish`), as :meth:`ekf_update_finish`."""
        pt_new = np.empty(self.point_size)
        return fused_update.ukf_update_finish(prepared[:8], prepared[8], y, angle, rvar, dims, gate, wc, force, e0, tol, quad_res,
                                  max_newton, self.mf, self.mi, pt_new) + (pt_new,)

    def _interval_args(self, x: np.ndarray, interval: tuple | None) -> tuple:
        """(propagate, x0, its point's buffer, G there, h, integrator code, process noise) of the EKF's update
        kernels, from ``interval`` or, without one, placeholders of the same types."""
        if interval is None:
            return False, np.ascontiguousarray(x, dtype=np.float64), np.zeros(self.point_size), \
                np.zeros((self.model.n, 0)), 0.0, 0, self._empty
        x0, pt0, G_int, h, integ, Qh = interval
        return True, np.ascontiguousarray(x0, dtype=np.float64), pt0, G_int, h, integ, Qh

    def filter_sigma_readings(self, X: np.ndarray, x0: np.ndarray, nd: int, ids: np.ndarray, force: bool, G: np.ndarray,
                              e0: int, ref: tuple, tol: float, quad_res: float, max_newton: int, table) -> tuple:
        """(status, Y): the sensors ``ids`` read at each sigma point, see :func:`~.measurement.filter_sigma_readings`;
        ``ref`` = (z, q, q̇, q̈, R, Jm) of x0's point."""
        z0, q0, qd0, qdd0, R0, Jm0 = ref
        return measurement.filter_sigma_readings(np.ascontiguousarray(X, dtype=np.float64), np.ascontiguousarray(x0, dtype=np.float64),
                                      nd, ids, self.dof.shape[0], force, G, e0, z0, q0, qd0, qdd0, R0, Jm0, tol, quad_res,
                                      max_newton, table, self.qe0, self.H, self.B,
                                      self.c, self.Hq, self.ang, self.angL, self.dof, self.M, self.Qg, self.DA, self.Dc)


"""Planar multibody model in natural coordinates (+ relative angles): kinematics and dynamics.

Pure numpy, no I/O.  Units SI (m, rad, kg, s).  Frames and the order of ``q`` are described in
docs/architecture.md: ``q`` holds x, y of every non-fixed point in file order, then the relative
coordinates.  Internally the fixed points' coordinates are appended to ``q`` ("extended"
coordinates ``qe``, length ``ne``) so every constraint is written with one index pattern.

Constraints:
- distance between two points of a body:  (rj - ri)·(rj - ri) - L² = 0   (quadratic, constant Hessian)
- slider: point on a fixed line:          d × (r - o) = 0                   (linear)
- relative angle θ of points a -> b:      (xb - xa) - L cos θ = 0  if |sin θ| ≥ |cos θ|
                                           (yb - ya) - L sin θ = 0  otherwise (as mbse does)

Dynamics:  M q̈ + Φ_qᵀ λ = Q,  Φ_q q̈ = γ = -Φ̇_q q̇,  with constant M (natural coordinates).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace

import numpy as np
import scipy.linalg

from estimator_service.errors import UserError
from estimator_service.mechanism import Mechanism
from estimator_service.model_arrays import AngleRow, ModelArrays, read_only_view

_ROT90 = np.array([[0.0, -1.0], [1.0, 0.0]])


#: a driven DOF's drive inertia over its own generalized inertia at q0 (:meth:`Model._add_drives`): the
#: model's acceleration of a driven DOF is its unbalanced force over this much inertia (≈ 1e-6 of the
#: free mechanism's)
DRIVE_INERTIA_RATIO = 1e6

#: largest change of the independent coordinates (rad or m) in one Newton solve of
#: :meth:`Model.solve_position`; larger changes are continued in steps of this size
CONTINUATION_STEP = 0.25


class AssemblyError(UserError):
    """The position problem has no solution near the given configuration."""


def _pivoted_rank(A: np.ndarray) -> tuple[int, np.ndarray]:
    """(numerical rank, column order) of A by QR with column pivoting: the first ``rank`` columns of
    the order are a largest independent set, the better conditioned (larger) columns first."""
    _, r, piv = scipy.linalg.qr(A, pivoting=True, mode="economic")
    tol = max(A.shape) * np.finfo(float).eps * max(abs(r[0, 0]), 1.0) * 1e3
    return int(np.sum(np.abs(np.diag(r)) > tol)), piv


@dataclass(frozen=True)
class StateJacobians:
    """Derivatives of the dependent state w.r.t. the independent one, at a consistent (q, q̇).

    q = q(z) (position problem), q̇ = R ż, q̈ = f(q, q̇, τ): ``R`` = ∂q/∂z = ∂q̇/∂ż (n, g),
    ``dqd_dz`` = ∂q̇/∂z at fixed ż (n, g), ``qdd`` and its partials w.r.t. q, q̇ (n, n) and τ (n, n).
    """

    R: np.ndarray
    dqd_dz: np.ndarray
    qdd: np.ndarray
    dqdd_dq: np.ndarray
    dqdd_dqd: np.ndarray
    dqdd_dtau: np.ndarray


class Model:
    """Kinematics and dynamics of a planar mechanism described by a :class:`Mechanism`.

    Attributes: ``n`` coordinates, ``m`` constraints, ``g`` degrees of freedom, ``dof`` (indices of
    the independent coordinates z in q), ``dof_names``, ``coord_names``, ``constraint_names``,
    ``q0`` (assembled initial configuration), ``M`` (n×n constant mass matrix, kg / kg·m², with the
    drive inertia of driven DOFs), ``driven`` (g,) and ``drive_density`` (g,): which DOFs a motor drives
    and the density of their unknown acceleration (``drives``: DOF name → density, from a rig's
    ``[[drive]]``; :meth:`_add_drives`), ``torque_driven`` (g,): the driven DOFs whose drive torque is a known
    input (``torque``: DOF name → the noise of its held torque, N·m·√s or N·√s).
    """

    def __init__(self, mech: Mechanism, drives: Mapping[str, float] | None = None,
                 torque: Mapping[str, float] | None = None) -> None:
        self.mech = mech
        self.gravity = np.asarray(mech.gravity, dtype=float)
        #: length scale of the mechanism (m): tolerances of the position problem scale with it
        self._size = 1.0 + max(max(abs(p.x), abs(p.y)) for p in mech.points)
        self._index_coordinates()
        self._build_constraints()
        self._build_inertia()
        self._build_dampers()
        self.q0 = self._assemble_initial()
        self._drop_redundant_constraints()
        self._choose_dof()
        self._add_drives(drives or {}, torque or {})
        #: the model's constant arrays (model_arrays.py), for every module outside this one; built once, final
        self.arrays = self._contract()

    # ------------------------------------------------------------------ construction
    def _index_coordinates(self) -> None:
        mech = self.mech
        names: list[str] = []
        meanings: list[str] = []
        point_idx: list[tuple[int, int]] = []
        fixed_values: list[float] = []
        n_free = sum(2 for p in mech.points if not p.fixed)
        n_rel = len(mech.relative_coordinates)
        self.n = n_free + n_rel
        k_free, k_fixed = 0, 0
        for i, p in enumerate(mech.points):
            if p.fixed:
                point_idx.append((self.n + k_fixed, self.n + k_fixed + 1))
                fixed_values += [p.x, p.y]
                k_fixed += 2
            else:
                point_idx.append((k_free, k_free + 1))
                names += [f"x{i}", f"y{i}"]
                meanings += [f"x of point {i} (m)", f"y of point {i} (m)"]
                k_free += 2
        for rc in mech.relative_coordinates:
            names.append(rc.name)
            meanings.append(f"angle of point {rc.a} -> point {rc.b} from +x (rad)")
        self.coord_names = names
        self.coord_meanings = meanings
        self._pidx = point_idx
        self._fixed = np.asarray(fixed_values, dtype=float)
        self.ne = self.n + len(fixed_values)
        self._qe = np.zeros(self.ne)
        self._qe[self.n :] = self._fixed

    def ext(self, q: np.ndarray) -> np.ndarray:
        """Extended coordinates: ``q`` followed by the fixed points' coordinates (a new array)."""
        qe = self._qe.copy()
        qe[: self.n] = q
        return qe

    def _ext_vel(self, qd: np.ndarray) -> np.ndarray:
        qde = np.zeros(self.ne)
        qde[: self.n] = qd
        return qde

    def _initial_guess(self) -> np.ndarray:
        q = np.zeros(self.n)
        for i, p in enumerate(self.mech.points):
            if not p.fixed:
                ix, iy = self._pidx[i]
                q[ix], q[iy] = p.x, p.y
        pts = self.mech.points
        for k, rc in enumerate(self.mech.relative_coordinates):
            a, b = pts[rc.a], pts[rc.b]
            q[self.n - len(self.mech.relative_coordinates) + k] = math.atan2(b.y - a.y, b.x - a.x)
        return q

    def _build_constraints(self) -> None:
        mech, ne = self.mech, self.ne
        quad_H: list[np.ndarray] = []
        quad_B: list[np.ndarray] = []
        quad_c: list[float] = []
        names: list[str] = []
        for body in mech.bodies:
            for (a, b), length in body.lengths.items():
                H = np.zeros((ne, ne))
                (xa, ya), (xb, yb) = self._pidx[a], self._pidx[b]
                for ia, ib in ((xa, xb), (ya, yb)):
                    # Φ = (qb - qa)² summed: ½ qeᵀ H qe with H = 2 (e_b - e_a)(e_b - e_a)ᵀ
                    H[ia, ia] += 2.0
                    H[ib, ib] += 2.0
                    H[ia, ib] -= 2.0
                    H[ib, ia] -= 2.0
                quad_H.append(H)
                quad_B.append(np.zeros(ne))
                quad_c.append(-(length**2))
                names.append(f"distance {a}-{b} = {length:.6g} m (body {body.name})")
        for s in mech.sliders:
            ox, oy = s.origin
            dx, dy = s.direction
            nrm = math.hypot(dx, dy)
            dx, dy = dx / nrm, dy / nrm
            xi, yi = self._pidx[s.point]
            Bv = np.zeros(ne)
            Bv[yi] += dx
            Bv[xi] -= dy
            quad_H.append(np.zeros((ne, ne)))
            quad_B.append(Bv)
            quad_c.append(-(dx * oy - dy * ox))
            names.append(f"point {s.point} on line through ({ox:.6g}, {oy:.6g}) dir ({dx:.4g}, {dy:.4g})")
        self._nq = len(quad_H)
        n_rel = len(mech.relative_coordinates)
        self.m = self._nq + n_rel
        self._H = np.zeros((self.m, ne, ne))
        self._B = np.zeros((self.m, ne))
        self._c = np.zeros(self.m)
        if quad_H:
            self._H[: self._nq] = np.array(quad_H)
            self._B[: self._nq] = np.array(quad_B)
            self._c[: self._nq] = quad_c
        self._angles: list[AngleRow] = []
        for k, rc in enumerate(mech.relative_coordinates):
            (xa, ya), (xb, yb) = self._pidx[rc.a], self._pidx[rc.b]
            length = self._pair_length(rc.a, rc.b)
            self._angles.append(
                AngleRow(self._nq + k, self.n - n_rel + k, xa, ya, xb, yb, length)
            )
            names.append(f"{rc.name} = angle of {rc.a}->{rc.b}")
        self.constraint_names = names
        self._theta_idx = np.array([a.theta for a in self._angles], dtype=int)
        self._angle_key: bytes | None = None
        self._angle_val: list = []
        # Hessians restricted to q (fixed coordinates never move).
        self._Hq = np.ascontiguousarray(self._H[:, : self.n, : self.n])

    def _pair_length(self, a: int, b: int) -> float:
        """Distance a-b fixed by a body's constraints, else from the file's initial coordinates."""
        for body in self.mech.bodies:
            for key in ((a, b), (b, a)):
                if key in body.lengths:
                    return body.lengths[key]
        pa, pb = self.mech.points[a], self.mech.points[b]
        return math.hypot(pb.x - pa.x, pb.y - pa.y)

    def _body_blocks(self, bi: int, m: float, I0: float) -> tuple[np.ndarray, np.ndarray]:
        """(mass matrix, gravity force) contributions (ne×ne, ne) of body ``bi`` with mass m and I0.

        Both are linear in (m, I0), which :meth:`inertia_derivatives` relies on.
        """
        ne, body, g = self.ne, self.mech.bodies[bi], self.gravity
        Me = np.zeros((ne, ne))
        Qe = np.zeros(ne)
        xi, yi, xj, yj, L = self._body_geom[bi]
        cx, cy = body.cog
        a_ii = m - 2.0 * m * cx / L + I0 / L**2
        a_ij = m * cx / L - I0 / L**2
        b_ij = m * cy / L
        a_jj = I0 / L**2
        blk_ij = a_ij * np.eye(2) + b_ij * _ROT90
        idx_i, idx_j = [xi, yi], [xj, yj]
        Me[np.ix_(idx_i, idx_i)] += a_ii * np.eye(2)
        Me[np.ix_(idx_j, idx_j)] += a_jj * np.eye(2)
        Me[np.ix_(idx_i, idx_j)] += blk_ij
        Me[np.ix_(idx_j, idx_i)] += blk_ij.T
        Qe[idx_i] += (m - m * cx / L) * g + b_ij * (_ROT90 @ g)
        Qe[idx_j] += (m * cx / L) * g - b_ij * (_ROT90 @ g)
        return Me, Qe

    def _build_inertia(self) -> None:
        ne = self.ne
        Me = np.zeros((ne, ne))
        Qe = np.zeros(ne)
        self._body_geom: list[tuple[int, int, int, int, float]] = []
        self._omega_A: list[np.ndarray] = []
        for bi, body in enumerate(self.mech.bodies):
            i, j = body.points[0], body.points[1]
            L = self._pair_length(i, j)
            (xi, yi), (xj, yj) = self._pidx[i], self._pidx[j]
            self._body_geom.append((xi, yi, xj, yj, L))
            Mb, Qb = self._body_blocks(bi, body.mass, body.I0)
            Me += Mb
            Qe += Qb
            # ω = qeᵀ A q̇e (bilinear; exact on the constraint manifold where |rj - ri| = L)
            A = np.zeros((ne, ne))
            ex = np.zeros(ne)
            ey = np.zeros(ne)
            ex[xj], ex[xi] = 1.0, -1.0
            ey[yj], ey[yi] = 1.0, -1.0
            A += (np.outer(ex, ey) - np.outer(ey, ex)) / L**2
            self._omega_A.append(A)
        self.M = np.ascontiguousarray(Me[: self.n, : self.n])
        self._Q_gravity = Qe[: self.n].copy()

    def _add_drives(self, drives: Mapping[str, float], torque: Mapping[str, float]) -> None:
        """Driven DOFs (a motor imposes their motion): each gets a drive inertia ``DRIVE_INERTIA_RATIO``
        times its own generalized inertia at q0 on its coordinate, so the dynamics leave its acceleration
        to the drive (z̈ of a driven DOF ≈ 0 from the model; the other DOFs follow the mechanism with the
        driven ones imposed) and the estimators carry the drive's unknown acceleration as process noise
        of density ``drive_density`` (rad/s²/√Hz or m/s²/√Hz). ``driven`` (g,) bool, ``drive_density`` (g,).

        A driven DOF in ``torque`` has its drive's torque as a known input (the estimators apply it: a rig's
        ``input = "torque"``): no drive inertia, the mechanism's own dynamics move it under that torque, and
        its density adds the held torque's error: a white error of σ held for T seconds moves ż by σT/M̄_dd
        per message, a density σ√T/M̄_dd (``torque[dof]`` = σ√T; M̄ the generalized inertia at q0).
        ``torque_driven`` (g,) bool."""
        self.driven = np.zeros(self.g, dtype=bool)
        self.drive_density = np.zeros(self.g)
        self.torque_driven = np.zeros(self.g, dtype=bool)
        if not drives:
            return
        R = self.R(self.q0)
        Mbar = R.T @ self.M @ R
        M = self.M.copy()
        for name, density in drives.items():
            d = self.dof_names.index(name)
            self.driven[d] = True
            inertia = max(float(Mbar[d, d]), 1e-12)
            if name in torque:
                self.torque_driven[d] = True
                self.drive_density[d] = math.hypot(float(density), float(torque[name]) / inertia)
            else:
                self.drive_density[d] = float(density)
                M[self.dof[d], self.dof[d]] += DRIVE_INERTIA_RATIO * inertia
        self.M = np.ascontiguousarray(M)

    def inertia_derivatives(self, body: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(∂M/∂m, ∂M/∂I0, ∂Q_gravity/∂m) of one body (n×n, n×n, n): M and Q are linear in them."""
        n = self.n
        Mm, Qm = self._body_blocks(body, 1.0, 0.0)
        MI, _ = self._body_blocks(body, 0.0, 1.0)
        return Mm[:n, :n].copy(), MI[:n, :n].copy(), Qm[:n].copy()

    def _build_dampers(self) -> None:
        self._dampers: list[tuple[np.ndarray, float]] = []
        for d in self.mech.dampers:
            A = self._omega_A[d.body_a].copy()
            if d.body_b is not None:
                A -= self._omega_A[d.body_b]
            self._dampers.append((A, d.c))

    def _assemble_initial(self) -> np.ndarray:
        q = self._initial_guess()
        free = np.arange(self.n)
        return self._newton(q, free, what="initial assembly from the file's point coordinates")

    def _drop_redundant_constraints(self) -> None:
        """Keep a largest independent set of constraint rows at the assembled q0.

        Parallelograms and other overconstrained loops make rows of Φ_q linearly dependent (mbse's
        pick-and-place robot: 21 rows of rank 20); the dynamics (KKT and R matrices) need independent
        rows.  Rows are chosen by QR with column pivoting of Φ_qᵀ, relative-angle rows first (they
        define their angle coordinate); the dropped rows' names are in :attr:`redundant`.  They hold
        on the assembly branch of q0 wherever the kept rows do, which is what overconstrained
        mechanisms are built for.
        """
        self.redundant: list[str] = []
        if self.m == 0:
            return
        weight = np.ones(self.m)
        weight[self._nq :] = 1e3  # relative-angle rows are kept first
        rank, piv = _pivoted_rank((self.Phi_q(self.q0) * weight[:, None]).T)
        if rank == self.m:
            return
        keep = np.sort(piv[:rank])
        if np.setdiff1d(np.arange(self._nq, self.m), keep).size:
            raise AssemblyError(f"{self.mech.source}: the relative angle coordinates are not independent "
                                f"of each other at the initial configuration")
        self.redundant = [self.constraint_names[i] for i in np.setdiff1d(np.arange(self.m), keep)]
        new_row = {int(old): k for k, old in enumerate(keep)}
        self.constraint_names = [self.constraint_names[i] for i in keep]
        self._H, self._B, self._c = self._H[keep], self._B[keep], self._c[keep]
        self._Hq = np.ascontiguousarray(self._H[:, : self.n, : self.n])
        self._nq = int(np.sum(keep < self._nq))
        self._angles = [replace(a, row=new_row[a.row]) for a in self._angles]
        self._angle_key = None  # the cached angle terms name the old rows
        self.m = rank

    def _choose_dof(self) -> None:
        mech = self.mech
        if mech.dofs:
            self.dof = np.array([d.coordinate for d in mech.dofs], dtype=int)
            self.dof_names = [d.name for d in mech.dofs]
        else:
            scale = np.ones(self.n)
            scale[self.n - len(mech.relative_coordinates) :] = 1e-3  # prefer angles as DOF
            rank, piv = _pivoted_rank(self.Phi_q(self.q0) * scale)
            self.dof = np.sort(piv[rank:]).astype(int)
            self.dof_names = [self.coord_names[i] for i in self.dof]
        self.g = len(self.dof)
        self._dependent = np.setdiff1d(np.arange(self.n), self.dof)
        self._S = np.zeros((self.g, self.n))
        self._S[np.arange(self.g), self.dof] = 1.0
        J = np.vstack([self.Phi_q(self.q0), self._S])
        if np.linalg.matrix_rank(J) < self.n:
            raise AssemblyError(
                f"{mech.source}: dofs: coordinates {self.dof_names} do not determine the mechanism "
                f"at its initial configuration (Jacobian rank {np.linalg.matrix_rank(J)} < {self.n})"
            )
        self._square = J.shape[0] == self.n

    def _contract(self) -> ModelArrays:
        """The final model's arrays (read-only; the private ones are frozen in place, M and dof by view)."""
        return ModelArrays(
            n=self.n, ne=self.ne, m=self.m, g=self.g, size=self._size, qe0=self._qe, H=self._H, B=self._B, c=self._c,
            Hq=self._Hq, angles=tuple(self._angles), dampers=tuple(self._dampers), Q_gravity=self._Q_gravity,
            M=read_only_view(self.M), dof=read_only_view(self.dof), dependent=self._dependent, S=self._S,
            body_geom=tuple(self._body_geom), omega_A=tuple(self._omega_A))

    # ------------------------------------------------------------------ constraints
    def _angle_terms(self, q: np.ndarray) -> list[tuple[AngleRow, bool, float, float, float, float]]:
        """Per relative-angle row: (row, x-form?, value term, d/dθ, d²/dθ², d³/dθ³) of its θ part.

        x-form: Φ = (xb − xa) − L cos θ; y-form: Φ = (yb − ya) − L sin θ (the better conditioned one).
        The last result is reused while the angles are unchanged (most calls share one q).
        """
        key = q[self._theta_idx].tobytes()
        if key == self._angle_key:
            return self._angle_val
        out = []
        for a in self._angles:
            th = q[a.theta]
            s, c = math.sin(th), math.cos(th)
            L = a.length
            if abs(s) >= abs(c):
                out.append((a, True, -L * c, L * s, L * c, -L * s))
            else:
                out.append((a, False, -L * s, -L * c, L * s, L * c))
        self._angle_key, self._angle_val = key, out
        return out

    def Phi(self, q: np.ndarray) -> np.ndarray:
        """Constraint vector Φ(q) (m,); units m² (distances), m (sliders, angles)."""
        qe = self.ext(q)
        out = 0.5 * np.einsum("rij,i,j->r", self._H, qe, qe) + self._B @ qe + self._c
        for a, xform, v, _, _, _ in self._angle_terms(q):
            out[a.row] = (qe[a.xb] - qe[a.xa] if xform else qe[a.yb] - qe[a.ya]) + v
        return out

    def Phi_q(self, q: np.ndarray) -> np.ndarray:
        """Constraint Jacobian Φ_q (m, n)."""
        qe = self.ext(q)
        J = self._H @ qe + self._B  # (m, ne); sliced to q below
        for a, xform, _, d1, _, _ in self._angle_terms(q):
            J[a.row, a.xb if xform else a.yb] += 1.0
            J[a.row, a.xa if xform else a.ya] -= 1.0
            J[a.row, a.theta] = d1
        return J[:, : self.n]

    def hess_contract(self, q: np.ndarray, v: np.ndarray) -> np.ndarray:
        """(m, n) matrix with [r, k] = Σ_l ∂²Φ_r/∂q_k∂q_l v_l.

        Equals Φ̇_q for v = q̇ and ∂(Φ_q(q) v)/∂q for any v (constraints are scleronomic).
        """
        out = self._Hq @ v
        for a, _, _, _, d2, _ in self._angle_terms(q):
            out[a.row, a.theta] = d2 * v[a.theta]
        return out

    def dPhiq_qd_dq(self, q: np.ndarray, qd: np.ndarray) -> np.ndarray:
        """∂(Φ_q(q) q̇)/∂q (m, n): the velocity-constraint factor Jacobian."""
        return self.hess_contract(q, qd)

    def lambda_hessian(self, q: np.ndarray, lam: np.ndarray) -> np.ndarray:
        """Σ_r λ_r ∂²Φ_r/∂q² (n, n) = ∂(Φ_qᵀ λ)/∂q."""
        out = (lam @ self._Hq.reshape(self.m, -1)).reshape(self.n, self.n)
        for a, _, _, _, d2, _ in self._angle_terms(q):
            out[a.theta, a.theta] += lam[a.row] * d2
        return out

    def gamma(self, q: np.ndarray, qd: np.ndarray) -> np.ndarray:
        """Right-hand side of the acceleration constraints γ = -Φ̇_q q̇ (m,)."""
        return -(self.hess_contract(q, qd) @ qd)

    def gamma_jac(self, q: np.ndarray, qd: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(∂γ/∂q, ∂γ/∂q̇), each (m, n)."""
        return self._gamma_dq(q, qd), -2.0 * self.hess_contract(q, qd)

    def _gamma_dq(self, q: np.ndarray, qd: np.ndarray) -> np.ndarray:
        """∂γ/∂q (m, n): only the relative-angle rows depend on q beyond their Hessian."""
        dg_dq = np.zeros((self.m, self.n))
        for a, _, _, _, _, d3 in self._angle_terms(q):
            w = qd[a.theta]
            dg_dq[a.row, a.theta] = -d3 * w * w
        return dg_dq

    # ------------------------------------------------------------------ kinematic problems
    def _newton(self, q: np.ndarray, free: np.ndarray, what: str, tol: float = 1e-12, max_iter: int = 60) -> np.ndarray:
        q = np.array(q, dtype=float)
        scale = self._size
        res = np.inf
        for _ in range(max_iter):
            phi = self.Phi(q)
            res = float(np.max(np.abs(phi))) if phi.size else 0.0
            if not np.isfinite(res):
                break
            if res <= tol * scale * scale:
                return q
            J = self.Phi_q(q)[:, free]
            try:
                q[free] -= np.linalg.solve(J, phi) if J.shape[0] == J.shape[1] else np.linalg.lstsq(J, phi, rcond=None)[0]
            except np.linalg.LinAlgError:  # singular configuration: least-squares step
                q[free] -= np.linalg.lstsq(J, phi, rcond=None)[0]
        raise AssemblyError(
            f"{self.mech.source}: {what}: position problem did not converge "
            f"(max |Phi| = {res:.3g}); the mechanism cannot be assembled there"
        )

    def solve_position(self, q_guess: np.ndarray, z: np.ndarray | None = None, tol: float = 1e-12) -> np.ndarray:
        """Newton–Raphson on Φ(q) = 0 from ``q_guess`` (keeps its branch), with q[dof] = z if given.

        Converged when max |Φ| ≤ tol · (1 + size of the mechanism in m)².

        A large change of z is taken in steps of at most :data:`CONTINUATION_STEP` (halved again
        while Newton fails), continuation from the guess, so the solution stays on the guess's
        assembly branch: one Newton solve over a large change may converge to another root (e.g. a
        relative-angle row in x-form admits the mirrored point).
        """
        q = np.array(q_guess, dtype=float)
        if z is None:
            return self._newton(q, np.arange(self.n), what="position problem", tol=tol)
        z = np.asarray(z, dtype=float)
        z_from = q[self.dof].copy()
        what = f"position problem for z = {np.round(z, 6).tolist()}"
        span = float(np.max(np.abs(z - z_from))) if z.size else 0.0
        first = max(1, math.ceil(span / CONTINUATION_STEP)) if np.isfinite(span) else 1
        depth = 0
        while True:
            try:
                steps = first * 2**depth
                for i in range(1, steps + 1):
                    q[self.dof] = z_from + (z - z_from) * i / steps
                    q = self._newton(q, self._dependent, what=what, tol=tol)
                return q
            except AssemblyError:
                depth += 1
                if depth > 5:
                    raise
                q = np.array(q_guess, dtype=float)

    def _solve_J(self, q: np.ndarray, rhs: np.ndarray) -> np.ndarray:
        """Solve [Φ_q; S] x = rhs (least squares when constraints are redundant)."""
        J = np.vstack([self.Phi_q(q), self._S])
        if self._square:
            return np.linalg.solve(J, rhs)
        return np.linalg.lstsq(J, rhs, rcond=None)[0]

    def solve_velocity(self, q: np.ndarray, zd: np.ndarray) -> np.ndarray:
        """q̇ with Φ_q q̇ = 0 and q̇[dof] = ż."""
        return self._solve_J(q, np.concatenate([np.zeros(self.m), np.atleast_1d(zd)]))

    def solve_acceleration(self, q: np.ndarray, qd: np.ndarray, zdd: np.ndarray) -> np.ndarray:
        """q̈ with Φ_q q̈ = γ and q̈[dof] = z̈."""
        return self._solve_J(q, np.concatenate([self.gamma(q, qd), np.atleast_1d(zdd)]))

    def R(self, q: np.ndarray) -> np.ndarray:
        """R matrix (n, g): q̇ = R ż."""
        rhs = np.zeros((self.m + self.g, self.g))
        rhs[self.m :] = np.eye(self.g)
        return self._solve_J(q, rhs)

    # ------------------------------------------------------------------ forces and dynamics
    def Q(self, q: np.ndarray, qd: np.ndarray, tau: np.ndarray | None = None) -> np.ndarray:
        """Generalized forces (n,): gravity + joint dampers + ``tau`` (generalized forces, added as is)."""
        out = self._Q_gravity.copy()
        if self._dampers:
            qe, qde = self.ext(q), self._ext_vel(qd)
            for A, c in self._dampers:
                j = (A.T @ qe)[: self.n]
                out -= c * j * float(qe @ A @ qde)
        if tau is not None:
            out += tau
        return out

    def Q_jac(self, q: np.ndarray, qd: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(∂Q/∂q, ∂Q/∂q̇), each (n, n)."""
        dQ_dq = np.zeros((self.n, self.n))
        dQ_dqd = np.zeros((self.n, self.n))
        if self._dampers:
            qe, qde = self.ext(q), self._ext_vel(qd)
            for A, c in self._dampers:
                j = (A.T @ qe)[: self.n]
                w = float(qe @ A @ qde)
                dw_dq = (A @ qde)[: self.n]
                dQ_dqd -= c * np.outer(j, j)
                dQ_dq -= c * (A.T[: self.n, : self.n] * w + np.outer(j, dw_dq))
        return dQ_dq, dQ_dqd

    def _kkt(self, q: np.ndarray, M: np.ndarray | None = None) -> np.ndarray:
        K = np.zeros((self.n + self.m, self.n + self.m))
        Jq = self.Phi_q(q)
        K[: self.n, : self.n] = self.M if M is None else M
        K[: self.n, self.n :] = Jq.T
        K[self.n :, : self.n] = Jq
        return K

    def forward_dynamics(self, q: np.ndarray, qd: np.ndarray, tau: np.ndarray | None = None,
                         M: np.ndarray | None = None) -> np.ndarray:
        """q̈ from M q̈ + Φ_qᵀ λ = Q, Φ_q q̈ = γ (Lagrange multipliers, dependent coordinates); ``M``
        replaces the model's mass matrix (a model with other inertia parameters: backends/uncertainty.py)."""
        rhs = np.concatenate([self.Q(q, qd, tau), self.gamma(q, qd)])
        return np.linalg.solve(self._kkt(q, M), rhs)[: self.n]

    def forward_dynamics_jac(
        self, q: np.ndarray, qd: np.ndarray, tau: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(q̈, ∂q̈/∂q, ∂q̈/∂q̇) of :meth:`forward_dynamics`, analytic."""
        qdd, d_q, d_qd, _ = self.forward_dynamics_jac_tau(q, qd, tau)
        return qdd, d_q, d_qd

    def forward_dynamics_jac_tau(
        self, q: np.ndarray, qd: np.ndarray, tau: np.ndarray | None = None, M: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(q̈, ∂q̈/∂q, ∂q̈/∂q̇, ∂q̈/∂τ) with τ the generalized forces added to Q (n,); ``M`` as in
        :meth:`forward_dynamics`."""
        n = self.n
        Kinv = np.linalg.inv(self._kkt(q, M))
        Cqd = self.hess_contract(q, qd)
        rhs = np.concatenate([self.Q(q, qd, tau), -(Cqd @ qd)])
        x = Kinv @ rhs
        qdd, lam = x[:n], x[n:]
        dQ_dq, dQ_dqd = self.Q_jac(q, qd)
        dg_dq = self._gamma_dq(q, qd)
        R_q = np.vstack([dQ_dq - self.lambda_hessian(q, lam), dg_dq - self.hess_contract(q, qdd)])
        R_qd = np.vstack([dQ_dqd, -2.0 * Cqd])
        return qdd, Kinv[:n] @ R_q, Kinv[:n] @ R_qd, Kinv[:n, :n]

    def zdd(self, q: np.ndarray, qd: np.ndarray, tau: np.ndarray | None = None) -> np.ndarray:
        """Independent accelerations z̈ = M̄⁻¹ Q̄ (R-matrix formulation) for a consistent (q, q̇)."""
        return self.forward_dynamics(q, qd, tau)[self.dof]

    def zdd_jac(
        self, q: np.ndarray, qd: np.ndarray, tau: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(z̈, ∂z̈/∂z, ∂z̈/∂ż) with q = q(z) on the constraint manifold and q̇ = R(q) ż."""
        j = self.state_jacobians(q, qd, tau)
        return j.qdd[self.dof], (j.dqdd_dq @ j.R + j.dqdd_dqd @ j.dqd_dz)[self.dof], (j.dqdd_dqd @ j.R)[self.dof]

    def state_jacobians(self, q: np.ndarray, qd: np.ndarray, tau: np.ndarray | None = None,
                        M: np.ndarray | None = None) -> StateJacobians:
        """Everything a filter in independent coordinates needs at a consistent (q, q̇); see StateJacobians.
        ``M`` as in :meth:`forward_dynamics_jac_tau` (a model with parameter errors)."""
        qdd, dq, dqd, dtau = self.forward_dynamics_jac_tau(q, qd, tau, M)
        R = self.R(q)
        # ∂q̇/∂q at fixed ż: differentiate [Φ_q; S] q̇ = [0; ż]  ->  J dq̇ = -[∂(Φ_q q̇)/∂q; 0]
        rhs = np.vstack([-self.hess_contract(q, qd), np.zeros((self.g, self.n))])
        dqd_dz = self._solve_J(q, rhs) @ R
        return StateJacobians(R, dqd_dz, qdd, dq, dqd, dtau)

    def energy(self, q: np.ndarray, qd: np.ndarray) -> float:
        """Kinetic plus gravitational potential energy (J); potential zero at the global origin."""
        T = 0.5 * float(qd @ self.M @ qd)
        V = 0.0
        for bi, body in enumerate(self.mech.bodies):
            r, _ = self.point_position(q, bi, body.cog)
            V -= body.mass * float(self.gravity @ r)
        return T + V

    # ------------------------------------------------------------------ bodies and points
    def body_index(self, key: str | int) -> int:
        """Index of a body given by index or name (KeyError with the known names otherwise)."""
        if isinstance(key, int) and 0 <= key < len(self.mech.bodies):
            return key
        for i, b in enumerate(self.mech.bodies):
            if b.name == key:
                return i
        raise KeyError(f"unknown body {key!r}; bodies are {[b.name for b in self.mech.bodies]}")

    def body_angle(self, q: np.ndarray, body: int) -> tuple[float, np.ndarray]:
        """Body angle φ (rad, CCW from +x) of the first->second point line, and ∂φ/∂q (n,)."""
        xi, yi, xj, yj, _ = self._body_geom[body]
        qe = self.ext(q)
        dx, dy = qe[xj] - qe[xi], qe[yj] - qe[yi]
        s = dx * dx + dy * dy
        J = np.zeros(self.ne)
        J[xj] += -dy / s
        J[xi] -= -dy / s
        J[yj] += dx / s
        J[yi] -= dx / s
        return math.atan2(dy, dx), J[: self.n]

    def body_rate(self, q: np.ndarray, qd: np.ndarray, body: int) -> tuple[float, np.ndarray, np.ndarray]:
        """Angular rate ω (rad/s, CCW) of a body, ∂ω/∂q and ∂ω/∂q̇ (each (n,))."""
        A = self._omega_A[body]
        qe, qde = self.ext(q), self._ext_vel(qd)
        Aqd = A @ qde
        return float(qe @ Aqd), Aqd[: self.n], (A.T @ qe)[: self.n]

    def point_matrix(self, body: int, local: tuple[float, float] | np.ndarray) -> np.ndarray:
        """C (2, ne) such that the global position of the body point is r = C qe (linear)."""
        xi, yi, xj, yj, L = self._body_geom[body]
        a, b = float(local[0]) / L, float(local[1]) / L
        C = np.zeros((2, self.ne))
        # r = ri + a (rj - ri) + b R90 (rj - ri)
        C[0, xi] += 1.0 - a
        C[1, yi] += 1.0 - a
        C[0, xj] += a
        C[1, yj] += a
        C[0, yj] -= b
        C[0, yi] += b
        C[1, xj] += b
        C[1, xi] -= b
        return C

    def point_position(self, q: np.ndarray, body: int, local: tuple[float, float] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Global position (m) of a point given in body frame, and ∂r/∂q (2, n)."""
        C = self.point_matrix(body, local)
        return C @ self.ext(q), C[:, : self.n]

    def point_acceleration(
        self, q: np.ndarray, qd: np.ndarray, qdd: np.ndarray, body: int, local: tuple[float, float] | np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Global acceleration (m/s²) of a body point; (a, ∂a/∂q, ∂a/∂q̇, ∂a/∂q̈). Linear in q̈."""
        C = self.point_matrix(body, local)[:, : self.n]
        zero = np.zeros((2, self.n))
        return C @ qdd, zero, zero.copy(), C

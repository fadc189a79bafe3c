"""Kinematics and dynamics of a :class:`~estimator_service.model.Model` at N states at once: the model's
equations (constraints Φ, Φ_q, γ, the velocity and acceleration problems, KKT forward dynamics, dampers) on arrays
with a leading N, read from its contract (``Model.arrays``, estimator_service/model_arrays.py).  For whole
trajectories: the identification's nodes (estimator_service/identify.py) and the virtual sensors' predictions
along an encoder trajectory (estimator_service/kinematics_check.py, calibrate.py).  Tested against ``Model``
sample by sample (tests/test_stacked.py).  Units SI, angles rad.
"""

from __future__ import annotations

import numpy as np

from estimator_service.model import CONTINUATION_STEP, AssemblyError, Model


def assembly_guesses(model: Model, Z: np.ndarray, q_start: np.ndarray | None = None) -> np.ndarray:
    """A guess of q (N, n) for each node of a trajectory Z (N, g), in order, on the assembly branch of
    ``q_start`` (default the mechanism file's assembly, ``model.q0``): a node's guess is the last solution
    found, and the position problem is solved again (Model.solve_position) only where z has moved more than
    one of its continuation steps (model.CONTINUATION_STEP) since it; :meth:`StackedModel.solve_position`
    then solves every node from its guess at once."""
    warm = np.zeros((len(Z), model.n))
    q = (model.q0 if q_start is None else q_start).copy()
    z_last = q[model.dof].copy()
    for i in range(len(Z)):
        if Z.shape[1] and float(np.max(np.abs(Z[i] - z_last))) > CONTINUATION_STEP:
            q = model.solve_position(q, Z[i])
            z_last = Z[i].copy()
        warm[i] = q
    return warm


#: nodes solved at once by :func:`kinematics_along` (its arrays are ~ chunk × (n + m)² floats)
CHUNK = 20_000


def kinematics_along(model: Model, Z: np.ndarray, Zd: np.ndarray, Zdd: np.ndarray
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(q, q̇, q̈), each (N, n), of a trajectory's independent coordinates, rates and accelerations Z, Ż, Z̈
    (N, g), in order: positions on the assembly branch of the mechanism file (:func:`assembly_guesses`),
    solved :data:`CHUNK` nodes at a time."""
    sm = StackedModel(model)
    q, qd, qdd = (np.empty((len(Z), model.n)) for _ in range(3))
    start = None
    for a in range(0, len(Z), CHUNK):
        s = slice(a, a + CHUNK)
        q[s] = sm.solve_position(assembly_guesses(model, Z[s], start), Z[s])
        qd[s] = sm.velocities(q[s], Zd[s])
        qdd[s] = sm.accelerations(q[s], qd[s], Zdd[s])
        start = q[s][-1]
    return q, qd, qdd


class StackedModel:
    """Kinematics and dynamics of a :class:`Model` at N states at once (arrays with a leading N).

    The same equations as ``Model`` (constraints, mass matrix, dampers, KKT forward dynamics),
    vectorised over the nodes of a trajectory; uses the model's constraint and inertia tables.
    """

    def __init__(self, model: Model) -> None:
        a = model.arrays
        self.model = model
        self.arrays = a
        self.n, self.m, self.g, self.ne = a.n, a.m, a.g, a.ne
        self.H, self.B, self.c, self.Hq = a.H, a.B, a.c, a.Hq
        self.angles = a.angles
        self.dof, self.dep = a.dof, a.dependent
        self.S = a.S
        self.fixed = a.fixed
        self.dampers = a.dampers
        self.M = a.M
        self.Qg = a.Q_gravity

    def ext(self, q: np.ndarray) -> np.ndarray:
        return np.concatenate([q, np.broadcast_to(self.fixed, (len(q), len(self.fixed)))], axis=1)

    def _angle_terms(self, q: np.ndarray) -> list[tuple]:
        out = []
        for a in self.angles:
            th = q[:, a.theta]
            s, c = np.sin(th), np.cos(th)
            L = a.length
            xf = np.abs(s) >= np.abs(c)
            out.append((a, xf, np.where(xf, -L * c, -L * s), np.where(xf, L * s, -L * c),
                        np.where(xf, L * c, L * s), np.where(xf, -L * s, L * c)))
        return out

    def phi(self, q: np.ndarray) -> np.ndarray:
        qe = self.ext(q)
        out = 0.5 * np.einsum("rij,ni,nj->nr", self.H, qe, qe) + qe @ self.B.T + self.c
        for a, xf, v, _, _, _ in self._angle_terms(q):
            out[:, a.row] = np.where(xf, qe[:, a.xb] - qe[:, a.xa], qe[:, a.yb] - qe[:, a.ya]) + v
        return out

    def phi_q(self, q: np.ndarray) -> np.ndarray:
        qe = self.ext(q)
        J = np.einsum("rij,nj->nri", self.H, qe) + self.B
        for a, xf, _, d1, _, _ in self._angle_terms(q):
            f = xf.astype(float)
            J[:, a.row, :] = 0.0
            J[:, a.row, a.xb] += f
            J[:, a.row, a.xa] -= f
            J[:, a.row, a.yb] += 1.0 - f
            J[:, a.row, a.ya] -= 1.0 - f
            J[:, a.row, a.theta] = d1
        return J[:, :, : self.n]

    def hess_contract(self, q: np.ndarray, v: np.ndarray, terms: list) -> np.ndarray:
        out = np.einsum("rkl,nl->nrk", self.Hq, v)
        for a, _, _, _, d2, _ in terms:
            out[:, a.row, a.theta] = d2 * v[:, a.theta]
        return out

    def solve_position(self, q: np.ndarray, z: np.ndarray, tol: float = 1e-12, max_iter: int = 30) -> np.ndarray:
        """Newton on the dependent coordinates of every node from ``q`` (keeps each node's branch)."""
        q = q.copy()
        q[:, self.dof] = z
        scale = self.arrays.size ** 2
        for _ in range(max_iter):
            ph = self.phi(q)
            err = np.max(np.abs(ph), axis=1)
            bad = err > tol * scale
            if not bad.any():
                return q
            J = self.phi_q(q[bad])[:, :, self.dep]
            if J.shape[1] == J.shape[2]:
                step = np.linalg.solve(J, ph[bad][:, :, None])[:, :, 0]
            else:
                step = np.einsum("nij,nj->ni", np.linalg.pinv(J), ph[bad])
            q[np.ix_(np.flatnonzero(bad), self.dep)] -= step
        k = int(np.argmax(np.max(np.abs(self.phi(q)), axis=1)))
        raise AssemblyError(f"{self.model.mech.source}: position problem did not converge at node {k} of {len(z)} of a "
                            f"trajectory (z = {z[k].tolist()})")

    def _joint_matrix(self, Pq: np.ndarray) -> np.ndarray:
        """[Φ_q; S] (N, m + g, n) from Φ_q (N, m, n): the matrix of the velocity and acceleration problems."""
        return np.concatenate([Pq, np.broadcast_to(self.S, (len(Pq), self.g, self.n))], axis=1)

    def _kkt(self, Pq: np.ndarray) -> np.ndarray:
        """The forward dynamics' matrix [[M, Φ_qᵀ], [Φ_q, 0]] (N, n + m, n + m)."""
        n, m = self.n, self.m
        K = np.zeros((len(Pq), n + m, n + m))
        K[:, :n, :n] = self.M
        K[:, :n, n:] = Pq.transpose(0, 2, 1)
        K[:, n:, :n] = Pq
        return K

    def _solve_joint(self, q: np.ndarray, rhs: np.ndarray) -> np.ndarray:
        """x (N, n) with [Φ_q; S] x = rhs (N, m + g) at every node (least squares when constraints are redundant,
        as Model's)."""
        J = self._joint_matrix(self.phi_q(q))
        if J.shape[1] == self.n:
            return np.linalg.solve(J, rhs[:, :, None])[:, :, 0]
        return np.einsum("nij,nj->ni", np.linalg.pinv(J), rhs)

    def velocities(self, q: np.ndarray, zd: np.ndarray) -> np.ndarray:
        """q̇ (N, n) with Φ_q q̇ = 0 and q̇[dof] = ż (N, g) at consistent positions q (N, n): Model.solve_velocity."""
        return self._solve_joint(q, np.concatenate([np.zeros((len(q), self.m)), zd], axis=1))

    def gamma(self, q: np.ndarray, qd: np.ndarray) -> np.ndarray:
        """γ = −Φ̇_q q̇ (N, m): Model.gamma."""
        return -np.einsum("nrk,nk->nr", self.hess_contract(q, qd, self._angle_terms(q)), qd)

    def accelerations(self, q: np.ndarray, qd: np.ndarray, zdd: np.ndarray) -> np.ndarray:
        """q̈ (N, n) with Φ_q q̈ = γ and q̈[dof] = z̈ (N, g): Model.solve_acceleration."""
        return self._solve_joint(q, np.concatenate([self.gamma(q, qd), zdd], axis=1))

    def forces(self, q: np.ndarray, qd: np.ndarray) -> np.ndarray:
        """Generalized forces Q (N, n): gravity and the joint dampers (Model.Q without τ)."""
        n = self.n
        qe, qde = self.ext(q), np.concatenate([qd, np.zeros((len(q), self.ne - n))], axis=1)
        Q = np.broadcast_to(self.Qg, (len(q), n)).copy()
        for A, c in self.dampers:
            Q -= c * (qe @ A)[:, :n] * np.einsum("ni,ij,nj->n", qe, A, qde)[:, None]
        return Q

    def forward_dynamics(self, q: np.ndarray, qd: np.ndarray) -> np.ndarray:
        """q̈ (N, n) of the unforced mechanism from M q̈ + Φ_qᵀ λ = Q, Φ_q q̈ = γ: Model.forward_dynamics."""
        rhs = np.concatenate([self.forces(q, qd), self.gamma(q, qd)], axis=1)
        return np.linalg.solve(self._kkt(self.phi_q(q)), rhs[:, :, None])[:, : self.n, 0]

    def evaluate(self, q: np.ndarray, zd: np.ndarray) -> dict[str, np.ndarray]:
        """Everything at consistent positions ``q`` (N, n) with rates ``zd`` (N, g).

        Returns q̇, R = ∂q/∂z, ∂q̇/∂z, q̈ and ∂q̈/∂z, ∂q̈/∂ż, the KKT inverse block ``Kinv_nn`` (∂q̈/∂τ),
        and per damper ``jw`` = ∂Q/∂c (N, n).
        """
        N, n, m = len(q), self.n, self.m
        terms = self._angle_terms(q)
        Pq = self.phi_q(q)
        J = self._joint_matrix(Pq)
        Jinv = np.linalg.inv(J) if J.shape[1] == n else np.linalg.pinv(J)
        R = Jinv[:, :, m:]
        qd = np.einsum("nij,nj->ni", R, zd)
        C = self.hess_contract(q, qd, terms)
        dqd_dz = -np.einsum("nij,njk,nkl->nil", Jinv[:, :, :m], C, R)
        Kinv = np.linalg.inv(self._kkt(Pq))
        qe = self.ext(q)
        qde = np.concatenate([qd, np.zeros((N, self.ne - n))], axis=1)
        Q = np.broadcast_to(self.Qg, (N, n)).copy()
        dQ_dq = np.zeros((N, n, n))
        dQ_dqd = np.zeros((N, n, n))
        jw = []
        for A, c in self.dampers:
            j = (qe @ A)[:, :n]
            w = np.einsum("ni,ij,nj->n", qe, A, qde)
            dw_dq = (qde @ A.T)[:, :n]
            jw.append(-j * w[:, None])
            Q += c * jw[-1]
            dQ_dqd -= c * np.einsum("ni,nj->nij", j, j)
            dQ_dq -= c * (A.T[None, :n, :n] * w[:, None, None] + np.einsum("ni,nj->nij", j, dw_dq))
        rhs = np.concatenate([Q, -np.einsum("nij,nj->ni", C, qd)], axis=1)
        x = np.einsum("nij,nj->ni", Kinv, rhs)
        qdd, lam = x[:, :n], x[:, n:]
        lam_h = np.einsum("nr,rkl->nkl", lam, self.Hq)
        dg_dq = np.zeros((N, m, n))
        for a, _, _, _, d2, d3 in terms:
            lam_h[:, a.theta, a.theta] += lam[:, a.row] * d2
            dg_dq[:, a.row, a.theta] = -d3 * qd[:, a.theta] ** 2
        R_q = np.concatenate([dQ_dq - lam_h, dg_dq - self.hess_contract(q, qdd, terms)], axis=1)
        R_qd = np.concatenate([dQ_dqd, -2.0 * C], axis=1)
        dqdd_dq = Kinv[:, :n] @ R_q
        dqdd_dqd = Kinv[:, :n] @ R_qd
        return {
            "q": q, "qd": qd, "R": R, "dqd_dz": dqd_dz, "qdd": qdd,
            "dqdd_dz": dqdd_dq @ R + dqdd_dqd @ dqd_dz, "dqdd_dzd": dqdd_dqd @ R,
            "Kinv_nn": Kinv[:, :n, :n], "jw": np.stack(jw, axis=1) if jw else np.zeros((N, 0, n)),
        }

    def body_rate(self, st: dict, body: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """ω (N,), ∂ω/∂z and ∂ω/∂ż (N, g) of a body."""
        A = self.arrays.omega_A[body]
        n = self.n
        qe = self.ext(st["q"])
        qde = np.concatenate([st["qd"], np.zeros((len(qe), self.ne - n))], axis=1)
        Aqd = (qde @ A.T)
        w = np.einsum("ni,ni->n", qe, Aqd)
        w_q, w_qd = Aqd[:, :n], (qe @ A)[:, :n]
        w_z = np.einsum("ni,nij->nj", w_q, st["R"]) + np.einsum("ni,nij->nj", w_qd, st["dqd_dz"])
        return w, w_z, np.einsum("ni,nij->nj", w_qd, st["R"])

    def body_angle(self, q: np.ndarray, body: int) -> tuple[np.ndarray, np.ndarray]:
        """φ (N,) (rad, atan2) and ∂φ/∂q (N, n) of a body."""
        xi, yi, xj, yj, _ = self.arrays.body_geom[body]
        qe = self.ext(q)
        dx, dy = qe[:, xj] - qe[:, xi], qe[:, yj] - qe[:, yi]
        s = dx * dx + dy * dy
        J = np.zeros((len(q), self.ne))
        J[:, xj] += -dy / s
        J[:, xi] -= -dy / s
        J[:, yj] += dx / s
        J[:, yi] -= dx / s
        return np.arctan2(dy, dx), J[:, : self.n]

"""Model uncertainty (rig TOML ``[estimator.model]``): the model's parameter errors as states of every
backend (adaptation, the default), or as process noise.

A typed-in model is wrong: masses include brackets and bolts, inertias are estimated, friction is
unknown.  With relative standard deviations u_m, u_I of each body's mass and inertia I0 (independent),
write the rig's true parameters θ_k (1 + u_k ε_k), ε_k ~ N(0, 1).  M and the gravity forces are linear
in the masses and inertias, so the true model has M + Σ ε_k ∂M/∂ε_k and Q + Σ ε_k ∂Q/∂ε_k
(:meth:`ModelUncertainty.directions`), i.e. the nominal dynamics plus the generalized force

    G(q̈) ε = Σ_k ε_k u_k θ_k (∂Q/∂θ_k − ∂M/∂θ_k q̈)        (:meth:`ModelUncertainty.forces`)

**Adaptation** (``adapt = true``): ε is part of every backend's state, constant (or a random walk of
density ``walk``), prior N(0, I).  The smoother solves the dynamics with M(ε), Q(ε) exactly; the filters
add G(q̈) ε with q̈ of their current point.  ε is learned while the rig moves (its effect on z̈ follows
the configuration and the accelerations), so the dynamics stay informative instead of being
distrusted: a wrong model costs accuracy only until the rig has swung.  Combinations that do not
change z̈ along the trajectory (a mass on a fixed pivot, every parameter scaled together) stay at
their prior and cost nothing.

**As noise** (``adapt = false``, or the share ``adapt_noise`` on top of the states): the error of the
independent accelerations Δz̈ = (RᵀMR)⁻¹ Rᵀ G(q̈) ε has the covariance :meth:`ModelUncertainty.accel_cov`.
The error is a bias of the model, correlated over the motion; as noise the backends treat it as white
acceleration noise whose spectral density is Σ_Δ · ``error_time_s`` (a short correlation time: the
sensors then correct the dynamics within a few samples instead of trusting a wrong model).

Unknown viscous friction up to ``friction_max`` (N·m·s/rad or N·s/m) sets the prior of the estimated
damping coefficient.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from estimator_service.errors import ConfigError
from estimator_service.model import AssemblyError, Model


@dataclass
class UncertaintyParams:
    """``[estimator.model]``: how good the model is (relative standard deviations, 1 σ)."""

    mass: float = 0.2  #: relative standard deviation of every body's mass
    inertia: float = 0.2  #: relative standard deviation of every body's I0
    friction_max: float = 0.05  #: largest unknown viscous friction on a DOF (N·m·s/rad or N·s/m)
    error_time_s: float = 0.02  #: correlation time of the model error (s): density² = Σ_Δ · this
    adapt: bool = True  #: estimate the parameter errors ε as states (learned while the rig moves)
    adapt_noise: float = 0.0  #: share of the white model noise kept when adapting (0..1)
    walk: float = 0.0  #: random walk density of ε (1/√s) when adapting
    body: dict[str, dict[str, float]] = field(default_factory=dict)  #: per-body {mass, inertia} overrides


def parse_uncertainty(source: str, table: dict, model: Model) -> UncertaintyParams:
    """UncertaintyParams from ``[estimator.model]`` (ConfigError naming file, key and value)."""
    out = UncertaintyParams()
    known = {"mass", "inertia", "friction_max", "error_time_s", "body", "adapt", "adapt_noise", "walk"}
    for key, v in table.items():
        f = f"estimator.model.{key}"
        if key not in known:
            raise ConfigError(source, f, f"unknown key; known keys: {sorted(known)}")
        if key == "body":
            if not isinstance(v, dict):
                raise ConfigError(source, f, "expected tables [estimator.model.body.<body name>] with mass, inertia")
            names = [b.name for b in model.mech.bodies]
            for bname, bt in v.items():
                fb = f"{f}.{bname}"
                if bname not in names:
                    raise ConfigError(source, fb, f"unknown body {bname!r}; bodies are {names}")
                if not isinstance(bt, dict):
                    raise ConfigError(source, fb, f"expected a table with mass, inertia, got {bt!r}")
                for k2, x in bt.items():
                    if k2 not in ("mass", "inertia"):
                        raise ConfigError(source, f"{fb}.{k2}", "unknown key; known keys: ['inertia', 'mass']")
                    _check_number(source, f"{fb}.{k2}", x)
                out.body[bname] = {k2: float(x) for k2, x in bt.items()}
            continue
        if key == "adapt":
            if not isinstance(v, bool):
                raise ConfigError(source, f, f"expected true or false, got {v!r}")
            out.adapt = v
            continue
        _check_number(source, f, v, positive=key == "error_time_s")
        if key == "adapt_noise" and v > 1:
            raise ConfigError(source, f, f"expected a share between 0 and 1, got {v!r}")
        setattr(out, key, float(v))
    return out


def _check_number(source: str, field_name: str, v: object, positive: bool = False) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not np.isfinite(v) or v < 0 or (positive and v == 0):
        raise ConfigError(source, field_name, f"expected a number {'> 0' if positive else '>= 0'}, got {v!r}")


class ModelUncertainty:
    """Acceleration-error covariance of a model from its parameter uncertainty (module docstring)."""

    def __init__(self, model: Model, params: UncertaintyParams) -> None:
        self.model, self.params = model, params
        dMs: list[np.ndarray] = []
        dQs: list[np.ndarray] = []
        #: per term: "<body>.mass" or "<body>.inertia"
        self.names: list[str] = []
        #: per term: its relative standard deviation u (ε = 1 is a parameter error of u × the value)
        self.relative: list[float] = []
        for bi, body in enumerate(model.mech.bodies):
            over = params.body.get(body.name, {})
            u_m, u_i = over.get("mass", params.mass), over.get("inertia", params.inertia)
            dM_dm, dM_dI, dQ_dm = model.inertia_derivatives(bi)
            if u_m > 0 and body.mass > 0:
                dMs.append(u_m * body.mass * dM_dm)
                dQs.append(u_m * body.mass * dQ_dm)
                self.names.append(f"{body.name}.mass")
                self.relative.append(u_m)
            if u_i > 0 and body.I0 > 0:
                dMs.append(u_i * body.I0 * dM_dI)
                dQs.append(np.zeros(model.n))
                self.names.append(f"{body.name}.inertia")
                self.relative.append(u_i)
        #: per term k: ∂M/∂ε_k (n, n) and ∂Q/∂ε_k (n,) for ε_k = 1 σ of its parameter θ (σ = u θ)
        self._dM = np.array(dMs).reshape(len(dMs), model.n, model.n)
        self._dQ = np.array(dQs).reshape(len(dQs), model.n)
        #: orthonormal basis (K, r) of the combinations of ε that change z̈ somewhere (:meth:`_identifiable`):
        #: the backends estimate η = Vᵀε (r states, prior N(0, I)); the rest changes nothing and stays at its prior
        self.V = self._identifiable() if self.names else np.zeros((0, 0))
        #: :meth:`forces` G(q̈) = G0 − Tq̈ as G0 = dQᵀV (n, r) and T[i, j, l] = Σ_k dM[k, i, l] V[k, j] (n, r, n)
        self._G0 = np.ascontiguousarray(self._dQ.T @ self.V) if self.names else np.zeros((model.n, 0))
        self._T = np.ascontiguousarray(np.einsum("kil,kj->ijl", self._dM, self.V)) if self.names else \
            np.zeros((model.n, 0, model.n))
        #: V scaled by each term's relative standard deviation: :meth:`report`'s ε u = (V u) η
        self._Vu = self.V * np.asarray(self.relative).reshape(-1, 1) if self.names else self.V
        #: (η's bytes, :meth:`report` of that η): η changes only in updates, the report is asked every step
        self._reported: tuple[bytes, dict[str, float]] | None = None

    def _identifiable(self, samples: int = 64, rel_tol: float = 1e-6) -> np.ndarray:
        """Basis of the ε combinations whose effect on z̈ is not identically zero: the right singular
        vectors of the stacked ∂z̈/∂ε over sampled states (seeded: the same basis every run) above
        ``rel_tol`` of the largest.  Drops e.g. the mass of a body whose centre of mass is on a ground
        pivot, and the scaling of every mass and inertia together (only ratios and gravity matter)."""
        m, rng, rows = self.model, np.random.default_rng(0), []
        q = m.q0
        for _ in range(samples):
            try:
                q = m.solve_position(q, m.q0[m.dof] + rng.normal(0.0, 0.5, m.g))
            except AssemblyError:
                q = m.q0
            qd = m.solve_velocity(q, rng.normal(0.0, 2.0, m.g))
            R = m.R(q)
            # (the numpy reference: 64 calls at start-up, where the compiled one costs a cold start ~9 s to compile)
            rows.append(np.linalg.solve(R.T @ m.M @ R, R.T @ self.all_forces(m.forward_dynamics(q, qd))))
        _, s, Vt = np.linalg.svd(np.vstack(rows), full_matrices=False)
        keep = s > rel_tol * s[0] if s.size and s[0] > 0 else np.zeros(len(s), bool)
        return np.ascontiguousarray(Vt[keep].T)

    @property
    def dim(self) -> int:
        """Number of parameter-error states η = Vᵀε when adapting (0 otherwise)."""
        return self.V.shape[1] if self.params.adapt and self.names else 0

    def directions(self) -> tuple[np.ndarray, np.ndarray]:
        """(dMs (r, n, n), dQs (r, n)): the change of M and of the gravity forces per unit η_j; the model
        with parameter errors ε = Vη has M + Σ η_j dMs[j] and Q + Σ η_j dQs[j] (both linear in ε)."""
        if not self.dim:
            return np.zeros((0, self.model.n, self.model.n)), np.zeros((0, self.model.n))
        return np.tensordot(self.V.T, self._dM, 1), self.V.T @ self._dQ

    def report(self, eta: np.ndarray) -> dict[str, float] | None:
        """Estimated relative parameter errors by "<body>.mass" / "<body>.inertia" (+0.2: the rig's value
        is 20 % above the model's), ε = Vη; None when not adapting.  Read-only: the same map is returned
        again while η is bit for bit the same."""
        if not self.dim:
            return None
        key = eta.tobytes()
        if self._reported is None or self._reported[0] != key:
            self._reported = key, dict(zip(self.names, (self._Vu @ eta).tolist(), strict=True))
        return self._reported[1]

    def report_std(self, P_eta: np.ndarray) -> dict[str, float] | None:
        """Standard deviations of :meth:`report` from the covariance of η: Var ε = V P Vᵀ + (I − V Vᵀ)
        (the combinations that change nothing keep their prior)."""
        if not self.dim:
            return None
        V = self.V
        var = np.diag(V @ P_eta @ V.T) + 1.0 - np.sum(V * V, axis=1)
        return {name: float(np.sqrt(max(v, 0.0)) * u) for name, v, u in zip(self.names, var, self.relative, strict=True)}

    def all_forces(self, qdd: np.ndarray) -> np.ndarray:
        """(n, K): the generalized force of a unit ε_k (one standard deviation of parameter k) at q̈:
        σ_k (∂Q/∂θ_k − ∂M/∂θ_k q̈), so that the true model's dynamics are the nominal ones plus this · ε."""
        return (self._dQ - self._dM @ qdd).T

    def force_terms(self) -> tuple[np.ndarray, np.ndarray]:
        """(G0 (n, r), T (n, r, n)), C-contiguous: :meth:`forces` is G0 − T q̈ (for the compiled updates)."""
        return self._G0, self._T

    def forces(self, qdd: np.ndarray) -> np.ndarray:
        """G (n, r) = :meth:`all_forces` V: the generalized force per unit η at q̈ (the filters' G(q̈) η),
        C-contiguous (two array operations: it is asked at every new point)."""
        return self._G0 - self._T @ qdd

    @property
    def noise_enabled(self) -> bool:
        """Whether the model error is (also) white acceleration noise: not adapting, or ``adapt_noise`` > 0."""
        return bool(self.names) and (not self.params.adapt or self.params.adapt_noise > 0)

    def accel_cov(self, qdd: np.ndarray, R: np.ndarray) -> np.ndarray:
        """Covariance (g×g) of the independent-acceleration error Δz̈ at a state with q̈ and R = ∂q/∂z."""
        g = R.shape[1]
        if not self.names:
            return np.zeros((g, g))
        cols = np.linalg.solve(R.T @ self.model.M @ R, R.T @ self.all_forces(qdd))  # (g, terms)
        return cols @ cols.T

    def accel_density2(self, qdd: np.ndarray, R: np.ndarray) -> np.ndarray:
        """Spectral density² (g×g; (rad/s²)²·s) of the white acceleration noise standing for the model error
        (scaled by ``adapt_noise`` when the error is estimated as states)."""
        scale = self.params.adapt_noise if self.params.adapt else 1.0
        return self.accel_cov(qdd, R) * (self.params.error_time_s * scale)

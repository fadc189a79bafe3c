"""Model uncertainty (rig TOML ``[estimator.model]``) turned into process noise for every backend.

A typed-in model is wrong: masses include brackets and bolts, inertias are estimated, friction is
unknown.  With relative standard deviations u_m, u_I of each body's mass and inertia I0 (independent),
the generalized-force error of the model at a state is

    ΔQ = Σ_b ε_m,b m_b (∂Q_g/∂m_b − ∂M/∂m_b q̈) − ε_I,b I0_b ∂M/∂I0_b q̈,   ε ~ N(0, u²)

and the error of the independent accelerations Δz̈ = (RᵀMR)⁻¹ Rᵀ ΔQ (R-matrix formulation) has the
covariance :meth:`ModelUncertainty.accel_cov`.  The error is a bias of the model, correlated over the
motion; the backends treat it as white acceleration noise whose spectral density is
Σ_Δ · ``error_time_s`` (a short correlation time: the sensors then correct the dynamics within a
few samples instead of trusting a wrong model).  Unknown viscous friction up to ``friction_max``
(N·m·s/rad or N·s/m) sets the prior of the estimated damping coefficient.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from estimator_service.errors import ConfigError
from estimator_service.model import Model


@dataclass
class UncertaintyParams:
    """``[estimator.model]``: how good the model is (relative standard deviations, 1 σ)."""

    mass: float = 0.2  #: relative standard deviation of every body's mass
    inertia: float = 0.2  #: relative standard deviation of every body's I0
    friction_max: float = 0.05  #: largest unknown viscous friction on a DOF (N·m·s/rad or N·s/m)
    error_time_s: float = 0.02  #: correlation time of the model error (s): density² = Σ_Δ · this
    body: dict[str, dict[str, float]] = field(default_factory=dict)  #: per-body {mass, inertia} overrides


def parse_uncertainty(source: str, table: dict, model: Model) -> UncertaintyParams:
    """UncertaintyParams from ``[estimator.model]`` (ConfigError naming file, key and value)."""
    out = UncertaintyParams()
    known = {"mass", "inertia", "friction_max", "error_time_s", "body"}
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
        _check_number(source, f, v, positive=key == "error_time_s")
        setattr(out, key, float(v))
    return out


def _check_number(source: str, field_name: str, v: object, positive: bool = False) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not np.isfinite(v) or v < 0 or (positive and v == 0):
        raise ConfigError(source, field_name, f"expected a number {'> 0' if positive else '>= 0'}, got {v!r}")


class ModelUncertainty:
    """Acceleration-error covariance of a model from its parameter uncertainty (module docstring)."""

    def __init__(self, model: Model, params: UncertaintyParams) -> None:
        self.model, self.params = model, params
        #: per body term: (std of ε × parameter value, ∂M/∂θ, ∂Q/∂θ) with θ = m_b or I0_b
        self._terms: list[tuple[float, np.ndarray, np.ndarray]] = []
        for bi, body in enumerate(model.mech.bodies):
            over = params.body.get(body.name, {})
            u_m, u_i = over.get("mass", params.mass), over.get("inertia", params.inertia)
            dM_dm, dM_dI, dQ_dm = model.inertia_derivatives(bi)
            if u_m > 0 and body.mass > 0:
                self._terms.append((u_m * body.mass, dM_dm, dQ_dm))
            if u_i > 0 and body.I0 > 0:
                self._terms.append((u_i * body.I0, dM_dI, np.zeros(model.n)))

    @property
    def enabled(self) -> bool:
        return bool(self._terms)

    def accel_cov(self, qdd: np.ndarray, R: np.ndarray) -> np.ndarray:
        """Covariance (g×g) of the independent-acceleration error Δz̈ at a state with q̈ and R = ∂q/∂z."""
        g = R.shape[1]
        if not self._terms:
            return np.zeros((g, g))
        Mbar_inv = np.linalg.inv(R.T @ self.model.M @ R)
        cols = np.array([s * (Mbar_inv @ (R.T @ (dQ - dM @ qdd))) for s, dM, dQ in self._terms])  # (terms, g)
        return cols.T @ cols

    def accel_density2(self, qdd: np.ndarray, R: np.ndarray) -> np.ndarray:
        """Spectral density² (g×g; (rad/s²)²·s) of the white acceleration noise standing for the model error."""
        return self.accel_cov(qdd, R) * self.params.error_time_s

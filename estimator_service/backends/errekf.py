"""Error-state extended Kalman filter in independent coordinates (Sanjurjo et al. 2017's errorEKF).

The multibody model runs on its own, as a simulation would: the *nominal* state
x̄ = [z, ż, c, b, p] (independent coordinates and rates, the unknown DOF force τ = b − c ⊙ ż and the
sensor parameters p, as in the EKF: backends/filter.py, backends/sensor_params.py) is advanced every step
by the EKF's integrator (``integrator``: heun / rk4 / euler, :meth:`IndependentFilter.transition`)
with no covariance work.  The filter's state is the *error* δx = x − x̄ (same layout and units); its
mean is zero between updates, so only its covariance P is propagated:

    P⁺ = Φ P Φᵀ + Q_c h   over each covariance interval of h ≤ ``covariance_step_s`` seconds.

Error dynamics (``error_model``), linearised at the nominal point at the end of the interval (where an
update evaluates its measurement Jacobian: both share one evaluation of the model's state Jacobians)
and discretised to first order (the error is small and is reset at every update, so a first-order
transition suffices where the nominal needs the accurate integrator):

- ``"linearised"`` (default): Φ = I + h A(x̄), A = ∂ẋ/∂x the model's analytic state Jacobian
  (∂z̈/∂z, ∂z̈/∂ż, and ∂z̈/∂(c, b) = M̄⁻¹ on the DOF force).  One Jacobian per interval, against the
  EKF's chained stage Jacobians (two with Heun, four with RK4) and their extra position problems.
- ``"kinematic"``: the errorEKF's error model "as simple as possible": δz̈ does not depend on δz, δż
  (Φ = [[I, hI], [0, I]] on positions and velocities), except through the DOF force, whose coupling
  into z̈ is kept (without it the force states would never be corrected).

Update at time t with measurements y: the error's predicted reading is H δx⁻ = 0, so the innovation
is y − h(x̄) with H = ∂h/∂x at the nominal (the EKF's measurement model), δx = K e, Joseph-form P.
Feedback: x̄ ← x̄ + δx, with the position problem solved at the corrected z from the nominal point
(so q stays on the constraint manifold and on its assembly branch) and q̇ = R ż; then δx ← 0.  The
errors are additive in independent coordinates, so the reset Jacobian is the identity and P is
unchanged by the reset.  With δx⁻ = 0 these update equations are exactly the EKF's update of the
nominal, which this backend therefore shares (:meth:`ExtendedKalmanFilter.update`, with its gating
and consistency bookkeeping); only the propagation differs.  On the compiled path the EKF's fused update
does it in the same call (kernels.fused_update.ekf_update_prepare with kernels.ERROR_MODEL_CODES: Φ and H
from one evaluation of the state Jacobians at the nominal), computed ahead in the step before an IMU's
expected sample like the EKF's; :meth:`covariance_over` is its numpy reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from estimator_service import kernels
from estimator_service.backends.base import params_from_dict
from estimator_service.backends.ekf import ExtendedKalmanFilter
from estimator_service.backends.filter import FilterParams
from estimator_service.backends.manifold import Point

ERROR_MODELS = ("linearised", "kinematic")


@dataclass
class _ErrorModelKey:
    """The ``error_model`` key alone (validated with the shared parameter loader)."""

    error_model: str = "linearised"


@dataclass
class ErrekfParams(FilterParams):
    """``[estimator.errekf]``: the shared filter parameters (see :class:`FilterParams`) plus the error model."""

    error_model: str = "linearised"  #: "linearised" (Φ = I + hA) or "kinematic" (errorEKF's [[I, hI], [0, I]])

    @classmethod
    def from_dict(cls, file: str, section: str, d: dict) -> ErrekfParams:
        """Build from a TOML table (ConfigError naming file, key and value on unknown keys and bad values)."""
        out = super().from_dict(file, section, {k: v for k, v in d.items() if k != "error_model"})
        if "error_model" in d:
            out.error_model = params_from_dict(_ErrorModelKey, file, section, {"error_model": d["error_model"]},
                                               choices={"error_model": ERROR_MODELS}).error_model
        return out


class ErrorStateKalmanFilter(ExtendedKalmanFilter):
    """errorEKF: nominal multibody simulation + covariance of its error, fed back and reset at each update."""

    name = "errekf"
    section = "errekf"
    params_class = ErrekfParams

    def error_jacobian(self, x: np.ndarray, pt: Point) -> np.ndarray:
        """A_e = ∂δẋ/∂δx (L, L) of the error dynamics at nominal state x (point ``pt``), per ``error_model``."""
        A = self.A(x, pt, pt)
        if self.params.error_model == "kinematic":
            g = self.model.g
            A[g : 2 * g, : 2 * g] = 0.0
        return A

    def __init__(self, model, sensors: list, config) -> None:
        super().__init__(model, sensors, config)
        #: (point, x[:nd], Jacobians) of the last evaluation (see :meth:`jacobians`)
        self._jac_memo: tuple | None = None

    def jacobians(self, x: np.ndarray, pt: Point, forces_at: Point | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The state Jacobians at (x, pt), remembered for the last point and dynamic state (with G of the
        same point): an update's error transition and its measurement Jacobian H share one evaluation."""
        memo = self._jac_memo
        at = self._forces_point(forces_at)
        if memo is not None and memo[0] is pt and memo[3] is at and np.array_equal(memo[1], x[: self.nd]):
            return memo[2]
        j = super().jacobians(x, pt, forces_at)
        self._jac_memo = (pt, x[: self.nd].copy(), j, at)
        return j

    def uses_transition_jacobian(self) -> bool:
        """Never: Φ is first order at the interval's end (:meth:`covariance_over`), whatever the integrator."""
        return False

    def fuse_propagation(self) -> bool:
        """The compiled update propagates the open interval with Φ at its end (:meth:`propagation_code`), with any
        integrator of the nominal."""
        return True

    def propagation_code(self) -> int:
        """Φ = I + h A_e at the interval's end (:meth:`covariance_over`), per ``error_model``
        (kernels.ERROR_MODEL_CODES)."""
        return kernels.ERROR_MODEL_CODES[self.params.error_model]

    def covariance_over(self, x0: np.ndarray, P0: np.ndarray, pt0: Point, h: float) -> np.ndarray:
        """Error covariance at the end of an interval of h seconds that started with covariance P0 (no
        process noise): Φ P0 Φᵀ with Φ = I + h A_e(x̄), linearised at the interval's end, the current
        nominal state (first order like the start point; an update evaluates H at the same point).
        ``x0``, ``pt0`` (the interval's start) are not needed.  Φ by kernels.interval_jacobian with
        :meth:`propagation_code`, the formula the fused update's kernel uses."""
        A = self.error_jacobian(self.x, self.point)
        Phi = self._interval_jacobian(A, A, h, self.propagation_code())
        P = Phi @ P0 @ Phi.T
        return 0.5 * (P + P.T)

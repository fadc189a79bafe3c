"""A fused accelerometer's stated mount, held until its readings contradict it (every backend).

The residual in-plane mount μ of a fused accelerometer (backends/sensor_params.py) starts *held*: its prior std
is ``MOUNT_HELD_SIGMA`` instead of the rig's ``mount_prior_deg``, so a rig whose ``mount_deg`` is right loses
nothing to the state.  (Free from the start, the state cost the public accelerometer scenarios 0.007–0.017° of
crank RMSE, all of it in the first second: until the mechanism has swung, the reading gives the body's angle
plus an unknown mount.)

Each fused sample of such an accelerometer feeds a sequential test of "the mount is as stated": its innovation
e (covariance S, both of the sample's rows) projected on the reading's sensitivity to μ, h = ∂y/∂μ, summed with
exponential forgetting over a window of τ = ``MOUNT_WINDOW_S``::

    a ← λ a + hᵀ S⁻¹ e,    v ← λ² v + hᵀ S⁻¹ h,    λ = exp(−Δt / τ)

While the mount is right, a ~ N(0, v) and a²/v is χ²₁; a mount error δ adds about δ hᵀS⁻¹h to a at every sample,
so a²/v grows towards δ² hᵀS⁻¹h (1 + λ)/(1 − λ) (one sample's information times the window's length).  When
a²/v passes ``MOUNT_RELEASE_SIGMA``² the mount is *released*: its variance grows by the rig's prior
``mount_prior``² (once), and the estimator learns it from then on.  A released mount stays released through a
re-initialisation (its evidence does not go away).  On the combined scenario (a mount 3° off) the test fires
within the first 0.1 s.
"""

from __future__ import annotations

import logging
import math

import numpy as np

from estimator_service.backends.sensor_params import SensorParams

log = logging.getLogger(__name__)

MOUNT_HELD_SIGMA = 1e-5  #: (rad) prior std of a held mount: as stated (a positive floor for the UKF's square roots)
MOUNT_RELEASE_SIGMA = 5.0  #: the test's threshold, in σ of a normal deviation (a²/v > 25: 6e-7 per window)
MOUNT_WINDOW_S = 1.0  #: (s) time constant of the test's forgetting


class MountTest:
    """The held/released state of each mount in p (``SensorParams.mount_index``) and its running test."""

    def __init__(self, sp: SensorParams) -> None:
        self.sp = sp
        #: indices into p of the mounts, and of those released so far (kept through :meth:`reset`)
        self.columns = sorted({k for k in sp.mount_index if k is not None})
        self.released: set[int] = set()
        self.reset()

    def reset(self) -> None:
        """Forget the running sums (a re-initialisation); released mounts stay released."""
        self._a = dict.fromkeys(self.columns, 0.0)
        self._v = dict.fromkeys(self.columns, 0.0)
        self._t: dict[int, float | None] = dict.fromkeys(self.columns, None)

    def state(self) -> tuple | None:
        """What :meth:`add` changes, for a filter's snapshot (None without mounts)."""
        if not self.columns:
            return None
        return dict(self._a), dict(self._v), dict(self._t), frozenset(self.released)

    def restore(self, state: tuple | None) -> None:
        """Back to a :meth:`state` (a re-run of the steps since it)."""
        if state is not None:
            a, v, t, released = state
            self._a, self._v, self._t, self.released = dict(a), dict(v), dict(t), set(released)

    def prior(self) -> np.ndarray:
        """Prior std of p (``SensorParams.prior``) with each held mount at ``MOUNT_HELD_SIGMA``."""
        out = self.sp.prior.copy()
        for k in self.columns:
            if k not in self.released:
                out[k] = MOUNT_HELD_SIGMA
        return out

    def add(self, k: int, t: float, e: np.ndarray, S: np.ndarray, h: np.ndarray) -> bool:
        """One fused sample (time t, s) of the accelerometer whose mount is p[k]: innovation ``e`` (its rows),
        their covariance ``S`` and ∂y/∂μ ``h``.  True when this sample releases the mount (the caller widens
        the state's variance by ``sp.prior[k]``²)."""
        if k in self.released:
            return False
        try:
            w = np.linalg.solve(S, h)
        except np.linalg.LinAlgError:
            return False
        t_prev, self._t[k] = self._t[k], t
        lam = 0.0 if t_prev is None else math.exp(-max(t - t_prev, 0.0) / MOUNT_WINDOW_S)
        a = lam * self._a[k] + float(w @ e)
        v = lam * lam * self._v[k] + float(w @ h)
        self._a[k], self._v[k] = a, v
        if not (v > 0.0 and a * a > MOUNT_RELEASE_SIGMA**2 * v):
            return False
        self.released.add(k)
        log.info("%s: the readings contradict the stated mount at t = %.3f s (%.1fσ): freed within its prior of %.3g°",
                 self.sp.names[k], t, math.sqrt(a * a / v), math.degrees(self.sp.prior[k]))
        return True

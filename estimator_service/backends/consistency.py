"""Consistency monitoring: does the estimator still agree with its sensors?

Per fused sensor, the normalised innovation squared NIS = eᵀ S⁻¹ e of each update (filters) or the
sum of squared whitened residuals r/σ of each sample (smoother) is summed over a sliding window of
``window_s`` seconds.  For a consistent estimator the sum is χ²-distributed with the window's total
degrees of freedom k (samples × rows); the estimate is flagged ``inconsistent`` while any sensor's
sum is above the χ² quantile ``1 − alpha`` of k (two-sided bounds are reported; only the upper one
flags: an estimator that is too cautious is still right).  A smoother's residuals are posterior
(smaller than innovations), so its bound is conservative.
"""

from __future__ import annotations

from collections import deque

from scipy.stats import chi2


class ConsistencyMonitor:
    """Sliding-window NIS per sensor against χ² bounds (module docstring)."""

    def __init__(self, names: list[str], window_s: float = 0.5, alpha: float = 1e-3) -> None:
        self.names, self.window_s, self.alpha = names, window_s, alpha
        self._win: list[deque[tuple[float, float, int]]] = [deque() for _ in names]
        self._sum = [0.0] * len(names)
        self._dof = [0] * len(names)
        self._bounds: dict[int, tuple[float, float]] = {}
        self.flagged_updates = 0  #: estimates flagged inconsistent since start
        self.gated = [0] * len(names)  #: measurements rejected by the innovation gate, per sensor

    def reset(self) -> None:
        for w in self._win:
            w.clear()
        self._sum = [0.0] * len(self.names)
        self._dof = [0] * len(self.names)

    def add(self, t: float, sensor: int, nis: float, dof: int) -> None:
        """Count one sample's NIS (sum of squared whitened residuals) with ``dof`` rows at time t (s)."""
        w = self._win[sensor]
        w.append((t, nis, dof))
        self._sum[sensor] += nis
        self._dof[sensor] += dof
        while w and w[0][0] <= t - self.window_s:
            _, old, d = w.popleft()
            self._sum[sensor] -= old
            self._dof[sensor] -= d

    def rewind(self, t: float) -> None:
        """Forget the samples after time t (s): a filter re-running from t adds them again."""
        for i, w in enumerate(self._win):
            while w and w[-1][0] > t + 1e-12:
                _, old, d = w.pop()
                self._sum[i] -= old
                self._dof[i] -= d

    def bounds(self, dof: int) -> tuple[float, float]:
        """(lower, upper) χ² bounds of a windowed sum with ``dof`` degrees of freedom."""
        b = self._bounds.get(dof)
        if b is None:
            b = (float(chi2.ppf(self.alpha, dof)), float(chi2.ppf(1 - self.alpha, dof)))
            self._bounds[dof] = b
        return b

    def inconsistent(self) -> list[str]:
        """Names of the sensors whose windowed NIS is above the upper bound now."""
        out = []
        for i, name in enumerate(self.names):
            if self._dof[i] > 0 and self._sum[i] > self.bounds(self._dof[i])[1]:
                out.append(name)
        return out

    def quality(self) -> str:
        """``ok`` or ``inconsistent`` (counted in ``flagged_updates``)."""
        if self.inconsistent():
            self.flagged_updates += 1
            return "inconsistent"
        return "ok"

    def stats(self) -> dict:
        """est/diag ``info.consistency``: per sensor windowed NIS per row, bounds per row, gated count."""
        per = {}
        for i, name in enumerate(self.names):
            k = self._dof[i]
            lo, hi = self.bounds(k) if k > 0 else (0.0, 0.0)
            per[name] = {"nis_per_row": self._sum[i] / k if k else 0.0, "rows": k,
                         "lower_per_row": lo / k if k else 0.0, "upper_per_row": hi / k if k else 0.0,
                         "gated": self.gated[i]}
        return {"window_s": self.window_s, "alpha": self.alpha, "flagged": self.flagged_updates, "sensors": per}

"""Consistency monitoring: does the estimator still agree with its sensors?

Per fused sensor, the normalised innovation squared NIS = eᵀ S⁻¹ e of each update (filters) or the
sum of squared whitened residuals r/σ of each sample (smoother) is summed over a sliding window of
``window_s`` seconds.  For a consistent estimator the sum is χ²-distributed with the window's total
degrees of freedom k (samples × rows); the estimate is flagged ``inconsistent`` while any sensor's
sum is above the χ² quantile ``1 − alpha`` of k (two-sided bounds are reported; only the upper one
flags: an estimator that is too cautious is still right).  The smoother's are the innovations of
each new sample against its predicted state, as a filter's.

A wrong model shows first as innovations of one sign, long before their squares add up: each row's
standardised innovations e_i/√S_ii are summed over the same window too, and a sensor is also
flagged while any row's sum, over √(samples), leaves the two-sided normal quantile of
``mean_alpha`` / rows (a time-average innovation test, Bar-Shalom et al. 2001, §5.4).  ``mean_alpha``
is 1e-4: with 1e-3 the sliding window's chance excursions flagged 3 % of a perfect model's estimates
(a run of 150 ms in 5 s), while a 50 % inertia error leaves the bound by a factor of two.

A sample the estimator's outlier gate rejects carries no NIS, yet a sensor whose samples are being
rejected is the plainest disagreement of all (a smoother 126° off rejected every gyro sample and had
nothing left in its window to flag): rejections are counted in the same window, and a sensor is also
flagged while more than ``REJECTED_SHARE`` of its samples there, and at least ``REJECTED_MIN``, were
rejected (an isolated outlier is not a disagreement).

**Noise that adapts** (covariance matching, every backend): a sensor far noisier than its configured σ (a
newcomer's gyro σ of 0.5°/s on a stepper's 18°/s vibration) has every sample rejected as an outlier, and
the estimate then ignores the one sensor that sees the motion. So each sensor's measurement variance is
scaled by λ ≥ 1: over ``ADAPT_WINDOW_S`` the median of the samples' NIS per row (kept and rejected) over
the median of χ²₁ is m, robust to a few outliers; when m > ``ADAPT_ABOVE`` the variance scale grows by m
(the innovation is the sensor's noise, S ≈ λR), when m < ``ADAPT_BELOW`` and λ > 1 it shrinks by m (to 1 at
least). A consistent sensor never comes near ``ADAPT_ABOVE`` (more than half of its samples would have to
be 2σ off), so calibrated rigs and the public scenarios keep λ = 1. While λ > ``ADAPT_FLAG`` the sensor is flagged: the estimate follows it with its real noise,
and says that the rig's σ is wrong.
"""


from __future__ import annotations

from collections import deque

import numpy as np

from estimator_service.tails import chi2_ppf, norm_ppf


#: degrees of freedom whose χ² bounds are tabulated at construction (a window's sum of a few sensors' rows)
BOUNDS_TABLE = 1024
#: noise adaptation (module docstring): window (s), NIS per row above which the variance scale grows, below
#: which it shrinks, the largest scale, and the scale that flags the sensor
ADAPT_WINDOW_S = 0.5
ADAPT_ABOVE = 4.0
ADAPT_BELOW = 0.25
MAX_SCALE = 1e6
ADAPT_FLAG = 4.0
CHI2_1_MEDIAN = 0.454936  #: the median of χ² with one degree of freedom
#: a sensor is flagged while more than this share of its samples in the window were rejected by the gate ...
REJECTED_SHARE = 0.2
#: ... and at least this many
REJECTED_MIN = 3


class ConsistencyMonitor:
    """Sliding-window NIS per sensor against χ² bounds (module docstring)."""

    def __init__(self, names: list[str], window_s: float = 0.5, alpha: float = 1e-3, mean_alpha: float = 1e-4) -> None:
        self.names, self.window_s, self.alpha, self.mean_alpha = names, window_s, alpha, mean_alpha
        self._win: list[deque[tuple[float, float, int, list[float] | None]]] = [deque() for _ in names]
        self._sum = [0.0] * len(names)
        self._dof = [0] * len(names)
        #: per row: windowed sum of e_i/√S_ii (Python floats: a sensor has a few rows, and these sums change at
        #: every update)
        self._zsum: list[list[float] | None] = [None] * len(names)
        self._zn = [0] * len(names)  # samples in that sum
        self._lower: list[float] = []  # χ² bounds by degrees of freedom (:meth:`bounds`)
        self._upper: list[float] = []
        self._extend_bounds(BOUNDS_TABLE - 1)
        self._zbounds: dict[int, float] = {}
        self._flagged: tuple[str, ...] | None = None  # inconsistent() until the windows change
        self.flagged_updates = 0  #: estimates flagged inconsistent since start
        self.gated = [0] * len(names)  #: measurements rejected by the innovation gate, per sensor
        self._rejected: list[deque[float]] = [deque() for _ in names]  # times of the window's rejected samples
        #: per sensor: the variance scale λ of noise adaptation (module docstring), and since when its window runs
        self.noise_scale = [1.0] * len(names)
        self._adapt: list[list] = [[[], None] for _ in names]  # [NIS per row of the window's samples, its start t]
        self.scale_changed = False  #: set when a scale changes; the backend clears it once it has taken them

    def _observe(self, t: float, sensor: int, nis: float, dof: int) -> None:
        """Noise adaptation: count one sample's NIS (``dof`` rows) and, once a window is full, rescale."""
        a = self._adapt[sensor]
        if a[1] is None:
            a[1] = t
        a[0].append(nis / dof if nis == nis else np.inf)  # (NaN: as far off as it gets)
        if t - a[1] < ADAPT_WINDOW_S:
            return
        m = float(np.median(a[0])) / CHI2_1_MEDIAN
        lam = self.noise_scale[sensor]
        new = min(lam * m, MAX_SCALE) if m > ADAPT_ABOVE else max(lam * m, 1.0) if m < ADAPT_BELOW and lam > 1.0 else lam
        if new != lam:
            self.noise_scale[sensor] = new
            self.scale_changed = True
            self._flagged = None
        a[0], a[1] = [], t

    def reset(self) -> None:
        for w in self._win:
            w.clear()
        for r in self._rejected:
            r.clear()
        self._adapt = [[[], None] for _ in self.names]  # (the scales themselves are the sensors': kept)
        self._sum = [0.0] * len(self.names)
        self._dof = [0] * len(self.names)
        self._zsum = [None] * len(self.names)
        self._zn = [0] * len(self.names)
        self._flagged = None

    def add(self, t: float, sensor: int, nis: float, dof: int, z: np.ndarray | None = None) -> None:
        """Count one sample's NIS (sum of squared whitened residuals) with ``dof`` rows at time t (s), and its
        standardised innovation ``z`` (e_i/√S_ii per row) for the mean test, if given."""
        self._flagged = None
        self._observe(t, sensor, nis, dof)
        w = self._win[sensor]
        if z is not None:  # a sensor's rows are fixed: its sum starts at its first sample
            z = z.tolist()
            zs = self._zsum[sensor]
            if zs is None:
                self._zsum[sensor] = list(z)
            else:
                for i, v in enumerate(z):
                    zs[i] += v
            self._zn[sensor] += 1
        w.append((t, nis, dof, z))
        self._sum[sensor] += nis
        self._dof[sensor] += dof
        while w and w[0][0] <= t - self.window_s:
            self._forget(sensor, w.popleft())

    def reject(self, t: float, sensor: int, nis: float | None = None, dof: int = 0) -> None:
        """Count one sample of ``sensor`` at time t (s) that the outlier gate rejected (module docstring), with
        its NIS over ``dof`` rows when known (noise adaptation)."""
        self._flagged = None
        self.gated[sensor] += 1
        if nis is not None and dof:
            self._observe(t, sensor, nis, dof)
        r = self._rejected[sensor]
        r.append(t)
        while r and r[0] <= t - self.window_s:
            r.popleft()
        w = self._win[sensor]
        while w and w[0][0] <= t - self.window_s:
            self._forget(sensor, w.popleft())

    def _mostly_rejected(self, sensor: int) -> bool:
        """More than ``REJECTED_SHARE`` of the sensor's samples in the window, and ``REJECTED_MIN``, rejected."""
        r = self._rejected[sensor]
        if len(r) < REJECTED_MIN:
            return False
        t_new = max(r[-1], self._win[sensor][-1][0]) if self._win[sensor] else r[-1]
        while r and r[0] <= t_new - self.window_s:
            r.popleft()
        return len(r) >= REJECTED_MIN and len(r) > REJECTED_SHARE * (len(r) + len(self._win[sensor]))

    def _forget(self, sensor: int, entry: tuple[float, float, int, list[float] | None]) -> None:
        _, old, d, z = entry
        self._flagged = None
        self._sum[sensor] -= old
        self._dof[sensor] -= d
        if z is not None:
            zs = self._zsum[sensor]
            for i, v in enumerate(z):
                zs[i] -= v
            self._zn[sensor] -= 1

    def rewind(self, t: float) -> None:
        """Forget the samples after time t (s): a filter re-running from t adds them again."""
        self._flagged = None
        for i, w in enumerate(self._win):
            while w and w[-1][0] > t + 1e-12:
                self._forget(i, w.pop())
            r = self._rejected[i]
            while r and r[-1] > t + 1e-12:
                r.pop()
                self.gated[i] -= 1  # counted again when the filter re-runs it

    def bounds(self, dof: int) -> tuple[float, float]:
        """(lower, upper) χ² bounds of a windowed sum with ``dof`` degrees of freedom."""
        if dof >= len(self._upper):
            self._extend_bounds(dof)
        return self._lower[dof], self._upper[dof]

    def _extend_bounds(self, dof: int) -> None:
        """Tabulate the bounds up to ``dof`` at least (twice the table's size: a window's degrees of freedom change
        at every update, and one quantile costs ~80 µs while a table of a thousand costs ~1 ms)."""
        k = np.arange(len(self._upper), max(dof + 1, 2 * len(self._upper)), dtype=float)
        self._lower += chi2_ppf(self.alpha, k).tolist()
        self._upper += chi2_ppf(1 - self.alpha, k).tolist()

    def mean_z(self, sensor: int) -> float:
        """Largest |windowed sum of a row's standardised innovations| / √samples of a sensor (0 if none)."""
        zs, k = self._zsum[sensor], self._zn[sensor]
        return max(map(abs, zs)) / k**0.5 if zs is not None and k > 0 else 0.0

    def mean_bound(self, rows: int) -> float:
        """Bound of :meth:`mean_z` for a sensor with ``rows`` rows: the normal quantile 1 − mean_alpha / (2 rows)."""
        b = self._zbounds.get(rows)
        if b is None:
            b = self._zbounds[rows] = float(norm_ppf(1 - self.mean_alpha / (2 * rows)))
        return b

    def inconsistent(self) -> tuple[str, ...]:
        """Names of the sensors whose windowed NIS is above the upper bound, whose mean innovation is
        outside its bound, or whose samples are mostly rejected, now (evaluated again only once the windows
        have changed)."""
        if self._flagged is None:
            out = []
            for i, name in enumerate(self.names):
                zs = self._zsum[i]
                if (self._dof[i] > 0 and self._sum[i] > self.bounds(self._dof[i])[1]) or (
                        zs is not None and self.mean_z(i) > self.mean_bound(len(zs))) or self._mostly_rejected(i) \
                        or self.noise_scale[i] > ADAPT_FLAG:
                    out.append(name)
            self._flagged = tuple(out)
        return self._flagged

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
                         "mean_z": self.mean_z(i),
                         "mean_bound": self.mean_bound(len(self._zsum[i])) if self._zsum[i] is not None else 0.0,
                         "gated": self.gated[i], "noise_scale": self.noise_scale[i]}
        return {"window_s": self.window_s, "alpha": self.alpha, "flagged": self.flagged_updates, "sensors": per}

"""gtsam ISAM2 as a fixed-lag smoother (backends/fgs.py): one interface, two implementations.

The smoother adds one chunk of new step variables per update (``chunk_steps``) and marginalises the variables
older than its lag.  gtsam's ``IncrementalFixedLagSmoother`` marks every key it marginalises for re-elimination
and orders all the others as one constraint group, so each update re-eliminates most of the window: 22 keys per
update on the public four-bar (10 new ones, a window of 21), 630 µs of the fgs's 1.3 ms per 10 ms of data.

:class:`GenerationalISAM2` sorts the keys into *generations*: the new keys of one update but its newest, and
that newest key alone.  It has ISAM2 order every key it re-eliminates by generation, older first (so the newest
key of all is the root).  An ordering that never puts a key after a younger one keeps a Bayes tree clique's
ancestors no older than itself, through every update: the new cliques are ordered so, and a subtree ISAM2 keeps
hangs below the clique of its separator's oldest key, which was its ancestor before.  So all generations older
than the lag together are leaves, and ``ISAM2.marginalizeLeaves`` takes them without re-eliminating anything:
13 keys per update on the four-bar (460 µs), and the newest key's marginal covariance is the root's (the
consistency check's refresh: 280 → 110 µs).  The window holds the variables of the last ``lag`` seconds, both
ends included, as gtsam's smoother's does (21 steps at 20 ms); a generation the lag covers in part stays whole.
(The newest key is a generation of its own so that the lag's end falls between generations when the lag is a
whole number of updates.)  ``marginalizeLeaves`` does not check the leaves in a release build of gtsam (a
non-leaf leaves ISAM2 inconsistent), which is why the ordering is the whole of the argument.

ccolamd takes a constraint group number only up to the number of keys it orders, at least an update's new keys
(beyond it gtsam writes past its arrays: measured, a heap corruption), and with ``k`` keys per update and a lag
of ``L`` steps the generations need ⌊L/k⌋ + ⌊(L−1)/k⌋ + 4 groups.  When they do not fit (``k`` small against
``L``, e.g. one step per update), :func:`fixed_lag_smoother` returns :class:`GtsamFixedLag`, gtsam's own
smoother; :meth:`GenerationalISAM2.update` refuses an update they would not fit.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Sequence

import gtsam
import numpy as np


class FixedLag(ABC):
    """The fixed-lag smoother the fgs drives: add factors and new variables, read the estimate and the newest
    variable's marginal covariance."""

    @abstractmethod
    def update(self, graph: gtsam.NonlinearFactorGraph, values: gtsam.Values, stamps: dict[int, float],
               remove: Sequence[int] = ()) -> list[int]:
        """Add the factors ``graph`` and the new variables ``values`` (their times ``stamps``, s), remove the factors
        in the slots ``remove``, solve, and marginalise the variables older than the lag.  The slots of the new
        factors, in the order of ``graph``."""

    @abstractmethod
    def holds(self, key: int) -> bool:
        """Whether the variable ``key`` is in the window (not marginalised yet)."""

    @abstractmethod
    def calculate_estimate(self) -> gtsam.Values:
        """The current estimate of every variable in the window."""

    @abstractmethod
    def marginal_covariance(self, key: int) -> np.ndarray:
        """Marginal covariance of one variable in the window (RuntimeError or IndexError if gtsam has none)."""

    @abstractmethod
    def factor_slots(self) -> int:
        """Factor slots ISAM2 holds (used and emptied): bounded by the window's factors, since emptied slots
        are reused (``findUnusedFactorSlots``)."""

    @abstractmethod
    def key_count(self) -> int:
        """Variables in the window."""

    @abstractmethod
    def reeliminated(self) -> int:
        """Variables the last update re-eliminated."""


class GenerationalISAM2(FixedLag):
    """ISAM2 with generation-ordered elimination and marginalisation of whole generations (module docstring)."""

    def __init__(self, lag_s: float, params: gtsam.ISAM2Params, tol_s: float) -> None:
        """``lag_s``: the lag (s); a generation whose newest variable is older than the newest one by more than
        the lag and ``tol_s`` is marginalised (half a step: the times are step times)."""
        self._isam = gtsam.ISAM2(params)
        self._lag_s, self._tol_s = lag_s, tol_s
        #: (newest time, keys) of each generation in the window, oldest first
        self._generations: deque[tuple[float, list[int]]] = deque()
        self._reeliminated = 0

    def update(self, graph: gtsam.NonlinearFactorGraph, values: gtsam.Values, stamps: dict[int, float],
               remove: Sequence[int] = ()) -> list[int]:
        """As :meth:`FixedLag.update`; ValueError, before ISAM2 sees it, for an update without new variables or
        whose generations would number more groups than its new variables (ccolamd's bound, module docstring:
        gtsam writes past its arrays there)."""
        if not stamps or _largest_group(len(self._generations), len(stamps)) > len(stamps):
            raise ValueError(f"{len(stamps)} new variables cannot order {len(self._generations)} older generations "
                             f"(fixed_lag.generations_fit)")
        new = sorted(stamps, key=stamps.__getitem__)
        if len(new) > 1:
            self._generations.append((stamps[new[-2]], new[:-1]))
        self._generations.append((stamps[new[-1]], new[-1:]))
        groups = gtsam.KeyGroupMap()
        for i, (_, keys) in enumerate(self._generations):
            for key in keys:
                groups.insert2(key, i)
        result = self._isam.update(graph, values, list(remove), groups)
        self._reeliminated = result.getVariablesReeliminated()
        cut = self._generations[-1][0] - self._lag_s - self._tol_s
        old = gtsam.KeyList()
        while len(self._generations) > 1 and self._generations[0][0] < cut:
            for key in self._generations.popleft()[1]:
                old.push_back(key)
        if old.size():
            self._isam.marginalizeLeaves(old)
        return list(result.getNewFactorsIndices())

    def holds(self, key: int) -> bool:
        return any(key in keys for _, keys in self._generations)

    def calculate_estimate(self) -> gtsam.Values:
        return self._isam.calculateEstimate()

    def marginal_covariance(self, key: int) -> np.ndarray:
        return self._isam.marginalCovariance(key)

    def factor_slots(self) -> int:
        return int(self._isam.getFactorsUnsafe().size())

    def key_count(self) -> int:
        return sum(len(keys) for _, keys in self._generations)

    def reeliminated(self) -> int:
        return self._reeliminated


class GtsamFixedLag(FixedLag):
    """gtsam's ``IncrementalFixedLagSmoother`` (variables older than the lag marginalised one by one, each
    update re-eliminating most of the window)."""

    def __init__(self, lag_s: float, params: gtsam.ISAM2Params) -> None:
        self._smoother = gtsam.IncrementalFixedLagSmoother(lag_s, params)

    def update(self, graph: gtsam.NonlinearFactorGraph, values: gtsam.Values, stamps: dict[int, float],
               remove: Sequence[int] = ()) -> list[int]:
        self._smoother.update(graph, values, stamps, list(remove))
        return list(self._smoother.getISAM2Result().getNewFactorsIndices())

    def holds(self, key: int) -> bool:
        return key in self._smoother.timestamps()

    def calculate_estimate(self) -> gtsam.Values:
        return self._smoother.calculateEstimate()

    def marginal_covariance(self, key: int) -> np.ndarray:
        return self._smoother.getISAM2().marginalCovariance(key)

    def factor_slots(self) -> int:
        return int(self._smoother.getFactors().size())

    def key_count(self) -> int:
        return len(self._smoother.timestamps())

    def reeliminated(self) -> int:
        return self._smoother.getISAM2Result().getVariablesReeliminated()


def _largest_group(older: int, new_keys: int) -> int:
    """The largest constraint group number of an update with ``new_keys`` new keys after ``older`` generations:
    its keys but the newest are one generation more, its newest key another."""
    return older + (1 if new_keys > 1 else 0)


def generations_fit(lag_steps: int, chunk_steps: int) -> bool:
    """Whether :class:`GenerationalISAM2`'s constraint groups fit ccolamd (module docstring) at ``chunk_steps`` new
    keys per update: the largest group number at most those keys, with the ⌊L/k⌋ + ⌊(L−1)/k⌋ + 2 generations a lag
    of L steps keeps (an update's newest key and the others, of each update within the lag)."""
    older = lag_steps // chunk_steps + (lag_steps - 1) // chunk_steps + 2
    return _largest_group(older, chunk_steps) <= chunk_steps


def fixed_lag_smoother(lag_steps: int, chunk_steps: int, dt: float, params: gtsam.ISAM2Params) -> FixedLag:
    """The fixed-lag smoother of a lag of ``lag_steps`` steps of ``dt`` s, ``chunk_steps`` new steps per update:
    :class:`GenerationalISAM2` when its groups fit, else :class:`GtsamFixedLag`."""
    if generations_fit(lag_steps, chunk_steps):
        return GenerationalISAM2(lag_steps * dt, params, 0.5 * dt)
    return GtsamFixedLag(lag_steps * dt, params)

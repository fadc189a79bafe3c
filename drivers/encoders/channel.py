"""Backend-independent encoder logic: counts → angle, device time → host time, ``enc/<name>`` messages.

Both backends (serial counter board, Phidget22) reduce their data to (continuous count, device
time) pairs and hand them to :meth:`EncoderChannel.sample`, which emits the bus message through a
sink callable ``sink(topic, msg)`` (the CLI's sink publishes on the bus; tests collect).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from estimator_service.angles import counts_to_angle

#: ``sink(topic, msg)`` receives every message a driver produces
Sink = Callable[[str, dict], None]


@dataclass(frozen=True)
class CountScale:
    """Quadrature counts ↔ angle of one encoder.

    ``lines`` is the encoder's lines (pulses) per revolution per phase; with 4× quadrature
    decoding ``cpr = 4 * lines`` counts per revolution.  ``offset`` (rad) is the angle at count 0:
    ``angle = offset + 2π count / cpr`` (rad, CCW positive when counts increase).
    """

    lines: int
    offset: float = 0.0

    def __post_init__(self) -> None:
        if self.lines <= 0:
            raise ValueError(f"lines must be a positive integer, got {self.lines}")

    @property
    def cpr(self) -> int:
        """Counts per revolution (4 × lines)."""
        return 4 * self.lines

    def angle(self, count: int) -> float:
        """Angle (rad) of a continuous count."""
        return counts_to_angle(count, self.cpr, self.offset)


class ClockMapper:
    """Maps a device clock (s, continuous) onto host time (s) with a skew-bounded minimum filter.

    Host receive times carry transport delay and jitter (USB polling, OS scheduling); the device
    clock does not.  The offset ``o = t_recv - t_dev`` is tracked as its running minimum, allowed to
    creep upwards by ``max_skew`` (relative clock rate difference) of elapsed device time:
    ``o_k = min(o_{k-1} + max_skew (t_dev_k - t_dev_{k-1}), t_recv_k - t_dev_k)``.  The mapped time
    ``t_dev + o`` is never later than the receive time and never decreases.
    """

    def __init__(self, max_skew: float = 2e-4) -> None:
        self.max_skew = max_skew
        self.offset: float | None = None
        self._last_dev = 0.0

    def reset(self) -> None:
        """Forget the offset (the device clock restarted)."""
        self.offset = None

    def host_time(self, t_dev: float, t_recv: float) -> float:
        """Host time (s) of a sample taken at device time ``t_dev`` (s) and received at ``t_recv`` (s)."""
        o = t_recv - t_dev
        if self.offset is not None:
            o = min(self.offset + self.max_skew * max(0.0, t_dev - self._last_dev), o)
        self.offset = o
        self._last_dev = t_dev
        return t_dev + o


class EncoderChannel:
    """One encoder published as ``enc/<name>``: message fields ``t`` (host time, s), ``seq``
    (per-topic sample counter: +1 per message, plus the device samples the backend reports lost
    before it), ``count`` (continuous counts), ``cpr`` and ``angle`` (rad).  ``lost`` sums them."""

    def __init__(self, name: str, scale: CountScale, sink: Sink) -> None:
        self.name = name
        self.topic = f"enc/{name}"
        self.scale = scale
        self.sink = sink
        self.clock = ClockMapper()
        self.seq = 0
        self.lost = 0

    def sample(self, count: int, t_dev: float, t_recv: float, missed: int = 0) -> dict:
        """Emit the message of continuous ``count`` latched at device time ``t_dev`` (s), received at
        host time ``t_recv`` (s), after ``missed`` device samples that never arrived; returns it."""
        self.seq += missed
        self.lost += missed
        msg = {
            "t": self.clock.host_time(t_dev, t_recv),
            "seq": self.seq,
            "count": int(count),
            "cpr": self.scale.cpr,
            "angle": self.scale.angle(count),
        }
        self.seq += 1
        self.sink(self.topic, msg)
        return msg

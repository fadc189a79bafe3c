"""Backend-independent part of the Xsens driver: device samples → ``imu/<name>`` messages.

Both backends (Xbus over pyserial in :mod:`drivers.xsens.device`, the vendor's ``xsensdeviceapi``
in :mod:`drivers.xsens.xda`) reduce every device packet to a :class:`Sample` and hand it, with its
host receive time, to :meth:`ImuStream.publish`.  One place therefore decides the message: ``t``
host time (s) of the sample — the device clock (SampleTimeFine, 10 kHz ticks, 32-bit wrap
unwrapped) mapped onto the host clock by :class:`~drivers.encoders.channel.ClockMapper`, which
removes USB transport jitter —, ``dev_t`` (s, device clock), ``seq`` from PacketCounter (16-bit
wrap unwrapped; gaps counted in :attr:`ImuStream.lost`; after :meth:`ImuStream.restart` — a
reconnect or a device restart, whose counters may have restarted — seq advances by the sample
periods the stream was silent, so a stall or an unplug shows as lost samples), ``gyr`` (rad/s,
sensor frame), ``acc`` (m/s², sensor frame, proper acceleration), ``quat`` (w, x, y, z, sensor to
ENU) and ``status`` (StatusWord).  :class:`ArrivalJitter` measures how evenly samples reach the
host (the USB adapter's latency timer shows up here, not in ``t``).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from drivers.encoders.channel import ClockMapper

Sink = Callable[[str, dict], None]

FINE_HZ = 10000.0  #: SampleTimeFine tick rate, Hz


class Unwrap:
    """Unwraps a counter that wraps at ``2**bits`` into a continuous integer."""

    def __init__(self, bits: int) -> None:
        self.mod = 1 << bits
        self.value: int | None = None

    def update(self, raw: int) -> int:
        if self.value is None:
            self.value = raw
        else:
            self.value += (raw - self.value) % self.mod
        return self.value


@dataclass(frozen=True)
class Sample:
    """One device packet, whichever backend read it: PacketCounter (16-bit), RateOfTurn (rad/s),
    Acceleration (m/s²), SampleTimeFine (10 kHz ticks, 32-bit; None if not sent), Quaternion
    (w, x, y, z; None if not sent), StatusWord."""

    counter: int
    gyr: Sequence[float]
    acc: Sequence[float]
    fine: int | None = None
    quat: Sequence[float] | None = None
    status: int = 0


class ArrivalJitter:
    """Host inter-arrival intervals (s) of the last ``window`` samples.

    Samples that arrive in one USB transfer share a receive time (interval 0); an FTDI adapter
    with its default 16 ms latency timer delivers a 400 Hz stream as clumps 16 ms apart.
    """

    def __init__(self, window: int = 4000) -> None:
        self.intervals: deque[float] = deque(maxlen=window)
        self._last: float | None = None
        self._lock = threading.Lock()  #: the status thread reads while the driver thread adds

    def restart(self) -> None:
        """A new connection: the gap to its first sample is not an inter-arrival interval."""
        self._last = None

    def add(self, t_recv: float) -> None:
        """Record the arrival of one sample at host time ``t_recv`` (s)."""
        if self._last is not None:
            with self._lock:
                self.intervals.append(max(0.0, t_recv - self._last))
        self._last = t_recv

    def percentiles_ms(self) -> dict[str, float] | None:
        """p50, p99 and max of the recorded intervals in ms, None before two samples arrived."""
        with self._lock:
            a = np.array(self.intervals, float) * 1e3
        if not a.size:
            return None
        p50, p99 = np.percentile(a, [50, 99])
        return {"p50": float(p50), "p99": float(p99), "max": float(a.max())}

    def summary(self) -> str:
        """``arrival interval p50 2.5 ms, p99 16.1 ms, max 16.3 ms`` (or ``no arrivals yet``)."""
        p = self.percentiles_ms()
        if p is None:
            return "arrival interval: no samples yet"
        return f"arrival interval p50 {p['p50']:.1f} ms, p99 {p['p99']:.1f} ms, max {p['max']:.1f} ms"


class StreamCounts:
    """``published`` and ``lost`` of a driver, read from its :class:`ImuStream` ``stream``."""

    stream: ImuStream

    @property
    def published(self) -> int:
        return self.stream.published

    @property
    def lost(self) -> int:
        return self.stream.lost


class ImuStream:
    """Turns :class:`Sample` objects into ``imu/<name>`` messages for ``sink(topic, message)``."""

    def __init__(self, name: str, sink: Sink, rate_hz: float = 100.0) -> None:
        self.topic, self.sink, self.rate_hz = f"imu/{name}", sink, rate_hz
        self.published = 0  #: messages emitted
        self.lost = 0  #: samples missing from the PacketCounter sequence (and silent periods across restarts)
        self.jitter = ArrivalJitter()
        self._last_seq: int | None = None
        #: (SampleTimeFine, monotonic s it was taken) of the last sample
        self._last_sample: tuple[int | None, float] = (None, 0.0)
        self.restart()

    def restart(self) -> None:
        """Forget the device's counters and clock (a new connection, or the device restarted)."""
        self._seq = Unwrap(16)
        self._fine = Unwrap(32)
        self._seq_base: int | None = None
        self._clock = ClockMapper()
        self.jitter.restart()

    def publish(self, s: Sample, t_recv: float) -> dict:
        """Emit the message of sample ``s`` received at host time ``t_recv`` (s); returns it."""
        now = time.monotonic()
        seq = self._device_seq(int(s.counter), s.fine, now)
        msg: dict = {"t": t_recv, "seq": seq, "gyr": [float(x) for x in s.gyr], "acc": [float(x) for x in s.acc],
                     "status": int(s.status)}
        if s.fine is not None:
            msg["dev_t"] = self._fine.update(int(s.fine)) / FINE_HZ
            msg["t"] = self._clock.host_time(msg["dev_t"], t_recv)
        if s.quat is not None:
            msg["quat"] = [float(x) for x in s.quat]
        # when it was sampled on the monotonic clock: the receive delay the clock mapping removes taken
        # off (a backlog read late before a silence would otherwise shorten the outage :meth:`_device_seq` sees)
        self._last_sample = (s.fine, now - (t_recv - msg["t"]))
        self.jitter.add(t_recv)
        self.sink(self.topic, msg)
        self.published += 1
        return msg

    def _device_seq(self, counter: int, fine: int | None, now: float) -> int:
        """``seq`` of a sample with PacketCounter ``counter`` (16 bit) and SampleTimeFine ``fine``
        (10 kHz ticks, 32 bit), handled at monotonic time ``now`` (s); counts the samples lost before it
        in :attr:`lost`.

        Within one connection seq follows the PacketCounter.  The first sample after
        :meth:`restart` advances seq by the sample periods (``rate_hz``) since the previous sample:
        on the device clock if it ran on (it advanced by the host-elapsed time within 0.5 s), else
        on the host's monotonic clock.  The host-elapsed time runs from when the previous sample was
        taken (:meth:`publish`), not when it was handled.
        """
        raw = self._seq.update(counter)
        if self._seq_base is None:  # first sample since restart
            advance = 0
            if self._last_seq is not None:
                last_fine, last_mono = self._last_sample
                elapsed = now - last_mono
                if fine is not None and last_fine is not None:
                    dev_elapsed = ((fine - last_fine) % 2**32) / FINE_HZ
                    if abs(dev_elapsed - elapsed) <= 0.5 + 1e-3 * elapsed:
                        elapsed = dev_elapsed
                advance = max(1, round(elapsed * self.rate_hz))
            self._seq_base = (self._last_seq + advance if self._last_seq is not None else 0) - raw
        seq = self._seq_base + raw
        if self._last_seq is not None and seq > self._last_seq + 1:
            self.lost += seq - self._last_seq - 1
        self._last_seq = seq
        return seq

    def status(self) -> str:
        """One status line: samples, losses, arrival jitter."""
        return f"{self.published} samples, {self.lost} lost, {self.jitter.summary()}"

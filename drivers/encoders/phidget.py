"""Phidget22 encoder backend (e.g. 1047 HighSpeed Encoder, ENC1000 on a VINT hub).

``phidget22`` is an optional dependency (``pip install 'rigstate[phidgets]'``), imported only when
this backend is used.  Its native library needs ``libusb-1.0-0`` (Debian/Ubuntu package) and a
udev rule granting access to the device (docs/encoders.md).

Each encoder is a Phidget22 ``Encoder`` channel matched by device serial number, hub port and
channel.  The library calls the position-change handler every ``data_interval_ms`` with the count
change and the elapsed device time (ms) since the previous event; their running sums are the
continuous count and the device time.  Events are queued and converted on the driver's own thread
(the bus publisher is not thread-safe).  On detach the driver reports and keeps the channel open:
the library re-attaches it when the device returns and publishing resumes (the count continues
from its last value; motion during the outage is not known).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from drivers.encoders.channel import EncoderChannel
from estimator_service.errors import UserError

log = logging.getLogger(__name__)


def import_encoder_class() -> type:
    """``Phidget22.Devices.Encoder.Encoder``, or a UserError telling how to install it."""
    try:
        from Phidget22.Devices.Encoder import Encoder
    except ImportError as exc:
        raise UserError("the Phidget backend needs the optional package phidget22: "
                        "pip install 'rigstate[phidgets]'") from exc
    return Encoder


@dataclass
class PhidgetStats:
    """Channel events since start."""

    attaches: int = 0
    detaches: int = 0
    index_pulses: int = 0  #: position-change events with indexTriggered
    errors: int = 0  #: Phidget error events


@dataclass
class _State:
    """Running sums of one channel: continuous count and device time (s)."""

    count: int = 0
    t_dev: float = 0.0


class PhidgetEncoderDriver:
    """Opens one Phidget22 ``Encoder`` per configured channel and feeds its :class:`EncoderChannel`.

    ``channels`` maps Phidget channel index → encoder; ``serial_number`` (device serial, None = any)
    and ``hub_port`` (VINT hub port, None = not on a hub) select the device;
    ``data_interval_ms`` is the event period (ms); ``clock`` gives host time (s).
    """

    def __init__(self, channels: Mapping[int, EncoderChannel], *, serial_number: int | None = None,
                 hub_port: int | None = None, data_interval_ms: int = 8, attach_timeout_s: float = 5.0,
                 clock: Callable[[], float] = time.time) -> None:
        self.channels = dict(channels)
        self.serial_number = serial_number
        self.hub_port = hub_port
        self.data_interval_ms = data_interval_ms
        self.attach_timeout_s = attach_timeout_s
        self.clock = clock
        self.stats = PhidgetStats()
        self._events: queue.Queue[tuple] = queue.Queue()
        self._state = {c: _State() for c in self.channels}

    def describe(self, channel: int) -> str:
        """Human-readable address of one channel."""
        sn = "any" if self.serial_number is None else str(self.serial_number)
        hub = "" if self.hub_port is None else f" hub port {self.hub_port}"
        return f"Phidget encoder serial {sn}{hub} channel {channel}"

    def run(self, stop: threading.Event) -> None:
        """Open the channels, convert events until ``stop`` is set, close the channels."""
        encoder_class = import_encoder_class()
        opened = []
        try:
            for c in self.channels:
                opened.append(self._open(encoder_class, c))
            waiting_since = time.monotonic()
            warned = False
            while not stop.is_set():
                try:
                    event = self._events.get(timeout=0.1)
                except queue.Empty:
                    if not warned and self.stats.attaches == 0 and time.monotonic() - waiting_since > self.attach_timeout_s:
                        log.warning("waiting for %s to attach (is it plugged in, and is the udev rule "
                                    "installed?)", ", ".join(self.describe(c) for c in self.channels))
                        warned = True
                    continue
                self._handle(*event)
        finally:
            for ch in opened:
                ch.close()

    def _open(self, encoder_class: type, channel: int):
        """Create, address and open (asynchronously) the Phidget channel ``channel``."""
        try:
            ch = encoder_class()
        except OSError as exc:
            raise UserError(f"cannot load the Phidget22 native library ({exc}); install the system "
                            "package libusb-1.0-0 (apt install libusb-1.0-0)") from exc
        if self.serial_number is not None:
            ch.setDeviceSerialNumber(self.serial_number)
        if self.hub_port is not None:
            ch.setHubPort(self.hub_port)
        ch.setChannel(channel)
        ch.setOnAttachHandler(lambda c: self._on_attach(c, channel))
        ch.setOnDetachHandler(lambda c: self._events.put(("detach", channel)))
        ch.setOnErrorHandler(lambda c, code, text: self._events.put(("error", channel, code, text)))
        ch.setOnPositionChangeHandler(
            lambda c, d_count, d_ms, index: self._events.put(
                ("position", channel, d_count, d_ms, index, self.clock())))
        ch.open()  # the library attaches (and re-attaches after a detach) in the background
        return ch

    def _on_attach(self, ch, channel: int) -> None:
        """Library thread: configure the freshly attached channel, then report."""
        try:
            ch.setDataInterval(self.data_interval_ms)
        except Exception as exc:  # PhidgetException (e.g. out of range); raising here would be lost
            self._events.put(("error", channel, "setDataInterval", str(exc)))
        self._events.put(("attach", channel))

    def _handle(self, kind: str, channel: int, *args) -> None:
        """Apply one queued event on the driver thread."""
        enc = self.channels[channel]
        if kind == "position":
            d_count, d_ms, index, t_recv = args
            self.position_change(channel, int(d_count), float(d_ms), bool(index), t_recv)
        elif kind == "attach":
            self.stats.attaches += 1
            enc.clock.reset()
            self._state[channel].t_dev = 0.0
            log.info("%s attached (data interval %d ms); publishing %s", self.describe(channel),
                     self.data_interval_ms, enc.topic)
        elif kind == "detach":
            self.stats.detaches += 1
            log.warning("%s detached; waiting for it to return (%s continues from count %d)",
                        self.describe(channel), enc.topic, self._state[channel].count)
        else:
            self.stats.errors += 1
            code, text = args
            log.warning("%s: error %s: %s", self.describe(channel), code, text)

    def position_change(self, channel: int, d_count: int, d_ms: float, index: bool, t_recv: float) -> dict:
        """One position-change event: ``d_count`` counts and ``d_ms`` device ms since the previous
        event of ``channel``, received at host time ``t_recv`` (s); returns the published message."""
        st = self._state[channel]
        st.count += d_count
        st.t_dev += d_ms * 1e-3
        if index:
            self.stats.index_pulses += 1
            if self.stats.index_pulses == 1:
                log.info("%s: index pulse near count %d", self.describe(channel), st.count)
        return self.channels[channel].sample(st.count, st.t_dev, t_recv)

"""Xsens MTi driver through the vendor's Xsens Device API (``xsensdeviceapi``, XDA).

``xsensdeviceapi`` is not on PyPI: it is the Python wheel shipped with the Xsens MT Software
Suite (docs/xsens.md).  It is imported only when this backend is chosen (:func:`import_xda`).

After each (re)connect: ``XsScanner_scanPort`` finds the device on ``port``, ``XsControl.openPort``
opens it, a callback handler is attached, then ``gotoConfig``, ``setOutputConfiguration`` with the
rig's outputs (:func:`~drivers.xsens.device.rig_outputs`: PacketCounter, SampleTimeFine,
StatusWord with every sample; RateOfTurn, Acceleration, Quaternion at ``rate_hz``) and
``gotoMeasurement``.  XDA calls ``onLiveDataAvailable(device, packet)`` on its own thread: the
callback copies the packet's fields into a :class:`~drivers.xsens.stream.Sample` with its host
receive time and queues it; the driver thread publishes the queue through the same
:class:`~drivers.xsens.stream.ImuStream` as the Xbus backend (identical messages, time mapping and
loss accounting).  ``onConnectivityChanged`` to anything but plugged in, or no packet for
``silence_s``, closes the port; the driver reconnects with back-off and configures the device again.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from drivers.serial_link import LinkStats, keep_serving
from drivers.xsens.device import DeviceError, DeviceInfo, rig_outputs
from drivers.xsens.stream import ImuStream, Sample, Sink, StreamCounts
from estimator_service.errors import UserError

log = logging.getLogger(__name__)

MODULE = "xsensdeviceapi"
INSTALL_HINT = ("it is not on PyPI: install the wheel shipped with the Xsens MT Software Suite into this Python "
                "environment (pip install <MT Software Suite folder>/.../xsensdeviceapi-*.whl, see docs/xsens.md)")


def load_xda() -> tuple[ModuleType | None, str]:
    """(the vendor module, where it was found) or (None, why it cannot be imported)."""
    try:
        import xsensdeviceapi
    except ImportError as exc:
        return None, str(exc)
    return xsensdeviceapi, getattr(xsensdeviceapi, "__file__", None) or "built in"


def import_xda() -> ModuleType:
    """The vendor module, or a UserError saying how to install it."""
    module, why = load_xda()
    if module is None:
        raise UserError(f"--backend xda: the Python module {MODULE} cannot be imported ({why}); {INSTALL_HINT}; "
                        "or use --backend xbus, which needs no vendor software")
    return module


def device_path(port: str) -> str:
    """The device a path or udev symlink points to now (``/dev/xsens-coupler`` -> ``/dev/ttyUSB0``)."""
    return os.path.realpath(port) if os.path.exists(port) else port


class ConnectFailed(OSError):
    """No device found on the port, or it could not be opened: retried with back-off."""


_LOST = object()  #: queued by the callback when the device is no longer plugged in


@dataclass
class _Connection:
    port_info: Any  #: XsPortInfo
    device: Any  #: XsDevice
    callback: Any  #: the XsCallback subclass instance
    events: queue.Queue


def make_callback(xda: ModuleType, events: queue.Queue, clock: Callable[[], float]) -> Any:
    """An ``xda.XsCallback`` that queues ``(Sample, t_recv)`` per live packet and ``_LOST`` when the
    device's connectivity leaves ``XCS_PluggedIn``.  Runs on XDA's thread: it only copies fields
    (the packet is not valid after the call) and never touches the bus."""

    class Callback(xda.XsCallback):  # type: ignore[name-defined,misc]
        def onLiveDataAvailable(self, dev: Any, packet: Any) -> None:  # noqa: N802 (XDA's name)
            t_recv = clock()
            if not (packet.containsPacketCounter() and packet.containsCalibratedGyroscopeData()
                    and packet.containsCalibratedAcceleration()):
                return
            gyr, acc = packet.calibratedGyroscopeData(), packet.calibratedAcceleration()
            quat = packet.orientationQuaternion() if packet.containsOrientation() else None
            events.put((Sample(
                counter=int(packet.packetCounter()),
                gyr=[float(gyr[i]) for i in range(3)],
                acc=[float(acc[i]) for i in range(3)],
                fine=int(packet.sampleTimeFine()) if packet.containsSampleTimeFine() else None,
                quat=[float(quat[i]) for i in range(4)] if quat is not None else None,
                status=int(packet.status()) if packet.containsStatus() else 0,
            ), t_recv))

        def onConnectivityChanged(self, dev: Any, new_state: Any) -> None:  # noqa: N802
            if new_state != xda.XCS_PluggedIn:
                events.put(_LOST)

    return Callback()


class XdaDriver(StreamCounts):
    """Reads one MTi through XDA and feeds ``sink(topic, message)``; see the module docstring.

    Same interface as :class:`~drivers.xsens.device.XsensDriver`: :meth:`run`, ``stream``,
    ``published``, ``lost``, ``stats``, ``info``.
    """

    def __init__(self, port: str, name: str, sink: Sink, xda: ModuleType, rate_hz: int = 100,
                 silence_s: float = 1.0, backoff_max_s: float = 5.0, clock: Callable[[], float] = time.time) -> None:
        self.port, self.xda, self.rate_hz = port, xda, rate_hz
        self.silence_s, self.backoff_max_s, self.clock = silence_s, backoff_max_s, clock
        self.stream = ImuStream(name, sink, rate_hz)
        self.stats = LinkStats()
        self.info = DeviceInfo()
        self._control: Any = None

    def run(self, stop: threading.Event) -> None:
        """Serve the device (reconnecting as needed) until ``stop`` is set."""
        self._control = self.xda.XsControl_construct()
        try:
            keep_serving(self.port, self._connect, self._serve, self._close, stop, self.stats,
                         backoff_max_s=self.backoff_max_s)
        finally:
            self._control.close()
            self._control.destruct()

    def _connect(self) -> _Connection:
        xda, path = self.xda, device_path(self.port)
        info = xda.XsScanner_scanPort(path, xda.XBR_Invalid)
        if info.empty():
            raise ConnectFailed(f"no Xsens device found on {path}")
        if not self._control.openPort(info.portName(), info.baudrate()):
            raise ConnectFailed(f"XsControl.openPort({info.portName()}) failed")
        device = self._control.device(info.deviceId())
        events: queue.Queue = queue.Queue()
        callback = make_callback(xda, events, self.clock)
        device.addCallbackHandler(callback)
        return _Connection(info, device, callback, events)

    def _close(self, conn: _Connection) -> None:
        conn.device.removeCallbackHandler(conn.callback)
        self._control.closePort(conn.port_info.portName())

    def configure(self, device: Any) -> DeviceInfo:
        """gotoConfig, the rig's output configuration, gotoMeasurement; DeviceError if refused."""
        xda = self.xda
        if not device.gotoConfig():
            raise DeviceError(f"{self.port}: XDA: gotoConfig failed")
        self.info = DeviceInfo(device_id=int(device.deviceId().toInt()), product_code=str(device.productCode()).strip(),
                               firmware=str(device.firmwareVersion().toXsString()))
        config = xda.XsOutputConfigurationArray()
        for name, rate in rig_outputs(self.rate_hz):
            config.push_back(xda.XsOutputConfiguration(getattr(xda, f"XDI_{name}"), rate))
        if not device.setOutputConfiguration(config):
            raise DeviceError(f"{self.port}: XDA: setOutputConfiguration refused (rate {self.rate_hz} Hz)")
        if not device.gotoMeasurement():
            raise DeviceError(f"{self.port}: XDA: gotoMeasurement failed")
        log.info("%s: %s (device id %08X, firmware %s) measuring at %d Hz through %s", self.port,
                 self.info.product_code, self.info.device_id, self.info.firmware, self.rate_hz, MODULE)
        return self.info

    def _serve(self, conn: _Connection, stop: threading.Event) -> bool:
        got_any = False
        self.stream.restart()
        try:
            self.configure(conn.device)
        except DeviceError as exc:
            log.warning("%s", exc)
            return False
        last_good = time.monotonic()
        while not stop.is_set():
            try:
                event = conn.events.get(timeout=0.05)
            except queue.Empty:
                event = None
            now = time.monotonic()
            if event is _LOST:
                self.stats.vanished += 1
                log.warning("%s: device disconnected; reconnecting", self.port)
                return got_any
            if event is not None:
                sample, t_recv = event
                self.stream.publish(sample, t_recv)
                got_any, last_good = True, now
            elif now - last_good > self.silence_s:
                self.stats.silent += 1
                log.warning("%s: no data for %.1f s; reconnecting", self.port, now - last_good)
                return got_any
        return got_any

"""Test stand-in for the vendor's ``xsensdeviceapi`` (Xsens Device API, XDA).

Implements the part of XDA's documented Python API that rigstate uses — ``XsControl_construct``,
``XsScanner_scanPort``/``XsScanner_scanPorts``, ``XsControl.openPort``/``device``/``closePort``/
``close``/``destruct``, ``XsDevice.gotoConfig``/``setOutputConfiguration``/``gotoMeasurement``/
``addCallbackHandler``, ``XsCallback.onLiveDataAvailable``/``onConnectivityChanged``, the
``XsDataPacket`` accessors and the ``XDI_``/``XCS_`` constants — over Xbus with pyserial, the
way the real library talks to an MTi.  So it drives the Xsens emulator on a pseudo-terminal, and
the same device data feeds both rigstate backends.  Like XDA it delivers packets on its own
thread and reports a vanished port as ``XCS_Disconnected``.

The real ``XsScanner_scanPorts`` enumerates the machine's USB and serial ports; a pseudo-terminal
is not one, so this one scans the ports listed in ``$XSENSDEVICEAPI_STANDIN_PORTS``
(``os.pathsep``-separated).  Tests put this directory on ``sys.path``/``PYTHONPATH``; nothing else
does.
"""

from __future__ import annotations

import os
import queue
import struct
import threading
from typing import Any

import serial

from drivers.xsens.mtdata2 import decode_mtdata2
from drivers.xsens.xbus import MID, Message, XbusParser, frame

PORTS_ENV = "XSENSDEVICEAPI_STANDIN_PORTS"
XBR_Invalid = 0  # noqa: N816 (XDA's names)
XBR_115k2 = 115200  # noqa: N816
XCS_Disconnected, XCS_Rejected, XCS_PluggedIn, XCS_Wireless, XCS_WirelessOutOfRange, XCS_File, XCS_Unknown = range(7)
XDI_PacketCounter = 0x1020  # noqa: N816 (data identifiers: the Xbus data ids)
XDI_SampleTimeFine = 0x1060  # noqa: N816
XDI_Quaternion = 0x2010  # noqa: N816
XDI_Acceleration = 0x4020  # noqa: N816
XDI_RateOfTurn = 0x8020  # noqa: N816
XDI_StatusWord = 0xE020  # noqa: N816
TIMEOUT_S = 1.0


class XsDeviceId:
    def __init__(self, value: int = 0) -> None:
        self._value = value

    def toInt(self) -> int:  # noqa: N802
        return self._value

    def toXsString(self) -> str:  # noqa: N802
        return f"{self._value:08X}"

    def isMti(self) -> bool:  # noqa: N802
        return self._value != 0

    def isMtig(self) -> bool:  # noqa: N802
        return False

    def __eq__(self, other: object) -> bool:
        return isinstance(other, XsDeviceId) and other._value == self._value

    def __hash__(self) -> int:
        return hash(self._value)


class XsVersion:
    def __init__(self, major: int = 0, minor: int = 0, revision: int = 0) -> None:
        self.parts = (major, minor, revision)

    def toXsString(self) -> str:  # noqa: N802
        return ".".join(str(p) for p in self.parts)


def xdaVersion(version: XsVersion) -> None:  # noqa: N802
    version.parts = (0, 0, 0)


class XsPortInfo:
    def __init__(self, name: str = "", baudrate: int = XBR_Invalid, device_id: int = 0) -> None:
        self._name, self._baud, self._id = name, baudrate, XsDeviceId(device_id)

    def portName(self) -> str:  # noqa: N802
        return self._name

    def baudrate(self) -> int:
        return self._baud

    def deviceId(self) -> XsDeviceId:  # noqa: N802
        return self._id

    def empty(self) -> bool:
        return not self._name


class XsPortInfoArray(list):
    def size(self) -> int:
        return len(self)


class XsOutputConfiguration:
    def __init__(self, data_identifier: int, frequency: int) -> None:
        self.m_dataIdentifier, self.m_frequency = data_identifier, frequency


class XsOutputConfigurationArray(list):
    def push_back(self, item: XsOutputConfiguration) -> None:  # noqa: N802
        self.append(item)

    def size(self) -> int:
        return len(self)


class XsCallback:
    """Base class: XDA calls these on its own thread; subclasses override what they need."""

    def onLiveDataAvailable(self, dev: Any, packet: Any) -> None:  # noqa: N802
        pass

    def onConnectivityChanged(self, dev: Any, new_state: int) -> None:  # noqa: N802
        pass


class XsDataPacket:
    """One MTData2 message; the accessors XDA offers for the outputs rigstate configures."""

    def __init__(self, payload: bytes) -> None:
        self._v = {f.name: f.value for f in decode_mtdata2(payload)[0]}

    def containsPacketCounter(self) -> bool:  # noqa: N802
        return "PacketCounter" in self._v

    def packetCounter(self) -> int:  # noqa: N802
        return int(self._v["PacketCounter"])

    def containsSampleTimeFine(self) -> bool:  # noqa: N802
        return "SampleTimeFine" in self._v

    def sampleTimeFine(self) -> int:  # noqa: N802
        return int(self._v["SampleTimeFine"])

    def containsCalibratedGyroscopeData(self) -> bool:  # noqa: N802
        return "RateOfTurn" in self._v

    def calibratedGyroscopeData(self) -> tuple[float, ...]:  # noqa: N802
        return tuple(self._v["RateOfTurn"])

    def containsCalibratedAcceleration(self) -> bool:  # noqa: N802
        return "Acceleration" in self._v

    def calibratedAcceleration(self) -> tuple[float, ...]:  # noqa: N802
        return tuple(self._v["Acceleration"])

    def containsOrientation(self) -> bool:  # noqa: N802
        return "Quaternion" in self._v

    def orientationQuaternion(self) -> tuple[float, ...]:  # noqa: N802
        return tuple(self._v["Quaternion"])

    def containsStatus(self) -> bool:  # noqa: N802
        return "StatusWord" in self._v or "StatusByte" in self._v

    def status(self) -> int:
        return int(self._v.get("StatusWord", self._v.get("StatusByte", 0)))


class _Link:
    """An open port: a reader thread parses Xbus; answers go to :meth:`request`, MTData2 to the device."""

    def __init__(self, name: str) -> None:
        self.ser = serial.serial_for_url(name, baudrate=115200, timeout=0.05)
        self.replies: queue.Queue[Message] = queue.Queue()
        self.on_data = lambda payload: None
        self.on_lost = lambda: None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, name="xda-standin", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        parser = XbusParser()
        while not self._stop.is_set():
            try:
                data = self.ser.read(self.ser.in_waiting or 1)
            except (serial.SerialException, OSError, TypeError):  # TypeError: port closed under us
                if not self._stop.is_set():
                    self.on_lost()
                return
            for msg in parser.feed(data):
                if msg.mid == MID.MTDATA2:
                    self.on_data(msg.payload)
                else:
                    self.replies.put(msg)

    def request(self, mid: int, payload: bytes, answer: int) -> bytes | None:
        """Send a message; the payload of its answer, None on Error or time-out."""
        while not self.replies.empty():
            self.replies.get_nowait()
        try:
            self.ser.write(frame(mid, payload))
        except (serial.SerialException, OSError):
            return None
        while True:
            try:
                msg = self.replies.get(timeout=TIMEOUT_S)
            except queue.Empty:
                return None
            if msg.mid == answer:
                return msg.payload
            if msg.mid == MID.ERROR:
                return None

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.ser.close()


def _device_id(link: _Link) -> int | None:
    if link.request(MID.GOTO_CONFIG, b"", MID.GOTO_CONFIG_ACK) is None:
        return None
    did = link.request(MID.REQ_DID, b"", MID.DEVICE_ID)
    return struct.unpack(">I", did[:4])[0] if did is not None and len(did) >= 4 else None


def XsScanner_scanPort(port_name: str, baudrate: int = XBR_Invalid) -> XsPortInfo:  # noqa: N802
    """The device on ``port_name`` (left in configuration mode), or an empty XsPortInfo."""
    try:
        link = _Link(port_name)
    except (serial.SerialException, OSError):
        return XsPortInfo()
    try:
        did = _device_id(link)
    finally:
        link.close()
    return XsPortInfo(port_name, XBR_115k2, did) if did is not None else XsPortInfo()


def XsScanner_scanPorts(baudrate: int = XBR_Invalid, singleScanTimeout: int = 100,  # noqa: N802,N803
                        ignoreNonXsensDevices: bool = True, detectRs485: bool = False) -> XsPortInfoArray:  # noqa: N803
    found = XsPortInfoArray()
    for name in filter(None, os.environ.get(PORTS_ENV, "").split(os.pathsep)):
        info = XsScanner_scanPort(name, baudrate)
        if not info.empty():
            found.append(info)
    return found


class XsDevice:
    def __init__(self, link: _Link, device_id: int, product_code: str, firmware: XsVersion) -> None:
        self._link, self._id, self._code, self._fw = link, XsDeviceId(device_id), product_code, firmware
        self._handlers: list[XsCallback] = []
        self._lock = threading.Lock()
        self._measuring = False
        link.on_data = self._data
        link.on_lost = self._lost

    def deviceId(self) -> XsDeviceId:  # noqa: N802
        return self._id

    def productCode(self) -> str:  # noqa: N802
        return self._code

    def firmwareVersion(self) -> XsVersion:  # noqa: N802
        return self._fw

    def addCallbackHandler(self, handler: XsCallback) -> None:  # noqa: N802
        with self._lock:
            self._handlers.append(handler)

    def removeCallbackHandler(self, handler: XsCallback) -> None:  # noqa: N802
        with self._lock:
            if handler in self._handlers:
                self._handlers.remove(handler)

    def gotoConfig(self) -> bool:  # noqa: N802
        self._measuring = False
        return self._link.request(MID.GOTO_CONFIG, b"", MID.GOTO_CONFIG_ACK) is not None

    def setOutputConfiguration(self, config: XsOutputConfigurationArray) -> bool:  # noqa: N802
        payload = b"".join(struct.pack(">HH", c.m_dataIdentifier, c.m_frequency) for c in config)
        return self._link.request(MID.SET_OUTPUT_CONFIGURATION, payload, MID.OUTPUT_CONFIGURATION) is not None

    def gotoMeasurement(self) -> bool:  # noqa: N802
        self._measuring = True  # the device streams right after its acknowledgement
        self._measuring = self._link.request(MID.GOTO_MEASUREMENT, b"", MID.GOTO_MEASUREMENT_ACK) is not None
        return self._measuring

    def isMeasuring(self) -> bool:  # noqa: N802
        return self._measuring

    def _callbacks(self) -> list[XsCallback]:
        with self._lock:
            return list(self._handlers)

    def _data(self, payload: bytes) -> None:
        if self._measuring:
            packet = XsDataPacket(payload)
            for h in self._callbacks():
                h.onLiveDataAvailable(self, packet)

    def _lost(self) -> None:
        self._measuring = False
        for h in self._callbacks():
            h.onConnectivityChanged(self, XCS_Disconnected)


class XsControl:
    def __init__(self) -> None:
        self._open: dict[str, XsDevice] = {}

    def openPort(self, port_name: str, baudrate: int) -> bool:  # noqa: N802
        try:
            link = _Link(port_name)
        except (serial.SerialException, OSError):
            return False
        did = _device_id(link)
        code = link.request(MID.REQ_PRODUCT_CODE, b"", MID.PRODUCT_CODE)
        fw = link.request(MID.REQ_FW_REV, b"", MID.FIRMWARE_REV)
        if did is None or code is None or fw is None:
            link.close()
            return False
        self._open[port_name] = XsDevice(link, did, code.decode("ascii", "replace").strip(), XsVersion(*fw[:3]))
        return True

    def device(self, device_id: XsDeviceId) -> XsDevice | None:
        return next((d for d in self._open.values() if d.deviceId() == device_id), None)

    def closePort(self, port_name: str) -> None:  # noqa: N802
        dev = self._open.pop(port_name, None)
        if dev is not None:
            dev._link.close()

    def close(self) -> None:
        for name in list(self._open):
            self.closePort(name)

    def destruct(self) -> None:
        self.close()


def XsControl_construct() -> XsControl:  # noqa: N802
    return XsControl()

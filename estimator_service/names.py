"""Names that come from outside (bus topics, sensor and rig names, log headers): one home for their rules.

* :func:`check_topic` — a bus topic is 1..``MAX_TOPIC`` characters of ``A-Z a-z 0-9 _ . - /``
  (so it is safe in a terminal, a file name and a CSV cell); the bus drops and counts any other.
* :func:`check_name` — a sensor name (``imu/<name>``, ``enc/<name>``): the same characters without ``/``.
* :func:`printable` — any text as safe terminal text: control and other non-printable characters
  (escape sequences, NUL, bidi overrides) are shown as ``\\xNN`` / ``\\uNNNN``.
* :func:`file_stem` — any name as one file-name component that cannot leave its directory.
"""

from __future__ import annotations

import re

MAX_TOPIC = 128  #: characters
MAX_NAME = 64  #: characters of a sensor name
MAX_STEM = 100  #: characters of a file-name stem made by :func:`file_stem`

_TOPIC = re.compile(r"[A-Za-z0-9_.\-/]+")
_NAME = re.compile(r"[A-Za-z0-9_.\-]+")
_UNSAFE_IN_FILE = re.compile(r"[^A-Za-z0-9_.\-]")


def topic_problem(topic: str) -> str | None:
    """Why ``topic`` is not a valid bus topic, or None if it is."""
    if not topic:
        return "empty topic"
    if len(topic) > MAX_TOPIC:
        return f"topic longer than {MAX_TOPIC} characters"
    if not _TOPIC.fullmatch(topic):
        return f"topic {topic!r} has characters other than A-Z a-z 0-9 _ . - /"  # repr: escaped
    return None


def check_topic(topic: str) -> bool:
    """True if ``topic`` is a valid bus topic (see the module docstring)."""
    return topic_problem(topic) is None


def name_problem(name: str) -> str | None:
    """Why ``name`` cannot be a sensor name (the ``<name>`` of ``imu/<name>``), or None."""
    if not name or len(name) > MAX_NAME or not _NAME.fullmatch(name):
        return f"expected 1 to {MAX_NAME} characters of A-Z a-z 0-9 _ . -, got {name!r}"
    return None


def printable(text: str) -> str:
    """``text`` with every non-printable character escaped (``\\x1b`` -> ``\\x1b`` as four characters)."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)


def file_stem(name: str) -> str:
    """``name`` as a single, harmless file-name component (at most ``MAX_STEM`` characters).

    Every character outside ``A-Z a-z 0-9 _ . -`` becomes ``_`` (so no ``/`` and no NUL), and a
    leading ``.`` becomes ``_`` (no ``..``, no hidden files): ``"../x"`` -> ``"_._x"``.
    """
    stem = _UNSAFE_IN_FILE.sub("_", name)[:MAX_STEM]
    if stem.startswith("."):
        stem = "_" + stem[1:]
    return stem or "_"

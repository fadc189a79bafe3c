"""Where rigstate finds its shipped configuration files and systemd units, and makes its output folders.

The repository keeps them in the top-level ``config/`` and ``systemd/`` folders; setup.py installs
them as the package data ``estimator_service.config`` / ``estimator_service.systemd``, so an
editable install, a wheel and ``pip install .`` all find them here, from any working directory.
"""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path

from estimator_service.errors import UserError


def _package_dir(name: str) -> Path:
    """Directory of the data package ``estimator_service.<name>``; in a source tree that is run
    without installing it (``python -m estimator_service.cli`` from a clone), the top-level ``<name>/``."""
    try:
        return Path(str(resources.files(f"estimator_service.{name}")))
    except ModuleNotFoundError:
        source = Path(__file__).resolve().parent.parent / name
        if source.is_dir():
            return source
        raise


def config_dir() -> Path:
    """Directory holding ``mechanisms/`` and ``rigs/``; ``$RIGSTATE_CONFIG_DIR`` wins."""
    env = os.environ.get("RIGSTATE_CONFIG_DIR")
    if env:
        return Path(env)
    return _package_dir("config")


def systemd_dir() -> Path:
    """Directory holding the systemd unit files and ``examples/*.env``."""
    return _package_dir("systemd")


def default_rig() -> Path:
    """The shipped Sensors-2016 testbed rig used by the demo and the bench."""
    return config_dir() / "rigs" / "fourbar-sensors2016.toml"


def make_output_dir(out: Path) -> Path:
    """Create the output folder ``out`` (and its parents) if needed; UserError naming it if that fails."""
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"{out}: cannot create the output directory: {exc.strerror}") from None
    return out

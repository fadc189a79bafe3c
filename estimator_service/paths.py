"""Where rigstate finds its shipped configuration files."""

from __future__ import annotations

import os
from pathlib import Path


def config_dir() -> Path:
    """Directory holding ``mechanisms/`` and ``rigs/``.

    ``$RIGSTATE_CONFIG_DIR`` wins; otherwise the ``config/`` folder of the source
    tree (the package is installed editable, see the README).
    """
    env = os.environ.get("RIGSTATE_CONFIG_DIR")
    if env:
        return Path(env)
    return Path(__file__).resolve().parent.parent / "config"


def default_rig() -> Path:
    """The shipped Sensors-2016 testbed rig used by the demo and the bench."""
    return config_dir() / "rigs" / "fourbar-sensors2016.toml"

"""Ship the top-level ``config/`` and ``systemd/`` folders inside the package.

The repository layout keeps them at the top level; an installed rigstate (wheel or ``pip install .``)
finds them as the package data ``estimator_service.config`` and ``estimator_service.systemd``
(see estimator_service/paths.py).  Everything else is in pyproject.toml.
"""

from setuptools import find_packages, setup

DATA_PACKAGES = {
    "estimator_service.config": "config",
    "estimator_service.systemd": "systemd",
}

setup(
    packages=find_packages(include=["estimator_service*", "drivers*"]) + sorted(DATA_PACKAGES),
    package_dir=DATA_PACKAGES,
    package_data={
        "estimator_service.config": ["mechanisms/*.yaml", "mechanisms/README.md", "mechanisms/LICENSE-*",
                                     "rigs/*.toml", "rigs/scenarios/*.toml", "rigs/scaling/*.toml",
                                     "maps/*.toml"],
        "estimator_service.systemd": ["*.service", "*.target", "README.md", "examples/*.env"],
    },
)

"""Estimation backends behind one interface (see base.Backend): ekf, ukf, fgs, errekf."""

from __future__ import annotations

import importlib

from estimator_service.backends.base import Backend

#: backend name -> "module:class" (imported on use, so gtsam loads only for the smoother)
REGISTRY = {
    "ekf": "estimator_service.backends.ekf:ExtendedKalmanFilter",
    "ukf": "estimator_service.backends.ukf:UnscentedKalmanFilter",
    "fgs": "estimator_service.backends.fgs:make_smoother",
    "errekf": "estimator_service.backends.errekf:ErrorStateKalmanFilter",
}


def make_backend(name: str, model, sensors: list, config) -> Backend:
    """Instantiate backend ``name`` for a model, its fused sensors and the rig's EstimatorConfig."""
    if name not in REGISTRY:
        raise ValueError(f"unknown backend {name!r}; backends are {sorted(REGISTRY)}")
    module, cls = REGISTRY[name].split(":")
    return getattr(importlib.import_module(module), cls)(model, sensors, config)

"""Shipped mechanisms and rigs, installed as the package data ``estimator_service.config`` (see setup.py)."""

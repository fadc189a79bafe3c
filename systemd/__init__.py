"""systemd units and example env files, installed as the package data ``estimator_service.systemd`` (see setup.py)."""

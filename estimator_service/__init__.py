"""rigstate estimator service: multibody model, estimation backends, bus, daemon and logs."""

__version__ = "0.1.0"

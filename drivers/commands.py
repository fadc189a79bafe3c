"""The ``rigstate driver``, ``rigstate xbus`` and ``rigstate xsens`` commands: every sensor source, one schema.

``driver sim`` (simulated streams), ``driver encoder`` (quadrature encoders) and ``driver xsens``
(Xsens MTi over Xbus) each register their own subparser.
"""

from __future__ import annotations

import argparse

from drivers import sim
from drivers.encoders import cli as encoder_cli
from drivers.xsens import cli as xsens_cli


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("driver", help="sensor drivers: publish sensor messages on the bus",
                       description="Sensor drivers; each publishes one message schema on the bus.")
    dsub = p.add_subparsers(dest="driver", metavar="DRIVER")
    dsub.required = True
    sim.register(dsub)
    encoder_cli.register(dsub)
    xsens_cli.register_driver(dsub)
    xsens_cli.register_xbus(sub)
    xsens_cli.register_xsens(sub)

"""The ``rigstate`` console command: one entry point, one module per subcommand."""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import logging
import sys

from estimator_service.errors import UserError
from estimator_service.names import printable

#: subcommand → the module that registers it (``register``), in the order shown by ``rigstate --help``.  A
#: process imports only its own command's module (:func:`build_parser`): a driver or the recorder starts
#: without numba, gtsam or scipy's signal processing.
COMMANDS: dict[str, str] = {
    "demo": "estimator_service.commands.demo",
    "model": "estimator_service.commands.model",
    "config": "estimator_service.commands.config",
    "simulate": "estimator_service.commands.simulate",
    "estimate": "estimator_service.commands.estimate",
    "report": "estimator_service.commands.report",
    "validate-kinematics": "estimator_service.commands.validate_kinematics",
    "calibrate": "estimator_service.commands.calibrate",
    "evaluate": "estimator_service.commands.evaluate",
    "identify": "estimator_service.commands.identify",
    "bench": "estimator_service.commands.bench",
    "estimator": "estimator_service.commands.estimator",
    "record": "estimator_service.commands.record",
    "replay": "estimator_service.commands.replay",
    "watch": "estimator_service.commands.watch",
    "service": "estimator_service.commands.service",
    "log": "estimator_service.commands.log",
    "foxglove": "estimator_service.commands.foxglove",
    "keys": "estimator_service.commands.keys",
    "inverse-dynamics": "estimator_service.commands.inverse_dynamics",
    "driver": "drivers.commands",
    "xbus": "drivers.commands",
    "xsens": "drivers.commands",
}


def installed_version() -> str:
    """The version of the installed ``rigstate`` distribution (package metadata)."""
    try:
        return importlib.metadata.version("rigstate")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed; run pip install .)"


def command_of(argv: list[str]) -> str | None:
    """The subcommand named by a command line (after the global options), or None (none, unknown, or help)."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--log-level")
    _, rest = pre.parse_known_args(argv)
    return rest[0] if rest and rest[0] in COMMANDS else None


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The whole command line's parser; with ``only``, just that subcommand's (:data:`COMMANDS`), the others'
    modules not imported."""
    parser = argparse.ArgumentParser(
        prog="rigstate",
        description="Real-time state estimation for instrumented mechanisms.",
    )
    parser.add_argument("--version", action="version", version=f"rigstate {installed_version()}")
    parser.add_argument(
        "--log-level",
        default="INFO",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="verbosity of the messages written to stderr (default INFO)",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for module in dict.fromkeys(COMMANDS.values()) if only is None else (COMMANDS[only],):
        importlib.import_module(module).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(command_of(argv)).parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, args.log_level),
        format="%(asctime)s %(name)s %(levelname)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except UserError as exc:
        text = "\n".join(printable(line) for line in str(exc).split("\n"))  # file names, values: no escape codes
        print(f"rigstate: error: {text}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

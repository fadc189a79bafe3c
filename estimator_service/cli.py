"""The ``rigstate`` console command: one entry point, one module per subcommand."""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import logging
import sys

from estimator_service.errors import UserError
from estimator_service.names import printable

# (module, ...) in the order shown by ``rigstate --help``.  Each module has ``register``.
COMMAND_MODULES: tuple[str, ...] = (
    "estimator_service.commands.demo",
    "estimator_service.commands.model",
    "estimator_service.commands.config",
    "estimator_service.commands.simulate",
    "estimator_service.commands.estimate",
    "estimator_service.commands.report",
    "estimator_service.commands.validate_kinematics",
    "estimator_service.commands.evaluate",
    "estimator_service.commands.identify",
    "estimator_service.commands.bench",
    "estimator_service.commands.estimator",
    "estimator_service.commands.record",
    "estimator_service.commands.replay",
    "estimator_service.commands.watch",
    "estimator_service.commands.service",
    "estimator_service.commands.log",
    "estimator_service.commands.foxglove",
    "estimator_service.commands.keys",
    "estimator_service.commands.inverse_dynamics",
    "drivers.commands",
)


def installed_version() -> str:
    """The version of the installed ``rigstate`` distribution (package metadata)."""
    try:
        return importlib.metadata.version("rigstate")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed; run pip install .)"


def build_parser() -> argparse.ArgumentParser:
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
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
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

"""Subcommands of the ``rigstate`` console command, one module per command.

Each module exposes ``register(subparsers)`` which adds its parser and sets
``func`` (a callable taking the parsed ``argparse.Namespace`` and returning an
exit code).
"""

"""``rigstate service install``: install the systemd units and example configuration.

Copies ``systemd/*.service`` and ``rigstate.target`` to ``<root>/etc/systemd/system`` (their
``ExecStart=`` pointing at this installation's ``rigstate``), and the shipped rig TOMLs,
mechanism YAMLs and example driver env files to ``<root>/etc/rigstate/{rigs,mechanisms,}``.
Configuration files that already exist are never overwritten; unit files are replaced (local
changes belong in drop-ins: ``systemctl edit <unit>``).  Prints the ``systemctl`` commands to run.
``--root DIR`` installs below DIR (packaging, tests); ``--dry-run`` only prints.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from estimator_service.errors import UserError
from estimator_service.paths import config_dir, systemd_dir

UNIT_DIR = "etc/systemd/system"
CONFIG_DIR = "etc/rigstate"
UNIT_BINARY = "/usr/local/bin/rigstate"  #: the ExecStart binary written in systemd/*.service


@dataclass(frozen=True)
class Action:
    """One file to install: ``kind`` is ``unit`` (replaced) or ``config`` (kept if present)."""

    kind: str
    source: Path
    target: Path
    text: str


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("service", help="systemd integration: install unit files and /etc/rigstate configs",
                       description="systemd integration (see docs/operations.md).")
    ssub = p.add_subparsers(dest="service_command", metavar="ACTION")
    ssub.required = True
    i = ssub.add_parser(
        "install", help="install units to /etc/systemd/system and example configs to /etc/rigstate",
        description="Install the rigstate systemd units and example configuration (existing configuration "
        "files are kept), then print the systemctl commands to run.")
    i.add_argument("--root", default="/", help="install below this directory (default /)")
    i.add_argument("--dry-run", action="store_true", help="print what would be done, change nothing")
    i.add_argument("--bin", help="rigstate executable for ExecStart= (default: the one on PATH)")
    i.set_defaults(func=run_install)


def rigstate_binary() -> str:
    """Absolute path of the ``rigstate`` executable of this installation."""
    found = shutil.which("rigstate")
    if found:
        return str(Path(found).resolve())
    candidate = Path(sys.executable).parent / "rigstate"
    return str(candidate) if candidate.exists() else UNIT_BINARY


def plan(root: Path, binary: str) -> list[Action]:
    """Every file the installation writes, with its final text."""
    systemd, config = systemd_dir(), config_dir()
    if not systemd.is_dir() or not config.is_dir():
        raise UserError(f"{systemd} / {config}: shipped units or configs missing; reinstall rigstate")
    actions = [Action("unit", f, root / UNIT_DIR / f.name, f.read_text().replace(UNIT_BINARY, binary))
               for f in sorted(systemd.glob("*.service")) + sorted(systemd.glob("*.target"))]
    for sub, pattern in (("rigs", "*.toml"), ("mechanisms", "*.yaml")):
        actions += [Action("config", f, root / CONFIG_DIR / sub / f.name, f.read_text())
                    for f in sorted((config / sub).glob(pattern))]
    actions += [Action("config", f, root / CONFIG_DIR / f.name, f.read_text())
                for f in sorted((systemd / "examples").glob("*.env"))]
    return actions


def _warn_hidden_paths(binary: str) -> list[str]:
    """Paths the units cannot reach under ProtectHome=yes."""
    hidden = ("/home/", "/root/", "/run/user/")
    return [f"warning: {what} {p} is under a directory the units hide (ProtectHome=yes); install rigstate "
            f"system-wide (e.g. a venv in /opt/rigstate) or relax ProtectHome in a drop-in"
            for what, p in (("executable", binary), ("package", str(Path(__file__).resolve().parents[1]))) if p.startswith(hidden)]


def run_install(args: argparse.Namespace) -> int:
    root = Path(args.root)
    if not root.is_dir():
        raise UserError(f"--root: {root} is not a directory")
    binary = args.bin or rigstate_binary()
    if not Path(binary).is_absolute():
        raise UserError(f"--bin: ExecStart needs an absolute path, got {binary!r}")
    for a in plan(root, binary):
        if a.target.exists() and a.kind == "config":
            print(f"{'kept':14s} {a.target} (exists)")
            continue
        if a.target.exists() and a.target.read_text() == a.text:
            print(f"{'unchanged':14s} {a.target}")
            continue
        state = "update" if a.target.exists() else "install"
        print(f"{'would ' + state if args.dry_run else state.rstrip('e') + 'ed':14s} {a.target}")
        if not args.dry_run:
            try:
                a.target.parent.mkdir(parents=True, exist_ok=True)
                a.target.write_text(a.text)
            except OSError as exc:
                raise UserError(f"{a.target}: cannot write: {exc.strerror} (run as root, or use --root)") from None
    for w in _warn_hidden_paths(binary):
        print(w)
    print("""
Next steps (as root; instance names: rig = file name in /etc/rigstate/rigs without .toml,
sensor/board = the NAME in /etc/rigstate/xsens-<sensor>.env, encoder-<board>.env):
  systemctl daemon-reload
  systemctl enable rigstate-driver-xsens@coupler rigstate-driver-xsens@rocker rigstate-driver-encoder@board0
  systemctl enable rigstate-estimator@fourbar-sensors2016 rigstate-record@fourbar-sensors2016
  systemctl enable --now rigstate.target
  journalctl -u 'rigstate-*' -f              # logs;  systemctl status 'rigstate-*'   # STATUS= lines
Without hardware: systemctl enable rigstate-driver-sim@fourbar-sensors2016 (instead of the drivers).""")
    return 0

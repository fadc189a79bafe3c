"""``rigstate keys generate``: CURVE key pairs for an authenticated bus (``[bus.auth]``, docs/config.md).

Writes ZeroMQ certificate files (the format of ``zmq.auth.create_certificates``): ``NAME.key``
(public key) and ``NAME.key_secret`` (public and secret key, mode 0600).  Without ``--client`` it
creates the rig's server pair ``server`` and a first client pair ``client``; every client's public
key is also put into ``clients/`` (the ``allowed_clients`` directory the publishers accept).
``--client NAME`` adds one more client (say a laptop running ``rigstate watch``).  Existing files
are never overwritten, and no file is written through a symbolic link.
"""

from __future__ import annotations

import argparse
import os
from datetime import datetime, UTC
from pathlib import Path

import zmq

from estimator_service.errors import UserError
from estimator_service.names import name_problem

ALLOWED_DIR = "clients"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("keys", help="CURVE keys for an authenticated bus ([bus.auth])",
                       description="Key management for the authenticated bus.")
    ksub = p.add_subparsers(dest="keys_command", metavar="SUBCOMMAND")
    ksub.required = True
    g = ksub.add_parser("generate", help="write server and client key pairs (secret files mode 0600)",
                        description="Without --client: the server pair 'server' and a client pair 'client'. "
                        "With --client NAME: one more client pair, its public key allowed in DIR/clients/.")
    g.add_argument("dir", help="key directory (created with mode 0700; default place: keys/ next to the rig TOML)")
    g.add_argument("--client", metavar="NAME", help="add a client key pair NAME instead of the server + client pair")
    g.set_defaults(func=run)


def _certificate(public: bytes, secret: bytes | None) -> bytes:
    """A zmq certificate file's bytes (read by ``zmq.auth.load_certificate``)."""
    kind = "Secret" if secret is not None else "Public"
    lines = [f"#   ****  Generated on {datetime.now(UTC):%Y-%m-%d %H:%M:%S} UTC by rigstate keys generate  ****",
             f"#   ZeroMQ CURVE {kind} Certificate"]
    if secret is not None:
        lines.append("#   DO NOT PROVIDE THIS FILE TO OTHER USERS nor change its permissions.")
    lines += ["", "metadata", "curve", f'    public-key = "{public.decode()}"']
    if secret is not None:
        lines.append(f'    secret-key = "{secret.decode()}"')
    return ("\n".join(lines) + "\n").encode()


def _write_new(path: Path, data: bytes, mode: int) -> None:
    """Create ``path`` with ``mode`` (never overwrite, never through a symlink); UserError otherwise."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
    except FileExistsError:
        raise UserError(f"{path}: already exists; refusing to overwrite a key") from None
    except OSError as exc:
        raise UserError(f"{path}: cannot create: {exc.strerror}") from None
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(path, mode)  # whatever the umask


def write_keypair(directory: Path, name: str) -> tuple[Path, Path]:
    """Write ``NAME.key`` (0644) and ``NAME.key_secret`` (0600) in ``directory``; returns their paths."""
    public, secret = zmq.curve_keypair()
    pub_path, sec_path = directory / f"{name}.key", directory / f"{name}.key_secret"
    for p in (pub_path, sec_path):
        if os.path.lexists(p):
            raise UserError(f"{p}: already exists; refusing to overwrite a key")
    _write_new(sec_path, _certificate(public, secret), 0o600)
    _write_new(pub_path, _certificate(public, None), 0o644)
    return pub_path, sec_path


def _mkdir(path: Path) -> None:
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"{path}: cannot create the key directory: {exc.strerror}") from None
    if path.is_symlink() or not path.is_dir():
        raise UserError(f"{path}: not a directory")


def generate(directory: Path, client: str | None = None) -> list[Path]:
    """The files ``rigstate keys generate`` writes (see the module docstring); returns them."""
    _mkdir(directory)
    _mkdir(directory / ALLOWED_DIR)
    written: list[Path] = []
    names = [client] if client is not None else ["server", "client"]
    for name in names:
        pub, sec = write_keypair(directory, name)
        written += [pub, sec]
        if name != "server" or client is not None:
            allowed = directory / ALLOWED_DIR / pub.name
            _write_new(allowed, pub.read_bytes(), 0o644)
            written.append(allowed)
    return written


def run(args: argparse.Namespace) -> int:
    if args.client is not None:
        problem = name_problem(args.client)
        if problem is not None or args.client == "server":
            raise UserError(f"--client: {problem or 'the name server is the server key pair'}")
    directory = Path(args.dir)
    for path in generate(directory, args.client):
        try:
            mode = path.stat().st_mode & 0o777
        except OSError as exc:
            raise UserError(f"{path}: {exc.strerror}") from None
        print(f"{path}  (mode {mode:o})")
    if args.client is None:
        print(f"\nIn the rig TOML (paths there are relative to the TOML file's directory):\n\n[bus.auth]\n"
              f'server_key = "{directory / "server.key"}"\nserver_secret_key = "{directory / "server.key_secret"}"\n'
              f'client_secret_key = "{directory / "client.key_secret"}"\nallowed_clients = "{directory / ALLOWED_DIR}"')
    else:
        print(f"\nOn the host of client {args.client!r}: client_secret_key = \"{directory / (args.client + '.key_secret')}\" "
              "and the server public key server.key; restart the publishers to allow the new key.")
    return 0

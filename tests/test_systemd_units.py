"""The systemd units: required settings, ExecStart lines that the CLI accepts, installation."""

from __future__ import annotations

import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from estimator_service.cli import build_parser, main
from estimator_service.commands.service import UNIT_BINARY
from estimator_service.rig import load_rig

from helpers import subcommands

SYSTEMD = Path(__file__).resolve().parents[1] / "systemd"
UNITS = sorted(SYSTEMD.glob("*.service"))
RIG_NAME = "fourbar-sensors2016"
# instance and example env file of each template
INSTANCES = {
    "rigstate-estimator@.service": (RIG_NAME, None),
    "rigstate-record@.service": (RIG_NAME, None),
    "rigstate-driver-sim@.service": (RIG_NAME, None),
    "rigstate-driver-xsens@.service": ("coupler", "xsens-coupler.env"),
    "rigstate-driver-encoder@.service": ("board0", "encoder-board0.env"),
}


def parse_unit(text: str) -> dict[str, dict[str, list[str]]]:
    """[section] -> key -> values (keys may repeat), as systemd reads them (no line continuations used)."""
    out: dict[str, dict[str, list[str]]] = {}
    section = None
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("["):
            section = line.strip("[]")
            out.setdefault(section, {})
            continue
        assert section is not None and "=" in line, f"bad line {raw!r}"
        key, _, value = line.partition("=")
        out[section].setdefault(key.strip(), []).append(value.strip())
    return out


def parse_env(path: Path) -> dict[str, str]:
    env = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            k, _, v = line.partition("=")
            env[k.strip()] = v.strip()
    return env


def expand(exec_start: str, instance: str, env: dict[str, str]) -> list[str]:
    """systemd's expansion: %i, ${VAR} (one word), $VAR (split on whitespace, unset: nothing)."""
    argv = []
    for word in shlex.split(exec_start.replace("%i", instance)):
        if word.startswith("$") and not word.startswith("${"):
            argv += env.get(word[1:], "").split()
            continue
        for k, v in env.items():
            word = word.replace("${" + k + "}", v)
        assert "${" not in word, f"unset variable in {word!r}"
        argv.append(word)
    return argv


def test_every_template_has_an_instance_and_the_target_exists():
    assert {u.name for u in UNITS} == set(INSTANCES)
    target = parse_unit((SYSTEMD / "rigstate.target").read_text())
    assert target["Install"]["WantedBy"] == ["multi-user.target"]


@pytest.mark.parametrize("unit", UNITS, ids=lambda p: p.name)
def test_required_settings(unit):
    u = parse_unit(unit.read_text())
    svc = u["Service"]
    required = {"Type": "notify", "NotifyAccess": "main", "WatchdogSec": "5", "Restart": "on-failure",
                "RestartSec": "1", "TimeoutStopSec": "5", "NoNewPrivileges": "yes", "ProtectSystem": "strict",
                "DynamicUser": "yes", "User": "rigstate"}
    for key, value in required.items():
        assert svc.get(key) == [value], f"{unit.name}: {key}"
    assert u["Unit"]["PartOf"] == ["rigstate.target"]
    assert u["Install"]["WantedBy"] == ["rigstate.target"]
    (exec_start,) = svc["ExecStart"]
    assert exec_start.startswith(UNIT_BINARY + " ")
    if "xsens" in unit.name or "encoder" in unit.name:
        assert "dialout" in svc["SupplementaryGroups"][0].split()
        assert "char-ttyUSB rw" in svc["DeviceAllow"] and svc["DevicePolicy"] == ["closed"]
        assert "PrivateDevices" not in svc
    else:
        assert svc["PrivateDevices"] == ["yes"]
    if "record" in unit.name:
        assert svc["StateDirectory"] == ["rigstate"] and "--out-dir /var/lib/rigstate" in exec_start
    if "estimator" in unit.name:  # numba's cache of the compiled kernels is writable under ProtectSystem=strict
        assert svc["CacheDirectory"] == ["rigstate"]
        assert "NUMBA_CACHE_DIR=/var/cache/rigstate/numba" in " ".join(svc["Environment"]).split()


def test_exec_start_lines_parse_with_the_cli(tmp_path):
    """Every ExecStart (after systemd's expansion) is accepted by the subcommands that exist."""
    parser = build_parser()
    commands = subcommands(parser)
    checked = []
    for unit in UNITS:
        instance, env_file = INSTANCES[unit.name]
        env = {"RIGSTATE_OPTS": "--log-level WARNING", **(parse_env(SYSTEMD / "examples" / env_file) if env_file else {})}
        full = expand(parse_unit(unit.read_text())["Service"]["ExecStart"][0], instance, env)[1:]
        assert full[:2] == ["--log-level", "WARNING"]
        argv = full[2:]
        sub = commands.get(argv[0])
        if sub is None or (argv[0] == "driver" and argv[1] not in subcommands(sub)):
            continue  # a driver not written yet (e.g. xsens)
        args = parser.parse_args(full)
        assert callable(args.func) and args.log_level == "WARNING"
        if getattr(args, "config", None):
            assert args.config in (f"/etc/rigstate/rigs/{RIG_NAME}.toml", env.get("CONFIG"))
        checked.append(" ".join(argv[:2]))
    assert {"estimator --config", "record --config", "driver sim", "driver encoder"} <= set(checked)


def _install(root: Path, *extra: str, capsys=None) -> str:
    assert main(["service", "install", "--root", str(root), "--bin", "/opt/rigstate/bin/rigstate", *extra]) == 0
    return capsys.readouterr().out if capsys else ""


def test_install_into_a_root_keeps_existing_configs(tmp_path, capsys):
    root = tmp_path / "root"
    root.mkdir()
    out = _install(root, "--dry-run", capsys=capsys)
    assert "would install" in out and not (root / "etc").exists()

    mine = root / "etc/rigstate/xsens-coupler.env"
    mine.parent.mkdir(parents=True)
    mine.write_text("PORT=/dev/ttyUSB7\nNAME=coupler\nRATE=400\nENDPOINT=tcp://127.0.0.1:5601\n")
    out = _install(root, capsys=capsys)
    assert mine.read_text().startswith("PORT=/dev/ttyUSB7") and f"kept           {mine}" in out
    assert "systemctl daemon-reload" in out and "systemctl enable --now rigstate.target" in out
    units = root / "etc/systemd/system"
    assert sorted(p.name for p in units.iterdir()) == sorted([u.name for u in UNITS] + ["rigstate.target"])
    est = parse_unit((units / "rigstate-estimator@.service").read_text())
    assert est["Service"]["ExecStart"][0].startswith("/opt/rigstate/bin/rigstate $RIGSTATE_OPTS estimator ")
    assert (root / "etc/rigstate/xsens-rocker.env").exists() and (root / "etc/rigstate/encoder-board0.env").exists()
    # the installed rig config loads (its mechanism path resolves inside /etc/rigstate)
    rig = load_rig(root / f"etc/rigstate/rigs/{RIG_NAME}.toml")
    assert rig.name == RIG_NAME

    out = _install(root, capsys=capsys)
    assert "installed" not in out and out.count("unchanged") == len(UNITS) + 1


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_systemd_analyze_verify_finds_no_problems(tmp_path):
    binary = shutil.which("rigstate") or shutil.which("true")
    for unit in [*UNITS, SYSTEMD / "rigstate.target"]:
        name = unit.name.replace("@.", f"@{INSTANCES.get(unit.name, ('x',))[0]}.")
        (tmp_path / name).write_text(unit.read_text().replace(UNIT_BINARY, binary))
    res = subprocess.run(["systemd-analyze", "verify", *sorted(str(p) for p in tmp_path.iterdir())],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stderr.strip() == "", res.stderr

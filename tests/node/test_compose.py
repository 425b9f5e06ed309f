"""docker-compose.yml runs real `tessera` subcommands on config files that exist in deploy/ and load."""

from __future__ import annotations

import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from node.cli.main import build_parser
from node.runtime.config import load_config
from node.sim.layout import sim_identity

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
CONFIG_MOUNT = "/etc/tessera/"
BOOTSTRAP_IP = "172.28.0.10"


def services() -> dict[str, dict]:
    return yaml.safe_load(COMPOSE.read_text(encoding="utf-8"))["services"]


def tessera_argv(service: dict) -> list[str]:
    """The arguments after `tessera` that a service runs (through the image's entrypoint or `sh -c`)."""
    command = service.get("command", [])
    if service.get("entrypoint") == ["sh", "-c"]:
        words = shlex.split(command[0])
        return words[words.index("tessera") + 1:]
    return list(command)


def test_every_service_runs_an_existing_tessera_subcommand() -> None:
    parser = build_parser()
    roles = {}
    for name, service in services().items():
        args = parser.parse_args(tessera_argv(service))  # argparse exits on an unknown subcommand
        assert callable(args.run), name
        roles[name] = args.command
    assert roles["init"] == "spec"
    assert sorted(roles.values()).count("validator") == 2
    assert sorted(roles.values()).count("miner") == 4
    assert roles["bootstrap"] == "bootstrap"


def test_every_config_file_exists_in_deploy_and_loads() -> None:
    loaded = {}
    for name, service in services().items():
        argv = tessera_argv(service)
        if "--config" not in argv:
            continue
        mounted = argv[argv.index("--config") + 1]
        assert mounted.startswith(CONFIG_MOUNT), f"{name}: config {mounted} is outside {CONFIG_MOUNT}"
        path = ROOT / "deploy" / mounted.removeprefix(CONFIG_MOUNT)
        assert path.is_file(), f"{name}: {path} is missing"
        config = load_config(path)
        assert config.node.role == argv[0], f"{name}: config role {config.node.role} but runs {argv[0]}"
        assert "./deploy:/etc/tessera:ro" in service["volumes"]
        loaded[name] = config
    assert len(loaded) == 6
    # Each node keeps its own state and key; the validators use the keys the spec names.
    assert len({c.node.data_dir for c in loaded.values()}) == 6
    assert len({c.node.key for c in loaded.values()}) == 6
    assert {str(loaded[f"validator-{i}"].node.key) for i in range(2)} == {
        "/net/keys/validator-0.key", "/net/keys/validator-1.key"}


def test_configs_name_the_bootstrap_peer_the_bootstrap_service_runs() -> None:
    from node.net.p2p import peer_id_for

    bootstrap = services()["bootstrap"]
    argv = tessera_argv(bootstrap)
    seed = int(argv[argv.index("--sim-key") + 1])
    assert bootstrap["networks"]["tessera"]["ipv4_address"] == BOOTSTRAP_IP
    peer = peer_id_for(sim_identity(seed, "bootstrap", 0).node_id)
    expected = f"/ip4/{BOOTSTRAP_IP}/tcp/{argv[argv.index('--port') + 1]}/p2p/{peer}"
    for path in sorted((ROOT / "deploy").glob("*.toml")):
        assert expected in load_config(path).p2p.bootstrap, path


@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="docker-compose is not installed")
def test_docker_compose_accepts_the_file() -> None:
    result = subprocess.run(["docker-compose", "-f", str(COMPOSE), "config", "-q"], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr

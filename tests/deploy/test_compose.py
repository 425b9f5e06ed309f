"""docker-compose.yml runs real `tessera` subcommands on config files that exist in deploy/ and load;
its init job leaves a whole network or none, even when killed part-way (its script runs here, on a
fake `tessera`); Prometheus scrapes every node, and its alert rules and the Grafana dashboard only use
metrics a node exports; `docker-compose config` accepts the file (the Makefile installs docker-compose)."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from node.cli.main import build_parser
from node.net.network import NetworkStats
from node.runtime.config import load_config
from node.runtime.metrics import NodeMetrics
from node.sim.layout import sim_identity

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
CONFIG_MOUNT = "/etc/tessera/"
BOOTSTRAP_IP = "172.28.0.10"
TESSERA_IMAGE = "tessera-node:latest"


def all_services() -> dict[str, dict]:
    return yaml.safe_load(COMPOSE.read_text(encoding="utf-8"))["services"]


def services() -> dict[str, dict]:
    """The services that run the tessera image."""
    return {name: s for name, s in all_services().items() if s.get("image") == TESSERA_IMAGE}


def tessera_argv(service: dict) -> list[str]:
    """The arguments after `tessera` that a service runs (through the image's entrypoint or `sh -c`)."""
    command = service.get("command", [])
    if service.get("entrypoint") == ["sh", "-c"]:
        lines = [shlex.split(line) for line in command[0].splitlines()]
        words = next(words for words in lines if "tessera" in words)
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
        "/net/network/keys/validator-0.key", "/net/network/keys/validator-1.key"}


# `tessera spec init --sim DIR` as far as the init job can tell: it refuses a non-empty DIR, writes keys,
# data and the spec last, and FAKE_KILL makes it die by SIGKILL before the spec or half-way through it.
FAKE_SPEC_INIT = """#!/bin/sh
while [ $# -gt 0 ]; do if [ "$1" = --sim ]; then dir="$2"; fi; shift; done
if [ -d "$dir" ] && [ -n "$(ls -A "$dir")" ]; then echo "$dir: directory is not empty" >&2; exit 2; fi
mkdir -p "$dir/keys" "$dir/data"
for i in 0 1; do echo key > "$dir/keys/validator-$i.key"; done
echo heldout > "$dir/data/heldout.jsonl"
if [ "${FAKE_KILL:-}" = before-spec ]; then kill -9 $$; fi
echo 'name = "sim-0"' > "$dir/spec.toml"
if [ "${FAKE_KILL:-}" = in-spec ]; then kill -9 $$; fi
echo 'complete = true' >> "$dir/spec.toml"
"""
COMPLETE_SPEC = 'name = "sim-0"\ncomplete = true\n'


def at_volume(path: str, volume: Path) -> str:
    """`path` with the `net` volume's mount point /net replaced by `volume`."""
    return re.sub(r"(?<![\w.$])/net(?!\w)", str(volume), path)


def run_init(volume: Path, fake_bin: Path, kill: str = "") -> subprocess.CompletedProcess[str]:
    """Run the init service's command as its container would, with `volume` as /net."""
    init = services()["init"]
    assert init["entrypoint"] == ["sh", "-c"] and "net:/net" in init["volumes"]
    script, *args = (at_volume(word.replace("$$", "$"), volume) for word in init["command"])  # compose's escape
    env = {**os.environ, "PATH": f"{fake_bin}{os.pathsep}{os.environ['PATH']}", "FAKE_KILL": kill}
    return subprocess.run(["sh", "-c", script, *args], capture_output=True, text=True, env=env, timeout=60)


def network_paths_nodes_read(volume: Path) -> list[Path]:
    """Every file in the `net` volume a node service opens: spec, validator keys, held-out data."""
    paths = []
    for name, service in services().items():
        argv = tessera_argv(service)
        if "--config" in argv:
            node = load_config(ROOT / "deploy" / argv[argv.index("--config") + 1].removeprefix(CONFIG_MOUNT))
            paths += [str(node.node.spec), str(node.node.key)]
            if node.validator.heldout is not None:
                paths.append(str(node.validator.heldout))
        elif name == "bootstrap":
            paths.append(argv[argv.index("--spec") + 1])
    return sorted({Path(at_volume(p, volume)) for p in paths if p.startswith("/net/")})


@pytest.mark.parametrize("kill", ["before-spec", "in-spec"])
def test_an_init_killed_part_way_leaves_no_network_and_the_next_init_writes_it_whole(
        kill: str, tmp_path: Path) -> None:
    fake_bin, volume = tmp_path / "bin", tmp_path / "net"
    fake_bin.mkdir()
    volume.mkdir()
    (fake_bin / "tessera").write_text(FAKE_SPEC_INIT, encoding="utf-8")
    (fake_bin / "tessera").chmod(0o755)
    read = network_paths_nodes_read(volume)
    assert len(read) == 4, read  # the spec, two validator keys, the held-out data

    killed = run_init(volume, fake_bin, kill)
    assert killed.returncode != 0, "the init job reported success for a network it did not finish"
    assert [p for p in read if p.exists()] == [], "a killed init left part of a network where nodes read it"

    again = run_init(volume, fake_bin)
    assert again.returncode == 0, f"a killed init wedged the next one: {again.stderr}"
    assert [p for p in read if not p.exists()] == []
    spec = next(p for p in read if p.name == "spec.toml")
    assert spec.read_text(encoding="utf-8") == COMPLETE_SPEC

    (fake_bin / "tessera").write_text("#!/bin/sh\nexit 99\n", encoding="utf-8")
    assert run_init(volume, fake_bin).returncode == 0, "a restarted stack must keep its network"
    assert spec.read_text(encoding="utf-8") == COMPLETE_SPEC


def test_an_init_refuses_a_volume_of_the_older_layout_and_writes_nothing(tmp_path: Path) -> None:
    """A `net` volume written before /net/network (a spec at its top) is refused: a new network there would run
    on the nodes' state of the old one."""
    fake_bin, volume = tmp_path / "bin", tmp_path / "net"
    fake_bin.mkdir()
    (fake_bin / "tessera").write_text(FAKE_SPEC_INIT, encoding="utf-8")
    (fake_bin / "tessera").chmod(0o755)
    (volume / "keys").mkdir(parents=True)
    (volume / "spec.toml").write_text("name = 'old'\n", encoding="utf-8")
    refused = run_init(volume, fake_bin)
    assert refused.returncode == 1 and "docker-compose down -v" in refused.stderr, refused.stderr
    assert sorted(p.name for p in volume.iterdir()) == ["keys", "spec.toml"]


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


def exported_metric_names() -> set[str]:
    """Every sample name a node's /metrics can hold (counters end in _total, histograms in _bucket...)."""
    metrics = NodeMetrics()
    metrics.bind_network(NetworkStats, lambda: 0)
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
    return {family.name + suffix for family in metrics.registry.collect() for suffix in suffixes[family.type]}


def test_prometheus_scrapes_every_node_on_its_http_port() -> None:
    config = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text(encoding="utf-8"))
    targets = {t for job in config["scrape_configs"] for group in job["static_configs"] for t in group["targets"]}
    expected = set()
    for name, service in services().items():
        argv = tessera_argv(service)
        if "--config" in argv:
            http = load_config(ROOT / "deploy" / argv[argv.index("--config") + 1].removeprefix(CONFIG_MOUNT)).http
            assert http.host == "0.0.0.0", f"{name}: Prometheus cannot reach an API bound to {http.host}"
            expected.add(f"{name}:{http.port}")
    assert targets == expected
    assert config["rule_files"] == ["/etc/prometheus/alerts.yml"]
    prometheus, grafana = all_services()["prometheus"], all_services()["grafana"]
    assert "./deploy/prometheus:/etc/prometheus:ro" in prometheus["volumes"]
    assert {"./deploy/grafana/provisioning:/etc/grafana/provisioning:ro",
            "./deploy/grafana/dashboards:/var/lib/grafana/dashboards:ro"} <= set(grafana["volumes"])
    datasource = yaml.safe_load((ROOT / "deploy/grafana/provisioning/datasources/prometheus.yml").read_text())
    assert datasource["datasources"][0]["url"] == "http://prometheus:9090"


def test_alerts_and_dashboard_use_only_metrics_a_node_exports() -> None:
    exported = exported_metric_names() | {"up"}
    rules = yaml.safe_load((ROOT / "deploy/prometheus/alerts.yml").read_text(encoding="utf-8"))
    alert_exprs = [rule["expr"] for group in rules["groups"] for rule in group["rules"]]
    dashboard = json.loads((ROOT / "deploy/grafana/dashboards/tessera.json").read_text(encoding="utf-8"))
    panel_exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    names = r"\b(?:tessera_\w+|process_\w+|up)\b"
    used = {name for expr in alert_exprs + panel_exprs for name in re.findall(names, expr)}
    assert used <= exported, sorted(used - exported)
    # Everything worth alerting on is on the dashboard.
    for metric in ("tessera_adopted_loss", "tessera_base_loss", "tessera_miner_rank", "tessera_miner_reward",
                   "tessera_train_tokens_per_second", "tessera_eval_seconds_sum", "tessera_phase_overruns_total",
                   "tessera_validator_agreement", "tessera_round_verdicts", "tessera_peers",
                   "tessera_blob_fetches_total", "tessera_clock_behind_seconds", "process_resident_memory_bytes"):
        assert any(metric in expr for expr in panel_exprs), metric
    uids = {t["datasource"]["uid"] for p in dashboard["panels"] for t in p.get("targets", [])}
    assert uids == {datasource_uid()}


def datasource_uid() -> str:
    datasource = yaml.safe_load((ROOT / "deploy/grafana/provisioning/datasources/prometheus.yml").read_text())
    return datasource["datasources"][0]["uid"]


def test_docker_compose_accepts_the_file() -> None:
    assert shutil.which("docker-compose"), "docker-compose is not installed; `make test` installs it with apt"
    result = subprocess.run(["docker-compose", "-f", str(COMPOSE), "config", "-q"], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def test_dockerfile_installs_the_pinned_cpu_torch_before_the_project() -> None:
    """PyPI's Linux wheel of torch is the CUDA build (gigabytes of nvidia-* wheels); this machine's pip finds the
    CPU wheel in /opt/wheels, a fresh image's pip does not, so the Dockerfile names PyTorch's CPU index."""
    pin = next(line for line in (ROOT / "constraints.txt").read_text(encoding="utf-8").splitlines()
               if line.startswith("torch=="))
    text = (ROOT / "Dockerfile").read_text(encoding="utf-8").replace("\\\n", " ")
    installs = [shlex.split(cmd) for line in text.splitlines() if line.startswith("RUN ")
                for cmd in line.removeprefix("RUN ").split("&&") if "pip install" in cmd]
    torch_install, project_install = installs[0], installs[1]
    assert pin in torch_install
    assert "--index-url" in torch_install, "torch would come from PyPI: the CUDA build"
    assert torch_install[torch_install.index("--index-url") + 1] == "https://download.pytorch.org/whl/cpu"
    assert project_install[-3:] == ["-c", "constraints.txt", "."]


def test_dashboard_loss_panel_averages_only_validators_with_a_loss() -> None:
    """A miner's adopted loss is the public one, a round behind a validator's (its next reports are not out
    yet), and a node with no results reads 0: averaging them all gives a loss no state had."""
    dashboard = json.loads((ROOT / "deploy/grafana/dashboards/tessera.json").read_text(encoding="utf-8"))
    panel = next(p for p in dashboard["panels"] if p["title"] == "Held-out loss")
    for target in panel["targets"]:
        assert re.fullmatch(r'avg\(tessera_(adopted|base)_loss\{role="validator"\} > 0\)', target["expr"]), target

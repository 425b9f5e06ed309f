"""`tessera init` for a node that other hosts reach: an existing key (`--key`), the listen address (`--host`), the
address peers dial (`--announce`), the device, a miner's forward model and a validator's general-domain file; each
option a role does not take, and each value that would not work, refused in one line before anything is written."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest

from node.cli.main import main
from node.runtime.config import load_config
from protocol.identity import load_identity, save_identity
from tests.conftest import make_identity, make_spec_dict, to_toml

VALIDATOR = make_identity(0)
MINER = make_identity(100)


def network(tmp_path: Path, general: bool = False) -> dict[str, Path]:
    """A spec whose held-out (and general-domain) files are here, a validator's key and a miner's key."""
    files = {name: tmp_path / "net" / f"{name}.jsonl" for name in ("heldout", "general")}
    files["heldout"].parent.mkdir()
    spec: dict[str, Any] = make_spec_dict()
    for name, path in files.items():
        path.write_text(f'{{"text": "{name} rows"}}\n', encoding="utf-8")
    spec["data"]["heldout_sha256"] = hashlib.sha256(files["heldout"].read_bytes()).hexdigest()
    if general:
        spec["data"]["general_sha256"] = hashlib.sha256(files["general"].read_bytes()).hexdigest()
    files["spec"] = tmp_path / "net" / "spec.toml"
    files["spec"].write_text(to_toml(spec), encoding="utf-8")
    for name, identity in (("val_key", VALIDATOR), ("miner_key", MINER)):
        save_identity(identity, tmp_path / f"{name}.key")
        files[name] = tmp_path / f"{name}.key"
    return files


def test_a_miner_for_other_hosts_points_at_its_key_and_says_where_to_dial_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    files = network(tmp_path)
    node_dir = tmp_path / "miner1"
    assert main(["init", "--role", "miner", "--spec", str(files["spec"]), "--dir", str(node_dir),
                 "--key", str(files["miner_key"]), "--host", "0.0.0.0", "--p2p-port", "4101",
                 "--announce", "/ip4/203.0.113.7/tcp/5101", "--announce", "/dns4/miner.example.org/tcp/5101",
                 "--device", "cuda:1", "--forward", "compressed"]) == 0
    path, node_id = capsys.readouterr().out.split()
    assert Path(path) == node_dir / "node.toml" and node_id == MINER.node_id
    config = load_config(node_dir / "node.toml")
    assert config.node.key == files["miner_key"].resolve() and not (node_dir / "node.key").exists()
    assert '"../miner_key.key"' in (node_dir / "node.toml").read_text(encoding="utf-8")  # moves with its key
    assert (config.p2p.host, config.p2p.port) == ("0.0.0.0", 4101)
    assert config.p2p.announce == ("/ip4/203.0.113.7/tcp/5101", "/dns4/miner.example.org/tcp/5101")
    assert (config.miner.device, config.miner.forward) == ("cuda:1", "compressed")


def test_a_miner_without_options_gets_a_new_key_and_its_defaults_written_out(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    files = network(tmp_path)
    assert main(["init", "--role", "miner", "--spec", str(files["spec"]), "--dir", str(tmp_path / "m")]) == 0
    text = (tmp_path / "m" / "node.toml").read_text(encoding="utf-8")
    assert '[miner]\ndevice = "cpu"\n# forward = "full"' in text and 'host = "127.0.0.1"' in text
    config = load_config(tmp_path / "m" / "node.toml")
    assert "forward" not in config.miner.model_fields_set and config.miner.forward == "full"
    assert load_identity(config.node.key).node_id == capsys.readouterr().out.split()[1]
    assert config.p2p.announce == ()


def test_a_validator_takes_the_key_the_spec_names_and_its_files(tmp_path: Path) -> None:
    files = network(tmp_path, general=True)
    node_dir = tmp_path / "val1"
    assert main(["init", "--role", "validator", "--spec", str(files["spec"]), "--dir", str(node_dir),
                 "--key", str(files["val_key"]), "--heldout", str(files["heldout"]), "--general", str(files["general"]),
                 "--host", "10.0.0.5", "--device", "auto"]) == 0
    config = load_config(node_dir / "node.toml")
    assert load_identity(config.node.key).node_id == VALIDATOR.node_id
    assert config.validator.heldout == files["heldout"].resolve() and config.validator.general == files["general"].resolve()
    assert (config.p2p.host, config.validator.device) == ("10.0.0.5", "auto")


@pytest.mark.parametrize(("role", "extra", "reason"), [
    ("validator", ["--heldout", "{heldout}"], "init --role validator needs --key FILE"),
    ("validator", ["--heldout", "{heldout}", "--key", "{miner_key}"], "is not one of the spec's validators"),
    ("miner", ["--key", "{val_key}"], "is a validator's key in the spec"),
    ("miner", ["--key", "{missing}"], "no such key file"),
    ("miner", ["--heldout", "{heldout}"], "--heldout is for validators"),
    ("miner", ["--general", "{general}"], "--general is for validators"),
    ("validator", ["--heldout", "{heldout}", "--key", "{val_key}", "--forward", "full"], "--forward is for miners"),
    ("validator", ["--heldout", "{heldout}", "--key", "{val_key}", "--general", "{general}"],
     "--general: the spec pins no general-domain held-out file"),
    ("miner", ["--announce", "/ip4/0.0.0.0/tcp/4001"], "p2p.announce"),
    ("miner", ["--announce", "/ip4/203.0.113.7/tcp/4001/p2p/12D3KooWAbc"], "p2p.announce"),
    ("miner", ["--announce", "203.0.113.7:4001"], "p2p.announce"),
    ("miner", ["--host", "node.example.org"], "p2p.host"),
])
def test_what_would_not_work_is_refused_in_one_line_and_nothing_is_written(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], role: str, extra: list[str], reason: str) -> None:
    files = {name: str(path) for name, path in network(tmp_path).items()} | {"missing": str(tmp_path / "none.key")}
    node_dir = tmp_path / "node"
    argv = ["init", "--role", role, "--spec", files["spec"], "--dir", str(node_dir),
            *(arg.format(**files) for arg in extra)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert reason in err and err.startswith("tessera: error: ") and err.count("\n") == 1, err
    assert not node_dir.exists()


def test_a_validator_of_a_spec_that_pins_a_general_file_needs_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    files = network(tmp_path, general=True)
    argv = ["init", "--role", "validator", "--spec", str(files["spec"]), "--dir", str(tmp_path / "v"),
            "--key", str(files["val_key"]), "--heldout", str(files["heldout"])]
    assert main(argv) == 2
    assert "--general: the spec pins a general-domain held-out file" in capsys.readouterr().err
    assert main([*argv, "--general", str(files["heldout"])]) == 2
    assert "but the spec pins data.general_sha256" in capsys.readouterr().err
    assert not (tmp_path / "v").exists()

"""The offline operator chain through `tessera`'s own entry point: spec init -> train -> inspect -> eval.

Also checks that a simulation directory is reproducible from its seed and genesis, and that user
mistakes end as one `tessera: error:` line with exit code 2. The commands run in this process (each would
spend about 8 s of CPU importing torch and transformers in a fresh one); what a real process does with the
exit code and its output is tested in test_inspect_cli.py and test_real_checkpoint_cli.py.
"""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
from datetime import UTC, datetime
from pathlib import Path

import pytest

from node.cli.main import main
from node.sim.layout import make_sim_network, sim_identity
from protocol.identity import save_identity
from protocol.spec import load_spec

GENESIS = "2026-01-01T00:00:00Z"


def tessera(*args: str | Path) -> subprocess.CompletedProcess[str]:
    """`tessera ARGS` as `node.cli.main.main` runs it: its exit code and what it printed."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in args])
    return subprocess.CompletedProcess(["tessera", *map(str, args)], code, out.getvalue(), err.getvalue())


@pytest.fixture(scope="module")
def chain(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    root = tmp_path_factory.mktemp("offline")
    sim = root / "sim"
    init = tessera("spec", "init", "--sim", sim, "--validators", "2", "--genesis", GENESIS)
    assert init.returncode == 0, init.stderr
    key = root / "miner.key"
    save_identity(sim_identity(0, "miner", 0), key)
    blob = root / "miner.blob"
    train = tessera("train", "--spec", sim / "spec.toml", "--key", key, "--round", "0", "--steps", "20",
                    "--out", blob)
    assert train.returncode == 0, train.stderr
    return {"sim": sim, "init": init.stdout, "key": key, "blob": blob, "train": json.loads(train.stdout)}


def test_spec_init_writes_a_valid_spec(chain: dict[str, object]) -> None:
    sim = chain["sim"]
    assert isinstance(sim, Path)
    spec_line, id_line = str(chain["init"]).split()
    spec = load_spec(spec_line)
    assert spec.network_id == id_line
    assert len(spec.validators) == 2
    assert sorted(p.name for p in (sim / "keys").iterdir()) == ["validator-0.key", "validator-1.key"]
    assert all((p.stat().st_mode & 0o777) == 0o600 for p in (sim / "keys").iterdir())
    assert all(len(ids) == 2 for ids in spec.group.values())


def test_train_writes_the_blob_it_would_submit(chain: dict[str, object]) -> None:
    from training.blob import decode_blob

    summary = chain["train"]
    assert isinstance(summary, dict)
    blob = Path(str(chain["blob"])).read_bytes()
    assert summary["steps"] == 20
    assert summary["last_loss"] < summary["first_loss"]
    assert summary["bytes"] == len(blob)
    spec = load_spec(Path(str(chain["sim"])) / "spec.toml")
    meta, tensors = decode_blob(blob, spec.limits.max_header_bytes)
    assert meta.network == spec.network_id
    assert meta.miner == sim_identity(0, "miner", 0).node_id
    assert meta.base == spec.model.base_hash
    assert meta.round == 0 and meta.group == dict(spec.group)
    assert tensors


def test_inspect_accepts_the_trained_blob(chain: dict[str, object]) -> None:
    spec = Path(str(chain["sim"])) / "spec.toml"
    result = tessera("inspect", "blob", chain["blob"], "--spec", spec, "--round", "0",
                     "--miner", sim_identity(0, "miner", 0).node_id, "--base", load_spec(spec).model.base_hash)
    assert result.returncode == 0, result.stdout + result.stderr
    assert json.loads(result.stdout)["verdict"] == "ACCEPT"


def test_trained_experts_lower_the_heldout_loss(chain: dict[str, object]) -> None:
    spec = Path(str(chain["sim"])) / "spec.toml"
    base = tessera("eval", "--spec", spec)
    trained = tessera("eval", "--spec", spec, "--blob", chain["blob"])
    assert base.returncode == 0, base.stderr
    assert trained.returncode == 0, trained.stderr
    base_out, trained_out = json.loads(base.stdout), json.loads(trained.stdout)
    assert base_out["tokens"] == trained_out["tokens"] > 0
    assert trained_out["loss"] < base_out["loss"]


def test_user_mistakes_are_one_error_line(chain: dict[str, object], tmp_path: Path) -> None:
    spec = Path(str(chain["sim"])) / "spec.toml"
    wrong = tmp_path / "heldout.jsonl"
    wrong.write_text('{"text": "1+1=2"}\n', encoding="utf-8")
    result = tessera("eval", "--spec", spec, "--heldout", wrong)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"tessera: error: {wrong}: SHA-256 differs from the spec's data.heldout_sha256; wrong held-out file"
    ]


def test_sim_network_is_reproducible(tmp_path: Path) -> None:
    genesis = datetime(2026, 1, 1, tzinfo=UTC)
    a = make_sim_network(tmp_path / "a", validators=3, genesis=genesis, seed=4)
    b = make_sim_network(tmp_path / "b", validators=3, genesis=genesis, seed=4)
    files = sorted(p.relative_to(a.directory) for p in a.directory.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(b.directory) for p in b.directory.rglob("*") if p.is_file())
    assert all((a.directory / f).read_bytes() == (b.directory / f).read_bytes() for f in files)
    assert a.network_id == b.network_id and a.validator_ids == b.validator_ids
    train = {json.loads(line)["text"] for line in (a.directory / "data/train.jsonl").read_text().splitlines()}
    heldout = [json.loads(line)["text"] for line in (a.directory / "data/heldout.jsonl").read_text().splitlines()]
    assert heldout and not train.intersection(heldout)
    with pytest.raises(ValueError, match="not empty"):
        make_sim_network(tmp_path / "a")


def test_select_experts_reproduces_the_sim_group(chain: dict[str, object], tmp_path: Path) -> None:
    sim = Path(str(chain["sim"]))
    out = tmp_path / "group.json"
    result = tessera("select-experts", "--spec", sim / "spec.toml", "--data", sim / "data/train.jsonl",
                     "--rule", "gate-mass", "--top-d", "2", "--max-sequences", "64", "--out", out)
    assert result.returncode == 0, result.stderr
    selection = json.loads(out.read_text())
    spec = load_spec(sim / "spec.toml")
    assert {int(k): v for k, v in selection["group"].items()} == dict(spec.group)
    assert selection["rule"] == "gate-mass" and len(selection["stats"]) == len(spec.group)

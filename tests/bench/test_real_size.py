"""bench/real_size_fixture.py writes a hub checkpoint transformers loads as written, export patches its sharded
bf16 rows in place, and bench/real_size.py runs every operator command and a one-round network on the smallest
such checkpoint (integration: real processes)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from tests.bench.scripts import BENCH, load_bench, run_bench
from training.adapters import adapter_for
from training.checkpoint import checkpoint_hash, meta_model, weight_files
from training.experts import extract, insert
from training.export import patch_checkpoint
from training.model import load_checkpoint, state_hash
from validator.merge import CANDIDATES

pytestmark = pytest.mark.slow


def test_the_fixture_is_a_sharded_hub_checkpoint_with_per_expert_keys(tmp_path: Path) -> None:
    fixture = load_bench("real_size_fixture")
    written = fixture.write_fixture(tmp_path / "ckpt", layers=2, hidden_size=32)
    directory = Path(written["checkpoint"])
    files = weight_files(directory)
    assert [f.name for f in files] == [f"model-0000{n}-of-00003.safetensors" for n in (1, 2, 3)]
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    keys = set()
    for path in files:
        with safe_open(str(path), "pt") as handle:
            keys |= set(handle.keys())
            assert {index["weight_map"][k] for k in handle.keys()} == {path.name}
    assert "model.layers.1.mlp.experts.63.gate_proj.weight" in keys and len(keys) == 3 + 2 * (9 + 64 * 3)
    model = load_checkpoint(directory)
    assert model.config.num_experts == 64 and model.config.num_experts_per_tok == 8
    assert str(model.dtype) == "torch.bfloat16" and model.config.vocab_size == 50304
    assert state_hash(model) == checkpoint_hash(directory)  # every weight came from the files, none from init
    assert set(model.state_dict()) == set(meta_model(directory).state_dict())
    assert written["weight_bytes"] == sum(t.numel() * 2 for t in model.state_dict().values())
    assert (directory / "data" / "train.jsonl").is_file() and (directory / "tokenizer.json").is_file()
    again = fixture.write_fixture(tmp_path / "again", layers=2, hidden_size=32)
    assert checkpoint_hash(Path(again["checkpoint"])) == checkpoint_hash(directory)


@pytest.mark.parametrize("args, message", [
    (["--layers", "17"], "--layers must be 1 to 16"),
    (["--hidden-size", "100"], "--hidden-size must be a multiple of 32"),
])
def test_the_fixture_refuses_bad_sizes_at_once(tmp_path: Path, args: list[str], message: str) -> None:
    run = subprocess.run([sys.executable, str(BENCH / "real_size_fixture.py"), "--out", str(tmp_path / "x"), *args],
                         capture_output=True, text=True, timeout=30)
    assert run.returncode == 2 and message in run.stderr


def test_the_benchmark_refuses_a_checkpoint_that_is_not_one(tmp_path: Path) -> None:
    run = subprocess.run([sys.executable, str(BENCH / "real_size.py"), "--out", str(tmp_path / "r.json"),
                          "--checkpoint", str(tmp_path)], capture_output=True, text=True, timeout=30)
    assert run.returncode == 2 and "no config.json there" in run.stderr


def test_a_command_s_peak_is_its_own_not_the_benchmark_s(tmp_path: Path) -> None:
    """A spawned process's maxrss starts at its parent's RSS: the benchmark's own GBs must not be a command's."""
    real_size = load_bench("real_size")
    held = bytearray(400 << 20)  # the benchmark holding 400 MB, touched, when it runs a command
    held[::4096] = b"x" * len(held[::4096])
    run = real_size.measure("inspect", ["--help"], tmp_path, weight_bytes=1 << 30)
    assert 0 < run["peak_rss_bytes"] < 200 << 20 and run["printed"] is None
    del held


@pytest.mark.integration
@pytest.mark.timeout(1500)
def test_every_command_and_one_round_at_the_smallest_size(tmp_path: Path) -> None:
    report = run_bench("real_size", tmp_path / "report.json", "--layers", "1", "--hidden-size", "32",
                       "--miners", "1", "--work", str(tmp_path / "work"))
    commands = report["commands"]
    assert set(commands) == {"spec_new", "inspect", "eval_base", "train_experts", "train_pgrad", "eval_blob", "export"}
    assert all(run["seconds"] > 0 and run["peak_rss_bytes"] > 0 for run in commands.values())
    assert commands["inspect"]["printed"]["verdict"] == "ACCEPT"
    assert commands["eval_blob"]["printed"]["loss"] != commands["eval_base"]["printed"]["loss"]
    assert 0 < report["blob_bytes"]["pgrad"] < report["blob_bytes"]["experts"]
    network = report["network"]
    assert network["one_state_everywhere"], network["heads"]
    assert network["gate"]["adopted"] in CANDIDATES  # the state the validator's gate adopted, on every node
    assert set(network["peak_rss_bytes"]) == {"bootstrap", "validator-0", "miner-0"}
    budgets = network["nodes_within_budget"]  # at this size the runtime outweighs the model: ratios, not verdicts
    assert set(budgets) == {"validator-0", "miner-0"} and budgets["validator-0"]["budget"] == 1.3
    assert all(b["ratio"] * report["weight_bytes"] == pytest.approx(network["peak_rss_bytes"][n], rel=1e-3)
               for n, b in budgets.items())
    assert [m["verdict"] for m in network["round"]["miners"]] == ["accept"]


def test_export_patches_the_rows_of_a_sharded_bf16_checkpoint(tmp_path: Path) -> None:
    directory = Path(load_bench("real_size_fixture").write_fixture(tmp_path / "ckpt", layers=2, hidden_size=32)[
        "checkpoint"])
    base = load_checkpoint(directory)
    adapter = adapter_for("olmoe")
    group = {0: [3, 63], 1: [5]}
    generator = torch.Generator().manual_seed(1)
    tensors = {name: torch.randn(t.shape, generator=generator) for name, t in extract(base, adapter, group).items()}
    patch_checkpoint(directory, tensors, tmp_path / "out")
    insert(base, adapter, tensors)
    assert state_hash(load_checkpoint(tmp_path / "out")) == state_hash(base)
    assert [f.name for f in weight_files(tmp_path / "out")] == [f.name for f in weight_files(directory)]

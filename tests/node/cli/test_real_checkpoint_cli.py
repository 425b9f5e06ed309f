"""A network from a hub-format checkpoint, every command an operator types: spec new -> export.

Each family runs `spec new` -> `spec check` -> `train` -> `inspect blob` -> `eval` -> `export`
in-process through the real `tessera` entry point; bad input is refused with exit code 2 and
nothing written.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from node.cli.main import main
from protocol.identity import Identity, save_identity
from protocol.spec import TrainingSpec, load_spec
from tests.training.hub_checkpoint import write_data, write_hub_checkpoint, write_tokenizer
from training.adapters import ADAPTERS
from training.blob import BlobMeta, decode_blob, encode_blob
from training.checkpoint import checkpoint_hash
from training.data import heldout_subset, load_sequences
from training.evaluate import heldout_loss
from training.experts import extract
from training.export import read_expert_pack
from training.model import load_base
from training.state import GlobalExperts
from training.tiny import build_tiny_model, tiny_config
from training.tokenizer import HFTokenizer


def run(capsys: pytest.CaptureFixture[str], *argv: object) -> tuple[int, str, str]:
    """The command's exit code and what it printed (not what the test printed before it, such as a load's bar)."""
    capsys.readouterr()
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def new_network(tmp_path: Path, capsys: pytest.CaptureFixture[str], family: str) -> tuple[Path, Path, Path]:
    checkpoint = write_hub_checkpoint(tmp_path / "ckpt", family)
    train, heldout = write_data(tmp_path)
    validator = Identity.from_seed(bytes(32)).node_id
    spec = tmp_path / "net" / "spec.toml"
    code, out, err = run(capsys, "spec", "new", "--checkpoint", checkpoint, "--train", train, "--heldout",
                         heldout, "--validator", f"{validator}:2", "--top-d", "2", "--timing", "sim",
                         "--seq-len", "32", "--heldout-sequences", "8", "--max-sequences", "64", "--out", spec)
    assert code == 0, err
    assert json.loads(out)["network_id"] == load_spec(spec).network_id
    return checkpoint, spec, heldout


# `make check` runs the pipeline on the simulation's family, `make test` on every family (marked slow: about a
# second of CPU each; tests/training/test_model_checkpoint.py loads each family's hub checkpoint in both).
@pytest.mark.parametrize("family", [family if family == "qwen3_moe" else pytest.param(family, marks=pytest.mark.slow)
                                    for family in ADAPTERS])
def test_spec_new_to_export(tmp_path: Path, capsys: pytest.CaptureFixture[str], family: str) -> None:
    checkpoint, spec_path, heldout = new_network(tmp_path, capsys, family)
    spec = load_spec(spec_path)
    assert run(capsys, "spec", "check", spec_path)[1].strip() == spec.network_id
    assert run(capsys, "spec", "hash-model", checkpoint)[1].strip() == spec.model.base_hash
    assert all(len(ids) == 2 for ids in spec.group.values()) and spec.model.family == family

    key = tmp_path / "miner.key"
    save_identity(Identity.from_seed(bytes([7]) * 32), key)
    blob = tmp_path / "miner.blob"
    code, _, err = run(capsys, "train", "--spec", spec_path, "--key", key, "--round", "0", "--steps", "20",
                       "--out", blob)
    assert code == 0, err
    code, out, _ = run(capsys, "inspect", "blob", blob, "--spec", spec_path)
    assert code == 0 and json.loads(out)["verdict"] == "ACCEPT"
    base_loss = json.loads(run(capsys, "eval", "--spec", spec_path, "--heldout", heldout)[1])["loss"]
    trained_loss = json.loads(run(capsys, "eval", "--spec", spec_path, "--heldout", heldout, "--blob", blob)[1])["loss"]
    assert trained_loss < base_loss

    exported = tmp_path / "exported"
    code, out, err = run(capsys, "export", "--spec", spec_path, "--blob", blob, "--heldout", heldout, "--out", exported)
    assert code == 0, err
    assert json.loads(out)["heldout_loss"] == pytest.approx(trained_loss, abs=1e-5)
    model = AutoModelForCausalLM.from_pretrained(str(exported))
    tokenizer = HFTokenizer(exported)
    sequences = heldout_subset(load_sequences([heldout], tokenizer, spec.data.seq_len), "0" * 64,
                               spec.data.heldout_sequences)
    assert heldout_loss(model, sequences, batch_size=16, pad_id=tokenizer.pad_id).loss == pytest.approx(
        trained_loss, abs=1e-5)
    _, tensors = decode_blob(blob.read_bytes(), spec.limits.max_header_bytes)
    written = extract(model, ADAPTERS[family], spec.group)
    assert all(torch.equal(written[name], tensors[name]) for name in tensors)

    state = hashlib.sha256(blob.read_bytes()).hexdigest()
    stored = tmp_path / "node" / "blobs" / state[:2] / state
    stored.parent.mkdir(parents=True)
    stored.write_bytes(blob.read_bytes())
    pack = tmp_path / "pack"
    code, _, err = run(capsys, "export", "--spec", spec_path, "--state", state, "--data-dir", tmp_path / "node",
                       "--experts-only", "--heldout", heldout, "--out", pack)
    assert code == 0, err
    manifest, packed = read_expert_pack(pack)
    assert manifest["network"] == spec.network_id and manifest["base_hash"] == spec.model.base_hash
    assert manifest["state"] == state and manifest["heldout_loss"] == pytest.approx(trained_loss, abs=1e-5)
    assert {int(k): v for k, v in manifest["group"].items()} == dict(spec.group) and manifest["round"] == 0
    assert packed.keys() == tensors.keys() and all(torch.equal(packed[n], tensors[n]) for n in tensors)


def test_export_and_eval_of_a_global_state_read_its_experts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    checkpoint = write_hub_checkpoint(tmp_path / "ckpt", "qwen3_moe")
    train, heldout = write_data(tmp_path)
    spec_path = tmp_path / "net" / "spec.toml"
    code, _, err = run(capsys, "spec", "new", "--checkpoint", checkpoint, "--train", train, "--heldout", heldout,
                       "--validator", "ab" * 32, "--timing", "sim", "--seq-len", "32", "--max-sequences", "64",
                       "--out", spec_path)
    assert code == 0, err
    spec = load_spec(spec_path)
    model, adapter = load_base(spec, spec_path)
    base = extract(model, adapter, spec.group)
    merged = {name: t + 0.5 for name, t in base.items()}
    state = GlobalExperts.genesis(spec, base).child(0, merged, {n: torch.zeros_like(t) for n, t in base.items()})
    stored = tmp_path / "node" / "blobs" / state.hash[:2] / state.hash
    stored.parent.mkdir(parents=True)
    stored.write_bytes(state.to_blob())

    pack, exported = tmp_path / "pack", tmp_path / "exported"
    code, out, err = run(capsys, "export", "--spec", spec_path, "--state", state.hash, "--data-dir", tmp_path / "node",
                         "--experts-only", "--heldout", heldout, "--out", pack)
    assert code == 0, err
    code, evaluated, err = run(capsys, "eval", "--spec", spec_path, "--heldout", heldout, "--blob", stored)
    assert code == 0, err  # `eval` of a state reads the experts `export` writes
    assert json.loads(evaluated)["loss"] == pytest.approx(json.loads(out)["heldout_loss"], abs=1e-6)
    manifest, packed = read_expert_pack(pack)
    assert manifest["state"] == state.hash
    assert all(torch.equal(packed[n], merged[n]) for n in base)
    code, _, err = run(capsys, "export", "--spec", spec_path, "--state", state.hash, "--data-dir", tmp_path / "node",
                       "--out", exported)
    assert code == 0, err
    written = extract(AutoModelForCausalLM.from_pretrained(str(exported)), adapter, spec.group)
    assert all(torch.equal(written[n], merged[n]) for n in base)


def _refused(capsys: pytest.CaptureFixture[str], *argv: object, match: str) -> None:
    code, _, err = run(capsys, *argv)
    assert code == 2 and match in err and len(err.strip().splitlines()) == 1, err


def test_bad_checkpoints_are_refused_and_nothing_is_written(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    train, heldout = write_data(tmp_path)
    out = tmp_path / "spec.toml"
    # a held-out file that fills a round's scored and gate rows, so that what is refused is the checkpoint
    args = ("--train", train, "--heldout", heldout, "--validator", "ab" * 32, "--heldout-sequences", "1", "--seq-len", "32",
            "--set", "data.gate_sequences=1", "--out", out)
    (tmp_path / "empty").mkdir()
    _refused(capsys, "spec", "new", "--checkpoint", tmp_path / "empty", *args, match="no config.json")
    no_weights = tmp_path / "no-weights"
    build_tiny_model("olmoe", tiny_config("olmoe"), 0).config.save_pretrained(str(no_weights))
    _refused(capsys, "spec", "hash-model", no_weights, match="no *.safetensors")
    torch.save({"w": torch.zeros(1)}, no_weights / "pytorch_model.bin")
    _refused(capsys, "spec", "new", "--checkpoint", no_weights, *args, match="pickled")
    dense = tmp_path / "dense"
    LlamaForCausalLM(LlamaConfig(vocab_size=260, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2)).save_pretrained(str(dense))
    capsys.readouterr()  # transformers' progress bars while the checkpoint was written
    _refused(capsys, "spec", "new", "--checkpoint", dense, *args, match="dense model")
    wide = write_hub_checkpoint(tmp_path / "wide", "qwen3_moe")
    write_tokenizer(wide, vocab_size=400)
    capsys.readouterr()
    _refused(capsys, "spec", "new", "--checkpoint", wide, *args, match="does not belong to this model")
    assert not out.exists()


def test_spec_new_sets_the_protocols_settings_and_judges_them_before_reading_the_checkpoint(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    checkpoint = write_hub_checkpoint(tmp_path / "ckpt", "qwen3_moe")
    train, heldout = write_data(tmp_path)
    capsys.readouterr()  # transformers' progress bars while the checkpoint was written
    out = tmp_path / "net" / "spec.toml"
    args = ("--train", train, "--heldout", heldout, "--validator", "ab" * 32, "--timing", "sim", "--seq-len", "32",
            "--max-sequences", "64", "--out", out)
    missing = tmp_path / "no-such-checkpoint"  # a bad setting is named before the checkpoint is looked at
    _refused(capsys, "spec", "new", "--checkpoint", missing, *args, "--set", "aggregation.outer_lrr=2",
             match="spec setting aggregation.outer_lrr: no such field in [aggregation]")
    _refused(capsys, "spec", "new", "--checkpoint", missing, *args, "--set", "submission.topk=42",
             match="spec setting submission: topk must be a multiple of 4")
    _refused(capsys, "spec", "new", "--checkpoint", missing, *args, "--set", f"model.base_hash={'ab' * 32}",
             match="cannot set 'model.base_hash' in a spec")
    with pytest.raises(SystemExit) as exit_:  # argparse's own refusal
        main(["spec", "new", "--checkpoint", str(missing), *map(str, args), "--set", "aggregation.outer_lr"])
    assert exit_.value.code == 2 and "write it as section.field=value" in capsys.readouterr().err
    assert not out.exists()

    code, _, err = run(capsys, "spec", "new", "--checkpoint", checkpoint, *args, "--set", "submission.format=pgrad",
                       "--set", "training.inner_steps=5", "--set", "aggregation.outer_lr=2.5",
                       "--set", "aggregation.momentum=0.5", "--set", "aggregation.top_g=8")
    assert code == 0, err
    spec = load_spec(out)
    assert (spec.submission.format, spec.training.inner_steps) == ("pgrad", 5)
    assert (spec.aggregation.outer_lr, spec.aggregation.momentum, spec.aggregation.top_g) == (2.5, 0.5, 8)
    assert spec.training.lr == TrainingSpec().lr and spec.aggregation.clip_to_median  # the rest keep defaults


def test_spec_new_sets_timing_the_blob_dtype_and_the_data_over_its_options(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    checkpoint = write_hub_checkpoint(tmp_path / "ckpt", "qwen3_moe")
    train, heldout = write_data(tmp_path)
    capsys.readouterr()
    out = tmp_path / "net" / "spec.toml"
    code, _, err = run(capsys, "spec", "new", "--checkpoint", checkpoint, "--train", train, "--heldout", heldout,
                       "--validator", "ab" * 32, "--timing", "sim", "--seq-len", "32", "--max-sequences", "64",
                       "--set", "timing.train_s=5", "--set", "timing.clock_skew_s=0.5", "--set", "model.dtype=bfloat16",
                       "--set", "data.seq_len=48", "--set", "data.heldout_sequences=4", "--out", out)
    assert code == 0, err
    spec = load_spec(out)
    assert (spec.timing.train_s, spec.timing.commit_s, spec.timing.clock_skew_s) == (5.0, 4.0, 0.5)  # over --timing
    assert (spec.model.dtype, spec.data.seq_len, spec.data.heldout_sequences) == ("bfloat16", 48, 4)


def test_bad_groups_and_export_targets_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _, spec_path, heldout = new_network(tmp_path, capsys, "qwen2_moe")
    text = spec_path.read_text(encoding="utf-8")
    first = text.index("[group]")
    for bad, match in (("0 = [1, 99]", "do not exist"), ("5 = [1]", "not an MoE layer")):
        broken = spec_path.with_name(f"broken-{bad[0]}.toml")
        lines = text[first:].splitlines()
        broken.write_text(text[:first] + "\n".join([lines[0], bad, *lines[2:]]) + "\n", encoding="utf-8")
        _refused(capsys, "eval", "--spec", broken, "--heldout", heldout, match=match)
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "keep.txt").write_text("mine", encoding="utf-8")
    _refused(capsys, "export", "--spec", spec_path, "--blob", tmp_path / "none.blob", "--out", taken,
             match="not an empty directory")
    assert [p.name for p in taken.iterdir()] == ["keep.txt"]


@pytest.mark.slow
def test_real_processes_print_the_hash_and_refuse_with_exit_2(tmp_path: Path) -> None:
    checkpoint = write_hub_checkpoint(tmp_path / "ckpt", "deepseek_v2")
    command = [sys.executable, "-m", "node.cli", "spec", "hash-model"]
    done = subprocess.run([*command, str(checkpoint)], capture_output=True, text=True, check=False)
    assert done.returncode == 0 and done.stdout.strip() == checkpoint_hash(checkpoint)
    done = subprocess.run([*command, str(tmp_path)], capture_output=True, text=True, check=False)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "no config.json" in done.stderr


@pytest.mark.parametrize("fmt", ["tessera-momentum/1", "tessera-pgrad/1"])
def test_export_refuses_a_blob_that_holds_no_weights(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                     fmt: str) -> None:
    checkpoint, spec_path, _ = new_network(tmp_path, capsys, "qwen3_moe")
    spec = load_spec(spec_path)
    model = AutoModelForCausalLM.from_pretrained(str(checkpoint))
    momentum = {name: torch.full_like(t, 0.5) for name, t in extract(model, ADAPTERS["qwen3_moe"], spec.group).items()}
    meta = BlobMeta(network=spec.network_id, round=3, miner="", base="cd" * 32,
                    group={layer: list(ids) for layer, ids in spec.group.items()}, format=fmt)
    blob = tmp_path / "momentum.blob"
    blob.write_bytes(encode_blob(momentum, meta))
    _refused(capsys, "export", "--spec", spec_path, "--blob", blob, "--out", tmp_path / "exported",
             match=f"the blob is a {fmt} blob, not expert weights")
    assert not (tmp_path / "exported").exists()

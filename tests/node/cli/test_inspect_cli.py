"""`tessera inspect blob`: one JSON verdict line; exit 0 ACCEPT, 1 REJECT, 2 usage error."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from node.cli.main import main
from protocol.spec import load_spec
from tests.conftest import make_identity, make_spec_dict, to_toml
from training.blob import BlobMeta, blob_hash, encode_blob
from training.experts import extract
from training.model import load_base, state_hash
from training.tiny import build_tiny_model, tiny_config

ROOT = Path(__file__).resolve().parents[3]
MINER = make_identity(100).node_id


@pytest.fixture(scope="module")
def network(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor], BlobMeta]:
    """A tiny qwen3_moe network on disk, its group's expert tensors, and a miner's round-3 metadata."""
    root = tmp_path_factory.mktemp("net")
    config = tiny_config("qwen3_moe")
    (root / "tiny.json").write_text(json.dumps(config), encoding="utf-8")
    data = make_spec_dict()
    data["model"]["base_hash"] = state_hash(build_tiny_model("qwen3_moe", config, data["model"]["init_seed"]))
    spec_path = root / "spec.toml"
    spec_path.write_text(to_toml(data), encoding="utf-8")
    spec = load_spec(spec_path)
    model, adapter = load_base(spec, spec_path)
    tensors = extract(model, adapter, spec.group)
    meta = BlobMeta(network=spec.network_id, round=3, miner=MINER, base=spec.model.base_hash, group=spec.group)
    return spec_path, tensors, meta


def _run(capsys: pytest.CaptureFixture[str], blob: Path, spec: Path, *extra: str) -> tuple[int, dict, str]:
    code = main(["inspect", "blob", str(blob), "--spec", str(spec), *extra])
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert len(lines) == (1 if code in (0, 1) else 0), out
    return code, json.loads(lines[0]) if lines else {}, err


def test_accepts_a_consistent_blob(network, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec_path, tensors, meta = network
    data = encode_blob(tensors, meta)
    blob = tmp_path / "b.safetensors"
    blob.write_bytes(data)
    code, line, _ = _run(capsys, blob, spec_path)
    assert code == 0
    assert line["verdict"] == "ACCEPT" and line["reason"] == ""
    assert line["hash"] == blob_hash(data) and line["bytes"] == len(data)
    assert line["round"] == 3 and line["miner"] == MINER and line["network"] == meta.network
    assert line["group"] == {"0": [1, 3], "1": [0]}
    explicit = ["--commit", blob_hash(data), "--round", "3", "--miner", MINER, "--base", meta.base]
    assert _run(capsys, blob, spec_path, *explicit)[0] == 0


def test_rejects_against_explicit_expectations(network, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec_path, tensors, meta = network
    blob = tmp_path / "b.safetensors"
    blob.write_bytes(encode_blob(tensors, meta))
    cases = {
        ("--round", "4"): "wrong round",
        ("--commit", "00" * 32): "hash mismatch",
        ("--miner", make_identity(101).node_id): "wrong miner",
        ("--base", "11" * 32): "stale base",
    }
    for extra, reason in cases.items():
        code, line, _ = _run(capsys, blob, spec_path, *extra)
        assert (code, line["verdict"], line["reason"]) == (1, "REJECT", reason)


def test_rejects_inconsistent_blobs(network, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec_path, tensors, meta = network
    poisoned = dict(tensors)
    name = sorted(poisoned)[0]
    poisoned[name] = poisoned[name].clone()
    poisoned[name][0, 0] = float("nan")
    other_net = BlobMeta(network="ab" * 32, round=3, miner=MINER, base=meta.base, group=meta.group)
    saved = io.BytesIO()
    torch.save(tensors, saved)
    blobs = {
        "nan": (encode_blob(poisoned, meta), "non-finite values"),
        "network": (encode_blob(tensors, other_net), "wrong network"),
        "missing": (encode_blob(dict(list(tensors.items())[1:]), meta), "missing tensor"),
        "bf16": (encode_blob({k: v.bfloat16() for k, v in tensors.items()}, meta), "wrong dtype"),
        "torch.save": (saved.getvalue(), "malformed header: zip archive"),
    }
    for label, (data, reason) in blobs.items():
        blob = tmp_path / f"{label}.safetensors"
        blob.write_bytes(data)
        code, line, _ = _run(capsys, blob, spec_path)
        assert code == 1 and line["verdict"] == "REJECT", label
        assert line["reason"].startswith(reason), (label, line["reason"])
        assert line["hash"] == blob_hash(data)


def test_usage_errors_exit_2(network, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec_path, tensors, meta = network
    blob = tmp_path / "b.safetensors"
    blob.write_bytes(encode_blob(tensors, meta))
    for spec, extra, needle in [
        (tmp_path / "nope.toml", (), "no such spec file"),
        (spec_path, ("--commit", "xyz"), "--commit must be 64 lower-case hex digits"),
        (spec_path, ("--round", "-1"), "--round must be non-negative"),
    ]:
        code, _, err = _run(capsys, blob, spec, *extra)
        assert code == 2
        assert err.startswith("tessera: error:") and needle in err and len(err.splitlines()) == 1
    code, _, err = _run(capsys, tmp_path / "absent.safetensors", spec_path)
    assert code == 2 and "cannot read blob" in err


@pytest.mark.slow
def test_exit_codes_from_a_real_process(network, tmp_path: Path) -> None:
    spec_path, tensors, meta = network
    blob = tmp_path / "b.safetensors"
    blob.write_bytes(encode_blob(tensors, meta))
    argv = [sys.executable, "-m", "node.cli", "inspect", "blob", str(blob), "--spec", str(spec_path), "--round", "9"]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    assert json.loads(done.stdout)["reason"] == "wrong round"


def test_reads_no_weights(network, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch) -> None:
    """The expected shapes come from the base on the meta device: no weights are built or loaded."""
    import training.model

    def refuse(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("inspect blob must not load the base weights")

    monkeypatch.setattr(training.model, "load_base", refuse)
    monkeypatch.setattr(training.model, "load_checkpoint", refuse)
    monkeypatch.setattr(training.model, "state_hash", refuse)
    spec_path, tensors, meta = network
    blob = tmp_path / "b.safetensors"
    blob.write_bytes(encode_blob(tensors, meta))
    assert _run(capsys, blob, spec_path)[0] == 0

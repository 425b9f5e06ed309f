"""The spec binds the base model's config as well as its weights (`model.config_sha256`), and `spec new` and
`spec check` refuse a spec whose miners' blob headers could be over `limits.max_header_bytes`.

A config edit that changes the forward pass but no weight (here `num_experts_per_tok`) leaves the base
hash as it was; the config hash catches it, and a node refuses to start in one line naming the field. Key
order and whitespace do not count. The header bound is the header the miner's own encoding writes.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from miner.submission import encode_submission
from node.cli.main import main
from node.cli.spec import submission_header_bytes
from protocol.identity import Identity
from protocol.spec import load_spec, parse_spec
from tests.conftest import to_toml
from tests.training.hub_checkpoint import write_data, write_hub_checkpoint
from training.adapters import adapter_for
from training.checkpoint import checkpoint_hash, config_hash
from training.experts import expected_shapes, extract
from training.model import BaseMismatchError, load_base, load_compressed_base, state_hash
from training.tiny import build_tiny_model, tiny_config


def run(capsys: pytest.CaptureFixture[str], *argv: object) -> tuple[int, str, str]:
    """The command's exit code and what it printed (not what the test printed before it, such as a load's bar)."""
    capsys.readouterr()
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def spec_new(tmp_path: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> tuple[int, str, str, Path, Path]:
    checkpoint = tmp_path / "ckpt"
    if not checkpoint.exists():
        write_hub_checkpoint(checkpoint, "qwen3_moe")
    train, heldout = write_data(tmp_path / "data")
    spec = tmp_path / "net" / "spec.toml"
    code, out, err = run(capsys, "spec", "new", "--checkpoint", checkpoint, "--train", train, "--heldout", heldout,
                         "--validator", Identity.from_seed(bytes(32)).node_id, "--top-d", "2", "--timing", "sim",
                         "--seq-len", "32", "--max-sequences", "16", "--out", spec, *extra)
    return code, out, err, checkpoint, spec


def edit_config(checkpoint: Path, **values: Any) -> None:
    path = checkpoint / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text(encoding="utf-8")), **values}), encoding="utf-8")


def test_spec_new_pins_the_config_and_a_node_with_another_config_refuses_to_start(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err, checkpoint, spec_path = spec_new(tmp_path, capsys)
    assert code == 0, err
    spec = load_spec(spec_path)
    config = json.loads((checkpoint / "config.json").read_text(encoding="utf-8"))
    assert spec.model.config_sha256 == config_hash(config)
    assert run(capsys, "spec", "hash-model", "--config", checkpoint)[1].strip() == spec.model.config_sha256
    load_compressed_base(spec, spec_path)  # the checkpoint it was made from starts

    # Reordered keys and another indentation are the same config.
    (checkpoint / "config.json").write_text(json.dumps(dict(reversed(config.items())), indent=4), encoding="utf-8")
    load_compressed_base(spec, spec_path)

    edit_config(checkpoint, num_experts_per_tok=config["num_experts_per_tok"] + 1)
    assert checkpoint_hash(checkpoint) == spec.model.base_hash  # the weights are the same ...
    assert run(capsys, "spec", "hash-model", "--config", checkpoint)[1].strip() != spec.model.config_sha256
    for start in (load_base, load_compressed_base):  # ... but a miner or validator refuses to start
        with pytest.raises(BaseMismatchError, match=r"model\.config_sha256") as info:
            start(spec, spec_path)
        assert "\n" not in str(info.value) and str(checkpoint / "config.json") in str(info.value)
    code, _, err = run(capsys, "eval", "--spec", spec_path, "--heldout", tmp_path / "data" / "heldout.jsonl")
    assert code == 2 and err.count("\n") == 1 and "model.config_sha256" in err


def test_a_tiny_config_spec_may_pin_its_config_and_one_that_does_not_has_it_null_in_its_network_id(
        tmp_path: Path, spec_dict: dict[str, Any]) -> None:
    config = tiny_config("qwen3_moe")
    (tmp_path / "tiny.json").write_text(json.dumps(config), encoding="utf-8")
    spec_dict["model"]["base_hash"] = state_hash(build_tiny_model("qwen3_moe", config, 7))
    unpinned = parse_spec(spec_dict)
    assert b'"config_sha256":null' in unpinned.canonical_bytes()
    pinned_dict = copy.deepcopy(spec_dict)
    pinned_dict["model"]["config_sha256"] = config_hash(config)
    pinned = parse_spec(pinned_dict)
    assert pinned.network_id != unpinned.network_id
    spec_path = tmp_path / "spec.toml"
    load_base(pinned, spec_path)
    load_base(unpinned, spec_path)
    (tmp_path / "tiny.json").write_text(json.dumps({**config, "norm_topk_prob": False}), encoding="utf-8")
    with pytest.raises(BaseMismatchError, match=r"tiny\.json: the model config hashes to .* model\.config_sha256"):
        load_base(pinned, spec_path)
    load_base(unpinned, spec_path)  # what a spec without the field always did


def test_spec_new_refuses_a_group_whose_pgrad_header_is_over_the_limit_and_writes_nothing(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err, _, spec_path = spec_new(tmp_path, capsys, "--set", "submission.format=pgrad",
                                          "--set", "limits.max_header_bytes=1024")
    assert code == 2 and err.count("\n") == 1, err
    assert "limits.max_header_bytes (1024) is too small: a miner's pgrad blob" in err
    assert "--set limits.max_header_bytes=" in err and "fewer experts" in err
    need = int(err.split("header of up to ")[1].split()[0])
    assert need > 1024 and not spec_path.exists()
    code, _, err, _, spec_path = spec_new(tmp_path, capsys, "--set", "submission.format=pgrad",
                                          "--set", f"limits.max_header_bytes={need}")
    assert code == 0, err
    assert load_spec(spec_path).limits.max_header_bytes == need


@pytest.mark.parametrize("fmt", ["experts", "pgrad"])
def test_the_header_bound_is_the_miners_own_header_at_its_largest(spec_dict: dict[str, Any], fmt: str) -> None:
    model = build_tiny_model("qwen3_moe", tiny_config("qwen3_moe"), 7)
    adapter = adapter_for("qwen3_moe")
    spec_dict["submission"] = {"format": fmt, "partitions": 1}
    spec = parse_spec(spec_dict)
    shapes = expected_shapes(model, adapter, spec.group)
    trained = extract(model, adapter, spec.group)
    base = {name: t + 0.01 for name, t in trained.items()}
    bound = submission_header_bytes(spec, shapes)
    data = encode_submission(spec, 999_999_999, "f" * 64, "f" * 64, trained, base)
    assert int.from_bytes(data[:8], "little") == bound
    if fmt == "pgrad":  # a draw of half the chunks never needs more
        halves = parse_spec({**spec_dict, "submission": {"format": "pgrad", "partitions": 2}})
        for miner in ("a", "b", "c"):
            data = encode_submission(halves, 12, miner * 64, "e" * 64, trained, base)
            assert int.from_bytes(data[:8], "little") <= submission_header_bytes(halves, shapes) == bound


def test_spec_check_refuses_a_header_over_the_limit_from_the_config_alone(
        tmp_path: Path, spec_dict: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "tiny.json").write_text(json.dumps(tiny_config("qwen3_moe")), encoding="utf-8")
    spec_dict["submission"] = {"format": "pgrad"}
    spec_dict["limits"] = {"max_header_bytes": 1024}
    path = tmp_path / "spec.toml"
    path.write_text(to_toml(spec_dict), encoding="utf-8")
    code, out, err = run(capsys, "spec", "check", path)
    assert code == 2 and out == "" and err.count("\n") == 1
    assert "limits.max_header_bytes (1024) is too small" in err
    spec_dict["limits"] = {"max_header_bytes": 1 << 20}
    path.write_text(to_toml(spec_dict), encoding="utf-8")
    code, out, err = run(capsys, "spec", "check", path)
    assert code == 0 and out.strip() == parse_spec(spec_dict).network_id

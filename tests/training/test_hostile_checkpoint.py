"""A malformed or hostile checkpoint directory (or expert pack) is refused with a ValueError naming what is wrong.

Each case edits one thing of a good tiny checkpoint (a safetensors header entry, the shard index,
a config.json value) and expects `checkpoint_hash` (what `spec new`, `spec hash-model` and every
node run first) and `load_checkpoint` to refuse it, never to raise something else or to accept it.
"""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from training.checkpoint import checkpoint_hash
from training.export import PACK_FORMAT, PACK_MANIFEST, PACK_TENSORS, read_expert_pack
from training.model import load_checkpoint

Header = dict[str, Any]


def _copy(good: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(good, tmp_path / "ckpt"))


def _edit_header(directory: Path, edit: Callable[[Header, str], object]) -> None:
    path = directory / "model.safetensors"
    data = path.read_bytes()
    (size,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + size])
    first = min(k for k in header if k != "__metadata__")
    raw = json.dumps(edit(header, first)).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + size :])


def _entry(**change: object) -> Callable[[Header, str], Header]:
    return lambda header, key: {**header, key: {**header[key], **change}}


def _offsets(header: Header, key: str) -> list[int]:
    return list(header[key]["data_offsets"])


@pytest.mark.parametrize(("edit", "match"), [
    (lambda header, key: [1, 2], "the header is not a JSON object"),
    (lambda header, key: {**header, key: "x"}, "header entry of lm_head.weight is malformed"),
    (lambda header, key: {**header, key: {"dtype": "F32", "shape": [260, 64]}}, "is malformed"),
    (lambda header, key: _entry(data_offsets=_offsets(header, key)[::-1])(header, key), "is malformed"),
    (_entry(shape="ab"), "is malformed"),
    (_entry(shape=[2, 2]), "is malformed"),
    (_entry(dtype=["F32"]), "is malformed"),
    (lambda header, key: _entry(data_offsets=[0, 1 << 40])(header, key), "is malformed"),
])
def test_malformed_safetensors_headers_are_refused(
        good: Path, tmp_path: Path, edit: Callable[[Header, str], object], match: str) -> None:
    directory = _copy(good, tmp_path)
    _edit_header(directory, edit)
    with pytest.raises(ValueError, match=match):
        checkpoint_hash(directory)


def test_a_header_pointing_past_the_end_of_the_file_is_truncated(good: Path, tmp_path: Path) -> None:
    directory = _copy(good, tmp_path)
    path = directory / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(ValueError, match="file ends inside model.norm.weight; the checkpoint is truncated"):
        checkpoint_hash(directory)


@pytest.mark.parametrize("shard", ["../good/model.safetensors", "/etc/passwd", 5])
def test_an_index_naming_shards_outside_the_directory_is_refused(good: Path, tmp_path: Path, shard: object) -> None:
    directory = _copy(good, tmp_path)
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": shard}}))
    with pytest.raises(ValueError, match="is not a file name in the directory"):
        checkpoint_hash(directory)


@pytest.mark.parametrize(("change", "match"), [
    ({"quantization_config": "fp8"}, r"quantized checkpoints \(fp8\) are not supported"),
    ({"dtype": "nonsense"}, "no attribute 'nonsense'"),
    ({"dtype": "float8_e4m3fn"}, "config.json has dtype 'torch.float8_e4m3fn'"),
    ({"hidden_size": "abc"}, "invalid qwen3_moe model config: Validation error for field 'hidden_size'"),
    ({"num_attention_heads": 0}, "describes no buildable qwen3_moe model"),
    ({"vocab_size": -5}, "describes no buildable qwen3_moe model"),
    ({"rope_parameters": {"rope_type": "bogus", "rope_theta": 1.0}}, "describes no buildable qwen3_moe model"),
    ({"num_experts_per_tok": 0}, "the router picks 0 experts per token of 8"),
    ({"num_experts_per_tok": 20}, "the router picks 20 experts per token of 8"),
])
def test_config_values_no_model_can_use_are_refused(
        good: Path, tmp_path: Path, change: dict[str, object], match: str) -> None:
    directory = _copy(good, tmp_path)
    config = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    (directory / "config.json").write_text(json.dumps({**config, **change}), encoding="utf-8")
    with pytest.raises(ValueError, match=match):
        checkpoint_hash(directory)
    with pytest.raises(ValueError):
        load_checkpoint(directory)


@pytest.mark.parametrize("group", [None, [1], {"0": 3}, {"x": [1]}])
def test_an_expert_pack_with_a_malformed_group_is_refused(tmp_path: Path, group: object) -> None:
    save_file({"layers.0.experts.1.down_proj": torch.zeros(1)}, str(tmp_path / PACK_TENSORS))
    manifest = {"format": PACK_FORMAT} if group is None else {"format": PACK_FORMAT, "group": group}
    (tmp_path / PACK_MANIFEST).write_text(json.dumps(manifest), encoding="utf-8")
    with pytest.raises(ValueError, match="the manifest's group is not"):
        read_expert_pack(tmp_path)

"""Loading the compressed model Θ̃0 straight from a checkpoint: the same model as cutting the full one.

`load_compressed` never reads the unselected experts of the group layers; what it builds must equal,
tensor for tensor, `compress` of the fully loaded checkpoint, and train to the same blob.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from training.adapters import adapter_for
from training.blob import BlobMeta, encode_blob
from training.checkpoint import Stored, meta_model, model_sources, read_rows
from training.compressed import CompressedModel, compress, count_expert_rows
from training.experts import parse_name
from training.model import StoredExperts, load_checkpoint, load_compressed
from training.tiny import build_tiny_model, tiny_config
from training.trainer import TrainConfig, train_experts

from .conftest import pattern_sequences


def save_tiny(directory: Path, family: str, dtype: torch.dtype = torch.float32, shard: str | None = None) -> None:
    model = build_tiny_model(family, tiny_config(family), 5).to(dtype)
    model.save_pretrained(str(directory), **({"max_shard_size": shard} if shard else {}))


def group_of(directory: Path) -> dict[int, list[int]]:
    """Experts 1, 3 and 6 of the first MoE layer (given out of order) and expert 2 of the second."""
    meta = meta_model(directory)
    first, second = adapter_for(meta.config.model_type).moe_layers(meta)[:2]
    return {first: [6, 1, 3], second: [2]}


def assert_same_model(a: CompressedModel, b: CompressedModel) -> None:
    left, right = a.model.state_dict(), b.model.state_dict()
    assert list(left) == list(right)
    for name in left:
        assert left[name].dtype == right[name].dtype and left[name].shape == right[name].shape, name
        assert torch.equal(left[name], right[name]), name
    assert a.group == b.group


@pytest.mark.parametrize("family", ["qwen3_moe", "olmoe", "deepseek_v3"])
def test_equals_compressing_the_full_model_and_holds_only_the_group(family: str, tmp_path: Path) -> None:
    save_tiny(tmp_path, family)
    group = group_of(tmp_path)
    full = load_checkpoint(tmp_path, attn_implementation="eager")
    expected = compress(full, adapter_for(family), group)
    loaded = load_compressed(tmp_path, group, attn_implementation="eager")
    assert_same_model(loaded, expected)
    rows = count_expert_rows(loaded.model, loaded.adapter)
    assert {layer: rows[layer] for layer in group} == {layer: len(ids) for layer, ids in group.items()}
    assert all(rows[layer] == 8 for layer in rows if layer not in group)
    assert all(t.device.type == "cpu" for t in (*loaded.model.parameters(), *loaded.model.buffers()))
    ids = pattern_sequences(2, 16, seed=3)
    with torch.no_grad():
        assert torch.equal(loaded.model(ids).logits, expected.model(ids).logits)


def test_unselected_experts_are_never_read(tmp_path: Path) -> None:
    """Poison every unselected expert of the group layers on disk: the loaded model does not change."""
    save_tiny(tmp_path, "olmoe")
    group = group_of(tmp_path)
    clean = load_compressed(tmp_path, group)
    sources = model_sources(tmp_path)
    path = tmp_path / "model.safetensors"
    tensors = load_file(str(path))
    poisoned = 0
    for layer, ids in group.items():
        for param in ("gate_up_proj", "down_proj"):
            for part in sources[f"model.layers.{layer}.mlp.experts.{param}"]:
                expert = int(part.key.split(".experts.")[1].split(".")[0])
                if expert not in ids:
                    tensors[part.key] = torch.full_like(tensors[part.key], float("nan"))
                    poisoned += 1
    assert poisoned == 3 * (8 - 3) + 3 * (8 - 1)
    save_file(tensors, str(path), metadata={"format": "pt"})
    assert_same_model(load_compressed(tmp_path, group), clean)
    full = load_checkpoint(tmp_path)
    assert all(clean.adapter.experts(full, layer).down_proj.isnan().any() for layer in group), "poison landed"


@pytest.mark.parametrize(("family", "dtype", "shard"), [("olmoe", torch.float32, None),
                                                       ("mixtral", torch.bfloat16, "100KB")])
def test_stored_experts_read_the_kept_rows_one_tensor_at_a_time(
    family: str, dtype: torch.dtype, shard: str | None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A compressed miner's genesis, read from the checkpoint when asked: the loaded model's rows, in their dtype."""
    save_tiny(tmp_path, family, dtype, shard)
    group = group_of(tmp_path)
    expected = load_compressed(tmp_path, group).tensors(dtype)
    reads: list[list[int]] = []

    def counted(parts: list[Stored], shape: tuple[int, ...], rows: list[int]) -> torch.Tensor:
        reads.append(rows)
        return read_rows(parts, shape, rows)

    monkeypatch.setattr("training.model.read_rows", counted)
    stored = StoredExperts(tmp_path, group)
    assert list(stored) == list(expected) and len(stored) == len(expected) == 2 * 4
    assert stored.shapes == {name: tuple(t.shape) for name, t in expected.items()}
    assert reads == [], "the names and shapes are known without reading a tensor"
    for name, tensor in expected.items():
        read = stored[name]
        assert read.dtype == dtype and torch.equal(read, tensor), name
    assert reads == [[parse_name(name)[1]] for name in expected], "one expert's rows a read, nothing kept"
    with pytest.raises(KeyError):
        stored["layers.0.experts.0.gate_up_proj"]


def test_bf16_sharded_checkpoint_keeps_its_dtype(tmp_path: Path) -> None:
    save_tiny(tmp_path, "mixtral", torch.bfloat16, shard="100KB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 2
    group = group_of(tmp_path)
    loaded = load_compressed(tmp_path, group)
    assert {t.dtype for t in loaded.model.parameters()} == {torch.bfloat16}
    assert_same_model(loaded, compress(load_checkpoint(tmp_path), loaded.adapter, group))
    wide = load_compressed(tmp_path, group, dtype=torch.float32)
    assert {t.dtype for t in wide.model.parameters()} == {torch.float32}
    assert_same_model(wide, compress(load_checkpoint(tmp_path, dtype=torch.float32), loaded.adapter, group))


def test_unknown_expert_is_refused(tmp_path: Path) -> None:
    save_tiny(tmp_path, "qwen3_moe")
    with pytest.raises(ValueError, match=r"experts \[8\] do not exist"):
        load_compressed(tmp_path, {0: [1, 8]})


@pytest.mark.parametrize("family", ["qwen3_moe", "olmoe"])
def test_trains_to_the_same_blob_as_the_full_model_cut_each_round(family: str, tmp_path: Path) -> None:
    save_tiny(tmp_path, family)
    group = group_of(tmp_path)
    cfg = TrainConfig(steps=3, lr=1e-2, weight_decay=0.1, batch_size=4, forward="compressed")
    data = pattern_sequences(12, 24, seed=7)
    full = load_checkpoint(tmp_path, attn_implementation="eager")
    old = train_experts(full, adapter_for(family), group, iter(data.split(4)), cfg)
    loaded = load_compressed(tmp_path, group, attn_implementation="eager")
    new = train_experts(loaded, loaded.adapter, group, iter(data.split(4)), cfg)
    assert old.losses == new.losses
    meta = BlobMeta(network="n", round=0, miner="m", base="b", group={k: list(v) for k, v in group.items()})
    assert encode_blob(new.tensors, meta) == encode_blob(old.tensors, meta)
    held = loaded.tensors()
    assert list(held) == list(new.tensors) and all(torch.equal(new.tensors[n], t) for n, t in held.items())


def test_fused_key_checkpoint_reads_only_the_selected_rows(tmp_path: Path) -> None:
    """A checkpoint holding the fused [E, ...] tensors under the model's own names (not hub per-expert keys)."""
    model = build_tiny_model("qwen3_moe", tiny_config("qwen3_moe"), 6)
    model.save_pretrained(str(tmp_path))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp_path / "model.safetensors"),
              metadata={"format": "pt"})
    assert "model.layers.0.mlp.experts.gate_up_proj" in load_file(str(tmp_path / "model.safetensors"))
    group = group_of(tmp_path)
    loaded = load_compressed(tmp_path, group)
    assert_same_model(loaded, compress(model, loaded.adapter, group))

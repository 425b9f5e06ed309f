"""Adapters and model loading on tiny models of all four families: determinism, hub checkpoints, base."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from protocol.spec import parse_spec
from training.adapters import ADAPTERS, adapter_for
from training.model import (
    BaseMismatchError,
    build_tiny_model,
    load_base,
    load_checkpoint,
    state_hash,
    tiny_config,
)

FAMILIES = tuple(ADAPTERS)
HUB_NAMES = {"mixtral": ("block_sparse_moe", "w1", "w3", "w2")}


def hub_state_dict(tiny: Any) -> dict[str, torch.Tensor]:
    """The model's weights with experts split per expert, the way hub checkpoints store them."""
    block, gate_name, up_name, down_name = HUB_NAMES.get(
        tiny.family, ("mlp", "gate_proj", "up_proj", "down_proj")
    )
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tiny.model.state_dict().items():
        prefix, _, param = name.rpartition(".")
        if param in ("gate_up_proj", "down_proj") and prefix.endswith(".mlp.experts"):
            hub_prefix = prefix.replace(".mlp.", f".{block}.")
            for e in range(tensor.shape[0]):
                if param == "gate_up_proj":
                    gate, up = tensor[e].chunk(2, dim=0)
                    out[f"{hub_prefix}.{e}.{gate_name}.weight"] = gate.clone()
                    out[f"{hub_prefix}.{e}.{up_name}.weight"] = up.clone()
                else:
                    out[f"{hub_prefix}.{e}.{down_name}.weight"] = tensor[e].clone()
        else:
            out[name.replace(".mlp.gate.", f".{block}.gate.")] = tensor.clone()
    return out


def write_checkpoint(tiny: Any, directory: Path, shards: int = 1) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(tiny.model.config.to_json_string(), encoding="utf-8")
    state = hub_state_dict(tiny)
    names = sorted(state)
    if shards == 1:
        save_file(state, str(directory / "model.safetensors"))
        return directory
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = names[i::shards]
        save_file({n: state[n] for n in part}, str(directory / file))
        weight_map.update(dict.fromkeys(part, file))
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": weight_map}), encoding="utf-8"
    )
    return directory


@pytest.mark.parametrize("family", FAMILIES)
def test_build_is_deterministic(family: str) -> None:
    config = tiny_config(family)
    json.dumps(config)
    a, b = build_tiny_model(family, config, 11), build_tiny_model(family, config, 11)
    assert state_hash(a) == state_hash(b)
    assert state_hash(a) != state_hash(build_tiny_model(family, config, 12))
    assert not a.training and a.config._attn_implementation == "eager"
    assert all(p.dtype == torch.float32 for p in a.parameters())


def test_state_hash_covers_persistent_buffers(make_tiny: Callable[..., Any]) -> None:
    tiny = make_tiny("deepseek_v3")
    before = state_hash(tiny.model)
    bias = tiny.adapter.router(tiny.model, tiny.adapter.moe_layers(tiny.model)[0]).e_score_correction_bias
    bias[0] = 1e-3
    assert state_hash(tiny.model) != before


def test_layout(tiny: Any) -> None:
    model, adapter = tiny.model, tiny.adapter
    layers = adapter.moe_layers(model)
    assert layers == ([1, 2] if tiny.family == "deepseek_v3" else [0, 1])
    assert adapter.num_experts(model) == 8
    experts = adapter.experts(model, layers[0])
    hidden = model.config.hidden_size
    assert experts.gate_up_proj.shape[0] == 8 and experts.gate_up_proj.shape[2] == hidden
    assert experts.down_proj.shape[1] == hidden
    assert adapter.router(model, layers[0]).weight.shape == (8, hidden)
    shared = adapter.shared_expert_params(model, layers[0])
    assert bool(shared) == (tiny.family == "deepseek_v3")
    names = dict(model.named_parameters())
    assert all(names[n] is p for n, p in shared.items())
    if tiny.family == "deepseek_v3":
        with pytest.raises(ValueError, match="dense"):
            adapter.experts(model, 0)


def test_qwen3_mlp_only_layers_are_not_moe() -> None:
    model = build_tiny_model(
        "qwen3_moe", tiny_config("qwen3_moe", num_hidden_layers=3, mlp_only_layers=[1]), 0
    )
    assert adapter_for("qwen3_moe").moe_layers(model) == [0, 2]


def test_hub_checkpoint_loads_into_fused_layout(tiny: Any, tmp_path: Path) -> None:
    directory = write_checkpoint(tiny, tmp_path / "ckpt")
    loaded = load_checkpoint(tiny.family, directory)
    assert state_hash(loaded) == state_hash(tiny.model)
    ids = torch.arange(24).reshape(2, 12)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, tiny.model(ids).logits, rtol=0, atol=0)


def test_sharded_checkpoint_and_gate_up_order(make_tiny: Callable[..., Any], tmp_path: Path) -> None:
    tiny = make_tiny("qwen3_moe")
    loaded = load_checkpoint("qwen3_moe", write_checkpoint(tiny, tmp_path / "ckpt", shards=3))
    assert state_hash(loaded) == state_hash(tiny.model)
    hub = hub_state_dict(tiny)
    fused = tiny.adapter.experts(loaded, 1).gate_up_proj[5]
    intermediate = fused.shape[0] // 2
    assert torch.equal(fused[:intermediate], hub["model.layers.1.mlp.experts.5.gate_proj.weight"])
    assert torch.equal(fused[intermediate:], hub["model.layers.1.mlp.experts.5.up_proj.weight"])


def test_checkpoint_errors_are_clear(make_tiny: Callable[..., Any], tmp_path: Path) -> None:
    tiny = make_tiny("mixtral")
    directory = write_checkpoint(tiny, tmp_path / "ckpt")
    state = hub_state_dict(tiny)
    del state["model.layers.0.block_sparse_moe.experts.7.w2.weight"]
    save_file(state, str(directory / "model.safetensors"))
    with pytest.raises(ValueError, match=r"w2 experts .*missing \[7\]"):
        load_checkpoint("mixtral", directory)
    with pytest.raises(ValueError, match="no config.json"):
        load_checkpoint("mixtral", tmp_path)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text(tiny.model.config.to_json_string(), encoding="utf-8")
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        load_checkpoint("mixtral", tmp_path / "empty")
    with pytest.raises(ValueError, match="family is 'olmoe'"):
        load_checkpoint("olmoe", directory)
    with pytest.raises(ValueError, match="unknown model family"):
        adapter_for("llama")


def _spec(
    tmp_path: Path, spec_dict: dict, base_hash: str, group: dict[str, list[int]]
) -> tuple[object, Path]:
    (tmp_path / "tiny.json").write_text(json.dumps(tiny_config("qwen3_moe")), encoding="utf-8")
    spec_dict["model"] = {
        "family": "qwen3_moe",
        "config": "tiny.json",
        "init_seed": 7,
        "base_hash": base_hash,
    }
    spec_dict["group"] = group
    return parse_spec(spec_dict), tmp_path / "spec.toml"


def test_load_base_checks_the_hash(tmp_path: Path, spec_dict: dict) -> None:
    expected = state_hash(build_tiny_model("qwen3_moe", tiny_config("qwen3_moe"), 7))
    spec, path = _spec(tmp_path, spec_dict, expected, {"0": [1, 3], "1": [0]})
    model, adapter = load_base(spec, path)
    assert state_hash(model) == expected and adapter.family == "qwen3_moe"
    spec, path = _spec(tmp_path, spec_dict, "ab" * 32, {"0": [1]})
    with pytest.raises(BaseMismatchError) as err:
        load_base(spec, path)
    assert expected in str(err.value) and "ab" * 32 in str(err.value)
    spec, path = _spec(tmp_path, spec_dict, expected, {"0": [8]})
    with pytest.raises(ValueError, match=r"experts \[8\] do not exist"):
        load_base(spec, path)

"""Adapters on tiny models of every family: determinism, layout, shared experts, routing, refusals, base."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from protocol.spec import parse_spec
from training.adapters import ADAPTERS, adapter_for, family_of
from training.model import BaseMismatchError, load_base, state_hash
from training.tiny import build_tiny_model, tiny_config

FAMILIES = tuple(ADAPTERS)
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
    dense_first = tiny.family in ("deepseek_v3", "deepseek_v2")
    assert layers == ([1, 2] if dense_first else [0, 1])
    assert adapter.num_experts(model) == 8
    experts = adapter.experts(model, layers[0])
    hidden = model.config.hidden_size
    assert experts.gate_up_proj.shape[0] == 8 and experts.gate_up_proj.shape[2] == hidden
    assert experts.down_proj.shape[1] == hidden
    assert adapter.router(model, layers[0]).weight.shape == (8, hidden)
    shared = adapter.shared_expert_params(model, layers[0])
    assert bool(shared) == (tiny.family in ("deepseek_v3", "deepseek_v2", "qwen2_moe"))
    names = dict(model.named_parameters())
    assert all(names[n] is p for n, p in shared.items())
    if dense_first:
        with pytest.raises(ValueError, match="dense"):
            adapter.experts(model, 0)


def test_qwen3_mlp_only_layers_are_not_moe() -> None:
    model = build_tiny_model(
        "qwen3_moe", tiny_config("qwen3_moe", num_hidden_layers=3, mlp_only_layers=[1]), 0
    )
    assert adapter_for("qwen3_moe").moe_layers(model) == [0, 2]


def test_new_families_layout_and_shared_experts() -> None:
    qwen2 = build_tiny_model("qwen2_moe", tiny_config("qwen2_moe"), 0)
    shared = adapter_for("qwen2_moe").shared_expert_params(qwen2, 0)
    assert "model.layers.0.mlp.shared_expert_gate.weight" in shared
    assert any(".shared_expert.gate_proj." in name for name in shared)
    deepseek = build_tiny_model("deepseek_v2", tiny_config("deepseek_v2"), 0)
    adapter = adapter_for("deepseek_v2")
    assert adapter.moe_layers(deepseek) == [1, 2] and adapter.num_experts(deepseek) == 8
    assert all(".shared_experts." in name for name in adapter.shared_expert_params(deepseek, 1))


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}, "dense model with no routed experts"),
        ({"model_type": "gpt_oss", "num_local_experts": 32}, "transposed"),
        ({"model_type": "dbrx", "num_experts": 16}, "no table entry"),
        ({"hidden_size": 8}, "no model_type"),
    ],
)
def test_unsupported_configs_say_what_was_found(config: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        family_of(config)
    assert family_of({"model_type": "qwen2_moe"}) == "qwen2_moe"


def test_route_keeps_deepseek_v2_unnormalised_and_scaled() -> None:
    model = build_tiny_model("deepseek_v2", tiny_config("deepseek_v2", routed_scaling_factor=2.0), 0)
    adapter = adapter_for("deepseek_v2")
    router = adapter.router(model, 1)
    hidden = torch.randn(5, 64, generator=torch.Generator().manual_seed(0))
    allowed = torch.ones(8, dtype=torch.bool)
    _, weights, index = adapter.route(router, hidden, allowed)
    _, expected_weights, expected_index = router(hidden)
    order, expected_order = index.sort(dim=-1).indices, expected_index.sort(dim=-1).indices
    assert torch.equal(index.gather(1, order), expected_index.gather(1, expected_order))
    torch.testing.assert_close(weights.gather(1, order), expected_weights.gather(1, expected_order))
    assert (weights.sum(dim=-1) < 2.0).all()


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


@pytest.mark.parametrize("family", FAMILIES)
def test_route_with_every_expert_is_the_routers_own_in_bf16(family: str) -> None:
    overrides = {"routed_scaling_factor": 2.5} if family.startswith("deepseek") else {}
    model = build_tiny_model(family, tiny_config(family, **overrides), 0).to(torch.bfloat16)
    adapter = adapter_for(family)
    router = adapter.router(model, adapter.moe_layers(model)[0])
    hidden = torch.randn(9, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    logits, weights, index = adapter.route(router, hidden, torch.ones(8, dtype=torch.bool))
    own_logits, own_weights, own_index = router(hidden)
    assert (logits.dtype, weights.dtype) == (own_logits.dtype, own_weights.dtype)
    assert torch.equal(logits, own_logits)
    order, own_order = index.sort(dim=-1).indices, own_index.sort(dim=-1).indices
    assert torch.equal(index.gather(1, order), own_index.gather(1, own_order))
    assert torch.equal(weights.gather(1, order), own_weights.gather(1, own_order))

"""Expert selection on a tiny model with a planted routing bias: every rule finds the planted experts.

The bias: two embedding coordinates are overwritten, `k` constant for every token and `j` positive
on arithmetic bytes (digits and operators) and negative elsewhere. In every MoE layer the router
row of expert U reads `k` (U is popular everywhere), A reads `+j` (arithmetic) and B reads `-j`
(everything else); all other router weights on those coordinates are zeroed.
"""

from __future__ import annotations

import pytest
import torch

from training.adapters import adapter_for
from training.corpus import generate
from training.data import pack
from training.selection import choose, routing_stats, select_experts
from training.tiny import build_tiny_model, tiny_config
from training.tokenizer import ByteTokenizer

U, A, B = 5, 2, 6
J, K = 3, 7
ARITH_BYTES = [ord(c) for c in "0123456789+-*()="]


def _planted(family: str) -> tuple[torch.nn.Module, object]:
    model = build_tiny_model(family, tiny_config(family), seed=0)
    adapter = adapter_for(family)
    with torch.no_grad():
        emb = model.get_input_embeddings().weight
        emb[:, K] = 4.0
        emb[:, J] = -4.0
        emb[ARITH_BYTES, J] = 4.0
        for layer in adapter.moe_layers(model):
            w = adapter.router(model, layer).weight
            w[:, J] = 0.0
            w[:, K] = 0.0
            w[U, K] = 2.0
            w[A, J] = 2.0
            w[B, J] = -2.0
    return model, adapter


def _data(domain: str, n: int = 12) -> torch.Tensor:
    return pack(generate(domain, 60, seed=11), ByteTokenizer(), 64)[:n]


@pytest.fixture(scope="module")
def qwen() -> tuple[torch.nn.Module, object]:
    return _planted("qwen3_moe")


@pytest.mark.parametrize("rule", ["gate-mass", "token-freq", "activation-norm"])
def test_domain_rules_pick_the_planted_experts(qwen: tuple[torch.nn.Module, object], rule: str) -> None:
    model, adapter = qwen
    out = select_experts(model, adapter, _data("arithmetic"), rule, top_d=2)
    layers = [str(layer) for layer in adapter.moe_layers(model)]
    assert list(out["group"]) == layers
    assert all(out["group"][layer] == sorted([U, A]) for layer in layers)
    assert out["rule"] == rule and out["budget"] == {"top_d": 2}
    assert all(len(out["stats"][layer]) == adapter.num_experts(model) for layer in layers)
    by_mass = select_experts(model, adapter, _data("arithmetic"), rule, mass=0.75)
    assert all(by_mass["group"][layer] == sorted([U, A]) for layer in layers)


def test_general_data_routes_to_the_other_planted_expert(qwen: tuple[torch.nn.Module, object]) -> None:
    model, adapter = qwen
    out = select_experts(model, adapter, _data("prose"), "gate-mass", top_d=2)
    assert all(ids == sorted([U, B]) for ids in out["group"].values())


def test_differential_drops_the_expert_popular_everywhere(qwen: tuple[torch.nn.Module, object]) -> None:
    model, adapter = qwen
    domain, general = _data("arithmetic"), _data("prose")
    top1 = select_experts(model, adapter, domain, "differential", top_d=1, general=general)
    assert all(ids == [A] for ids in top1["group"].values())
    by_mass = select_experts(model, adapter, domain, "differential", mass=0.75, general=general)
    assert all(ids == [A] for ids in by_mass["group"].values())
    with pytest.raises(ValueError, match="needs general data"):
        select_experts(model, adapter, domain, "differential", top_d=1)


def test_statistics_are_normalised_and_exclude_padding(qwen: tuple[torch.nn.Module, object]) -> None:
    model, adapter = qwen
    data = _data("arithmetic", n=4)
    padded = data.clone()
    padded[:, 40:] = 256
    stats = routing_stats(model, adapter, padded)
    assert stats.tokens == 4 * 40
    for layer in adapter.moe_layers(model):
        assert float(stats.gate_mass[layer].sum()) == pytest.approx(1.0, abs=1e-5)
        assert float(stats.token_freq[layer].sum()) == pytest.approx(1.0, abs=1e-5)
    trimmed = routing_stats(model, adapter, data[:, :40])
    for layer in adapter.moe_layers(model):
        assert torch.allclose(stats.gate_mass[layer], trimmed.gate_mass[layer], atol=1e-5)
        assert torch.allclose(stats.token_freq[layer], trimmed.token_freq[layer], atol=1e-6)


@pytest.mark.parametrize("family", ["olmoe", "mixtral", "deepseek_v3"])
def test_other_families_normalise_and_find_the_planted_experts(family: str) -> None:
    model, adapter = _planted(family)
    stats = routing_stats(model, adapter, _data("arithmetic"))
    for layer in adapter.moe_layers(model):
        assert float(stats.gate_mass[layer].sum()) == pytest.approx(1.0, abs=1e-5)
    out = select_experts(model, adapter, _data("arithmetic"), "gate-mass", top_d=2)
    assert all(ids == sorted([U, A]) for ids in out["group"].values())


def test_choose_budgets() -> None:
    scores = torch.tensor([0.125, 0.5, 0.0625, 0.25, 0.0625])
    assert choose(scores, top_d=2) == [1, 3]
    assert choose(scores, top_d=4) == [0, 1, 2, 3]
    assert choose(scores, mass=0.75) == [1, 3]
    assert choose(scores, mass=0.76) == [0, 1, 3]
    assert choose(torch.tensor([0.2, -0.5, 0.2]), top_d=1) == [0]
    with pytest.raises(ValueError, match="no expert has a positive score"):
        choose(torch.tensor([-0.1, -0.2]), mass=0.5)
    with pytest.raises(ValueError, match="exactly one budget"):
        choose(scores)
    with pytest.raises(ValueError, match="top_d must be between 1 and 5"):
        choose(scores, top_d=6)


@pytest.mark.parametrize(("budget", "says"), [
    ({"top_d": 0}, "top_d must be between 1 and 8, got 0"),
    ({"top_d": 9}, "top_d must be between 1 and 8, got 9"),
    ({"mass": 0.0}, r"mass must be in \(0, 1\], got 0.0"),
    ({"mass": 1.5}, r"mass must be in \(0, 1\], got 1.5"),
])
def test_a_bad_budget_is_refused_before_any_forward(qwen: tuple[torch.nn.Module, object],
                                                    budget: dict[str, float], says: str) -> None:
    model, adapter = qwen
    forwards: list[int] = []
    handle = model.register_forward_hook(lambda *_: forwards.append(1))
    try:
        with pytest.raises(ValueError, match=says):
            select_experts(model, adapter, _data("arithmetic"), "gate-mass", mode="layerwise", **budget)
    finally:
        handle.remove()
    assert forwards == []

"""The physically compressed model: what it holds, that it computes the masked-routing loss, slot maps."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from training.compressed import compress, count_expert_rows, masked_routing
from training.evaluate import heldout_loss
from training.experts import extract, parse_name
from training.model import state_hash


def randomise_router_bias(tiny: Any) -> None:
    if tiny.family == "deepseek_v3":
        gen = torch.Generator().manual_seed(4)
        for layer in tiny.adapter.moe_layers(tiny.model):
            bias = tiny.adapter.router(tiny.model, layer).e_score_correction_bias
            bias.copy_(0.01 * torch.randn(bias.shape, generator=gen))


def test_holds_no_unselected_expert_parameters(tiny: Any) -> None:
    model, adapter, group = tiny.model, tiny.adapter, tiny.group
    full_hash = state_hash(model)
    cm = compress(model, adapter, group)
    moe_layers = adapter.moe_layers(model)
    n_experts = adapter.num_experts(model)
    assert count_expert_rows(cm.model, adapter) == {
        layer: len(group[layer]) if layer in group else n_experts for layer in moe_layers
    }
    assert all(adapter.router(cm.model, layer).weight.shape[0] == len(group[layer]) for layer in group)
    expert_params = [
        p for layer in moe_layers for p in adapter.experts(cm.model, layer).parameters()
    ]
    one_expert = sum(p[0].numel() for p in adapter.experts(model, moe_layers[0]).parameters())
    kept = sum(len(group.get(layer, range(n_experts))) for layer in moe_layers)
    assert sum(p.numel() for p in expert_params) == kept * one_expert
    full_count = sum(p.numel() for p in model.parameters())
    dropped = sum(n_experts - len(e) for e in group.values()) * one_expert
    router_rows = sum(n_experts - len(e) for e in group.values()) * model.config.hidden_size
    assert sum(p.numel() for p in cm.model.parameters()) == full_count - dropped - router_rows
    assert state_hash(model) == full_hash, "compress must not modify the full model"


def test_shares_frozen_weights_on_the_same_device(make_tiny: Callable[..., Any]) -> None:
    tiny = make_tiny("qwen3_moe")
    cm = compress(tiny.model, tiny.adapter, tiny.group)
    assert cm.model.model.embed_tokens.weight is tiny.model.model.embed_tokens.weight
    layer = next(iter(tiny.group))
    assert cm.experts(layer).gate_up_proj is not tiny.adapter.experts(tiny.model, layer).gate_up_proj


def test_loss_equals_the_masked_routing_loss_of_the_full_model(
    tiny: Any, pattern: Callable[..., torch.Tensor]
) -> None:
    model, adapter, group = tiny.model, tiny.adapter, tiny.group
    randomise_router_bias(tiny)
    data = pattern(6, 32, 7, pad_tail=3)
    compressed = heldout_loss(compress(model, adapter, group).model, data, batch_size=3)
    unmasked = heldout_loss(model, data, batch_size=3)
    handles = masked_routing(model, adapter, group)
    masked = heldout_loss(model, data, batch_size=3)
    for handle in handles:
        handle.remove()
    assert compressed.tokens == masked.tokens
    assert compressed.loss == pytest.approx(masked.loss, abs=1e-6)
    assert abs(unmasked.loss - masked.loss) > 1e-5, "the group must change routing for this test to mean anything"


def test_slots_map_to_full_expert_ids(make_tiny: Callable[..., Any]) -> None:
    tiny = make_tiny("olmoe")
    cm = compress(tiny.model, tiny.adapter, {0: [5, 1], 1: [2]})
    assert cm.group == {0: (1, 5), 1: (2,)}
    assert cm.full_ids(0, torch.tensor([[1, 0]])).tolist() == [[5, 1]]
    assert cm.slot(0, 5) == 1
    with pytest.raises(ValueError, match="keeps experts"):
        cm.slot(0, 3)
    with pytest.raises(ValueError, match="not in the compressed model's group"):
        cm.slot(7, 0)
    tensors = cm.tensors()
    assert tensors.keys() == extract(tiny.model, tiny.adapter, {0: [1, 5], 1: [2]}).keys()
    assert all(torch.equal(t, extract(tiny.model, tiny.adapter, {0: [1, 5], 1: [2]})[n]) for n, t in tensors.items())


def test_load_writes_blob_tensors_into_their_slots(make_tiny: Callable[..., Any]) -> None:
    tiny = make_tiny("mixtral")
    cm = compress(tiny.model, tiny.adapter, tiny.group)
    new = {name: torch.full_like(t, float(parse_name(name)[1])) for name, t in cm.tensors().items()}
    cm.load(new)
    assert all(torch.equal(cm.tensors()[n], t) for n, t in new.items())
    bad = dict(new)
    name = sorted(bad)[0]
    bad[name] = bad[name][:-1]
    before = cm.tensors()
    with pytest.raises(ValueError, match="shape"):
        cm.load({**{n: t + 1 for n, t in new.items()}, name: bad[name]})
    assert all(torch.equal(cm.tensors()[n], t) for n, t in before.items()), "nothing may be half-written"


def test_compress_onto_meta_never_touches_unselected_rows(make_tiny: Callable[..., Any]) -> None:
    tiny = make_tiny("deepseek_v3")
    cm = compress(tiny.model, tiny.adapter, tiny.group, device="meta")
    assert {p.device.type for p in cm.model.parameters()} == {"meta"}
    assert {p.device.type for p in tiny.model.parameters()} == {"cpu"}
    layer = next(iter(tiny.group))
    assert cm.experts(layer).num_experts == len(tiny.group[layer])
    with pytest.raises(ValueError, match="do not exist"):
        compress(tiny.model, tiny.adapter, {layer: [99]})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_keeping_every_expert_gives_the_models_own_logits(tiny: Any, dtype: torch.dtype) -> None:
    """Bit-equal in bf16 too: `route` must give logits and weights the dtypes of each family's own router.

    Exact, not within a tolerance: with every expert kept the compressed model runs the same operations
    on the same bytes as the full model, so any difference is a routing difference (in bf16, Mixtral's
    fp32 top-k weights and DeepSeek-V2's fp32 router logits were each worth ~1e-2 in the logits).
    """
    randomise_router_bias(tiny)
    model, adapter = tiny.model.to(dtype), tiny.adapter
    every = {layer: list(range(adapter.num_experts(model))) for layer in adapter.moe_layers(model)}
    ids = torch.randint(0, 256, (3, 32), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        own = model(input_ids=ids).logits
        compressed = compress(model, adapter, every).model(input_ids=ids).logits
        handles = masked_routing(model, adapter, every)
        masked = model(input_ids=ids).logits
        for handle in handles:
            handle.remove()
    assert own.dtype == dtype
    assert torch.equal(compressed, own)
    assert torch.equal(masked, own)

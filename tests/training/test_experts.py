"""Expert slicing on tiny models: names, shapes, bit-exact extract/insert, validation, pseudo-gradients."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from training.experts import (
    check_group,
    expected_shapes,
    expert_names,
    extract,
    flatten,
    group_from_spec,
    insert,
    parse_name,
    pseudo_gradient,
)
from training.model import state_hash


def test_names_are_sorted_and_parse_back() -> None:
    names = expert_names({10: [0], 2: [3, 1]})
    assert names == sorted(names)
    assert names[0] == "layers.10.experts.0.down_proj"
    assert len(names) == 6
    assert parse_name("layers.2.experts.3.gate_up_proj") == (2, 3, "gate_up_proj")
    with pytest.raises(ValueError, match="not an expert tensor name"):
        parse_name("layers.2.experts.3.up_proj")


def test_group_from_spec(spec: Any) -> None:
    assert group_from_spec(spec) == {0: [1, 3], 1: [0]}


def test_shapes_and_extract(tiny: Any) -> None:
    model, adapter, group = tiny.model, tiny.adapter, tiny.group
    shapes = expected_shapes(model, adapter, group)
    assert list(shapes) == expert_names(group)
    hidden, inter = model.config.hidden_size, adapter.experts(model, min(group)).down_proj.shape[2]
    assert set(shapes.values()) == {(2 * inter, hidden), (hidden, inter)}
    tensors = extract(model, adapter, group)
    assert {n: tuple(t.shape) for n, t in tensors.items()} == shapes
    layer = min(group)
    fused = adapter.experts(model, layer).gate_up_proj
    assert torch.equal(tensors[f"layers.{layer}.experts.3.gate_up_proj"], fused[3])
    assert all(t.is_contiguous() and t.device.type == "cpu" for t in tensors.values())
    tensors[f"layers.{layer}.experts.3.gate_up_proj"].zero_()
    assert not torch.equal(fused[3], torch.zeros_like(fused[3])), "extract must copy, not view"
    assert (
        extract(model, adapter, group, dtype=torch.bfloat16)[expert_names(group)[0]].dtype == torch.bfloat16
    )


def test_insert_round_trips_bit_exactly(tiny: Any) -> None:
    model, adapter, group = tiny.model, tiny.adapter, tiny.group
    original_hash = state_hash(model)
    original = extract(model, adapter, group)
    gen = torch.Generator().manual_seed(1)
    new = {n: torch.randn(t.shape, generator=gen) for n, t in original.items()}
    insert(model, adapter, new)
    back = extract(model, adapter, group)
    assert all(torch.equal(back[n], new[n]) for n in new)
    layer = min(group)
    untouched = adapter.experts(model, layer).gate_up_proj[0]
    assert torch.equal(
        untouched, extract(tiny.model, adapter, {layer: [0]})[f"layers.{layer}.experts.0.gate_up_proj"]
    )
    insert(model, adapter, original)
    assert state_hash(model) == original_hash


def test_insert_validates_everything_before_writing(tiny: Any) -> None:
    model, adapter, group = tiny.model, tiny.adapter, tiny.group
    before = state_hash(model)
    good = {n: t + 1 for n, t in extract(model, adapter, group).items()}
    layer = min(group)
    cases = {
        "shape": {f"layers.{layer}.experts.1.down_proj": torch.zeros(3, 3)},
        "does not exist": {
            f"layers.{layer}.experts.8.down_proj": good[f"layers.{layer}.experts.1.down_proj"]
        },
        "not an MoE layer": {"layers.9.experts.1.down_proj": good[f"layers.{layer}.experts.1.down_proj"]},
        "not an expert tensor name": {"model.embed_tokens.weight": torch.zeros(1)},
    }
    for message, bad in cases.items():
        with pytest.raises(ValueError, match=message):
            insert(model, adapter, {**good, **bad})
        assert state_hash(model) == before


def test_check_group_rejects_bad_groups(tiny: Any) -> None:
    with pytest.raises(ValueError, match="empty"):
        check_group(tiny.model, tiny.adapter, {})
    with pytest.raises(ValueError, match="not an MoE layer"):
        check_group(tiny.model, tiny.adapter, {7: [0]})
    with pytest.raises(ValueError, match="distinct"):
        check_group(tiny.model, tiny.adapter, {min(tiny.group): [1, 1]})


def test_pseudo_gradient_and_flatten() -> None:
    global_t = {"b": torch.tensor([[1.0, 2.0]]), "a": torch.tensor([0.5], dtype=torch.bfloat16)}
    miner_t = {"a": torch.tensor([0.25]), "b": torch.tensor([[0.0, 3.0]])}
    grad = pseudo_gradient(global_t, miner_t)
    assert grad["a"].dtype == torch.float32 and grad["a"].tolist() == [0.25]
    assert grad["b"].tolist() == [[1.0, -1.0]]
    assert flatten(grad).tolist() == [0.25, 1.0, -1.0]
    with pytest.raises(ValueError, match="missing"):
        pseudo_gradient(global_t, {"a": torch.zeros(1)})
    with pytest.raises(ValueError, match="shape"):
        pseudo_gradient(global_t, {"a": torch.zeros(1), "b": torch.zeros(2)})


def test_a_name_must_match_the_whole_pattern_with_numbers_of_any_length() -> None:
    assert parse_name("layers.10.experts.127.down_proj") == (10, 127, "down_proj")
    for bad in ("layers.2.experts.3.gate_up_proj.weight", "model.layers.2.experts.3.gate_up_proj",
                "layers.2.experts.3.down_proj\n"):  # a regex's `$` would take the trailing newline
        with pytest.raises(ValueError, match="not an expert tensor name"):
            parse_name(bad)


def test_check_group_refuses_a_layer_without_experts_and_ids_out_of_range(tiny: Any) -> None:
    model, adapter = tiny.model, tiny.adapter
    layer, n = min(tiny.group), adapter.num_experts(model)
    with pytest.raises(ValueError, match="expert ids must be distinct and at least one"):
        check_group(model, adapter, {layer: []})
    for bad in (n, -1):
        with pytest.raises(ValueError, match=rf"experts \[{bad}\] do not exist \(the model has {n}\)"):
            check_group(model, adapter, {layer: [0, bad]})
    check_group(model, adapter, {layer: [0, n - 1]})


def test_extract_and_expected_shapes_check_the_group_first(tiny: Any) -> None:
    bad = {min(tiny.group): [tiny.adapter.num_experts(tiny.model)]}
    for read in (extract, expected_shapes):
        with pytest.raises(ValueError, match="do not exist"):
            read(tiny.model, tiny.adapter, bad)


def test_a_dense_layer_is_refused_by_check_group_and_insert(make_tiny: Any) -> None:
    tiny = make_tiny("deepseek_v3")  # its layer 0 is a dense MLP, layers 1 and 2 are MoE
    assert tiny.adapter.moe_layers(tiny.model) == [1, 2]
    with pytest.raises(ValueError, match="group layer 0 is not an MoE layer"):
        check_group(tiny.model, tiny.adapter, {0: [1]})
    down = extract(tiny.model, tiny.adapter, {1: [1]})["layers.1.experts.1.down_proj"]
    with pytest.raises(ValueError, match="layer 0 is not an MoE layer"):
        insert(tiny.model, tiny.adapter, {"layers.0.experts.1.down_proj": down})


def test_insert_refuses_a_transposed_or_integer_tensor(tiny: Any) -> None:
    model, adapter, layer = tiny.model, tiny.adapter, min(tiny.group)
    before = state_hash(model)
    name = f"layers.{layer}.experts.1.down_proj"
    down = extract(model, adapter, tiny.group)[name]
    assert down.shape[0] != down.shape[1]
    with pytest.raises(ValueError, match=rf"shape \({down.shape[1]}, {down.shape[0]}\), the model expects"):
        insert(model, adapter, {name: down.t().contiguous()})  # the same entries, the other layout
    with pytest.raises(ValueError, match="dtype torch.int64 is not a floating-point type"):
        insert(model, adapter, {name: down.to(torch.int64)})
    assert state_hash(model) == before


def test_pseudo_gradient_of_two_bf16_sides_is_taken_in_fp32() -> None:
    global_t = {"a": torch.tensor([1.0, 512.0], dtype=torch.bfloat16)}
    miner_t = {"a": torch.tensor([0.5, 1.0], dtype=torch.bfloat16)}
    grad = pseudo_gradient(global_t, miner_t)
    assert grad["a"].dtype == torch.float32 and grad["a"].tolist() == [0.5, 511.0]  # 511 is not a bf16


def test_pseudo_gradient_refuses_extra_miner_tensors() -> None:
    global_t = {"a": torch.zeros(2)}
    with pytest.raises(ValueError, match=r"missing \[\], extra \['b'\]"):
        pseudo_gradient(global_t, {"a": torch.zeros(2), "b": torch.zeros(2)})


def test_flatten_walks_the_names_sorted_whatever_the_dict_order() -> None:
    assert flatten({"b": torch.tensor([2.0, 3.0]), "a": torch.tensor([[1.0]])}).tolist() == [1.0, 2.0, 3.0]
    empty = flatten({})
    assert empty.shape == (0,) and empty.dtype == torch.float32

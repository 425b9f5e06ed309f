"""Local expert training and held-out evaluation on tiny models of all four families."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from tests.training.rows import assert_only_the_group_changed
from training.adapters import tensor_attr
from training.blob import BlobMeta, decode_blob, encode_blob
from training.compressed import compress
from training.evaluate import heldout_loss, loss_with_experts
from training.experts import expert_names, extract, insert, tensor_name
from training.model import state_hash
from training.trainer import TrainConfig, train_experts

BATCH = 4
LENGTH = 32


def batches(data: torch.Tensor) -> Any:
    return (data[i : i + BATCH] for i in range(0, data.shape[0] - BATCH + 1, BATCH))


def randomise_router_bias(tiny: Any) -> None:
    """DeepSeek's correction bias starts at zero; make it non-trivial so a change would show."""
    if tiny.family == "deepseek_v3":
        gen = torch.Generator().manual_seed(4)
        for layer in tiny.adapter.moe_layers(tiny.model):
            bias = tiny.adapter.router(tiny.model, layer).e_score_correction_bias
            bias.copy_(0.01 * torch.randn(bias.shape, generator=gen))


@pytest.mark.parametrize("forward", ["full", "compressed"])
def test_only_selected_expert_rows_change(
    tiny: Any, pattern: Callable[..., torch.Tensor], forward: str
) -> None:
    model, adapter, group = tiny.model, tiny.adapter, tiny.group
    randomise_router_bias(tiny)
    before = {name: t.clone() for name, t in model.state_dict().items()}
    flags = {name: p.requires_grad for name, p in model.named_parameters()}
    cfg = TrainConfig(steps=4, lr=1e-2, weight_decay=0.1, batch_size=BATCH, forward=forward)
    # Data whose batches reach every group expert of every family (Mixtral's layer-1 expert 2 only just).
    result = train_experts(model, adapter, group, batches(pattern(16, LENGTH, 3)), cfg)
    assert len(result.losses) == 4 and all(torch.isfinite(torch.tensor(result.losses)))
    assert_only_the_group_changed(model, group, before)
    trained = extract(model, adapter, group)
    assert sorted(result.tensors) == sorted(trained)
    assert all(torch.equal(result.tensors[n], trained[n]) for n in trained)
    assert {name: p.requires_grad for name, p in model.named_parameters()} == flags
    assert not model.training


def test_a_batch_that_reaches_none_of_the_groups_experts_is_a_step_without_gradient(
    make_tiny: Callable[..., Any], pattern: Callable[..., torch.Tensor]
) -> None:
    # The full forward routes among all experts, so a micro-batch can miss the group (the compressed one
    # routes among the kept experts alone, so its tokens always reach them).
    tiny = make_tiny("qwen3_moe")
    layer = tiny.adapter.moe_layers(tiny.model)[0]
    shunned = 1  # the router never picks it: every token goes to another expert instead

    def route_around(module: Any, args: Any, output: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        logits, scores, indices = output
        return logits, scores, torch.where(indices == shunned, (indices + 2) % logits.shape[-1], indices)

    handle = tiny.adapter.router(tiny.model, layer).register_forward_hook(route_around)
    try:
        before = extract(tiny.model, tiny.adapter, {layer: [shunned]})
        cfg = TrainConfig(steps=3, lr=1e-2, weight_decay=0.1, batch_size=BATCH, micro_batch_size=2)
        result = train_experts(tiny.model, tiny.adapter, {layer: [shunned]}, batches(pattern(12, LENGTH, 1)), cfg)
    finally:
        handle.remove()
    assert len(result.losses) == 3 and all(torch.isfinite(torch.tensor(result.losses)))
    assert all(torch.equal(result.tensors[name], before[name]) for name in before)  # no gradient, no decay


def test_compressed_forward_computes_only_selected_experts(
    make_tiny: Callable[..., Any], pattern: Callable[..., torch.Tensor]
) -> None:
    tiny = make_tiny("qwen3_moe")
    full_hash = state_hash(tiny.model)
    cut = compress(tiny.model, tiny.adapter, tiny.group)
    seen: dict[int, set[int]] = {layer: set() for layer in tiny.group}
    handles = []
    for layer in tiny.group:

        def record(module: Any, args: tuple[Any, ...], layer: int = layer) -> None:
            seen[layer].update(cut.full_ids(layer, args[1]).unique().tolist())

        handles.append(cut.experts(layer).register_forward_pre_hook(record))
    data = pattern(24, LENGTH, 2)
    cfg = TrainConfig(steps=6, lr=2e-2, batch_size=BATCH, forward="compressed")
    result = train_experts(cut, tiny.adapter, tiny.group, batches(data), cfg)
    for handle in handles:
        handle.remove()
    assert seen == {layer: set(experts) for layer, experts in tiny.group.items()}
    assert result.losses[-1] < result.losses[0]
    assert all(torch.equal(cut.tensors()[n], t) for n, t in result.tensors.items())
    assert state_hash(tiny.model) == full_hash, "training a compressed model leaves the full model alone"
    with pytest.raises(ValueError, match="only be trained with forward = 'compressed'"):
        train_experts(cut, tiny.adapter, tiny.group, batches(data), TrainConfig(batch_size=BATCH))


def test_training_lowers_heldout_loss_on_the_domain(tiny: Any, pattern: Callable[..., torch.Tensor]) -> None:
    model, adapter, group = tiny.model, tiny.adapter, tiny.group
    heldout = pattern(8, LENGTH, 99)
    base_hash = state_hash(model)
    base = heldout_loss(model, heldout, batch_size=4)
    base_experts = extract(model, adapter, group)
    cfg = TrainConfig(steps=12, lr=2e-2, batch_size=BATCH, micro_batch_size=2)
    result = train_experts(model, adapter, group, batches(pattern(64, LENGTH, 1)), cfg)
    trained = heldout_loss(model, heldout, batch_size=4)
    assert trained.loss < base.loss - 0.3, (base.loss, trained.loss)
    assert result.tokens == 12 * BATCH * (LENGTH - 1)
    # Proof-of-Loss view: the base model with the trained experts scores the same, and is restored.
    insert(model, adapter, base_experts)
    assert state_hash(model) == base_hash
    swapped = loss_with_experts(model, adapter, result.tensors, heldout, batch_size=4)
    assert swapped == trained
    assert state_hash(model) == base_hash


def test_first_step_loss_matches_the_models_own_forward(
    make_tiny: Callable[..., Any], pattern: Callable[..., torch.Tensor]
) -> None:
    tiny = make_tiny("deepseek_v3")
    data = pattern(BATCH, LENGTH, 3, pad_tail=5)
    expected = heldout_loss(tiny.model, data, batch_size=BATCH).loss
    result = train_experts(
        tiny.model, tiny.adapter, tiny.group, iter([data]), TrainConfig(steps=1, batch_size=BATCH)
    )
    assert result.losses[0] == pytest.approx(expected, abs=1e-6)
    assert result.tokens == BATCH * (LENGTH - 1 - 5)


def test_same_seed_same_tensors_and_accumulation_matches(
    make_tiny: Callable[..., Any], pattern: Callable[..., torch.Tensor]
) -> None:
    data = pattern(16, LENGTH, 5)
    runs = []
    for micro in (None, None, 1):
        tiny = make_tiny("olmoe")
        cfg = TrainConfig(steps=4, lr=1e-2, weight_decay=0.05, batch_size=BATCH, micro_batch_size=micro)
        runs.append(train_experts(tiny.model, tiny.adapter, tiny.group, batches(data), cfg).tensors)
    assert all(torch.equal(runs[0][n], runs[1][n]) for n in runs[0])
    assert all(torch.allclose(runs[0][n], runs[2][n], atol=1e-5) for n in runs[0])


def test_padding_is_excluded_from_the_loss(
    make_tiny: Callable[..., Any], pattern: Callable[..., torch.Tensor]
) -> None:
    tiny = make_tiny("mixtral")
    padded = pattern(6, LENGTH, 8, pad_tail=10)
    full = heldout_loss(tiny.model, padded, batch_size=4)
    prefix = heldout_loss(tiny.model, padded[:, : LENGTH - 10].clone(), batch_size=4)
    assert full.tokens == prefix.tokens == 6 * (LENGTH - 11)
    assert full.loss == pytest.approx(prefix.loss, abs=1e-5)
    with pytest.raises(ValueError, match="only padding"):
        heldout_loss(tiny.model, torch.full((2, 8), 256))


@pytest.mark.parametrize("forward", ["full", "compressed"])
def test_grouped_gemm_and_checkpointing_match_the_eager_loop(
    make_tiny: Callable[..., Any], pattern: Callable[..., torch.Tensor], forward: str
) -> None:
    data = pattern(12, LENGTH, 6)
    variants: dict[str, dict[str, Any]] = {
        "eager": {},
        "grouped": {"experts_implementation": "grouped_mm"},
        "checkpointed": {"checkpointing": True},
    }
    runs, calls = {}, {}
    for name, options in variants.items():
        tiny = make_tiny("qwen3_moe")
        layer = next(iter(tiny.group))
        counted = [0]

        def count(*_: Any, counted: list[int] = counted) -> None:
            counted[0] += 1

        tiny.adapter.experts(tiny.model, layer).register_forward_pre_hook(count)
        cfg = TrainConfig(steps=3, lr=1e-2, batch_size=BATCH, forward=forward, **options)  # type: ignore[arg-type]
        runs[name] = train_experts(tiny.model, tiny.adapter, tiny.group, batches(data), cfg)
        calls[name] = counted[0]
        assert not tiny.model.model.gradient_checkpointing and not tiny.model.model.layers[0].training
    eager = runs["eager"]
    for name in ("grouped", "checkpointed"):
        assert runs[name].losses == pytest.approx(eager.losses, abs=1e-5)
        assert all(torch.allclose(runs[name].tensors[n], t, atol=1e-5) for n, t in eager.tensors.items())
    # Checkpointing really recomputes: the experts run twice per step (forward hooks survive compress).
    assert calls["checkpointed"] == 2 * calls["eager"] == 6


def test_both_modes_produce_the_same_blob_format(
    make_tiny: Callable[..., Any], pattern: Callable[..., torch.Tensor]
) -> None:
    formats = []
    for forward in ("full", "compressed"):
        tiny = make_tiny("olmoe")
        cfg = TrainConfig(steps=2, lr=1e-2, batch_size=BATCH, forward=forward)  # type: ignore[arg-type]
        tensors = train_experts(tiny.model, tiny.adapter, tiny.group, batches(pattern(8, LENGTH, 4)), cfg).tensors
        assert list(tensors) == expert_names(tiny.group)
        meta = BlobMeta(network="n" * 64, round=1, miner="m", base="b" * 64, group=tiny.group)
        decoded_meta, decoded = decode_blob(encode_blob(tensors, meta), 1 << 16)
        assert decoded_meta == meta
        formats.append({name: (t.dtype, tuple(t.shape)) for name, t in decoded.items()})
    assert formats[0] == formats[1]


def test_bad_batches_and_configs_are_refused(make_tiny: Callable[..., Any]) -> None:
    tiny = make_tiny("qwen3_moe")
    with pytest.raises(ValueError, match="batch of shape"):
        train_experts(
            tiny.model,
            tiny.adapter,
            tiny.group,
            iter([torch.zeros(3, 8, dtype=torch.long)]),
            TrainConfig(steps=1, batch_size=BATCH),
        )
    with pytest.raises(ValueError, match="no batches"):
        train_experts(tiny.model, tiny.adapter, tiny.group, iter([]), TrainConfig(steps=1, batch_size=BATCH))
    with pytest.raises(ValueError, match="micro_batch_size"):
        TrainConfig(batch_size=4, micro_batch_size=8)
    with pytest.raises(ValueError, match="forward"):
        TrainConfig(forward="sparse")  # type: ignore[arg-type]
    for beta1 in (1.0, -0.1):
        with pytest.raises(ValueError, match="beta1 must be in"):
            TrainConfig(beta1=beta1)


def test_a_run_that_goes_on_from_the_last_ones_optimizer_state_is_that_run_continued(
    make_tiny: Callable[..., Any], pattern: Callable[..., torch.Tensor]
) -> None:
    data = pattern(32, LENGTH, 5)
    whole = make_tiny("qwen3_moe")
    cfg = TrainConfig(steps=8, lr=1e-2, weight_decay=0.1, batch_size=BATCH)
    straight = train_experts(whole.model, whole.adapter, whole.group, batches(data), cfg)

    split = make_tiny("qwen3_moe")
    half = TrainConfig(steps=4, lr=1e-2, weight_decay=0.1, batch_size=BATCH)
    first = train_experts(split.model, split.adapter, split.group, batches(data[:16]), half, hand_on=True)
    resumed = train_experts(split.model, split.adapter, split.group, batches(data[16:]), half, first.optimizer_state)
    assert all(torch.equal(resumed.tensors[n], straight.tensors[n]) for n in straight.tensors)

    restarted = make_tiny("qwen3_moe")
    not_handed = train_experts(restarted.model, restarted.adapter, restarted.group, batches(data[:16]), half)
    assert not_handed.optimizer_state == {}  # a miner's run: its moments are dropped with the optimizer
    fresh = train_experts(restarted.model, restarted.adapter, restarted.group, batches(data[16:]), half)
    assert not all(torch.equal(fresh.tensors[n], straight.tensors[n]) for n in straight.tensors)  # zeroed moments differ

    other = {layer: ids[:1] for layer, ids in split.group.items()}
    with pytest.raises(ValueError, match="other expert tensors"):
        train_experts(split.model, split.adapter, other, batches(data), half, first.optimizer_state)


def test_beta1_sets_the_first_moments_decay_and_a_resumed_run_takes_the_new_one(
    make_tiny: Callable[..., Any], pattern: Callable[..., torch.Tensor]
) -> None:
    data = pattern(16, LENGTH, 6)
    runs = {}
    for beta1 in (0.9, 0.5):
        tiny = make_tiny("qwen3_moe")
        cfg = TrainConfig(steps=4, lr=1e-2, batch_size=BATCH, beta1=beta1)
        runs[beta1] = train_experts(tiny.model, tiny.adapter, tiny.group, batches(data), cfg, hand_on=True)
        assert runs[beta1].optimizer_state["param_groups"][0]["betas"] == (beta1, 0.999)
    assert not all(torch.equal(runs[0.9].tensors[n], runs[0.5].tensors[n]) for n in runs[0.9].tensors)
    resumed = train_experts(tiny.model, tiny.adapter, tiny.group, batches(data), TrainConfig(
        steps=1, lr=1e-2, batch_size=BATCH, beta1=0.3), runs[0.5].optimizer_state, hand_on=True)
    assert resumed.optimizer_state["param_groups"][0]["betas"] == (0.3, 0.999)


def test_a_compressed_layers_fused_rows_are_released_while_its_copies_train(
    tiny: Any, pattern: Callable[..., torch.Tensor]
) -> None:
    """A compressed layer's fused tensors hold only the group, which its fp32 copies hold too: while they train
    the fused storage is empty, and afterwards it holds the trained rows."""
    cut = compress(tiny.model, tiny.adapter, tiny.group)
    fused = {layer: tensor_attr(tiny.adapter.experts(cut.model, layer), "gate_up_proj") for layer in cut.group}
    shapes = {layer: tuple(t.shape) for layer, t in fused.items()}
    sizes_seen: list[list[int]] = []

    def watched(data: torch.Tensor) -> Any:
        for batch in batches(data):
            sizes_seen.append([t.numel() for t in fused.values()])
            yield batch

    cfg = TrainConfig(steps=2, lr=1e-2, batch_size=BATCH, forward="compressed")
    result = train_experts(cut, tiny.adapter, tiny.group, watched(pattern(8, LENGTH, 3)), cfg)
    assert len(sizes_seen) == 2 and all(size == 0 for sizes in sizes_seen for size in sizes)
    for layer, ids in cut.group.items():
        assert tuple(fused[layer].shape) == shapes[layer]
        for slot, expert in enumerate(ids):
            assert torch.equal(fused[layer][slot], result.tensors[tensor_name(layer, expert, "gate_up_proj")])


@pytest.mark.parametrize("hand_on", [False, True])
def test_the_moments_are_let_go_before_the_trained_rows_are_written_back(
    pattern: Callable[..., torch.Tensor], monkeypatch: pytest.MonkeyPatch, hand_on: bool
) -> None:
    """Writing back brings the fused rows back beside the copies: the optimizer state, unless handed on, is gone by
    then (the memory plan's last phase)."""
    import training.sparse_experts
    import training.trainer
    from tests.training.conftest import make_tiny

    made: list[torch.optim.Optimizer] = []
    states: list[int] = []
    inner = training.trainer.inner_adamw
    monkeypatch.setattr(training.trainer, "inner_adamw", lambda *a: made.append(inner(*a)) or made[-1])
    write_back = training.sparse_experts.LayerCopies.write_back
    monkeypatch.setattr(training.sparse_experts.LayerCopies, "write_back",
                        lambda self: states.append(len(made[0].state)) or write_back(self))
    tiny = make_tiny("olmoe")
    cfg = TrainConfig(steps=2, batch_size=BATCH, forward="compressed")
    result = train_experts(tiny.model, tiny.adapter, tiny.group, batches(pattern(8, LENGTH, 3)), cfg, hand_on=hand_on)
    assert states and set(states) == {0}
    assert bool(result.optimizer_state) == hand_on
    if hand_on:
        assert all(len(s) == 3 for s in result.optimizer_state["state"].values())  # step and both moments

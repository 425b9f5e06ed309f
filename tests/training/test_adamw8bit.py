"""The miner's 8-bit inner optimizer (bitsandbytes' AdamW8bit, which runs on the CPU too): it lowers the loss,
changes only the selected experts' rows, holds about a quarter of fp32 AdamW's state, and goes on exactly from a
saved state; on CUDA (`gpu`) the same in bf16."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from tests.training.rows import assert_only_the_group_changed
from training.trainer import TrainConfig, TrainResult, train_experts

BATCH, LENGTH = 4, 32


def batches(data: torch.Tensor) -> Iterator[torch.Tensor]:
    return (data[i : i + BATCH] for i in range(0, data.shape[0] - BATCH + 1, BATCH))


def state_bytes(result: TrainResult) -> int:
    return sum(v.numel() * v.element_size() for moments in result.optimizer_state["state"].values()
               for v in moments.values() if isinstance(v, torch.Tensor))


@pytest.mark.parametrize("forward", ["full", "compressed"])
def test_8bit_adamw_lowers_the_loss_and_changes_only_the_selected_rows(
    make_tiny: Callable[..., Any], pattern: Callable[..., torch.Tensor], forward: str
) -> None:
    tiny = make_tiny("qwen3_moe")
    before = {name: t.clone() for name, t in tiny.model.state_dict().items()}
    data = pattern(8 * BATCH, LENGTH, 1)
    cfg = TrainConfig(steps=8, lr=2e-2, batch_size=BATCH, forward=forward, optimizer="adamw8bit")  # type: ignore[arg-type]
    result = train_experts(tiny.model, tiny.adapter, tiny.group, batches(data), cfg)
    assert result.losses[-1] < result.losses[0] - 0.1, result.losses
    assert_only_the_group_changed(tiny.model, tiny.group, before)


def test_8bit_state_is_about_a_quarter_of_fp32_adamws_and_resumes_exactly(
    make_tiny: Callable[..., Any], pattern: Callable[..., torch.Tensor]
) -> None:
    data = pattern(4 * BATCH, LENGTH, 2)
    fp32 = train_experts(*make_tiny("qwen3_moe")[1:], batches(data), TrainConfig(steps=1, batch_size=BATCH), hand_on=True)
    cfg = TrainConfig(steps=2, lr=1e-2, batch_size=BATCH, optimizer="adamw8bit")
    whole = train_experts(*make_tiny("qwen3_moe")[1:], batches(data), TrainConfig(**{**vars(cfg), "steps": 4}),
                          hand_on=True)
    assert state_bytes(whole) < 0.3 * state_bytes(fp32)
    tiny = make_tiny("qwen3_moe")
    first = train_experts(tiny.model, tiny.adapter, tiny.group, batches(data[: 2 * BATCH]), cfg, hand_on=True)
    second = train_experts(tiny.model, tiny.adapter, tiny.group, batches(data[2 * BATCH :]), cfg,
                           optimizer_state=first.optimizer_state)
    assert all(torch.equal(second.tensors[n], whole.tensors[n]) for n in whole.tensors)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_8bit_adamw_on_cuda_in_bf16_lowers_the_loss_and_changes_only_the_selected_rows(
    make_tiny: Callable[..., Any], pattern: Callable[..., torch.Tensor]
) -> None:
    tiny = make_tiny("olmoe")
    tiny.model.to(torch.bfloat16)
    before = {name: t.clone() for name, t in tiny.model.state_dict().items()}
    data = pattern(8 * BATCH, LENGTH, 1)
    cfg = TrainConfig(steps=8, lr=2e-2, batch_size=BATCH, forward="compressed", device="cuda", optimizer="adamw8bit")
    result = train_experts(tiny.model, tiny.adapter, tiny.group, batches(data), cfg)
    assert result.losses[-1] < result.losses[0], result.losses
    assert_only_the_group_changed(tiny.model, tiny.group, before)

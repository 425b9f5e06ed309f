"""fp32 arithmetic over bf16 weights on a CPU (training.cpu_compute): the trainer's bf16 path on every family."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any, Literal

import pytest
import torch
import torch.nn.functional as F

from training import cpu_compute
from training.cpu_compute import fp32_compute
from training.evaluate import heldout_loss
from training.trainer import TrainConfig, train_experts

BATCH = 4


@pytest.mark.parametrize("bias", [False, True])
def test_a_narrow_linear_computes_in_fp32_blockwise_and_its_gradients_match_fp32(
    monkeypatch: pytest.MonkeyPatch, bias: bool
) -> None:
    monkeypatch.setattr(cpu_compute, "BLOCK_BYTES", 4 * 16 * 5)  # 5 rows of 16 at a time: 13 rows in 3 blocks
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(13, 16, generator=gen).to(torch.bfloat16).requires_grad_(True)
    b = torch.randn(13, generator=gen).to(torch.bfloat16).requires_grad_(True) if bias else None
    x = torch.randn(2, 3, 16, generator=gen, requires_grad=True)
    with fp32_compute():
        out = F.linear(x, weight, b)
    assert out.dtype == torch.float32
    out.square().sum().backward()  # type: ignore[no-untyped-call]  # unannotated in torch

    w32 = weight.detach().float().requires_grad_(True)
    b32 = b.detach().float().requires_grad_(True) if b is not None else None
    x32 = x.detach().clone().requires_grad_(True)
    reference = F.linear(x32, w32, b32)
    reference.square().sum().backward()  # type: ignore[no-untyped-call]  # unannotated in torch
    torch.testing.assert_close(out, reference)
    assert x.grad is not None and weight.grad is not None and w32.grad is not None
    torch.testing.assert_close(x.grad, x32.grad)
    assert weight.grad.dtype == torch.bfloat16
    torch.testing.assert_close(weight.grad.float(), w32.grad, rtol=1e-2, atol=1e-2)  # rounded to bf16
    if b is not None:
        assert b.grad is not None and b32 is not None and b.grad.dtype == torch.bfloat16
        torch.testing.assert_close(b.grad.float(), b32.grad, rtol=1e-2, atol=1e-2)


def test_outside_the_context_and_for_fp32_weights_nothing_changes() -> None:
    x, weight = torch.randn(3, 8), torch.randn(5, 8).to(torch.bfloat16)
    assert F.linear(x.to(torch.bfloat16), weight).dtype == torch.bfloat16
    with fp32_compute():
        assert F.linear(x, weight.float()).dtype == torch.float32
        assert F.embedding(torch.tensor([1, 2]), weight).dtype == torch.float32
        assert F.embedding(torch.tensor([1, 2]), weight.double()).dtype == torch.float64


@pytest.mark.parametrize(("forward", "checkpointing"), [("full", False), ("compressed", False), ("compressed", True)])
def test_a_bf16_model_trains_on_the_cpu_as_its_fp32_upcast_does(
    tiny: Any, pattern: Callable[..., torch.Tensor], forward: Literal["full", "compressed"], checkpointing: bool
) -> None:
    """The trainer widens a bf16 model's arithmetic: the same losses and trained experts as the model's exact
    fp32 upcast (bf16 arithmetic would differ by about 1e-2); with activation checkpointing too, whose layers
    run their forward again inside backward."""
    narrow = copy.deepcopy(tiny.model).to(torch.bfloat16)
    wide = copy.deepcopy(narrow).to(torch.float32)
    data = pattern(8, 32, 3)
    cfg = TrainConfig(steps=2, lr=1e-2, batch_size=BATCH, forward=forward, checkpointing=checkpointing)
    runs = [train_experts(model, tiny.adapter, tiny.group, (data[i:i + BATCH] for i in range(0, 8, BATCH)), cfg)
            for model in (narrow, wide)]
    assert runs[0].losses == pytest.approx(runs[1].losses, rel=1e-5)
    for name, tensor in runs[1].tensors.items():
        torch.testing.assert_close(runs[0].tensors[name], tensor, rtol=1e-4, atol=1e-5)


def test_a_bf16_model_scores_on_the_cpu_as_its_fp32_upcast_does(tiny: Any, pattern: Callable[..., torch.Tensor]) -> None:
    narrow = copy.deepcopy(tiny.model).to(torch.bfloat16)
    data = pattern(8, 32, 3)
    wide = heldout_loss(copy.deepcopy(narrow).to(torch.float32), data, batch_size=4)
    assert heldout_loss(narrow, data, batch_size=4).loss == pytest.approx(wide.loss, rel=1e-6)

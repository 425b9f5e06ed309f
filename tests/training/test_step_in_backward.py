"""The optimizer step taken in backward (`TrainConfig.step_in_backward`) trains as the default step does.

Real tensors, a tiny model, six steps on learnable data. Where no step's gradient norm passes the clip the updates are the same operations in another order, and the losses and
trained experts are bit-identical; where the clip binds, a step is clipped by the norm of the step before it, and
the losses drift from the default's: at a clip of 0.05, which binds every step here, by 1.6% at the sixth step
(the test allows 2%).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from tests.training.conftest import make_tiny
from training.trainer import TrainConfig, TrainResult, train_experts

STEPS, BATCH, LENGTH = 6, 4, 32
CLIP_RTOL = 0.02


def trained(family: str, data: torch.Tensor, *, in_backward: bool, clip: float, optimizer: str = "adamw",
            forward: str = "compressed") -> TrainResult:
    tiny = make_tiny(family)
    cfg = TrainConfig(steps=STEPS, lr=1e-2, batch_size=BATCH, forward=forward, grad_clip=clip,  # type: ignore[arg-type]
                      optimizer=optimizer, step_in_backward=in_backward)  # type: ignore[arg-type]
    batches = (data[i : i + BATCH] for i in range(0, data.shape[0], BATCH))
    return train_experts(tiny.model, tiny.adapter, tiny.group, batches, cfg)


@pytest.mark.parametrize(("family", "optimizer", "forward"), [
    ("olmoe", "adamw", "compressed"),
    pytest.param("deepseek_v2", "adamw8bit", "compressed", marks=pytest.mark.slow),
    pytest.param("qwen3_moe", "adamw", "full", marks=pytest.mark.slow),
])
def test_where_the_clip_does_not_bind_the_step_in_backward_trains_bit_identically(
    pattern: Callable[..., torch.Tensor], family: str, optimizer: str, forward: str
) -> None:
    data = pattern(STEPS * BATCH, LENGTH, 3)
    default = trained(family, data, in_backward=False, clip=1e6, optimizer=optimizer, forward=forward)
    in_backward = trained(family, data, in_backward=True, clip=1e6, optimizer=optimizer, forward=forward)
    assert len(default.losses) == STEPS and default.losses[-1] < default.losses[0]  # it learns
    assert in_backward.losses == default.losses
    assert all(torch.equal(in_backward.tensors[name], t) for name, t in default.tensors.items())


def test_where_the_clip_binds_the_losses_stay_within_two_percent(pattern: Callable[..., Any]) -> None:
    data = pattern(STEPS * BATCH, LENGTH, 3)
    default = trained("olmoe", data, in_backward=False, clip=0.05)
    unclipped = trained("olmoe", data, in_backward=False, clip=1e6)
    in_backward = trained("olmoe", data, in_backward=True, clip=0.05)
    assert default.losses != unclipped.losses  # the clip binds
    assert in_backward.losses == pytest.approx(default.losses, rel=CLIP_RTOL)


def test_step_in_backward_refuses_a_step_of_several_micro_batches() -> None:
    with pytest.raises(ValueError, match="step_in_backward"):
        TrainConfig(batch_size=4, micro_batch_size=2, step_in_backward=True)

"""On a CUDA machine: bf16 sparse training on the GPU changes only the selected rows and lowers the loss."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from tests.training.rows import assert_only_the_group_changed
from training.trainer import TrainConfig, train_experts

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
BATCH, LENGTH = 4, 32


@pytest.mark.parametrize("forward", ["full", "compressed"])
def test_bf16_training_on_cuda_changes_only_selected_rows(
    make_tiny: Callable[..., Any], pattern: Callable[..., torch.Tensor], forward: str
) -> None:
    tiny = make_tiny("olmoe")
    model, adapter, group = tiny.model.to(torch.bfloat16), tiny.adapter, tiny.group
    before = {name: t.clone() for name, t in model.state_dict().items()}
    data = pattern(8 * BATCH, LENGTH, 1)
    cfg = TrainConfig(steps=8, lr=2e-2, batch_size=BATCH, forward=forward, device="cuda", checkpointing=True)  # type: ignore[arg-type]
    result = train_experts(model, adapter, group, (data[i : i + BATCH] for i in range(0, len(data), BATCH)), cfg)
    assert result.losses[-1] < result.losses[0], result.losses
    for name, tensor in model.state_dict().items():
        assert tensor.dtype == before[name].dtype, f"{name} changed dtype"
    assert_only_the_group_changed(model, group, before)

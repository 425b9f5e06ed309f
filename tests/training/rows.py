"""What a training step on an expert group may change: the group's expert rows, nothing else."""

from __future__ import annotations

import torch


def assert_only_the_group_changed(model: torch.nn.Module, group: dict[int, list[int]],
                                  before: dict[str, torch.Tensor]) -> None:
    """Every tensor of `model` equals `before` but the fused expert rows `group` names, each of which moved."""
    fused = {f"model.layers.{layer}.mlp.experts.{p}": layer for layer in group for p in ("gate_up_proj", "down_proj")}
    for name, tensor in model.state_dict().items():
        tensor = tensor.cpu()
        if name not in fused:
            assert torch.equal(tensor, before[name]), f"{name} changed"
            continue
        for expert in range(tensor.shape[0]):
            same = torch.equal(tensor[expert], before[name][expert])
            assert same != (expert in group[fused[name]]), f"{name}[{expert}] changed={not same}"

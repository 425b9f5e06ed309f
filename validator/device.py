"""Where a validator's model lives: its skeleton for the device check, and a big model spread over all GPUs.

`skeleton` is the checkpoint's model without weights, which `training.device.check_device` sizes
before a validator starts (and the loaded model again once it is). `spread` places a model too large
for one GPU over all GPUs with accelerate's balanced device map (`training.device.spread_map`, as
transformers' `device_map="auto"` makes it, and as `tessera plan --gpus N` plans it); it does not
offload to CPU memory, because Proof-of-Loss swaps expert rows in place and offloaded weights are not
resident. This module knows nothing about rounds, submissions or
the network.
"""

from __future__ import annotations

from pathlib import Path

import torch

from protocol.spec import NetworkSpec, spec_dir_path
from training.checkpoint import meta_model
from training.device import spread_map


def skeleton(spec: NetworkSpec, spec_path: str | Path) -> torch.nn.Module | None:
    """The spec's checkpoint model on the meta device (config.json only), or None for a tiny-config spec."""
    if spec.model.checkpoint is None:
        return None
    return meta_model(spec_dir_path(spec_path, spec.model.checkpoint))


def spread(model: torch.nn.Module) -> None:
    """Place `model` over all CUDA GPUs by accelerate's balanced device map; ValueError if they cannot hold it."""
    from accelerate import dispatch_model

    if not torch.cuda.is_available():
        raise ValueError("validator.device = 'auto' spreads the model over CUDA GPUs, but this machine has none")
    free = {i: torch.cuda.mem_get_info(i)[0] for i in range(torch.cuda.device_count())}
    try:
        device_map = spread_map(model, free)
    except ValueError as exc:
        raise ValueError(f"validator.device = 'auto': {exc} (free memory)") from None
    dispatch_model(model, device_map)

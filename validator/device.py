"""Where a validator's model lives: its skeleton for the device check, and a big model spread over all GPUs.

`skeleton` is the checkpoint's model without weights, which `training.device.check_device` sizes
before a validator starts (and the loaded model again once it is). `spread` places a model too large
for one GPU over all GPUs with accelerate's device map (the same machinery as transformers'
`device_map="auto"`); it does not offload to CPU memory, because Proof-of-Loss swaps expert rows in
place and offloaded weights are not resident. This module knows nothing about rounds, submissions or
the network.
"""

from __future__ import annotations

from pathlib import Path

import torch

from protocol.spec import NetworkSpec, spec_dir_path
from training.checkpoint import meta_model
from training.device import GIB


def skeleton(spec: NetworkSpec, spec_path: str | Path) -> torch.nn.Module | None:
    """The spec's checkpoint model on the meta device (config.json only), or None for a tiny-config spec."""
    if spec.model.checkpoint is None:
        return None
    return meta_model(spec_dir_path(spec_path, spec.model.checkpoint))


def spread(model: torch.nn.Module) -> None:
    """Place `model` over all CUDA GPUs by accelerate's device map; ValueError if they cannot hold it."""
    from accelerate import dispatch_model, infer_auto_device_map

    if not torch.cuda.is_available():
        raise ValueError("validator.device = 'auto' spreads the model over CUDA GPUs, but this machine has none")
    max_memory: dict[int | str, int] = {
        i: torch.cuda.mem_get_info(i)[0] for i in range(torch.cuda.device_count())
    }
    device_map = infer_auto_device_map(
        model, max_memory=max_memory, no_split_module_classes=getattr(model, "_no_split_modules", None)
    )
    off_gpu = sorted({str(d) for d in device_map.values() if d in ("cpu", "disk")})
    if off_gpu:
        raise ValueError(
            f"validator.device = 'auto': the model does not fit in the GPUs' free memory "
            f"({sum(max_memory.values()) / GIB:.1f} GiB) without offloading to {', '.join(off_gpu)}"
        )
    dispatch_model(model, device_map)

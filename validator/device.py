"""Where a validator's model lives: refuse a scoring device that is missing or too small, spread a big model.

`check_device` runs before a validator starts (on `skeleton`, the checkpoint's model without
weights) and again once the model is loaded: a `validator.device` that does not exist on this
machine, or a GPU whose free memory is below what scoring the model needs (weights in their dtype
plus one batch of activations, estimated), is refused with one line naming the setting and the
memory needed. `spread` places a model too large for one GPU over all GPUs with accelerate's
device map (the same machinery as transformers' `device_map="auto"`); it does not offload to CPU
memory, because Proof-of-Loss swaps expert rows in place and offloaded weights are not resident.
This module knows nothing about rounds, submissions or the network.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from protocol.spec import NetworkSpec, spec_dir_path
from training.model import meta_model

GIB = 1024**3
_HEADROOM = 1.15
"""Allowance over the estimate for the allocator, norms and hidden states."""


def scoring_bytes(model: torch.nn.Module, batch_size: int, seq_len: int) -> int:
    """Estimated device memory to score with `model`: resident weights plus one batch's activations."""
    weights = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    config: Any = model.config
    vocab = int(config.vocab_size)
    element = next(model.parameters()).element_size()
    # the logits in the model dtype, their fp32 copy and cross-entropy's fp32 log-softmax (training.evaluate)
    logits = batch_size * seq_len * vocab * (element + 8)
    heads = int(getattr(config, "num_attention_heads", 1))
    scores = batch_size * heads * seq_len * seq_len * 4  # eager attention scores of one layer
    return int((weights + logits + scores) * _HEADROOM)


def skeleton(spec: NetworkSpec, spec_path: str | Path) -> torch.nn.Module | None:
    """The spec's checkpoint model on the meta device (config.json only), or None for a tiny-config spec."""
    if spec.model.checkpoint is None:
        return None
    return meta_model(spec_dir_path(spec_path, spec.model.checkpoint))


def check_device(
    device: str, model: torch.nn.Module | None, batch_size: int, seq_len: int, setting: str = "validator.device"
) -> None:
    """ValueError (one line naming `setting` and the memory needed) unless `device` can score `model`.

    With `model` None only the device's existence is checked.
    """
    if device == "auto":
        if not torch.cuda.is_available():
            raise ValueError(f"{setting} = 'auto' spreads the model over CUDA GPUs, but this machine has none")
        if model is None:
            return
        need = scoring_bytes(model, batch_size, seq_len)
        free = sum(torch.cuda.mem_get_info(i)[0] for i in range(torch.cuda.device_count()))
        if free < need:
            raise ValueError(
                f"{setting} = 'auto': scoring this model needs about {need / GIB:.1f} GiB but all "
                f"{torch.cuda.device_count()} GPU(s) together have {free / GIB:.1f} GiB free"
            )
        return
    try:
        target = torch.device(device)
    except RuntimeError:
        raise ValueError(f"{setting} = {device!r} is not a torch device; use cpu, cuda, cuda:N or auto") from None
    if target.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        index = target.index if target.index is not None else 0
        if index >= count:
            raise ValueError(f"{setting} = {device!r} does not exist: this machine has {count} CUDA device(s)")
        if model is None:
            return
        need = scoring_bytes(model, batch_size, seq_len)
        free = torch.cuda.mem_get_info(index)[0]
        if free < need:
            raise ValueError(
                f"{setting} = {device!r} has {free / GIB:.1f} GiB free but scoring this model needs about "
                f"{need / GIB:.1f} GiB; use a larger GPU, 'auto' to spread it over all GPUs, or a smaller "
                "validator.batch_size"
            )
    elif target.type not in ("cpu", "meta"):
        backend = getattr(torch, target.type, None)
        if backend is None or not backend.is_available():
            raise ValueError(f"{setting} = {device!r} does not exist on this machine")


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

"""Whether a device can hold a model's scoring (a device missing or too small is refused in one line), and
frozen weights held in int8 to make a model smaller there.

`check_device` refuses a device that does not exist on this machine, or a GPU whose free memory is
below what scoring a model needs (`scoring_bytes`: weights in their dtype plus one batch of
activations, estimated), with one line naming the setting and the memory needed; without a model it
checks only that the device exists (a miner's training device, or a validator's before its model
loads). `hold_int8` swaps a model's frozen linear layers (attention, dense and shared-expert MLPs; not
the routers, the fused experts, which Proof-of-Loss swaps rows of, or an output layer tied to the
embeddings) for `Int8Linear`: weight-only int8, one scale per output row. This module knows nothing
about rounds, roles' duties or the network.
Legend: O output features, I input features.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

from training.cpu_compute import BLOCK_BYTES, holds_narrow_weights

GIB = 1024**3
_HEADROOM = 1.15
"""Allowance over the estimate for the allocator, norms and hidden states."""


def scoring_bytes(model: torch.nn.Module, batch_size: int, seq_len: int, device: str = "cuda") -> int:
    """Estimated memory on `device` to score with `model`: resident weights plus one batch's activations."""
    weights = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    config: Any = model.config
    vocab = int(config.vocab_size)
    element = next(model.parameters()).element_size()
    widened = torch.device(device).type == "cpu" and holds_narrow_weights(model)
    if widened:  # a CPU computes a bf16 model in fp32, a block of weight rows upcast at a time (training.cpu_compute)
        element, weights = 4, weights + BLOCK_BYTES
    # the logits in the compute dtype, their fp32 copy and cross-entropy's fp32 log-softmax (training.evaluate)
    logits = batch_size * seq_len * vocab * (element + 8)
    heads = int(getattr(config, "num_attention_heads", 1))
    scores = batch_size * heads * seq_len * seq_len * 4  # eager attention scores of one layer
    return int((weights + logits + scores) * _HEADROOM)


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


def spread_map(model: torch.nn.Module, memory: Mapping[int, int]) -> dict[str, int]:
    """accelerate's balanced device map of `model` over GPUs of `memory` bytes each (index -> bytes), as
    transformers' `device_map="auto"` makes it: module name -> GPU. ValueError naming the memory when the GPUs
    cannot hold it without offloading to the CPU or disk."""
    from accelerate.utils import get_balanced_memory, infer_auto_device_map

    no_split = getattr(model, "_no_split_modules", None)
    budget: dict[int | str, int] = {index: nbytes for index, nbytes in memory.items()}
    balanced = get_balanced_memory(model, max_memory=budget, no_split_module_classes=no_split)
    device_map = infer_auto_device_map(model, max_memory=balanced, no_split_module_classes=no_split)
    off_gpu = sorted({str(d) for d in device_map.values() if not isinstance(d, int)})
    if off_gpu:
        raise ValueError(f"the model does not fit in the GPUs' memory ({sum(memory.values()) / GIB:.1f} GiB) "
                         f"without offloading to {', '.join(off_gpu)}")
    return {name: int(d) for name, d in device_map.items()}


class Int8Linear(torch.nn.Module):
    """A frozen `nn.Linear` held as int8 weights with one scale per output row (symmetric, round to nearest).

    The forward multiplies by the int8 weights cast to the input's dtype and scales the output rows, so
    one layer's weights exist in that dtype only while that layer runs."""

    w_OI: torch.Tensor
    scale_O: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        with torch.no_grad():
            w_OI = linear.weight.detach().float()
            scale_O = w_OI.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / 127
            self.register_buffer("w_OI", torch.round(w_OI / scale_O[:, None]).to(torch.int8))
            self.register_buffer("scale_O", scale_O.to(linear.weight.dtype))
            bias = None if linear.bias is None else linear.bias.detach().clone()
            self.register_buffer("bias", bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.w_OI.to(x.dtype)) * self.scale_O.to(x.dtype)
        return y if self.bias is None else y + self.bias.to(x.dtype)


def hold_int8(model: torch.nn.Module, routers: list[torch.nn.Module]) -> int:
    """Swap every frozen `nn.Linear` of `model` but `routers` and an output layer tied to the input embeddings
    for an `Int8Linear` in place; the number swapped."""
    keep = {id(r) for r in routers}
    get_input = getattr(model, "get_input_embeddings", None)
    embeddings = get_input() if callable(get_input) else None
    tied = None if embeddings is None else embeddings.weight
    swapped = [(name, module) for name, module in model.named_modules()
               if isinstance(module, torch.nn.Linear) and id(module) not in keep and module.weight is not tied]
    for name, module in swapped:
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, Int8Linear(module))
    return len(swapped)

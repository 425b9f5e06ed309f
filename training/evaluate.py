"""Held-out loss: the number Proof-of-Loss compares.

The loss is the mean next-token cross-entropy over every target that is not padding: summed token
losses divided by the token count. Each sequence's sum is taken in fp32 from fp32 logits and kept
(`LossResult.row_sums`: what the merge gate compares sequence by sequence); the sums are added
exactly (`math.fsum`, rounded once), so the same model, data and batch size give the same number.
Evaluation runs under no_grad with the model in eval mode; on a CPU a model stored in bf16 or fp16
computes in fp32 (training.cpu_compute). This module knows nothing about where sequences come from
or what a validator does with the loss.
"""

from __future__ import annotations

import math
import sys
from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch
import torch.nn.functional as F
from tqdm import tqdm

from training.adapters import MoEAdapter, tensor_attr
from training.cpu_compute import fp32_compute, holds_narrow_weights
from training.data import not_padding
from training.experts import ExpertGroup, Tensors, check_group, expert_names, insert, parse_name

if TYPE_CHECKING:
    from transformers import PreTrainedModel


@dataclass(frozen=True)
class LossResult:
    """Mean token loss, how many tokens it averages, and each sequence's summed token loss (in order)."""

    loss: float
    tokens: int
    row_sums: tuple[float, ...]


def token_loss_sum(model: torch.nn.Module, ids_BL: torch.Tensor, pad_id: int) -> torch.Tensor:
    """Summed next-token cross-entropy (fp32 scalar) over targets that are not padding (`not_padding`)."""
    logits_NV, targets_N = _logits_and_targets(model, ids_BL, pad_id)
    return F.cross_entropy(logits_NV, targets_N, ignore_index=-100, reduction="sum")


def row_loss_sums(model: torch.nn.Module, ids_BL: torch.Tensor, pad_id: int) -> torch.Tensor:
    """Each sequence's summed next-token cross-entropy over targets that are not padding: fp32 [B]."""
    logits_NV, targets_N = _logits_and_targets(model, ids_BL, pad_id)
    losses_N = F.cross_entropy(logits_NV, targets_N, ignore_index=-100, reduction="none")
    return losses_N.reshape(ids_BL.shape[0], -1).sum(dim=1)


def _logits_and_targets(model: torch.nn.Module, ids_BL: torch.Tensor, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 next-token logits [B*(L-1), V] and their targets [B*(L-1)], -100 where the target is padding."""
    mask_BL = not_padding(ids_BL, pad_id)
    logits_BLV = model(input_ids=ids_BL, attention_mask=mask_BL.long(), use_cache=False).logits
    targets_BL = ids_BL[:, 1:].masked_fill(~mask_BL[:, 1:], -100)
    return logits_BLV[:, :-1].float().reshape(-1, logits_BLV.shape[-1]), targets_BL.reshape(-1)


@torch.no_grad()
def heldout_loss(
    model: torch.nn.Module,
    sequences: torch.Tensor,
    batch_size: int = 16,
    device: str = "cpu",
    pad_id: int = 256,
    progress: bool = False,
) -> LossResult:
    """Mean token loss of `model` on `sequences` [N, L]; the model is moved to `device` (see `place`).

    `progress`: a tqdm bar over the batches when stderr is a terminal (the `tessera eval` command)."""
    if sequences.ndim != 2 or sequences.shape[0] == 0 or sequences.dtype != torch.long:
        raise ValueError(
            f"expected a non-empty LongTensor [N, L] of token ids, got {sequences.dtype} "
            f"{tuple(sequences.shape)}"
        )
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    input_device = place(model, device)
    wide = input_device.type == "cpu" and holds_narrow_weights(model)  # training.cpu_compute
    was_training = model.training
    model.eval()
    rows: list[float] = []
    tokens = 0
    try:
        starts = range(0, sequences.shape[0], batch_size)
        for start in tqdm(starts, desc="eval", unit="batch", disable=not (progress and sys.stderr.isatty())):
            ids_BL = sequences[start : start + batch_size].to(input_device)
            with fp32_compute() if wide else nullcontext():
                rows.extend(row_loss_sums(model, ids_BL, pad_id).double().cpu().tolist())
            tokens += int(not_padding(ids_BL, pad_id)[:, 1:].sum())
    finally:
        model.train(was_training)
    if tokens == 0:
        raise ValueError("the held-out sequences hold only padding; there is nothing to score")
    return LossResult(loss=math.fsum(rows) / tokens, tokens=tokens, row_sums=tuple(rows))


def place(model: torch.nn.Module, device: str | torch.device) -> torch.device:
    """Move `model` to `device` and return where its inputs go; a model spread by a device_map stays put."""
    if getattr(model, "hf_device_map", None):
        embeddings = cast("PreTrainedModel", model).get_input_embeddings()
        return tensor_attr(embeddings, "weight").device
    model.to(device)
    return torch.device(device)


def loss_with_experts(
    model: torch.nn.Module,
    adapter: MoEAdapter,
    tensors: Tensors,
    sequences: torch.Tensor,
    batch_size: int = 16,
    device: str = "cpu",
    pad_id: int = 256,
    progress: bool = False,
) -> LossResult:
    """Loss of Θ0[Φ_S ← Φ]: the model with `tensors` in its expert rows; the rows are restored after."""
    group: dict[int, set[int]] = {}
    for name in tensors:
        layer, expert, _ = parse_name(name)
        group.setdefault(layer, set()).add(expert)
    original = _rows(model, adapter, {layer: sorted(e) for layer, e in group.items()})
    insert(model, adapter, tensors)
    try:
        return heldout_loss(model, sequences, batch_size=batch_size, device=device, pad_id=pad_id, progress=progress)
    finally:
        insert(model, adapter, original)


@torch.no_grad()
def _rows(model: torch.nn.Module, adapter: MoEAdapter, group: ExpertGroup) -> dict[str, torch.Tensor]:
    """Clones of `group`'s expert rows where they live (no trip through host memory), by name."""
    check_group(model, adapter, group)
    out: dict[str, torch.Tensor] = {}
    for name in expert_names(group):
        layer, expert, param = parse_name(name)
        out[name] = getattr(adapter.experts(model, layer), param)[expert].detach().clone()
    return out

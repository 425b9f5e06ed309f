"""Judging a selection by running the pruned model alone: held-out loss against the fraction of experts kept.

At each keep fraction f, every MoE layer keeps n = max(1, round(f * E)) experts: the n the rule
scored highest (the selection's per-layer scores), or n drawn at random (one draw per seed). The
model is then physically pruned with `training.compressed.compress` (router rows sliced, routing
renormalised over the kept experts, top-k capped at n) and its held-out loss measured. Besides the
curve the report gives the full model's loss, the loss of the model pruned to exactly the selected
group, and the loss of the full model with the group's experts taken out (the complement kept), which
says how much the model leans on them. This module knows nothing about files or the command line.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from training.adapters import MoEAdapter
from training.compressed import compress
from training.evaluate import heldout_loss
from training.selection import choose

FRACTIONS = (0.0625, 0.125, 0.25, 0.5, 1.0)
SEEDS = (0, 1, 2)
Keep = dict[int, list[int]]
Scores = dict[int, list[float]]


def keep_count(fraction: float, num_experts: int) -> int:
    """Experts kept per layer at `fraction`: round(fraction * E), at least one."""
    if not 0 < fraction <= 1:
        raise ValueError(f"keep fractions must be in (0, 1], got {fraction}")
    return max(1, round(fraction * num_experts))


def parse_selection(selection: Mapping[str, Any], model: torch.nn.Module, adapter: MoEAdapter) -> tuple[Keep, Scores]:
    """(group, per-layer scores) of a selection JSON, refused in one line if it does not fit `model`."""
    group, stats = selection.get("group"), selection.get("stats")
    if not isinstance(group, dict) or not isinstance(stats, dict) or not group:
        raise ValueError("not a selection: expected 'group' and 'stats' objects keyed by layer")
    moe_layers, num_experts = adapter.moe_layers(model), adapter.num_experts(model)
    try:
        parsed_group = {int(layer): [int(e) for e in ids] for layer, ids in group.items()}
        scores = {int(layer): [float(v) for v in values] for layer, values in stats.items()}
    except (TypeError, ValueError) as exc:
        raise ValueError("not a selection: layers must be integers and ids and scores numbers") from exc
    for layer in sorted(set(parsed_group) | set(scores)):
        if layer not in moe_layers:
            raise ValueError(f"the selection names layer {layer}, which is not an MoE layer of this model "
                             f"(MoE layers: {moe_layers}); it was made for another model")
        if layer in scores and len(scores[layer]) != num_experts:
            raise ValueError(f"the selection scores {len(scores[layer])} experts in layer {layer}, this model "
                             f"has {num_experts}; it was made for another model")
        if any(not 0 <= e < num_experts for e in parsed_group.get(layer, [])):
            raise ValueError(f"the selection's layer {layer} names experts this model does not have "
                             f"(it has {num_experts}); it was made for another model")
    if set(scores) != set(parsed_group):
        raise ValueError("the selection's 'group' and 'stats' cover different layers")
    return parsed_group, scores


def rule_keep(scores: Mapping[int, Sequence[float]], n: int) -> Keep:
    """The `n` highest-scored experts of each layer (ties to the lower id)."""
    return {layer: choose(torch.tensor(values), top_d=n) for layer, values in sorted(scores.items())}


def random_keep(layers: Sequence[int], num_experts: int, n: int, seed: int) -> Keep:
    """`n` experts per layer drawn without replacement from a generator seeded by `seed`."""
    generator = torch.Generator().manual_seed(seed)
    return {layer: sorted(torch.randperm(num_experts, generator=generator)[:n].tolist()) for layer in layers}


def pruned_loss(
    model: torch.nn.Module, adapter: MoEAdapter, keep: Keep, sequences: torch.Tensor, batch_size: int, pad_id: int
) -> float:
    """Held-out loss of the model physically holding only `keep`'s experts in those layers."""
    small = compress(model, adapter, keep)
    return heldout_loss(small.model, sequences, batch_size=batch_size, pad_id=pad_id).loss


def subset_report(
    model: torch.nn.Module,
    adapter: MoEAdapter,
    selection: Mapping[str, Any],
    sequences: torch.Tensor,
    fractions: Sequence[float] = FRACTIONS,
    seeds: Sequence[int] = SEEDS,
    batch_size: int = 16,
    pad_id: int = 256,
) -> dict[str, Any]:
    """The keep-fraction curve of a selection against random choice, with full and group losses."""
    if not fractions or not seeds:
        raise ValueError("give at least one keep fraction and one random seed")
    num_experts = adapter.num_experts(model)
    counts = [keep_count(f, num_experts) for f in fractions]
    group, scores = parse_selection(selection, model, adapter)
    full = heldout_loss(model, sequences, batch_size=batch_size, pad_id=pad_id)
    curve = []
    for fraction, n in zip(fractions, counts, strict=True):
        randoms = [pruned_loss(model, adapter, random_keep(sorted(scores), num_experts, n, seed), sequences,
                               batch_size, pad_id) for seed in seeds]
        curve.append({
            "fraction": fraction,
            "kept": n,
            "rule": pruned_loss(model, adapter, rule_keep(scores, n), sequences, batch_size, pad_id),
            "random": randoms,
            "random_mean": sum(randoms) / len(randoms),
        })
    complement = {layer: sorted(set(range(num_experts)) - set(ids)) for layer, ids in group.items()}
    without = None
    if all(complement.values()):
        without = pruned_loss(model, adapter, complement, sequences, batch_size, pad_id)
    return {
        "rule": selection.get("rule"),
        "experts": num_experts,
        "layers": sorted(scores),
        "tokens": full.tokens,
        "seeds": list(seeds),
        "full": full.loss,
        "group": {"experts": {str(k): v for k, v in group.items()},
                  "loss": pruned_loss(model, adapter, group, sequences, batch_size, pad_id)},
        "without_group": without,
        "curve": curve,
    }

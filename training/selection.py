"""Phase 1 expert selection: routing statistics on domain data, then a per-layer choice of experts.

A forward hook on every MoE layer's router records, over non-padding tokens only:
- gate mass: mean router probability per expert (softmax of the router logits; for DeepSeek-V3,
  whose router scores each expert with an independent sigmoid, the sigmoid scores normalised to
  sum to one per token);
- token frequency: each expert's share of the top-k routing slots;
- activation norm: mean over tokens of the norm of the expert's gated output, ||w_te * E_e(x_t)||,
  counted as zero where the token is not routed to e, so it measures how much each expert writes
  into the residual stream on this data;
- differential (a rule, not a statistic): domain gate mass minus general-data gate mass.
Per layer, experts are ranked by the rule's score and chosen by a budget: the `top_d` best, or the
fewest whose share of the (positive) score reaches `mass`.

Data comes as packed rows [N, S] (statistics pooled over all tokens) or as a list of documents, each
[n_i, S] (statistics pooled per document, then averaged across documents, so each document counts
once however long it is; this is how EMO selects from 1-5 examples). Mode `global` measures every
layer on the full model; `layerwise` measures layer l with layers < l already pruned to their chosen
experts (routed as `training.compressed` does), so later choices see the model the group will run
in. Shared experts are always on and never part of a group. The result records a hash of the token
ids it measured, the rule, budget, mode and per-layer scores, so the choice can be reproduced.
Expert-layout knowledge stays in the adapter; tokenization and files stay in `training.data`. This
module does not train.

Shapes: D documents (groups of rows), T tokens in a forward, H hidden, E experts, K top-k slots,
I expert intermediate size.
"""

from __future__ import annotations

import hashlib
import math
import sys
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from tqdm import tqdm

from training.adapters import tensor_attr
from training.compressed import masked_routing
from training.data import not_padding

RULES = ("gate-mass", "token-freq", "differential", "activation-norm")
MODES = ("global", "layerwise")
Domain = torch.Tensor | Sequence[torch.Tensor]


@dataclass(frozen=True)
class RoutingStats:
    """Per-layer, per-expert routing statistics over `tokens` non-padding tokens."""

    gate_mass: dict[int, torch.Tensor]
    token_freq: dict[int, torch.Tensor]
    activation_norm: dict[int, torch.Tensor]
    tokens: int


def router_probs(logits_TE: torch.Tensor, sigmoid: bool) -> torch.Tensor:
    """Per-token routing distribution (fp32): softmax of the logits, or sigmoid scores normalised to one."""
    if sigmoid:
        scores_TE = logits_TE.float().sigmoid()
        return scores_TE / scores_TE.sum(dim=-1, keepdim=True)
    return logits_TE.float().softmax(dim=-1)


class _LayerRecorder:
    """Accumulates one layer's statistics per group of rows (a document, or all rows as one group)."""

    def __init__(self, experts: torch.nn.Module, groups: int, num_experts: int, sigmoid: bool) -> None:
        self.experts = experts
        self.sigmoid = sigmoid
        self.gate_sum_DE = torch.zeros(groups, num_experts, dtype=torch.float64)
        self.slots_DE = torch.zeros(groups, num_experts, dtype=torch.float64)
        self.norm_sum_DE = torch.zeros(groups, num_experts, dtype=torch.float64)
        self.mask_T: torch.Tensor | None = None
        self.group_T: torch.Tensor | None = None

    def hook(self, module: torch.nn.Module, inputs: tuple[Any, ...], outputs: tuple[torch.Tensor, ...]) -> None:
        assert self.mask_T is not None and self.group_T is not None, "set mask and groups before the forward"
        logits_TE, weights_TK, index_TK = outputs[0], outputs[1], outputs[2]
        x_TH = inputs[0].reshape(-1, inputs[0].shape[-1])
        keep = self.mask_T
        logits_TE, weights_TK, index_TK, x_TH = logits_TE[keep], weights_TK[keep], index_TK[keep], x_TH[keep]
        group_T = self.group_T[keep].cpu()
        probs_TE = router_probs(logits_TE, self.sigmoid).double().cpu()
        self.gate_sum_DE.index_add_(0, group_T, probs_TE)
        slot_group = group_T.repeat_interleave(index_TK.shape[1])
        ones = torch.ones(slot_group.numel(), dtype=torch.float64)
        self.slots_DE.index_put_((slot_group, index_TK.reshape(-1).cpu()), ones, accumulate=True)
        self._add_output_norms(x_TH, weights_TK, index_TK, group_T)

    def _add_output_norms(
        self, x_TH: torch.Tensor, weights_TK: torch.Tensor, index_TK: torch.Tensor, group_T: torch.Tensor
    ) -> None:
        w_gu_EIH = tensor_attr(self.experts, "gate_up_proj")
        w_down_EHI = tensor_attr(self.experts, "down_proj")
        act_fn = self.experts.get_submodule("act_fn")
        for expert in torch.unique(index_TK).tolist():
            token, slot = torch.where(index_TK == expert)
            gate, up = torch.nn.functional.linear(x_TH[token], w_gu_EIH[expert]).chunk(2, dim=-1)
            out_TH = torch.nn.functional.linear(act_fn(gate) * up, w_down_EHI[expert])
            out_TH = out_TH * weights_TK[token, slot, None]
            norms = out_TH.float().norm(dim=-1).double().cpu()
            self.norm_sum_DE[:, expert].index_add_(0, group_T[token.cpu()], norms)


@torch.no_grad()
def routing_stats(
    model: torch.nn.Module,
    adapter: Any,
    sequences: torch.Tensor,
    batch_size: int = 8,
    pad_id: int = 256,
    groups: torch.Tensor | None = None,
    progress: bool = False,
) -> RoutingStats:
    """Run `sequences` [N, S] through the model and gather routing statistics of every MoE layer.

    With `groups` [N] (each row's document index, 0..D-1, every index used) the statistics are taken
    per document and then averaged over documents; without, over all tokens at once. `progress`: a
    tqdm bar over the batches when stderr is a terminal (the `tessera select-experts` command).
    """
    if sequences.ndim != 2 or sequences.shape[0] == 0:
        raise ValueError(f"expected a non-empty [N, seq_len] tensor of token ids, got shape {tuple(sequences.shape)}")
    if groups is None:
        groups = torch.zeros(sequences.shape[0], dtype=torch.long)
    assert groups.shape == sequences.shape[:1], "one group index per row"
    n_groups = int(groups.max()) + 1
    num_experts = adapter.num_experts(model)
    recorders: dict[int, _LayerRecorder] = {}
    handles = []
    for layer in adapter.moe_layers(model):
        router = adapter.router(model, layer)
        recorders[layer] = _LayerRecorder(adapter.experts(model, layer), n_groups, num_experts,
                                          adapter.routing == "sigmoid")
        handles.append(router.register_forward_hook(recorders[layer].hook))
    was_training = model.training
    model.eval()
    tokens_D = torch.zeros(n_groups, dtype=torch.float64)
    device = next(model.parameters()).device
    try:
        starts = range(0, sequences.shape[0], batch_size)
        for start in tqdm(starts, desc="routing", unit="batch", disable=not (progress and sys.stderr.isatty())):
            ids_BS = sequences[start : start + batch_size].to(device)
            mask_BS = not_padding(ids_BS, pad_id)
            group_BS = groups[start : start + batch_size, None].expand(ids_BS.shape)
            for recorder in recorders.values():
                recorder.mask_T = mask_BS.reshape(-1)
                recorder.group_T = group_BS.reshape(-1).to(device)
            model(input_ids=ids_BS, attention_mask=mask_BS.long())
            tokens_D.index_add_(0, group_BS.reshape(-1), mask_BS.reshape(-1).double().cpu())
    finally:
        for handle in handles:
            handle.remove()
        model.train(was_training)
    if bool((tokens_D == 0).any()):
        raise ValueError("the data holds only padding tokens" if n_groups == 1 else "a document holds only padding")

    def per_group_mean(sums_DE: torch.Tensor, totals_D: torch.Tensor) -> torch.Tensor:
        return (sums_DE / totals_D[:, None]).mean(dim=0).float()

    return RoutingStats(
        gate_mass={layer: per_group_mean(r.gate_sum_DE, tokens_D) for layer, r in recorders.items()},
        token_freq={layer: per_group_mean(r.slots_DE, r.slots_DE.sum(dim=1)) for layer, r in recorders.items()},
        activation_norm={layer: per_group_mean(r.norm_sum_DE, tokens_D) for layer, r in recorders.items()},
        tokens=int(tokens_D.sum()),
    )


def rule_scores(rule: str, domain: RoutingStats, general: RoutingStats | None = None) -> dict[int, torch.Tensor]:
    """Per-layer expert scores for a selection rule; `differential` needs general-data statistics."""
    if rule == "gate-mass":
        return domain.gate_mass
    if rule == "token-freq":
        return domain.token_freq
    if rule == "activation-norm":
        return domain.activation_norm
    if rule == "differential":
        if general is None:
            raise ValueError("the differential rule needs general data (--general FILES)")
        return {layer: domain.gate_mass[layer] - general.gate_mass[layer] for layer in domain.gate_mass}
    raise ValueError(f"unknown selection rule {rule!r}; choose one of {', '.join(RULES)}")


def check_budget(top_d: int | None, mass: float | None, num_experts: int) -> None:
    """ValueError unless exactly one budget is given: 1 <= top_d <= num_experts, or mass in (0, 1]."""
    if (top_d is None) == (mass is None):
        raise ValueError("give exactly one budget: top_d or mass")
    if top_d is not None and not 1 <= top_d <= num_experts:
        raise ValueError(f"top_d must be between 1 and {num_experts}, got {top_d}")
    if mass is not None and not 0 < mass <= 1:
        raise ValueError(f"mass must be in (0, 1], got {mass}")


def choose(scores_E: torch.Tensor, top_d: int | None = None, mass: float | None = None) -> list[int]:
    """Expert ids for one layer: the `top_d` highest scores, or the fewest reaching `mass` of the total.

    Ties go to the lower expert id. For `mass`, negative scores count as zero.
    """
    check_budget(top_d, mass, scores_E.numel())
    order = sorted(range(scores_E.numel()), key=lambda e: (-float(scores_E[e]), e))
    if top_d is not None:
        return sorted(order[:top_d])
    assert mass is not None
    positive = scores_E.double().clamp(min=0)
    total = float(positive.sum())
    if total <= 0:
        raise ValueError("no expert has a positive score in this layer; use a top-d budget instead")
    chosen, reached = [], 0.0
    for expert in order:
        chosen.append(expert)
        reached += float(positive[expert]) / total
        if reached >= mass - 1e-9:
            break
    return sorted(chosen)


def pooled_stats(
    model: torch.nn.Module, adapter: Any, domain: Domain, batch_size: int = 8, pad_id: int = 256,
    progress: bool = False,
) -> RoutingStats:
    """Statistics of packed rows [N, S] over all tokens, or of documents: per document, then their mean."""
    if isinstance(domain, torch.Tensor):
        return routing_stats(model, adapter, domain, batch_size, pad_id, progress=progress)
    if not domain:
        raise ValueError("no documents to measure")
    groups = torch.cat([torch.full((doc.shape[0],), i, dtype=torch.long) for i, doc in enumerate(domain)])
    return routing_stats(model, adapter, torch.cat(list(domain)), batch_size, pad_id, groups=groups,
                         progress=progress)


def data_sha256(domain: Domain) -> str:
    """SHA-256 over the token ids measured (each document's shape, then its int64 ids), as hex."""
    digest = hashlib.sha256()
    for rows in [domain] if isinstance(domain, torch.Tensor) else domain:
        digest.update(repr(tuple(rows.shape)).encode())
        digest.update(rows.to(torch.int64).contiguous().numpy().tobytes())
    return digest.hexdigest()


def select_experts(
    model: torch.nn.Module,
    adapter: Any,
    domain: Domain,
    rule: str,
    top_d: int | None = None,
    mass: float | None = None,
    general: Domain | None = None,
    batch_size: int = 8,
    pad_id: int = 256,
    mode: str = "global",
    progress: bool = False,
    exclude: Mapping[int, Sequence[int]] | None = None,
) -> dict[str, Any]:
    """The JSON-able selection of every MoE layer's experts (see the module docstring for `domain`, `mode`);
    `exclude`: experts no layer may choose (the group trained now, when the next must be disjoint from it).

    Keys: "group" {layer: ids}, "rule", "budget", "mode", "pooling" ("tokens" or "documents"),
    "documents" (count, or None for packed rows), "tokens", "data_sha256", "general_sha256" (or None),
    "stats" {layer: scores the choice ranked}.
    """
    if rule not in RULES:
        raise ValueError(f"unknown selection rule {rule!r}; choose one of {', '.join(RULES)}")
    if mode not in MODES:
        raise ValueError(f"unknown selection mode {mode!r}; choose one of {', '.join(MODES)}")
    if rule == "differential" and general is None:
        raise ValueError("the differential rule needs general data (--general FILES)")
    check_budget(top_d, mass, adapter.num_experts(model))  # before any forward
    group: dict[int, list[int]] = {}
    scores: dict[int, torch.Tensor] = {}
    tokens = 0
    moe_layers = adapter.moe_layers(model)
    passes = [moe_layers] if mode == "global" else [[layer] for layer in moe_layers]
    for layers in passes:
        with _pruned(model, adapter, group):
            domain_stats = pooled_stats(model, adapter, domain, batch_size, pad_id, progress)
            general_stats = (pooled_stats(model, adapter, general, batch_size, pad_id, progress)
                             if general is not None else None)
        layer_scores = rule_scores(rule, domain_stats, general_stats)
        tokens = domain_stats.tokens
        for layer in layers:
            scores[layer] = layer_scores[layer]
            eligible = scores[layer].clone()
            eligible[list((exclude or {}).get(layer, []))] = -math.inf  # never in a top-d, no share of the mass
            group[layer] = choose(eligible, top_d, mass)
            if set(group[layer]) & set((exclude or {}).get(layer, [])):
                raise ValueError(f"layer {layer}: fewer experts than the budget asks for are outside the excluded "
                                 "group; ask for fewer")
    return {
        "group": {str(layer): group[layer] for layer in sorted(group)},
        "rule": rule,
        "budget": {"top_d": top_d} if top_d is not None else {"mass": mass},
        "mode": mode,
        "pooling": "tokens" if isinstance(domain, torch.Tensor) else "documents",
        "documents": None if isinstance(domain, torch.Tensor) else len(domain),
        "tokens": tokens,
        "data_sha256": data_sha256(domain),
        "general_sha256": None if general is None else data_sha256(general),
        "stats": {str(layer): [round(float(v), 6) for v in scores[layer]] for layer in sorted(scores)},
    }


@contextmanager
def _pruned(model: torch.nn.Module, adapter: Any, keep: Mapping[int, Sequence[int]]) -> Iterator[None]:
    handles = masked_routing(model, adapter, keep)
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()

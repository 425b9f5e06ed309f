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
fewest whose share of the (positive) score reaches `mass`. Expert-layout knowledge stays in the
adapter; tokenization and files stay in `training.data`. This module does not train anything.

Shapes: T tokens in a forward, H hidden, E experts, K top-k slots, I expert intermediate size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

RULES = ("gate-mass", "token-freq", "differential", "activation-norm")


@dataclass(frozen=True)
class RoutingStats:
    """Per-layer, per-expert routing statistics over `tokens` non-padding tokens."""

    gate_mass: dict[int, torch.Tensor]
    token_freq: dict[int, torch.Tensor]
    activation_norm: dict[int, torch.Tensor]
    tokens: int


class _LayerRecorder:
    """Accumulates one layer's statistics from its router's inputs and outputs."""

    def __init__(self, experts: torch.nn.Module, num_experts: int, sigmoid: bool) -> None:
        self.experts = experts
        self.sigmoid = sigmoid
        self.gate_sum_E = torch.zeros(num_experts, dtype=torch.float64)
        self.slots_E = torch.zeros(num_experts, dtype=torch.float64)
        self.norm_sum_E = torch.zeros(num_experts, dtype=torch.float64)
        self.mask_T: torch.Tensor | None = None

    def hook(self, module: torch.nn.Module, inputs: tuple[Any, ...], outputs: tuple[torch.Tensor, ...]) -> None:
        assert self.mask_T is not None, "set the token mask before the forward pass"
        logits_TE, weights_TK, index_TK = outputs[0], outputs[1], outputs[2]
        x_TH = inputs[0].reshape(-1, inputs[0].shape[-1])
        keep = self.mask_T
        logits_TE, weights_TK, index_TK, x_TH = logits_TE[keep], weights_TK[keep], index_TK[keep], x_TH[keep]
        if self.sigmoid:
            scores_TE = logits_TE.float().sigmoid()
            probs_TE = scores_TE / scores_TE.sum(dim=-1, keepdim=True)
        else:
            probs_TE = logits_TE.float().softmax(dim=-1)
        self.gate_sum_E += probs_TE.sum(dim=0).double()
        self.slots_E += torch.bincount(index_TK.reshape(-1), minlength=self.gate_sum_E.numel()).double()
        self.norm_sum_E += self._output_norms(x_TH, weights_TK, index_TK)

    def _output_norms(self, x_TH: torch.Tensor, weights_TK: torch.Tensor, index_TK: torch.Tensor) -> torch.Tensor:
        w_gu_EIH = self.experts.gate_up_proj
        w_down_EHI = self.experts.down_proj
        sums_E = torch.zeros_like(self.norm_sum_E)
        for expert in index_TK.unique().tolist():
            token, slot = torch.where(index_TK == expert)
            gate, up = torch.nn.functional.linear(x_TH[token], w_gu_EIH[expert]).chunk(2, dim=-1)
            out_TH = torch.nn.functional.linear(self.experts.act_fn(gate) * up, w_down_EHI[expert])
            out_TH = out_TH * weights_TK[token, slot, None]
            sums_E[expert] = out_TH.float().norm(dim=-1).sum().double()
        return sums_E


@torch.no_grad()
def routing_stats(
    model: torch.nn.Module, adapter: Any, sequences: torch.Tensor, batch_size: int = 8, pad_id: int = 256
) -> RoutingStats:
    """Run `sequences` [N, S] through the model and gather routing statistics of every MoE layer."""
    if sequences.ndim != 2 or sequences.shape[0] == 0:
        raise ValueError(f"expected a non-empty [N, seq_len] tensor of token ids, got shape {tuple(sequences.shape)}")
    num_experts = adapter.num_experts(model)
    recorders: dict[int, _LayerRecorder] = {}
    handles = []
    for layer in adapter.moe_layers(model):
        router = adapter.router(model, layer)
        recorders[layer] = _LayerRecorder(adapter.experts(model, layer), num_experts, adapter.routing == "sigmoid")
        handles.append(router.register_forward_hook(recorders[layer].hook))
    was_training = model.training
    model.eval()
    tokens = 0
    device = next(model.parameters()).device
    try:
        for start in range(0, sequences.shape[0], batch_size):
            ids_BS = sequences[start : start + batch_size].to(device)
            mask_BS = ids_BS != pad_id
            for recorder in recorders.values():
                recorder.mask_T = mask_BS.reshape(-1)
            model(input_ids=ids_BS, attention_mask=mask_BS.long())
            tokens += int(mask_BS.sum())
    finally:
        for handle in handles:
            handle.remove()
        model.train(was_training)
    if tokens == 0:
        raise ValueError("the data holds only padding tokens")
    top_k = _slots_per_token(recorders, tokens)
    return RoutingStats(
        gate_mass={layer: (r.gate_sum_E / tokens).float() for layer, r in recorders.items()},
        token_freq={layer: (r.slots_E / (tokens * top_k)).float() for layer, r in recorders.items()},
        activation_norm={layer: (r.norm_sum_E / tokens).float() for layer, r in recorders.items()},
        tokens=tokens,
    )


def _slots_per_token(recorders: dict[int, _LayerRecorder], tokens: int) -> int:
    slots = {round(float(r.slots_E.sum()) / tokens) for r in recorders.values()}
    assert len(slots) == 1, f"MoE layers disagree on top-k: {slots}"
    return slots.pop()


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


def choose(scores_E: torch.Tensor, top_d: int | None = None, mass: float | None = None) -> list[int]:
    """Expert ids for one layer: the `top_d` highest scores, or the fewest reaching `mass` of the total.

    Ties go to the lower expert id. For `mass`, negative scores count as zero.
    """
    if (top_d is None) == (mass is None):
        raise ValueError("give exactly one budget: top_d or mass")
    order = sorted(range(scores_E.numel()), key=lambda e: (-float(scores_E[e]), e))
    if top_d is not None:
        if not 1 <= top_d <= scores_E.numel():
            raise ValueError(f"top_d must be between 1 and {scores_E.numel()}, got {top_d}")
        return sorted(order[:top_d])
    assert mass is not None
    if not 0 < mass <= 1:
        raise ValueError(f"mass must be in (0, 1], got {mass}")
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


def select_experts(
    model: torch.nn.Module,
    adapter: Any,
    domain: torch.Tensor,
    rule: str,
    top_d: int | None = None,
    mass: float | None = None,
    general: torch.Tensor | None = None,
    batch_size: int = 8,
    pad_id: int = 256,
) -> dict[str, Any]:
    """The JSON-able selection: {"group": {layer: ids}, "rule", "budget", "tokens", "stats": {layer: scores}}."""
    if rule not in RULES:
        raise ValueError(f"unknown selection rule {rule!r}; choose one of {', '.join(RULES)}")
    if rule == "differential" and general is None:
        raise ValueError("the differential rule needs general data (--general FILES)")
    domain_stats = routing_stats(model, adapter, domain, batch_size, pad_id)
    general_stats = routing_stats(model, adapter, general, batch_size, pad_id) if general is not None else None
    scores = rule_scores(rule, domain_stats, general_stats)
    return {
        "group": {str(layer): choose(scores[layer], top_d, mass) for layer in sorted(scores)},
        "rule": rule,
        "budget": {"top_d": top_d} if top_d is not None else {"mass": mass},
        "tokens": domain_stats.tokens,
        "stats": {str(layer): [round(float(v), 6) for v in scores[layer]] for layer in sorted(scores)},
    }

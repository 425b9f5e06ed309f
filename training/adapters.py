"""Model adapters: where each transformers MoE family keeps its experts, router and shared experts.

In transformers 5 all supported families share one layout: a decoder layer whose `mlp` is an MoE
block has `mlp.experts.gate_up_proj` [E, 2I, H] (rows [gate; up]), `mlp.experts.down_proj`
[E, H, I] and a router `mlp.gate` with `.weight` [E, H]. Dense layers (DeepSeek's
`first_k_dense_replace`, Qwen3's `mlp_only_layers` / `decoder_sparse_step`) have no `experts`
and are never listed. Hub checkpoints keep one key per expert; `convert_hub_state_dict` fuses them
the way transformers' own conversion mapping does (stack experts on dim 0, concat gate then up).
An adapter also knows how its family routes, so the trainer's `compressed` forward can mask the
router to the selected experts. This module knows nothing about training, blobs or the network.

Legend: T tokens, H hidden size, E routed experts, K experts per token, I expert intermediate size.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from transformers import (
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    OlmoeConfig,
    OlmoeForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

Routing = Literal["softmax", "sigmoid"]
# One routed expert in a hub checkpoint: <prefix>.experts.<e>.<projection>.weight
_HUB_EXPERT = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>\w+)\.weight$")


@dataclass(frozen=True)
class MoEAdapter:
    """Everything family-specific about one transformers MoE family."""

    family: str
    config_class: type[PretrainedConfig]
    model_class: type[PreTrainedModel]
    routing: Routing
    """`softmax`: softmax over router logits, top-k; `sigmoid`: DeepSeek-V3 sigmoid scores + bias."""
    hub_projections: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    """Per-expert hub key names of the gate, up and down projections."""
    hub_renames: tuple[tuple[str, str], ...] = ()
    """Substring renames applied to hub keys before fusing (Mixtral's `block_sparse_moe` -> `mlp`)."""
    shared_attr: str | None = None
    """Attribute of the MoE block holding always-on shared experts, if the family has them."""

    def moe_layers(self, model: torch.nn.Module) -> list[int]:
        """Indices of the decoder layers that hold routed experts, ascending."""
        return [i for i, layer in enumerate(_decoder_layers(model)) if hasattr(layer.mlp, "experts")]

    def experts(self, model: torch.nn.Module, layer: int) -> torch.nn.Module:
        """The fused experts module of `layer` (attributes `gate_up_proj`, `down_proj`)."""
        return self._moe_block(model, layer).experts

    def router(self, model: torch.nn.Module, layer: int) -> torch.nn.Module:
        """The router of `layer` (`.weight` [E, H]; DeepSeek-V3 also `e_score_correction_bias`)."""
        return self._moe_block(model, layer).gate

    def num_experts(self, model: torch.nn.Module) -> int:
        """Routed experts per MoE layer (the same in every layer of the supported families)."""
        layers = self.moe_layers(model)
        if not layers:
            raise ValueError(f"the {self.family} model has no MoE layers")
        return int(self.experts(model, layers[0]).gate_up_proj.shape[0])

    def shared_expert_params(self, model: torch.nn.Module, layer: int) -> dict[str, torch.nn.Parameter]:
        """Parameters of `layer`'s shared experts by their name in the model; empty if none."""
        block = self._moe_block(model, layer)
        if self.shared_attr is None:
            return {}
        prefix = f"model.layers.{layer}.mlp.{self.shared_attr}."
        return {prefix + name: p for name, p in getattr(block, self.shared_attr).named_parameters()}

    def convert_hub_state_dict(
        self, state_dict: Mapping[str, torch.Tensor], config: PretrainedConfig
    ) -> dict[str, torch.Tensor]:
        """Turn per-expert hub keys into the fused layout; already-fused keys pass through unchanged."""
        renamed: dict[str, torch.Tensor] = {}
        for key, tensor in state_dict.items():
            for old, new in self.hub_renames:
                key = key.replace(old, new)
            renamed[key] = tensor
        per_expert: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
        out: dict[str, torch.Tensor] = {}
        for key, tensor in renamed.items():
            match = _HUB_EXPERT.match(key)
            if match is None:
                out[key] = tensor
                continue
            if match["proj"] not in self.hub_projections:
                raise ValueError(f"{key}: unknown expert projection {match['proj']!r} for {self.family}")
            by_proj = per_expert.setdefault(match["prefix"], {})
            by_proj.setdefault(match["proj"], {})[int(match["expert"])] = tensor
        n_experts = int(config.num_local_experts)
        gate, up, down = self.hub_projections
        for prefix, by_proj in sorted(per_expert.items()):
            stacked = {
                proj: _stack_experts(prefix, proj, by_proj.get(proj, {}), n_experts)
                for proj in (gate, up, down)
            }
            out[f"{prefix}.gate_up_proj"] = torch.cat([stacked[gate], stacked[up]], dim=1)
            out[f"{prefix}.down_proj"] = stacked[down]
        return out

    def route(
        self, router: torch.nn.Module, hidden_TH: torch.Tensor, allowed_E: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Route tokens to `allowed_E` experts only, as a model holding just those experts would.

        Returns (router logits [T, E], weights [T, K'], expert ids [T, K']) with K' = min(K, allowed).
        Softmax families take the softmax over the allowed experts' logits only; DeepSeek-V3 keeps its
        sigmoid scores and correction bias but drops group-limited routing (the groups of a partial
        expert set are not meaningful).
        """
        hidden_TH = hidden_TH.reshape(-1, router.weight.shape[1])
        k = min(int(router.top_k), int(allowed_E.sum()))
        blocked_E = ~allowed_E.to(hidden_TH.device)
        if self.routing == "softmax":
            logits_TE = F.linear(hidden_TH, router.weight)
            probs_TE = logits_TE.float().masked_fill(blocked_E, float("-inf")).softmax(dim=-1)
            weights_TK, index_TK = torch.topk(probs_TE, k, dim=-1)
            if getattr(router, "norm_topk_prob", True):  # Mixtral always renormalises and has no flag
                weights_TK = weights_TK / weights_TK.sum(dim=-1, keepdim=True)
            return logits_TE, weights_TK.to(logits_TE.dtype), index_TK
        logits_TE = F.linear(hidden_TH.float(), router.weight.float())
        scores_TE = logits_TE.sigmoid()
        choice_TE = (scores_TE + router.e_score_correction_bias).masked_fill(blocked_E, float("-inf"))
        index_TK = torch.topk(choice_TE, k, dim=-1, sorted=False)[1]
        weights_TK = scores_TE.gather(1, index_TK)
        if router.norm_topk_prob:
            weights_TK = weights_TK / (weights_TK.sum(dim=-1, keepdim=True) + 1e-20)
        return logits_TE, weights_TK * router.routed_scaling_factor, index_TK

    def _moe_block(self, model: torch.nn.Module, layer: int) -> torch.nn.Module:
        layers = _decoder_layers(model)
        if not 0 <= layer < len(layers):
            raise ValueError(f"layer {layer} does not exist; the model has {len(layers)} layers")
        if not hasattr(layers[layer].mlp, "experts"):
            raise ValueError(
                f"layer {layer} is dense, not an MoE layer; MoE layers: {self.moe_layers(model)}"
            )
        return layers[layer].mlp


ADAPTERS: dict[str, MoEAdapter] = {
    "qwen3_moe": MoEAdapter("qwen3_moe", Qwen3MoeConfig, Qwen3MoeForCausalLM, "softmax"),
    "olmoe": MoEAdapter("olmoe", OlmoeConfig, OlmoeForCausalLM, "softmax"),
    "mixtral": MoEAdapter(
        "mixtral",
        MixtralConfig,
        MixtralForCausalLM,
        "softmax",
        hub_projections=("w1", "w3", "w2"),
        hub_renames=((".block_sparse_moe.", ".mlp."),),
    ),
    "deepseek_v3": MoEAdapter(
        "deepseek_v3", DeepseekV3Config, DeepseekV3ForCausalLM, "sigmoid", shared_attr="shared_experts"
    ),
}


def adapter_for(family: str) -> MoEAdapter:
    """The adapter of a family name as written in a spec ("qwen3_moe", "olmoe", "mixtral", "deepseek_v3")."""
    try:
        return ADAPTERS[family]
    except KeyError:
        raise ValueError(f"unknown model family {family!r}; supported: {', '.join(ADAPTERS)}") from None


def _decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    base = getattr(model, "model", model)
    layers = getattr(base, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise ValueError(f"{type(model).__name__} has no decoder layers at `model.layers`")
    return layers


def _stack_experts(
    prefix: str, proj: str, tensors: Mapping[int, torch.Tensor], n_experts: int
) -> torch.Tensor:
    missing = sorted(set(range(n_experts)) - set(tensors))
    extra = sorted(set(tensors) - set(range(n_experts)))
    if missing or extra:
        raise ValueError(
            f"{prefix}: the checkpoint's {proj} experts do not match the config's {n_experts} experts "
            f"(missing {missing[:5]}, unexpected {extra[:5]})"
        )
    shapes = {tuple(t.shape) for t in tensors.values()}
    if len(shapes) != 1:
        raise ValueError(f"{prefix}: {proj} experts have different shapes {sorted(shapes)}")
    return torch.stack([tensors[e] for e in range(n_experts)], dim=0)

"""Model adapters: one reader of transformers 5's standard MoE layout, with each family a table entry.

In transformers 5 every supported family keeps its MoE block at `model.layers[i].mlp`, with fused
routed experts `mlp.experts.gate_up_proj` [E, 2I, H] (rows [gate; up]) and `mlp.experts.down_proj`
[E, H, I], a router `mlp.gate` with `.weight` [E, H], and optionally always-on shared experts.
Dense layers (DeepSeek's `first_k_dense_replace`, Qwen's `mlp_only_layers` / `decoder_sparse_step`)
have no `experts` and are never listed. What differs between families is only how they route and
where their shared experts live; that is the `MoEAdapter` table entry. Hub checkpoints keep one key
per expert; transformers' own conversion mapping fuses them on load (see `training.model`), so this
module never renames weights. It knows nothing about files, training, blobs or the network.

Legend: T tokens, H hidden size, E routed experts, K experts per token, I expert intermediate size.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, SupportsInt, cast

import torch
import torch.nn.functional as F

Routing = Literal["softmax", "sigmoid"]
# Config keys that count routed experts in the families transformers knows.
_EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
# MoE families whose experts do not fit the fused [E, 2I, H] / [E, H, I] layout, and why.
_UNFIT: dict[str, str] = {
    "gpt_oss": "its experts are stored transposed ([E, H, 2I]), with gate/up interleaved and biases, "
    "and hub checkpoints are MXFP4-quantized",
}


@dataclass(frozen=True)
class MoEAdapter:
    """Everything family-specific about one transformers MoE family: how it routes, where shared experts are."""

    family: str
    """The transformers `model_type`, as written in a spec's `model.family`."""
    routing: Routing
    """`softmax`: softmax over router logits, top-k; `sigmoid`: DeepSeek-V3 sigmoid scores + bias."""
    renormalise: bool | None = None
    """Whether top-k weights are renormalised; None reads the router's own `norm_topk_prob` flag."""
    shared: tuple[str, ...] = ()
    """Attributes of the MoE block holding always-on shared experts (and their gate), if any."""
    fp32_logits: bool = False
    """Whether the router's logits are computed in fp32 (DeepSeek) rather than in the model's dtype."""
    cast_weights: bool = True
    """Whether top-k weights are cast to the logits' dtype (Qwen, OLMoE), not left in fp32 (Mixtral)."""

    def moe_layers(self, model: torch.nn.Module) -> list[int]:
        """Indices of the decoder layers that hold routed experts, ascending."""
        return [i for i, layer in enumerate(decoder_layers(model)) if hasattr(layer.mlp, "experts")]

    def experts(self, model: torch.nn.Module, layer: int) -> torch.nn.Module:
        """The fused experts module of `layer` (attributes `gate_up_proj`, `down_proj`)."""
        return self._moe_block(model, layer).get_submodule("experts")

    def router(self, model: torch.nn.Module, layer: int) -> torch.nn.Module:
        """The router of `layer` (`.weight` [E, H]; DeepSeek-V3 also `e_score_correction_bias`)."""
        return self._moe_block(model, layer).get_submodule("gate")

    def num_experts(self, model: torch.nn.Module) -> int:
        """Routed experts per MoE layer (the same in every layer of the supported families)."""
        layers = self.moe_layers(model)
        if not layers:
            raise ValueError(f"the {self.family} model has no MoE layers")
        return int(tensor_attr(self.experts(model, layers[0]), "gate_up_proj").shape[0])

    def shared_expert_params(self, model: torch.nn.Module, layer: int) -> dict[str, torch.nn.Parameter]:
        """Parameters of `layer`'s shared experts (and shared-expert gate) by their name in the model."""
        block = self._moe_block(model, layer)
        out: dict[str, torch.nn.Parameter] = {}
        for attr in self.shared:
            prefix = f"model.layers.{layer}.mlp.{attr}."
            out |= {prefix + name: p for name, p in getattr(block, attr).named_parameters()}
        return out

    def check_layout(self, model: torch.nn.Module) -> None:
        """Refuse a model whose MoE layers do not have the fused layout this adapter reads."""
        layers = self.moe_layers(model)
        if not layers:
            raise ValueError(f"the {self.family} model has no MoE layers (every layer is dense)")
        for layer in layers:
            experts, router = self.experts(model, layer), self.router(model, layer)
            gate_up = getattr(experts, "gate_up_proj", None)
            down = getattr(experts, "down_proj", None)
            found = {name: tuple(t.shape) for name, t in experts.named_parameters()}
            if not isinstance(gate_up, torch.Tensor) or not isinstance(down, torch.Tensor) or set(found) != {
                "gate_up_proj",
                "down_proj",
            }:
                raise ValueError(
                    f"layer {layer}: experts hold {found}, not the fused gate_up_proj/down_proj layout"
                )
            n, two_i, hidden = gate_up.shape
            weight_EH = tensor_attr(router, "weight")
            if tuple(down.shape) != (n, hidden, two_i // 2) or tuple(weight_EH.shape) != (n, hidden):
                raise ValueError(
                    f"layer {layer}: gate_up_proj {tuple(gate_up.shape)}, down_proj {tuple(down.shape)} and "
                    f"router {tuple(weight_EH.shape)} are not [E, 2I, H], [E, H, I] and [E, H]"
                )
            if not 1 <= router_top_k(router) <= n:
                raise ValueError(
                    f"layer {layer}: the router picks {router_top_k(router)} experts per token of {n}; "
                    "num_experts_per_tok must be between 1 and the number of experts"
                )

    def route(
        self, router: torch.nn.Module, hidden_TH: torch.Tensor, allowed_E: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Route tokens to `allowed_E` experts only, as a model holding just those experts would.

        Returns (router logits [T, E], weights [T, K'], expert ids [T, K']) with K' = min(K, allowed).
        Softmax families take the softmax over the allowed experts' logits only; DeepSeek keeps its
        scaling factor, and V3 its sigmoid scores and correction bias, but group-limited routing is
        dropped (the groups of a partial expert set are not meaningful). Logits and weights take the
        dtypes the family's own router gives them (`fp32_logits`, `cast_weights`), so that with every
        expert allowed the outputs equal the router's own in any model dtype, not only in fp32.
        """
        weight_EH = tensor_attr(router, "weight")
        hidden_TH = hidden_TH.reshape(-1, weight_EH.shape[1])
        k = min(router_top_k(router), int(allowed_E.sum()))
        blocked_E = ~allowed_E.to(hidden_TH.device)
        scale = float(getattr(router, "routed_scaling_factor", 1.0))
        renormalise = self.renormalise
        if renormalise is None:
            renormalise = bool(getattr(router, "norm_topk_prob", True))  # Mixtral always renormalises
        if self.fp32_logits:
            logits_TE = F.linear(hidden_TH.float(), weight_EH.float())
        else:
            logits_TE = F.linear(hidden_TH, weight_EH)
        if self.routing == "softmax":
            probs_TE = logits_TE.float().masked_fill(blocked_E, float("-inf")).softmax(dim=-1)
            weights_TK, index_TK = torch.topk(probs_TE, k, dim=-1)
            if renormalise:
                weights_TK = weights_TK / weights_TK.sum(dim=-1, keepdim=True)
        else:
            scores_TE = logits_TE.sigmoid()
            bias_E = tensor_attr(router, "e_score_correction_bias")
            choice_TE = (scores_TE + bias_E).masked_fill(blocked_E, float("-inf"))
            index_TK = torch.topk(choice_TE, k, dim=-1, sorted=False)[1]
            weights_TK = scores_TE.gather(1, index_TK)
            if renormalise:
                weights_TK = weights_TK / (weights_TK.sum(dim=-1, keepdim=True) + 1e-20)
        weights_TK = weights_TK * scale
        if self.cast_weights:
            weights_TK = weights_TK.to(logits_TE.dtype)
        return logits_TE, weights_TK, index_TK

    def _moe_block(self, model: torch.nn.Module, layer: int) -> torch.nn.Module:
        layers = decoder_layers(model)
        if not 0 <= layer < len(layers):
            raise ValueError(f"layer {layer} does not exist; the model has {len(layers)} layers")
        if not hasattr(layers[layer].mlp, "experts"):
            raise ValueError(
                f"layer {layer} is dense, not an MoE layer; MoE layers: {self.moe_layers(model)}"
            )
        return layers[layer].get_submodule("mlp")


ADAPTERS: dict[str, MoEAdapter] = {
    entry.family: entry
    for entry in (
        MoEAdapter("qwen3_moe", "softmax"),
        MoEAdapter("qwen2_moe", "softmax", shared=("shared_expert", "shared_expert_gate")),
        MoEAdapter("olmoe", "softmax"),
        MoEAdapter("mixtral", "softmax", cast_weights=False),
        MoEAdapter(
            "deepseek_v2", "softmax", renormalise=False, shared=("shared_experts",),
            fp32_logits=True, cast_weights=False,
        ),
        MoEAdapter(
            "deepseek_v3", "sigmoid", shared=("shared_experts",), fp32_logits=True, cast_weights=False
        ),
    )
}


def adapter_for(family: str) -> MoEAdapter:
    """The adapter of a family name as written in a spec (a transformers `model_type`)."""
    try:
        return ADAPTERS[family]
    except KeyError:
        raise ValueError(f"unknown model family {family!r}; supported: {', '.join(ADAPTERS)}") from None


def family_of(config: Mapping[str, Any]) -> str:
    """The supported family a checkpoint's config.json describes; one line saying what was found if none."""
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise ValueError("config.json names no model_type, so the model family is unknown")
    if model_type in ADAPTERS:
        return model_type
    supported = ", ".join(ADAPTERS)
    if model_type in _UNFIT:
        raise ValueError(f"{model_type} is an MoE, but not of the supported layout: {_UNFIT[model_type]}")
    experts = [config[k] for k in _EXPERT_COUNT_KEYS if isinstance(config.get(k), int)]
    if any(n > 1 for n in experts):
        raise ValueError(
            f"{model_type} is an MoE family Tessera has no table entry for; supported: {supported}"
        )
    architectures = config.get("architectures") or [model_type]
    raise ValueError(
        f"{model_type} ({', '.join(map(str, architectures))}) is a dense model with no routed experts; "
        f"Tessera trains MoE models: {supported}"
    )


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The decoder layers at `model.layers` (of the base model under a head); ValueError if there are none."""
    base = getattr(model, "model", model)
    layers = getattr(base, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise ValueError(f"{type(model).__name__} has no decoder layers at `model.layers`")
    return layers


def tensor_attr(module: torch.nn.Module, name: str) -> torch.Tensor:
    """`module.<name>` (a fused expert tensor, a router's weight or bias); TypeError if it is not a tensor."""
    value = getattr(module, name)
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{type(module).__name__}.{name} is a {type(value).__name__}, not a tensor")
    return value


def router_top_k(router: torch.nn.Module) -> int:
    """How many experts `router` picks per token (its `top_k`)."""
    return int(cast(SupportsInt, router.top_k))

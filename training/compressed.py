"""The compressed model Θ̃0 = {θ0, Ψ0, W_S}: a model that physically holds only an expert group.

`compress(model, adapter, group, device)` builds a second model that shares (or copies to `device`)
every weight of `model` except, in each group layer, the fused experts and the router: those are
replaced by the selected experts' rows and the selected router rows only. Slot `s` of layer `l`
holds expert `group[l][s]` (experts ascending). The router of a group layer routes among the kept
experts alone, exactly as `MoEAdapter.route` does on the full model with the other experts masked:
softmax over the kept logits (or DeepSeek-V3's sigmoid scores + correction bias), top-k capped at
the number kept. Unselected expert weights are never copied, so they never reach `device`; MoE
layers outside the group keep all their experts. `model` itself is never modified. Given the kept
rows (`rows`), `compress` also cuts a model whose group experts were never loaded
(`training.model.load_compressed` reads just those rows from the checkpoint).

Blob tensors are named by full expert ids (`layers.{l}.experts.{e}.{param}`); `CompressedModel`
maps them to and from slots. This module knows nothing about training, data, blobs or the network.

Legend: T tokens, H hidden size, E experts in the full layer, S kept experts, K experts per token.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from training.adapters import MoEAdapter, router_top_k, tensor_attr
from training.experts import PARAMS, ExpertGroup, Tensors, check_group, parse_name, tensor_name


class KeptRouter(torch.nn.Module):
    """A group layer's router cut to its kept experts: `weight` [S, H] (and DeepSeek's bias [S])."""

    def __init__(self, adapter: MoEAdapter, router: torch.nn.Module, rows: Sequence[int], device: torch.device):
        super().__init__()
        weight_EH = tensor_attr(router, "weight")
        index = torch.tensor(list(rows), device=weight_EH.device)
        self.adapter = adapter
        self.num_experts = len(rows)
        self.top_k = min(router_top_k(router), len(rows))
        self.weight = torch.nn.Parameter(
            weight_EH.detach()[index].to(device).clone(), requires_grad=weight_EH.requires_grad
        )
        bias = getattr(router, "e_score_correction_bias", None)
        if bias is not None:
            self.register_buffer("e_score_correction_bias", bias.detach()[index].to(device).clone())
        for attr in ("routed_scaling_factor", "norm_topk_prob"):
            if hasattr(router, attr):
                setattr(self, attr, getattr(router, attr))

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(router logits [T, S], weights [T, K'], slots [T, K']) with K' = min(K, S)."""
        every_S = torch.ones(self.num_experts, dtype=torch.bool, device=hidden.device)
        return self.adapter.route(self, hidden, every_S)


@dataclass
class CompressedModel:
    """A model holding only `group`'s experts in the group layers; slot s of layer l is expert group[l][s]."""

    model: torch.nn.Module
    adapter: MoEAdapter
    group: dict[int, tuple[int, ...]]
    """Group layer -> the full expert ids it keeps, ascending (index = slot)."""

    def experts(self, layer: int) -> torch.nn.Module:
        """The (compressed, for group layers) fused experts module of `layer`."""
        return self.adapter.experts(self.model, layer)

    def full_ids(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """Map slot indices routed in group layer `layer` (any shape) to full expert ids."""
        ids = torch.tensor(self.group[layer], dtype=torch.long, device=slots.device)
        return ids[slots]

    def slot(self, layer: int, expert: int) -> int:
        """The slot holding full expert `expert` of group layer `layer`; ValueError if it is not kept."""
        kept = self.group.get(layer)
        if kept is None:
            raise ValueError(f"layer {layer} is not in the compressed model's group {sorted(self.group)}")
        if expert not in kept:
            raise ValueError(f"layer {layer} keeps experts {list(kept)}, not expert {expert}")
        return kept.index(expert)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Name -> shape of each kept expert tensor (the blob format's), sorted; read while the rows are held, not
        while training releases them (`training.sparse_experts.trainable_experts`)."""
        return dict(sorted((tensor_name(layer, expert, param), tuple(getattr(self.experts(layer), param).shape[1:]))
                           for layer, kept in self.group.items() for expert in kept for param in PARAMS))

    @torch.no_grad()
    def tensors(self, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
        """The kept experts' tensors on the CPU, named by full expert id (the blob format), sorted."""
        out: dict[str, torch.Tensor] = {}
        for layer, kept in self.group.items():
            module = self.experts(layer)
            for slot, expert in enumerate(kept):
                for param in PARAMS:
                    row = getattr(module, param)[slot]
                    out[tensor_name(layer, expert, param)] = row.detach().to("cpu", dtype).clone()
        return dict(sorted(out.items()))

    @torch.no_grad()
    def load(self, tensors: Tensors) -> None:
        """Write tensors named by full expert id into their slots; every one is checked before any is, and each
        is taken from `tensors` once to check and once to write (a state read from its blob file a tensor at a
        time is never whole in memory)."""
        targets: list[tuple[str, torch.Tensor]] = []
        for name in sorted(tensors):
            layer, expert, param = parse_name(name)
            row = getattr(self.experts(layer), param)[self.slot(layer, expert)]
            tensor = tensors[name]
            if tuple(tensor.shape) != tuple(row.shape):
                raise ValueError(f"{name}: shape {tuple(tensor.shape)}, the model expects {tuple(row.shape)}")
            if not tensor.is_floating_point():
                raise ValueError(f"{name}: dtype {tensor.dtype} is not a floating-point type")
            targets.append((name, row))
        for name, row in targets:
            row.copy_(tensors[name].to(device=row.device, dtype=row.dtype))


def compress(
    model: torch.nn.Module,
    adapter: MoEAdapter,
    group: ExpertGroup,
    device: str | torch.device | None = None,
    rows: Mapping[int, Mapping[str, torch.Tensor]] | None = None,
) -> CompressedModel:
    """A compressed copy of `model` on `device` (default: where `model` is) holding only `group`'s experts.

    Weights already on `device` are shared with `model`, not copied; `model` is left unchanged. The
    module tree is copied (`copy.deepcopy` with the weights pre-seeded), so hooks registered on
    `model`'s modules come along. `rows` (layer -> param -> [S, ...], experts ascending) gives the
    kept experts' rows of a model that does not hold them (its group experts on the meta device,
    `training.model.load_compressed`); they are used as they are, not copied.
    """
    check_group(model, adapter, group)
    kept = {layer: tuple(sorted(experts)) for layer, experts in sorted(group.items())}
    target = torch.device(device) if device is not None else next(model.parameters()).device
    memo: dict[int, object] = {}
    skipped: set[int] = set()
    for layer, ids in kept.items():
        experts, router = adapter.experts(model, layer), adapter.router(model, layer)
        for param in PARAMS:
            fused = getattr(experts, param)
            if rows is None:
                value = fused.detach()[torch.tensor(ids, device=fused.device)].to(target).clone()
            else:
                value = rows[layer][param].to(target)
                assert value.shape == (len(ids), *fused.shape[1:]) and value.dtype == fused.dtype, (
                    f"layer {layer} {param}: rows {value.dtype} {tuple(value.shape)} do not fit {fused.dtype} "
                    f"{tuple(fused.shape)}")
            memo[id(fused)] = torch.nn.Parameter(value, requires_grad=fused.requires_grad)
        memo[id(router)] = KeptRouter(adapter, router, ids, target)
        skipped |= {id(t) for t in (*router.parameters(), *router.buffers())}
    for tensor in (*model.parameters(), *model.buffers()):
        if id(tensor) in memo or id(tensor) in skipped:
            continue
        memo[id(tensor)] = _on(tensor, target)
    out = copy.deepcopy(model, memo)
    for layer, ids in kept.items():
        # torch types Module attributes as tensors or modules; any value may be set.
        adapter.experts(out, layer).num_experts = len(ids)  # type: ignore[assignment]
    return CompressedModel(out, adapter, kept)


def count_expert_rows(model: torch.nn.Module, adapter: MoEAdapter) -> dict[int, int]:
    """MoE layer -> how many experts its fused tensors hold (for checking what a model carries)."""
    return {
        layer: int(tensor_attr(adapter.experts(model, layer), "gate_up_proj").shape[0])
        for layer in adapter.moe_layers(model)
    }


def _on(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    if tensor.device == device:
        return tensor
    if isinstance(tensor, torch.nn.Parameter):
        return torch.nn.Parameter(tensor.detach().to(device), requires_grad=tensor.requires_grad)
    return tensor.to(device)


def masked_routing(
    model: torch.nn.Module, adapter: MoEAdapter, group: Mapping[int, Sequence[int]]
) -> list[torch.utils.hooks.RemovableHandle]:
    """Make `model` (full) route each group layer among the group's experts only; returns hook handles.

    This is the full-model view of the compressed model's routing: remove the handles to undo it.
    """
    handles = []
    for layer, experts in sorted(group.items()):
        router = adapter.router(model, layer)
        allowed_E = torch.zeros(tensor_attr(router, "weight").shape[0], dtype=torch.bool)
        allowed_E[list(experts)] = True

        def hook(module: torch.nn.Module, args: tuple[torch.Tensor, ...], output: object,
                 allowed_E: torch.Tensor = allowed_E) -> object:
            return adapter.route(module, args[0], allowed_E)

        handles.append(router.register_forward_hook(hook))
    return handles

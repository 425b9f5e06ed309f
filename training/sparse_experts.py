"""The trainer's experts forward: selected experts from trainable fp32 copies, every other expert frozen.

`LayerCopies` holds one MoE layer's trainable copies `w_gu_SIH` [S, 2I, H] and `w_down_SHI`
[S, H, I] of the selected rows. Inside `trainable_experts(copies)` the layer's experts module
dispatches, through transformers' experts interface (`tessera_trainable`, registered here on its
own config copy, so other layers keep their implementation), to a forward that reads the selected
experts from the copies and the rest from the frozen fused tensors: gradients reach the copies only.
Two maths: the eager per-expert loop (the same operations as transformers' eager experts, so CPU
results are bit-identical to it) and grouped GEMMs (transformers' `grouped_mm` on CUDA, its
reference kernel elsewhere) with one pass over the selected experts' pairs and one over the rest.
This module knows nothing about optimizers, data or blobs.
Legend: T tokens, K experts per token, P routed (token, expert) pairs, S selected experts, E experts
in the layer, I expert intermediate, H hidden.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from transformers import PretrainedConfig
from transformers.integrations.moe import ExpertsInterface, _grouped_linear

from training.adapters import tensor_attr

IMPLEMENTATION = "tessera_trainable"


@dataclass
class LayerCopies:
    """Trainable fp32 copies of one layer's selected experts, and where they live in the fused tensors."""

    layer: int
    experts: torch.nn.Module
    rows: list[int]
    """Fused rows of the selected experts in `experts` (slots in a compressed layer)."""
    ids: list[int]
    """The selected experts' full ids, for tensor names (equal to `rows` in a full layer)."""
    w_gu_SIH: torch.nn.Parameter
    w_down_SHI: torch.nn.Parameter
    grouped: bool
    n_experts: int
    """Rows of the layer's fused tensors (all of them selected in a compressed layer)."""

    @torch.no_grad()
    def write_back(self) -> None:
        """Copy the trained rows into the fused tensors, in their dtype."""
        gate_up_EIH = tensor_attr(self.experts, "gate_up_proj")
        down_EHI = tensor_attr(self.experts, "down_proj")
        rows = torch.tensor(self.rows, device=gate_up_EIH.device)
        gate_up_EIH[rows] = self.w_gu_SIH.to(gate_up_EIH.dtype)
        down_EHI[rows] = self.w_down_SHI.to(down_EHI.dtype)


def layer_copies(module: torch.nn.Module, layer: int, rows: list[int], ids: list[int], grouped: bool) -> LayerCopies:
    """fp32 copies of `rows` of `module`'s fused experts; `ids` name them, `grouped` picks the maths."""
    gate_up_EIH, down_EHI = tensor_attr(module, "gate_up_proj"), tensor_attr(module, "down_proj")
    index = torch.tensor(rows, device=gate_up_EIH.device)
    w_gu = torch.nn.Parameter(gate_up_EIH.detach()[index].to(torch.float32).clone())
    w_down = torch.nn.Parameter(down_EHI.detach()[index].to(torch.float32).clone())
    return LayerCopies(layer, module, rows, ids, w_gu, w_down, grouped, int(gate_up_EIH.shape[0]))


@contextmanager
def trainable_experts(copies: LayerCopies) -> Iterator[None]:
    """Dispatch the layer's experts module to `tessera_trainable` (on its own config copy) with `copies`; on
    leaving, the copies are written back into the fused tensors.

    Where the copies hold every row of the fused tensors (a compressed layer), the fused tensors' storage is
    released inside, since neither maths reads them there: a compressed miner holds its trained experts once
    in fp32, not also in the checkpoint's dtype."""
    module = copies.experts
    original = module.config
    module.config = copy.copy(original)
    cast(PretrainedConfig, module.config)._experts_implementation = IMPLEMENTATION
    # torch types Module attributes as tensors or modules; any value may be set.
    module.tessera_copies = copies  # type: ignore[assignment]
    fused = [tensor_attr(module, name) for name in ("gate_up_proj", "down_proj")]
    shapes = [t.shape for t in fused]
    release = len(copies.rows) == copies.n_experts
    if release:
        for tensor in fused:
            tensor.data = tensor.data.new_empty(0)
    try:
        yield
    finally:
        if release:
            for tensor, shape in zip(fused, shapes, strict=True):
                tensor.data = tensor.data.new_empty(shape)
        copies.write_back()
        del module.tessera_copies
        module.config = original


def _trainable_forward(
    module: torch.nn.Module, hidden_TH: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """Experts forward reading selected experts from the fp32 copies (in the activations' dtype) and the rest
    from the frozen rows."""
    copies = cast(LayerCopies, module.tessera_copies)
    if copies.grouped:
        return _grouped_forward(module, copies, hidden_TH, top_k_index, top_k_weights)
    gate_up_EIH, down_EHI = tensor_attr(module, "gate_up_proj"), tensor_attr(module, "down_proj")
    act_fn = module.get_submodule("act_fn")
    slot_of = {row: slot for slot, row in enumerate(copies.rows)}
    out_TH = torch.zeros_like(hidden_TH)
    for expert in torch.unique(top_k_index).tolist():
        token, slot = torch.where(top_k_index == expert)
        if expert in slot_of:
            w_gu = copies.w_gu_SIH[slot_of[expert]].to(hidden_TH.dtype)
            w_down = copies.w_down_SHI[slot_of[expert]].to(hidden_TH.dtype)
        else:
            w_gu, w_down = gate_up_EIH[expert], down_EHI[expert]
        gate, up = F.linear(hidden_TH[token], w_gu).chunk(2, dim=-1)
        y_TH = F.linear(act_fn(gate) * up, w_down) * top_k_weights[token, slot, None]
        out_TH = out_TH.index_add(0, token, y_TH.to(out_TH.dtype))
    return out_TH


def _grouped_forward(
    module: torch.nn.Module,
    copies: LayerCopies,
    hidden_TH: torch.Tensor,
    index_TK: torch.Tensor,
    weights_TK: torch.Tensor,
) -> torch.Tensor:
    """Grouped-GEMM experts: one pass over the selected experts' pairs, one over the frozen experts' pairs."""
    gate_up_EIH, down_EHI = tensor_attr(module, "gate_up_proj"), tensor_attr(module, "down_proj")
    act_fn = module.get_submodule("act_fn")
    dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else gate_up_EIH.dtype
    n_experts, n_selected = copies.n_experts, len(copies.rows)
    slot_E = torch.full((n_experts,), -1, dtype=torch.long, device=index_TK.device)
    slot_E[torch.tensor(copies.rows, device=index_TK.device)] = torch.arange(n_selected, device=index_TK.device)
    token_P = torch.arange(index_TK.shape[0], device=index_TK.device).repeat_interleave(index_TK.shape[1])
    expert_P, weight_P = index_TK.reshape(-1), weights_TK.reshape(-1)
    mine_P = slot_E[expert_P] >= 0
    out_TH = torch.zeros_like(hidden_TH)
    passes: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]] = [
        (mine_P, slot_E[expert_P], copies.w_gu_SIH, copies.w_down_SHI, n_selected)
    ]
    if n_selected < n_experts:
        passes.append((~mine_P, expert_P, gate_up_EIH, down_EHI, n_experts))
    for keep_P, ids_P, w_gu_NIH, w_down_NHI, n in passes:
        ids_P, tok_P, wt_P = ids_P[keep_P], token_P[keep_P], weight_P[keep_P]
        if ids_P.numel() == 0:
            continue
        order = torch.argsort(ids_P, stable=True)
        offsets = torch.cumsum(torch.bincount(ids_P, minlength=n), 0).to(torch.int32)
        x_PH = hidden_TH[tok_P[order]].to(dtype)
        gate, up = _gmm(x_PH, w_gu_NIH.to(dtype), offsets).chunk(2, dim=-1)
        y_PH = _gmm(act_fn(gate) * up, w_down_NHI.to(dtype), offsets) * wt_P[order, None]
        out_TH = out_TH.index_add(0, tok_P[order], y_PH.to(out_TH.dtype))
    return out_TH


def _gmm(x_PI: torch.Tensor, w_NOI: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """x @ w[n].T for each group n of rows; transformers' grouped_mm on CUDA, its reference kernel elsewhere."""
    if x_PI.device.type == "cuda":
        return _grouped_linear(x_PI, w_NOI, offsets)
    w_NIO = w_NOI.transpose(-2, -1)
    return cast(torch.Tensor, torch.ops.transformers.grouped_mm_fallback(x_PI, w_NIO, offs=offsets))


ExpertsInterface.register(IMPLEMENTATION, _trainable_forward)

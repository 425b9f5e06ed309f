"""Local training of an expert group: inner AdamW over fp32 copies of just the selected expert rows.

Each selected MoE layer gets two trainable copies, `w_gu_SIH` [S, 2I, H] and `w_down_SHI`
[S, H, I] (S = selected experts). While training, that layer's experts module runs a functional
forward (the same maths as transformers' eager experts loop) that reads selected experts from the
copies and every other expert from the frozen fused tensors, so gradients reach the copies only.
After each optimizer step the copies are written back into the fused rows. Router, attention,
embeddings, norms, shared experts and unselected experts are never touched; weight decay and optimizer
state exist for the copies alone. The model stays in eval mode (no dropout, no router jitter).

Forward modes:
- `full`: every expert runs (frozen ones included) with the model's own routing.
- `compressed`: in the group's layers the router is masked to the selected experts, as if the model
  held only them: top-k is taken among the selected experts (k shrinks to their count if smaller),
  softmax routers normalise over the selected experts' logits, and only those experts are computed.
  MoE layers outside the group run in full.

This module knows nothing about data files, blobs or the network; it consumes token batches.
Legend: B batch, L sequence length, T tokens, S selected experts, I expert intermediate, H hidden.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F
from tqdm import tqdm

from training.adapters import MoEAdapter
from training.evaluate import token_loss_sum
from training.experts import ExpertGroup, check_group, tensor_name


@dataclass
class TrainConfig:
    """The inner loop of one round."""

    steps: int = 20
    """H: optimizer steps (fewer if the batch iterator ends first)."""
    lr: float = 1e-3
    """Inner AdamW learning rate."""
    weight_decay: float = 0.0
    """Inner AdamW decoupled weight decay, applied to the selected experts only."""
    batch_size: int = 8
    """Sequences per optimizer step; every batch from the iterator must have this many."""
    micro_batch_size: int | None = None
    """Sequences per forward/backward (gradient accumulation); None means the whole batch."""
    grad_clip: float = 1.0
    """Clip the global gradient norm of the selected experts to this value."""
    forward: Literal["full", "compressed"] = "full"
    """`full` runs every expert; `compressed` runs only the selected ones (see module docstring)."""
    device: str = "cpu"
    """Where to train; the model is moved there. bf16 autocast is used on CUDA only."""
    seed: int = 0
    """Seeds torch's RNGs for the run; the CPU generator's state is restored afterwards."""
    pad_id: int = 256
    """Token id excluded from the loss."""
    progress: bool = False
    """Show a tqdm bar when stderr is a terminal."""

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"steps must be at least 1, got {self.steps}")
        if self.lr <= 0 or self.weight_decay < 0 or self.grad_clip <= 0:
            raise ValueError("lr and grad_clip must be positive and weight_decay non-negative")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {self.batch_size}")
        if self.micro_batch_size is not None and not 1 <= self.micro_batch_size <= self.batch_size:
            raise ValueError(
                f"micro_batch_size must be between 1 and batch_size, got {self.micro_batch_size}"
            )
        if self.forward not in ("full", "compressed"):
            raise ValueError(f"forward must be 'full' or 'compressed', got {self.forward!r}")


@dataclass
class TrainResult:
    """What a run produced: the trained expert tensors (fp32, CPU, by name) and its statistics."""

    tensors: dict[str, torch.Tensor]
    losses: list[float] = field(default_factory=list)
    """Mean token loss of each step's batch, before that step's update."""
    tokens: int = 0
    """Tokens that counted in the loss (targets that are not padding)."""
    seconds: float = 0.0


@dataclass
class _LayerCopies:
    """Trainable fp32 copies of one layer's selected experts."""

    layer: int
    experts: torch.nn.Module
    rows: list[int]
    w_gu_SIH: torch.nn.Parameter
    w_down_SHI: torch.nn.Parameter

    @torch.no_grad()
    def write_back(self) -> None:
        rows = torch.tensor(self.rows, device=self.experts.gate_up_proj.device)
        self.experts.gate_up_proj[rows] = self.w_gu_SIH.to(self.experts.gate_up_proj.dtype)
        self.experts.down_proj[rows] = self.w_down_SHI.to(self.experts.down_proj.dtype)


def train_experts(
    model: torch.nn.Module,
    adapter: MoEAdapter,
    group: ExpertGroup,
    batches: Iterator[torch.Tensor],
    cfg: TrainConfig,
) -> TrainResult:
    """Train `group`'s experts in place for up to `cfg.steps` batches of token ids [B, L]."""
    check_group(model, adapter, group)
    device = torch.device(cfg.device)
    model.to(device)
    copies = [_copies(adapter, model, layer, experts, device) for layer, experts in sorted(group.items())]
    params = [p for c in copies for p in (c.w_gu_SIH, c.w_down_SHI)]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    result = TrainResult(tensors={})
    started = time.perf_counter()
    with ExitStack() as stack:
        bar = stack.enter_context(
            tqdm(total=cfg.steps, desc="train", disable=not (cfg.progress and sys.stderr.isatty()))
        )
        stack.enter_context(torch.random.fork_rng(devices=[]))
        torch.manual_seed(cfg.seed)
        stack.enter_context(_frozen(model))
        for c in copies:
            stack.enter_context(_functional_experts(c))
            if cfg.forward == "compressed":
                stack.enter_context(_masked_router(adapter, model, c))
        for _, ids_BL in zip(range(cfg.steps), batches, strict=False):
            loss, tokens = _step(model, ids_BL, cfg, device, optimizer, params)
            for c in copies:
                c.write_back()
            result.losses.append(loss)
            result.tokens += tokens
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.4f}")
    if not result.losses:
        raise ValueError("the batch iterator gave no batches; there is nothing to train on")
    result.seconds = time.perf_counter() - started
    result.tensors = _named_tensors(copies)
    return result


def _step(
    model: torch.nn.Module,
    ids_BL: torch.Tensor,
    cfg: TrainConfig,
    device: torch.device,
    optimizer: torch.optim.Optimizer,
    params: list[torch.nn.Parameter],
) -> tuple[float, int]:
    if ids_BL.ndim != 2 or ids_BL.shape[0] != cfg.batch_size or ids_BL.dtype != torch.long:
        raise ValueError(
            f"expected a LongTensor batch of shape [{cfg.batch_size}, L], got "
            f"{ids_BL.dtype} {tuple(ids_BL.shape)}"
        )
    ids_BL = ids_BL.to(device)
    tokens = int((ids_BL[:, 1:] != cfg.pad_id).sum())
    if tokens == 0:
        raise ValueError("a training batch holds only padding; nothing to learn from")
    optimizer.zero_grad(set_to_none=True)
    total = 0.0
    micro = cfg.micro_batch_size or cfg.batch_size
    for start in range(0, ids_BL.shape[0], micro):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss_sum = token_loss_sum(model, ids_BL[start : start + micro], cfg.pad_id)
        (loss_sum / tokens).backward()
        total += float(loss_sum.detach())
    torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
    optimizer.step()
    return total / tokens, tokens


def _copies(
    adapter: MoEAdapter,
    model: torch.nn.Module,
    layer: int,
    experts: list[int] | tuple[int, ...],
    device: torch.device,
) -> _LayerCopies:
    module = adapter.experts(model, layer)
    rows = sorted(experts)
    index = torch.tensor(rows, device=device)
    w_gu = torch.nn.Parameter(module.gate_up_proj.detach()[index].to(torch.float32).clone())
    w_down = torch.nn.Parameter(module.down_proj.detach()[index].to(torch.float32).clone())
    return _LayerCopies(layer, module, rows, w_gu, w_down)


def _named_tensors(copies: list[_LayerCopies]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for c in copies:
        for slot, expert in enumerate(c.rows):
            out[tensor_name(c.layer, expert, "gate_up_proj")] = c.w_gu_SIH[slot].detach().cpu().clone()
            out[tensor_name(c.layer, expert, "down_proj")] = c.w_down_SHI[slot].detach().cpu().clone()
    return dict(sorted(out.items()))


@contextmanager
def _frozen(model: torch.nn.Module) -> Iterator[None]:
    """No model parameter requires grad inside; the flags are restored afterwards."""
    flags = [(p, p.requires_grad) for p in model.parameters()]
    was_training = model.training
    model.eval()
    for p, _ in flags:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p, flag in flags:
            p.requires_grad_(flag)
        model.train(was_training)


@contextmanager
def _functional_experts(copies: _LayerCopies) -> Iterator[None]:
    """Run the layer's experts from the copies (selected) and the frozen fused rows (the rest)."""
    module = copies.experts
    slot_of = {expert: slot for slot, expert in enumerate(copies.rows)}

    def forward(
        hidden_TH: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        out_TH = torch.zeros_like(hidden_TH)
        for expert in torch.unique(top_k_index).tolist():
            token, slot = torch.where(top_k_index == expert)
            if expert in slot_of:
                w_gu = copies.w_gu_SIH[slot_of[expert]].to(module.gate_up_proj.dtype)
                w_down = copies.w_down_SHI[slot_of[expert]].to(module.down_proj.dtype)
            else:
                w_gu, w_down = module.gate_up_proj[expert], module.down_proj[expert]
            gate, up = F.linear(hidden_TH[token], w_gu).chunk(2, dim=-1)
            y_TH = F.linear(module.act_fn(gate) * up, w_down) * top_k_weights[token, slot, None]
            out_TH = out_TH.index_add(0, token, y_TH.to(out_TH.dtype))
        return out_TH

    assert "forward" not in vars(module), "the experts module already has an instance forward"
    module.forward = forward
    try:
        yield
    finally:
        del module.forward


@contextmanager
def _masked_router(adapter: MoEAdapter, model: torch.nn.Module, copies: _LayerCopies) -> Iterator[None]:
    """Replace the layer's routing by routing among the selected experts only."""
    router = adapter.router(model, copies.layer)
    allowed_E = torch.zeros(copies.experts.gate_up_proj.shape[0], dtype=torch.bool)
    allowed_E[copies.rows] = True

    def hook(module: torch.nn.Module, args: tuple[torch.Tensor, ...], output: object) -> object:
        return adapter.route(module, args[0], allowed_E)

    handle = router.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()

"""Local training of an expert group: inner AdamW over fp32 copies of just the selected expert rows.

Each selected MoE layer gets two trainable fp32 copies of its selected rows; while training, that
layer's experts run `training.sparse_experts`' forward (plugged in through transformers' experts
interface), which reads selected experts from the copies and every other expert from the frozen
fused tensors, so gradients reach the copies only. After each optimizer step the copies are
written back into the fused rows. Router, attention, embeddings, norms, shared experts
and unselected experts are never touched; weight decay and AdamW state exist for the copies alone.
The model stays in eval mode (no dropout, no router jitter), so training draws no random numbers
and touches no global RNG.

Forward modes:
- `full`: the model as given; every expert runs (frozen ones included) with the model's own routing.
- `compressed`: the model is first cut by `training.compressed.compress` to the group's experts
  (unselected expert rows are never copied to the device); routing is renormalised among the kept
  experts, top-k capped at their number. Trained rows are written back into the model passed in.

Memory: frozen weights keep their dtype (bf16 for checkpoints); bf16 autocast on CUDA; activation
checkpointing of decoder layers, micro-batches with gradient accumulation, 8-bit AdamW moments, and the optimizer
step taken in backward, each tensor's as its gradient is complete (`step_in_backward`), are options.
This module knows nothing about data files, blobs or the network; it consumes token batches.
Legend: B batch, L sequence length.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, cast

import torch
from tqdm import tqdm

from training import allocator
from training.adapters import MoEAdapter, decoder_layers
from training.compressed import CompressedModel, compress
from training.cpu_compute import fp32_compute, holds_narrow_weights
from training.data import not_padding
from training.evaluate import token_loss_sum
from training.experts import ExpertGroup, check_group, insert, tensor_name
from training.sparse_experts import LayerCopies, layer_copies, trainable_experts

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from protocol.spec import TrainingSpec


@dataclass
class TrainConfig:
    """The inner loop of one round."""

    steps: int = 20
    """H: optimizer steps (fewer if the batch iterator ends first)."""
    lr: float = 1e-3
    """Inner AdamW learning rate."""
    weight_decay: float = 0.0
    """Inner AdamW decoupled weight decay, applied to the selected experts only."""
    beta1: float = 0.9
    """Inner AdamW first-moment decay (AdamW's default; the spec's `training.beta1`, docs/learning.md as of
    commit 3cb31c3, "Settings measured at H = 20")."""
    batch_size: int = 8
    """Sequences per optimizer step; every batch from the iterator must have this many."""
    micro_batch_size: int | None = None
    """Sequences per forward/backward (gradient accumulation); None means the whole batch."""
    grad_clip: float = 1.0
    """Clip the global gradient norm of the selected experts to this value."""
    forward: Literal["full", "compressed"] = "full"
    """`full` runs every expert; `compressed` holds and runs only the selected ones (module docstring)."""
    device: str = "cpu"
    """Where to train; in `full` mode the model is moved there, in `compressed` mode only the cut model."""
    autocast: bool = True
    """Run forward and backward under bf16 autocast on CUDA (no effect on other devices)."""
    checkpointing: bool = False
    """Recompute each decoder layer's activations during backward: less memory, about a third more compute."""
    optimizer: Literal["adamw", "adamw8bit"] = "adamw"
    """`adamw`: torch's fused AdamW, fp32 moments; `adamw8bit`: bitsandbytes' AdamW8bit, moments held in 8 bits
    block-wise (about a quarter of the state; tensors under 4096 values keep fp32 moments)."""
    step_in_backward: bool = False
    """Take each trained tensor's optimizer step in backward, as soon as its gradient is complete, and free the
    gradient then: the gradients of the whole group never live at once (a step is one micro-batch). The global
    norm is still measured, but a step is clipped by the norm of the step before it (the first by none); where
    no step's norm exceeds `grad_clip`, the updates are the default's."""
    experts_implementation: Literal["auto", "eager", "grouped_mm"] = "auto"
    """Selected-expert maths: `eager` per-expert loop, `grouped_mm` grouped GEMMs; `auto` = grouped on CUDA in bf16."""
    pad_id: int = 256
    """Token id excluded from the loss."""
    progress: bool = False
    """Show a tqdm bar when stderr is a terminal."""

    @classmethod
    def from_spec(cls, training: TrainingSpec, **settings: Any) -> TrainConfig:
        """The inner loop a spec's `training` section fixes (H, lr, beta1, weight decay, batch, clip); `settings`:
        how this machine runs it, and any of those a caller changes on purpose (a shorter `tessera train`, the
        learning benchmark's data-parallel ceiling with M batches a step at its own lr)."""
        return cls(**{"steps": training.inner_steps, "lr": training.lr, "beta1": training.beta1,
                      "weight_decay": training.weight_decay, "batch_size": training.batch_size,
                      "grad_clip": training.grad_clip, **settings})

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"steps must be at least 1, got {self.steps}")
        if self.lr <= 0 or self.weight_decay < 0 or self.grad_clip <= 0:
            raise ValueError("lr and grad_clip must be positive and weight_decay non-negative")
        if not 0 <= self.beta1 < 1:
            raise ValueError(f"beta1 must be in [0, 1), got {self.beta1}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {self.batch_size}")
        if self.micro_batch_size is not None and not 1 <= self.micro_batch_size <= self.batch_size:
            raise ValueError(
                f"micro_batch_size must be between 1 and batch_size, got {self.micro_batch_size}"
            )
        if self.forward not in ("full", "compressed"):
            raise ValueError(f"forward must be 'full' or 'compressed', got {self.forward!r}")
        if self.step_in_backward and (self.micro_batch_size or self.batch_size) < self.batch_size:
            raise ValueError("step_in_backward takes the step in a step's only backward: it needs micro_batch_size "
                             f"unset or equal to batch_size ({self.batch_size}), got {self.micro_batch_size}")
        if self.optimizer not in ("adamw", "adamw8bit"):
            raise ValueError(f"optimizer must be adamw or adamw8bit, got {self.optimizer!r}")
        if self.experts_implementation not in ("auto", "eager", "grouped_mm"):
            raise ValueError(
                f"experts_implementation must be auto, eager or grouped_mm, got {self.experts_implementation!r}"
            )


@dataclass
class TrainResult:
    """What a run produced: the trained expert tensors (fp32, CPU, by name) and its statistics."""

    tensors: dict[str, torch.Tensor]
    losses: list[float] = field(default_factory=list)
    """Mean token loss of each step's batch, before that step's update."""
    tokens: int = 0
    """Tokens that counted in the loss (targets that are not padding)."""
    seconds: float = 0.0
    lr: float = 0.0
    """The AdamW lr the steps ran at (`TrainConfig.lr`)."""
    optimizer_state: dict[str, Any] = field(default_factory=dict)
    """The AdamW state after the last step (`torch.optim.Optimizer.state_dict`), for the next run to go on from,
    where `train_experts` was asked to hand it on; else empty (its moments are twice the trained experts)."""


def train_experts(
    model: torch.nn.Module | CompressedModel,
    adapter: MoEAdapter,
    group: ExpertGroup,
    batches: Iterator[torch.Tensor],
    cfg: TrainConfig,
    optimizer_state: dict[str, Any] | None = None,
    hand_on: bool = False,
) -> TrainResult:
    """Train `group`'s experts in place for up to `cfg.steps` batches of token ids [B, L].

    `model` is the full model, or (in `compressed` mode) an already compressed one for `group`.
    `optimizer_state`: an earlier run's `TrainResult.optimizer_state` on the same group, so AdamW's
    moments go on from where that run left them (one continuous AdamW run in pieces, as the learning
    benchmark's single-node baselines are); None starts them at zero. `cfg`'s lr, weight decay and beta1 apply
    either way. `hand_on`: the result carries the AdamW state after the run, for such a next piece.
    """
    device = torch.device(cfg.device)
    net, copies = _prepare(model, adapter, group, cfg, device)
    wide = device.type == "cpu" and holds_narrow_weights(net)  # training.cpu_compute: a CPU's bf16 matmul is slow
    params = [p for c in copies for p in (c.w_gu_SIH, c.w_down_SHI)]
    optimizer = inner_adamw(params, cfg)
    if optimizer_state is not None:
        _resume(optimizer, params, optimizer_state, cfg)
    result = TrainResult(tensors={}, lr=cfg.lr)
    started = time.perf_counter()
    with ExitStack() as stack:
        bar = stack.enter_context(
            tqdm(total=cfg.steps, desc="train", disable=not (cfg.progress and sys.stderr.isatty()))
        )
        stack.enter_context(_frozen(net))
        if device.type == "cpu":
            stack.enter_context(_pages_returned(net, copies))
        if cfg.checkpointing:
            stack.enter_context(_checkpointed(net, adapter, wide))
        for c in copies:
            stack.enter_context(trainable_experts(c))
        in_backward = stack.enter_context(_InBackward(optimizer, params, cfg.grad_clip)) if cfg.step_in_backward else None
        for _, ids_BL in zip(range(cfg.steps), batches, strict=False):
            loss, tokens = _step(net, ids_BL, cfg, device, optimizer, params, wide, in_backward)
            result.losses.append(loss)
            result.tokens += tokens
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.4f}")
        for p in params:  # before the fused rows come back (trainable_experts): the last step's gradients
            p.grad = None
        if hand_on:  # the state's own tensors, not copies
            result.optimizer_state = optimizer.state_dict()
        optimizer.state.clear()  # and, unless handed on, its moments: neither is needed to write the rows back
    if not result.losses:
        raise ValueError("the batch iterator gave no batches; there is nothing to train on")
    result.seconds = time.perf_counter() - started
    result.tensors = _named_tensors(copies)
    if cfg.forward == "compressed" and not isinstance(model, CompressedModel):
        insert(model, adapter, result.tensors)
    return result


def inner_adamw(params: list[torch.nn.Parameter], cfg: TrainConfig) -> torch.optim.Optimizer:
    """`cfg.optimizer` over `params`. Torch's AdamW runs fused, on every device torch fuses it for (CPU and CUDA
    among them): the multi-tensor (foreach) step it replaces holds temporaries the size of the trainable
    experts in fp32 at the step, on CUDA, where it is torch's default."""
    betas = (cfg.beta1, 0.999)
    if cfg.optimizer == "adamw8bit":
        # imported only when asked for: it takes seconds (it imports torch.compile's machinery)
        from bitsandbytes.optim.adamw import AdamW8bit

        # bitsandbytes leaves its optimizers unannotated
        eight_bit = AdamW8bit(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=betas)  # type: ignore[no-untyped-call]
        return cast(torch.optim.Optimizer, eight_bit)
    return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=betas, fused=True)


def _resume(
    optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter], state: dict[str, Any], cfg: TrainConfig
) -> None:
    """Load an earlier run's optimizer state; ValueError when it was not for these parameters."""
    moments = state.get("state", {})
    first = ("exp_avg", "state1")  # torch's AdamW names its first moment so, bitsandbytes' its 8-bit state
    shapes = [next((tuple(moments[i][k].shape) for k in first if k in moments[i]), None) if i in moments else None
              for i in range(len(params))]
    groups = state.get("param_groups") or [{}]
    if len(groups) != 1 or len(groups[0].get("params", [])) != len(params) or any(
        shape is not None and shape != tuple(p.shape) for shape, p in zip(shapes, params, strict=True)
    ):
        raise ValueError("the optimizer state to go on from is for other expert tensors than this group's")
    optimizer.load_state_dict(state)
    for group in optimizer.param_groups:
        group["lr"], group["weight_decay"] = cfg.lr, cfg.weight_decay
        group["betas"] = (cfg.beta1, group["betas"][1])


def _prepare(
    model: torch.nn.Module | CompressedModel,
    adapter: MoEAdapter,
    group: ExpertGroup,
    cfg: TrainConfig,
    device: torch.device,
) -> tuple[torch.nn.Module, list[LayerCopies]]:
    """The module to run and the copies of its selected rows, on `device`."""
    if cfg.forward == "compressed":
        cut = model if isinstance(model, CompressedModel) else compress(model, adapter, group, device)
        if {layer: tuple(sorted(e)) for layer, e in group.items()} != cut.group:
            raise ValueError(f"the compressed model holds group {cut.group}, not the group to train")
        net = cut.model.to(device)
        slots = {layer: (list(range(len(ids))), list(ids)) for layer, ids in cut.group.items()}
    elif isinstance(model, CompressedModel):
        raise ValueError("a compressed model can only be trained with forward = 'compressed'")
    else:
        check_group(model, adapter, group)
        net = model.to(device)
        slots = {layer: (sorted(e), sorted(e)) for layer, e in group.items()}
    grouped = cfg.experts_implementation == "grouped_mm" or (
        cfg.experts_implementation == "auto" and device.type == "cuda" and cfg.autocast
    )
    copies = [
        layer_copies(adapter.experts(net, layer), layer, rows, ids, grouped)
        for layer, (rows, ids) in sorted(slots.items())
    ]
    return net, copies


def _step(
    model: torch.nn.Module,
    ids_BL: torch.Tensor,
    cfg: TrainConfig,
    device: torch.device,
    optimizer: torch.optim.Optimizer,
    params: list[torch.nn.Parameter],
    wide: bool,
    in_backward: _InBackward | None = None,
) -> tuple[float, int]:
    """One optimizer step on `ids_BL`; `wide`: compute in fp32 over narrow weights (training.cpu_compute);
    `in_backward`: the step is taken inside backward, tensor by tensor."""
    if ids_BL.ndim != 2 or ids_BL.shape[0] != cfg.batch_size or ids_BL.dtype != torch.long:
        raise ValueError(
            f"expected a LongTensor batch of shape [{cfg.batch_size}, L], got "
            f"{ids_BL.dtype} {tuple(ids_BL.shape)}"
        )
    ids_BL = ids_BL.to(device)
    tokens = int(not_padding(ids_BL, cfg.pad_id)[:, 1:].sum())
    if tokens == 0:
        raise ValueError("a training batch holds only padding; nothing to learn from")
    optimizer.zero_grad(set_to_none=True)
    total = 0.0
    micro = cfg.micro_batch_size or cfg.batch_size
    for start in range(0, ids_BL.shape[0], micro):
        with (torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda" and cfg.autocast),
              fp32_compute() if wide else nullcontext()):
            loss_sum = token_loss_sum(model, ids_BL[start : start + micro], cfg.pad_id)
        if loss_sum.requires_grad:  # else no token of this micro-batch reached the group: no gradient
            (loss_sum / tokens).backward()  # type: ignore[no-untyped-call]  # unannotated in torch
        total += float(loss_sum.detach())
    if in_backward is not None:
        in_backward.end_step()
    else:
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        optimizer.step()
    return total / tokens, tokens


class _InBackward:
    """The optimizer step taken in backward (`TrainConfig.step_in_backward`): as a trained tensor's gradient is
    complete, its squared norm is added up, the gradient is scaled by the clip factor of the step before and
    the optimizer steps that tensor alone (torch's optimizers skip parameters without a gradient), then the
    gradient is freed. One optimizer holds every tensor's state, so its state is the default step's."""

    def __init__(self, optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter], clip: float) -> None:
        self._optimizer, self._params, self._clip = optimizer, params, clip
        self._factor: torch.Tensor | None = None
        """The clip factor this step's gradients are scaled by: min(1, clip / the norm of the step before)."""
        self._squares: list[torch.Tensor] = []
        self._handles: list[Any] = []

    def __enter__(self) -> _InBackward:
        # unannotated in torch; a gradient hook that returns a value would replace the gradient: this one returns None
        self._handles = [p.register_post_accumulate_grad_hook(self._arrived)  # type: ignore[no-untyped-call]
                         for p in self._params]
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()

    def _arrived(self, param: torch.nn.Parameter) -> None:
        assert param.grad is not None, "a post-accumulate hook runs once the gradient is there"
        self._squares.append(param.grad.detach().float().square().sum())
        if self._factor is not None:
            param.grad.mul_(self._factor)
        self._optimizer.step()
        param.grad = None

    def end_step(self) -> None:
        """The step's backward is over: its norm gives the next step's clip factor (torch's clip_grad_norm_'s)."""
        if self._squares:
            norm = torch.stack(self._squares).sum().sqrt()
            self._factor = (self._clip / (norm + 1e-6)).clamp(max=1.0)
        self._squares = []


def _named_tensors(copies: list[LayerCopies]) -> dict[str, torch.Tensor]:
    """The trained rows by name, on the CPU: views of the copies there (nothing trains them after this), so the
    trained experts are not held twice."""
    out: dict[str, torch.Tensor] = {}
    for c in copies:
        for slot, expert in enumerate(c.ids):
            out[tensor_name(c.layer, expert, "gate_up_proj")] = c.w_gu_SIH[slot].detach().cpu()
            out[tensor_name(c.layer, expert, "down_proj")] = c.w_down_SHI[slot].detach().cpu()
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
def _pages_returned(model: torch.nn.Module, copies: list[LayerCopies]) -> Iterator[None]:
    """On a CPU, the C heap hands its free pages back as a step grows the process (`training.allocator.GrowthTrim`,
    asked after each decoder layer's forward and after each trained layer's gradients arrive). A layer's activations
    under the mmap threshold (`training.allocator.MMAP_THRESHOLD`) come from the heap, and what the step frees there
    stays with it: at OLMoE-1B-7B's size, with 4 x 64 tokens a step, 0.9 GB of freed activations stayed resident
    beside the gradients backward brought, and the compressed miner peaked at 5.5 GB; handed back, at 4.7 GB."""
    trim = allocator.GrowthTrim()
    handles = [layer.register_forward_hook(lambda *_: trim()) for layer in decoder_layers(model)]
    # a gradient hook that returns a value replaces the gradient: this one returns None
    handles += [c.w_gu_SIH.register_post_accumulate_grad_hook(lambda _: trim())  # type: ignore[no-untyped-call]
                for c in copies]  # (unannotated in torch)
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@contextmanager
def _checkpointed(model: torch.nn.Module, adapter: MoEAdapter, wide: bool) -> Iterator[None]:
    """Activation checkpointing of every decoder layer, with the rest of the model left in eval mode. `wide`: the
    layers' forward, run again inside backward (outside `_step`'s `fp32_compute`), computes in fp32 there too."""
    kwargs: dict[str, Any] = {"use_reentrant": False, "preserve_rng_state": False}
    if wide:
        kwargs["context_fn"] = _wide_recompute
    hf_model = cast("PreTrainedModel", model)
    # transformers 5.23 renamed gradient checkpointing to activation checkpointing (the old names warn
    # until v6); every transformers 5.x is supported. Of these methods transformers annotates only
    # activation_checkpointing_enable.
    if hasattr(hf_model, "activation_checkpointing_enable"):
        hf_model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        disable = hf_model.activation_checkpointing_disable
    else:
        hf_model.gradient_checkpointing_enable(  # type: ignore[no-untyped-call]
            gradient_checkpointing_kwargs=kwargs
        )
        disable = hf_model.gradient_checkpointing_disable
    layers = decoder_layers(hf_model)
    # transformers checkpoints a layer only while that layer is in training mode; flag the layers
    # alone so attention, routers and experts keep eval behaviour (no dropout, no jitter).
    for layer in layers:
        layer.training = True
    try:
        yield
    finally:
        for layer in layers:
            layer.training = False
        disable()  # type: ignore[no-untyped-call]  # unannotated in transformers


def _wide_recompute() -> tuple[AbstractContextManager[None], AbstractContextManager[None]]:
    """torch.utils.checkpoint's contexts for a layer's first forward (`_step`'s `fp32_compute` is already around it)
    and for its recomputation in backward."""
    return nullcontext(), fp32_compute()

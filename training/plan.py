"""A node's memory plan: the peak of a round's training steps or a scoring pass, traced on fake tensors before anything loads.

`plan` builds the model of a config dict on fake tensors (shapes, dtypes and no storage; no weight is
read), runs the project's own work on it, a miner's `training.trainer.train_experts` over `STEPS` inner
steps (fp32 trainable copies, the optimizer, the trained rows written back; two micro-batches a step where
gradients accumulate), which is its steady state, or a validator's `training.evaluate.loss_with_experts`
pass, and follows every storage it allocates and frees (`training.trace.Trace`): the peak, its step and
phase, split into weights, trainable copies, gradients, optimizer state and activations (with every other
temporary); for a validator spread over several GPUs, each GPU's. `measure` runs the same trace on a model
already built, real or fake, so a real run checks the fake one.

Fake tensors hold no values; the trace answers what depends on them from real shadows, a router's top-k
routing round-robin, every expert getting the same share of tokens (`training.trace`). The trace runs on
the CPU, in the weights' dtype for an accelerator as it computes (`training.cpu_compute.as_on_accelerator`),
and labels the target device; what a CPU trace does not see is in `SEES_NOT` and `margin_bytes`.
This module reads no files and knows nothing about specs, nodes or the network.
Legend: B micro-batch, L sequence length.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Mapping
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Literal, cast

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from transformers import AutoModelForCausalLM

from training.adapters import MoEAdapter, adapter_for, family_of
from training.compressed import compress
from training.cpu_compute import as_on_accelerator
from training.device import hold_int8, spread_map
from training.evaluate import loss_with_experts
from training.experts import ExpertGroup, check_group, expert_names, parse_name
from training.tiny import hf_config
from training.trace import Trace
from training.trainer import TrainConfig, train_experts

GIB = 1024**3
STEPS = 2
"""Inner steps a miner's plan traces: from the second on, the optimizer state lives through every forward and
backward, and every later step holds what the second does (tests/training/test_plan_steady.py)."""
MARGIN_FIXED = GIB
"""Allowance for the CUDA context and cuBLAS/attention workspaces, which no CPU trace allocates."""
MARGIN_SHARE = 0.10
"""Allowance, as a share of the peak, for the caching allocator's block rounding and fragmentation."""
SEES_NOT = (
    "the CUDA context and the kernel libraries' workspaces (cuBLAS, attention)",
    "the caching allocator's rounding and fragmentation",
    "CUDA attention kernels (the trace runs the CPU's; flash attention holds no L x L scores on either)",
    "bf16 autocast as CUDA applies it (the trace applies the CPU's autocast lists)",
)
_NO_PADDING = -1
"""The planned batch's pad id: no token is padding, so every position counts as in a full packed batch."""

Role = Literal["miner", "validator"]
Forward = Literal["full", "compressed"]


@dataclass(frozen=True)
class Setting:
    """What the plan runs: a role's work on one micro-batch, and how the node would run it."""

    role: Role
    seq_len: int
    micro_batch: int = 1
    batch_size: int | None = None
    """A miner's sequences per optimizer step; None: one micro-batch. Above `micro_batch`, gradients accumulate
    over micro-batches and the trace runs two a step (from the second on, each holds the gradients)."""
    device: str = "cuda"
    """The device planned for; the trace itself runs on the CPU (module docstring)."""
    forward: Forward = "compressed"
    checkpointing: bool = False
    autocast: bool = False
    """bf16 autocast, as a miner on CUDA runs it (no effect on a CPU device, as in the trainer)."""
    optimizer: Literal["adamw", "adamw8bit"] = "adamw"
    """A miner's inner optimizer (`training.trainer.TrainConfig.optimizer`)."""
    step_in_backward: bool = False
    """A miner's optimizer step taken in backward, tensor by tensor (`training.trainer.TrainConfig.step_in_backward`)."""
    weights: Literal["checkpoint", "int8"] = "checkpoint"
    """A validator's frozen weights: as the checkpoint holds them, or int8 (`training.device.hold_int8`)."""
    gpus: int = 1
    """A validator's model spread over this many GPUs by accelerate's balanced device map (`training.device.spread_map`,
    as `validator.device = 'auto'` places it); the plan is then each GPU's."""

    def __post_init__(self) -> None:
        if self.role not in ("miner", "validator"):
            raise ValueError(f"the role is miner or validator, got {self.role!r}")
        if self.seq_len < 2 or self.micro_batch < 1:
            raise ValueError(f"seq_len must be at least 2 and micro_batch at least 1, got {self.seq_len}, "
                             f"{self.micro_batch}")
        if self.batch_size is not None and self.batch_size < self.micro_batch:
            raise ValueError(f"batch_size must be at least micro_batch ({self.micro_batch}), got {self.batch_size}")
        if self.step_in_backward and self.traced_batch > self.micro_batch:
            raise ValueError("step_in_backward needs a step of one micro-batch (micro_batch equal to batch_size)")
        if self.forward not in ("full", "compressed"):
            raise ValueError(f"forward must be 'full' or 'compressed', got {self.forward!r}")
        if self.optimizer not in ("adamw", "adamw8bit"):
            raise ValueError(f"optimizer must be 'adamw' or 'adamw8bit', got {self.optimizer!r}")
        if self.weights not in ("checkpoint", "int8") or (self.weights == "int8" and self.role != "validator"):
            raise ValueError(f"weights is 'checkpoint', or 'int8' on a validator, got {self.weights!r} on a {self.role}")
        if self.gpus < 1 or (self.gpus > 1 and (self.role != "validator" or torch.device(self.device).type != "cuda")):
            raise ValueError(f"gpus is 1, or more for a validator on cuda, got {self.gpus} for a {self.role} on "
                             f"{self.device}")

    @property
    def traced_batch(self) -> int:
        """Sequences a traced miner step takes: one micro-batch, or two where gradients accumulate."""
        return min(self.batch_size or self.micro_batch, 2 * self.micro_batch)

    @property
    def cuda_autocast(self) -> bool:
        """Whether the trainer would run bf16 autocast (and so grouped experts): autocast asked for on CUDA."""
        return self.autocast and torch.device(self.device).type == "cuda"


@dataclass(frozen=True)
class MemoryPlan:
    """The traced peak in bytes, what it holds, and the allowance for what the trace does not see."""

    peak_bytes: int
    parts: dict[str, int]
    """`training.trace.PARTS` -> bytes live at the peak; they add up to `peak_bytes`."""
    phase: str
    """Where the peak falls: forward, backward, optimizer step, or writing back (the trained rows, after the last
    step)."""
    step: int
    """The inner step the peak falls in (a validator's scoring pass is its step 1)."""
    step_peaks: tuple[int, ...]
    """The most bytes live in each step traced, in order; the largest is `peak_bytes`."""
    device: str
    seconds: float
    device_peaks: tuple[int, ...] = ()
    """A model spread over several GPUs: each GPU's own peak, in order; the others describe the largest's."""

    def margin_of(self, peak_bytes: int) -> int:
        """The allowance added to a peak of `peak_bytes` (`MARGIN_FIXED`, `MARGIN_SHARE`): each GPU has its own."""
        return int(MARGIN_FIXED + MARGIN_SHARE * peak_bytes)

    @property
    def margin_bytes(self) -> int:
        """The allowance added to the peak for what the trace does not see (`MARGIN_FIXED`, `MARGIN_SHARE`)."""
        return self.margin_of(self.peak_bytes)


def first_experts(model: torch.nn.Module, adapter: MoEAdapter, per_layer: int) -> dict[int, list[int]]:
    """A group of `per_layer` experts in every MoE layer (the first ones: which does not change the memory)."""
    n_experts = adapter.num_experts(model)
    if not 1 <= per_layer <= n_experts:
        raise ValueError(f"experts per layer must be between 1 and the model's {n_experts}, got {per_layer}")
    return {layer: list(range(per_layer)) for layer in adapter.moe_layers(model)}


def plan(config: Mapping[str, Any], setting: Setting, group: ExpertGroup | int, family: str | None = None,
         dtype: torch.dtype | None = None, attn_implementation: str = "sdpa", steps: int | None = None) -> MemoryPlan:
    """Trace `setting` on a fake model of `config` (a checkpoint's config.json or a tiny config dict).

    `group`: the expert group, or a number of experts per MoE layer. `family`: the model family (default:
    the config's model_type). `dtype`: the weights' dtype (default: the config's, as a checkpoint loads;
    float32 when it names none)."""
    adapter = adapter_for(family or family_of(config))
    hf = hf_config(adapter, dict(config))
    with torch.device("meta"):  # transformers leaves from_config unannotated
        model = AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
            hf, dtype=dtype or _config_dtype(hf), attn_implementation=attn_implementation,
            experts_implementation="eager")
    with FakeTensorMode(allow_non_fake_inputs=True) as fake:
        model.to_empty(device="cpu")
        model.tie_weights()
        model.eval()
        chosen = first_experts(model, adapter, group) if isinstance(group, int) else group
        return measure(model, adapter, chosen, setting, fake, steps)


def measure(model: torch.nn.Module, adapter: MoEAdapter, group: ExpertGroup, setting: Setting,
            fake: FakeTensorMode | None = None, steps: int | None = None) -> MemoryPlan:
    """Trace `steps` inner steps of `setting` on `model` as it is: real tensors, or fake ones made under `fake`
    (still active). A validator scores `steps` batches (default one: a scoring pass keeps nothing from one batch
    to the next); a miner takes `STEPS` by default."""
    steps = steps if steps is not None else STEPS if setting.role == "miner" else 1
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    check_group(model, adapter, group)
    started = time.perf_counter()
    net: Any = model
    if setting.role == "miner" and setting.forward == "compressed":
        net = compress(model, adapter, group)
    module = net.model if net is not model else model
    if fake is not None:
        # torch cannot move a fake parameter (FakeTensorMode holds weak references to it, so swap_tensors
        # refuses), and the trainer and the scorer move the model where it already is: let that be a no-op.
        vars(module)["to"] = lambda *_, **__: module
    if setting.weights == "int8":
        hold_int8(module, [adapter.router(module, layer) for layer in adapter.moe_layers(module)])
    named = [*module.named_parameters(), *module.named_buffers()]
    weights = [tensor for _, tensor in named]
    places = _places(module, [name for name, _ in named], setting.gpus) if setting.gpus > 1 else None
    submission = _submission(model, adapter, group) if setting.role == "validator" else {}
    narrow = as_on_accelerator() if torch.device(setting.device).type != "cpu" else nullcontext()
    with (Trace(weights, fake, places) as trace, narrow,
          torch.autocast("cpu", torch.bfloat16, enabled=setting.cuda_autocast)):
        vocab = int(cast(Any, model).config.vocab_size)
        rows = setting.traced_batch if setting.role == "miner" else steps * setting.micro_batch
        ids_BL = torch.arange(rows * setting.seq_len).remainder(vocab).view(rows, -1)
        if setting.role == "miner":
            _train(net, adapter, group, ids_BL, setting, steps, trace)
        else:
            loss_with_experts(net, adapter, submission, ids_BL, batch_size=setting.micro_batch, pad_id=_NO_PADDING)
    peak, parts, phase, step = trace.peak()
    step_peaks = tuple(trace.step_peaks[s] for s in sorted(trace.step_peaks))
    seconds = time.perf_counter() - started
    if places is None:
        return MemoryPlan(peak, parts, phase, step, step_peaks, setting.device, seconds)
    devices = trace.device_peak()
    peak, parts, phase, step = max(devices.values(), key=lambda d: d[0])
    return MemoryPlan(peak, parts, phase, step, step_peaks, setting.device, seconds,
                      tuple(devices.get(d, (0,))[0] for d in range(setting.gpus)))


def _places(model: torch.nn.Module, names: list[str], gpus: int) -> list[int]:
    """The GPU each named weight of `model` lands on, spread over `gpus` GPUs as a validator spreads it."""
    quiet = logging.getLogger("accelerate.utils.modeling")  # it warns of every GPU this machine lacks
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        device_map = spread_map(model, dict.fromkeys(range(gpus), 1 << 50))
    finally:
        quiet.setLevel(level)
    prefixes = sorted(device_map, key=len, reverse=True)

    def place(name: str) -> int:
        prefix = next(p for p in prefixes if p == "" or name == p or name.startswith(p + "."))
        return int(device_map[prefix])

    return [place(name) for name in names]


def _train(net: Any, adapter: MoEAdapter, group: ExpertGroup, ids_BL: torch.Tensor, setting: Setting, steps: int,
           trace: Trace) -> None:
    """`steps` steps of the miner's own training (the trainer's copies, forward, backward and optimizer steps, and
    the trained rows written back), each on `ids_BL`; `trace` is told which step runs."""

    def batches() -> Iterator[torch.Tensor]:
        for step in range(1, steps + 1):
            trace.step = step
            yield ids_BL
        trace.after_steps = True  # the trainer asks for one more than it is given: the steps are over

    cfg = TrainConfig(steps=steps + 1, batch_size=setting.traced_batch, micro_batch_size=setting.micro_batch,
                      forward=setting.forward, device="cpu", checkpointing=setting.checkpointing,
                      autocast=setting.autocast, pad_id=_NO_PADDING, optimizer=setting.optimizer,
                      step_in_backward=setting.step_in_backward,
                      experts_implementation="grouped_mm" if setting.cuda_autocast else "eager")
    train_experts(net, adapter, group, batches(), cfg)


def _submission(model: torch.nn.Module, adapter: MoEAdapter, group: ExpertGroup) -> dict[str, torch.Tensor]:
    """A submission's fp32 experts, made before the trace: a validator holds them in host memory."""
    with torch.no_grad():
        return {name: torch.empty(getattr(adapter.experts(model, layer), param).shape[1:], dtype=torch.float32)
                for name in expert_names(group) for layer, _, param in [parse_name(name)]}


def _config_dtype(config: Any) -> torch.dtype:
    """The dtype a checkpoint's weights load in: its config's, float32 when it names none."""
    dtype = getattr(config, "dtype", None) or torch.float32
    loaded = getattr(torch, dtype, None) if isinstance(dtype, str) else dtype
    if not isinstance(loaded, torch.dtype) or not loaded.is_floating_point:
        raise ValueError(f"the model config names dtype {str(dtype)[:40]!r}, not a floating-point dtype")
    return loaded

"""A node's memory plan: the peak of a round's training steps or a scoring pass, traced on fake tensors before anything loads.

`plan` builds the model of a config dict on fake tensors (shapes, dtypes and no storage; no weight is
read), runs the project's own work on it, a miner's `training.trainer.train_experts` over `STEPS` inner
steps (fp32 trainable copies, the optimizer, the trained rows written back; two micro-batches a step where
gradients accumulate), which is its steady state, or a validator's `training.evaluate.loss_with_experts`
pass, and follows every storage it allocates and frees (`Trace`): the peak, its step and phase, split into
weights, trainable copies, gradients, optimizer state and activations (with every other temporary); for a
validator spread over several GPUs, each GPU's. `measure` runs the same trace on a model already built,
real or fake, so a real run checks the fake one.

Fake tensors hold no values, so an operation whose result depends on them (which experts a token
picks, a count, `.item()`) gets one from a shadow: integer and other small tensors are computed for
real beside their fakes, and a router's top-k on value-less scores routes round-robin, every expert
getting the same share of tokens. A loss read as a number reads 0. The trace runs on the CPU, in the
weights' dtype for an accelerator as it computes (`training.cpu_compute.as_on_accelerator`), and labels the
target device; what a CPU trace does not see is in `SEES_NOT` and `margin_bytes`.
This module reads no files and knows nothing about specs, nodes or the network.
Legend: B micro-batch, L sequence length.
"""

from __future__ import annotations

import itertools
import logging
import time
import weakref
from collections.abc import Iterable, Iterator, Mapping
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Literal, cast

import torch
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
    unset_fake_temporarily,
)
from torch.multiprocessing.reductions import StorageWeakRef
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.weak import WeakIdKeyDictionary
from transformers import AutoModelForCausalLM

from training.adapters import MoEAdapter, adapter_for, family_of
from training.compressed import compress
from training.cpu_compute import as_on_accelerator
from training.device import hold_int8, spread_map
from training.evaluate import loss_with_experts
from training.experts import ExpertGroup, check_group, expert_names, parse_name
from training.tiny import hf_config
from training.trainer import TrainConfig, train_experts

GIB = 1024**3
STEPS = 2
"""Inner steps a miner's plan traces: from the second on, the optimizer state lives through every forward and
backward, and every later step holds what the second does (tests/training/test_plan_steady.py)."""
PARTS = ("weights", "trainable_copies", "gradients", "optimizer_state", "activations")
"""What the peak is made of; `activations` holds every temporary too (AdamW's, the loss's)."""
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
_SHADOW_NUMEL = 1 << 24
"""The largest float tensor given a real shadow; a bigger one (a float mask of a long sequence) stays fake."""
_SHADOW_NUMEL_EXACT = 1 << 26
"""The largest integer or boolean tensor given one: routing's one-hot masks of a validator's batch (16 x 2048
tokens, top-8 of 64 experts: 17 M values) decide which experts run."""
_NO_PADDING = -1
"""The planned batch's pad id: no token is padding, so every position counts as in a full packed batch."""

Role = Literal["miner", "validator"]
Forward = Literal["full", "compressed"]
aten = torch.ops.aten


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
    """PARTS -> bytes live at the peak; they add up to `peak_bytes`."""
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


def _shadowable(tensor: torch.Tensor) -> bool:
    """Whether a tensor is small enough to be computed for real beside its fake (`_SHADOW_NUMEL`)."""
    limit = _SHADOW_NUMEL if tensor.is_floating_point() else _SHADOW_NUMEL_EXACT
    return tensor.numel() <= limit


def _config_dtype(config: Any) -> torch.dtype:
    """The dtype a checkpoint's weights load in: its config's, float32 when it names none."""
    dtype = getattr(config, "dtype", None) or torch.float32
    loaded = getattr(torch, dtype, None) if isinstance(dtype, str) else dtype
    if not isinstance(loaded, torch.dtype) or not loaded.is_floating_point:
        raise ValueError(f"the model config names dtype {str(dtype)[:40]!r}, not a floating-point dtype")
    return loaded


class Trace(TorchDispatchMode):  # type: ignore[no-untyped-call]  # torch leaves the mode unannotated
    """Follows every storage the operations inside allocate, until they free it, and labels the peak.

    Storages are keyed by their storage's identity; a tensor's weakref finalizer says when one may be
    gone, and the storage's own weak reference says whether it is. `weights` are live from the start.
    The optimizer step is marked through torch's step hooks: its parameters are the trainable copies,
    their gradients the gradients, and what its state holds after the step the optimizer state.
    It follows every step the caller runs and what comes after them; the caller says which step runs
    (`step`) and when they are over (`after_steps`). With `fake`, data-
    dependent operations are answered from real shadows (module docstring).
    With `places` (the device of each weight, for a model spread over several), every storage is also
    counted on a device: an operation's results on the last of its inputs' devices (a forward pass moves
    through the devices in order, and accelerate's hooks move the inputs of each module to its device), or
    where the last operation ran when it has none; each device's peak is kept apart (`device_peak`).
    """

    def __init__(self, weights: Iterable[torch.Tensor], fake: FakeTensorMode | None,
                 places: Iterable[int] | None = None) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.step = 1
        """The inner step running now (the caller advances it); its peak is kept apart (`step_peaks`)."""
        self.after_steps = False
        """Set by the caller once the last step is over: what follows is the trained rows written back."""
        self._fake = fake
        self._shadows: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._allocations: dict[int, int] = {}
        """A live storage's address -> its allocation's number (addresses are reused once freed)."""
        self._count = itertools.count()
        self._refs: dict[int, tuple[int, StorageWeakRef]] = {}
        """Allocation -> (its storage's address, a weak reference to the storage)."""
        self._live: dict[int, int] = {}
        """Allocation -> bytes, for the storages alive now."""
        self._maybe_freed: set[int] = set()
        self._labels: dict[int, str] = {}
        self._live_bytes = 0
        self._peak: dict[int, int] = {}
        self._peak_bytes = -1
        self._peak_phase = "forward"
        self._peak_step = 1
        self.step_peaks: dict[int, int] = {}
        """Step -> the most bytes live during it (the write-back after the last step counts in the last)."""
        self._in_step = False
        self._where: dict[int, int] | None = None if places is None else {}
        """Allocation -> its device, where the model is spread over several."""
        self._here = self._last = 0
        self._device_live: dict[int, int] = {}
        self._device_peak: dict[int, tuple[int, dict[int, int], str, int]] = {}
        """Device -> (its peak bytes, allocation -> bytes on it then, phase, step)."""
        weights = list(weights)
        for tensor, place in zip(weights, places if places is not None else [0] * len(weights), strict=True):
            self._here = place  # no finalizer: a weakref would stop `Module.to` swapping a fake parameter
            self._labels[self._add(tensor, watch=False)] = "weights"
        self._hooks: list[Any] = []

    def __enter__(self) -> Trace:
        self._hooks = [register_optimizer_step_pre_hook(self._before_step),
                       register_optimizer_step_post_hook(self._after_step)]
        super().__enter__()  # type: ignore[no-untyped-call]
        return self

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)  # type: ignore[no-untyped-call]
        for hook in self._hooks:
            hook.remove()

    def peak(self) -> tuple[int, dict[str, int], str, int]:
        """(peak bytes, PARTS at the peak, its phase, its step)."""
        parts = dict.fromkeys(PARTS, 0)
        for key, nbytes in self._peak.items():
            parts[self._labels.get(key, "activations")] += nbytes
        assert sum(parts.values()) == self._peak_bytes, "the parts of the peak do not add up to it"
        return self._peak_bytes, parts, self._peak_phase, self._peak_step

    def device_peak(self) -> dict[int, tuple[int, dict[str, int], str, int]]:
        """Device -> (its peak bytes, PARTS at it, its phase, its step), where the model is spread over several."""
        out = {}
        for device, (peak, live, phase, step) in sorted(self._device_peak.items()):
            parts = dict.fromkeys(PARTS, 0)
            for key, nbytes in live.items():
                parts[self._labels.get(key, "activations")] += nbytes
            out[device] = (peak, parts, phase, step)
        return out

    def _before_step(self, optimizer: torch.optim.Optimizer, *_: object) -> None:
        for group in optimizer.param_groups:
            for param in group["params"]:
                self._labels[self._key(param)] = "trainable_copies"
                if param.grad is not None:
                    self._labels[self._key(param.grad)] = "gradients"
        self._collect_frees()
        self._in_step = True

    def _after_step(self, optimizer: torch.optim.Optimizer, *_: object) -> None:
        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    self._labels[self._key(value)] = "optimizer_state"
        self._in_step = False

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs) if self._fake is None else self._fake_call(func, args, kwargs)
        self._collect_frees()
        if self._where is not None:
            where, allocations = self._where, self._allocations
            inputs = [where.get(allocations.get(int(a.untyped_storage()._cdata), -1), -1)
                      for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
            self._here = max(inputs, default=-1)
            if self._here < 0:
                self._here = self._last
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor):
                self._add(tensor)
        if self._live_bytes > self.step_peaks.get(self.step, -1):
            self.step_peaks[self.step] = self._live_bytes
        if self._live_bytes > self._peak_bytes:
            self._peak, self._peak_bytes, self._peak_step = dict(self._live), self._live_bytes, self.step
            self._peak_phase = self._phase()
        if self._where is not None:
            self._last = self._here
            here = self._device_live.get(self._here, 0)
            if here > self._device_peak.get(self._here, (-1,))[0]:
                live = {key: n for key, n in self._live.items() if self._where.get(key) == self._here}
                self._device_peak[self._here] = (here, live, self._phase(), self.step)
        return out

    def _phase(self) -> str:
        return ("optimizer step" if self._in_step else
                "backward" if torch._C._current_autograd_node() is not None else
                "writing back" if self.after_steps else "forward")

    def _key(self, tensor: torch.Tensor) -> int:
        return self._allocations[int(tensor.untyped_storage()._cdata)]

    def _add(self, tensor: torch.Tensor, watch: bool = True) -> int:
        storage = tensor.untyped_storage()
        nbytes = storage.nbytes()
        key = self._allocations.get(int(storage._cdata))
        if key is None:
            key = self._allocations[int(storage._cdata)] = next(self._count)
            self._refs[key] = (int(storage._cdata), StorageWeakRef(storage))  # type: ignore[no-untyped-call]
            self._live[key] = 0
            if self._where is not None:
                self._where[key] = self._here
        if nbytes > self._live[key]:  # new, or resized in place
            self._live_bytes += nbytes - self._live[key]
            if self._where is not None:
                device = self._where[key]
                self._device_live[device] = self._device_live.get(device, 0) + nbytes - self._live[key]
            self._live[key] = nbytes
        if watch:
            weakref.finalize(tensor, self._maybe_freed.add, key)
        return key

    def _collect_frees(self) -> None:
        for key in list(self._maybe_freed):
            ref = self._refs.get(key)
            if ref is None or ref[1].expired():  # type: ignore[no-untyped-call]
                self._maybe_freed.discard(key)
                if ref is not None:
                    del self._refs[key], self._allocations[ref[0]]
                    nbytes = self._live.pop(key)
                    self._live_bytes -= nbytes
                    if self._where is not None:
                        self._device_live[self._where.pop(key)] -= nbytes

    def _fake_call(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run `func` on fake tensors, answering what depends on values from the shadows."""
        assert self._fake is not None
        flat = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        known = all(not isinstance(a, FakeTensor) or a in self._shadows for a in flat)
        if not known and func in (aten.index.Tensor, aten.index_put.default, aten.index_put_.default):
            args = (args[0], [self._long_index(i) for i in args[1]], *args[2:])
        try:
            out = func(*args, **kwargs)
        except (DynamicOutputShapeException, DataDependentOutputException):
            if known:
                return self._shadowed(func, args, kwargs, None)
            if func is aten._local_scalar_dense.default and args[0].is_floating_point():
                return 0.0  # a value no one traced: a loss read as a number
            raise AssertionError(f"the plan cannot trace {func} on values it does not hold") from None
        if func is aten.topk.default and not known:
            self._round_robin(args, out)
        elif known and all(_shadowable(t) for t in tree_flatten(out)[0]
                                    if isinstance(t, torch.Tensor)):
            self._shadowed(func, args, kwargs, out)
        elif not known and func._schema.is_mutable:
            for tensor in flat:
                self._shadows.pop(tensor, None)  # type: ignore[no-untyped-call]
        return out

    def _shadowed(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> Any:
        """Run `func` on the shadows; `out` (None: made from the real result) gets the results as shadows."""
        assert self._fake is not None
        shadows = self._shadows
        real_args, real_kwargs = tree_map(
            lambda a: shadows.get(a, a) if isinstance(a, FakeTensor) else a,  # type: ignore[no-untyped-call]
            (args, kwargs))
        with unset_fake_temporarily():
            real = func(*real_args, **real_kwargs)
        if out is None:
            fake = self._fake
            out = tree_map(lambda r: fake.from_tensor(r) if isinstance(r, torch.Tensor) else r, real)
        for o, r in zip(tree_flatten(out)[0], tree_flatten(real)[0], strict=True):
            if isinstance(o, torch.Tensor) and isinstance(r, torch.Tensor) and _shadowable(r):
                self._shadows[o] = r
        return out

    def _long_index(self, index: torch.Tensor | None) -> torch.Tensor | None:
        """A known boolean mask index as the integer indices it selects (its shape is then known)."""
        if index is None or index.dtype != torch.bool or index not in self._shadows:
            return index
        assert self._fake is not None
        assert index.ndim == 1, "the plan turns only one-dimensional masks into indices"
        with unset_fake_temporarily():
            rows = self._shadows[index].nonzero().reshape(-1)
        fake = self._fake.from_tensor(rows)
        self._shadows[fake] = rows
        return fake

    def _round_robin(self, args: tuple[Any, ...], out: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Shadow a top-k over value-less scores: row r picks choices (r k + j) mod E, every choice equally often."""
        scores = args[0]
        dim = args[2] if len(args) > 2 else -1
        assert dim in (-1, scores.ndim - 1), "the plan routes only a top-k over the last dimension"
        choices = scores.shape[-1]
        with unset_fake_temporarily():
            picks = torch.arange(out[1].numel()).remainder(choices).reshape(out[1].shape)
        self._shadows[out[1]] = picks

"""Settings picked to fit: the fastest combination of a node's memory settings whose steady-state plan fits a budget.

`fit` orders the combinations of the settings it may change (`free`) by their estimated step time
(`Choice.slowdown`), and among equally fast ones those that change the arithmetic least first, and returns
the first whose peak plus margin, traced with the caller's `trace` (a `training.plan.plan` over one model
and group), is within the budget. Where the fastest does not fit, it traces the combinations that save the
most: if none of them fits, none does, and `DoesNotFit` names the one that needs least. A combination is not traced when
one that saves at least as much on every setting was traced and did not fit: memory falls as each setting
saves more. Settings the caller pinned stay as given.

What each setting costs in speed (`COSTS`) is stated with where the figure comes from: no GPU has measured
these yet, so the GPU factors are estimates, with the one CPU measurement the repository holds named beside
them. A miner's forward is `compressed` (it holds and runs only the group's experts: no slower and no larger
than `full`) and a CUDA miner's autocast is on (bf16 matmuls and grouped experts) unless pinned. This module
knows nothing about configs, specs or the network.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch

from training.plan import GIB, MemoryPlan, Setting

MINER_FIELDS = ("forward", "autocast", "micro_batch", "checkpointing", "step_in_backward", "optimizer")
"""A miner's memory settings (`Setting` fields) a fit may choose."""
VALIDATOR_FIELDS = ("micro_batch", "weights")
"""A validator's: its scoring batch and its frozen weights."""
FULL_PASS_TOKENS = 2048
"""Tokens a pass needs for its matmuls to keep a GPU busy (estimate); a micro-batch below it costs `COSTS`."""


@dataclass(frozen=True)
class Cost:
    """What one setting does to a step's time: a factor on it, and where the factor comes from."""

    factor: float
    source: str


COSTS = {
    "checkpointing": Cost(4 / 3, "estimate: each decoder layer runs its forward again in backward, and a forward is "
                                 "about a third of a step's compute"),
    "micro_batch": Cost(1.1, "estimate, per halving of a micro-batch below 2048 tokens a pass: a GPU's matmuls "
                             "are no longer full; none at 2048 tokens or more"),
    "optimizer": Cost(1.0, "estimate: bitsandbytes' 8-bit step is one kernel per tensor, a small share of a step; "
                           "the moments are held in 8 bits, block-wise"),
    "step_in_backward": Cost(1.0, "estimate: the same work, the step taken tensor by tensor inside backward; a step "
                                  "is clipped by the norm of the step before (the same updates where the clip does "
                                  "not bind)"),
    "weights": Cost(1.05, "estimate: each int8 layer's weights are cast to the compute dtype as it runs"),
    "forward": Cost(1.0, "compressed is no slower than full (measured on a CPU, scaled OLMoE shape: 1.95x the "
                         "tokens/s, bench/results/gpu-cpu-scaled.json)"),
}
_FIDELITY = ("micro_batch", "step_in_backward", "weights", "optimizer")
"""Settings in the order of how much they change the arithmetic, least first: the order ties are broken in."""


@dataclass(frozen=True)
class Choice:
    """A combination, its traced plan, and what it costs against the fastest."""

    setting: Setting
    plan: MemoryPlan
    slowdown: float
    """Estimated step time over the fastest combination's (1.0: as fast)."""
    changes: tuple[str, ...]
    """Each setting that costs something or changes the arithmetic, with its cost, in words."""

    @property
    def need_bytes(self) -> int:
        return self.plan.peak_bytes + self.plan.margin_bytes


class DoesNotFit(ValueError):
    """No combination fits the budget; `nearest` is the one that needs the least of those that save the most."""

    def __init__(self, budget_bytes: int, nearest: Choice) -> None:
        self.budget_bytes, self.nearest = budget_bytes, nearest
        super().__init__(f"nothing fits {budget_bytes / GIB:.1f} GiB; the nearest, {describe(nearest.setting)}, "
                         f"needs {nearest.need_bytes / GIB:.1f} GiB (a traced peak of "
                         f"{nearest.plan.peak_bytes / GIB:.1f} GiB plus {nearest.plan.margin_bytes / GIB:.1f} GiB margin)")


def fit(trace: Callable[[Setting], MemoryPlan], base: Setting, free: Iterable[str], budget_bytes: int,
        on_trace: Callable[[Setting], None] | None = None) -> Choice:
    """The fastest combination of `free` settings (the rest as in `base`) whose plan plus margin fits `budget_bytes`.

    `trace(setting)` plans one combination; `on_trace` is told of each before it is traced. DoesNotFit when none fits."""
    free = tuple(free)
    allowed = MINER_FIELDS if base.role == "miner" else VALIDATOR_FIELDS
    unknown = [name for name in free if name not in allowed]
    assert not unknown, f"a {base.role}'s fit cannot choose {unknown}"
    candidates = sorted(_combinations(base, free), key=lambda s: (_slowdown(s, base), _fidelity(s, base)))
    traced: dict[Setting, Choice] = {}

    def choose(setting: Setting) -> Choice:
        if setting not in traced:
            if on_trace is not None:
                on_trace(setting)
            traced[setting] = Choice(setting, trace(setting), _slowdown(setting, base),
                                     tuple(_changes(setting, base, free)))
        return traced[setting]

    if choose(candidates[0]).need_bytes <= budget_bytes:
        return traced[candidates[0]]
    most = [s for s in candidates if not any(o != s and _saves_no_more(s, o) for o in candidates)]
    nearest = min((choose(s) for s in most), key=lambda c: c.need_bytes)
    if nearest.need_bytes > budget_bytes:  # the combinations that save the most do not fit: none does
        raise DoesNotFit(budget_bytes, nearest)
    for setting in candidates:
        if any(_saves_no_more(setting, other) for other, c in traced.items() if c.need_bytes > budget_bytes):
            continue
        choice = choose(setting)
        if choice.need_bytes <= budget_bytes:
            return choice
    raise DoesNotFit(budget_bytes, min(traced.values(), key=lambda c: c.need_bytes))


def describe(setting: Setting) -> str:
    """The memory settings of `setting` in words, as `tessera plan` takes them."""
    if setting.role == "validator":
        return f"micro-batch {setting.micro_batch}, weights {setting.weights}"
    words = [setting.forward, f"micro-batch {setting.micro_batch}"]
    words += [name for name, on in (("checkpointing", setting.checkpointing), ("autocast", setting.autocast),
                                    ("step in backward", setting.step_in_backward)) if on]
    return ", ".join([*words, setting.optimizer])


def _combinations(base: Setting, free: tuple[str, ...]) -> Iterator[Setting]:
    """Every combination of the free settings' values; a miner's forward and CUDA autocast as the module says."""
    batch = base.batch_size or base.micro_batch
    halves = sorted({max(1, -(-batch >> shift)) for shift in range(batch.bit_length())}, reverse=True)
    options: dict[str, list[Any]] = {
        "forward": ["compressed"],
        "autocast": [True] if torch.device(base.device).type == "cuda" else [base.autocast],
        "micro_batch": list(halves),
        "checkpointing": [False, True],
        "step_in_backward": [False, True],
        "optimizer": ["adamw", "adamw8bit"],
        "weights": ["checkpoint", "int8"],
    }
    values = [options[name] for name in free]
    for combination in itertools.product(*values):
        changes: dict[str, Any] = dict(zip(free, combination, strict=True))
        if changes.get("step_in_backward", base.step_in_backward) and changes.get("micro_batch", base.micro_batch) < batch:
            continue  # a step of several micro-batches holds its gradients anyway
        yield replace(base, **changes)


def _slowdown(setting: Setting, base: Setting) -> float:
    """Estimated step time over the fastest combination's (`COSTS`)."""
    factor = COSTS["checkpointing"].factor if setting.checkpointing else 1.0
    if setting.weights == "int8":
        factor *= COSTS["weights"].factor
    return factor * COSTS["micro_batch"].factor ** _short_passes(setting, base)


def _short_passes(setting: Setting, base: Setting) -> int:
    """Halvings of a GPU pass below `FULL_PASS_TOKENS` (or below the whole batch's tokens, if fewer)."""
    if torch.device(setting.device).type == "cpu":
        return 0
    full = min((base.batch_size or base.micro_batch) * setting.seq_len, FULL_PASS_TOKENS)
    tokens = setting.micro_batch * setting.seq_len
    return 0 if tokens >= full else math.ceil(math.log2(full / tokens))


def _fidelity(setting: Setting, base: Setting) -> tuple[bool, ...]:
    batch = base.batch_size or base.micro_batch
    changed = {"micro_batch": setting.micro_batch < batch, "step_in_backward": setting.step_in_backward,
               "weights": setting.weights == "int8", "optimizer": setting.optimizer == "adamw8bit"}
    return tuple(changed[name] for name in reversed(_FIDELITY))


def _savings(setting: Setting) -> tuple[int, ...]:
    """How much a combination saves on each setting (more saves more memory)."""
    return (int(setting.checkpointing), int(setting.step_in_backward), int(setting.optimizer == "adamw8bit"),
            int(setting.weights == "int8"), -setting.micro_batch, int(setting.forward == "compressed"))


def _saves_no_more(setting: Setting, other: Setting) -> bool:
    """Whether `setting` saves no more than `other` on any setting (and equals it where savings do not order)."""
    same = setting.autocast == other.autocast
    return same and all(a <= b for a, b in zip(_savings(setting), _savings(other), strict=True))


def _changes(setting: Setting, base: Setting, free: tuple[str, ...]) -> Iterator[str]:
    """The chosen settings that cost speed or change the arithmetic, each with its cost."""
    chosen = {
        "forward": setting.forward == "compressed" and setting.role == "miner",
        "checkpointing": setting.checkpointing,
        "step_in_backward": setting.step_in_backward,
        "optimizer": setting.optimizer == "adamw8bit",
        "weights": setting.weights == "int8",
        "micro_batch": setting.micro_batch < (base.batch_size or base.micro_batch),
    }
    words = {"forward": "forward compressed", "checkpointing": "checkpointing", "step_in_backward": "step in backward",
             "optimizer": "8-bit moments", "weights": "int8 weights",
             "micro_batch": f"micro-batch {setting.micro_batch} ({setting.micro_batch * setting.seq_len} tokens a pass)"}
    for name in ("forward", "checkpointing", "micro_batch", "step_in_backward", "optimizer", "weights"):
        if name in free and chosen[name]:
            factor = COSTS[name].factor ** (_short_passes(setting, base) if name == "micro_batch" else 1)
            yield f"{words[name]}: x{factor:.2f} ({COSTS[name].source})"

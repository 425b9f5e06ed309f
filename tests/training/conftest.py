"""Fixtures for the model-side training tests: a tiny model of each family, a group, pattern data.

`tiny` is parametrised over all six families and gives a `Tiny(family, model, adapter, group)`;
the group takes experts 1 and 3 of the first MoE layer and expert 2 of the second. The factories
`make_tiny(family, seed=0)` and `pattern(n, length, seed, ...)` are fixtures too; `pattern` makes a
deterministic, easily learnable domain: rotations of a short repeating byte pattern. `good` is a
tiny Qwen3-MoE checkpoint directory written with `save_pretrained`, once per module.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch

from training.adapters import MoEAdapter, adapter_for
from training.tiny import build_tiny_model, tiny_config

FAMILIES = ("qwen3_moe", "olmoe", "mixtral", "deepseek_v3", "qwen2_moe", "deepseek_v2")
PAD = 256


class Tiny(NamedTuple):
    family: str
    model: Any
    adapter: MoEAdapter
    group: dict[int, list[int]]


def make_tiny(family: str, seed: int = 0) -> Tiny:
    model = build_tiny_model(family, tiny_config(family), seed)
    adapter = adapter_for(family)
    first, second = adapter.moe_layers(model)[:2]
    return Tiny(family, model, adapter, {first: [1, 3], second: [2]})


def pattern_sequences(
    n: int, length: int, seed: int, pattern: bytes = b"tessera!", pad_tail: int = 0
) -> torch.Tensor:
    """[n, length] rotations of `pattern`; the last `pad_tail` positions of every row are padding."""
    gen = torch.Generator().manual_seed(seed)
    base = torch.tensor(list(pattern), dtype=torch.long)
    rows = []
    for _ in range(n):
        shift = int(torch.randint(0, len(pattern), (1,), generator=gen))
        rows.append(base.roll(-shift).repeat(length // len(pattern) + 1)[:length])
    out = torch.stack(rows)
    if pad_tail:
        out[:, -pad_tail:] = PAD
    return out


@pytest.fixture(params=FAMILIES)
def tiny(request: pytest.FixtureRequest) -> Tiny:
    return make_tiny(request.param)


@pytest.fixture(name="make_tiny")
def make_tiny_fixture() -> Callable[..., Tiny]:
    return make_tiny


@pytest.fixture(name="pattern")
def pattern_fixture() -> Callable[..., torch.Tensor]:
    return pattern_sequences


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("good")
    build_tiny_model("qwen3_moe", tiny_config("qwen3_moe"), 0).save_pretrained(str(directory))
    return directory

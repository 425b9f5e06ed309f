"""docs/hardware.md cannot drift from the plans: it is bench/hardware.py's rendering of docs/hardware.json, every
row there was traced with the setting the generator names, the numbers hold what a steady state must, and a row
traced again (slow: seconds of fake-tensor trace at full size) gives the numbers in the file."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.bench.scripts import load_bench
from training.adapters import adapter_for
from training.plan import GIB, Setting, plan
from training.tiny import hf_config

DOCS = Path(__file__).resolve().parents[2] / "docs"
SMALL = 4096
"""Bytes two traces of the same work may differ by (tests/training/test_plan_steady.py)."""


@pytest.fixture(scope="module")
def hardware() -> ModuleType:
    return load_bench("hardware")


@pytest.fixture(scope="module")
def numbers() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads((DOCS / "hardware.json").read_text(encoding="utf-8"))
    return loaded


def test_the_table_is_the_rendering_of_the_plans_numbers(hardware: ModuleType, numbers: dict[str, Any]) -> None:
    assert (DOCS / "hardware.md").read_text(encoding="utf-8") == hardware.render(numbers), (
        "docs/hardware.md differs from its rendering: python bench/hardware.py --render docs/hardware.json "
        "--out docs/hardware.md")


def test_every_row_was_traced_with_the_setting_the_generator_names(hardware: ModuleType,
                                                                   numbers: dict[str, Any]) -> None:
    plans, fits = numbers["plans"], numbers["fits"]
    for row in hardware.rows():
        assert plans[row.key()]["setting"] == asdict(row.setting), row.key()
        if row.setting.role == "miner" and row.label == "defaults":
            fitted = fits[row.key()]
            prefix = row.key().rsplit(" | ", 1)[0]  # this shape, role, group and sequence length
            chosen = [entry for key, entry in plans.items()
                      if key.startswith(prefix) and entry["setting"] == fitted.get("setting")]
            if fitted["fits"]:  # the choice is a traced plan that fits the card
                assert fitted["need_bytes"] <= hardware.CARD_GIB * GIB
                assert [e["peak_bytes"] + e["margin_bytes"] for e in chosen] == [fitted["need_bytes"]]
            else:  # even the setting that needs least does not
                least = plans[next(r for r in hardware.rows() if (r.shape, r.per_layer, r.setting.seq_len, r.label)
                                   == (row.shape, row.per_layer, row.setting.seq_len, "least")).key()]
                assert least["peak_bytes"] + least["margin_bytes"] > hardware.CARD_GIB * GIB


def test_a_miners_peak_is_its_steady_state_with_every_copy_and_moment(hardware: ModuleType,
                                                                      numbers: dict[str, Any]) -> None:
    for row in hardware.rows():
        if row.setting.role != "miner":
            continue
        entry = numbers["plans"][row.key()]
        group = hardware.Sizes.of(hardware.SHAPES[row.shape]).group(row.per_layer)
        parts = entry["parts"]
        assert entry["step"] == 2 and max(entry["step_peaks"]) == entry["peak_bytes"] == sum(parts.values())
        assert parts["trainable_copies"] == 4 * group, row.key()
        if row.setting.optimizer == "adamw":  # two fp32 moments, and a step count a tensor
            assert 8 * group <= parts["optimizer_state"] <= 8 * group + SMALL, row.key()
        else:  # 8 bits a moment and a scale of 4 bytes every 256 values
            assert 2 * group <= parts["optimizer_state"] <= 2.1 * group, row.key()


def test_the_sizes_are_the_models_parameter_counts(hardware: ModuleType) -> None:
    for config in hardware.SHAPES.values():
        adapter = adapter_for(config["model_type"])
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hf_config(adapter, dict(config)))  # type: ignore[no-untyped-call]
        assert hardware.Sizes.of(config).total == sum(p.numel() for p in model.parameters())


@pytest.mark.slow
def test_a_row_traced_again_gives_the_numbers_in_the_file(hardware: ModuleType, numbers: dict[str, Any]) -> None:
    row = next(r for r in hardware.rows() if (r.shape, r.per_layer, r.label) == ("OLMoE-1B-7B", 2, "defaults"))
    assert row.setting == Setting(role="miner", seq_len=2048, forward="compressed", autocast=True)
    again = plan(hardware.SHAPES[row.shape], row.setting, row.per_layer)
    entry = numbers["plans"][row.key()]
    assert abs(again.peak_bytes - entry["peak_bytes"]) <= SMALL
    assert (again.step, again.phase) == (entry["step"], entry["phase"])
    assert all(abs(again.parts[k] - v) <= SMALL for k, v in entry["parts"].items())

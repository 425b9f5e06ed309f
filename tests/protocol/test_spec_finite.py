"""Every float in a spec must be finite: inf and nan are refused naming the field, from data, a TOML
file or a `--set` setting, so nothing non-finite reaches the network id's JSON encoding."""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import pytest

from protocol.spec import (
    AggregationSpec,
    DataSpec,
    LimitSpec,
    ModelSpec,
    RewardSpec,
    SpecError,
    SubmissionSpec,
    TimingSpec,
    TrainingSpec,
    ValidatorEntry,
    judge_settings,
    load_spec,
    parse_spec,
)
from tests.conftest import make_spec_dict, to_toml

SECTIONS = {"timing": TimingSpec, "model": ModelSpec, "data": DataSpec, "training": TrainingSpec,
            "validators.0": ValidatorEntry, "rewards": RewardSpec, "aggregation": AggregationSpec,
            "limits": LimitSpec, "submission": SubmissionSpec}
FLOAT_FIELDS = [f"{section}.{name}" for section, model in SECTIONS.items()
                for name, info in model.model_fields.items() if info.annotation in (float, float | None)]
NOT_FINITE = [math.inf, -math.inf, math.nan]


def _with(dotted: str, value: object) -> dict[str, Any]:
    data = copy.deepcopy(make_spec_dict())
    *parents, last = dotted.split(".")
    node: Any = data
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node.setdefault(part, {})
    node[last] = value
    return data


def test_every_float_field_of_the_spec_is_covered() -> None:
    assert len(FLOAT_FIELDS) == 17
    assert {"validators.0.weight", "timing.train_s", "training.beta1", "aggregation.forgetting_budget",
            "aggregation.gate_margin"} <= set(FLOAT_FIELDS)


@pytest.mark.parametrize("value", NOT_FINITE, ids=repr)
@pytest.mark.parametrize("field", FLOAT_FIELDS)
def test_a_float_that_is_not_finite_is_refused_naming_the_field(field: str, value: float) -> None:
    with pytest.raises(SpecError) as info:
        parse_spec(_with(field, value))
    assert str(info.value) == f"{field}: Input should be a finite number"


@pytest.mark.parametrize("field", ["timing.train_s", "aggregation.outer_lr", "validators.0.weight"])
@pytest.mark.parametrize("value", NOT_FINITE, ids=repr)
def test_a_spec_file_with_inf_or_nan_names_the_file_and_the_field(tmp_path: Path, field: str, value: float) -> None:
    path = tmp_path / "spec.toml"
    path.write_text(to_toml(_with(field, value)), encoding="utf-8")
    assert f"= {value!r}\n" in path.read_text(encoding="utf-8")  # TOML's own spelling: inf, -inf, nan
    with pytest.raises(SpecError) as info:
        load_spec(path)
    assert str(info.value) == f"{path}: {field}: Input should be a finite number"


@pytest.mark.parametrize("value", NOT_FINITE, ids=repr)
def test_a_setting_that_is_not_finite_is_refused_naming_it(value: float) -> None:
    with pytest.raises(ValueError, match="^spec setting aggregation.outer_lr: Input should be a finite number$"):
        judge_settings([("aggregation.outer_lr", value)])


def test_phases_that_add_up_past_a_float_are_refused() -> None:
    data = _with("timing.train_s", 1e308)
    data["timing"]["commit_s"] = 1e308
    with pytest.raises(SpecError, match="^timing: the phases add up to a round longer than a float holds$"):
        parse_spec(data)


def test_large_finite_values_are_kept() -> None:
    spec = parse_spec(_with("aggregation.outer_lr", 1e300))
    assert spec.aggregation.outer_lr == 1e300 and len(spec.network_id) == 64

"""Subset evaluation: the physically pruned model at keep fractions, for the rule and for random choice."""

from __future__ import annotations

import pytest
import torch

from tests.training.conftest import FAMILIES, make_tiny
from tests.training.planted import A, U, documents, planted_domains, rows
from training.evaluate import heldout_loss
from training.selection import select_experts
from training.subset_eval import keep_count, parse_selection, random_keep, rule_keep, subset_report


@pytest.mark.parametrize("family", FAMILIES)
def test_keeping_every_expert_is_the_full_model(family: str) -> None:
    tiny = make_tiny(family)
    data = rows("prose", 4)
    selection = select_experts(tiny.model, tiny.adapter, data, "gate-mass", top_d=2)
    report = subset_report(tiny.model, tiny.adapter, selection, data, fractions=(0.25, 1.0), seeds=(0,))
    full = heldout_loss(tiny.model, data).loss
    assert report["full"] == full
    last = report["curve"][-1]
    assert last["kept"] == tiny.adapter.num_experts(tiny.model)
    assert last["rule"] == pytest.approx(full, rel=1e-6) and last["random"][0] == pytest.approx(full, rel=1e-6)
    assert report["curve"][0]["kept"] == 2 and report["curve"][0]["rule"] != pytest.approx(full, rel=1e-6)


def test_planted_group_beats_random_selection_at_a_quarter() -> None:
    model, adapter = planted_domains(harmful=True)
    selection = select_experts(model, adapter, documents("arithmetic", 5), "gate-mass", top_d=2)
    heldout = rows("arithmetic", 8, seed=99)
    report = subset_report(model, adapter, selection, heldout, fractions=(0.25, 1.0))
    quarter = report["curve"][0]
    assert quarter["kept"] == 2 and len(quarter["random"]) == 3
    assert quarter["rule"] < quarter["random_mean"] - 1.0
    assert quarter["rule"] <= min(quarter["random"]) + 1e-3
    assert report["group"]["experts"] == {"0": sorted([U, A]), "1": sorted([U, A])}
    assert report["group"]["loss"] == pytest.approx(quarter["rule"])
    assert report["without_group"] > report["full"] + 1.0


def test_keep_sets() -> None:
    assert [keep_count(f, 8) for f in (0.0625, 0.125, 0.25, 0.5, 1.0)] == [1, 1, 2, 4, 8]
    assert [keep_count(f, 64) for f in (0.0625, 0.125, 0.25, 0.5, 1.0)] == [4, 8, 16, 32, 64]
    for bad in (0.0, -0.5, 1.5):
        with pytest.raises(ValueError, match=r"keep fractions must be in \(0, 1\]"):
            keep_count(bad, 8)
    assert rule_keep({3: [0.1, 0.5, 0.2, 0.5]}, 2) == {3: [1, 3]}
    drawn = random_keep([0, 1], 8, 3, seed=7)
    assert drawn == random_keep([0, 1], 8, 3, seed=7) != random_keep([0, 1], 8, 3, seed=8)
    assert all(len(set(ids)) == 3 and all(0 <= e < 8 for e in ids) for ids in drawn.values())


def test_a_selection_for_another_model_is_refused() -> None:
    tiny = make_tiny("qwen3_moe")
    good = {"group": {"0": [1, 2]}, "stats": {"0": [0.1] * 8}}
    assert parse_selection(good, tiny.model, tiny.adapter) == ({0: [1, 2]}, {0: [0.1] * 8})
    cases = {
        "not an MoE layer of this model": {"group": {"5": [1]}, "stats": {"5": [0.1] * 8}},
        "scores 16 experts in layer 0": {"group": {"0": [1]}, "stats": {"0": [0.1] * 16}},
        "names experts this model does not have": {"group": {"0": [9]}, "stats": {"0": [0.1] * 8}},
        "expected 'group' and 'stats'": {"group": {"0": [1]}},
        "cover different layers": {"group": {"0": [1]}, "stats": {"0": [0.1] * 8, "1": [0.1] * 8}},
    }
    for message, selection in cases.items():
        with pytest.raises(ValueError, match=message):
            parse_selection(selection, tiny.model, tiny.adapter)
    with pytest.raises(ValueError, match="at least one keep fraction"):
        subset_report(tiny.model, tiny.adapter, good, torch.zeros(1, 4, dtype=torch.long), fractions=())

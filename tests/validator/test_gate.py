"""The merge gate: it adopts the candidate with the lowest gate loss (the current state on a tie), refuses
a candidate over the forgetting budget, and holds still when nothing was merged. Synthetic tensors and a
measure that reads losses from a table; no model is needed."""

from __future__ import annotations

import math
from collections.abc import Mapping

import pytest
import torch

from protocol.spec import NetworkSpec
from tests.validator.test_merge import Round, _global, _miners, _moved
from validator.merge import CANDIDATES, GateLoss, gate


def _round(spec: NetworkSpec) -> tuple[Round, str]:
    """A round in which two miners improve; the better (the best single submission) is returned with it."""
    a, b = _miners(2)
    glob = _global(spec)
    return Round(spec, {a: _moved(glob, 1), b: _moved(glob, 2)}, {a: 2.5, b: 2.0}), b


def _gated(spec: NetworkSpec, losses: Mapping[str, GateLoss]):
    """Gate the round's merge with a measure that knows each candidate by its tensors."""
    rnd, best = _round(spec)
    merged = rnd.merge()
    current = dict(rnd.head.tensors)
    by_state = {"current": current, "merged": merged.new_global, "best_single": rnd.blobs[best]}

    def measure(tensors: Mapping[str, torch.Tensor]) -> GateLoss:
        [name] = [n for n, held in by_state.items()
                  if all(torch.equal(tensors[k].float(), held[k].float()) for k in held)]
        return losses[name]

    return gate(merged, rnd.blobs, current, dict(rnd.head.momentum), spec, measure), merged, rnd, best


@pytest.mark.parametrize("lowest", CANDIDATES)
def test_the_gate_adopts_the_candidate_with_the_lowest_gate_loss(spec: NetworkSpec, lowest: str) -> None:
    losses = {name: GateLoss(2.0 if name == lowest else 2.5) for name in CANDIDATES}
    adoption, merged, rnd, best = _gated(spec, losses)

    assert adoption.adopted == lowest and adoption.losses == losses and adoption.refused == ()
    assert adoption.changed == (lowest != "current")
    if lowest == "merged":
        assert adoption.contributors == merged.contributors and adoption.new_global is merged.new_global
        assert adoption.new_momentum is merged.new_momentum
    elif lowest == "best_single":
        assert adoption.contributors == [best] and adoption.new_momentum == dict(rnd.head.momentum)
        assert all(torch.equal(adoption.new_global[k], rnd.blobs[best][k]) for k in rnd.blobs[best])
        assert all(t.dtype == torch.float32 for t in adoption.new_global.values())
    else:
        assert adoption.contributors == [] and adoption.new_global == dict(rnd.head.tensors)
    assert adoption.report() == {"adopted": lowest, "losses": {n: losses[n].loss for n in CANDIDATES},
                                 "general_losses": None, "refused": []}


def test_a_tie_keeps_the_current_state_and_a_non_finite_candidate_is_refused(spec: NetworkSpec) -> None:
    tie, _, _, _ = _gated(spec, {name: GateLoss(2.0) for name in CANDIDATES})
    assert tie.adopted == "current" and not tie.changed

    broken, _, _, _ = _gated(spec, {"current": GateLoss(2.0), "merged": GateLoss(math.nan),
                                    "best_single": GateLoss(1.9)})
    assert broken.adopted == "best_single" and broken.refused == ("merged",)


def test_a_candidate_over_the_forgetting_budget_is_refused(spec: NetworkSpec) -> None:
    budget = 0.1
    spec = spec.model_copy(update={"aggregation": spec.aggregation.model_copy(update={"forgetting_budget": budget})})
    losses = {"current": GateLoss(3.0, general=2.0),
              "merged": GateLoss(1.0, general=2.0 + 2 * budget),  # lowest on the target, forgets too much
              "best_single": GateLoss(1.5, general=2.0 + budget / 2)}
    adoption, _, _, best = _gated(spec, losses)

    assert adoption.adopted == "best_single" and adoption.refused == ("merged",)
    assert adoption.contributors == [best]
    assert adoption.report()["general_losses"] == {n: losses[n].general for n in CANDIDATES}

    everything_forgets = {name: GateLoss(1.0, general=2.0 + 2 * budget) for name in CANDIDATES[1:]}
    kept, _, _, _ = _gated(spec, {"current": GateLoss(3.0, general=2.0), **everything_forgets})
    assert kept.adopted == "current" and kept.refused == ("merged", "best_single") and not kept.changed


def test_without_a_forgetting_budget_general_losses_are_reported_and_refuse_nothing(spec: NetworkSpec) -> None:
    assert spec.aggregation.forgetting_budget is None
    losses = {"current": GateLoss(3.0, general=2.0), "merged": GateLoss(1.0, general=9.0),
              "best_single": GateLoss(1.5, general=2.1)}
    adoption, _, _, _ = _gated(spec, losses)
    assert adoption.adopted == "merged" and adoption.refused == ()
    assert adoption.report()["general_losses"] == {n: losses[n].general for n in CANDIDATES}


def test_a_round_that_merged_nothing_keeps_the_current_state_unmeasured(spec: NetworkSpec) -> None:
    rnd, _ = _round(spec)
    nothing = rnd.merge(blobs=rnd.blobs, reports={v: r.model_copy(update={"entries": ()})
                                                  for v, r in rnd.reports.items()})
    assert not nothing.changed

    def measure(tensors: Mapping[str, torch.Tensor]) -> GateLoss:
        raise AssertionError("nothing to weigh")

    tensors, momentum = dict(rnd.head.tensors), dict(rnd.head.momentum)
    adoption = gate(nothing, rnd.blobs, tensors, momentum, spec, measure)
    assert adoption.adopted == "current" and adoption.losses == {} and adoption.contributors == []
    assert adoption.new_global is tensors and adoption.new_momentum is momentum


def test_when_every_update_is_flagged_a_copy_the_gate_weighs_the_best_single_submission(spec: NetworkSpec) -> None:
    a, b = _miners(2)
    update = _moved(_global(spec), 1)
    rnd = Round(spec, {a: update, b: {name: t.clone() for name, t in update.items()}}, {a: 2.5, b: 2.0})
    merged = rnd.merge()
    assert not merged.changed and merged.duplicates == {a, b} and merged.best == b  # a copy: neither merged

    def measure(tensors: Mapping[str, torch.Tensor]) -> GateLoss:
        return GateLoss(2.0 if all(torch.equal(tensors[k], update[k]) for k in update) else 3.0)

    adoption = gate(merged, rnd.blobs, dict(rnd.head.tensors), dict(rnd.head.momentum), spec, measure)
    assert adoption.adopted == "best_single" and adoption.contributors == [b]
    assert adoption.losses == {"current": GateLoss(3.0), "best_single": GateLoss(2.0)}  # no merged state to weigh
    assert merged.points == {}  # the copies earn nothing

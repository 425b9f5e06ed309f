"""Merging a round: identical inputs give identical bytes, copiers are caught, and a round nobody
improves leaves the global state untouched. Uses synthetic expert tensors; no model is needed."""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Mapping

import pytest
import torch

from protocol.assignment import assign
from protocol.messages import ScoreEntry, ScoreReport
from protocol.ranking import NoCountedReports
from protocol.spec import NetworkSpec, parse_spec
from tests.conftest import MINER_OFFSET, make_identity, make_spec_dict
from training.outer import OuterConfig
from training.pgrad import chunk_draw, coverage, pgrad_config
from training.state import GlobalExperts
from validator.merge import MergeInputError, MissingBlobError, merge_round, outer_config

ROUND = 4
SEED = hashlib.sha256(b"round-seed").hexdigest()
BASE_LOSS = 3.0
SHAPES = {"gate_up_proj": (8, 8), "down_proj": (8, 4)}

Tensors = dict[str, torch.Tensor]


def _miners(n: int) -> list[str]:
    return [make_identity(MINER_OFFSET + i).node_id for i in range(n)]


def _global(spec: NetworkSpec) -> Tensors:
    g = torch.Generator().manual_seed(0)
    return {
        f"layers.{layer}.experts.{e}.{p}": torch.randn(shape, generator=g)
        for layer, experts in spec.group.items()
        for e in experts
        for p, shape in SHAPES.items()
    }


def _moved(tensors: Tensors, seed: int, scale: float = 0.05) -> Tensors:
    g = torch.Generator().manual_seed(seed)
    return {name: t - scale * torch.randn(t.shape, generator=g) for name, t in sorted(tensors.items())}


class Round:
    """One round's inputs: every validator reports `losses[miner]` for the miners assigned to it."""

    def __init__(self, spec: NetworkSpec, blobs: Mapping[str, Tensors], losses: Mapping[str, float]) -> None:
        self.spec = spec
        self.head = GlobalExperts.genesis(spec, _global(spec))
        self.blobs = dict(blobs)
        self.commitments = {m: hashlib.sha256(m.encode()).hexdigest() for m in blobs}
        validators = [v.key for v in spec.validators]
        self.assignment = assign(SEED, list(blobs), validators, spec.rewards.replication)
        self.reports = {
            v: ScoreReport(
                round=ROUND,
                base=self.head.hash,
                base_loss=BASE_LOSS,
                entries=tuple(
                    ScoreEntry(miner=m, commitment=self.commitments[m], loss=losses[m], verdict="accept")
                    for m in sorted(blobs)
                    if v in self.assignment[m]
                ),
            )
            for v in validators
        }

    def merge(
        self, reports: Mapping[str, ScoreReport] | None = None, blobs: Mapping[str, Tensors] | None = None
    ):
        return merge_round(
            reports if reports is not None else self.reports,
            self.assignment,
            self.commitments,
            self.blobs if blobs is None else blobs,
            dict(self.head.tensors),
            dict(self.head.momentum),
            self.spec,
            self.head.hash,
        )


def test_identical_inputs_give_byte_identical_state(spec: NetworkSpec) -> None:
    a, b, c = _miners(3)
    glob = _global(spec)
    rnd = Round(spec, {a: _moved(glob, 1), b: _moved(glob, 2), c: _moved(glob, 3)}, {a: 2.5, b: 2.0, c: 2.8})
    first = rnd.merge()
    twin = copy.deepcopy(rnd)
    second = twin.merge(reports=dict(reversed(list(twin.reports.items()))))

    assert first.contributors == [b, a, c] and first.ranking.ranked() == (b, a, c)
    assert first.points == {b: 1.0, a: 2 / 3, c: 1 / 3}
    states = [
        r.head.child(ROUND, res.new_global, res.new_momentum) for r, res in ((rnd, first), (twin, second))
    ]
    assert (
        states[0].to_blob() == states[1].to_blob() and states[0].momentum_blob() == states[1].momentum_blob()
    )
    assert states[0].hash != rnd.head.hash
    assert not all(torch.equal(first.new_global[n], glob[n]) for n in glob)


def test_top_g_limits_the_contributors(spec: NetworkSpec) -> None:
    narrow = spec.model_copy(update={"aggregation": spec.aggregation.model_copy(update={"top_g": 1})})
    a, b = _miners(2)
    glob = _global(spec)
    result = Round(narrow, {a: _moved(glob, 1), b: _moved(glob, 2)}, {a: 2.5, b: 2.0}).merge()
    assert result.contributors == [b] and set(result.points) == {a, b}


def test_near_duplicate_copier_is_neither_rewarded_nor_merged(spec: NetworkSpec) -> None:
    honest, copier, other = _miners(3)
    glob = _global(spec)
    trained = _moved(glob, 1)
    copied = {name: t + 1e-4 * torch.ones_like(t) for name, t in trained.items()}
    rnd = Round(
        spec,
        {honest: trained, copier: copied, other: _moved(glob, 2)},
        {honest: 2.0, copier: 2.0, other: 2.9},
    )
    result = rnd.merge()
    assert result.duplicates == {honest, copier}
    assert result.contributors == [other] and result.points == {other: 1.0}
    assert result.ranking.result(copier).reason == "near-duplicate"
    assert result.ranking.result(honest).reason == "near-duplicate"


def test_no_qualifying_miner_leaves_state_and_momentum_untouched(spec: NetworkSpec) -> None:
    worse, lazy, lazy_too = _miners(3)
    glob = _global(spec)
    rnd = Round(
        spec,
        {worse: _moved(glob, 1, scale=1.0), lazy: dict(glob), lazy_too: dict(glob)},
        {worse: 4.0, lazy: BASE_LOSS, lazy_too: BASE_LOSS},
    )
    global_tensors, momentum = dict(rnd.head.tensors), dict(rnd.head.momentum)
    result = merge_round(
        rnd.reports, rnd.assignment, rnd.commitments, rnd.blobs, global_tensors, momentum, spec, rnd.head.hash
    )
    assert not result.changed and result.contributors == [] and result.points == {}
    assert result.new_global is global_tensors and result.new_momentum is momentum
    assert result.duplicates == set()
    assert {r.reason for r in result.ranking.results} == {"no utility"}
    assert result.ranking.result(lazy).utility == 0.0


def test_reports_against_another_head_do_not_count(spec: NetworkSpec) -> None:
    a, b = _miners(2)
    glob = _global(spec)
    rnd = Round(spec, {a: _moved(glob, 1), b: _moved(glob, 2)}, {a: 2.5, b: 2.0})
    stale = {v: r.model_copy(update={"base": "ee" * 32}) for v, r in rnd.reports.items()}
    with pytest.raises(NoCountedReports, match="no score report"):
        rnd.merge(reports=stale)
    one_fresh = {**stale, spec.validators[0].key: rnd.reports[spec.validators[0].key]}
    result = rnd.merge(reports=one_fresh)
    counted = {m for m, vs in rnd.assignment.items() if spec.validators[0].key in vs}
    assert set(result.contributors) == counted


def test_missing_candidate_blob_is_named(spec: NetworkSpec) -> None:
    a, b, c = _miners(3)
    glob = _global(spec)
    rnd = Round(spec, {a: _moved(glob, 1), b: _moved(glob, 2), c: _moved(glob, 3)}, {a: 2.5, b: 2.0, c: 3.5})
    with pytest.raises(MissingBlobError) as info:
        rnd.merge(blobs={})
    assert info.value.miners == sorted([a, b])  # the candidates: a combined loss with positive utility
    first, second = sorted([a, b])
    assert str(info.value) == f"missing checked blobs for 2 candidate miner(s): {first[:12]}, {second[:12]}"
    with pytest.raises(MissingBlobError) as info:
        rnd.merge(blobs={a: rnd.blobs[a], c: rnd.blobs[c]})
    assert info.value.miners == [b]
    assert rnd.merge(blobs={a: rnd.blobs[a], b: rnd.blobs[b]}).contributors == [b, a]


def test_an_outer_step_that_would_overflow_fp32_is_not_taken(spec: NetworkSpec) -> None:
    steep = spec.model_copy(update={"aggregation": spec.aggregation.model_copy(update={"outer_lr": 8.0})})
    a, b = _miners(2)
    glob = _global(spec)
    huge = {name: torch.full_like(t, -3e38) for name, t in glob.items()}  # finite, as a checked blob must be
    rnd = Round(steep, {a: huge, b: _moved(glob, 2)}, {a: 2.0, b: 2.5})
    global_tensors, momentum = dict(rnd.head.tensors), dict(rnd.head.momentum)
    result = merge_round(rnd.reports, rnd.assignment, rnd.commitments, rnd.blobs, global_tensors, momentum,
                         steep, rnd.head.hash)
    assert result.ranking.ranked() == (a, b) and result.points == {a: 1.0, b: pytest.approx(2 / 3)}  # rewarded
    assert not result.changed and result.new_global is global_tensors and result.new_momentum is momentum


def test_an_overflow_in_one_entry_keeps_the_state_and_still_reports_the_duplicates(spec: NetworkSpec) -> None:
    steep = spec.model_copy(update={"aggregation": spec.aggregation.model_copy(update={"outer_lr": 8.0})})
    spiky, other, honest, copier = _miners(4)
    glob = _global(spec)
    name = sorted(glob)[0]
    spike = dict(glob)
    spike[name] = glob[name].clone()
    spike[name][0, 0] = -3e38  # one finite entry the outer step would take to -inf; every other entry stays finite
    trained = _moved(glob, 2)
    copied = {n: t + 1e-4 * torch.ones_like(t) for n, t in trained.items()}
    blobs = {spiky: spike, other: _moved(glob, 3), honest: trained, copier: copied}
    rnd = Round(steep, blobs, {spiky: 2.0, other: 2.2, honest: 2.5, copier: 2.5})
    global_tensors, momentum = dict(rnd.head.tensors), dict(rnd.head.momentum)
    result = merge_round(rnd.reports, rnd.assignment, rnd.commitments, rnd.blobs, global_tensors, momentum,
                         steep, rnd.head.hash)
    assert result.ranking.ranked() == (spiky, other)
    assert result.points == {spiky: 1.0, other: pytest.approx(2 / 3)}
    assert not result.changed and result.new_global is global_tensors and result.new_momentum is momentum
    assert result.duplicates == {honest, copier}


def test_outer_config_takes_every_aggregation_setting_from_the_spec() -> None:
    for clip in (False, True):
        aggregation = {"outer_lr": 0.7, "momentum": 0.9, "clip_to_median": clip, "weighting": "utility"}
        spec = parse_spec({**make_spec_dict(), "aggregation": aggregation})
        assert outer_config(spec) == OuterConfig(lr=0.7, momentum=0.9, clip_to_median=clip, weighting="utility")


@pytest.mark.parametrize("momentum", [0.0, 0.5])
def test_a_lone_contributors_merged_state_is_its_submission_byte_for_byte(spec: NetworkSpec, momentum: float) -> None:
    spec = spec.model_copy(update={"aggregation": spec.aggregation.model_copy(update={"momentum": momentum})})
    assert spec.aggregation.outer_lr > 1
    (a,) = _miners(1)
    glob = _global(spec)
    submission = {name: t.to(torch.bfloat16) for name, t in _moved(glob, 1).items()}
    rnd = Round(spec, {a: submission}, {a: 2.0})
    before = dict(rnd.head.momentum)
    alone = merge_round(rnd.reports, rnd.assignment, rnd.commitments, rnd.blobs, dict(rnd.head.tensors), before,
                        spec, rnd.head.hash)
    assert alone.contributors == [a] and alone.best == a and alone.changed
    assert list(alone.new_global) == sorted(glob) and alone.new_momentum is before  # the momentum stays
    for name in glob:  # not a step a rounding away from it: one state, whatever arithmetic a validator has
        assert alone.new_global[name].dtype == torch.float32
        assert torch.equal(alone.new_global[name], submission[name].float())


def test_two_updates_are_averaged_and_taken_outer_lr_times(spec: NetworkSpec) -> None:
    a, b = _miners(2)
    glob = _global(spec)
    unclipped = spec.model_copy(update={"aggregation": spec.aggregation.model_copy(update={"clip_to_median": False})})
    pair = Round(unclipped, {a: _moved(glob, 1), b: _moved(glob, 2)}, {a: 2.0, b: 2.5}).merge()
    assert sorted(pair.contributors) == sorted([a, b])
    for name, t in glob.items():  # two updates: their average taken outer_lr times
        mean = ((t - _moved(glob, 1)[name]) + (t - _moved(glob, 2)[name])) / 2
        torch.testing.assert_close(pair.new_global[name], t - spec.aggregation.outer_lr * mean, rtol=0, atol=1e-6)


def _partitioned(**aggregation: object) -> NetworkSpec:
    submission = {"format": "pgrad", "chunk": 32, "topk": 4, "quant": "int8", "partitions": 2}
    return parse_spec({**make_spec_dict(), "submission": submission, "aggregation": aggregation})


def test_a_partitioned_round_averages_each_chunk_over_the_miners_that_drew_it() -> None:
    spec = _partitioned(clip_to_median=False)
    cfg = pgrad_config(spec)
    assert cfg is not None
    miners = _miners(3)
    glob = _global(spec)
    shapes = {name: tuple(t.shape) for name, t in glob.items()}
    masks = {m: coverage(shapes, cfg, chunk_draw(spec.network_id, ROUND, m))
             for m in miners}
    entries = {m: {name: masks[m][name].repeat_interleave(t.numel() // masks[m][name].numel()).reshape(t.shape)
                   for name, t in glob.items()} for m in miners}
    g = torch.Generator().manual_seed(11)
    grads = {m: {name: 0.05 * torch.randn(t.shape, generator=g) * entries[m][name] for name, t in glob.items()}
             for m in miners}  # a rebuilt partitioned submission is 0 off the chunks its miner drew
    rnd = Round(spec, {m: {n: glob[n] - grads[m][n] for n in glob} for m in miners}, dict.fromkeys(miners, 2.5))
    result = rnd.merge()
    assert sorted(result.contributors) == sorted(miners)
    covered = {name: sum(entries[m][name] for m in miners) for name in glob}
    assert any(bool(((c > 0) & (c < len(miners))).any()) for c in covered.values())  # the draws differ
    for name, t in glob.items():
        total = sum(grads[m][name] for m in miners)
        mean = torch.where(covered[name] > 0, total / covered[name].clamp(min=1), torch.zeros_like(t))
        torch.testing.assert_close(result.new_global[name], t - spec.aggregation.outer_lr * mean, rtol=0, atol=1e-6)


def test_reports_of_different_rounds_cannot_be_merged_in_a_partitioned_network() -> None:
    spec = _partitioned()
    a, b = _miners(2)
    glob = _global(spec)
    rnd = Round(spec, {a: _moved(glob, 1), b: _moved(glob, 2)}, {a: 2.5, b: 2.0})
    first = spec.validators[0].key
    mixed = {**rnd.reports, first: rnd.reports[first].model_copy(update={"round": ROUND + 1})}
    with pytest.raises(MergeInputError, match=rf"score reports of rounds \[{ROUND}, {ROUND + 1}\] cannot be merged"):
        rnd.merge(reports=mixed)


def test_the_outer_step_carries_the_previous_momentum(spec: NetworkSpec) -> None:
    nesterov = spec.model_copy(update={"aggregation": spec.aggregation.model_copy(
        update={"momentum": 0.5, "clip_to_median": False})})
    a, b = _miners(2)
    glob = _global(spec)
    rnd = Round(nesterov, {a: _moved(glob, 1), b: _moved(glob, 2)}, {a: 2.0, b: 2.5})
    previous = {name: torch.full_like(t, 0.25) for name, t in glob.items()}
    result = merge_round(rnd.reports, rnd.assignment, rnd.commitments, rnd.blobs, dict(rnd.head.tensors),
                         previous, nesterov, rnd.head.hash)
    assert sorted(result.contributors) == sorted([a, b])
    lr = nesterov.aggregation.outer_lr
    for name, t in glob.items():
        g = ((t - rnd.blobs[a][name]) + (t - rnd.blobs[b][name])) / 2
        m = 0.5 * previous[name] + g
        torch.testing.assert_close(result.new_momentum[name], m, rtol=0, atol=1e-6)
        torch.testing.assert_close(result.new_global[name], t - lr * (g + 0.5 * m), rtol=0, atol=1e-6)

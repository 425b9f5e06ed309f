"""Ranking, points and standing against hand-computed cases."""

from __future__ import annotations

import pytest

from protocol.messages import ScoreEntry, ScoreReport
from protocol.ranking import Refused, median, rank_points, rank_round, scores_from_report, update_standing


def mid(n: int) -> str:
    return f"{n:02x}" * 32


V1, V2, V3 = "a1" * 32, "a2" * 32, "a3" * 32
M1, M2, M3, M4, M5, M6, M7, M8 = (mid(n) for n in range(1, 9))
ASSIGNMENT = {
    M1: (V1, V2),
    M2: (V1, V3),
    M3: (V2, V3),
    M4: (V1, V2),
    M5: (V2,),
    M6: (V1, V3),
    M7: (V1,),
    M8: (V1, V2, V3),
}
COMMITMENTS = {m: mid(0x10 + i) for i, m in enumerate(ASSIGNMENT)}
COMMITMENTS[M1] = "ff" * 32  # M1 and M2 tie on loss; M2's smaller commitment ranks first
COMMITMENTS[M2] = "01" * 32
REPORTS = {
    V1: {M1: 2.0, M2: 2.2, M4: Refused("hash mismatch"), M7: 1.5, M8: 1.0},
    V2: {M1: 2.4, M3: 2.5, M4: 1.0, M5: 3.5, M8: 1.2},
    V3: {M2: 2.2, M3: None, M5: 0.1, M8: Refused("non-finite values")},
}
BASE = {V1: 3.0, V2: 3.0, V3: 3.0}


def test_hand_computed_round() -> None:
    ranking = rank_round(REPORTS, ASSIGNMENT, BASE, COMMITMENTS, {M7}, top_k=3)
    got = {r.miner: (r.loss, r.rank, r.points, r.reason) for r in ranking.results}
    assert got[M8] == (pytest.approx(1.1), 1, 1.0, "")
    assert got[M2] == (pytest.approx(2.2), 2, pytest.approx(2 / 3), "")
    assert got[M1] == (pytest.approx(2.2), 3, pytest.approx(1 / 3), "")
    assert got[M3] == (2.5, 4, 0.0, "not ranked in top-K")
    assert got[M4] == (None, None, 0.0, "rejected: hash mismatch")
    assert got[M5] == (3.5, None, 0.0, "no utility")  # V3 is not assigned to M5: its 0.1 is ignored
    assert got[M6] == (None, None, 0.0, "unscored")
    assert got[M7] == (1.5, None, 0.0, "near-duplicate")
    assert ranking.ranked() == (M8, M2, M1, M3)
    assert ranking.points() == {M8: 1.0, M2: pytest.approx(2 / 3), M1: pytest.approx(1 / 3)}
    assert ranking.result(M8).utility == pytest.approx(1.9)
    assert ranking.result(M5).utility == 0.0
    with pytest.raises(KeyError):
        ranking.result("ff" * 32)  # a miner the round did not assign has no result
    assert [r.miner for r in ranking.results][:4] == [M8, M2, M1, M3]


def test_loss_equal_to_base_has_no_utility() -> None:
    ranking = rank_round({V1: {M1: 3.0}}, {M1: (V1,)}, {V1: 3.0}, {M1: "aa" * 32}, set(), top_k=1)
    assert ranking.result(M1).reason == "no utility" and ranking.points() == {}


def test_rejection_needs_half_the_verdicts() -> None:
    reports = {V1: {M1: Refused("bad header")}, V2: {M1: 1.0}, V3: {M1: 2.0}}
    one_of_three = rank_round(reports, {M1: (V1, V2, V3)}, BASE, {M1: "aa" * 32}, set(), top_k=1)
    assert one_of_three.result(M1).loss == 1.5
    two_of_three = rank_round(
        {**reports, V3: {M1: Refused("dtype")}}, {M1: (V1, V2, V3)}, BASE, {M1: "aa" * 32}, set(), top_k=1
    )
    assert two_of_three.result(M1).reason == "rejected: bad header"


def test_a_miner_that_sent_the_head_back_has_no_utility_where_validators_base_losses_differ() -> None:
    # Each validator measures the unchanged head exactly at its own base loss; theirs differ in the last bits
    # (other hardware, another batch size), and the median base is above one of them.
    base = {V1: 3.0000001, V2: 3.0, V3: 3.0000002}
    lazy = {v: {M1: loss} for v, loss in base.items()}
    ranking = rank_round(lazy, {M1: (V2,)}, base, {M1: "aa" * 32}, set(), top_k=1)
    assert ranking.base_loss == 3.0000001  # the median, shown as the round's base
    assert ranking.result(M1).utility == 0.0 and ranking.result(M1).reason == "no utility"
    trained = {V1: {M1: 2.5000001}, V2: {M1: 2.4}, V3: {M1: 2.6}}  # gains 0.5, 0.6 and 0.4000002
    ranking = rank_round(trained, {M1: (V1, V2, V3)}, base, {M1: "aa" * 32}, set(), top_k=1)
    assert ranking.result(M1).utility == pytest.approx(0.5) and ranking.result(M1).loss == 2.5000001


def test_bad_inputs() -> None:
    with pytest.raises(ValueError, match="no commitment"):
        rank_round({}, {M1: (V1,)}, {}, {}, set(), top_k=1)
    with pytest.raises(ValueError, match="base loss must be a finite"):
        rank_round({}, {}, {V1: float("nan")}, {}, set(), top_k=1)
    with pytest.raises(ValueError, match="base loss must be a finite non-negative number, got -1.0"):
        rank_round({}, {}, {V1: -1.0}, {}, set(), top_k=1)
    assert rank_round({}, {}, {V1: 0.0}, {}, set(), top_k=1).base_loss == 0.0  # non-negative: zero is a loss
    with pytest.raises(ValueError, match="no base loss for validator"):
        rank_round({V1: {M1: 2.0}}, {M1: (V1,)}, {}, {M1: "aa" * 32}, set(), top_k=1)
    with pytest.raises(ValueError, match="non-finite"):
        rank_round({V1: {M1: float("inf")}}, {M1: (V1,)}, {V1: 3.0}, {M1: "aa" * 32}, set(), top_k=1)
    with pytest.raises(ValueError, match="top_k must be >= 1, got 0"):
        rank_round({}, {}, {V1: 3.0}, {}, set(), top_k=0)  # refused even when no miner would be ranked


def test_scores_from_report() -> None:
    entries = (
        ScoreEntry(miner=M1, commitment=COMMITMENTS[M1], loss=2.0, verdict="accept"),
        ScoreEntry(miner=M2, commitment=COMMITMENTS[M2], verdict="reject", reason="bad dtype"),
        ScoreEntry(miner=M3, commitment=COMMITMENTS[M3], verdict="missing"),
        ScoreEntry(miner=M4, commitment="ee" * 32, loss=0.5, verdict="accept"),
    )
    report = ScoreReport(round=1, base="bb" * 32, base_loss=3.0, entries=entries)
    assert scores_from_report(report, COMMITMENTS) == {M1: 2.0, M2: Refused("bad dtype"), M3: None}


def test_median_and_points() -> None:
    assert median([3.0, 1.0, 2.0]) == 2.0
    assert median([4.0, 1.0, 3.0, 2.0]) == 2.5
    with pytest.raises(ValueError, match="median of no values"):
        median([])
    assert [rank_points(k, 4) for k in range(0, 6)] == [0.0, 1.0, 0.75, 0.5, 0.25, 0.0]
    with pytest.raises(ValueError, match="top_k must be >= 1, got 0"):
        rank_points(1, 0)


def test_update_standing_ema() -> None:
    standing = update_standing({"a": 1.0, "b": 0.5, "gone": 1e-9}, {"b": 1.0, "c": 0.5}, alpha=0.5)
    assert standing == {"a": 0.5, "b": 0.75, "c": 0.25}
    decayed = {"a": 1.0}
    for _ in range(3):
        decayed = update_standing(decayed, {}, alpha=0.5)
    assert decayed == {"a": 0.125}
    assert update_standing({"at": 2e-9}, {}, alpha=0.5) == {"at": 1e-9}  # exactly the floor stays
    assert update_standing({"a": 1.0}, {"b": 1.0}, alpha=1) == {"b": 1.0}  # alpha 1 keeps only this round
    with pytest.raises(ValueError, match="alpha"):
        update_standing({}, {}, alpha=0)

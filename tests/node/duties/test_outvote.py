"""Where validators holding a majority of weight adopted another state than this validator's merge gate picked,
its round report says so (`node.duties.report.outvote`): its candidate, the majority's, how it measured here."""

from __future__ import annotations

from node.duties.report import outvote
from node.store.records import GlobalStateRecord

A, B, C = "aa" * 32, "bb" * 32, "cc" * 32
GATE = {"adopted": "merged", "losses": {"current": 3.0, "merged": 2.5, "best_single": 2.49999},
        "holders": {"current": [], "merged": [A, B], "best_single": [B]}}
MARGIN = 1e-4


def _state(hash: str, contributors: tuple[str, ...]) -> GlobalStateRecord:
    return GlobalStateRecord(hash, "ee" * 32, 3, contributors, True, ("v1", "v2"))


def test_the_network_adopting_our_proposal_is_no_outvote() -> None:
    assert outvote(GATE, "11" * 32, _state("11" * 32, (A, B)), MARGIN) is None


def test_another_candidate_adopted_by_the_majority_is_named_with_how_it_measured_here() -> None:
    note = outvote(GATE, "11" * 32, _state("22" * 32, (B,)), MARGIN)
    assert note is not None and note["mine"] == "merged" and note["majority"] == "best_single"
    assert note["state"] == "22" * 32 and note["margin"] == MARGIN
    assert abs(note["gain"] - 1e-5) < 1e-12  # the majority's candidate measured 1e-5 nats lower here


def test_a_state_none_of_our_candidates_holds_is_another_one() -> None:
    note = outvote(GATE, "11" * 32, _state("33" * 32, (C,)), MARGIN)
    assert note is not None and note["majority"] == "another" and note["gain"] is None


def test_keeping_the_current_state_while_the_majority_moved_is_an_outvote() -> None:
    kept = {**GATE, "adopted": "current"}
    note = outvote(kept, None, _state("22" * 32, (A, B)), MARGIN)
    assert note is not None and (note["mine"], note["majority"]) == ("current", "merged")
    assert abs(note["gain"] - 0.5) < 1e-12


def test_a_validator_that_picked_a_change_but_proposed_nothing_lost_no_vote() -> None:
    """Out of sync with the momentum, or a disk too full to store the state: it abstained, it was not outvoted."""
    assert outvote(GATE, None, _state("22" * 32, (B,)), MARGIN) is None

"""Successor documents as pure rules: signing by the predecessor's validators, each refusal in one line, and the
successor spec every node derives from the predecessor, the document and the base state."""

from __future__ import annotations

import copy

import pytest

from protocol.spec import NetworkSpec, SpecError, parse_spec
from protocol.successor import (
    GRACE_ROUNDS,
    Selection,
    Signature,
    SuccessorDocument,
    decode_document,
    draft,
    judge_document,
    judge_successor_spec,
    missing_experts,
    parse_document,
    signing_bytes,
    spec_from_bytes,
    successor_spec,
)
from tests.conftest import make_identity

EXPERTS = {0: 8, 1: 8}  # the model's MoE layers and experts per layer
BASE = "e1" * 32


@pytest.fixture
def predecessor(spec_dict: dict[str, object]) -> NetworkSpec:
    return parse_spec(spec_dict)


def signed(spec: NetworkSpec, *validators: int, activation: int = 5) -> SuccessorDocument:
    document = draft(spec, activation, {0: [2, 4], 1: [5]}, {"data": {"train": ["b.txt"]}},
                     Selection(rule="gate-mass"))
    for i in validators:
        document = document.signed_by(make_identity(i))
    return document


def test_a_document_signed_by_a_weight_majority_is_sound(predecessor: NetworkSpec) -> None:
    document = signed(predecessor, 0, 2)
    assert judge_document(document, predecessor, 1, EXPERTS) is None
    assert document.predecessor == predecessor.network_id and document.data.train == ["b.txt"]
    assert document.training == predecessor.training  # sections not changed are the predecessor's, written out


@pytest.mark.parametrize(("validators", "round", "expected"), [
    ((0,), 1, "signed by 1 of 3 validators (weight 1 of 3); it needs validators holding more than half the weight"),
    ((), 1, "signed by 0 of 3 validators"),
    ((0, 1), 5, "its activation round 5 has already begun (round 5 is in progress)"),
    ((0, 1), 9, "its activation round 5 has already begun (round 9 is in progress)"),
    ((0, 1), 4, f"its activation round 5 is too soon: it must be at least {GRACE_ROUNDS} rounds after the round in "
                "progress (4)"),
])
def test_too_few_signers_and_a_past_or_too_early_activation_are_refused(
        predecessor: NetworkSpec, validators: tuple[int, ...], round: int, expected: str) -> None:
    reason = judge_document(signed(predecessor, *validators), predecessor, round, EXPERTS)
    assert reason is not None and reason.startswith(expected) and "\n" not in reason


def test_a_document_naming_another_predecessor_is_refused(predecessor: NetworkSpec, spec_dict: dict) -> None:
    other = parse_spec({**copy.deepcopy(spec_dict), "name": "othernet"})
    reason = judge_document(signed(other, 0, 1, 2), predecessor, 1, EXPERTS)
    assert reason == (f"it names predecessor {other.network_id[:16]}..., but this network runs spec "
                      f"{predecessor.network_id[:16]}...")


@pytest.mark.parametrize(("group", "expected"), [
    ({0: [2, 8]}, "group layer 0: experts [8] do not exist (the model has 8)"),
    ({3: [1]}, "group layer 3 is not an MoE layer of the model (MoE layers: [0, 1])"),
])
def test_experts_the_model_lacks_are_refused(predecessor: NetworkSpec, group: dict, expected: str) -> None:
    document = draft(predecessor, 5, group).signed_by(make_identity(0)).signed_by(make_identity(1))
    assert judge_document(document, predecessor, 1, EXPERTS) == expected
    assert missing_experts(group, EXPERTS) == expected


def test_signatures_from_outside_the_set_twice_or_not_over_this_body_are_refused(predecessor: NetworkSpec) -> None:
    outsider = signed(predecessor, 0, 1).signed_by(make_identity(7))
    assert "which is not a validator of the predecessor" in str(judge_document(outsider, predecessor, 1, EXPERTS))
    document = signed(predecessor, 0, 1)
    twice = document.model_copy(update={"signatures": [*document.signatures, document.signatures[0]]})
    assert "signed twice by validator" in str(judge_document(twice, predecessor, 1, EXPERTS))
    moved = document.model_copy(update={"activation": 6})  # the signatures are over activation 5
    assert "does not verify" in str(judge_document(moved, predecessor, 1, EXPERTS))


def test_a_signature_is_over_a_tagged_hash_no_envelope_can_carry(predecessor: NetworkSpec) -> None:
    document = signed(predecessor, 0)
    message = signing_bytes(document.hash)
    assert message.startswith(b"tessera-successor/1\x00") and not message.startswith(b"{")
    untagged = make_identity(1).sign(bytes.fromhex(document.hash))  # the hash alone: not what validators sign
    forged = document.model_copy(update={"signatures": [
        *document.signatures, Signature(validator=make_identity(1).node_id, signature=untagged.hex())]})
    assert "does not verify" in str(judge_document(forged, predecessor, 1, EXPERTS))


def test_a_document_travels_as_canonical_bytes_and_nothing_else_decodes(predecessor: NetworkSpec) -> None:
    document = signed(predecessor, 0, 1)
    data = document.to_bytes()
    assert decode_document(data) == document
    with pytest.raises(SpecError, match="canonical"):
        decode_document(data.replace(b",", b", ", 1))
    with pytest.raises(SpecError, match="timing"):  # a successor cannot change the network's clock
        parse_document({**document.body(), "timing": {"train_s": 1.0}})
    with pytest.raises(SpecError, match="not a JSON document"):
        decode_document(b"\xff")


def test_the_successor_spec_binds_its_base_and_inherits_the_predecessors_state(predecessor: NetworkSpec) -> None:
    document = signed(predecessor, 0, 1)
    spec = successor_spec(predecessor, document, BASE)
    assert spec.group == {0: [2, 4], 1: [5]} and spec.data.train == ["b.txt"]
    assert spec.timing == predecessor.timing and spec.validators == predecessor.validators
    assert spec.lineage is not None and spec.lineage.inherits == [BASE] and spec.first_round == 5
    assert (spec.root, spec.gossip_id) == (BASE, predecessor.network_id)
    assert successor_spec(predecessor, document, "e2" * 32).network_id != spec.network_id  # the id binds the base
    untrained = successor_spec(predecessor, document, predecessor.root)  # nothing adopted: nothing inherited
    assert untrained.lineage is not None and untrained.lineage.inherits == []
    assert spec_from_bytes(spec.canonical_bytes()) == spec
    assert judge_successor_spec(spec, predecessor) is None
    third = successor_spec(spec, draft(spec, 9, {1: [7]}), "e3" * 32)  # the states of every earlier spec go in
    assert third.lineage is not None and third.lineage.inherits == [BASE, "e3" * 32]
    assert third.gossip_id == predecessor.network_id and judge_successor_spec(third, spec) is None


def test_a_fetched_successor_spec_that_changes_what_cannot_change_is_refused(predecessor: NetworkSpec) -> None:
    spec = successor_spec(predecessor, signed(predecessor, 0, 1), BASE)
    retimed = spec.model_copy(update={"timing": spec.timing.model_copy(update={"train_s": 31.0})})
    assert "cannot" in str(judge_successor_spec(retimed, predecessor))
    assert spec.lineage is not None
    for changes, expected in [
        ({"inherits": []}, "it inherits other states than its predecessor's and its base"),
        ({"predecessor": "ff" * 32}, f"it does not succeed spec {predecessor.network_id[:16]}..."),
        ({"activation": 0}, "its lineage does not continue its predecessor's"),
    ]:
        changed = spec.model_copy(update={"lineage": spec.lineage.model_copy(update=changes)})
        assert judge_successor_spec(changed, predecessor) == expected
    assert judge_successor_spec(predecessor, predecessor) is not None  # a genesis spec succeeds nothing

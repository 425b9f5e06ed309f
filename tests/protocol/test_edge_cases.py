"""Edge cases where a peer's input or a legal-looking spec made nodes disagree, crash or trust a forgery:
weak Ed25519 keys, a float body written as an integer, phases below a timestamp's resolution, validator
weights that overflow, a layer named twice, and the median of huge losses."""

from __future__ import annotations

import copy
import hashlib
import math
from typing import Any

import pytest

from protocol.check import CheckContext, Verdict, check_bytes
from protocol.encoding import canonical_json
from protocol.identity import Identity, is_weak_key, verify
from protocol.messages import Commit, DecodeError, ScoreEntry, ScoreReport, decode_envelope, seal
from protocol.ranking import median
from protocol.rounds import Schedule
from protocol.spec import SpecError, parse_spec
from tests.conftest import make_spec_dict

IDENTITY_POINT = "01" + "00" * 31
"""The neutral element's encoding: with it as the key and as R, and S = 0, OpenSSL verifies any message."""
FORGED = bytes.fromhex(IDENTITY_POINT + "00" * 32)
NETWORK = "cd" * 32


def _forged_commit(round: int = 0) -> bytes:
    body = Commit(round=round, commitment="ab" * 32).model_dump(mode="json", exclude={"kind"})
    envelope = {"body": body, "kind": "commit", "network": NETWORK, "round": round, "sender": IDENTITY_POINT,
                "signature": FORGED.hex()}
    return canonical_json(envelope)


@pytest.mark.parametrize("message", [b"", b"commit", hashlib.sha256(b"any").digest()])
def test_the_identity_point_signs_nothing(message: bytes) -> None:
    assert not verify(IDENTITY_POINT, message, FORGED)


def test_a_forged_envelope_from_a_small_order_sender_is_rejected() -> None:
    schedule = Schedule(0.0, train_s=30, commit_s=5, reveal_s=10, evaluate_s=10, merge_s=5)
    ctx = CheckContext(network_id=NETWORK, validators={}, schedule=schedule, now=31.0)
    result, _ = check_bytes(_forged_commit(), ctx, 65536)
    assert result.verdict is Verdict.REJECT and result.reason == "bad signature"


@pytest.mark.parametrize("key", [
    "00" * 32, IDENTITY_POINT, "00" * 31 + "80", "01" + "00" * 30 + "80", "ec" + "ff" * 30 + "7f",
    "ed" + "ff" * 30 + "7f", "ee" + "ff" * 30 + "ff", "f0" + "ff" * 31,
    "26e8958fc2b227b045c3f489f2ef98f0d5dfac05d3c63339b13802886d53fc05",
    "c7176a703d4dd84fba3c0b760d10670f2a2053fa2c39ccc64ec7fd7792ac03fa",
])
def test_small_order_and_non_canonical_keys_are_weak(key: str) -> None:
    assert is_weak_key(bytes.fromhex(key))


def test_generated_keys_are_not_weak_and_still_verify() -> None:
    for i in range(64):
        identity = Identity.from_seed(hashlib.sha256(i.to_bytes(4, "big")).digest())
        signature = identity.sign(b"message %d" % i)
        assert not is_weak_key(bytes.fromhex(identity.node_id))
        assert verify(identity.node_id, b"message %d" % i, signature)
        assert not verify(identity.node_id, b"another", signature)


def test_a_spec_refuses_a_weak_validator_key() -> None:
    data = make_spec_dict()
    data["validators"][0]["key"] = IDENTITY_POINT
    with pytest.raises(SpecError, match="^validators.0.key: not a usable Ed25519 public key"):
        parse_spec(data)


def test_a_float_written_as_an_integer_is_not_a_second_encoding() -> None:
    identity = Identity.from_seed(b"\x05" * 32)
    entry = ScoreEntry(miner="aa" * 32, commitment="bb" * 32, loss=3.0, verdict="accept")
    report = ScoreReport(round=1, base="cc" * 32, base_loss=2.0, entries=(entry,))
    data = seal(report, NETWORK, identity).to_bytes()
    assert decode_envelope(data, 65536).message() == report
    for written in ([b'"base_loss":2.0', b'"base_loss":2'], [b'"loss":3.0', b'"loss":3']):
        other = data.replace(*written)
        envelope = decode_envelope(other, 65536)  # the bytes are canonical JSON of what they hold
        with pytest.raises(DecodeError, match="not in canonical form"):
            envelope.message()


def test_a_body_without_an_optional_field_still_decodes() -> None:
    """Older senders leave out fields added since (GlobalState.momentum, ScoreEntry.reason)."""
    identity = Identity.from_seed(b"\x06" * 32)
    report = ScoreReport(round=1, base="cc" * 32, base_loss=2.5, entries=(
        ScoreEntry(miner="aa" * 32, commitment="bb" * 32, verdict="missing"),))
    data = seal(report, NETWORK, identity).to_bytes().replace(b',"reason":""', b"")
    assert decode_envelope(data, 65536).message() == report


def _timing(length: float) -> dict[str, Any]:
    data = make_spec_dict()
    data["timing"] = {name: length for name in ("train_s", "commit_s", "reveal_s", "evaluate_s", "merge_s")}
    return data


def test_phases_below_a_timestamps_resolution_are_refused() -> None:
    with pytest.raises(SpecError, match="^timing.train_s: Input should be greater than or equal to 0.001$"):
        parse_spec(_timing(1e-9))
    with pytest.raises(ValueError, match="commit phase length must be at least"):
        Schedule(1.7e9, train_s=1, commit_s=1e-9, reveal_s=1, evaluate_s=1, merge_s=1)


def test_the_shortest_phases_still_tile_time() -> None:
    schedule = Schedule.from_spec(parse_spec(_timing(0.001)))
    for k in range(2000):
        t = schedule.genesis_ts + k * 1234.5678901
        r, phase = schedule.phase_at(t)
        start, end = schedule.phase_window(r, phase)
        assert start <= t < end


def test_validator_weights_that_add_up_past_a_float_are_refused() -> None:
    data = make_spec_dict()
    for v in data["validators"]:
        v["weight"] = 1e308
    with pytest.raises(SpecError, match="^validators: the validators' weights add up to more than a float holds$"):
        parse_spec(data)
    data["validators"] = data["validators"][:1]  # one is enough: a vote compares 2 * 1e308 with the total
    with pytest.raises(SpecError, match="^validators: the validators' weights add up"):
        parse_spec(copy.deepcopy(data))
    data["validators"][0]["weight"] = 8e307
    assert parse_spec(data).total_validator_weight == 8e307


def test_a_layer_given_twice_is_refused_not_merged() -> None:
    data = make_spec_dict()
    data["group"] = {"1": [0, 1], "01": [2, 3]}
    with pytest.raises(SpecError, match="^group: layer 1 is given twice"):
        parse_spec(data)


def test_the_median_of_huge_finite_losses_is_finite() -> None:
    assert median([1.7e308, 1.7e308]) == 1.7e308
    assert median([-1.7e308, -1.7e308]) == -1.7e308
    assert median([0.1, 0.7]) == (0.1 + 0.7) / 2  # the ordinary case is computed as it always was
    # Halving first only when the sum overflowed: halving the smallest subnormals first would round them to 0.
    assert median([5e-324, 5e-324]) == 5e-324
    assert math.isinf(median([math.inf, 1.0]))

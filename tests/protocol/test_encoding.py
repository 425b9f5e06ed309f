"""Canonical encoding, envelopes and the byte-level integrity of signed messages."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.check import CheckContext, Verdict, check_bytes
from protocol.encoding import canonical_json, is_hex_digest, sha256_hex
from protocol.identity import Identity
from protocol.messages import (
    MESSAGE_TYPES,
    VALIDATOR_KINDS,
    DecodeError,
    ScoreEntry,
    ScoreReport,
    decode_envelope,
    seal,
)
from protocol.rounds import Phase, Schedule

H = "ab" * 32
SIGNER = Identity.from_seed(bytes(range(32)))
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4),
    max_leaves=20,
)


def test_canonical_json_bytes() -> None:
    expected = '{"a":[1.5,"é",null,true],"b":1}'.encode()
    assert canonical_json({"b": 1, "a": [1.5, "é", None, True]}) == expected
    with pytest.raises(ValueError):
        canonical_json({"x": float("nan")})
    assert sha256_hex(b"") == "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
    assert is_hex_digest(H) and not is_hex_digest(H.upper()) and not is_hex_digest(H[:-2])


@given(json_values)
def test_canonical_json_is_stable(value: object) -> None:
    import json

    encoded = canonical_json(value)
    assert canonical_json(json.loads(encoded)) == encoded


def report(loss: float) -> ScoreReport:
    entry = ScoreEntry(miner=H, commitment=H, loss=loss, verdict="accept")
    return ScoreReport(round=3, base=H, base_loss=4.25, entries=(entry,))


@given(st.floats(min_value=0, max_value=1e30, allow_nan=False, allow_infinity=False))
@settings(max_examples=50)
def test_envelope_round_trips_byte_for_byte(loss: float) -> None:
    env = seal(report(loss), "11" * 32, SIGNER)
    data = env.to_bytes()
    decoded = decode_envelope(data, 65536)
    assert decoded == env and decoded.to_bytes() == data
    assert decoded.message() == report(loss)
    assert decoded.signature_ok()
    # Ed25519 is deterministic: sealing again gives the same bytes.
    assert seal(report(loss), "11" * 32, SIGNER).to_bytes() == data


def test_message_kinds_and_entry_consistency() -> None:
    assert set(MESSAGE_TYPES) == {
        "seed_commit",
        "seed_reveal",
        "commit",
        "reveal",
        "score_report",
        "global_state",
        "heartbeat",
        "successor",
    }
    assert VALIDATOR_KINDS < set(MESSAGE_TYPES)
    with pytest.raises(ValueError, match="loss exactly when"):
        ScoreEntry(miner=H, commitment=H, loss=None, verdict="accept")
    with pytest.raises(ValueError, match="loss exactly when"):
        ScoreEntry(miner=H, commitment=H, loss=1.0, verdict="reject", reason="bad hash")


def test_decode_refuses_oversized_and_non_canonical() -> None:
    data = seal(report(1.0), "11" * 32, SIGNER).to_bytes()
    with pytest.raises(DecodeError, match="exceeds"):
        decode_envelope(data, len(data) - 1)
    with pytest.raises(DecodeError, match="canonical"):
        decode_envelope(data + b" ", len(data) + 1)


SCHEDULE = Schedule(0.0, train_s=30, commit_s=5, reveal_s=10, evaluate_s=10, merge_s=5)
CTX = CheckContext(
    network_id="11" * 32,
    validators={SIGNER.node_id: 1.0},
    schedule=SCHEDULE,
    now=SCHEDULE.phase_window(3, Phase.MERGE)[0],
)
SIGNED = seal(report(1.0), "11" * 32, SIGNER).to_bytes()


def test_signed_envelope_is_accepted_untouched() -> None:
    assert check_bytes(SIGNED, CTX, 65536)[0].verdict is Verdict.ACCEPT


def test_every_single_bit_flip_is_rejected() -> None:
    for i in range(len(SIGNED)):
        for bit in (0x01, 0x20):
            data = bytearray(SIGNED)
            data[i] ^= bit
            result, _ = check_bytes(bytes(data), CTX, 65536)
            assert result.verdict is Verdict.REJECT, (i, bit, result)


@given(st.integers(min_value=0, max_value=len(SIGNED) - 1), st.integers(min_value=1, max_value=255))
def test_any_flipped_byte_is_rejected(i: int, xor: int) -> None:
    data = bytearray(SIGNED)
    data[i] ^= xor
    assert check_bytes(bytes(data), CTX, 65536)[0].verdict is Verdict.REJECT


@given(st.binary(max_size=600))
def test_garbage_never_raises(data: bytes) -> None:
    result, envelope = check_bytes(data, CTX, 65536)
    assert result.verdict is Verdict.REJECT and envelope is None

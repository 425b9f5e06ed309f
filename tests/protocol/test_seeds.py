"""Commit-reveal of validator seeds and the combined round seed."""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from protocol.seeds import checkpoint_commitment, commitment, gate_seed, new_seed, reveal_matches, round_seed

SEEDS = {f"v{i}": hashlib.sha256(bytes([i])).hexdigest() for i in range(4)}
COMMITS = {v: commitment(s) for v, s in SEEDS.items()}


def test_commitment_is_sha256_of_seed_bytes() -> None:
    seed = "00" * 31 + "01"
    assert commitment(seed) == hashlib.sha256(bytes(31) + b"\x01").hexdigest()
    assert reveal_matches(commitment(seed), seed)
    assert not reveal_matches(commitment(seed), "00" * 32)
    assert not reveal_matches(commitment(seed), "zz" * 32)
    with pytest.raises(ValueError, match="seed"):
        commitment("abc")


def test_new_seed_is_fresh_hex() -> None:
    a, b = new_seed(), new_seed()
    assert a != b and len(a) == 64 and reveal_matches(commitment(a), a)


def test_round_seed_hashes_sorted_seed_bytes() -> None:
    expected = hashlib.sha256(b"".join(sorted(bytes.fromhex(s) for s in SEEDS.values()))).hexdigest()
    assert round_seed(COMMITS, SEEDS) == expected


@given(st.permutations(sorted(SEEDS)))
def test_round_seed_ignores_order(order: list[str]) -> None:
    assert round_seed({v: COMMITS[v] for v in order}, {v: SEEDS[v] for v in reversed(order)}) == round_seed(
        COMMITS, SEEDS
    )


def test_round_seed_drops_non_revealers_liars_and_uncommitted() -> None:
    honest = {v: SEEDS[v] for v in ("v0", "v1")}
    expected = round_seed({v: COMMITS[v] for v in honest}, honest)
    reveals = {"v0": SEEDS["v0"], "v1": SEEDS["v1"], "v2": SEEDS["v3"], "late": new_seed()}
    commits = {"v0": COMMITS["v0"], "v1": COMMITS["v1"], "v2": COMMITS["v2"], "v3": COMMITS["v3"]}
    assert round_seed(commits, reveals) == expected
    assert round_seed(commits, reveals) != round_seed(COMMITS, SEEDS)


def test_round_seed_needs_one_honest_reveal() -> None:
    with pytest.raises(ValueError, match="no validator revealed"):
        round_seed(COMMITS, {"v0": SEEDS["v1"]})


def test_checkpoint_commitment() -> None:
    assert checkpoint_commitment(b"blob") == hashlib.sha256(b"blob").hexdigest()


def test_the_gate_seed_is_a_fixed_function_of_the_round_seed_and_differs_from_it() -> None:
    s_r = hashlib.sha256(b"round").hexdigest()
    assert gate_seed(s_r) == hashlib.sha256(b"tessera-gate" + bytes.fromhex(s_r)).hexdigest()
    assert gate_seed(s_r) != s_r and gate_seed(s_r) != gate_seed(hashlib.sha256(b"other").hexdigest())

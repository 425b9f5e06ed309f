"""Proof-of-Loss assignment: deterministic, follows its documented hash, balanced."""

from __future__ import annotations

import hashlib
import math
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.assignment import admit, assign, assigned_to

SEED = "5e" * 32
VALIDATORS = [hashlib.sha256(f"v{i}".encode()).hexdigest() for i in range(10)]
MINERS = [hashlib.sha256(f"m{i}".encode()).hexdigest() for i in range(2000)]


def test_follows_the_documented_hash() -> None:
    miner = MINERS[0]

    def dist(v: str) -> bytes:
        return hashlib.sha256(bytes.fromhex(SEED + miner + v)).digest()

    expected = tuple(sorted(VALIDATORS, key=dist)[:3])
    assert assign(SEED, [miner], VALIDATORS, 3) == {miner: expected}
    assert assign(SEED, [miner], VALIDATORS, 1) == {miner: expected[:1]}  # replication 1 is the least allowed


def test_deterministic_and_order_free() -> None:
    a = assign(SEED, MINERS[:50], VALIDATORS, 2)
    b = assign(SEED, list(reversed(MINERS[:50])), list(reversed(VALIDATORS)), 2)
    assert a == b
    assert all(len(set(vs)) == 2 for vs in a.values())
    assert assign("00" * 32, MINERS[:50], VALIDATORS, 2) != a


def test_replication_beyond_validator_count_takes_everyone() -> None:
    result = assign(SEED, MINERS[:3], VALIDATORS[:2], 5)
    assert all(sorted(vs) == sorted(VALIDATORS[:2]) for vs in result.values())


def test_assigned_to_is_the_inverse() -> None:
    result = assign(SEED, MINERS[:40], VALIDATORS, 3)
    for v in VALIDATORS:
        mine = assigned_to(v, SEED, MINERS[:40], VALIDATORS, 3)
        assert mine == tuple(sorted(m for m, vs in result.items() if v in vs))


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((SEED, ["xyz"], VALIDATORS, 2), "miner id"),
        ((SEED, MINERS[:1], [], 2), "validator set is empty"),
        ((SEED, MINERS[:1], VALIDATORS, 0), "replication"),
        (("00", MINERS[:1], VALIDATORS, 1), "round seed"),
    ],
)
def test_bad_input(args: tuple, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        assign(*args)


@given(st.binary(min_size=32, max_size=32))
@settings(max_examples=8, deadline=None)
def test_balanced_load(seed: bytes) -> None:
    replication = 3
    load = Counter(v for vs in assign(seed.hex(), MINERS, VALIDATORS, replication).values() for v in vs)
    expected = len(MINERS) * replication / len(VALIDATORS)
    # Each count is Binomial(2000, 0.3), sd 20.5, and a run checks 80 (8 seeds, 10 validators). At a
    # bound of 15% (4.4 sd) about one run in a thousand fails on chance alone, as one did (a validator
    # drew 692, 4.5 sd); at 6 sd (123, about 20%) one run in some six million does.
    sd = math.sqrt(len(MINERS) * (replication / len(VALIDATORS)) * (1 - replication / len(VALIDATORS)))
    assert all(abs(load[v] - expected) <= 6 * sd for v in VALIDATORS), load


def test_a_round_admits_the_miners_the_seed_puts_first_when_too_many_revealed() -> None:
    assert admit(SEED, MINERS[:10], 10) == tuple(sorted(MINERS[:10]))  # room for all
    chosen = admit(SEED, reversed(MINERS[:100]), 7)
    first = sorted(MINERS[:100], key=lambda m: hashlib.sha256(bytes.fromhex(SEED + m)).digest())[:7]
    assert chosen == tuple(sorted(first))
    assert admit("00" * 32, MINERS[:100], 7) != chosen  # another round, another draw
    assert admit(SEED, MINERS[:100], 1) == tuple(first[:1])  # capacity 1 is the least allowed
    with pytest.raises(ValueError, match="capacity"):
        admit(SEED, MINERS[:3], 0)
    with pytest.raises(ValueError, match="round seed"):
        admit("00", MINERS[:3], 10)  # refused even when every miner fits

"""Proof-of-Loss assignment: which R validators evaluate each miner in a round.

A validator's distance to a miner is SHA256(s_r || miner || validator) over raw bytes: the 32-byte
round seed, then the miner's 32-byte public key, then the validator's 32-byte public key (each
decoded from its hex). Each miner is assigned the R validators with the smallest distance (ties,
which need a hash collision, fall to the smaller validator id), nearest first. When R exceeds the
validator count every validator evaluates every miner. Everyone computes the same answer from the
same round seed. A round takes at most as many miners as one validator's score report can carry
(`admit`); this module knows nothing about scores or timing.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

from protocol.encoding import is_hex_digest


def distance(round_seed: str, miner: str, validator: str) -> bytes:
    """SHA256(s_r || miner || validator) over the raw 32-byte values."""
    return hashlib.sha256(
        bytes.fromhex(round_seed) + bytes.fromhex(miner) + bytes.fromhex(validator)
    ).digest()


def assign(
    round_seed: str, miners: Iterable[str], validators: Iterable[str], replication: int
) -> dict[str, tuple[str, ...]]:
    """Miner -> its assigned validators, nearest first. Miners and validators are hex node ids."""
    miner_ids = _ids(miners, "miner")
    validator_ids = _ids(validators, "validator")
    _require_hex(round_seed, "round seed")
    if replication < 1:
        raise ValueError(f"replication must be >= 1, got {replication}")
    if not validator_ids:
        raise ValueError("cannot assign miners: the validator set is empty")
    r = min(replication, len(validator_ids))

    def closest(miner: str) -> tuple[str, ...]:
        return tuple(sorted(validator_ids, key=lambda v: (distance(round_seed, miner, v), v))[:r])

    return {miner: closest(miner) for miner in miner_ids}


def admit(round_seed: str, miners: Iterable[str], capacity: int) -> tuple[str, ...]:
    """The miners a round takes when more than `capacity` revealed, sorted by id: those with the smallest
    SHA256(s_r || miner). The round seed is unknown until the commit window has closed, so no miner can
    choose an identity or commitment that gets it in."""
    miner_ids = _ids(miners, "miner")
    _require_hex(round_seed, "round seed")
    if capacity < 1:
        raise ValueError(f"capacity must be >= 1, got {capacity}")
    if len(miner_ids) <= capacity:
        return tuple(miner_ids)
    order = sorted(miner_ids, key=lambda m: (hashlib.sha256(bytes.fromhex(round_seed) + bytes.fromhex(m)).digest(), m))
    return tuple(sorted(order[:capacity]))


def assigned_to(
    validator: str, round_seed: str, miners: Iterable[str], validators: Iterable[str], replication: int
) -> tuple[str, ...]:
    """The miners `validator` must evaluate this round, sorted by id."""
    assignment = assign(round_seed, miners, validators, replication)
    return tuple(sorted(miner for miner, chosen in assignment.items() if validator in chosen))


def _ids(values: Iterable[str], what: str) -> list[str]:
    ids = sorted(set(values))
    for value in ids:
        _require_hex(value, what)
    return ids


def _require_hex(value: str, what: str) -> None:
    if not is_hex_digest(value):
        raise ValueError(f"{what} id must be 64 lower-case hex characters, got {value[:80]!r}")

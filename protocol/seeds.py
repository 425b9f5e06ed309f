"""Commit-reveal arithmetic: validators' round seeds and miners' checkpoint commitments.

A validator commits to SHA256(seed) during TRAIN and reveals the seed during REVEAL; the round
seed hashes the sorted seeds of every validator whose reveal matches its commitment, so no single
validator picks it and no miner can know it when it commits. Seeds are 32 random bytes as hex.
The merge gate draws its held-out rows from `gate_seed`, a seed derived from the round seed, so every
validator draws the same rows and no miner knew them when it committed.
This module knows nothing about messages, time windows or who is a validator.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Mapping

from protocol.encoding import is_hex_digest, sha256_hex


def new_seed() -> str:
    """A fresh 32-byte random seed, hex."""
    return secrets.token_hex(32)


def commitment(seed_hex: str) -> str:
    """SHA256 of the seed's 32 raw bytes, hex; ValueError if `seed_hex` is not 32 bytes of hex."""
    if not is_hex_digest(seed_hex):
        raise ValueError(f"a seed must be 64 lower-case hex characters, got {seed_hex[:80]!r}")
    return sha256_hex(bytes.fromhex(seed_hex))


def reveal_matches(commitment_hex: str, seed_hex: str) -> bool:
    """True when `seed_hex` is a well-formed seed whose commitment is `commitment_hex`."""
    return is_hex_digest(seed_hex) and commitment(seed_hex) == commitment_hex


def round_seed(commits: Mapping[str, str], reveals: Mapping[str, str]) -> str:
    """The round seed: SHA256 over the concatenated, byte-sorted seeds of honest revealers.

    Only validators present in both `commits` (validator -> commitment) and `reveals`
    (validator -> seed) whose seed matches their commitment count. ValueError when none does.
    """
    seeds = sorted(
        bytes.fromhex(seed)
        for validator, seed in reveals.items()
        if validator in commits and reveal_matches(commits[validator], seed)
    )
    if not seeds:
        raise ValueError("no validator revealed a seed matching its commitment; the round has no seed")
    return hashlib.sha256(b"".join(seeds)).hexdigest()


def gate_seed(round_seed_hex: str) -> str:
    """The seed of the round's merge gate: SHA256("tessera-gate" ‖ the round seed's 32 bytes), hex."""
    return sha256_hex(b"tessera-gate" + bytes.fromhex(round_seed_hex))


def checkpoint_commitment(blob: bytes) -> str:
    """A miner's commitment to its checkpoint: SHA256 of the blob's bytes, hex (also its address)."""
    return sha256_hex(blob)

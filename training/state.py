"""The global expert state as a value: tensors, outer momentum, their average, and their place in the hash chain.

A `GlobalExperts` is the state produced by the merge of one round. Its `hash` is the SHA-256 of its
canonical state blob, an ordinary Tessera blob whose metadata reads
`{network, round, miner: "", base: parent hash, group, format: "tessera-global/1"}`: the empty miner
names no one, and `base` links the state to its parent, so the hashes form a chain. The chain's
root is the genesis state (round -1): the base model's own experts, whose hash is the spec's
`base_hash` and which has no blob, since every node builds it from the base model.

The outer momentum travels in a second blob with `format: "tessera-momentum/1"` and `base` = the
hash of the state it belongs to, so a validator in the minority re-syncs by fetching two blobs: the
state by the hash the majority endorsed, and the momentum that names that hash as its base.
`adopt` picks the hash endorsed by a strict majority of validator weight. This module knows
nothing about how states are computed (see `validator.merge`) or transferred.

A network whose spec sets `aggregation.average_decay` above 0 also keeps the average of its merged
states: every child state folds its merged tensors into its parent's average (`training.outer.
average_states`; the genesis average is the base's experts), and the state blob holds that average
next to the merged tensors, each under `average/` + its name, so the one hash the validators vote on
binds both. The average is the model the network offers (`offered`: reported, exported); miners
train from, and validators score against, the merged tensors.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property

import torch

from protocol.spec import NetworkSpec
from training.blob import BlobError, BlobMeta, blob_hash, decode_blob, encode_blob
from training.outer import average_states

GLOBAL_FORMAT = "tessera-global/1"
MOMENTUM_FORMAT = "tessera-momentum/1"
GENESIS_ROUND = -1
STATE_MINER = ""
AVERAGE_PREFIX = "average/"
"""A state blob holds the average of the merged states (where the spec keeps one) under this prefix."""


class StateError(ValueError):
    """A state or momentum blob from a peer is not the state it claims to be."""


@dataclass(frozen=True, eq=False)
class GlobalExperts:
    """The global expert tensors after round `round`, the outer momentum, and the parent's hash.

    Treat it as a value: tensors are never modified in place; a merge makes a new state.
    """

    spec: NetworkSpec
    round: int
    parent: str
    tensors: Mapping[str, torch.Tensor]
    momentum: Mapping[str, torch.Tensor]
    average: Mapping[str, torch.Tensor] | None = None
    """The average of the merged states where `aggregation.average_decay` > 0, else None. None there too in a
    miner's view (`held_average` False), which trains from the merged tensors and need not hold a second copy."""

    def __post_init__(self) -> None:
        assert self.round >= GENESIS_ROUND, f"round {self.round} precedes genesis"
        assert set(self.tensors) == set(self.momentum), "momentum must have one tensor per expert tensor"
        assert self.average is None or self.spec.aggregation.average_decay, \
            "a state keeps an average only where its spec sets aggregation.average_decay"
        assert self.average is None or set(self.average) == set(self.tensors), \
            "the average must have one tensor per expert tensor"

    @classmethod
    def genesis(cls, spec: NetworkSpec, tensors: Mapping[str, torch.Tensor], *,
                held_average: bool = True) -> GlobalExperts:
        """The chain's root: the base model's experts (from `training.experts.extract`), zero momentum,
        and (where the spec keeps one, unless `held_average` is False: a miner's view) an average that is the
        base's experts in fp32."""
        momentum = {name: torch.zeros(t.shape, dtype=torch.float32) for name, t in tensors.items()}
        keeps = spec.aggregation.average_decay and held_average  # fp32 on the CPU, as the outer step's states
        average = {name: t.detach().to("cpu", torch.float32) for name, t in tensors.items()} if keeps else None
        return cls(spec=spec, round=GENESIS_ROUND, parent="", tensors=dict(tensors), momentum=momentum,
                   average=average)

    @property
    def held_average(self) -> bool:
        """False for a view that leaves out the average its spec keeps (a miner's): it can offer, merge into
        or write nothing."""
        return self.average is not None or not self.spec.aggregation.average_decay

    @property
    def is_genesis(self) -> bool:
        return self.round == GENESIS_ROUND

    @property
    def offered(self) -> Mapping[str, torch.Tensor]:
        """The experts the network offers as its model: the average where the spec keeps one, else the merged
        tensors. The status page reports its loss and `tessera export` writes it."""
        self._check_held()
        return self.tensors if self.average is None else self.average

    @cached_property
    def hash(self) -> str:
        """The state's address: `spec.model.base_hash` at genesis, else SHA-256 of `to_blob()`."""
        return self.spec.model.base_hash if self.is_genesis else blob_hash(self.to_blob())

    @cached_property
    def momentum_hash(self) -> str:
        """SHA-256 of `momentum_blob()`."""
        return blob_hash(self.momentum_blob())

    def child(
        self, round: int, tensors: Mapping[str, torch.Tensor], momentum: Mapping[str, torch.Tensor]
    ) -> GlobalExperts:
        """The state a merge in `round` produced from this one, with the merged `tensors` folded into the
        average (where the spec keeps one)."""
        if round <= self.round:
            raise ValueError(f"a child state must come after round {self.round}, got round {round}")
        if set(tensors) != set(self.tensors):
            raise ValueError("a child state must hold exactly the parent's tensor names")
        self._check_held()
        average = None if self.average is None else average_states(
            self.average, tensors, self.spec.aggregation.average_decay)
        return GlobalExperts(spec=self.spec, round=round, parent=self.hash, tensors=dict(tensors),
                             momentum=dict(momentum), average=average)

    def to_blob(self) -> bytes:
        """The canonical state blob, with the average under `AVERAGE_PREFIX`; its SHA-256 is `hash`."""
        self._check_held()
        held = dict(self.tensors)
        if self.average is not None:
            held.update({AVERAGE_PREFIX + name: t for name, t in self.average.items()})
        return encode_blob(held, self._meta(self.parent, GLOBAL_FORMAT))

    def momentum_blob(self) -> bytes:
        """The canonical momentum blob (fp32), bound to this state by `base` = `hash`."""
        momentum = {name: t.to(torch.float32) for name, t in self.momentum.items()}
        return encode_blob(momentum, self._meta(self.hash, MOMENTUM_FORMAT))

    @classmethod
    def from_blobs(
        cls, state: bytes, momentum: bytes, spec: NetworkSpec, shapes: Mapping[str, tuple[int, ...]]
    ) -> GlobalExperts:
        """Rebuild a state fetched from a peer; StateError names what does not fit."""
        state_meta, tensors, average = decode_state_blob(state, spec, shapes)
        return cls.with_momentum(blob_hash(state), state_meta, tensors, momentum, spec, shapes, average)

    @classmethod
    def with_momentum(
        cls,
        state_hash: str,
        state_meta: BlobMeta,
        tensors: dict[str, torch.Tensor],
        momentum: bytes,
        spec: NetworkSpec,
        shapes: Mapping[str, tuple[int, ...]],
        average: dict[str, torch.Tensor] | None,
    ) -> GlobalExperts:
        """An already decoded state (`state_hash`: its blob's hash; `average` as `decode_state_blob` gives it)
        with its momentum blob; StateError names what does not fit."""
        momentum_meta, moments = _decode(momentum, spec, MOMENTUM_FORMAT, shapes)
        if momentum_meta.base != state_hash:
            raise StateError("momentum blob belongs to another state: its base is not the state's hash")
        if momentum_meta.round != state_meta.round:
            raise StateError(
                f"momentum is for round {momentum_meta.round}, the state for round {state_meta.round}"
            )
        if any(t.dtype != torch.float32 for t in moments.values()):
            raise StateError("momentum tensors must be float32")
        return cls(spec=spec, round=state_meta.round, parent=state_meta.base, tensors=tensors, momentum=moments,
                   average=average)

    def _check_held(self) -> None:
        if not self.held_average:
            raise ValueError("this view of the state leaves out its average (a miner's view); load the state "
                             "with its average to offer, merge into or write it")

    def _meta(self, base: str, fmt: str) -> BlobMeta:
        if self.is_genesis:
            raise ValueError(
                "the genesis state is the base model itself and has no blob; build it from the base"
            )
        return BlobMeta(
            network=self.spec.network_id,
            round=self.round,
            miner=STATE_MINER,
            base=base,
            group={layer: list(ids) for layer, ids in self.spec.group.items()},
            format=fmt,
        )


def adopt(votes: Mapping[str, str], weights: Mapping[str, float]) -> str | None:
    """The hash endorsed by validators holding a strict majority of the total weight, else None.

    `votes` maps validator -> the state hash it published; `weights` is the whole validator set
    (validator -> stake), so silent validators count against every hash. Votes from keys outside
    `weights` are ignored.
    """
    total = math.fsum(weights.values())
    if total <= 0:
        raise ValueError("the validator set has no weight")
    backers: dict[str, list[float]] = {}
    for validator, digest in votes.items():
        if validator in weights:
            backers.setdefault(digest, []).append(weights[validator])
    for digest in sorted(backers):
        if 2 * math.fsum(backers[digest]) > total:
            return digest
    return None


def state_shapes(spec: NetworkSpec, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """The names and shapes a state blob of `spec` holds, given the expert group's `shapes`: those, and the
    average's under `AVERAGE_PREFIX` where the spec keeps one."""
    held = {name: tuple(shape) for name, shape in shapes.items()}
    if spec.aggregation.average_decay:
        held.update({AVERAGE_PREFIX + name: tuple(shape) for name, shape in shapes.items()})
    return held


def split_average(
    spec: NetworkSpec, held: Mapping[str, torch.Tensor]
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor] | None]:
    """A state blob's tensors (names as `state_shapes` gives them) as (merged tensors, average or None)."""
    if not spec.aggregation.average_decay:
        return dict(held), None
    tensors = {name: t for name, t in held.items() if not name.startswith(AVERAGE_PREFIX)}
    return tensors, {name[len(AVERAGE_PREFIX):]: t for name, t in held.items() if name.startswith(AVERAGE_PREFIX)}


def decode_state_blob(
    data: bytes, spec: NetworkSpec, shapes: Mapping[str, tuple[int, ...]]
) -> tuple[BlobMeta, dict[str, torch.Tensor], dict[str, torch.Tensor] | None]:
    """A global state blob of this network and group (`shapes`: the group's) as its metadata, merged tensors
    and average (None where the spec keeps none); StateError names what does not fit."""
    meta, held = _decode(data, spec, GLOBAL_FORMAT, state_shapes(spec, shapes))
    return (meta, *split_average(spec, held))


def _decode(
    data: bytes, spec: NetworkSpec, fmt: str, shapes: Mapping[str, tuple[int, ...]]
) -> tuple[BlobMeta, dict[str, torch.Tensor]]:
    try:
        meta, tensors = decode_blob(data, spec.limits.max_header_bytes)
    except BlobError as exc:
        raise StateError(f"{fmt} blob: {exc.reason}") from exc
    if meta.format != fmt:
        raise StateError(f"expected a {fmt} blob, got {meta.format}")
    if meta.network != spec.network_id:
        raise StateError(f"{fmt} blob is for another network")
    if meta.miner != STATE_MINER:
        raise StateError(f"{fmt} blob names a miner; it is a submission, not a global state")
    if meta.group != {layer: sorted(ids) for layer, ids in spec.group.items()}:
        raise StateError(f"{fmt} blob is for another expert group")
    if {name: tuple(t.shape) for name, t in tensors.items()} != {
        name: tuple(s) for name, s in shapes.items()
    }:
        raise StateError(f"{fmt} blob tensors do not match the expert group's names and shapes")
    if not all(bool(torch.isfinite(t).all()) for t in tensors.values()):
        raise StateError(f"{fmt} blob holds non-finite values")
    return meta, tensors

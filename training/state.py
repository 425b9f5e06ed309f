"""The global expert state as a value: tensors, outer momentum and their place in the hash chain.

A `GlobalExperts` is the state produced by the merge of one round. Its `hash` is the SHA-256 of its
canonical state blob, an ordinary Tessera blob whose metadata reads
`{network, round, miner: "", base: parent hash, group, format: "tessera-global/1"}`: the empty miner
names no one, and `base` links the state to its parent, so the hashes form a chain. The chain's
root is the genesis state (round -1): the base model's own experts, whose hash is the spec's
`base_hash` and which has no blob, since every node builds it from the base model. A successor spec's
chain starts again at round -1 from its own group cut from the base model with the earlier specs'
states written in (`inherited_experts`); its root's hash is the predecessor's state it starts on.

The outer momentum travels in a second blob with `format: "tessera-momentum/1"` and `base` = the
hash of the state it belongs to, so a validator in the minority re-syncs by fetching two blobs: the
state by the hash the majority endorsed, and the momentum that names that hash as its base.
`adopt` picks the hash endorsed by a strict majority of validator weight. This module knows
nothing about how states are computed (see `validator.merge`) or transferred.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import torch

from protocol.spec import NetworkSpec
from training.blob import (
    DTYPES,
    BlobError,
    BlobFile,
    BlobMeta,
    blob_hash,
    decode_blob,
    encoded_hash,
    encoded_parts,
    read_header,
)

GLOBAL_FORMAT = "tessera-global/1"
MOMENTUM_FORMAT = "tessera-momentum/1"
GENESIS_ROUND = -1
STATE_MINER = ""


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

    def __post_init__(self) -> None:
        assert self.round >= GENESIS_ROUND, f"round {self.round} precedes genesis"
        assert set(self.tensors) == set(self.momentum), "momentum must have one tensor per expert tensor"

    @classmethod
    def genesis(cls, spec: NetworkSpec, tensors: Mapping[str, torch.Tensor]) -> GlobalExperts:
        """The chain's root: the base model's experts (from `training.experts.extract`) and zero momentum.

        The zeros are one element each, broadcast to the tensor's shape (`expand`): a state is never
        changed in place, and a whole zero momentum is the group once more in fp32 (0.8 GB for
        OLMoE-1B-7B's two experts a layer) that every validator would hold for nothing."""
        zero = torch.zeros((), dtype=torch.float32)
        momentum = {name: zero.expand(t.shape) for name, t in tensors.items()}
        return cls(spec=spec, round=GENESIS_ROUND, parent="", tensors=dict(tensors), momentum=momentum)

    @property
    def is_genesis(self) -> bool:
        return self.round == GENESIS_ROUND

    @cached_property
    def hash(self) -> str:
        """The state's address: the root of the spec's chain at genesis (`spec.root`: the base hash, or a successor
        spec's base state), else SHA-256 of `to_blob()` (streamed)."""
        return self.spec.root if self.is_genesis else encoded_hash(self.tensors, self._state_meta())

    @cached_property
    def momentum_hash(self) -> str:
        """SHA-256 of `momentum_blob()` (streamed)."""
        return encoded_hash(_Fp32(self.momentum), self._meta(self.hash, MOMENTUM_FORMAT))

    def child(
        self, round: int, tensors: Mapping[str, torch.Tensor], momentum: Mapping[str, torch.Tensor]
    ) -> GlobalExperts:
        """The state a merge in `round` produced from this one."""
        if round <= self.round:
            raise ValueError(f"a child state must come after round {self.round}, got round {round}")
        if set(tensors) != set(self.tensors):
            raise ValueError("a child state must hold exactly the parent's tensor names")
        return GlobalExperts(spec=self.spec, round=round, parent=self.hash, tensors=dict(tensors),
                             momentum=dict(momentum))

    def to_blob(self) -> bytes:
        """The canonical state blob; its SHA-256 is `hash`."""
        return b"".join(self.blob_parts())

    def momentum_blob(self) -> bytes:
        """The canonical momentum blob (fp32), bound to this state by `base` = `hash`."""
        return b"".join(self.momentum_parts())

    def blob_parts(self) -> Iterator[bytes | memoryview]:
        """`to_blob()` in pieces, a tensor at a time (`training.blob.encoded_parts`)."""
        return encoded_parts(self.tensors, self._state_meta())

    def momentum_parts(self) -> Iterator[bytes | memoryview]:
        """`momentum_blob()` in pieces, a tensor at a time."""
        return encoded_parts(_Fp32(self.momentum), self._meta(self.hash, MOMENTUM_FORMAT))

    @classmethod
    def from_files(cls, state_hash: str, state: Path, momentum: Path, spec: NetworkSpec,
                   shapes: Mapping[str, tuple[int, ...]]) -> GlobalExperts:
        """A state and its momentum held in blob files whose bytes hash to their names (`state_hash`: the
        state's), read a tensor at a time when asked for (`training.blob.BlobFile`); checked as `from_blobs`
        checks them, streaming. StateError names what does not fit."""
        state_meta, tensors = read_state_file(state, spec, GLOBAL_FORMAT, shapes)
        momentum_meta, moments = read_state_file(momentum, spec, MOMENTUM_FORMAT, shapes)
        return cls._paired(state_hash, state_meta, tensors, momentum_meta, moments, spec)

    @classmethod
    def from_blobs(
        cls, state: bytes, momentum: bytes, spec: NetworkSpec, shapes: Mapping[str, tuple[int, ...]]
    ) -> GlobalExperts:
        """Rebuild a state fetched from a peer; StateError names what does not fit."""
        state_meta, tensors = decode_state_blob(state, spec, shapes)
        return cls.with_momentum(blob_hash(state), state_meta, tensors, momentum, spec, shapes)

    @classmethod
    def with_momentum(
        cls,
        state_hash: str,
        state_meta: BlobMeta,
        tensors: dict[str, torch.Tensor],
        momentum: bytes,
        spec: NetworkSpec,
        shapes: Mapping[str, tuple[int, ...]],
    ) -> GlobalExperts:
        """An already decoded state (`state_hash`: its blob's hash) with its momentum blob; StateError names
        what does not fit."""
        momentum_meta, moments = _decode(momentum, spec, MOMENTUM_FORMAT, shapes)
        return cls._paired(state_hash, state_meta, tensors, momentum_meta, moments, spec)

    @classmethod
    def with_momentum_file(cls, state_hash: str, state_meta: BlobMeta, tensors: Mapping[str, torch.Tensor],
                           momentum: Path, spec: NetworkSpec, shapes: Mapping[str, tuple[int, ...]]) -> GlobalExperts:
        """`with_momentum` with the momentum in a blob file, read a tensor at a time when asked for."""
        momentum_meta, moments = read_state_file(momentum, spec, MOMENTUM_FORMAT, shapes)
        return cls._paired(state_hash, state_meta, tensors, momentum_meta, moments, spec)

    @classmethod
    def _paired(cls, state_hash: str, state_meta: BlobMeta, tensors: Mapping[str, torch.Tensor],
                momentum_meta: BlobMeta, moments: Mapping[str, torch.Tensor], spec: NetworkSpec) -> GlobalExperts:
        if momentum_meta.base != state_hash:
            raise StateError("momentum blob belongs to another state: its base is not the state's hash")
        if momentum_meta.round != state_meta.round:
            raise StateError(
                f"momentum is for round {momentum_meta.round}, the state for round {state_meta.round}"
            )
        if any(_dtype(moments, name) != torch.float32 for name in moments):
            raise StateError("momentum tensors must be float32")
        return cls(spec=spec, round=state_meta.round, parent=state_meta.base, tensors=tensors, momentum=moments)

    def _state_meta(self) -> BlobMeta:
        return self._meta(self.parent, GLOBAL_FORMAT)

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


def inherited_experts(paths: Sequence[Path], max_header_bytes: int) -> dict[str, torch.Tensor]:
    """The expert tensors of earlier specs' global states (blob files whose bytes hash to their names, oldest
    first), a later state's over an earlier's: what a successor spec writes into the base model before it cuts
    its own group from it (`protocol.spec.Lineage.inherits`). StateError for a file that is not a global state."""
    merged: dict[str, torch.Tensor] = {}
    for path in paths:
        try:
            header = read_header(path, max_header_bytes)
        except BlobError as exc:
            raise StateError(f"inherited state {path.name[:12]}: {exc.reason}") from exc
        if header.meta.format != GLOBAL_FORMAT or header.meta.miner != STATE_MINER:
            raise StateError(f"inherited state {path.name[:12]} is a {header.meta.format} blob, not a global state")
        tensors = BlobFile(path, header)
        merged.update({name: tensors[name] for name in tensors})
    return merged


def decode_state_blob(
    data: bytes, spec: NetworkSpec, shapes: Mapping[str, tuple[int, ...]]
) -> tuple[BlobMeta, dict[str, torch.Tensor]]:
    """A global state blob of this network and group (`shapes`: the group's) as its metadata and tensors;
    StateError names what does not fit."""
    return _decode(data, spec, GLOBAL_FORMAT, shapes)


def read_state_file(
    path: Path, spec: NetworkSpec, fmt: str, shapes: Mapping[str, tuple[int, ...]]
) -> tuple[BlobMeta, BlobFile]:
    """`_decode`'s checks on a blob file, its tensors read a tensor at a time (once here, for finiteness);
    StateError names what does not fit, OSError a file that cannot be read."""
    try:
        header = read_header(path, spec.limits.max_header_bytes)
    except BlobError as exc:
        raise StateError(f"{fmt} blob: {exc.reason}") from exc
    tensors = BlobFile(path, header)
    _check(header.meta, {name: info.shape for name, info in header.tensors.items()}, spec, fmt, shapes)
    if not all(bool(torch.isfinite(tensors[name]).all()) for name in tensors):
        raise StateError(f"{fmt} blob holds non-finite values")
    return header.meta, tensors


def _decode(
    data: bytes, spec: NetworkSpec, fmt: str, shapes: Mapping[str, tuple[int, ...]]
) -> tuple[BlobMeta, dict[str, torch.Tensor]]:
    try:
        meta, tensors = decode_blob(data, spec.limits.max_header_bytes)
    except BlobError as exc:
        raise StateError(f"{fmt} blob: {exc.reason}") from exc
    _check(meta, {name: tuple(t.shape) for name, t in tensors.items()}, spec, fmt, shapes)
    if not all(bool(torch.isfinite(t).all()) for t in tensors.values()):
        raise StateError(f"{fmt} blob holds non-finite values")
    return meta, tensors


def _check(meta: BlobMeta, held: Mapping[str, tuple[int, ...]], spec: NetworkSpec, fmt: str,
           shapes: Mapping[str, tuple[int, ...]]) -> None:
    """A state or momentum blob's metadata and tensor shapes (`held`) against this network and group."""
    if meta.format != fmt:
        raise StateError(f"expected a {fmt} blob, got {meta.format}")
    if meta.network != spec.network_id:
        raise StateError(f"{fmt} blob is for another network")
    if meta.miner != STATE_MINER:
        raise StateError(f"{fmt} blob names a miner; it is a submission, not a global state")
    if meta.group != {layer: sorted(ids) for layer, ids in spec.group.items()}:
        raise StateError(f"{fmt} blob is for another expert group")
    if {name: tuple(shape) for name, shape in held.items()} != {name: tuple(s) for name, s in shapes.items()}:
        raise StateError(f"{fmt} blob tensors do not match the expert group's names and shapes")


def _dtype(tensors: Mapping[str, torch.Tensor], name: str) -> torch.dtype:
    """A tensor's dtype, from a blob file's header where it is one (without reading the tensor)."""
    if isinstance(tensors, BlobFile):
        return DTYPES[tensors.header.tensors[name].dtype]
    return tensors[name].dtype


class _Fp32(Mapping[str, torch.Tensor]):
    """A state's momentum as fp32 tensors, converted when asked for (the genesis momentum is broadcast zeros)."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]) -> None:
        self._tensors = tensors

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._tensors[name].to(torch.float32)

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

"""Successor specs: the signed document that moves a network to its next expert group, and the spec it yields.

A successor document names its predecessor (that spec's network id), the round from which it is in force
(`activation`, N), the new expert group and every spec section that may change with it ([data], [training],
[rewards], [aggregation], [submission]), and how the group was chosen ([selection], a record). What every round
must agree on for the network's whole life cannot change: name, genesis, timing, model, validators and limits.
Validators sign the SHA-256 of the document's body (its canonical JSON, signatures aside) under a domain tag of
its own; a document takes effect only when validators holding a strict majority of the predecessor's validator
weight signed it (`judge_document`, which also refuses another predecessor, an activation round that has begun
or comes sooner than GRACE_ROUNDS after the round in progress, and a group naming experts the model lacks).

At activation every node derives the successor spec (`successor_spec`): the predecessor with those sections
replaced and a `lineage` naming the predecessor, the document, the activation round and the base, the
predecessor's adopted state at the end of round N - 1. The successor's network id hashes all of it, so it is
known once that state is. The base model of a successor is the genesis base with the states of earlier specs
written in, oldest first (`lineage.inherits`). This module is pure: it reads files only in `load_document`,
never raises for a peer's document (`parse_document` raises SpecError, `judge_document` returns the refusal),
and knows nothing about gossip, storage or models.
"""

from __future__ import annotations

import json
import math
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from protocol.encoding import canonical_json, sha256_hex
from protocol.identity import Identity, verify
from protocol.messages import MAX_ROUND
from protocol.spec import (
    AggregationSpec,
    DataSpec,
    Hex32,
    Lineage,
    NetworkSpec,
    RewardSpec,
    SpecError,
    SubmissionSpec,
    TrainingSpec,
    checked_group,
    int_layer_keys,
)

FORMAT = "tessera-successor/1"
GRACE_ROUNDS = 2
"""The fewest rounds between the round in progress and a successor's activation round when a node takes it in:
gossip, a restart or a validator's re-announcement has that long to bring it to every node before it is due."""
SIGNING_TAG = b"tessera-successor/1\x00"
"""What a signature signs before the body's hash: no other signed bytes of the protocol (envelopes are JSON
objects) begin so, so a signature over a document can never pass as a message's, nor the other way round."""
CHANGES = ("data", "training", "rewards", "aggregation", "submission")
"""The spec sections a successor replaces, beside `group`."""
MAX_DOCUMENT_BYTES = 1 << 20
"""The largest signed document a node fetches: far over any group's and validator set's (a few KiB)."""
Hex64 = Annotated[str, Field(min_length=128, max_length=128, pattern=r"^[0-9a-f]{128}$")]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


class Selection(_Strict):
    """How the group was chosen, as `tessera select-experts` reported it: a record for people, not a rule."""

    rule: str = Field(min_length=1, max_length=64, description="The statistic that ranked the experts.")
    state: Hex32 | None = Field(default=None, description="The adopted state the routing was measured on; "
                                "None: the base model.")
    data_sha256: list[Hex32] = Field(default_factory=list, max_length=64, description="The domain files measured.")


class Signature(_Strict):
    """One validator's Ed25519 signature of SIGNING_TAG + the body's SHA-256 (raw bytes)."""

    validator: Hex32
    signature: Hex64


class SuccessorDocument(_Strict):
    """A successor document with the signatures gathered so far; `hash` names its body."""

    format: Literal["tessera-successor/1"]
    predecessor: Hex32 = Field(description="Network id of the spec this one succeeds.")
    activation: int = Field(ge=1, le=MAX_ROUND, description="The first round the successor is in force.")
    group: dict[int, list[int]] = Field(description="The next expert group: {layer: [expert ids]}.")
    data: DataSpec
    training: TrainingSpec
    rewards: RewardSpec
    aggregation: AggregationSpec
    submission: SubmissionSpec
    selection: Selection | None = None
    signatures: list[Signature] = Field(default_factory=list, max_length=4096)

    @field_validator("group")
    @classmethod
    def _group(cls, value: dict[int, list[int]]) -> dict[int, list[int]]:
        return checked_group(value)

    def body(self) -> dict[str, Any]:
        """The signed part as JSON-able data (group keys as strings): everything but the signatures."""
        data = self.model_dump(mode="json", exclude={"signatures"})
        data["group"] = {str(layer): experts for layer, experts in self.group.items()}
        return data

    @property
    def hash(self) -> str:
        """SHA-256 of the body's canonical JSON: what validators sign and a successor spec's lineage names."""
        return sha256_hex(canonical_json(self.body()))

    def to_bytes(self) -> bytes:
        """The whole document, signatures included, as canonical JSON: its bytes as a blob."""
        return canonical_json({**self.body(), "signatures": [s.model_dump() for s in self.signatures]})

    def signed_by(self, identity: Identity) -> SuccessorDocument:
        """This document with `identity`'s signature added (or replacing its earlier one)."""
        signature = Signature(validator=identity.node_id, signature=identity.sign(signing_bytes(self.hash)).hex())
        others = [s for s in self.signatures if s.validator != identity.node_id]
        return self.model_copy(update={"signatures": sorted([*others, signature], key=lambda s: s.validator)})


def signing_bytes(document_hash: str) -> bytes:
    """What a validator signs for the document whose body hashes to `document_hash`."""
    return SIGNING_TAG + bytes.fromhex(document_hash)


def parse_document(data: Mapping[str, object]) -> SuccessorDocument:
    """A successor document from decoded TOML or JSON; SpecError naming the field."""
    try:
        fixed = int_layer_keys(dict(data))
        return SuccessorDocument.model_validate(fixed)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "document"
        raise SpecError(f"{where}: {err['msg'].removeprefix('Value error, ')}") from exc
    except ValueError as exc:  # a layer key given twice
        raise SpecError(str(exc)) from exc


def decode_document(data: bytes) -> SuccessorDocument:
    """A document as a peer sends it (`SuccessorDocument.to_bytes`); SpecError for anything else."""
    if len(data) > MAX_DOCUMENT_BYTES:
        raise SpecError(f"the document is {len(data)} bytes, over {MAX_DOCUMENT_BYTES}")
    try:
        decoded = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SpecError(f"not a JSON document: {exc}") from exc
    if not isinstance(decoded, dict):
        raise SpecError("not a successor document: a JSON object was expected")
    document = parse_document(decoded)
    if document.to_bytes() != data:
        raise SpecError("the document is not in canonical form")
    return document


def load_document(path: Path) -> SuccessorDocument:
    """Read a successor document file (TOML, as `tessera spec successor` writes it); SpecError naming the file."""
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise SpecError(f"{path}: no such successor document") from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecError(f"{path}: cannot read: {exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise SpecError(f"{path}: not valid TOML: {exc}") from exc
    if data.get("format") != FORMAT:
        raise SpecError(f"{path}: not a successor document (its format is not {FORMAT!r})")
    try:
        return parse_document(data)
    except SpecError as exc:
        raise SpecError(f"{path}: {exc}") from exc


def draft(predecessor: NetworkSpec, activation: int, group: Mapping[int, list[int]],
          changes: Mapping[str, Mapping[str, Any]] = {}, selection: Selection | None = None) -> SuccessorDocument:
    """An unsigned document: `predecessor`'s sections, each of `changes` (section -> fields) written over its own;
    SpecError naming the field for a value the spec refuses."""
    sections = {name: {**getattr(predecessor, name).model_dump(mode="json"), **changes.get(name, {})}
                for name in CHANGES}
    return parse_document({"format": FORMAT, "predecessor": predecessor.network_id, "activation": activation,
                           "group": {str(layer): list(experts) for layer, experts in group.items()},
                           **sections, **({} if selection is None else {"selection": selection.model_dump()})})


def signers(document: SuccessorDocument, validators: Mapping[str, float]) -> tuple[float, str | None]:
    """The weight of the validators whose signatures verify, and the first problem with a signature (None if
    none): a key outside `validators`, a validator that signed twice, or a signature that does not verify."""
    message, seen, weight = signing_bytes(document.hash), set(), 0.0
    for entry in document.signatures:
        short = entry.validator[:16]
        if entry.validator not in validators:
            return weight, f"signed by {short}..., which is not a validator of the predecessor"
        if entry.validator in seen:
            return weight, f"signed twice by validator {short}..."
        if not verify(entry.validator, message, bytes.fromhex(entry.signature)):
            return weight, f"the signature of validator {short}... does not verify"
        seen.add(entry.validator)
        weight += validators[entry.validator]
    return weight, None


def majority(weight: float, validators: Mapping[str, float]) -> bool:
    """Whether `weight` is a strict majority of the validator set's total weight."""
    return 2 * weight > math.fsum(validators.values())


def judge_document(document: SuccessorDocument, predecessor: NetworkSpec, round: int,
                   experts: Mapping[int, int] | None = None) -> str | None:
    """Why a node running `predecessor` in round `round` refuses `document`, in one line; None: it is sound.

    `experts`: the model's MoE layers and how many routed experts each holds (None: not checked here)."""
    if document.predecessor != predecessor.network_id:
        return (f"it names predecessor {document.predecessor[:16]}..., but this network runs spec "
                f"{predecessor.network_id[:16]}...")
    if document.activation <= round:
        return f"its activation round {document.activation} has already begun (round {round} is in progress)"
    if document.activation < round + GRACE_ROUNDS:
        return (f"its activation round {document.activation} is too soon: it must be at least {GRACE_ROUNDS} rounds "
                f"after the round in progress ({round})")
    if experts is not None and (lacking := missing_experts(document.group, experts)) is not None:
        return lacking
    validators = predecessor.validator_weights
    weight, problem = signers(document, validators)
    if problem is not None:
        return problem
    if not majority(weight, validators):
        count = len(document.signatures)
        return (f"signed by {count} of {len(validators)} validators (weight {weight:g} of "
                f"{math.fsum(validators.values()):g}); it needs validators holding more than half the weight")
    return None


def missing_experts(group: Mapping[int, list[int]], experts: Mapping[int, int]) -> str | None:
    """The first layer or expert of `group` the model lacks, in one line; None when it has them all.
    `experts`: the model's MoE layers -> how many routed experts each holds."""
    for layer, ids in sorted(group.items()):
        if layer not in experts:
            return f"group layer {layer} is not an MoE layer of the model (MoE layers: {sorted(experts)})"
        lacking = [e for e in ids if e >= experts[layer]]
        if lacking:
            return f"group layer {layer}: experts {lacking} do not exist (the model has {experts[layer]})"
    return None


def successor_spec(predecessor: NetworkSpec, document: SuccessorDocument, base: str) -> NetworkSpec:
    """The spec in force from `document.activation`, on `base`, the predecessor's adopted state at the end of the
    round before; every node derives the same one from the same three. `document` must name `predecessor`."""
    assert document.predecessor == predecessor.network_id, "a successor of another spec"
    inherits = list(predecessor.lineage.inherits) if predecessor.lineage is not None else []
    if base != predecessor.root:  # the predecessor changed its group's experts: they go into the base model
        inherits.append(base)
    lineage = Lineage(genesis=predecessor.gossip_id, predecessor=predecessor.network_id, document=document.hash,
                      activation=document.activation, base=base, inherits=inherits)
    changed = {name: getattr(document, name) for name in CHANGES}
    return predecessor.model_copy(update={"group": document.group, **changed, "lineage": lineage})


def spec_from_bytes(data: bytes) -> NetworkSpec:
    """A spec sent as its canonical bytes (a successor spec travels so, addressed by its network id); SpecError
    when the bytes are not one in canonical form."""
    from protocol.spec import parse_spec

    try:
        decoded = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SpecError(f"not a JSON spec: {exc}") from exc
    if not isinstance(decoded, dict):
        raise SpecError("not a spec: a JSON object was expected")
    spec = parse_spec(decoded)
    if spec.canonical_bytes() != data:
        raise SpecError("the spec is not in canonical form")
    return spec


def judge_successor_spec(spec: NetworkSpec, predecessor: NetworkSpec) -> str | None:
    """Why `spec`, offered as the successor of `predecessor` (a node that missed its activation fetches it from
    the validators that announce it), is not one, in one line; None: it follows `predecessor` and changes only
    what a successor may change. Its base and document are the announcing validators' word, as a head is."""
    lineage = spec.lineage
    if lineage is None or lineage.predecessor != predecessor.network_id:
        return f"it does not succeed spec {predecessor.network_id[:16]}..."
    if lineage.genesis != predecessor.gossip_id or lineage.activation <= predecessor.first_round:
        return "its lineage does not continue its predecessor's"
    expected_inherits = list(predecessor.lineage.inherits) if predecessor.lineage is not None else []
    if lineage.base != predecessor.root:
        expected_inherits.append(lineage.base)
    if lineage.inherits != expected_inherits:
        return "it inherits other states than its predecessor's and its base"
    fixed = {"group", "lineage", *CHANGES}
    if spec.model_dump(exclude=fixed) != predecessor.model_dump(exclude=fixed):
        return "it changes what a successor cannot (name, genesis, timing, model, validators or limits)"
    return None

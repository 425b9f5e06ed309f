"""Application messages and the signed envelope that carries them over gossip.

Every message is a strict, frozen pydantic model (`extra="forbid"`, no type coercion). An
`Envelope` wraps one message as `{network, kind, sender, round, body, signature}`; the signature
covers the canonical JSON of every other field. Envelopes travel as canonical JSON bytes.
This module decodes and signs; deciding whether a message is acceptable lives in `check`.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from protocol.encoding import canonical_json, sha256_hex
from protocol.identity import Identity, verify

Hex32 = Annotated[str, Field(min_length=64, max_length=64, pattern=r"^[0-9a-f]{64}$")]
MAX_ROUND = 10**15
"""The largest round a message may name: far past any network's life (10**15 one-minute rounds are 2 billion
years), and small enough that the schedule's float maths on it stays finite, so `check` can judge any
envelope; a round near 10**309 from a peer overflowed there before the signature was checked."""
Round = Annotated[int, Field(ge=0, le=MAX_ROUND)]


MAX_REPORT_ENTRIES = 1024
"""The most miners one ScoreReport names; a spec's message size limit may allow fewer (`report_capacity`)."""
REPORT_REASON_CHARS = 48
"""What `fit_report` cuts reasons to first, when a report would not fit in one message."""


class DecodeError(ValueError):
    """Bytes from a peer are not a well-formed envelope or message."""


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)
    round: Round


class SeedCommit(_Message):
    """A validator's commitment to its round seed: SHA256(seed)."""

    kind: Literal["seed_commit"] = "seed_commit"
    commitment: Hex32


class SeedReveal(_Message):
    """A validator's round seed, revealed after the commit window closed."""

    kind: Literal["seed_reveal"] = "seed_reveal"
    seed: Hex32


class Commit(_Message):
    """A miner's commitment c = SHA256(checkpoint)."""

    kind: Literal["commit"] = "commit"
    commitment: Hex32


class Reveal(_Message):
    """A miner's reveal: the blob with address `commitment` and `size` bytes is now served."""

    kind: Literal["reveal"] = "reveal"
    commitment: Hex32
    size: int = Field(gt=0)


class ScoreEntry(BaseModel):
    """One miner's result in a validator's report: a loss, or the verdict that refused it."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)
    miner: Hex32
    commitment: Hex32
    loss: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    verdict: Literal["accept", "reject", "missing"]
    reason: str = Field(default="", max_length=200)

    @model_validator(mode="after")
    def _loss_iff_accepted(self) -> ScoreEntry:
        if (self.loss is not None) != (self.verdict == "accept"):
            raise ValueError("an entry carries a loss exactly when its verdict is 'accept'")
        return self


class ScoreReport(_Message):
    """A validator's Proof-of-Loss results for the miners assigned to it."""

    kind: Literal["score_report"] = "score_report"
    base: Hex32
    base_loss: float = Field(ge=0, allow_inf_nan=False)
    entries: tuple[ScoreEntry, ...] = Field(max_length=MAX_REPORT_ENTRIES)


class GlobalState(_Message):
    """A validator's next global expert state: its hash, its parent and who contributed."""

    kind: Literal["global_state"] = "global_state"
    hash: Hex32
    parent: Hex32
    contributors: tuple[Hex32, ...] = Field(max_length=1024)
    momentum: Hex32 | None = Field(default=None, description="Hash of the outer momentum blob, for re-syncs.")


class Heartbeat(_Message):
    """Liveness and head announcement; any node, any phase."""

    kind: Literal["heartbeat"] = "heartbeat"
    role: Literal["miner", "validator", "bootstrap"]
    head: Hex32
    momentum: Hex32 | None = Field(default=None, description="Validators: hash of the outer momentum blob of "
                                   "`head`, so a node that missed the round's votes can follow and re-sync.")
    spec: Hex32 | None = Field(default=None, description="Network id of the successor spec the sender runs this "
                               "round (protocol.successor); absent: the genesis spec.")


class Successor(_Message):
    """A signed successor document (protocol.successor) is served by its address: any node may offer one."""

    kind: Literal["successor"] = "successor"
    document: Hex32 = Field(description="SHA-256 of the document's bytes (signatures included): its blob address.")
    size: int = Field(gt=0)


Message = SeedCommit | SeedReveal | Commit | Reveal | ScoreReport | GlobalState | Heartbeat | Successor
Kind = Literal["seed_commit", "seed_reveal", "commit", "reveal", "score_report", "global_state", "heartbeat",
               "successor"]
MESSAGE_TYPES: dict[str, type[_Message]] = {
    cls.model_fields["kind"].default: cls
    for cls in (SeedCommit, SeedReveal, Commit, Reveal, ScoreReport, GlobalState, Heartbeat, Successor)
}
VALIDATOR_KINDS = frozenset({"seed_commit", "seed_reveal", "score_report", "global_state"})


class Envelope(BaseModel):
    """A signed message: the unit of gossip."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)
    network: Hex32
    kind: Kind
    sender: Hex32
    round: Round
    body: dict[str, object]
    signature: Annotated[str, Field(min_length=128, max_length=128, pattern=r"^[0-9a-f]{128}$")]

    def signed_bytes(self) -> bytes:
        """The canonical bytes the signature covers: every field but the signature."""
        return canonical_json(self.model_dump(mode="json", exclude={"signature"}))

    def to_bytes(self) -> bytes:
        return canonical_json(self.model_dump(mode="json"))

    @property
    def message_id(self) -> str:
        """Content id for de-duplication: SHA-256 of the canonical envelope."""
        return sha256_hex(self.to_bytes())

    def signature_ok(self) -> bool:
        return verify(self.sender, self.signed_bytes(), bytes.fromhex(self.signature))

    def message(self) -> Message:
        """Decode the body into its strict model; raises DecodeError if it does not fit `kind`."""
        cls = MESSAGE_TYPES[self.kind]
        if "kind" in self.body:
            raise DecodeError(f"{self.kind} body: the kind belongs in the envelope, not the body")
        try:
            msg = cls.model_validate_json(canonical_json({**self.body, "kind": self.kind}))
        except ValidationError as exc:
            raise DecodeError(f"{self.kind} body: {_first_error(exc)}") from exc
        # One message, one body: a float field takes a JSON integer, so 2 and 2.0 would both decode to it.
        if canonical_json(msg.model_dump(mode="json", exclude_unset=True, exclude={"kind"})) != canonical_json(self.body):
            raise DecodeError(f"{self.kind} body: not in canonical form (write every float with a fraction, e.g. 2.0)")
        return msg  # type: ignore[return-value]


def seal(message: Message, network: str, identity: Identity) -> Envelope:
    """Wrap and sign `message` for `network` as `identity`."""
    body = message.model_dump(mode="json", exclude={"kind"})
    unsigned = {
        "network": network,
        "kind": message.kind,
        "sender": identity.node_id,
        "round": message.round,
        "body": body,
    }
    signature = identity.sign(canonical_json(unsigned)).hex()
    return Envelope.model_validate({**unsigned, "signature": signature})


def decode_envelope(data: bytes, max_bytes: int) -> Envelope:
    """Parse envelope bytes from a peer; raises DecodeError for anything malformed or oversized."""
    if len(data) > max_bytes:
        raise DecodeError(f"envelope of {len(data)} bytes exceeds the {max_bytes}-byte limit")
    try:
        envelope = Envelope.model_validate_json(data)
    except ValidationError as exc:
        raise DecodeError(f"envelope: {_first_error(exc)}") from exc
    if envelope.to_bytes() != data:
        raise DecodeError("envelope is not in canonical encoding")
    return envelope


def _first_error(exc: ValidationError) -> str:
    err = exc.errors()[0]
    where = ".".join(str(p) for p in err["loc"]) or "value"
    return f"{where}: {err['msg']}"


# -- score report size -----------------------------------------------------------------------------

_LONGEST_LOSS = 2.2250738585072014e-308  # a finite non-negative float with one of the longest JSON forms


def report_bytes(report: ScoreReport) -> int:
    """The size of `report` sealed in an envelope (every network id, sender and signature has one length)."""
    envelope = {"network": "0" * 64, "kind": report.kind, "sender": "0" * 64, "round": report.round,
                "body": report.model_dump(mode="json", exclude={"kind"}), "signature": "0" * 128}
    return len(canonical_json(envelope))


def report_capacity(max_message_bytes: int) -> int:
    """How many miners one ScoreReport can carry within `max_message_bytes`: every entry at its longest
    with an empty reason (`fit_report` shortens reasons to fit), at most the report's entry limit."""
    def longest(n: int) -> int:
        entry = ScoreEntry(miner="f" * 64, commitment="f" * 64, loss=_LONGEST_LOSS, verdict="accept")
        return report_bytes(ScoreReport(round=MAX_ROUND, base="f" * 64, base_loss=_LONGEST_LOSS,
                                        entries=(entry,) * n))

    first = longest(1)
    each = longest(2) - first
    return max(0, min(MAX_REPORT_ENTRIES, (max_message_bytes - first) // each + 1))


def fit_report(report: ScoreReport, max_message_bytes: int) -> ScoreReport:
    """`report` with its entries' reasons cut short, or dropped, if that is what it takes to fit in a
    `max_message_bytes` envelope; unchanged when it fits. Reasons only explain a verdict to people."""
    fitted = report
    for keep in (REPORT_REASON_CHARS, 0):
        if report_bytes(fitted) <= max_message_bytes:
            break
        fitted = report.model_copy(update={"entries": tuple(e.model_copy(update={"reason": e.reason[:keep]})
                                                            for e in report.entries)})
    return fitted

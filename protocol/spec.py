"""The network spec (genesis): what every node of one network must agree on, loaded from TOML.

A spec fixes timing, the base model, the expert group, the data, the validator set, rewards,
aggregation and limits. Its SHA-256 over a canonical encoding is the network id carried in every
message. Paths in a spec are relative to the spec file and stay as written in the canonical form,
so the id does not depend on where a node keeps its files; the files themselves are pinned by
hashes (`base_hash` and `config_sha256` for the model, `heldout_sha256` and `general_sha256` for the held-out
data). The id hashes every field, the defaults of those a file leaves out too, so a spec file that writes every
field (`written_out`) names the same network in every release, and `defaults_left` names what a file leaves to
this release's defaults. This module does not load models or data.
"""

from __future__ import annotations

import math
import tomllib
from collections.abc import Iterable, Iterator, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any, Literal, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from protocol.encoding import canonical_json, sha256_hex
from protocol.identity import is_weak_key

FAMILIES = ("qwen3_moe", "qwen2_moe", "olmoe", "mixtral", "deepseek_v2", "deepseek_v3")
Family = Literal["qwen3_moe", "qwen2_moe", "olmoe", "mixtral", "deepseek_v2", "deepseek_v3"]
Hex32 = Annotated[str, Field(min_length=64, max_length=64, pattern=r"^[0-9a-f]{64}$")]
MIN_PHASE_S = 0.001
"""The shortest phase, in seconds: still thousands of float steps at any timestamp a network lives at. A
phase near a nanosecond is below a timestamp's resolution (about 2e-7 s near 2026), its window collapses
and round arithmetic finds no phase at all."""


class SpecError(ValueError):
    """A spec file is missing, unreadable or invalid; the message names the field."""


class _Strict(BaseModel):
    """Every spec model: unknown fields, type coercion and non-finite floats (inf, nan) are refused."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


class TimingSpec(_Strict):
    """Phase lengths in seconds; round r starts at genesis + r * round_seconds."""

    train_s: float = Field(ge=MIN_PHASE_S, description="TRAIN: miners train, validators publish seed commits.")
    commit_s: float = Field(ge=MIN_PHASE_S, description="COMMIT: miners publish commitments.")
    reveal_s: float = Field(ge=MIN_PHASE_S, description="REVEAL: miners reveal and serve blobs, validators reveal seeds.")
    evaluate_s: float = Field(ge=MIN_PHASE_S, description="EVALUATE: validators score and publish reports.")
    merge_s: float = Field(ge=MIN_PHASE_S, description="MERGE: validators combine, reward, aggregate, publish state.")
    clock_skew_s: float = Field(default=2.0, ge=0, description="Tolerance on every phase boundary.")

    @model_validator(mode="after")
    def _finite_round(self) -> TimingSpec:
        if not math.isfinite(self.round_seconds):
            raise ValueError("the phases add up to a round longer than a float holds")
        return self

    @property
    def round_seconds(self) -> float:
        return self.train_s + self.commit_s + self.reveal_s + self.evaluate_s + self.merge_s


class ModelSpec(_Strict):
    """The base model: a local HF checkpoint directory, or a tiny config plus an init seed."""

    family: Family = Field(description="Transformers MoE family; picks the adapter.")
    checkpoint: str | None = Field(default=None, description="HF checkpoint directory, relative to the spec.")
    config: str | None = Field(default=None, description="HF config JSON for a tiny model, relative to the spec.")
    init_seed: int = Field(default=0, ge=0, description="Seed that initialises a model built from `config`.")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(default="float32", description="Expert dtype in blobs.")
    base_hash: Hex32 = Field(description="SHA-256 of the base weights in canonical form.")
    config_sha256: Hex32 | None = Field(
        default=None, description="SHA-256 of the model config's JSON in canonical form (the checkpoint's "
                                  "config.json, or the `config` file); None: the config is not pinned.")

    @model_validator(mode="after")
    def _one_source(self) -> ModelSpec:
        if (self.checkpoint is None) == (self.config is None):
            raise ValueError("set exactly one of model.checkpoint or model.config")
        return self


class DataSpec(_Strict):
    """Training and held-out data. Validators hold the held-out file; the spec pins its hash."""

    train: list[str] = Field(min_length=1, description="Miners' training files (.txt/.jsonl/.parquet), relative.")
    heldout_sha256: Hex32 = Field(description="SHA-256 of the validators' held-out file.")
    tokenizer: str = Field(default="byte", description="'byte' or a tokenizer directory, relative to the spec.")
    seq_len: int = Field(default=64, ge=8, le=65536, description="Tokens per packed sequence.")
    heldout_sequences: int = Field(default=64, ge=1, description="Held-out sequences scored each round.")
    gate_sequences: int = Field(
        default=64, ge=1,
        description="Held-out sequences the merge gate scores each round, drawn by the round seed from the rows "
        "the round's scores leave out (the held-out file holds at least heldout_sequences + gate_sequences).")
    general_sha256: Hex32 | None = Field(
        default=None,
        description="SHA-256 of the validators' general-domain held-out file, on which the merge gate measures "
        "forgetting (aggregation.forgetting_budget); None: validators hold none and forgetting is not checked.")


class TrainingSpec(_Strict):
    """The inner loop the network asks miners to run."""

    inner_steps: int = Field(default=20, ge=1, description="H: local AdamW steps per round.")
    lr: float = Field(default=1e-3, gt=0, description="Inner AdamW learning rate.")
    beta1: float = Field(
        default=0.6561, ge=0, lt=1,
        description="Inner AdamW beta1, the first moment's decay: 0.6561 (0.9^4), where AdamW's usual 0.9 averages "
        "over about as many steps as a round of H = 20 takes (docs/learning.md as of commit 3cb31c3 has the "
        "measurement, on its skill domains).")
    weight_decay: float = Field(default=0.0, ge=0, description="Inner AdamW weight decay.")
    batch_size: int = Field(default=8, ge=1, description="Sequences per inner step.")
    grad_clip: float = Field(default=1.0, gt=0, description="Global gradient-norm clip.")


class ValidatorEntry(_Strict):
    """One member of the validator set."""

    key: Hex32 = Field(description="Ed25519 public key, hex (the validator's node id).")
    weight: float = Field(default=1.0, gt=0, description="Stake: weight in global-state votes.")

    @field_validator("key")
    @classmethod
    def _strong_key(cls, value: str) -> str:
        if is_weak_key(bytes.fromhex(value)):
            raise ValueError("not a usable Ed25519 public key (a small-order point or a non-canonical encoding, "
                             "for which anyone can sign)")
        return value


class RewardSpec(_Strict):
    """Assignment, ranking and rewards."""

    replication: int = Field(default=2, ge=1, description="R: validators that evaluate each miner.")
    top_k: int = Field(default=3, ge=1, description="Miners ranked 1..K with positive utility earn points.")
    ema_alpha: float = Field(default=0.3, gt=0, le=1, description="Weight of this round in the standing EMA.")
    duplicate_cosine: float = Field(
        default=0.9999, gt=0, le=1,
        description="Cosine at which two updates are copies: honest miners starting from one state agree closely, "
        "a copied blob has cosine 1 (docs/learning.md as of commit 3cb31c3 has how close honest miners come).")


class AggregationSpec(_Strict):
    """The outer optimizer that merges the best pseudo-gradients, and the merge gate that adopts a state. The
    defaults are the learning benchmark's pick at the spec's default H = 20 and top-G 3 (docs/learning.md as of
    commit 3cb31c3, on its skill domains)."""

    top_g: int = Field(default=3, ge=1, description="How many top-ranked miners are merged.")
    outer_lr: float = Field(default=1.25, gt=0, description="Nesterov SGD learning rate; a step over one miner's "
                            "update is taken at no more than 1.")
    momentum: float = Field(default=0.0, ge=0, lt=1, description="Nesterov momentum.")
    weighting: Literal["uniform", "utility"] = Field(default="uniform", description="How merged updates are weighted.")
    clip_to_median: bool = Field(default=True, description="Clip each pseudo-gradient to the median norm.")
    gate_margin: float = Field(
        default=1e-4, ge=0,
        description="Nats by which the merge gate needs a candidate's gain over the state it would replace, at the "
        "low end of the gain's paired 95% interval on the gate rows: far wider than the differences between "
        "validators that measure on other hardware (docs/protocol.md §7).")
    forgetting_budget: float | None = Field(
        default=None, ge=0,
        description="Where the spec pins a general-domain held-out file (data.general_sha256): the most a candidate "
        "state may raise its loss there over the current state (a successor spec: over its base state, the value at "
        "the switch), in nats, and still be adopted by the merge gate. "
        "None: the gate reports each candidate's general-domain loss and refuses none for it (tuning experts to "
        "a domain forgets some general loss; docs/learning.md measures how much against single-node tuning).")


class LimitSpec(_Strict):
    """Size limits on what peers may send."""

    max_message_bytes: int = Field(default=65536, ge=1024, le=1 << 20, description="Largest gossip envelope.")
    max_header_bytes: int = Field(default=1 << 20, ge=1024, description="Largest safetensors header in a blob.")


class SubmissionSpec(_Strict):
    """What miners submit: full experts, or a compressed pseudo-gradient (top-k per chunk, quantised).

    `pgrad` blobs hold, per expert tensor, `.idx` (in-chunk indices: U8 for chunks of at most 256
    entries, else I16), `.q` (I8, or U8 with four 2-bit codes per byte) and `.scale` (F32, one per
    chunk), for the 1/`partitions` of the group's chunks that the round and the miner's id draw;
    training.pgrad defines the layout. The defaults are the learning benchmark's choice: 40 of 256 entries
    in half the chunks, 19x smaller than bf16 experts, and more miners cover more chunks.
    """

    format: Literal["experts", "pgrad"] = Field(default="experts", description="Submission format.")
    chunk: int = Field(default=256, ge=1, le=32768, description="pgrad: entries per chunk.")
    topk: int = Field(default=40, ge=4, description="pgrad: entries kept per chunk, a multiple of 4.")
    quant: Literal["int8", "2bit"] = Field(default="2bit", description="pgrad: how kept values are quantised.")
    partitions: int = Field(default=2, ge=1, le=64,
                            description="pgrad: a blob carries 1/partitions of the chunks, drawn per miner and round.")

    @model_validator(mode="after")
    def _topk_fits(self) -> SubmissionSpec:
        if self.topk % 4 or self.topk > self.chunk:
            raise ValueError(f"topk must be a multiple of 4 and at most chunk, got {self.topk}")
        return self


class Lineage(_Strict):
    """Where a successor spec comes from (`protocol.successor.successor_spec` derives it); a genesis spec has none."""

    genesis: Hex32 = Field(description="Network id of the network's genesis spec: the gossip topic and every "
                           "envelope's `network`, for the network's whole life.")
    predecessor: Hex32 = Field(description="Network id of the spec this one succeeds.")
    document: Hex32 = Field(description="SHA-256 of the successor document's body (signatures aside).")
    activation: int = Field(ge=1, description="The first round in which this spec is in force.")
    base: Hex32 = Field(description="The predecessor's adopted state at the end of round activation - 1: the root "
                        "of this spec's chain of global states.")
    inherits: list[Hex32] = Field(default_factory=list, description="Global states of earlier specs, oldest first, "
                                  "written into the base model before this spec's group is cut from it.")


class NetworkSpec(_Strict):
    """Everything one network agrees on. `network_id` hashes its canonical encoding."""

    name: str = Field(min_length=1, max_length=64, description="Human name of the network.")
    genesis: datetime = Field(description="UTC start of round 0.")
    timing: TimingSpec
    model: ModelSpec
    group: dict[int, list[int]] = Field(description="Expert group: {layer: [expert ids]}.")
    data: DataSpec
    training: TrainingSpec = TrainingSpec()
    validators: list[ValidatorEntry] = Field(min_length=1)
    rewards: RewardSpec = RewardSpec()
    aggregation: AggregationSpec = AggregationSpec()
    limits: LimitSpec = LimitSpec()
    submission: SubmissionSpec = SubmissionSpec()
    lineage: Lineage | None = Field(default=None, description="Set in a successor spec only: its predecessor, "
                                    "activation round and base state.")

    @field_validator("genesis")
    @classmethod
    def _utc(cls, value: datetime) -> datetime:
        if value.tzinfo is None:
            raise ValueError("genesis must carry a UTC offset, e.g. 2026-01-01T00:00:00Z")
        return value.astimezone(UTC)

    @field_validator("group")
    @classmethod
    def _group(cls, value: dict[int, list[int]]) -> dict[int, list[int]]:
        return checked_group(value)

    @field_validator("validators")
    @classmethod
    def _distinct_validators(cls, value: list[ValidatorEntry]) -> list[ValidatorEntry]:
        keys = [v.key for v in value]
        if len(set(keys)) != len(keys):
            raise ValueError("a validator key appears twice")
        try:
            total = math.fsum(v.weight for v in value)
        except OverflowError:
            total = math.inf
        if not math.isfinite(2 * total):  # votes compare twice a hash's backing with the total
            raise ValueError("the validators' weights add up to more than a float holds")
        return value

    @property
    def genesis_ts(self) -> float:
        """Genesis as a POSIX timestamp."""
        return self.genesis.timestamp()

    @property
    def validator_weights(self) -> dict[str, float]:
        """Validator node id -> weight."""
        return {v.key: v.weight for v in self.validators}

    @property
    def total_validator_weight(self) -> float:
        return sum(v.weight for v in self.validators)

    @property
    def first_round(self) -> int:
        """The first round in which this spec is in force: 0, or a successor's activation round."""
        return 0 if self.lineage is None else self.lineage.activation

    @property
    def root(self) -> str:
        """The root of this spec's chain of global states: the base model's hash, or a successor's base state."""
        return self.model.base_hash if self.lineage is None else self.lineage.base

    @property
    def gossip_id(self) -> str:
        """The id every envelope carries and the gossip topic is named by: the genesis spec's network id."""
        return self.network_id if self.lineage is None else self.lineage.genesis

    def canonical_bytes(self) -> bytes:
        """The canonical encoding that `network_id` hashes: every field, defaults and nulls included, but for the
        `lineage` of a genesis spec (which has none), so that field left the ids of genesis specs as they were."""
        data = self.model_dump(mode="json", exclude={"lineage"} if self.lineage is None else None)
        data["group"] = {str(k): v for k, v in self.group.items()}
        return canonical_json(data)

    @property
    def network_id(self) -> str:
        """SHA-256 of the canonical spec: the id carried in every message."""
        return sha256_hex(self.canonical_bytes())


def checked_group(value: dict[int, list[int]]) -> dict[int, list[int]]:
    """An expert group with layers and experts sorted; ValueError for an empty one, a negative layer or a layer
    naming no, negative or repeated experts."""
    if not value:
        raise ValueError("the expert group is empty")
    for layer, experts in value.items():
        if layer < 0:
            raise ValueError(f"layer {layer} is negative")
        if not experts:
            raise ValueError(f"layer {layer} selects no experts")
        if any(e < 0 for e in experts) or len(set(experts)) != len(experts):
            raise ValueError(f"layer {layer}: expert ids must be distinct and non-negative")
    return {layer: sorted(value[layer]) for layer in sorted(value)}


def int_layer_keys(data: dict[str, object]) -> dict[str, object]:
    """Decoded TOML or JSON data with its `group` keyed by integer layers (TOML and JSON keys are strings);
    SpecError for a key that is not an integer or a layer given twice (`1` and `01`)."""
    fixed = dict(data)
    if isinstance(fixed.get("group"), dict):
        group: dict[int, object] = {}
        for key, experts in fixed["group"].items():  # type: ignore[attr-defined]
            try:
                layer = int(key)
            except ValueError as exc:
                raise SpecError("group: layer keys must be integers, e.g. 0 = [1, 5]") from exc
            if layer in group:
                raise SpecError(f"group: layer {layer} is given twice, as {key!r} and another spelling")
            group[layer] = experts
        fixed["group"] = group
    return fixed


def parse_spec(data: dict[str, object]) -> NetworkSpec:
    """Validate a spec from already-decoded TOML data; raises SpecError naming the field."""
    fixed = int_layer_keys(data)
    if isinstance(fixed.get("genesis"), str):
        try:
            fixed["genesis"] = datetime.fromisoformat(fixed["genesis"])  # type: ignore[arg-type]
        except ValueError as exc:
            raise SpecError("genesis: not an ISO 8601 time, e.g. 2026-01-01T00:00:00Z") from exc
    try:
        # Strict: TOML has real types, so a quoted number or a boolean where a number belongs is an error.
        return NetworkSpec.model_validate(fixed)
    except ValidationError as exc:
        raise SpecError(_first_error(exc)) from exc


SETTABLE_SECTIONS: dict[str, type[BaseModel]] = {
    "timing": TimingSpec, "model": ModelSpec, "data": DataSpec, "training": TrainingSpec, "rewards": RewardSpec,
    "aggregation": AggregationSpec, "submission": SubmissionSpec, "limits": LimitSpec}
"""The spec sections a command line may set one field at a time (`--set SECTION.FIELD=VALUE`, the same in
`tessera spec new` and `tessera simulate`), over what the command's own options wrote there."""

DERIVED_FIELDS: dict[str, tuple[str, ...]] = {
    "model": ("family", "checkpoint", "config", "init_seed", "base_hash", "config_sha256"),
    "data": ("train", "heldout_sha256", "general_sha256", "tokenizer")}
"""The fields of settable sections that a command derives from the files it is given (the model, the data):
a setting refuses them, since a value that disagrees with those files makes a spec no node can load."""


def parse_setting(text: str) -> tuple[str, Any]:
    """`section.field=value` as (`section.field`, value): the value is read as TOML (2.5, true, "x"),
    and a bare word that is not TOML (pgrad) as a string. ValueError names a setting without `=`."""
    key, sep, raw = text.partition("=")
    key, raw = key.strip(), raw.strip()
    if not sep or not key or not raw:
        raise ValueError(f"spec setting {text!r}: write it as section.field=value, e.g. aggregation.outer_lr=2.5")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return key, value


def judge_settings(settings: Iterable[tuple[str, Any]]) -> dict[str, dict[str, Any]]:
    """(`section.field`, value) pairs by section, later ones over earlier ones, each section judged by its
    own model (alone: a field's other settings are the defaults, or unset where the section has none);
    ValueError names the setting."""
    sections: dict[str, dict[str, Any]] = {}
    for key, value in settings:
        section, _, field = key.partition(".")
        if section not in SETTABLE_SECTIONS or not field or "." in field:
            raise ValueError(f"cannot set {key!r} in a spec: give section.field with the section one of "
                             f"{', '.join(SETTABLE_SECTIONS)}")
        if field in DERIVED_FIELDS.get(section, ()):
            settable = [name for name in SETTABLE_SECTIONS[section].model_fields if name not in DERIVED_FIELDS[section]]
            raise ValueError(f"cannot set {key!r} in a spec: the command derives it from the files it is given; "
                             f"settable in [{section}]: {', '.join(settable)}")
        sections.setdefault(section, {})[field] = value
    for section, values in sections.items():
        try:
            SETTABLE_SECTIONS[section].model_validate(values)
        except ValidationError as exc:
            errors = [err for err in exc.errors() if err["type"] != "missing"]  # a field the command writes
            if not errors:
                continue
            where = ".".join([section, *(str(part) for part in errors[0]["loc"])])
            why = f"no such field in [{section}]" if errors[0]["type"] == "extra_forbidden" else errors[0]["msg"]
            raise ValueError(f"spec setting {where}: {why.removeprefix('Value error, ')}") from exc
    return sections


def apply_settings(spec: dict[str, Any], settings: Iterable[tuple[str, Any]]) -> None:
    """Write judged settings (`judge_settings`) into decoded spec data, over what its sections hold."""
    for section, values in judge_settings(settings).items():
        spec[section] = {**spec.get(section, {}), **values}


def written_out(spec: NetworkSpec) -> dict[str, Any]:
    """Every field of `spec` with its value, shaped as decoded TOML, for a spec file that leaves nothing to a
    release's defaults (`tessera spec new` writes it): parsed back, it is the same spec with the same network id
    in any release that has the same fields. A field that is unset (None) is left out, as TOML has no null."""
    data = spec.model_dump(mode="python", exclude_none=True)
    data["group"] = {str(layer): experts for layer, experts in spec.group.items()}
    return data


def defaults_left(data: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """The fields that a spec, as decoded TOML `data`, leaves to this release's defaults, with the values they take:
    (`section.field`, value), in the spec's field order. The network id hashes them, so a release with other
    defaults would read the same file as another network. Fields whose default is unset (None) are not listed:
    unset means off in every release."""
    return list(_defaults_left(NetworkSpec, data, ""))


def _defaults_left(model: type[BaseModel], data: Mapping[str, Any], prefix: str) -> Iterator[tuple[str, Any]]:
    for name, info in model.model_fields.items():
        where, nested = f"{prefix}{name}", _nested_model(info.annotation)
        if name in data:
            value = data[name]
            if nested is not None and isinstance(value, Mapping):
                yield from _defaults_left(nested, value, f"{where}.")
            elif nested is not None and isinstance(value, list):
                for i, item in enumerate(value):
                    yield from _defaults_left(nested, item if isinstance(item, Mapping) else {}, f"{where}[{i}].")
            continue
        if info.is_required():
            continue
        default = info.get_default(call_default_factory=True)
        if isinstance(default, BaseModel):
            yield from ((f"{where}.{field}", value) for field, value in default.model_dump(mode="json").items()
                        if value is not None)
        elif default is not None:
            yield where, default


def _nested_model(annotation: Any) -> type[BaseModel] | None:
    """The spec model a field holds, itself or in a list (`validators`); None for a plain value."""
    if get_origin(annotation) is list:
        annotation = get_args(annotation)[0]
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


def load_spec(path: str | Path) -> NetworkSpec:
    """Read and validate a spec TOML file; raises SpecError with one line naming the problem."""
    path = Path(path)
    try:
        text = path.read_bytes().decode("utf-8")
    except FileNotFoundError as exc:
        raise SpecError(f"{path}: no such spec file") from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecError(f"{path}: cannot read spec: {exc}") from exc
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise SpecError(f"{path}: not valid TOML: {exc}") from exc
    try:
        return parse_spec(data)
    except SpecError as exc:
        raise SpecError(f"{path}: {exc}") from exc


def spec_dir_path(spec_path: str | Path, relative: str) -> Path:
    """Resolve a path written in a spec relative to the spec file's directory."""
    return (Path(spec_path).parent / relative).resolve()


def _first_error(exc: ValidationError) -> str:
    err = exc.errors()[0]
    where = ".".join(str(p) for p in err["loc"]) or "spec"
    return f"{where}: {err['msg'].removeprefix('Value error, ')}"

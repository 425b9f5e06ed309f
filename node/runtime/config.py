"""Node configuration: one TOML file plus `TESSERA_*` environment overrides, validated once at load.

Sections are small typed models with defaults; `load_config` reads the file, lets environment
variables override it (nested with `__`, e.g. `TESSERA_HTTP__PORT=9000`), and raises `ConfigError`
naming the file (or variable) and the field. Relative paths are resolved against the config file's
directory. The `[p2p]` section is the network layer's own `P2PConfig` (node.net.config), used by it
as is. This module knows nothing about the network spec's contents, storage or networking; it only
says where things are and how the node should behave.
"""

from __future__ import annotations

import difflib
import json
import os
import tomllib
from pathlib import Path
from types import NoneType, UnionType
from typing import Annotated, Any, Literal, get_args, get_origin

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    model_validator,
)
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from miner.settings import MinerSettings
from node.net.config import P2PConfig

ENV_PREFIX = "TESSERA_"
Role = Literal["miner", "validator"]


class ConfigError(ValueError):
    """A node config file is missing, not TOML, or invalid; the message names the field."""


def _non_empty(value: Any) -> Any:
    if value == "":  # Path("") is the current directory: a data_dir that silently lands next to the config
        raise ValueError("an empty path; name a file or directory")
    return value


ConfigPath = Annotated[Path, BeforeValidator(_non_empty)]
"""A path setting: relative to the config file's directory, never empty."""


def _bind_host(value: str) -> str:
    if not value.strip():  # aiohttp (asyncio) binds every interface, not loopback, to an empty host
        raise ValueError("an empty host would listen on every interface; name the address to bind, e.g. 127.0.0.1")
    return value


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class NodeSection(_Section):
    """Who this node is and where it keeps its files."""

    role: Role = Field(description="'miner' trains target experts; 'validator' scores and merges.")
    spec: ConfigPath = Field(description="The network spec TOML every node of the network shares.")
    key: ConfigPath = Field(default=Path("node.key"), description="Ed25519 key file; created (mode 0600) on first start.")
    data_dir: ConfigPath = Field(default=Path("data"), description="SQLite state, blobs and the rewards ledger.")


class HttpSection(_Section):
    """The local HTTP API (/healthz, /status, /metrics, /rewards)."""

    enabled: bool = Field(default=True, description="Serve the HTTP API.")
    host: Annotated[str, AfterValidator(_bind_host)] = Field(
        default="127.0.0.1", description="Bind address, never empty; keep it on loopback unless proxied."
    )
    port: int = Field(default=8080, ge=0, le=65535, description="TCP port; 0 picks a free one.")


class MinerSection(MinerSettings):
    """How a miner trains: miner.settings.MinerSettings (how this machine trains) and the node's own fields. Of its
    memory settings (`forward`, `micro_batch_size`, `checkpointing`, `autocast`, `optimizer`, `step_in_backward`),
    those the file and the environment leave unset are chosen as the miner starts on CUDA (or on a CPU with
    `device_memory_gib` set): the fastest whose traced plan fits (node.runtime.preflight.fit_memory); elsewhere
    they take their defaults."""

    device_memory_gib: float | None = Field(
        default=None, gt=0, description="GiB training may use: of the CUDA device (unset: its free memory at start), "
        "or of host memory on a CPU (unset: no plan). A miner whose traced plan (`tessera plan`) needs more refuses "
        "to start; the memory settings left unset are chosen to fit it."
    )
    data: ConfigPath | None = Field(default=None, description="Local training file overriding the spec's train files.")


class ValidatorSection(_Section):
    """How a validator evaluates."""

    heldout: ConfigPath | None = Field(default=None, description="The held-out file whose SHA-256 the spec pins.")
    general: ConfigPath | None = Field(
        default=None, description="The general-domain held-out file whose SHA-256 the spec pins as data.general_sha256 "
        "(required where the spec pins one): the merge gate's forgetting check reads it.")
    data: list[ConfigPath] = Field(
        default_factory=list, description="Held-out and general-domain files of successor specs: a validator scores "
        "a successor with the one whose SHA-256 it pins (protocol.successor).")
    device: str = Field(
        default="cpu", description="Torch device for scoring (cpu, cuda, cuda:1); 'auto' spreads the model over all GPUs."
    )
    batch_size: int = Field(default=16, ge=1, description="Held-out sequences per scoring forward pass.")
    device_memory_gib: float | None = Field(
        default=None, gt=0, description="GiB of the CUDA device scoring may use; unset: its free memory at start. "
        "A validator whose traced plan (`tessera plan`) needs more refuses to start."
    )
    weights: Literal["checkpoint", "int8"] = Field(
        default="checkpoint", description="Frozen weights as the checkpoint holds them, or 'int8': attention, dense "
        "and shared-expert layers held weight-only in int8 (the experts scored stay as they are)."
    )
    prefetch_bytes: int = Field(
        default=8 << 30, ge=0,
        description="Bytes of revealed blobs fetched during REVEAL each round (as their reveals declare them), "
        "those assigned to this validator first; 0 prefetches none. What does not fit is fetched at EVALUATE "
        "if this validator scores it.",
    )


class StorageSection(_Section):
    """What the node keeps on disk."""

    blob_retention_rounds: int = Field(default=3, ge=1, description="Rounds of blobs kept before pruning.")
    message_retention_rounds: int = Field(
        default=8, ge=2, description="Rounds of the seen-message log kept; commits, scores and states stay."
    )
    blob_budget_bytes: int | None = Field(
        default=None, ge=0,
        description="Most bytes the blob store may hold: a fetch that would pass it is refused (this node's own "
        "blobs are always written); unset: no budget.",
    )


class NodeConfig(BaseSettings):
    """The whole node config tree; build it with `load_config`, hand sections down."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, env_nested_delimiter="__", extra="forbid", frozen=True, case_sensitive=False
    )

    node: NodeSection
    p2p: P2PConfig = P2PConfig()
    http: HttpSection = HttpSection()
    miner: MinerSection = MinerSection()
    validator: ValidatorSection = ValidatorSection()
    storage: StorageSection = StorageSection()

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # The environment overrides the file, which arrives as init kwargs; no dotenv, no secrets dir.
        return env_settings, init_settings

    @model_validator(mode="after")
    def _role_needs(self) -> NodeConfig:
        if self.node.role == "validator" and self.validator.heldout is None:
            raise ValueError("validator.heldout: a validator needs the held-out file the spec pins")
        return self

    @property
    def db_path(self) -> Path:
        return self.node.data_dir / "node.db"

    @property
    def blob_dir(self) -> Path:
        return self.node.data_dir / "blobs"

    @property
    def rewards_jsonl(self) -> Path:
        return self.node.data_dir / "rewards.jsonl"

    def resolved(self, base: Path) -> NodeConfig:
        """A copy whose relative paths are taken relative to `base` (the config file's directory)."""

        def fix(path: Path | None) -> Path | None:
            return None if path is None else (base / path).resolve()

        node = self.node.model_copy(update={"spec": fix(self.node.spec), "key": fix(self.node.key),
                                            "data_dir": fix(self.node.data_dir)})
        miner = self.miner.model_copy(update={"data": fix(self.miner.data)})
        validator = self.validator.model_copy(update={"heldout": fix(self.validator.heldout),
                                                      "general": fix(self.validator.general),
                                                      "data": [(base / path).resolve() for path in self.validator.data]})
        return self.model_copy(update={"node": node, "miner": miner, "validator": validator})


def load_config(path: str | Path) -> NodeConfig:
    """Read, override from the environment, validate and resolve paths; raises ConfigError."""
    path = Path(path)
    try:
        text = path.read_bytes().decode("utf-8")
    except FileNotFoundError as exc:
        raise ConfigError(f"{path}: no such config file (create one with `tessera init`)") from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read config: {exc}") from exc
    return parse_config(text, path)


def parse_config(text: str, path: Path) -> NodeConfig:
    """`text` as the config file at `path` would be (environment overrides, relative paths); raises ConfigError."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from exc
    for key in data:
        if key.startswith("_"):  # BaseSettings reads `_env_file` and friends from init kwargs
            raise ConfigError(f"{path}: {key}: Extra inputs are not permitted")
    _check_scalar_types(data, path)
    _check_overrides()
    try:
        config = NodeConfig(**data)
    except ValidationError as exc:
        raise ConfigError(_describe(exc, path)) from exc
    return config.resolved(path.parent.resolve())


_TOML_TYPES: dict[type, tuple[tuple[type, ...], str]] = {
    bool: ((bool,), "a valid boolean (true or false)"),
    int: ((int,), "a valid integer"),
    float: ((int, float), "a valid number"),
}


def _check_scalar_types(data: dict[str, Any], path: Path) -> None:
    """Refuse a file value of another TOML type than its field's: pydantic would read `port = true` as 1,
    `enabled = "off"` as false and `2.0` as 2. Environment overrides are text, and are parsed as such."""
    for section, values in data.items():
        field = NodeConfig.model_fields.get(section)
        model = None if field is None else field.annotation
        if not isinstance(values, dict) or not (isinstance(model, type) and issubclass(model, BaseModel)):
            continue  # pydantic names what is wrong there
        for name, value in values.items():
            info = model.model_fields.get(name)
            if info is None or (expected := _TOML_TYPES.get(_scalar(info.annotation))) is None:
                continue
            types, what = expected
            if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
                raise ConfigError(f"{path}: {section}.{name}: Input should be {what}, "
                                  f"got {json.dumps(value, default=str)}")


def _scalar(annotation: Any) -> Any:
    """`int` for `int` and `int | None`; other annotations as they are."""
    if get_origin(annotation) is UnionType:
        args = [arg for arg in get_args(annotation) if arg is not NoneType]
        return args[0] if len(args) == 1 else annotation
    return annotation


def _check_overrides() -> None:
    """Refuse a `TESSERA_*` variable that overrides nothing (a typo would otherwise be ignored), or that
    overrides a whole section or a list with something other than the JSON pydantic-settings reads there."""
    sections = {name: section.annotation for name, section in NodeConfig.model_fields.items()}
    for key, value in os.environ.items():
        if not key.upper().startswith(ENV_PREFIX):
            continue
        section, _, field = key[len(ENV_PREFIX):].lower().partition("__")
        model = sections.get(section)
        if model is None or (field and field not in model.model_fields):
            raise ConfigError(f"{key} (environment): no such setting; overrides are named "
                              f"{ENV_PREFIX}<SECTION>__<FIELD>, e.g. {ENV_PREFIX}HTTP__PORT")
        if not field or get_origin(model.model_fields[field].annotation) in (tuple, list, dict):
            try:
                json.loads(value)
            except json.JSONDecodeError:
                example = f"{ENV_PREFIX}P2P__BOOTSTRAP='[\"/ip4/10.0.0.1/tcp/4001/p2p/<peer id>\"]'"
                raise ConfigError(f"{key} (environment): not JSON; a list takes JSON (a whole section too), "
                                  f"e.g. {example}") from None


def _describe(exc: ValidationError, path: Path) -> str:
    err = exc.errors()[0]
    loc = [str(p) for p in err["loc"]]
    msg = err["msg"].removeprefix("Value error, ")
    if not loc:  # a cross-field rule; its message starts with the field it blames
        return f"{path}: {msg}"
    field = ".".join(loc)
    if err["type"] == "extra_forbidden":
        msg += _did_you_mean(loc)
    for depth in range(len(loc), 0, -1):
        name = ENV_PREFIX + "__".join(loc[:depth]).upper()
        if any(k.upper() == name for k in os.environ):
            return f"{name} (environment): {field}: {msg}"
    return f"{path}: {field}: {msg}"


def _did_you_mean(loc: list[str]) -> str:
    """" (did you mean X?)" for a misspelt section or field, naming the closest one; "" when none is close."""
    model: Any = NodeConfig
    for part in loc[:-1]:
        info = model.model_fields.get(part)
        model = None if info is None else info.annotation
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            return ""
    close = difflib.get_close_matches(loc[-1], list(model.model_fields), n=1)
    return f" (did you mean {'.'.join([*loc[:-1], close[0]])}?)" if close else ""


def render_config(role: Role, spec: Path, key: Path, data_dir: Path, p2p_port: int, http_port: int,
                  heldout: Path | None = None, bootstrap: tuple[str, ...] = (), host: str = "127.0.0.1",
                  announce: tuple[str, ...] = (), general: Path | None = None,
                  settings: dict[str, str | int | float | bool] | None = None) -> str:
    """A commented node config TOML for `tessera init`; paths are written as given; `settings` are fields of the
    role's section (`[miner]` or `[validator]`). The role's device is always written, so an operator sees what the
    node trains or scores on; a miner's memory settings left out are chosen to fit its device as it starts."""
    lines = [
        "# Tessera node config. Environment variables TESSERA_<SECTION>__<FIELD> override it.",
        "[node]",
        f"role = {_q(role)}",
        f"spec = {_q(spec.as_posix())}",
        f"key = {_q(key.as_posix())}",
        f"data_dir = {_q(data_dir.as_posix())}",
        "",
        "[p2p]",
        f"host = {_q(host)}  # the address libp2p listens on; 0.0.0.0 for peers on other hosts",
        f"port = {p2p_port}",
        f"announce = [{', '.join(_q(a) for a in announce)}]  # what peers are told to dial; empty: the listen address",
        f"bootstrap = [{', '.join(_q(b) for b in bootstrap)}]",
        f"# penalty_threshold = {P2PConfig().penalty_threshold}  # REJECTs a peer may send in one round before it is cut off",
        f"# penalty_backoff_s = {P2PConfig().penalty_backoff_s}  # how long it then stays disconnected and undialled",
        "",
        "[http]",
        'host = "127.0.0.1"',
        f"port = {http_port}",
        "",
    ]
    fields = dict(settings or {})
    section = (MinerSection if role == "miner" else ValidatorSection).model_fields
    lines += [f"[{role}]", f"device = {_q(str(fields.pop('device', section['device'].default)))}"]
    if role == "validator":
        lines.append(f"heldout = {_q(heldout.as_posix())}" if heldout is not None else '# heldout = "heldout.txt"')
        if general is not None:
            lines.append(f"general = {_q(general.as_posix())}")
    elif "forward" not in fields:
        lines.append(f"# forward = {_q(section['forward'].default)}  # or compressed: only the group's experts "
                     "(unset on CUDA: chosen to fit the device's memory)")
    lines += [f"{name} = {_toml(value)}" for name, value in fields.items()]
    return "\n".join(lines) + "\n"


def _toml(value: str | int | float | bool) -> str:
    """A TOML value: a string quoted, a boolean in lower case."""
    if isinstance(value, bool):
        return str(value).lower()
    return _q(value) if isinstance(value, str) else repr(value)


def _q(text: str) -> str:
    """A TOML basic string: JSON's escapes (quote, backslash, control, \\u-escapes) are all valid TOML."""
    return json.dumps(text)

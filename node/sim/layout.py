"""Write a self-contained simulation network directory: spec, tiny model config, data and keys.

`make_sim_network` lays out, under one directory:
    spec.toml                 the network spec (valid per protocol.spec)
    base/                     the base model: the pretrained tiny MoE of `training.pretrain` (an HF
                              checkpoint, copied from the pretraining cache; the spec pins its weights
                              and its config.json)
    data/train.jsonl          miners' training data (arithmetic domain, which the base never saw)
    data/heldout.jsonl        validators' held-out data (same domain, another seed, disjoint)
    data/general.jsonl        mixed code and prose, for `select-experts --rule differential`
    keys/validator-{i}.key    the validator keys (mode 0600), derived from the seed
The expert group is chosen by running gate-mass selection on the training data. Miners submit full
experts or, with `submission_format="pgrad"`, compressed pseudo-gradients (protocol.spec's default
chunk, top-k, quantisation and partitions); `settings` (`section.field`, value) land in the spec
last. The base is the same for every seed (pretraining costs seconds, once per cache directory);
everything else is derived from `seed` and `genesis`, so the same arguments write the same bytes.
This module knows nothing about running the network; `tessera simulate` and the tests start
processes from it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

import torch

from node.sim.process import MAX_VALIDATORS
from protocol.identity import Identity, save_identity
from protocol.spec import apply_settings, judge_settings, load_spec
from training.adapters import ADAPTERS, adapter_for
from training.checkpoint import checkpoint_hash, config_hash, read_config
from training.corpus import generate, write_documents
from training.data import file_sha256, pack
from training.model import load_checkpoint
from training.pretrain import PretrainConfig, pretrained_base
from training.selection import select_experts
from training.tokenizer import ByteTokenizer

DEFAULT_TIMING = {"train_s": 40.0, "commit_s": 4.0, "reveal_s": 8.0, "evaluate_s": 8.0, "merge_s": 6.0}
TRAIN_DOCS = 2000
HELDOUT_DOCS = 300
GENERAL_DOCS = 400
SEQ_LEN = 64
SELECTION_SEQUENCES = 64


@dataclass(frozen=True)
class SimNetwork:
    """Where a simulation network's files are, and who its validators are."""

    directory: Path
    spec_path: Path
    network_id: str
    validator_ids: list[str]
    validator_keys: list[Path]
    group: dict[int, list[int]]


def sim_identity(seed: int, role: str, index: int) -> Identity:
    """The deterministic key of simulation node `role`-`index` (e.g. "validator", 0)."""
    return Identity.from_seed(hashlib.sha256(f"tessera-sim:{seed}:{role}:{index}".encode()).digest())


def make_sim_network(
    directory: str | Path,
    validators: int = 2,
    family: str = "qwen3_moe",
    genesis: datetime | None = None,
    timing: Mapping[str, float] | None = None,
    seed: int = 0,
    experts_per_layer: int = 2,
    cache_dir: str | Path | None = None,
    submission_format: Literal["experts", "pgrad"] = "experts",
    settings: Sequence[tuple[str, Any]] = (),
) -> SimNetwork:
    """Create the directory (which must be empty or absent) and write a simulation network into it.

    The pretrained base is cached under `cache_dir` (default: `default_cache_dir()`); miners submit
    full experts or compressed pseudo-gradients as `submission_format` says, and `settings`
    (`protocol.spec.judge_settings`) are written over everything else. The arguments are judged
    before the directory is made, and a failure part-way removes what was written.
    """
    directory = Path(directory).resolve()
    if directory.exists() and any(directory.iterdir()):
        raise ValueError(f"{directory}: directory is not empty; choose a new directory for the simulation")
    if not 1 <= validators <= MAX_VALIDATORS:
        raise ValueError(f"a simulation network takes 1 to {MAX_VALIDATORS} validators, got {validators}")
    if family not in ADAPTERS:
        raise ValueError(f"unknown model family {family!r}; supported: {', '.join(ADAPTERS)}")
    if submission_format not in ("experts", "pgrad"):
        raise ValueError(f"submission format must be 'experts' or 'pgrad', got {submission_format!r}")
    unknown = set(timing or {}) - set(DEFAULT_TIMING) - {"clock_skew_s"}
    if unknown:
        raise ValueError(f"unknown timing field(s): {', '.join(sorted(unknown))}")
    judge_settings(settings)
    created = not directory.exists()
    directory.mkdir(parents=True, exist_ok=True)
    try:
        return _write_network(directory, validators, family, genesis, timing, seed, experts_per_layer, cache_dir,
                              submission_format, settings)
    except BaseException:
        remove_written(directory, created)
        raise


def _write_network(directory: Path, validators: int, family: str, genesis: datetime | None,
                   timing: Mapping[str, float] | None, seed: int, experts_per_layer: int,
                   cache_dir: str | Path | None, submission_format: str,
                   settings: Sequence[tuple[str, Any]]) -> SimNetwork:
    base_hash, config_sha256, group = _write_model_and_data(directory, family, seed, experts_per_layer, cache_dir)
    ids, keys = [], []
    for i in range(validators):
        identity = sim_identity(seed, "validator", i)
        key_path = directory / "keys" / f"validator-{i}.key"
        save_identity(identity, key_path)
        ids.append(identity.node_id)
        keys.append(key_path)

    when = genesis or datetime.now(UTC).replace(microsecond=0)
    spec = {
        "name": f"sim-{seed}",
        "genesis": when.astimezone(UTC),
        "timing": {**DEFAULT_TIMING, **(timing or {})},
        "model": {"family": family, "checkpoint": "base", "base_hash": base_hash, "config_sha256": config_sha256},
        "group": {str(layer): experts for layer, experts in sorted(group.items())},
        "data": {
            "train": ["data/train.jsonl"],
            "heldout_sha256": file_sha256(directory / "data" / "heldout.jsonl"),
            "tokenizer": "byte",
            "seq_len": SEQ_LEN,
        },
        "training": {"inner_steps": 20},
        "validators": [{"key": node_id, "weight": 1.0} for node_id in ids],
    }
    apply_settings(spec, [("submission.format", submission_format), *settings])
    spec_path = directory / "spec.toml"
    spec_path.write_text(to_toml(spec), encoding="utf-8")
    loaded = load_spec(spec_path)
    return SimNetwork(directory, spec_path, loaded.network_id, ids, keys, dict(loaded.group))


def remove_written(directory: Path, created: bool) -> None:
    """Undo a failed write into `directory`, which was absent (`created`) or empty before it."""
    shutil.rmtree(directory, ignore_errors=True)
    if not created:
        directory.mkdir(exist_ok=True)


def default_cache_dir() -> Path:
    """Where simulation networks cache their pretrained base: $XDG_CACHE_HOME/tessera or ~/.cache/tessera."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tessera"


def prepare_base(family: str, cache_dir: str | Path | None = None) -> Path:
    """The pretrained base's cached checkpoint for `family`, trained now if the cache lacks it.

    Call it before fixing a genesis time: pretraining into a cold cache can take a minute on a busy CPU.
    """
    return pretrained_base(Path(cache_dir) if cache_dir is not None else default_cache_dir(), PretrainConfig(family=family))


def _write_model_and_data(
    directory: Path, family: str, seed: int, experts_per_layer: int, cache_dir: str | Path | None
) -> tuple[str, str, dict[int, list[int]]]:
    base = prepare_base(family, cache_dir)
    shutil.copytree(base, directory / "base")
    train = generate("arithmetic", TRAIN_DOCS, seed)
    seen = set(train)
    heldout = [doc for doc in generate("arithmetic", HELDOUT_DOCS, seed + 1_000_003) if doc not in seen]
    general = generate("code", GENERAL_DOCS // 2, seed) + generate("prose", GENERAL_DOCS // 2, seed)
    data = directory / "data"
    write_documents(data / "train.jsonl", train)
    write_documents(data / "heldout.jsonl", heldout)
    write_documents(data / "general.jsonl", general)

    model = load_checkpoint(directory / "base", dtype=torch.float32, attn_implementation="eager")
    adapter = adapter_for(family)
    sequences = pack(train, ByteTokenizer(), SEQ_LEN)[:SELECTION_SEQUENCES]
    selection = select_experts(model, adapter, sequences, "gate-mass", top_d=experts_per_layer)
    group = {int(layer): ids for layer, ids in selection["group"].items()}
    return checkpoint_hash(directory / "base"), config_hash(read_config(directory / "base")), group


def to_toml(table: Mapping[str, object]) -> str:
    """Write a spec-shaped mapping as TOML: scalars first, then sub-tables, then arrays of tables."""
    lines: list[str] = []
    _emit_table(lines, table, prefix="")
    return "\n".join(lines).strip() + "\n"


def _emit_table(lines: list[str], table: Mapping[str, object], prefix: str) -> None:
    subtables = {k: v for k, v in table.items() if isinstance(v, Mapping)}
    arrays = {k: v for k, v in table.items() if isinstance(v, list) and v and isinstance(v[0], Mapping)}
    for key, value in table.items():
        if key not in subtables and key not in arrays:
            lines.append(f"{_key(key)} = {_value(value)}")
    for key, value in subtables.items():
        name = f"{prefix}{_key(key)}"
        lines.extend(["", f"[{name}]"])
        _emit_table(lines, value, prefix=f"{name}.")
    for key, items in arrays.items():
        for item in items:
            lines.extend(["", f"[[{prefix}{_key(key)}]]"])
            _emit_table(lines, item, prefix=f"{prefix}{_key(key)}.")


def _key(key: str) -> str:
    return key if key.replace("_", "").replace("-", "").isalnum() and key.isascii() else json.dumps(key)


def _value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, datetime):
        return value.isoformat().replace("+00:00", "Z")
    if isinstance(value, list):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {type(value).__name__} as TOML")

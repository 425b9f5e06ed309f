"""A hub checkpoint directory on disk: its weight files and the streaming base hash.

The base hash pins a model's weights in one canonical form: the names, dtypes and shapes of the
model's own `state_dict()` (fused experts, as transformers 5 holds them), framed as follows (all
integers little-endian) after the ASCII tag `tessera-state/1\\n`, for every tensor sorted by name:
    u32 len(name) | name (UTF-8) | u32 len(dtype) | dtype (e.g. "float32") | u32 ndim |
    u64 dim for each dim | u64 nbytes | the tensor's bytes (C order, little-endian)
and the hash is SHA-256 of that stream, as lower-case hex. `checkpoint_hash` computes it straight
from the safetensors files, one source tensor at a time in small reads, using transformers' own
conversion mapping to learn which hub keys make up which model tensor (per-expert keys stacked on
dim 0, gate then up concatenated on dim 1), so it equals `training.model.state_hash` of the model
loaded in the checkpoint's dtype. Each tensor is framed with the dtype it is stored in, so nodes
compare the bytes they were given, whatever dtype they load them in. Checkpoint keys the model
does not have (e.g. DeepSeek's MTP layer) are not part of the model and not hashed. `read_rows` reads
chosen rows (experts) of one model tensor and nothing else, so a compressed miner never reads the
experts it does not train; `row_pieces` says where a row's bytes lie, so an export can write just those. `config_hash` pins the model config beside the weights (a spec's
`config_sha256`): SHA-256 of the config's JSON content in canonical form (protocol.encoding: sorted
keys, compact, UTF-8), so key order and whitespace do not count but every value does, including ones
that change the forward pass without changing a weight (top-k, norm_topk_prob, rope settings). It
hashes the JSON as written, never transformers' view of it, which differs between transformers
versions. `meta_model` is the checkpoint's model on the meta device (names, shapes and layout from
config.json, no weights), which the hash and the row readers map stored keys onto. This module never
loads weights into a model, trains or knows about the network.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeGuard, cast

import torch
from huggingface_hub.errors import StrictDataclassError
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from protocol.encoding import canonical_json, sha256_hex
from training.adapters import adapter_for, family_of
from training.tiny import hf_config

STATE_TAG = b"tessera-state/1\n"
_CHUNK = 8 << 20
_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
           "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}
_EXPERT_INDEX = re.compile(r"\.experts\.(\d+)\.")
_CHECKPOINT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
# What building a model from a checkpoint's config.json raises on values it cannot build (a zero head
# count, a negative vocabulary, an unknown rope type, a field of the wrong type).
_CONFIG_ERRORS = (ArithmeticError, AssertionError, KeyError, RuntimeError, TypeError, ValueError, StrictDataclassError)


@dataclass(frozen=True)
class Stored:
    """One tensor as stored in a safetensors file: its key, where its bytes are, its dtype and shape."""

    key: str
    path: Path
    offset: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]


def tensor_frame(name: str, dtype: str, shape: tuple[int, ...], nbytes: int) -> bytes:
    """The framing that precedes one tensor's bytes in the canonical stream (module docstring)."""
    encoded, dt = name.encode("utf-8"), dtype.encode("ascii")
    return (struct.pack("<I", len(encoded)) + encoded + struct.pack("<I", len(dt)) + dt
            + struct.pack("<I", len(shape)) + b"".join(struct.pack("<Q", d) for d in shape)
            + struct.pack("<Q", nbytes))


def read_config(directory: Path) -> dict[str, Any]:
    """The checkpoint's config.json as a dict; ValueError naming what is missing or wrong."""
    path = directory / "config.json"
    if not directory.is_dir():
        raise ValueError(f"{directory}: not a checkpoint directory")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise ValueError(f"{directory}: no config.json in the checkpoint directory") from exc
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: cannot read the model config: {exc}") from exc
    if not isinstance(config, dict):
        raise ValueError(f"{path}: the model config must be a JSON object")
    return config


def meta_model(directory: str | Path) -> PreTrainedModel:
    """The checkpoint's model with no weights (on the meta device): names, shapes, layout; reads config.json only."""
    directory = Path(directory)
    config = checkpoint_config(directory)
    try:
        with torch.device("meta"):  # transformers leaves from_config unannotated
            model: PreTrainedModel = AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]
    except _CONFIG_ERRORS as exc:  # what torch and transformers raise on values they cannot build
        raise ValueError(f"{directory}: config.json describes no buildable {config.model_type} model: "
                         f"{type(exc).__name__}: {exc}") from exc
    adapter_for(config.model_type).check_layout(model)
    return model


def checkpoint_config(directory: Path) -> PretrainedConfig:
    """The checkpoint's config.json as transformers' config of its family; ValueError naming what is refused
    (a quantized checkpoint, a dtype Tessera does not load)."""
    raw = read_config(directory)
    family = family_of(raw)
    quantization = raw.get("quantization_config")
    if quantization is not None:
        method = quantization.get("quant_method", "?") if isinstance(quantization, dict) else quantization
        raise ValueError(f"{directory}: quantized checkpoints ({str(method)[:40]}) are not supported; "
                         "use a bf16/fp16/fp32 checkpoint")
    config = hf_config(adapter_for(family), raw)
    try:
        stored_dtype(config)
    except ValueError as exc:
        raise ValueError(f"{directory}: {exc}") from None
    return config


def stored_dtype(config: PretrainedConfig) -> torch.dtype:
    """The dtype the checkpoint stores its weights in (config.json's `dtype`), one Tessera loads; ValueError else."""
    dtype = getattr(config, "dtype", None) or torch.float32
    loaded = getattr(torch, dtype, None) if isinstance(dtype, str) else dtype
    if loaded not in _CHECKPOINT_DTYPES:
        raise ValueError(f"config.json has dtype {str(dtype)[:40]!r}; Tessera loads float32, bfloat16, float16 "
                         "or float64 checkpoints")
    return cast(torch.dtype, loaded)


def config_hash(config: dict[str, Any]) -> str:
    """SHA-256 of a model config's JSON content in canonical form (module docstring); ValueError on NaN or Inf."""
    try:
        return sha256_hex(canonical_json(config))
    except ValueError as exc:  # json.loads reads NaN and Infinity, which canonical JSON has no form for
        raise ValueError(f"the model config holds a value JSON cannot hash canonically: {exc}") from exc


def weight_files(directory: Path) -> list[Path]:
    """The checkpoint's safetensors files (from the index when sharded); refuses pickled weights."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"{index}: not a valid safetensors index: {exc}") from exc
        for name in names:  # a shard lies in the checkpoint directory itself, never elsewhere
            if not isinstance(name, str) or name in ("", ".", "..") or Path(name).name != name or "\\" in name:
                raise ValueError(f"{index}: shard name {str(name)[:80]!r} is not a file name in the directory")
        files = sorted(directory / name for name in names)
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ValueError(f"{index}: names shard {missing[0]}, which is not in the directory")
        return files
    files = sorted(directory.glob("*.safetensors"))
    if files:
        return files
    if any(directory.glob("*.bin")) or any(directory.glob("*.pt")) or any(directory.glob("*.pth")):
        raise ValueError(f"{directory}: pickled .bin/.pt weights are never loaded; convert them to safetensors")
    raise ValueError(f"{directory}: no *.safetensors weights in the checkpoint directory")


def stored_tensors(directory: Path) -> dict[str, Stored]:
    """Every tensor of the checkpoint by its key in the files, from the safetensors headers alone."""
    out: dict[str, Stored] = {}
    for path in weight_files(directory):
        for key, stored in _read_header(path).items():
            if key in out:
                raise ValueError(f"{path}: tensor {key} also appears in {out[key].path.name}")
            out[key] = stored
    return out


def checkpoint_hash(directory: str | Path) -> str:
    """The base hash of a checkpoint directory, streamed from its files (framing: module docstring)."""
    directory = Path(directory)
    digest = hashlib.sha256(STATE_TAG)
    for name, dtype, shape, parts in _canonical_parts(directory):
        digest.update(tensor_frame(name, dtype, shape, sum(p.nbytes for p in parts)))
        for stored in parts:
            for chunk in _read_bytes(stored):
                digest.update(chunk)
    return digest.hexdigest()


def model_sources(directory: str | Path) -> dict[str, list[Stored]]:
    """Model tensor name -> the stored pieces whose bytes make it, in order (see `_canonical_parts`).

    Reads the safetensors headers and config.json only; the pieces name their checkpoint keys.
    """
    return {name: parts for name, _, _, parts in _canonical_parts(Path(directory))}


def read_rows(parts: list[Stored], shape: tuple[int, ...], rows: list[int]) -> torch.Tensor:
    """Rows `rows` (dim 0, in that order) of the model tensor of `shape` made of `parts`, in the stored dtype.

    Only those rows' bytes are read: from a fused stored tensor [E, ...] the rows' byte ranges, from
    per-expert hub pieces just those experts' pieces (gate before up, as the converter concatenates).
    """
    wanted = [piece for row in rows for piece in row_pieces(parts, shape, row)]
    out = torch.empty((len(rows), *shape[1:]), dtype=getattr(torch, parts[0].dtype))
    buffer = out.reshape(-1).view(torch.uint8).numpy().data
    assert buffer.nbytes == sum(p.nbytes for p in wanted), f"the pieces of {parts[0].key} do not fill {shape}"
    at = 0
    for stored in wanted:
        with stored.path.open("rb") as handle:
            handle.seek(stored.offset)
            if handle.readinto(buffer[at : at + stored.nbytes]) != stored.nbytes:
                raise ValueError(f"{stored.path}: file ends inside {stored.key}; the checkpoint is truncated")
        at += stored.nbytes
    return out


def row_pieces(parts: list[Stored], shape: tuple[int, ...], row: int) -> list[Stored]:
    """Where row `row` (dim 0) of the model tensor of `shape` made of `parts` lies: the stored pieces (or the byte
    range of a fused stored tensor) whose bytes, in order, are that row's bytes in the stored dtype."""
    assert 0 <= row < shape[0], f"row {row} of a tensor with {shape[0]} rows"
    if len(parts) > 1:
        per_row = len(parts) // shape[0]
        return parts[row * per_row : (row + 1) * per_row]
    size = parts[0].nbytes // shape[0]
    return [replace(parts[0], offset=parts[0].offset + row * size, nbytes=size)]


def _canonical_parts(directory: Path) -> Iterator[tuple[str, str, tuple[int, ...], list[Stored]]]:
    """Each model tensor (name, dtype, shape), sorted, with the stored pieces whose bytes make it, in order.

    A fused expert tensor [E, R, C] is, byte for byte, expert 0's pieces, then expert 1's, ...;
    within an expert, the converter's source patterns in order (gate before up).
    """
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import (
        Concatenate,
        MergeModulelist,
        WeightConverter,
        WeightRenaming,
        rename_source_key,
    )

    model = meta_model(directory)
    expected = model.state_dict()
    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    plain: dict[str, Stored] = {}
    fused: dict[str, dict[tuple[int, int], Stored]] = {}
    for key, stored in stored_tensors(directory).items():
        target, pattern = rename_source_key(key, renamings, converters, model.base_model_prefix, expected)
        if target not in expected:
            continue
        if pattern is None:
            plain[target] = stored
            continue
        converter = next(c for c in converters if pattern in c.source_patterns)
        ops = [(type(op), getattr(op, "dim", None)) for op in converter.operations]
        if ops not in ([(MergeModulelist, 0)], [(MergeModulelist, 0), (Concatenate, 1)]):
            raise ValueError(f"{key}: transformers converts it with {ops}, which the base hash cannot stream")
        match = _EXPERT_INDEX.search(key)
        if match is None:
            raise ValueError(f"{key}: a per-expert key without an expert index")
        fused.setdefault(target, {})[(int(match[1]), converter.source_patterns.index(pattern))] = stored
    tied = getattr(model, "all_tied_weights_keys", None) or {}
    for name in sorted(expected):
        shape = tuple(expected[name].shape)
        if name in fused:
            parts = _fused_parts(directory, name, fused[name], shape)
        elif name in plain or tied.get(name) in plain:
            parts = [plain.get(name) or plain[tied[name]]]
            if parts[0].shape != shape:
                raise ValueError(f"{directory}: {name} has shape {parts[0].shape}, the config implies {shape}")
        else:
            raise ValueError(f"{directory}: the checkpoint has no weights for {name}")
        yield name, parts[0].dtype, shape, parts


def _fused_parts(
    directory: Path, name: str, pieces: dict[tuple[int, int], Stored], shape: tuple[int, ...]
) -> list[Stored]:
    experts = sorted({e for e, _ in pieces})
    sources = sorted({s for _, s in pieces})
    if experts != list(range(shape[0])) or len(pieces) != len(experts) * len(sources):
        raise ValueError(
            f"{directory}: {name} needs all {shape[0]} experts of every projection; "
            f"the checkpoint has experts {experts[:3]}...{experts[-3:]} ({len(pieces)} pieces)"
        )
    ordered = [pieces[(e, s)] for e in experts for s in sources]
    kinds = {(p.dtype, p.shape[1:]) for p in ordered}
    rows = sum(pieces[(0, s)].shape[0] for s in sources)
    if len(kinds) != 1 or (shape[0], rows, *ordered[0].shape[1:]) != shape:
        raise ValueError(f"{directory}: the per-expert pieces of {name} do not fuse to the shape {shape}")
    return ordered


def _read_header(path: Path) -> dict[str, Stored]:
    try:
        with path.open("rb") as handle:
            size = struct.unpack("<Q", handle.read(8))[0]
            if size > 100 << 20:
                raise ValueError(f"{path}: safetensors header of {size} bytes is implausibly large")
            header = json.loads(handle.read(size))
    except (OSError, struct.error, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not a readable safetensors file: {exc}") from exc
    if not isinstance(header, dict):
        raise ValueError(f"{path}: not a readable safetensors file: the header is not a JSON object")
    base, file_size = 8 + size, path.stat().st_size
    out: dict[str, Stored] = {}
    for key, info in header.items():
        if key == "__metadata__":
            continue
        malformed = f"{path}: the safetensors header entry of {key} is malformed; the checkpoint is damaged"
        if not isinstance(info, dict):
            raise ValueError(malformed)
        code, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        dtype = _DTYPES.get(code) if isinstance(code, str) else None
        if isinstance(code, str) and dtype is None:
            raise ValueError(f"{path}: {key} has dtype {code}, which Tessera does not load "
                             "(FP8/quantized checkpoints are not supported)")
        if (dtype is None or not _naturals(shape) or not _naturals(offsets) or len(offsets) != 2
                or offsets[1] - offsets[0] != math.prod(shape) * getattr(torch, dtype).itemsize):
            raise ValueError(malformed)
        if base + offsets[1] > file_size:
            raise ValueError(f"{path}: file ends inside {key}; the checkpoint is truncated")
        out[key] = Stored(key, path, base + offsets[0], offsets[1] - offsets[0], dtype, tuple(shape))
    return out


def _naturals(value: object) -> TypeGuard[list[int]]:
    """Whether `value` is a JSON list of non-negative integers (a shape, or data offsets)."""
    return isinstance(value, list) and all(type(v) is int and v >= 0 for v in value)


def _read_bytes(stored: Stored) -> Iterator[bytes]:
    with stored.path.open("rb") as handle:
        handle.seek(stored.offset)
        left = stored.nbytes
        while left:
            chunk = handle.read(min(_CHUNK, left))
            if not chunk:
                raise ValueError(f"{stored.path}: file ends inside a tensor; the checkpoint is truncated")
            left -= len(chunk)
            yield chunk


assert torch.tensor([1], dtype=torch.int32).numpy().tobytes() == b"\x01\x00\x00\x00", (
    "the base hash frames tensor bytes as little-endian; big-endian hosts are not supported"
)

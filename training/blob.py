"""The canonical expert blob: a safetensors file with exactly one byte form per content.

Layout (safetensors): 8-byte little-endian header length N, N bytes of JSON header padded with
spaces to a multiple of 8, then the data buffer. The header maps each tensor name to
{dtype, shape, data_offsets}; tensors are sorted by name and laid out contiguously in that order;
the JSON has sorted keys and no whitespace; "__metadata__" holds ONE key, "tessera", whose value is
the compact sorted JSON of `BlobMeta`. The reader is strict: it refuses an oversized header before
reading it, accepts only canonical bytes, and never unpickles anything. This module knows nothing
about what a validator expects of a blob (see validator.checks) nor where blobs come from.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from protocol.encoding import canonical_json, sha256_hex

BLOB_FORMAT = "tessera-experts/1"
PGRAD_FORMAT = "tessera-pgrad/1"
"""A compressed pseudo-gradient submission (training.pgrad): integer indices and codes, fp32 scales."""
# Validators' global state and outer momentum (training.state) use the same layout.
FORMATS = (BLOB_FORMAT, PGRAD_FORMAT, "tessera-global/1", "tessera-momentum/1")
META_KEY = "tessera"
DTYPES: dict[str, torch.dtype] = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
                                  "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8}
_CODES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
          torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8"}
_SPEC_NAMES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}
_ITEMSIZE = {"F32": 4, "BF16": 2, "F16": 2, "I16": 2, "I8": 1, "U8": 1}
_PICKLE_PROTOCOLS = range(2, 6)
_ZIP_MAGIC = b"PK\x03\x04"
_META_FIELDS = ("base", "format", "group", "miner", "network", "round")

assert sys.byteorder == "little", "safetensors data is little-endian; big-endian hosts are not supported"


class BlobError(ValueError):
    """Bytes are not a canonical Tessera blob; `reason` is a short, stable description."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class BlobMeta:
    """Who made a blob, for which round and network, from which base, for which expert group."""

    network: str
    round: int
    miner: str
    base: str
    group: dict[int, list[int]]
    format: str = BLOB_FORMAT

    def to_json(self) -> str:
        """Compact sorted JSON with string layer keys and sorted expert ids (the metadata value)."""
        group = {str(layer): sorted(ids) for layer, ids in self.group.items()}
        data = {"base": self.base, "format": self.format, "group": group, "miner": self.miner,
                "network": self.network, "round": self.round}
        return canonical_json(data).decode("utf-8")


@dataclass(frozen=True)
class TensorInfo:
    """One header entry: dtype code, shape, and [begin, end) within the data buffer."""

    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclass(frozen=True)
class Header:
    """A validated header: metadata, tensor entries by name, and where the data buffer starts."""

    meta: BlobMeta
    tensors: dict[str, TensorInfo]
    data_start: int


def blob_dtype(dtype: str | torch.dtype) -> str:
    """The safetensors code ("F32", "BF16", "F16") for a torch dtype, spec name or code."""
    code = _CODES.get(dtype) if isinstance(dtype, torch.dtype) else _SPEC_NAMES.get(dtype, dtype)
    if code not in DTYPES:
        raise ValueError(f"unsupported blob dtype {dtype!r}: use float32, bfloat16 or float16")
    return code


def blob_hash(data: bytes) -> str:
    """The blob's address and commitment: lower-case hex SHA-256 of its bytes."""
    return sha256_hex(data)


def max_blob_bytes(
    expected_shapes: Mapping[str, tuple[int, ...]], dtype: str | torch.dtype, max_header_bytes: int
) -> int:
    """The largest a valid blob with these tensors can be: length prefix + header cap + data."""
    itemsize = _ITEMSIZE[blob_dtype(dtype)]
    return 8 + max_header_bytes + sum(math.prod(shape) * itemsize for shape in expected_shapes.values())


def encode_blob(tensors: Mapping[str, torch.Tensor], meta: BlobMeta) -> bytes:
    """Serialize tensors and metadata canonically: same inputs give the same bytes everywhere."""
    return b"".join(encoded_parts(tensors, meta))


def encoded_parts(tensors: Mapping[str, torch.Tensor], meta: BlobMeta) -> Iterator[bytes | memoryview]:
    """`encode_blob`'s bytes in pieces, the length prefix and header first, then each tensor's data in name
    order: a writer or a hash takes them one tensor at a time (a state of OLMoE-1B-7B's group is 0.8 GB)."""
    specs = {name: (blob_dtype(t.dtype), tuple(t.shape)) for name, t in tensors.items()}
    infos = _layout(specs)
    header = _header_bytes(infos, meta)
    yield struct.pack("<Q", len(header)) + header
    for name in infos:
        flat = tensors[name].detach().to("cpu").contiguous().reshape(-1)
        yield flat.view(torch.uint8).numpy().data


def encoded_hash(tensors: Mapping[str, torch.Tensor], meta: BlobMeta) -> str:
    """`blob_hash(encode_blob(tensors, meta))`, without the blob's bytes in memory at once."""
    hasher = hashlib.sha256()
    for part in encoded_parts(tensors, meta):
        hasher.update(part)
    return hasher.hexdigest()


def header_size(tensors: Mapping[str, tuple[str, tuple[int, ...]]], meta: BlobMeta) -> int:
    """Bytes of the header `encode_blob` writes for tensors of these (dtype code, shape), from sizes alone."""
    return len(_header_bytes(_layout(tensors), meta))


def _layout(tensors: Mapping[str, tuple[str, tuple[int, ...]]]) -> dict[str, TensorInfo]:
    """Where each tensor's data lies: in name order, back to back (the one canonical layout)."""
    infos: dict[str, TensorInfo] = {}
    offset = 0
    for name in sorted(tensors):
        code, shape = tensors[name]
        size = math.prod(shape) * _ITEMSIZE[code]
        infos[name] = TensorInfo(code, shape, offset, offset + size)
        offset += size
    return infos


def decode_header(data: bytes, max_header_bytes: int) -> Header:
    """Parse and validate a blob's header against `data`; raises BlobError with a short reason."""
    return _parse_header(data, len(data), max_header_bytes)


def read_header(path: str | Path, max_header_bytes: int) -> Header:
    """`decode_header` of a blob file, reading only its header (the file's size stands for the data's)."""
    with open(path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        prefix = fh.read(8)
        if len(prefix) == 8:
            (n,) = struct.unpack("<Q", prefix)
            prefix += fh.read(min(n, max_header_bytes + 1))
    return _parse_header(prefix, size, max_header_bytes)


def _parse_header(data: bytes, total: int, max_header_bytes: int) -> Header:
    """The header at the start of `data`, for a blob of `total` bytes."""
    if len(data) < 8:
        raise BlobError("truncated")
    (n,) = struct.unpack("<Q", data[:8])
    if n > max_header_bytes:
        raise BlobError(_foreign_format(data) or "header too large")
    if len(data) < 8 + n:
        raise BlobError("truncated")
    raw = data[8 : 8 + n]
    obj = _strict_json(raw)
    if not isinstance(obj, dict):
        raise BlobError("malformed header: not a JSON object")
    meta = _parse_meta(obj.pop("__metadata__", None))
    tensors = {name: _parse_entry(name, entry) for name, entry in obj.items()}
    _check_layout(tensors, total - 8 - n)
    if _header_bytes(tensors, meta) != raw:
        raise BlobError("malformed header: not canonical")
    return Header(meta=meta, tensors=tensors, data_start=8 + n)


def decode_blob(data: bytes, max_header_bytes: int) -> tuple[BlobMeta, dict[str, torch.Tensor]]:
    """Decode a canonical blob into its metadata and freshly allocated tensors."""
    header = decode_header(data, max_header_bytes)
    return header.meta, {name: read_tensor(data, header, name) for name in header.tensors}


def read_tensor(data: bytes, header: Header, name: str) -> torch.Tensor:
    """Copy one tensor named in a validated `header` out of `data` (never pickle)."""
    info = header.tensors[name]
    dtype = DTYPES[info.dtype]
    if info.end == info.begin:
        return torch.empty(info.shape, dtype=dtype)
    buf = bytearray(data[header.data_start + info.begin : header.data_start + info.end])
    return torch.frombuffer(buf, dtype=dtype).reshape(info.shape)


class BlobFile(Mapping[str, torch.Tensor]):
    """The tensors of a blob file whose bytes were checked, read from the file one at a time when asked for.

    Holds the path and the validated `header` of those bytes, not the tensors: a validator keeps its
    accepted submissions this way from scoring to the merge (validator.scoring), which walks them name by
    name. The file must not change meanwhile; a node's blob store is content-addressed and writes each file
    once. A read that comes back short (the file cut or removed since) raises OSError.
    """

    def __init__(self, path: str | Path, header: Header) -> None:
        self.path = Path(path)
        self.header = header

    def __getitem__(self, name: str) -> torch.Tensor:
        info = self.header.tensors[name]
        dtype = DTYPES[info.dtype]
        size = info.end - info.begin
        with open(self.path, "rb") as fh:
            fh.seek(self.header.data_start + info.begin)
            buf = bytearray(fh.read(size))
        if len(buf) != size:
            raise OSError(f"{self.path}: {name} ends past the end of the file; it changed after it was checked")
        if not size:
            return torch.empty(info.shape, dtype=dtype)
        return torch.frombuffer(buf, dtype=dtype).reshape(info.shape)

    def __iter__(self) -> Iterator[str]:
        return iter(self.header.tensors)

    def __len__(self) -> int:
        return len(self.header.tensors)


def _header_bytes(tensors: Mapping[str, TensorInfo], meta: BlobMeta) -> bytes:
    header: dict[str, object] = {"__metadata__": {META_KEY: meta.to_json()}}
    for name, info in tensors.items():
        header[name] = {"data_offsets": [info.begin, info.end], "dtype": info.dtype, "shape": list(info.shape)}
    raw = canonical_json(header)
    return raw + b" " * (-len(raw) % 8)


def _foreign_format(data: bytes) -> str | None:
    if data.startswith(_ZIP_MAGIC):
        return "malformed header: zip archive (torch.save?), not safetensors"
    if data[0] == 0x80 and data[1] in _PICKLE_PROTOCOLS:
        return "malformed header: pickle data, not safetensors"
    return None


def _strict_json(raw: bytes) -> object:
    def no_duplicates(pairs: list[tuple[str, object]]) -> dict[str, object]:
        keys = [k for k, _ in pairs]
        if len(set(keys)) != len(keys):
            raise BlobError("malformed header: duplicate key")
        return dict(pairs)

    def no_constants(name: str) -> object:
        raise BlobError(f"malformed header: {name} is not allowed")

    try:
        text = raw.decode("utf-8")
        return json.loads(text, object_pairs_hook=no_duplicates, parse_constant=no_constants)
    except BlobError:
        raise
    except UnicodeDecodeError as exc:
        raise BlobError("malformed header: not UTF-8") from exc
    except (ValueError, RecursionError) as exc:
        raise BlobError("malformed header: not JSON") from exc


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _parse_meta(value: object) -> BlobMeta:
    if not isinstance(value, dict) or list(value) != [META_KEY] or not isinstance(value[META_KEY], str):
        raise BlobError(f"malformed header: __metadata__ must hold exactly one string key {META_KEY!r}")
    obj = _strict_json(value[META_KEY].encode("utf-8"))
    if not isinstance(obj, dict) or sorted(obj) != list(_META_FIELDS):
        raise BlobError(f"malformed header: metadata must have exactly the fields {', '.join(_META_FIELDS)}")
    if not all(isinstance(obj[k], str) for k in ("base", "format", "miner", "network")):
        raise BlobError("malformed header: metadata base, format, miner and network must be strings")
    if not _is_int(obj["round"]) or obj["round"] < 0:
        raise BlobError("malformed header: metadata round must be a non-negative integer")
    if obj["format"] not in FORMATS:
        raise BlobError(f"malformed header: unknown format {obj['format'][:40]!r}")
    return BlobMeta(network=obj["network"], round=obj["round"], miner=obj["miner"], base=obj["base"],
                    group=_parse_group(obj["group"]), format=obj["format"])


def _parse_group(value: object) -> dict[int, list[int]]:
    if not isinstance(value, dict):
        raise BlobError("malformed header: metadata group must be an object")
    group: dict[int, list[int]] = {}
    for key, ids in value.items():
        if not (0 < len(key) <= 9 and key.isascii() and key.isdigit()) or str(int(key)) != key:
            raise BlobError("malformed header: group layer keys must be decimal integers")
        if not isinstance(ids, list) or not all(_is_int(e) and e >= 0 for e in ids):
            raise BlobError("malformed header: group expert ids must be non-negative integers")
        group[int(key)] = ids
    return group


def _parse_entry(name: str, entry: object) -> TensorInfo:
    shown = name[:80]
    if not isinstance(entry, dict) or sorted(entry) != ["data_offsets", "dtype", "shape"]:
        raise BlobError(f"malformed header: entry {shown!r} must have exactly dtype, shape, data_offsets")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if dtype not in DTYPES:
        raise BlobError(f"malformed header: unsupported dtype {str(dtype)[:16]!r}")
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise BlobError(f"malformed header: shape of {shown!r} must be a list of non-negative integers")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_int(o) for o in offsets):
        raise BlobError(f"malformed header: data_offsets of {shown!r} must be two integers")
    begin, end = offsets
    if begin < 0 or end - begin != math.prod(shape) * _ITEMSIZE[dtype]:
        raise BlobError(f"malformed header: offsets of {shown!r} out of range")
    return TensorInfo(dtype=dtype, shape=tuple(shape), begin=begin, end=end)


def _check_layout(tensors: Mapping[str, TensorInfo], buffer_len: int) -> None:
    by_offset = sorted(tensors, key=lambda name: (tensors[name].begin, tensors[name].end, name))
    position = 0
    for name in by_offset:
        info = tensors[name]
        if info.begin < position:
            raise BlobError(f"malformed header: offsets of {name[:80]!r} overlap another tensor")
        if info.begin > position:
            raise BlobError(f"malformed header: gap before {name[:80]!r}")
        position = info.end
    if buffer_len < position:
        raise BlobError("truncated")
    if buffer_len > position:
        raise BlobError("malformed header: trailing bytes after the data buffer")
    if by_offset != sorted(tensors):  # the same content in another order is another byte form
        raise BlobError("malformed header: tensor data not laid out in name order")

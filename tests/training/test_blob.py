"""Canonical blob format: bit-exact round trips, one byte form, and the safetensors library agrees."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors
import safetensors.torch
import torch

from training.blob import (
    BLOB_FORMAT,
    BlobError,
    BlobFile,
    BlobMeta,
    blob_dtype,
    blob_hash,
    decode_blob,
    decode_header,
    encode_blob,
    encoded_hash,
    encoded_parts,
    max_blob_bytes,
    read_header,
)

ROOT = Path(__file__).resolve().parents[2]
GROUP = {2: [3, 0], 0: [1]}
META = BlobMeta(network="ab" * 32, round=7, miner="cd" * 32, base="ef" * 32, group=GROUP)
MAX_HEADER = 4096



def make_tensors(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    out = {}
    for layer, experts in GROUP.items():
        for e in experts:
            out[f"layers.{layer}.experts.{e}.gate_up_proj"] = torch.randn(8, 6, generator=g).to(dtype)
            out[f"layers.{layer}.experts.{e}.down_proj"] = torch.randn(6, 4, generator=g).to(dtype)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_is_bit_exact(dtype: torch.dtype) -> None:
    tensors = make_tensors(dtype)
    meta, decoded = decode_blob(encode_blob(tensors, META), MAX_HEADER)
    assert meta.network == META.network and meta.round == 7 and meta.miner == META.miner
    assert meta.group == {0: [1], 2: [0, 3]} and meta.format == BLOB_FORMAT
    assert list(decoded) == sorted(tensors)
    for name, tensor in tensors.items():
        assert decoded[name].dtype == dtype and decoded[name].shape == tensor.shape
        assert torch.equal(decoded[name].view(torch.int16 if dtype != torch.float32 else torch.int32),
                           tensor.view(torch.int16 if dtype != torch.float32 else torch.int32))


def test_decoded_tensors_own_their_memory() -> None:
    data = bytearray(encode_blob(make_tensors(torch.float32), META))
    _, decoded = decode_blob(bytes(data), MAX_HEADER)
    before = decoded["layers.0.experts.1.down_proj"].clone()
    data[-50:] = b"\x00" * 50
    assert torch.equal(decoded["layers.0.experts.1.down_proj"], before)


def test_same_content_same_bytes_regardless_of_insertion_order() -> None:
    tensors = make_tensors(torch.float32)
    reordered = dict(reversed(list(tensors.items())))
    meta2 = BlobMeta(network=META.network, round=7, miner=META.miner, base=META.base, group={0: [1], 2: [0, 3]})
    assert encode_blob(tensors, META) == encode_blob(reordered, meta2)


@pytest.mark.slow
def test_byte_identical_across_processes() -> None:
    script = (
        "import sys, torch; sys.path.insert(0, 'tests/training')\n"
        "from test_blob import META, make_tensors\n"
        "from training.blob import blob_hash, encode_blob\n"
        "print(blob_hash(encode_blob(make_tensors(torch.bfloat16), META)))"
    )
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == blob_hash(encode_blob(make_tensors(torch.bfloat16), META))


def test_header_layout_is_canonical() -> None:
    data = encode_blob(make_tensors(torch.float32), META)
    (n,) = struct.unpack("<Q", data[:8])
    raw = data[8 : 8 + n]
    assert n % 8 == 0
    text = raw.decode().rstrip(" ")
    header = json.loads(text)
    assert text == json.dumps(header, sort_keys=True, separators=(",", ":"))
    assert header["__metadata__"] == {"tessera": META.to_json()}
    assert json.loads(META.to_json())["group"] == {"0": [1], "2": [0, 3]}
    names = [k for k in header if k != "__metadata__"]
    assert names == sorted(names)
    offsets = [header[k]["data_offsets"] for k in names]
    assert offsets[0][0] == 0 and all(a[1] == b[0] for a, b in zip(offsets, offsets[1:], strict=False))
    assert offsets[-1][1] == len(data) - 8 - n


def test_safetensors_library_reads_our_blob(tmp_path: Path) -> None:
    tensors = make_tensors(torch.bfloat16)
    data = encode_blob(tensors, META)
    loaded = safetensors.torch.load(data)
    assert set(loaded) == set(tensors)
    assert all(torch.equal(loaded[k], tensors[k]) for k in tensors)
    path = tmp_path / "blob.safetensors"
    path.write_bytes(data)
    with safetensors.safe_open(str(path), framework="pt") as fh:
        assert fh.metadata() == {"tessera": META.to_json()}


def test_safetensors_library_output_is_not_canonical() -> None:
    tensors = make_tensors(torch.float32)
    theirs = safetensors.torch.save(tensors, metadata={"tessera": META.to_json()})
    with pytest.raises(BlobError, match="not canonical"):
        decode_header(theirs, MAX_HEADER)


def test_the_same_tensors_laid_out_out_of_name_order_are_refused() -> None:
    """A canonical header whose offsets put two tensors' data the other way round holds the same content
    in a second byte form: only encode_blob's layout (contiguous in sorted-name order) is accepted."""
    tensors = make_tensors(torch.float32)
    data = encode_blob(tensors, META)
    (n,) = struct.unpack("<Q", data[:8])
    header, body = json.loads(data[8 : 8 + n]), data[8 + n :]
    first, second = sorted(k for k in header if k != "__metadata__")[:2]
    (a0, a1), (b0, b1) = header[first]["data_offsets"], header[second]["data_offsets"]
    header[second]["data_offsets"], header[first]["data_offsets"] = [a0, a0 + b1 - b0], [a0 + b1 - b0, b1]
    raw = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    swapped = struct.pack("<Q", len(raw)) + raw + body[b0:b1] + body[a0:a1] + body[b1:]
    loaded = safetensors.torch.load(swapped)
    assert swapped != data and all(torch.equal(loaded[k], tensors[k]) for k in tensors)
    with pytest.raises(BlobError, match="tensor data not laid out in name order"):
        decode_header(swapped, MAX_HEADER)


def test_oversized_header_refused_before_reading_it() -> None:
    claim = struct.pack("<Q", 1 << 30)
    with pytest.raises(BlobError) as info:
        decode_header(claim, MAX_HEADER)
    assert info.value.reason == "header too large"
    with pytest.raises(BlobError) as info:
        decode_header(claim[:5], MAX_HEADER)
    assert info.value.reason == "truncated"


def test_max_blob_bytes_is_tight() -> None:
    tensors = make_tensors(torch.float16)
    data = encode_blob(tensors, META)
    (n,) = struct.unpack("<Q", data[:8])
    shapes = {k: tuple(v.shape) for k, v in tensors.items()}
    assert max_blob_bytes(shapes, "float16", n) == len(data)
    assert max_blob_bytes(shapes, torch.float32, n) == 8 + n + 2 * (len(data) - 8 - n)


def test_dtype_names() -> None:
    assert [blob_dtype(d) for d in ("float32", "BF16", torch.float16)] == ["F32", "BF16", "F16"]
    with pytest.raises(ValueError, match="unsupported blob dtype"):
        blob_dtype("int8")
    with pytest.raises(ValueError, match="unsupported blob dtype"):
        encode_blob({"x": torch.zeros(2, dtype=torch.int64)}, META)


def _reheadered(edit) -> bytes:
    """A valid blob whose header (with its metadata as a dict) went through `edit`, written canonically."""
    data = encode_blob(make_tensors(torch.float32), META)
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    meta = json.loads(header["__metadata__"]["tessera"])
    edit(header, meta)
    header["__metadata__"]["tessera"] = json.dumps(meta, sort_keys=True, separators=(",", ":"))
    raw = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + data[8 + n :]


FIRST = sorted(make_tensors(torch.float32))[0]


def _set_group_key(key: str):
    def edit(header: dict, meta: dict) -> None:
        meta["group"] = {key: [0]}
    return edit


def _set_entry(field: str, value: object):
    def edit(header: dict, meta: dict) -> None:
        header[FIRST][field] = value
    return edit


def _shift_first(header: dict, meta: dict) -> None:
    header[FIRST]["data_offsets"] = [o - 8 for o in header[FIRST]["data_offsets"]]


@pytest.mark.parametrize(
    ("edit", "reason"),
    [
        (lambda h, m: m.update(format="x" * 100), f"malformed header: unknown format {'x' * 40!r}"),
        (_set_group_key(""), "malformed header: group layer keys must be decimal integers"),
        (_set_group_key("1234567890"), "malformed header: group layer keys must be decimal integers"),
        (_set_group_key("01"), "malformed header: group layer keys must be decimal integers"),
        (_set_entry("shape", [-1, 48]), f"malformed header: shape of {FIRST!r} must be a list of non-negative integers"),
        (_set_entry("data_offsets", [0, 192, 192]), f"malformed header: data_offsets of {FIRST!r} must be two integers"),
        (_shift_first, f"malformed header: offsets of {FIRST!r} out of range"),
        (_set_entry("dtype", "X" * 50), f"malformed header: unsupported dtype {'X' * 16!r}"),
        (lambda h, m: h.update({"y" * 200: {"dtype": "F32", "shape": [0]}}),
         f"malformed header: entry {'y' * 80!r} must have exactly dtype, shape, data_offsets"),
    ],
    ids=["long format", "empty layer key", "10-digit layer key", "leading zero", "negative shape",
         "three offsets", "negative begin", "long dtype", "long entry name"],
)
def test_each_malformed_header_field_has_its_own_short_reason(edit, reason: str) -> None:
    with pytest.raises(BlobError) as info:
        decode_header(_reheadered(edit), MAX_HEADER)
    assert info.value.reason == reason


def test_edge_cases_that_are_valid_blobs() -> None:
    wide = BlobMeta(network="ab" * 32, round=0, miner="", base="ef" * 32, group={123456789: [0]})
    assert decode_blob(encode_blob({}, wide), MAX_HEADER) == (wide, {})  # nine-digit layer, no tensors


def test_fewer_than_eight_bytes_are_truncated_and_a_non_pickle_0x80_is_not_called_pickle() -> None:
    for k in range(8):
        with pytest.raises(BlobError) as info:
            decode_header(b"\x01" * k, MAX_HEADER)
        assert info.value.reason == "truncated", k
    with pytest.raises(BlobError) as info:
        decode_header(b"\x80\x01" + b"\xff" * 14, MAX_HEADER)
    assert info.value.reason == "header too large"


def test_every_header_is_padded_to_a_multiple_of_eight_bytes() -> None:
    for extra in range(8):
        data = encode_blob(make_tensors(torch.float32), BlobMeta(network="ab", round=7, miner="c" * extra,
                                                                 base="ef", group=GROUP))
        (n,) = struct.unpack("<Q", data[:8])
        assert n % 8 == 0, extra


def test_a_blob_in_pieces_is_the_blob_and_its_header_reads_from_the_file(tmp_path: Path) -> None:
    tensors = {"b": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3), "a": torch.ones(4)}
    data = encode_blob(tensors, META)
    assert b"".join(encoded_parts(tensors, META)) == data and encoded_hash(tensors, META) == blob_hash(data)
    path = tmp_path / "blob"
    path.write_bytes(data)
    header = read_header(path, MAX_HEADER)
    assert header == decode_header(data, MAX_HEADER)
    held = BlobFile(path, header)
    assert list(held) == ["a", "b"] and all(torch.equal(held[n], tensors[n]) for n in tensors)
    path.write_bytes(data + b"\0")
    with pytest.raises(BlobError, match="trailing bytes"):
        read_header(path, MAX_HEADER)

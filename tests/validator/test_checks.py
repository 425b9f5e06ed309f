"""Submission checks: a valid blob is accepted; every hostile blob is rejected with its own reason."""

from __future__ import annotations

import dataclasses
import io
import json
import pickle
import struct

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from training.blob import BlobMeta, blob_hash, encode_blob
from validator.checks import Expectation, SubmissionVerdict, check_submission

GROUP = {0: [1, 3], 2: [0]}
HIDDEN, INTER = 8, 4
SHAPES = {
    f"layers.{layer}.experts.{e}.{param}": shape
    for layer, experts in GROUP.items()
    for e in experts
    for param, shape in (("gate_up_proj", (2 * INTER, HIDDEN)), ("down_proj", (HIDDEN, INTER)))
}
META = BlobMeta(network="aa" * 32, round=5, miner="bb" * 32, base="cc" * 32, group=GROUP)
UNPICKLED: list[str] = []


def _tensors(dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {name: torch.randn(shape, generator=g).to(dtype) for name, shape in SHAPES.items()}


def _expect(data: bytes) -> Expectation:
    """The expectation for META's miner, committed to exactly `data`."""
    return Expectation(network=META.network, round=META.round, miner=META.miner, base=META.base, group=GROUP,
                       shapes=SHAPES, dtype="float32", commitment=blob_hash(data), max_header_bytes=4096)


def _check(data: bytes) -> SubmissionVerdict:
    return check_submission(data, _expect(data))


def _reassemble(data: bytes, edit) -> bytes:
    """Rewrite a valid blob's header with `edit(header_dict)`, keeping it canonical JSON."""
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    edit(header)
    raw = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + data[8 + n :]


def _mark(text: str) -> None:
    UNPICKLED.append(text)


class _Boom:
    def __reduce__(self):
        return (_mark, ("unpickled",))


def test_valid_blob_is_accepted_with_its_tensors() -> None:
    tensors = _tensors()
    verdict = _check(encode_blob(tensors, META))
    assert verdict.ok and verdict.reason == ""
    assert verdict.meta == META
    assert verdict.tensors is not None and set(verdict.tensors) == set(SHAPES)
    assert all(torch.equal(verdict.tensors[k], tensors[k]) for k in tensors)


def test_hash_mismatch_is_checked_first() -> None:
    data = encode_blob(_tensors(), META)
    verdict = check_submission(b"garbage", _expect(data))
    assert not verdict.ok and verdict.reason == "hash mismatch"


def test_blob_over_the_cap_is_too_large() -> None:
    tensors = _tensors() | {"layers.9.experts.9.down_proj": torch.zeros(64, 64)}
    assert _check(encode_blob(tensors, META)).reason == "blob too large"


def test_a_blob_exactly_at_the_cap_is_accepted_and_one_byte_over_is_too_large() -> None:
    data = encode_blob(_tensors(), META)
    (n,) = struct.unpack("<Q", data[:8])
    at_cap = dataclasses.replace(_expect(data), max_header_bytes=n)
    assert at_cap.max_bytes() == len(data)
    assert check_submission(data, at_cap).ok
    one_over = dataclasses.replace(_expect(data), max_header_bytes=n - 1)
    assert check_submission(data, one_over).reason == "blob too large"


def test_tensor_set_mismatches_name_the_first_tensor_in_sorted_order() -> None:
    first, second = sorted(SHAPES)[:2]
    missing = {k: v for k, v in _tensors().items() if k not in (first, second)}
    assert _check(encode_blob(missing, META)).reason == f"missing tensor {first}"
    extra = _tensors() | {"layers.2.experts.5.down_proj": torch.zeros(1), "layers.2.experts.7.down_proj": torch.zeros(1)}
    assert _check(encode_blob(extra, META)).reason == "unexpected tensor layers.2.experts.5.down_proj"


def test_an_unexpected_tensor_name_is_cut_to_80_characters_in_the_reason() -> None:
    long_name = "x" * 200
    verdict = _check(encode_blob(_tensors() | {long_name: torch.zeros(1)}, META))
    assert verdict.reason == f"unexpected tensor {'x' * 80}"


def test_the_expected_group_matches_whatever_order_its_expert_ids_are_given_in() -> None:
    data = encode_blob(_tensors(), META)
    shuffled = dataclasses.replace(_expect(data), group={0: [3, 1], 2: [0]})
    assert check_submission(data, shuffled).ok


def _hostile_blobs() -> dict[str, tuple[bytes, str]]:
    valid = encode_blob(_tensors(), META)
    name = sorted(SHAPES)[0]
    last = sorted(SHAPES)[-1]
    nan, inf = _tensors(), _tensors()
    nan[name][0, 0] = float("nan")
    inf[last][1, 1] = float("inf")
    wrong_shape = _tensors()
    wrong_shape[name] = torch.zeros(HIDDEN, INTER + 1)
    missing = _tensors()
    del missing[last]
    torch_saved = io.BytesIO()
    torch.save(_tensors(), torch_saved)

    def overlap(header: dict) -> None:
        header[last]["data_offsets"] = [o - 4 for o in header[last]["data_offsets"]]

    def out_of_range(header: dict) -> None:
        header[name]["data_offsets"] = [0, 10**12]

    def other(**changes: object) -> bytes:
        return encode_blob(_tensors(), dataclasses.replace(META, **changes))

    return {
        "extra tensor": (encode_blob(_tensors() | {"layers.2.experts.5.down_proj": torch.zeros(HIDDEN, INTER)}, META),
                         "unexpected tensor layers.2.experts.5.down_proj"),
        "missing tensor": (encode_blob(missing, META), f"missing tensor {last}"),
        "wrong dtype": (encode_blob(_tensors(torch.bfloat16), META), "wrong dtype"),
        "wrong shape": (encode_blob(wrong_shape, META), "wrong shape"),
        "nan": (encode_blob(nan, META), f"non-finite values in {name}: 1 NaN, 0 Inf"),
        "inf": (encode_blob(inf, META), f"non-finite values in {last}: 0 NaN, 1 Inf"),
        "pickle": (pickle.dumps({"w": _Boom(), "t": _tensors()}), "malformed header: pickle data"),
        "torch.save": (torch_saved.getvalue(), "malformed header: zip archive"),
        "truncated": (valid[:-10], "truncated"),
        "1 GB header": (struct.pack("<Q", 1 << 30) + valid[8:], "header too large"),
        "other miner": (other(miner="dd" * 32), "wrong miner"),
        "other round": (other(round=4), "wrong round"),
        "other base": (other(base="ee" * 32), "stale base"),
        "other network": (other(network="ff" * 32), "wrong network"),
        "other group": (other(group={0: [1, 2], 2: [0]}), "wrong group"),
        "overlapping offsets": (_reassemble(valid, overlap), "malformed header: offsets of"),
        "offsets out of range": (_reassemble(valid, out_of_range), "malformed header: offsets of"),
        "non-JSON header": (struct.pack("<Q", 16) + b"{not json, at al" + valid[-64:], "malformed header: not JSON"),
        "trailing bytes": (valid + b"\0" * 8, "malformed header: trailing bytes"),
    }


def test_each_hostile_blob_is_rejected_with_a_distinct_reason() -> None:
    reasons = {}
    for label, (data, expected) in _hostile_blobs().items():
        verdict = _check(data)
        assert not verdict.ok, label
        assert verdict.tensors is None, label
        assert verdict.reason.startswith(expected), (label, verdict.reason)
        if label in ("extra tensor", "missing tensor", "wrong dtype", "wrong shape", "nan", "inf"):
            assert verdict.meta == META, label
        reasons[label] = verdict.reason
    assert len(set(reasons.values())) == len(reasons), reasons
    assert "overlap" in reasons["overlapping offsets"] and "out of range" in reasons["offsets out of range"]
    assert UNPICKLED == []


def test_metadata_checks_report_the_blob_meta() -> None:
    verdict = _check(encode_blob(_tensors(), dataclasses.replace(META, round=9)))
    assert verdict.reason == "wrong round" and verdict.meta is not None and verdict.meta.round == 9


@settings(max_examples=300, deadline=None, derandomize=True)
@given(flips=st.lists(st.tuples(st.integers(0, 10**6), st.integers(1, 255)), min_size=1, max_size=4),
       header_only=st.booleans(), cut=st.integers(0, 10**6) | st.none())
def test_byte_flips_never_raise(flips: list[tuple[int, int]], header_only: bool, cut: int | None) -> None:
    valid = encode_blob(_tensors(), META)
    (n,) = struct.unpack("<Q", valid[:8])
    span = 8 + n if header_only else len(valid)
    data = bytearray(valid)
    for position, mask in flips:
        data[position % span] ^= mask
    if cut is not None:
        data = data[: cut % (len(data) + 1)]
    verdict = _check(bytes(data))
    assert isinstance(verdict, SubmissionVerdict)
    assert verdict.ok == (verdict.reason == "")
    if verdict.ok:
        assert len(data) == len(valid) and bytes(data[: 8 + n]) == valid[: 8 + n]

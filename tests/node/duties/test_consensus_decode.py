"""node.duties.consensus.decode_state, and read_state on a blob file: a fetched state blob is refused unless it
is a global state of this network and expert group, with the group's tensor names and shapes and finite
values; a file's tensors are read when asked for."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from node.duties.consensus import SyncError, decode_state, read_state
from protocol.spec import parse_spec
from tests.conftest import make_spec_dict
from training.blob import BlobFile, BlobMeta, encode_blob
from training.state import GLOBAL_FORMAT, MOMENTUM_FORMAT, STATE_MINER

SPEC = parse_spec(make_spec_dict())
SHAPES = {"w": (2, 2)}
META = BlobMeta(network=SPEC.network_id, round=3, miner=STATE_MINER, base="ab" * 32,
                group={layer: sorted(ids) for layer, ids in SPEC.group.items()}, format=GLOBAL_FORMAT)
TENSORS = {"w": torch.arange(4, dtype=torch.float32).reshape(2, 2)}


def test_a_global_state_of_this_network_and_group_decodes() -> None:
    meta, tensors = decode_state(encode_blob(TENSORS, META), SPEC, SHAPES)
    assert meta == META
    torch.testing.assert_close(tensors["w"], TENSORS["w"], rtol=0, atol=0)


@pytest.mark.parametrize(("meta", "tensors", "message"), [
    (replace(META, format=MOMENTUM_FORMAT), TENSORS, "not a global state"),
    (replace(META, miner="cd" * 32), TENSORS, "not a global state"),
    (replace(META, network="ef" * 32), TENSORS, "for another network"),
    (replace(META, group={0: [1], 1: [0]}), TENSORS, "for another expert group"),
    (META, {"w": torch.zeros(4)}, "do not match the expert group's names and shapes"),
    (META, {"v": torch.zeros(2, 2)}, "do not match the expert group's names and shapes"),
    (META, {**TENSORS, "v": torch.zeros(2, 2)}, "do not match the expert group's names and shapes"),
    (META, {"w": torch.tensor([[0.0, float("nan")], [0.0, 0.0]])}, "non-finite"),
    (META, {"w": torch.tensor([[0.0, float("inf")], [0.0, 0.0]])}, "non-finite"),
])
def test_anything_else_is_refused_with_what_is_wrong(meta: BlobMeta, tensors: dict[str, torch.Tensor],
                                                      message: str, tmp_path: Path) -> None:
    with pytest.raises(SyncError, match=message):
        decode_state(encode_blob(tensors, meta), SPEC, SHAPES)
    (tmp_path / "state").write_bytes(encode_blob(tensors, meta))
    with pytest.raises(SyncError, match=message):
        read_state(tmp_path / "state", SPEC, SHAPES)


def test_bytes_that_are_no_blob_are_refused(tmp_path: Path) -> None:
    with pytest.raises(SyncError, match="state blob: "):
        decode_state(b"not a blob", SPEC, SHAPES)
    (tmp_path / "state").write_bytes(encode_blob(TENSORS, META)[:-1])
    with pytest.raises(SyncError, match="state blob: truncated"):
        read_state(tmp_path / "state", SPEC, SHAPES)


def test_a_state_file_is_read_a_tensor_at_a_time_when_asked_for(tmp_path: Path) -> None:
    path = tmp_path / "state"
    path.write_bytes(encode_blob(TENSORS, META))
    meta, tensors = read_state(path, SPEC, SHAPES)
    assert meta == META and isinstance(tensors, BlobFile) and list(tensors) == ["w"]
    first = tensors["w"]
    assert torch.equal(first, TENSORS["w"]) and tensors["w"] is not first  # read again, not kept

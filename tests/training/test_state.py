"""Global state as a value: blob round trips, the hash chain, re-sync checks and weighted adoption."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from protocol.spec import NetworkSpec
from training.blob import BlobFile, BlobMeta, blob_hash, decode_blob, encode_blob
from training.state import GENESIS_ROUND, GLOBAL_FORMAT, MOMENTUM_FORMAT, GlobalExperts, StateError, adopt
from validator.checks import Expectation, check_submission

HIDDEN, INTER = 8, 4


def _shapes(spec: NetworkSpec) -> dict[str, tuple[int, ...]]:
    return {
        f"layers.{layer}.experts.{e}.{param}": shape
        for layer, experts in spec.group.items()
        for e in experts
        for param, shape in (("gate_up_proj", (2 * INTER, HIDDEN)), ("down_proj", (HIDDEN, INTER)))
    }


def _tensors(spec: NetworkSpec, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=g) for name, shape in sorted(_shapes(spec).items())}


def _chain(spec: NetworkSpec) -> tuple[GlobalExperts, GlobalExperts]:
    genesis = GlobalExperts.genesis(spec, _tensors(spec, 0))
    child = genesis.child(3, _tensors(spec, 1), {k: v * 0.1 for k, v in _tensors(spec, 2).items()})
    return genesis, child


def test_genesis_hash_is_base_hash_and_it_has_no_blob(spec: NetworkSpec) -> None:
    genesis = GlobalExperts.genesis(spec, _tensors(spec, 0))
    assert genesis.round == GENESIS_ROUND and genesis.hash == spec.model.base_hash
    assert all(bool((m == 0).all()) and m.dtype == torch.float32 for m in genesis.momentum.values())
    with pytest.raises(ValueError, match="genesis"):
        genesis.to_blob()


def test_state_and_momentum_blobs_round_trip(spec: NetworkSpec) -> None:
    genesis, child = _chain(spec)
    state, momentum = child.to_blob(), child.momentum_blob()
    assert child.hash == blob_hash(state) and child.momentum_hash == blob_hash(momentum)
    assert child.parent == spec.model.base_hash

    meta, _ = decode_blob(state, spec.limits.max_header_bytes)
    assert (meta.format, meta.miner, meta.base, meta.round) == ("tessera-global/1", "", genesis.hash, 3)
    meta, _ = decode_blob(momentum, spec.limits.max_header_bytes)
    assert (meta.format, meta.base) == ("tessera-momentum/1", child.hash)

    again = GlobalExperts.from_blobs(state, momentum, spec, _shapes(spec))
    assert (again.round, again.parent, again.hash, again.momentum_hash) == (
        3,
        child.parent,
        child.hash,
        child.momentum_hash,
    )
    for name in child.tensors:
        assert torch.equal(again.tensors[name], child.tensors[name])
        assert torch.equal(again.momentum[name], child.momentum[name])


def test_hash_depends_on_tensors_parent_and_round(spec: NetworkSpec) -> None:
    genesis, child = _chain(spec)
    moved = {k: v.clone() for k, v in child.tensors.items()}
    first = sorted(moved)[0]
    moved[first][0, 0] += 1e-6
    assert genesis.child(3, moved, child.momentum).hash != child.hash
    assert genesis.child(4, child.tensors, child.momentum).hash != child.hash
    grandchild = child.child(4, child.tensors, child.momentum)
    assert grandchild.parent == child.hash and grandchild.hash != child.hash
    with pytest.raises(ValueError, match="after round"):
        child.child(3, child.tensors, child.momentum)


def test_a_state_held_in_blob_files_is_the_state_its_bytes_are(spec: NetworkSpec, tmp_path: Path) -> None:
    _, child = _chain(spec)
    assert b"".join(child.blob_parts()) == child.to_blob() and child.hash == blob_hash(child.to_blob())
    state, momentum = tmp_path / child.hash, tmp_path / child.momentum_hash
    state.write_bytes(child.to_blob())
    momentum.write_bytes(child.momentum_blob())
    again = GlobalExperts.from_files(child.hash, state, momentum, spec, _shapes(spec))
    assert isinstance(again.tensors, BlobFile) and isinstance(again.momentum, BlobFile)
    assert (again.round, again.parent, again.hash, again.momentum_hash) == (3, child.parent, child.hash,
                                                                           child.momentum_hash)
    assert all(torch.equal(again.tensors[n], child.tensors[n]) for n in child.tensors)
    with pytest.raises(StateError, match="another state"):
        GlobalExperts.from_files("ab" * 32, state, momentum, spec, _shapes(spec))
    nan = {k: v.clone() for k, v in child.tensors.items()}
    nan[sorted(nan)[-1]][-1, -1] = float("nan")  # in the last tensor: every tensor is read to find it
    state.write_bytes(encode_blob(nan, _state_meta(spec, child)))
    with pytest.raises(StateError, match="tessera-global/1 blob holds non-finite values"):
        GlobalExperts.from_files(child.hash, state, momentum, spec, _shapes(spec))


def test_the_genesis_momentum_is_broadcast_zeros_and_a_childs_momentum_blob_holds_them(spec: NetworkSpec) -> None:
    genesis = GlobalExperts.genesis(spec, _tensors(spec, 0))
    assert all(m.untyped_storage().nbytes() == 4 for m in genesis.momentum.values())
    child = genesis.child(0, _tensors(spec, 1), genesis.momentum)
    _, moments = decode_blob(child.momentum_blob(), spec.limits.max_header_bytes)
    assert all(bool((t == 0).all()) and t.shape == genesis.tensors[n].shape for n, t in moments.items())


def test_from_blobs_refuses_mismatched_pairs_and_submissions(spec: NetworkSpec) -> None:
    genesis, child = _chain(spec)
    other = genesis.child(3, _tensors(spec, 9), child.momentum)
    with pytest.raises(StateError, match="another state"):
        GlobalExperts.from_blobs(child.to_blob(), other.momentum_blob(), spec, _shapes(spec))
    with pytest.raises(StateError, match="expected a tessera-global/1"):
        GlobalExperts.from_blobs(child.momentum_blob(), child.momentum_blob(), spec, _shapes(spec))
    smaller = {k: v for k, v in _shapes(spec).items() if "layers.1." not in k}
    with pytest.raises(StateError, match="names and shapes"):
        GlobalExperts.from_blobs(child.to_blob(), child.momentum_blob(), spec, smaller)
    submission = encode_blob(
        child.tensors,
        BlobMeta(network=spec.network_id, round=3, miner="ee" * 32, base=genesis.hash, group=spec.group),
    )
    with pytest.raises(StateError, match="expected a tessera-global/1"):
        GlobalExperts.from_blobs(submission, child.momentum_blob(), spec, _shapes(spec))


def _state_meta(spec: NetworkSpec, child: GlobalExperts, **changes: object) -> BlobMeta:
    meta = BlobMeta(network=spec.network_id, round=child.round, miner="", base=child.parent, group=spec.group,
                    format=GLOBAL_FORMAT)
    return dataclasses.replace(meta, **changes)


def test_from_blobs_refuses_a_state_blob_that_is_not_this_networks_state(spec: NetworkSpec) -> None:
    _, child = _chain(spec)
    momentum = child.momentum_blob()
    nan = {k: v.clone() for k, v in child.tensors.items()}
    nan[sorted(nan)[0]][0, 0] = float("nan")
    hostile = {
        "another network": (encode_blob(child.tensors, _state_meta(spec, child, network="ff" * 32)),
                            "tessera-global/1 blob is for another network"),
        "names a miner": (encode_blob(child.tensors, _state_meta(spec, child, miner="ee" * 32)),
                          "tessera-global/1 blob names a miner; it is a submission, not a global state"),
        "another group": (encode_blob(child.tensors, _state_meta(spec, child, group={0: [0]})),
                          "tessera-global/1 blob is for another expert group"),
        "one NaN": (encode_blob(nan, _state_meta(spec, child)), "tessera-global/1 blob holds non-finite values"),
        "truncated": (child.to_blob()[:-8], "tessera-global/1 blob: truncated"),
    }
    for label, (state, reason) in hostile.items():
        with pytest.raises(StateError) as info:
            GlobalExperts.from_blobs(state, momentum, spec, _shapes(spec))
        assert str(info.value) == reason, label


def test_from_blobs_refuses_momentum_of_another_round_or_dtype(spec: NetworkSpec) -> None:
    _, child = _chain(spec)
    state = child.to_blob()
    momentum = _state_meta(spec, child, base=child.hash, format=MOMENTUM_FORMAT)
    later = encode_blob(child.momentum, dataclasses.replace(momentum, round=child.round + 1))
    with pytest.raises(StateError, match=f"momentum is for round {child.round + 1}, the state for round {child.round}"):
        GlobalExperts.from_blobs(state, later, spec, _shapes(spec))
    half = encode_blob({k: v.to(torch.bfloat16) for k, v in child.momentum.items()}, momentum)
    with pytest.raises(StateError, match="momentum tensors must be float32"):
        GlobalExperts.from_blobs(state, half, spec, _shapes(spec))


def test_a_child_keeps_the_parents_names_and_writes_its_momentum_in_fp32(spec: NetworkSpec) -> None:
    genesis, child = _chain(spec)
    fewer = dict(list(child.tensors.items())[1:])
    with pytest.raises(ValueError, match="exactly the parent's tensor names"):
        genesis.child(3, fewer, {k: child.momentum[k] for k in fewer})
    half = genesis.child(3, child.tensors, {k: v.to(torch.bfloat16) for k, v in child.momentum.items()})
    again = GlobalExperts.from_blobs(half.to_blob(), half.momentum_blob(), spec, _shapes(spec))
    assert all(m.dtype == torch.float32 for m in again.momentum.values())


def test_a_state_blob_never_passes_as_a_submission(spec: NetworkSpec) -> None:
    genesis, child = _chain(spec)
    data = child.to_blob()
    expect = Expectation(
        network=spec.network_id,
        round=3,
        miner="",
        base=genesis.hash,
        group=spec.group,
        shapes=_shapes(spec),
        dtype="float32",
        commitment=blob_hash(data),
        max_header_bytes=spec.limits.max_header_bytes,
    )
    assert check_submission(data, expect).reason == "wrong format"


def test_adopt_needs_a_strict_weighted_majority() -> None:
    a, b, c, d = ("a" * 64, "b" * 64, "c" * 64, "d" * 64)
    weights = {a: 3.0, b: 1.0, c: 1.0, d: 1.0}
    assert adopt({a: "x", b: "x"}, weights) == "x"  # 4 of 6
    assert adopt({a: "x", b: "y", c: "y", d: "y"}, weights) is None  # 3 vs 3: tie
    assert adopt({a: "x"}, weights) is None  # 3 of 6 is not a strict majority
    assert adopt({b: "y", c: "y", d: "y"}, {**weights, a: 2.0}) == "y"  # 3 of 5
    assert adopt({"e" * 64: "z", a: "z"}, weights) is None  # an outsider's vote does not count
    assert adopt({}, weights) is None
    with pytest.raises(ValueError, match="no weight"):
        adopt({a: "x"}, {})

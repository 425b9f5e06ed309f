"""Compressed submissions: a valid pseudo-gradient blob is accepted and rebuilt; every hostile one is rejected."""

from __future__ import annotations

import dataclasses
import math
import struct
from collections.abc import Callable

import pytest
import torch

from protocol.spec import SpecError, parse_spec
from tests.conftest import make_spec_dict
from training.blob import BLOB_FORMAT, PGRAD_FORMAT, BlobMeta, blob_hash, encode_blob
from training.pgrad import PgradConfig, chunk_draw, coverage, drawn_chunks, encode, pgrad_config, rebuild
from validator.checks import Expectation, SubmissionVerdict, check_submission

GROUP = {0: [1], 1: [2]}
SHAPES = {
    f"layers.{layer}.experts.{e}.{param}": shape
    for layer, experts in GROUP.items()
    for e in experts
    for param, shape in (("gate_up_proj", (16, 8)), ("down_proj", (8, 8)))
}
CFG = PgradConfig(chunk=64, topk=8, quant="int8")
META = BlobMeta(network="aa" * 32, round=3, miner="bb" * 32, base="cc" * 32, group=GROUP, format=PGRAD_FORMAT)
GATE = "layers.0.experts.1.gate_up_proj"


def _grads() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {name: torch.randn(shape, generator=g) for name, shape in SHAPES.items()}


def _blob_tensors() -> dict[str, torch.Tensor]:
    return encode(_grads(), None, CFG)[0]


def _check(tensors: dict[str, torch.Tensor], meta: BlobMeta = META, cfg: PgradConfig = CFG) -> SubmissionVerdict:
    data = encode_blob(tensors, meta)
    expect = Expectation(network=META.network, round=META.round, miner=META.miner, base=META.base, group=GROUP,
                         shapes=SHAPES, dtype="float32", commitment=blob_hash(data), max_header_bytes=4096,
                         pgrad=cfg)
    return check_submission(data, expect)


def test_a_valid_compressed_blob_is_accepted_and_rebuilds_the_miner_experts() -> None:
    blob = _blob_tensors()
    verdict = _check(blob)
    assert verdict.ok, verdict.reason
    assert verdict.tensors is not None and verdict.tensors.keys() == blob.keys()
    global_t = {name: torch.full(shape, 0.5) for name, shape in SHAPES.items()}
    phi = rebuild(global_t, verdict.tensors, CFG)
    kept = blob[f"{GATE}.idx"].long()
    for name in SHAPES:
        changed = (phi[name] != 0.5).reshape(-1)
        assert int(changed.sum()) == blob[f"{name}.idx"].numel()
    assert bool((phi[GATE].reshape(2, 64) != 0.5).gather(1, kept).all())


def test_a_partitioned_network_accepts_only_the_chunks_the_miner_drew() -> None:
    cfg = dataclasses.replace(CFG, partitions=2)
    draw = chunk_draw(META.network, META.round, META.miner)
    own = encode(_grads(), None, cfg, draw)[0]
    verdict = _check(own, cfg=cfg)
    assert verdict.ok, verdict.reason
    assert verdict.tensors is not None
    global_t = {name: torch.full(shape, 0.5) for name, shape in SHAPES.items()}
    phi = rebuild(global_t, verdict.tensors, cfg, draw)
    mask = {name: m.repeat_interleave(math.prod(SHAPES[name]) // m.numel()).reshape(SHAPES[name])  # chunk -> entries
            for name, m in coverage(SHAPES, cfg, draw).items()}
    for name in SHAPES:  # only the drawn chunks move
        assert bool((phi[name][mask[name] == 0] == 0.5).all())
        assert int((phi[name] != 0.5).sum()) == (own[f"{name}.idx"].numel() if f"{name}.idx" in own else 0)
    # Chunks another draw picks, however well formed, are not this miner's to send.
    other = next(d for d in range(100) if drawn_chunks(SHAPES, cfg, d) != drawn_chunks(SHAPES, cfg, draw))
    verdict = _check(encode(_grads(), None, cfg, other)[0], cfg=cfg)
    assert not verdict.ok and verdict.reason.startswith(("missing tensor", "unexpected tensor", "wrong shape"))


def _set(name: str, index: tuple[int, ...], value: float) -> Callable[[dict[str, torch.Tensor]], None]:
    def edit(blob: dict[str, torch.Tensor]) -> None:
        blob[name][index] = value

    return edit


def _replace(name: str, make: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[dict[str, torch.Tensor]], None]:
    def edit(blob: dict[str, torch.Tensor]) -> None:
        blob[name] = make(blob[name])

    return edit


def _dup(blob: dict[str, torch.Tensor]) -> None:
    blob[f"{GATE}.idx"][0, 1] = blob[f"{GATE}.idx"][0, 0]


@pytest.mark.parametrize(
    ("edit", "reason"),
    [
        (_set(f"{GATE}.idx", (0, 7), 64), f"index out of range in {GATE}.idx"),
        (_set(f"{GATE}.idx", (1, 0), -5), f"index out of range in {GATE}.idx"),
        (_dup, f"duplicate index in {GATE}.idx"),
        (_replace(f"{GATE}.idx", lambda t: t.flip(1).contiguous()), f"indices not ascending in {GATE}.idx"),
        (_set(f"{GATE}.scale", (0,), float("nan")), f"non-finite scale in {GATE}.scale"),
        (_set(f"{GATE}.scale", (1,), float("-inf")), f"non-finite scale in {GATE}.scale"),
        (_set(f"{GATE}.scale", (1,), -0.5), f"negative scale in {GATE}.scale"),
        (_replace(f"{GATE}.idx", lambda t: t[:, :7].contiguous()), f"wrong shape for {GATE}.idx: [2, 7], expected [2, 8]"),
        (_replace(f"{GATE}.q", lambda t: torch.cat([t, t[:, :1]], 1)), f"wrong shape for {GATE}.q: [2, 9], expected [2, 8]"),
        (_replace(f"{GATE}.scale", lambda t: t[:1].contiguous()), f"wrong shape for {GATE}.scale: [1], expected [2]"),
        (_replace(f"{GATE}.idx", lambda t: t.to(torch.int8)), f"wrong dtype for {GATE}.idx: I8, expected U8"),
        (lambda b: b.pop(f"{GATE}.scale"), f"missing tensor {GATE}.scale"),
    ],
)
def test_hostile_compressed_blobs_are_rejected_with_their_own_reason(
    edit: Callable[[dict[str, torch.Tensor]], object], reason: str
) -> None:
    blob = _blob_tensors()
    edit(blob)
    verdict = _check(blob)
    assert not verdict.ok and verdict.reason == reason
    assert verdict.meta == META


def test_oversize_and_wrong_format_are_rejected() -> None:
    padded = {**_blob_tensors(), "layers.0.experts.1.gate_up_proj.x": torch.zeros(8192, dtype=torch.uint8)}
    assert _check(padded).reason == "blob too large"
    assert _check(_blob_tensors(), dataclasses.replace(META, format=BLOB_FORMAT)).reason == "wrong format"


def test_a_compressed_blob_exactly_at_the_cap_is_accepted_and_one_byte_over_is_too_large() -> None:
    data = encode_blob(_blob_tensors(), META)
    (n,) = struct.unpack("<Q", data[:8])

    def expect(max_header_bytes: int) -> Expectation:
        return Expectation(network=META.network, round=META.round, miner=META.miner, base=META.base, group=GROUP,
                           shapes=SHAPES, dtype="float32", commitment=blob_hash(data),
                           max_header_bytes=max_header_bytes, pgrad=CFG)

    assert expect(n).max_bytes() == len(data)
    assert check_submission(data, expect(n)).ok
    assert check_submission(data, expect(n - 1)).reason == "blob too large"


def test_full_experts_are_refused_where_the_spec_asks_for_pseudo_gradients() -> None:
    verdict = _check(_grads(), dataclasses.replace(META, format=PGRAD_FORMAT))
    assert not verdict.ok and verdict.reason.startswith("missing tensor")


def test_the_spec_names_the_format_and_a_default_section_keeps_the_network_id() -> None:
    plain = parse_spec(make_spec_dict())
    assert pgrad_config(plain) is None
    explicit = parse_spec({**make_spec_dict(), "submission": {"format": "experts"}})
    assert explicit.network_id == plain.network_id
    compressed = parse_spec({**make_spec_dict(), "submission": {"format": "pgrad", "chunk": 64, "topk": 8,
                                                                 "quant": "int8", "partitions": 1}})
    assert pgrad_config(compressed) == CFG and compressed.network_id != plain.network_id
    halves = parse_spec({**make_spec_dict(), "submission": {"format": "pgrad", "chunk": 64, "topk": 8,
                                                             "quant": "int8", "partitions": 2}})
    assert pgrad_config(halves) == dataclasses.replace(CFG, partitions=2)
    with pytest.raises(SpecError, match="submission: topk must be a multiple of 4"):
        parse_spec({**make_spec_dict(), "submission": {"format": "pgrad", "topk": 6}})

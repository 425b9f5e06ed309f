"""Edges of the compressed pseudo-gradient format on hand-made tensors: the config's bounds, pinned
draws, tensors a draw skips, tensors smaller than topk, all-zero chunks, two-byte indices, ties,
`rebuild`, and the error-feedback file's mark."""

from __future__ import annotations

import pytest
import safetensors.torch
import torch

from training.pgrad import (
    PgradConfig,
    check_compressed,
    chunk_draw,
    compressed_bytes,
    compressed_shapes,
    coverage,
    decode,
    drawn_chunks,
    encode,
    error_bytes,
    load_error,
    rebuild,
)

RAGGED = {"a": (8,), "b": (2,)}  # chunks of 4: a has 2, b is one chunk of its own 2 entries


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"chunk": 0}, "pgrad chunk must be between 1 and 32768, got 0"),
        ({"chunk": 32769}, "pgrad chunk must be between 1 and 32768, got 32769"),
        ({"chunk": 4, "topk": 8}, "pgrad topk must be a multiple of 4 between 4 and chunk, got 8"),
        ({"topk": 0}, "pgrad topk must be a multiple of 4 between 4 and chunk, got 0"),
        ({"partitions": 65}, "pgrad partitions must be between 1 and 64, got 65"),
    ],
)
def test_config_refuses_each_value_just_past_its_bound(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        PgradConfig(**kwargs)  # type: ignore[arg-type]


def test_the_largest_chunk_indexes_its_last_entry_in_int16() -> None:
    cfg = PgradConfig(chunk=32768, topk=4, quant="int8", partitions=64)
    g = torch.zeros(32768)
    g[-4:] = torch.tensor([1.0, -2.0, 3.0, -4.0])
    blob, _ = encode({"t": g}, None, cfg)
    assert blob["t.idx"].dtype == torch.int16
    assert blob["t.idx"].tolist() == [[32764, 32765, 32766, 32767]]
    assert check_compressed(blob, {"t": (32768,)}, cfg) == ""
    assert torch.allclose(decode(blob, {"t": (32768,)}, cfg)["t"], g, atol=4.0 / 127 / 2)


def test_indices_past_a_byte_take_two_bytes_in_the_size_cap_and_in_each_draw() -> None:
    cfg = PgradConfig(chunk=512, topk=4, quant="int8")
    per_chunk = 2 * 4 + 4 + 4  # I16 indices, int8 codes, one fp32 scale
    assert compressed_bytes({"t": (1024,)}, cfg) == compressed_bytes({"t": (1024,)}, cfg, draw=0) == 2 * per_chunk
    blob, _ = encode({"t": torch.linspace(-1.0, 1.0, 1024)}, None, cfg)
    assert sum(t.numel() * t.element_size() for t in blob.values()) == 2 * per_chunk


def test_chunk_draw_is_pinned_so_every_validator_and_release_draws_the_same_chunks() -> None:
    # The first four bytes, big-endian, of SHA-256 of "tessera-pgrad-chunks:net:3:miner-0".
    assert chunk_draw("net", 3, "miner-0") == 1400699291
    assert chunk_draw("tessera", 0, "alice") == 1798284370


@pytest.mark.parametrize("partitions", [1, 3])
@pytest.mark.parametrize("draw", [-1, 1 << 32])
def test_a_draw_outside_32_bits_is_refused_whatever_the_partitions(partitions: int, draw: int) -> None:
    with pytest.raises(ValueError, match="a chunk draw is a 32-bit number"):
        drawn_chunks(RAGGED, PgradConfig(chunk=4, topk=4, partitions=partitions), draw)


def test_two_partitions_draw_half_of_the_groups_chunks() -> None:
    cfg = PgradConfig(chunk=4, topk=4, quant="int8", partitions=2)
    parts = {"a": (4, 4), "b": (2, 2), "c": (8,)}  # 7 chunks: ceil(7 / 2) = 4 a draw
    assert drawn_chunks(parts, cfg, 0) == {"a": [1, 2, 3], "c": [1]}
    assert drawn_chunks(parts, cfg, 2) == {"a": [1, 2, 3], "b": [0]}


def test_the_draw_numbers_chunks_in_sorted_name_order_whatever_the_dict_order() -> None:
    cfg = PgradConfig(chunk=4, topk=4, quant="int8", partitions=3)
    shuffled = {"c": (8,), "a": (4, 4), "b": (2, 2)}  # sorted: a's chunks are 0-3, b's 4, c's 5-6
    assert drawn_chunks(shuffled, cfg, 12345) == {"a": [3], "b": [0], "c": [1]}


def test_a_tensor_the_draw_skips_has_no_blob_tensors_decodes_to_zero_and_owes_nothing() -> None:
    cfg = PgradConfig(chunk=4, topk=4, quant="int8", partitions=3)
    assert drawn_chunks(RAGGED, cfg, 1) == {"a": [0]} and drawn_chunks(RAGGED, cfg, 0) == {"b": [0]}
    names = ["a.idx", "a.q", "a.scale"]
    assert sorted(compressed_shapes(RAGGED, cfg, 1)) == names
    assert {name: m.tolist() for name, m in coverage(RAGGED, cfg, 1).items()} == {"a": [1.0, 0.0], "b": [0.0]}
    g = {"a": torch.arange(1.0, 9.0), "b": torch.tensor([2.0, -1.0])}
    blob, error = encode(g, None, cfg, draw=1)
    assert sorted(blob) == names
    assert check_compressed(blob, RAGGED, cfg, draw=1) == ""  # checks draw 1's tensors, not draw 0's b
    dense = decode(blob, RAGGED, cfg, draw=1)
    assert dense["b"].tolist() == [0.0, 0.0] and error["b"].tolist() == [0.0, 0.0]
    assert dense["a"][4:].tolist() == [0.0] * 4 and error["a"][4:].tolist() == [0.0] * 4


def test_a_tensor_smaller_than_topk_keeps_every_entry_with_a_ragged_last_byte() -> None:
    cfg = PgradConfig(chunk=16, topk=8, quant="2bit")
    g = {"t": torch.tensor([1.0, -1.0, 1 / 3, -1 / 3, 1.0, 1.0])}  # codes 3, 0, 2, 1, 3, 3
    assert compressed_shapes({"t": (6,)}, cfg) == {
        "t.idx": ("U8", (1, 6)), "t.q": ("U8", (1, 2)), "t.scale": ("F32", (1,)),
    }
    assert compressed_bytes({"t": (6,)}, cfg) == compressed_bytes({"t": (6,)}, cfg, draw=0) == 6 + 2 + 4
    blob, error = encode(g, None, cfg)
    assert blob["t.q"].tolist() == [[3 | 0 << 2 | 2 << 4 | 1 << 6, 3 | 3 << 2]]
    assert check_compressed(blob, {"t": (6,)}, cfg) == ""  # the second byte's two codes are not padding
    assert torch.allclose(decode(blob, {"t": (6,)}, cfg)["t"], g["t"], atol=1e-6)
    assert error["t"].abs().max().item() < 1e-6
    blob["t.q"][0, 1] |= 0b0001_0000
    assert check_compressed(blob, {"t": (6,)}, cfg) == "padding bits set in t.q"


@pytest.mark.parametrize("quant", ["int8", "2bit"])
def test_a_chunk_of_zeros_has_scale_zero_checks_and_decodes_to_zero(quant: str) -> None:
    """An expert a miner's data never routed to leaves whole chunks unmoved: an honest blob."""
    cfg = PgradConfig(chunk=4, topk=4, quant=quant)  # type: ignore[arg-type]
    g = {"t": torch.tensor([0.0, 0.0, 0.0, 0.0, 1.0, -2.0, 0.5, 0.25])}
    blob, error = encode(g, None, cfg)
    assert blob["t.scale"].tolist()[0] == 0.0
    if quant == "int8":
        assert blob["t.q"][0].tolist() == [0, 0, 0, 0]
    assert check_compressed(blob, {"t": (8,)}, cfg) == ""
    dense = decode(blob, {"t": (8,)}, cfg)["t"]
    assert dense[:4].tolist() == [0.0] * 4 and error["t"][:4].tolist() == [0.0] * 4
    assert bool(torch.isfinite(dense).all())


def test_equal_magnitudes_keep_the_lower_indices() -> None:
    cfg = PgradConfig(chunk=8, topk=4, quant="int8")
    blob, error = encode({"t": torch.tensor([1.0, -1.0, 0.5, 1.0, -1.0, 1.0, -1.0, 1.0])}, None, cfg)
    assert blob["t.idx"].tolist() == [[0, 1, 3, 4]]
    assert error["t"].tolist() == [0.0, 0.0, 0.5, 0.0, 0.0, 1.0, -1.0, 1.0]
    # From 64 entries on, torch's unstable CPU sort reorders ties: the choice needs the stable one.
    cfg = PgradConfig(chunk=64, topk=8, quant="int8")
    blob, _ = encode({"t": torch.tensor([1.0, -1.0, 0.5, 0.25] * 16)}, None, cfg)
    assert blob["t.idx"].tolist() == [[0, 1, 4, 5, 8, 9, 12, 13]]


def test_bf16_gradients_encode_exactly_as_their_fp32_values() -> None:
    g = torch.tensor([0.5, -2.0, 0.125, 1.0, 8.0, 0.0, -0.25, 0.375])  # exact in bf16
    cfg = PgradConfig(chunk=4, topk=4, quant="int8")
    blob16, error16 = encode({"t": g.to(torch.bfloat16)}, None, cfg)
    blob32, error32 = encode({"t": g}, None, cfg)
    assert blob16["t.scale"].dtype == torch.float32
    assert all(torch.equal(blob16[name], blob32[name]) for name in blob32)
    assert torch.equal(error16["t"], error32["t"])


def test_rebuild_subtracts_the_decoded_pseudo_gradient_from_the_global_experts_in_fp32() -> None:
    cfg = PgradConfig(chunk=4, topk=4, quant="2bit")
    blob, _ = encode({"t": torch.tensor([3.0, -3.0, 1.0, -1.0])}, None, cfg)  # decodes exactly
    global_t = {"t": torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.bfloat16)}
    phi = rebuild(global_t, blob, cfg)  # Φ_i = Φ_t − G_i
    assert phi["t"].dtype == torch.float32
    assert phi["t"].tolist() == pytest.approx([-2.0, 5.0, 2.0, 5.0], abs=1e-6)


def test_the_error_buffer_file_is_fp32_whatever_the_buffer_holds() -> None:
    error = {"t": torch.tensor([[0.5, -1.25], [2.0, 0.0]], dtype=torch.bfloat16).t()}  # bf16, not contiguous
    loaded = load_error(error_bytes(error), {"t": (2, 2)})
    assert loaded["t"].dtype == torch.float32 and loaded["t"].tolist() == [[0.5, 2.0], [-1.25, 0.0]]


def test_an_error_buffer_file_missing_a_tensor_of_the_group_is_refused() -> None:
    data = error_bytes({"a": torch.zeros(8)})
    with pytest.raises(ValueError, match="names other tensors than the expert group"):
        load_error(data, RAGGED)


def test_an_expert_weights_file_with_the_same_names_is_not_taken_for_a_buffer() -> None:
    weights = {"layers.0.experts.1.down_proj": torch.ones(2, 4)}
    marked_as_weights = safetensors.torch.save(weights, metadata={"format": "pt"})  # as save_pretrained marks them
    with pytest.raises(ValueError, match="does not name tessera-error-feedback/1"):
        load_error(marked_as_weights, {"layers.0.experts.1.down_proj": (2, 4)})

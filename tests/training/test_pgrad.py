"""Compressed pseudo-gradients on hand-made tensors: what is kept, how it decodes, what is left over."""

from __future__ import annotations

import math

import pytest
import safetensors.torch
import torch

from training.pgrad import (
    ERROR_FORMAT,
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
    layout,
    load_error,
)

SHAPES = {"layers.0.experts.1.down_proj": (2, 4), "layers.0.experts.1.gate_up_proj": (4, 4)}


def grads() -> dict[str, torch.Tensor]:
    return {
        "layers.0.experts.1.down_proj": torch.tensor([[0.1, -4.0, 0.2, 3.0], [1.0, 0.0, -0.5, 0.25]]),
        "layers.0.experts.1.gate_up_proj": torch.arange(16, dtype=torch.float32).reshape(4, 4) - 7.5,
    }


def test_int8_keeps_the_largest_entries_of_each_chunk_in_index_order() -> None:
    cfg = PgradConfig(chunk=4, topk=4, quant="int8")
    g = {"t": torch.tensor([0.5, -2.0, 0.1, 1.0, 8.0, 0.0, -0.2, 0.3])}
    assert layout((8,), cfg) == (2, 4, 4)
    blob, error = encode(g, None, cfg)
    assert blob["t.idx"].tolist() == [[0, 1, 2, 3], [0, 1, 2, 3]]
    assert blob["t.scale"].tolist() == pytest.approx([2.0 / 127, 8.0 / 127])
    assert blob["t.q"][1, 0] == 127 and blob["t.q"][0, 1] == -127
    dense = decode(blob, {"t": (8,)}, cfg)["t"]
    assert torch.allclose(dense, g["t"], atol=8.0 / 127 / 2 + 1e-6)
    assert torch.allclose(dense + error["t"], g["t"], atol=1e-6)


def test_top_k_drops_small_entries_into_the_error_buffer() -> None:
    g = {"t": torch.tensor([0.5, -2.0, 0.1, 1.0, 0.0, 0.0, -0.2, 0.3] * 2)}
    cfg = PgradConfig(chunk=8, topk=4, quant="int8")
    blob, error = encode(g, None, cfg)
    assert blob["t.idx"].tolist() == [[0, 1, 3, 7], [0, 1, 3, 7]]
    dense = decode(blob, {"t": (16,)}, cfg)["t"]
    assert dense[[2, 4, 5, 6]].tolist() == [0.0, 0.0, 0.0, 0.0]
    assert error["t"][[2, 6]].tolist() == pytest.approx([0.1, -0.2])
    assert torch.allclose(dense + error["t"], g["t"], atol=1e-6)


def test_2bit_codes_decode_to_four_levels_of_the_chunk_scale() -> None:
    cfg = PgradConfig(chunk=4, topk=4, quant="2bit")
    g = {"t": torch.tensor([3.0, -3.0, 1.0, -1.0])}
    blob, error = encode(g, None, cfg)
    assert blob["t.q"].dtype == torch.uint8 and blob["t.q"].shape == (1, 1)
    assert blob["t.q"].item() == 3 | (0 << 2) | (2 << 4) | (1 << 6)
    assert decode(blob, {"t": (4,)}, cfg)["t"].tolist() == pytest.approx([3.0, -3.0, 1.0, -1.0])
    assert error["t"].abs().max().item() == pytest.approx(0.0, abs=1e-6)


def test_error_feedback_sends_what_earlier_rounds_left_behind() -> None:
    cfg = PgradConfig(chunk=16, topk=4, quant="2bit")
    error = None
    sent_total = {name: torch.zeros(shape) for name, shape in SHAPES.items()}
    g = grads()
    for _ in range(3):
        before = error
        blob, error = encode(g, before, cfg)
        dense = decode(blob, SHAPES, cfg)
        for name in SHAPES:
            expected = g[name] + (before[name] if before is not None else 0)
            assert torch.allclose(dense[name] + error[name], expected, atol=1e-5)
            sent_total[name] += dense[name]
    # After three rounds, sent + still owed = three times the gradient: nothing was lost.
    for name in SHAPES:
        assert torch.allclose(sent_total[name] + error[name], 3 * g[name], atol=1e-4)


def test_shapes_and_bytes_follow_the_layout() -> None:
    cfg = PgradConfig(chunk=8, topk=4, quant="2bit")
    shapes = compressed_shapes({"a": (4, 4), "b": (2, 2)}, cfg)
    assert shapes == {
        "a.idx": ("U8", (2, 4)), "a.q": ("U8", (2, 1)), "a.scale": ("F32", (2,)),
        "b.idx": ("U8", (1, 4)), "b.q": ("U8", (1, 1)), "b.scale": ("F32", (1,)),
    }
    assert compressed_bytes({"a": (4, 4), "b": (2, 2)}, cfg) == (8 + 2 + 8) + (4 + 1 + 4)
    # In-chunk indices take a byte up to chunks of 256 entries, two bytes beyond.
    assert compressed_shapes({"a": (512,)}, PgradConfig(chunk=256, topk=4))["a.idx"] == ("U8", (2, 4))
    assert compressed_shapes({"a": (514,)}, PgradConfig(chunk=514, topk=4))["a.idx"] == ("I16", (1, 4))
    with pytest.raises(ValueError, match="does not split into chunks of 8"):
        layout((3, 5), cfg)


def test_2bit_payload_is_at_least_16x_smaller_than_bf16() -> None:
    shapes = {"layers.0.experts.0.gate_up_proj": (768, 2048), "layers.0.experts.0.down_proj": (2048, 384)}
    bf16 = sum(2 * h * w for h, w in shapes.values())
    assert bf16 / compressed_bytes(shapes, PgradConfig(chunk=4096, topk=64, quant="2bit")) >= 16
    assert bf16 / compressed_bytes(shapes, PgradConfig(chunk=1024, topk=32, quant="2bit")) >= 16


@pytest.mark.parametrize(
    ("mutate", "reason"),
    [
        (lambda b: b["t.idx"].__setitem__((0, 3), 8), "index out of range in t.idx"),
        (lambda b: b["t.idx"].__setitem__((0, 0), -1), "index out of range in t.idx"),
        (lambda b: b["t.idx"].__setitem__((0, 1), b["t.idx"][0, 0]), "duplicate index in t.idx"),
        (lambda b: b["t.idx"].__setitem__(0, b["t.idx"][0].flip(0)), "indices not ascending in t.idx"),
        (lambda b: b["t.scale"].__setitem__(0, float("nan")), "non-finite scale in t.scale"),
        (lambda b: b["t.scale"].__setitem__(1, float("inf")), "non-finite scale in t.scale"),
        (lambda b: b["t.scale"].__setitem__(0, -1.0), "negative scale in t.scale"),
        (lambda b: b["t.scale"].__setitem__(1, 3.0e38), "scale overflows fp32 in t.scale"),
        (lambda b: b["t.q"].__setitem__((0, 0), -128), "int8 value -128 in t.q"),
    ],
)
def test_check_compressed_refuses_hostile_values(mutate: object, reason: str) -> None:
    cfg = PgradConfig(chunk=8, topk=4, quant="int8")
    blob, _ = encode({"t": torch.arange(16, dtype=torch.float32) - 3}, None, cfg)
    assert check_compressed(blob, {"t": (16,)}, cfg) == ""
    mutate(blob)  # type: ignore[operator]
    assert check_compressed(blob, {"t": (16,)}, cfg) == reason


def test_2bit_padding_bits_of_a_short_tensor_must_be_zero() -> None:
    cfg = PgradConfig(chunk=8, topk=4, quant="2bit")
    blob, _ = encode({"t": torch.tensor([1.0, -2.0])}, None, cfg)
    assert blob["t.q"].shape == (1, 1) and check_compressed(blob, {"t": (2,)}, cfg) == ""
    blob["t.q"][0, 0] |= 0b1100_0000
    assert check_compressed(blob, {"t": (2,)}, cfg) == "padding bits set in t.q"


@pytest.mark.parametrize(("quant", "scale", "reason"), [
    ("int8", 2.6e36, ""),  # 127 times it is 3.30e38, below fp32's largest, 3.40e38
    ("int8", 2.7e36, "scale overflows fp32 in t.scale"),  # 3.43e38
    ("2bit", torch.finfo(torch.float32).max, ""),
])
def test_a_scale_is_refused_exactly_when_its_largest_code_decodes_to_inf(quant: str, scale: float, reason: str) -> None:
    cfg = PgradConfig(chunk=8, topk=4, quant=quant)  # type: ignore[arg-type]
    blob, _ = encode({"t": torch.arange(16, dtype=torch.float32) - 3}, None, cfg)
    blob["t.scale"][:] = scale
    assert check_compressed(blob, {"t": (16,)}, cfg) == reason
    if not reason:
        assert bool(torch.isfinite(decode(blob, {"t": (16,)}, cfg)["t"]).all())


def test_int8_encodes_a_peak_at_fp32s_largest_into_a_blob_its_check_accepts() -> None:
    """peak / 127 rounds up there, and 127 codes of that scale would decode to inf."""
    largest = torch.finfo(torch.float32).max
    cfg = PgradConfig(chunk=8, topk=4, quant="int8")
    blob, error = encode({"t": torch.tensor([largest, -largest / 2, 1.0, 0.0])}, None, cfg)
    assert check_compressed(blob, {"t": (4,)}, cfg) == ""
    sent = decode(blob, {"t": (4,)}, cfg)["t"]
    assert bool(torch.isfinite(sent).all()) and bool(torch.isfinite(error["t"]).all())
    assert 0 < largest - sent[0].item() <= largest / 2**23  # the peak is sent, short of it by an ulp's worth


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"chunk": 40000}, "chunk"), ({"topk": 6}, "multiple of 4"), ({"quant": "4bit"}, "quant"),
     ({"partitions": 0}, "partitions")],
)
def test_config_refuses_bad_parameters(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        PgradConfig(**kwargs)  # type: ignore[arg-type]


def test_the_error_buffer_file_round_trips_and_refuses_another_group() -> None:
    _, error = encode(grads(), None, PgradConfig(chunk=4, topk=4, quant="2bit"))
    loaded = load_error(error_bytes(error), SHAPES)
    assert all(torch.equal(loaded[name], error[name]) for name in SHAPES)
    with pytest.raises(ValueError, match="other tensors"):
        load_error(error_bytes(error), {"layers.0.experts.1.down_proj": (2, 4)})
    with pytest.raises(ValueError, match="not fp32 of shape"):
        load_error(error_bytes(error), {**SHAPES, "layers.0.experts.1.down_proj": (4, 2)})
    with pytest.raises(ValueError, match="not fp32"):
        load_error(safetensors.torch.save({name: t.to(torch.float16) for name, t in error.items()},
                                          metadata={"format": ERROR_FORMAT}), SHAPES)
    with pytest.raises(ValueError, match="not a safetensors"):
        load_error(b"\x00" * 8, SHAPES)
    with pytest.raises(ValueError, match="does not name tessera-error-feedback/1"):
        load_error(safetensors.torch.save(dict(error)), SHAPES)  # the right tensors, without the buffer's mark


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_the_error_buffer_file_refuses_non_finite_values(value: float) -> None:
    """A diverged round's buffer must not carry its NaN or Inf into the rounds after a restart."""
    _, error = encode(grads(), None, PgradConfig(chunk=4, topk=4, quant="2bit"))
    error["layers.0.experts.1.gate_up_proj"][2, 1] = value
    with pytest.raises(ValueError, match="buffer's layers.0.experts.1.gate_up_proj holds non-finite values"):
        load_error(error_bytes(error), SHAPES)


PARTS = {"a": (4, 4), "b": (2, 2), "c": (8,)}  # chunks of 4: a has 4, b 1, c 2; group-wide numbers 0-3, 4, 5-6


def test_a_draw_picks_a_fixed_share_of_the_groups_chunks() -> None:
    cfg = PgradConfig(chunk=4, topk=4, quant="int8", partitions=3)
    draws = [drawn_chunks(PARTS, cfg, draw) for draw in range(60)]
    picked = [{(name, j) for name, chunks in d.items() for j in chunks} for d in draws]
    assert all(len(chunks) == 3 for chunks in picked)  # ceil(7 / 3) of the 7 chunks
    assert all(chunks == sorted(chunks) for d in draws for chunks in d.values())
    assert set().union(*picked) == {("a", 0), ("a", 1), ("a", 2), ("a", 3), ("b", 0), ("c", 0), ("c", 1)}
    assert drawn_chunks(PARTS, cfg, 7) == draws[7] and len({frozenset(c) for c in picked}) > 10
    # numpy's legacy RandomState stream is frozen, so this draw is the same on every validator, for good.
    assert drawn_chunks(PARTS, cfg, 12345) == {"a": [3], "b": [0], "c": [1]}
    assert drawn_chunks(PARTS, PgradConfig(chunk=4, topk=4), 99) == {"a": [0, 1, 2, 3], "b": [0], "c": [0, 1]}
    masks = coverage(PARTS, cfg, 12345)
    assert {name: m.tolist() for name, m in masks.items()} == {"a": [0.0, 0.0, 0.0, 1.0], "b": [1.0], "c": [0.0, 1.0]}
    with pytest.raises(ValueError, match="32-bit"):
        drawn_chunks(PARTS, cfg, 1 << 32)


def test_a_drawn_blob_decodes_to_its_chunks_and_keeps_only_its_own_leftover() -> None:
    cfg = PgradConfig(chunk=4, topk=4, quant="int8", partitions=3)
    g = {name: torch.arange(1, 1 + torch.Size(shape).numel(), dtype=torch.float32).reshape(shape) / 7
         for name, shape in PARTS.items()}
    earlier = {name: torch.full(shape, 0.5) for name, shape in PARTS.items()}
    blob, error = encode(g, earlier, cfg, draw=12345)
    assert sorted(blob) == [f"{name}.{part}" for name in "abc" for part in ("idx", "q", "scale")]
    assert blob["a.idx"].shape == (1, 4) and blob["c.idx"].shape == (1, 4)
    assert check_compressed(blob, PARTS, cfg, draw=12345) == ""
    assert compressed_bytes(PARTS, cfg, 12345) == sum(t.numel() * t.element_size() for t in blob.values())
    dense = decode(blob, PARTS, cfg, draw=12345)
    mask = {name: m.repeat_interleave(math.prod(PARTS[name]) // m.numel()).reshape(PARTS[name])  # chunk -> entries
            for name, m in coverage(PARTS, cfg, 12345).items()}
    for name in PARTS:
        acc = g[name] + earlier[name]
        assert torch.equal(dense[name] * (1 - mask[name]), torch.zeros(PARTS[name]))  # nothing off the drawn chunks
        # On them everything is kept (topk = chunk), up to int8 rounding, and the rounding is owed.
        assert torch.allclose(dense[name] + error[name], acc * mask[name], atol=1e-6)
        assert torch.equal(error[name] * (1 - mask[name]), torch.zeros(PARTS[name]))  # others' chunks are not owed


def test_the_size_cap_bounds_every_draw() -> None:
    cfg = PgradConfig(chunk=4, topk=4, quant="int8", partitions=3)
    sizes = {compressed_bytes(PARTS, cfg, draw) for draw in range(60)}
    # The three largest chunks: a's and c's cost 4 + 4 + 4 bytes each, b's (one chunk of its own size) too.
    assert compressed_bytes(PARTS, cfg) == max(sizes) == 3 * 12
    ragged = {"a": (8,), "b": (2,)}  # b is one chunk of 2 entries: 2 + 2 + 4 bytes against a chunk of a's 12
    assert {compressed_bytes(ragged, cfg, d) for d in range(20)} == {8, 12} and compressed_bytes(ragged, cfg) == 12


def test_chunk_draw_is_a_deterministic_32_bit_number_per_miner_and_round() -> None:
    draws = [chunk_draw("net", 3, f"miner-{i}") for i in range(64)]
    assert draws == [chunk_draw("net", 3, f"miner-{i}") for i in range(64)]
    assert all(0 <= d < 1 << 32 for d in draws) and len(set(draws)) == 64
    assert draws != [chunk_draw("net", 4, f"miner-{i}") for i in range(64)]
    assert chunk_draw("net", 3, "miner-0") != chunk_draw("other", 3, "miner-0")

"""Compressed pseudo-gradients on hand-made tensors: what is kept, how it decodes, what is left over."""

from __future__ import annotations

import pytest
import safetensors.torch
import torch

from training.pgrad import (
    PgradConfig,
    check_compressed,
    compressed_bytes,
    compressed_shapes,
    decode,
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
        "a.idx": ("I16", (2, 4)), "a.q": ("U8", (2, 1)), "a.scale": ("F32", (2,)),
        "b.idx": ("I16", (1, 4)), "b.q": ("U8", (1, 1)), "b.scale": ("F32", (1,)),
    }
    assert compressed_bytes({"a": (4, 4), "b": (2, 2)}, cfg) == (16 + 2 + 8) + (8 + 1 + 4)
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


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"chunk": 40000}, "chunk"), ({"topk": 6}, "multiple of 4"), ({"quant": "4bit"}, "quant")],
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
        load_error(safetensors.torch.save({name: t.to(torch.float16) for name, t in error.items()}), SHAPES)
    with pytest.raises(ValueError, match="not a safetensors"):
        load_error(b"\x00" * 8, SHAPES)

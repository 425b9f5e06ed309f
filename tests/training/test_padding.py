"""Padding is the run of pad that ends a row, so a tokenizer without a pad token (pad = eos) still
scores every document boundary inside a row, the same way under every attention kernel."""

from __future__ import annotations

import torch

from training.data import not_padding, pack
from training.evaluate import heldout_loss
from training.tiny import build_tiny_model, tiny_config
from training.tokenizer import ByteTokenizer

EOS = ByteTokenizer.eos_id


def test_only_the_run_of_pad_that_ends_a_row_is_padding() -> None:
    rows = torch.tensor([[5, 9, 9, 7], [9, 3, 9, 9], [9, 9, 9, 9], [1, 2, 3, 4]])
    assert not_padding(rows, pad_id=9).tolist() == [
        [True, True, True, True], [True, True, False, False], [False] * 4, [True] * 4,
    ]
    assert not_padding(torch.tensor([4, 9, 4, 9]), pad_id=9).tolist() == [True, True, True, False]


def _eos_padded() -> tuple[torch.Tensor, torch.Tensor]:
    """The same documents packed twice: padded with pad (256), and padded with eos as a tokenizer
    without a pad token does. In the first the last document's own eos is made pad too, since with
    eos padding it cannot be told from the padding that follows it."""
    docs = ["the cat sat.", "on the mat", "and then it ran off to the barn", "fin"]
    rows = pack(docs, ByteTokenizer(), seq_len=12)
    with_eos = rows.masked_fill(rows == ByteTokenizer.pad_id, EOS)
    assert int((rows[:, :-1] == EOS).sum()) >= 2  # document boundaries inside rows
    assert int(rows[1, 0]) == EOS  # one starts a row: with eos read as padding its query sees nothing
    trailing = ~not_padding(with_eos, EOS)
    return rows.masked_fill(trailing, ByteTokenizer.pad_id), with_eos


def test_with_eos_as_pad_every_boundary_inside_a_row_is_scored() -> None:
    reference, with_eos = _eos_padded()
    model = build_tiny_model("qwen3_moe", tiny_config("qwen3_moe"), seed=0)
    expected = heldout_loss(model, reference, batch_size=2, pad_id=ByteTokenizer.pad_id)
    got = heldout_loss(model, with_eos, batch_size=2, pad_id=EOS)
    assert got.tokens == expected.tokens
    assert abs(got.loss - expected.loss) < 1e-6


def test_with_eos_as_pad_the_loss_does_not_depend_on_the_attention_kernel() -> None:
    _, with_eos = _eos_padded()
    model = build_tiny_model("qwen3_moe", tiny_config("qwen3_moe"), seed=0)
    losses = []
    for kernel in ("eager", "sdpa"):
        model.set_attn_implementation(kernel)
        losses.append(heldout_loss(model, with_eos, batch_size=2, pad_id=EOS).loss)
    assert abs(losses[0] - losses[1]) < 1e-5

"""Edges of the data pipeline: malformed records, the held-out file pin, bounds of pack, shard and
batches, and pinned shards and held-out subsets (every validator must pick the same rows)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from training.data import (
    batches,
    check_heldout_file,
    heldout_subset,
    load_sequences,
    pack,
    read_documents,
    shard,
)
from training.tokenizer import ByteTokenizer

ROWS = torch.arange(10).view(10, 1)  # row i holds the token i, so a result reads as the rows it took


def test_the_heldout_file_must_be_a_file_with_the_pinned_hash(tmp_path: Path) -> None:
    path = tmp_path / "heldout.jsonl"
    path.write_bytes(b"abc")
    check_heldout_file(path, "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad")
    with pytest.raises(ValueError, match="hashes to ba7816bf.*but the spec pins data.heldout_sha256 = 00"):
        check_heldout_file(path, "00" * 32)
    with pytest.raises(ValueError, match="is not a file"):
        check_heldout_file(tmp_path, "00" * 32)


def test_txt_keeps_the_spaces_that_open_and_close_a_document(tmp_path: Path) -> None:
    path = tmp_path / "code.txt"
    path.write_text("    return x  \n\n\tpass\n", encoding="utf-8")
    assert read_documents(path) == ["    return x  ", "\tpass"]


def test_jsonl_skips_lines_of_only_whitespace(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    path.write_text('{"text": "x"}\n   \n\t\n{"text": "y"}\n', encoding="utf-8")
    assert read_documents(path) == ["x", "y"]


@pytest.mark.parametrize("record", [["text"], "text", {"text": None}, {"text": 3}])
def test_jsonl_refuses_a_record_that_is_not_an_object_with_string_text(tmp_path: Path, record: object) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"text": "ok"}) + "\n" + json.dumps(record) + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: expected an object with a string 'text' field"):
        read_documents(path)


def test_parquet_refuses_null_text(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["x", None]}), tmp_path / "p.parquet")
    with pytest.raises(ValueError, match="the 'text' column holds non-string or null values"):
        read_documents(tmp_path / "p.parquet")


def test_a_file_that_is_no_parquet_is_named_in_one_line(tmp_path: Path) -> None:
    path = tmp_path / "corrupt.parquet"
    path.write_bytes(b"garbage")  # pyarrow raises ArrowInvalid, not OSError, for this one
    with pytest.raises(ValueError, match=r"corrupt\.parquet: cannot read parquet: "):
        read_documents(path)


def test_pack_refuses_rows_too_short_to_predict_and_nothing_to_pack() -> None:
    with pytest.raises(ValueError, match="seq_len must be at least 2, got 1"):
        pack(["ab"], ByteTokenizer(), seq_len=1)
    with pytest.raises(ValueError, match="no documents to pack"):
        pack([], ByteTokenizer(), seq_len=4)
    with pytest.raises(ValueError, match="no data files given"):
        load_sequences([], ByteTokenizer(), 4)


def test_pack_tokenizes_documents_as_they_are() -> None:
    assert pack([" a\n"], ByteTokenizer(), seq_len=4).tolist() == [[32, 97, 10, 258]]


def test_shards_and_orders_are_pinned_per_miner_and_round() -> None:
    # The subset comes from SHA-256("shard|<miner>"), the order from SHA-256("order|<miner>|<round>").
    assert shard(ROWS, "miner-a", 3).flatten().tolist() == [1, 6, 8, 9, 2]
    assert shard(ROWS, "miner-a", 4).flatten().tolist() == [9, 1, 8, 6, 2]
    assert shard(ROWS, "miner-b", 3).flatten().tolist() == [6, 0, 4, 8, 5]


@pytest.mark.parametrize("fraction", [0.0, -0.5, 1.5])
def test_shard_refuses_a_fraction_outside_zero_to_one(fraction: float) -> None:
    with pytest.raises(ValueError, match=f"shard fraction must be in \\(0, 1\\], got {fraction}"):
        shard(ROWS, "miner-a", 0, fraction)


def test_shard_size_rounds_half_up_and_is_at_least_one_row() -> None:
    five = torch.arange(5).view(5, 1)
    assert len(shard(five, "m", 0, 0.3)) == 2  # 1.5 rows
    assert len(shard(five, "m", 0, 0.5)) == 3  # 2.5 rows
    assert len(shard(five, "m", 0, 1.0)) == 5
    assert shard(torch.arange(1).view(1, 1), "m", 0, 0.3).tolist() == [[0]]  # 0.3 rows


def test_batches_refuse_a_non_positive_size() -> None:
    with pytest.raises(ValueError, match="batch_size must be positive, got 0"):
        next(batches(ROWS, 0, seed=0))


@pytest.mark.timeout(10)  # without the check, the generator would wait forever for rows
def test_batches_refuse_an_empty_set_of_sequences() -> None:
    with pytest.raises(ValueError, match="cannot batch an empty set of sequences"):
        next(batches(torch.zeros(0, 4, dtype=torch.long), 2, seed=0))


def test_a_batch_larger_than_the_data_spans_several_whole_passes() -> None:
    three = torch.arange(3).view(3, 1)
    taken = [b.flatten().tolist() for _, b in zip(range(3), batches(three, 7, seed=0), strict=False)]
    assert [len(b) for b in taken] == [7, 7, 7]
    flat = [row for b in taken for row in b]
    assert all(sorted(flat[i:i + 3]) == [0, 1, 2] for i in range(0, 21, 3))  # seven whole passes


def test_each_pass_over_the_rows_is_a_fresh_permutation() -> None:
    three = torch.arange(3).view(3, 1)
    rows = [int(b) for _, b in zip(range(6), batches(three, 1, seed=0), strict=False)]
    assert rows == [2, 0, 1, 2, 1, 0]


def test_heldout_subsets_are_pinned_and_in_file_order() -> None:
    # Seeded by SHA-256("heldout|<round seed>"): every validator, on every release, scores these rows.
    assert heldout_subset(ROWS, "ab" * 32, 4).flatten().tolist() == [2, 5, 6, 8]
    assert heldout_subset(ROWS, "ab" * 32, 10).flatten().tolist() == list(range(10))  # all of it

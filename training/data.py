"""Training and held-out data: read local text files, tokenize, pack, shard per miner, batch.

Documents come from `.txt` (one document per blank-line-separated block), `.jsonl` (one JSON
object per line with a string `text` field; blank lines are skipped) or `.parquet` (a `text`
column). Each document is tokenized, followed by eos, and the stream of all documents in file
order is cut into rows of `seq_len` tokens; the last partial row is padded with pad, and padding
is that trailing run alone (`not_padding`): a tokenizer without a pad token pads with eos. Every
step is deterministic: the same files give the same [N, seq_len] tensor on every machine, and
shards, batch orders and held-out subsets come from explicit seeds (miner id, round, round seed).
This module knows nothing about models, the network or where the files came from.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from training.tokenizer import Tokenizer

SUFFIXES = (".txt", ".jsonl", ".parquet")


def file_sha256(path: str | Path) -> str:
    """Lower-case hex SHA-256 of a file's bytes, read in chunks."""
    digest = hashlib.sha256()
    with Path(path).open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def check_heldout_file(path: Path, pinned: str) -> None:
    """ValueError unless `path` is a file whose SHA-256 is the spec's `data.heldout_sha256` (`pinned`)."""
    if not path.is_file():
        raise ValueError(f"{path} is not a file")
    actual = file_sha256(path)
    if actual != pinned:
        raise ValueError(f"{path} hashes to {actual}, but the spec pins data.heldout_sha256 = {pinned}; "
                         "use the network's held-out file")


def check_general_file(path: Path | None, pinned: str | None, setting: str) -> None:
    """ValueError unless the general-domain held-out file `path` (given as `setting`) is what the spec's
    `data.general_sha256` (`pinned`) asks for: none where it pins none, else a file with that SHA-256."""
    if pinned is None and path is not None:
        raise ValueError(f"{setting}: the spec pins no general-domain held-out file (data.general_sha256); "
                         f"remove {setting}")
    if pinned is None:
        return
    if path is None:
        raise ValueError(f"{setting}: the spec pins a general-domain held-out file (data.general_sha256); "
                         "give its path")
    actual = file_sha256(path) if path.is_file() else None
    if actual != pinned:
        raise ValueError(f"{setting}: {path} {'hashes to ' + actual if actual else 'is not a file'}, but the spec "
                         f"pins data.general_sha256 = {pinned}; use the network's general-domain file")


def read_documents(path: str | Path) -> list[str]:
    """The documents of one `.txt`, `.jsonl` or `.parquet` file, in file order; ValueError naming the file."""
    path = Path(path)
    if path.suffix not in SUFFIXES:
        raise ValueError(f"{path}: unsupported data file type {path.suffix!r}; use one of {', '.join(SUFFIXES)}")
    if not path.is_file():
        raise ValueError(f"{path}: no such data file")
    if path.suffix == ".parquet":
        return _read_parquet(path)
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise ValueError(f"{path}:{line}: not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start})") from exc
    text = text.replace("\r\n", "\n").replace("\r", "\n")  # universal newlines, as text-mode reading gives
    return _read_txt(text) if path.suffix == ".txt" else _read_jsonl(path, text)


def _read_txt(text: str) -> list[str]:
    blocks = (block.strip("\n") for block in text.split("\n\n"))
    return [block for block in blocks if block.strip()]


def _read_jsonl(path: Path, text: str) -> list[str]:
    docs = []
    for lineno, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{lineno}: not valid JSON: {exc.msg}") from exc
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise ValueError(f"{path}:{lineno}: expected an object with a string 'text' field")
        docs.append(record["text"])
    return docs


def _read_parquet(path: Path) -> list[str]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (OSError, ValueError) as exc:  # pyarrow's ArrowInvalid (not a parquet file) is a ValueError
        raise ValueError(f"{path}: cannot read parquet: {exc}") from exc
    if "text" not in table.column_names:
        raise ValueError(f"{path}: parquet file has no 'text' column (columns: {', '.join(table.column_names)})")
    values: list[str] = table.column("text").to_pylist()
    if any(not isinstance(v, str) for v in values):
        raise ValueError(f"{path}: the 'text' column holds non-string or null values")
    return values


def pack(documents: Sequence[str], tokenizer: Tokenizer, seq_len: int) -> torch.Tensor:
    """Tokenize documents (each followed by eos) and cut the stream into a [N, seq_len] LongTensor."""
    if seq_len < 2:
        raise ValueError(f"seq_len must be at least 2, got {seq_len}")
    stream: list[int] = []
    for doc in documents:
        stream.extend(tokenizer.encode(doc))
        stream.append(tokenizer.eos_id)
    if not stream:
        raise ValueError("no documents to pack")
    remainder = len(stream) % seq_len
    if remainder:
        stream.extend([tokenizer.pad_id] * (seq_len - remainder))
    return torch.tensor(stream, dtype=torch.long).view(-1, seq_len)


def not_padding(ids: torch.Tensor, pad_id: int) -> torch.Tensor:
    """True where `ids` (rows along the last dimension) holds a token rather than padding.

    Padding is the run of `pad_id` that ends a row, the only place `pack` puts it. A tokenizer
    without a pad token pads with eos, so an eos inside a row is a document boundary, not padding
    (at worst a row's own final eos reads as padding)."""
    trailing = (ids == pad_id).flip(-1).long().cumprod(-1).flip(-1)
    return trailing == 0


def load_sequences(paths: Sequence[str | Path], tokenizer: Tokenizer, seq_len: int) -> torch.Tensor:
    """Read every file in the given order and pack all their documents together."""
    if not paths:
        raise ValueError("no data files given")
    documents: list[str] = []
    for path in paths:
        documents.extend(read_documents(path))
    if not documents:
        names = ", ".join(str(path) for path in paths)
        raise ValueError(f"{names}: the data file{'s hold' if len(paths) > 1 else ' holds'} no documents")
    return pack(documents, tokenizer, seq_len)


def check_disjoint(train_documents: Sequence[str], heldout_documents: Sequence[str]) -> None:
    """Refuse held-out data that shares any document with the training data."""
    shared = set(train_documents) & set(heldout_documents)
    if shared:
        raise ValueError(f"held-out data shares {len(shared)} document(s) with the training data")


def _seed_from(*parts: str) -> int:
    digest = hashlib.sha256("|".join(parts).encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") & ((1 << 63) - 1)


def _permutation(n: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randperm(n, generator=generator)


def shard(sequences: torch.Tensor, miner_id: str, round: int, fraction: float = 0.5) -> torch.Tensor:
    """The miner's own shard for a round: a miner-seeded subset, in a (miner, round)-seeded order.

    The subset (`fraction` of the rows, at least one) depends only on the miner id, so a miner keeps
    its slice of the data from round to round; the order changes every round.
    """
    if not 0 < fraction <= 1:
        raise ValueError(f"shard fraction must be in (0, 1], got {fraction}")
    n = sequences.shape[0]
    size = max(1, int(n * fraction + 0.5))
    rows = _permutation(n, _seed_from("shard", miner_id))[:size]
    order = _permutation(size, _seed_from("order", miner_id, str(round)))
    return sequences[rows[order]]


def batches(sequences: torch.Tensor, batch_size: int, seed: int) -> Iterator[torch.Tensor]:
    """Endless [batch_size, seq_len] batches; each pass over the rows is a fresh seeded permutation."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    n = sequences.shape[0]
    if n == 0:
        raise ValueError("cannot batch an empty set of sequences")
    generator = torch.Generator().manual_seed(seed)
    pending = torch.empty(0, dtype=torch.long)
    while True:
        while pending.numel() < batch_size:
            pending = torch.cat([pending, torch.randperm(n, generator=generator)])
        take, pending = pending[:batch_size], pending[batch_size:]
        yield sequences[take]


def heldout_subset(sequences: torch.Tensor, seed_hex: str, n: int) -> torch.Tensor:
    """The `n` held-out rows the round seed picks; every validator computes the same subset."""
    total = sequences.shape[0]
    if n > total:
        raise ValueError(f"held-out data has {total} sequences but the spec asks for {n} per round")
    rows = _permutation(total, _seed_from("heldout", seed_hex))[:n]
    return sequences[rows.sort().values]

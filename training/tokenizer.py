"""Tokenizers behind one small interface: text in, token ids out, plus the pad/eos ids and vocab size.

`ByteTokenizer` maps UTF-8 bytes to ids 0..255 and reserves pad=256, bos=257, eos=258 (vocab 260,
matching the tiny simulation models). A real network names a local Hugging Face tokenizer
directory instead; it is loaded offline. This module knows nothing about models, files of text,
packing or the network spec beyond the one `tokenizer` value it is handed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

BYTE_VOCAB = 260
BYTE_PAD = 256
BYTE_BOS = 257
BYTE_EOS = 258


class Tokenizer(Protocol):
    """What the data pipeline needs from a tokenizer."""

    pad_id: int
    eos_id: int
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens: ids 0..255, pad 256, bos 257, eos 258."""

    pad_id = BYTE_PAD
    bos_id = BYTE_BOS
    eos_id = BYTE_EOS
    vocab_size = BYTE_VOCAB

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A local Hugging Face tokenizer directory, loaded without network access."""

    def __init__(self, directory: Path) -> None:
        from transformers import AutoTokenizer

        try:
            self._tok = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
        except (OSError, ValueError) as exc:
            raise ValueError(f"{directory}: cannot load a tokenizer from this directory: {exc}") from exc
        eos = self._tok.eos_token_id
        if eos is None:
            raise ValueError(f"{directory}: tokenizer defines no eos token")
        pad = self._tok.pad_token_id
        self.eos_id: int = int(eos)
        self.pad_id: int = int(pad) if pad is not None else int(eos)
        self.vocab_size: int = len(self._tok)

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))


def check_vocab(tokenizer: Tokenizer, model_vocab: int, where: str | Path) -> None:
    """Refuse a tokenizer that can produce ids the model's embedding has no row for."""
    if tokenizer.vocab_size > model_vocab:
        raise ValueError(
            f"{where}: the tokenizer has {tokenizer.vocab_size} tokens but the model's vocabulary is "
            f"{model_vocab}; this tokenizer does not belong to this model"
        )


def load_tokenizer(spec_value: str, spec_dir: str | Path) -> Tokenizer:
    """`"byte"` gives the byte tokenizer; anything else is a tokenizer directory relative to `spec_dir`."""
    if spec_value == "byte":
        return ByteTokenizer()
    directory = (Path(spec_dir) / spec_value).resolve()
    if not directory.is_dir():
        raise ValueError(f"data.tokenizer: {directory} is not a directory (use 'byte' or a tokenizer directory)")
    return HFTokenizer(directory)

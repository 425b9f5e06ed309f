"""Test helper: a small hub-format MoE checkpoint directory with a real tokenizer, and data for it.

`write_hub_checkpoint` builds a tiny model of a family, writes it with `save_pretrained` (per-expert
hub keys, as real hub checkpoints hold them) and adds a byte-level BPE `tokenizer.json` trained
with the `tokenizers` library on generated arithmetic text (vocabulary 200, so it fits the tiny
models' 260 rows). `write_data` writes disjoint training and held-out JSONL files of that domain.
Nothing is downloaded.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from training.corpus import generate, write_documents
from training.tiny import build_tiny_model, tiny_config

TOKENIZER_VOCAB = 200


def write_tokenizer(directory: Path, vocab_size: int = TOKENIZER_VOCAB) -> Path:
    """A byte-level BPE tokenizer with <pad> and <eos>, saved as an HF tokenizer directory."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(generate("arithmetic", 200, seed=99), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>", pad_token="<pad>")
    fast.save_pretrained(str(directory))
    return directory


def write_hub_checkpoint(directory: Path, family: str, seed: int = 0, **overrides: object) -> Path:
    """A tiny `family` model saved the way hub checkpoints are, with a tokenizer beside it."""
    model = build_tiny_model(family, tiny_config(family, **overrides), seed)
    model.save_pretrained(str(directory))
    write_tokenizer(directory)
    return directory


def write_data(directory: Path, train_docs: int = 300, heldout_docs: int = 80) -> tuple[Path, Path]:
    """(train.jsonl, heldout.jsonl) of generated arithmetic, disjoint."""
    train = generate("arithmetic", train_docs, seed=1)
    seen = set(train)
    heldout = [d for d in generate("arithmetic", heldout_docs, seed=2) if d not in seen]
    return (write_documents(directory / "train.jsonl", train),
            write_documents(directory / "heldout.jsonl", heldout))

"""What several commands share: the spec's model, a network blob read and checked, the held-out subset, `--set`.

Each helper raises ValueError with one line naming the file and what was wrong (the command line turns
it into `tessera: error: ...`, exit 2). Heavy imports happen inside, so `tessera --help` stays fast.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


def load_spec_model(spec_path: Path) -> tuple[Any, Any, Any, Any]:
    """The spec, its base model (checked against base_hash), the adapter and the tokenizer."""
    from protocol.spec import load_spec
    from training.model import load_base
    from training.tokenizer import load_tokenizer

    spec = load_spec(spec_path)
    model, adapter = load_base(spec, spec_path, progress=True)
    return spec, model, adapter, load_tokenizer(spec.data.tokenizer, spec_path.parent)


def decode_network_blob(path: Path, data: bytes, spec: Any) -> tuple[Any, dict[str, Any]]:
    """The metadata and tensors of a blob of this spec's network and expert group."""
    from training.blob import BlobError, decode_blob

    try:
        meta, tensors = decode_blob(data, spec.limits.max_header_bytes)
    except BlobError as exc:
        raise ValueError(f"{path}: not a valid blob: {exc.reason}") from exc
    if meta.network != spec.network_id:
        raise ValueError(f"{path}: the blob is for network {meta.network[:16]}..., not this spec's network")
    if {layer: sorted(ids) for layer, ids in meta.group.items()} != dict(spec.group):
        raise ValueError(f"{path}: the blob's expert group differs from the spec's group")
    return meta, tensors


def heldout_sequences(heldout: Path | None, spec_path: Path, spec: Any, tokenizer: Any,
                      seed: str) -> torch.Tensor:
    """The held-out subset `seed` picks from `heldout` (default: the simulation layout's data/heldout.jsonl)."""
    from training.data import file_sha256, heldout_subset, load_sequences

    heldout = heldout or spec_path.parent / "data" / "heldout.jsonl"
    if not heldout.is_file():
        raise ValueError(f"{heldout}: no held-out file; pass --heldout FILE")
    if file_sha256(heldout) != spec.data.heldout_sha256:
        raise ValueError(f"{heldout}: SHA-256 differs from the spec's data.heldout_sha256; wrong held-out file")
    return heldout_subset(load_sequences([heldout], tokenizer, spec.data.seq_len), seed, spec.data.heldout_sequences)


def spec_setting(text: str) -> tuple[str, Any]:
    """argparse's type for `--set SECTION.FIELD=VALUE`: `protocol.spec.parse_setting`, its error shown as argparse's."""
    from protocol.spec import parse_setting

    try:
        return parse_setting(text)
    except ValueError as exc:  # argparse shows an ArgumentTypeError's own message
        raise argparse.ArgumentTypeError(str(exc)) from exc


def comma_list(text: str) -> tuple[str, ...]:
    """argparse's type for a comma-separated option (`--adversaries noise,copier`): its non-empty items."""
    return tuple(item.strip() for item in text.split(",") if item.strip())

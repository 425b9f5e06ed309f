"""What several commands share: the spec's model, a network blob read and checked, the held-out subset,
output files checked before any work, and argparse types (`--set`, `--seed`, comma lists).

Each helper raises ValueError with one line naming the file and what was wrong (the command line turns
it into `tessera: error: ...`, exit 2). Heavy imports happen inside, so `tessera --help` stays fast.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from protocol.files import write_file

if TYPE_CHECKING:
    import torch

DEFAULT_SEED = "0" * 64
"""The round seed `--seed` defaults to: it picks the held-out subset in eval, eval-subset and export."""


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


def check_output_file(path: Path, flag: str, *, replace: bool = False) -> None:
    """Refuse, before any work, an output file that cannot be written or (unless `replace`) already exists.

    A probe file is made and removed in the file's directory, or in its nearest existing ancestor when
    the directory is still to be made, so a write that would fail fails now rather than after the model
    has been loaded and run. Nothing is left behind: the directory is made when the result is written.
    """
    if path.is_dir():
        raise ValueError(f"{flag} {path}: is a directory; give a file path")
    if not replace and (path.exists() or path.is_symlink()):
        raise ValueError(f"{flag} {path}: already exists; choose another path (it is never overwritten)")
    existing = path.parent
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ValueError(f"{flag} {path}: {existing} is not a directory")
    try:
        fd, probe = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".probe", dir=existing)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise ValueError(f"{flag} {path}: cannot write a file there: {exc.strerror or exc}") from exc


def write_new_file(path: Path, data: bytes, flag: str) -> None:
    """Write a result to `path`, which `check_output_file` found free before the work began: through a
    synced temporary sibling linked into place, so it appears whole or not at all, and a file that
    appeared there meanwhile is never replaced (ValueError naming it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        write_file(path, data, replace=False)
    except FileExistsError:
        raise ValueError(f"{flag} {path}: a file appeared there while this ran; it was not overwritten") from None


def write_atomically(path: Path, text: str) -> None:
    """Write `text` to `path` (replacing it) whole or not at all: `protocol.files.write_file`."""

    path.parent.mkdir(parents=True, exist_ok=True)
    write_file(path, text.encode("utf-8"))


def round_seed(text: str) -> str:
    """argparse's type for `--seed`: a round seed, exactly 64 hex digits, lower-cased as rounds derive it."""
    from protocol.encoding import is_hex_digest

    if not is_hex_digest(text.lower()):
        raise argparse.ArgumentTypeError(f"a round seed is exactly 64 hex digits, got {text[:80]!r}")
    return text.lower()


def spec_setting(text: str) -> tuple[str, Any]:
    """argparse's type for `--set SECTION.FIELD=VALUE`: `protocol.spec.parse_setting`, its error shown as argparse's."""
    from protocol.spec import parse_setting

    try:
        return parse_setting(text)
    except ValueError as exc:  # argparse shows an ArgumentTypeError's own message
        raise argparse.ArgumentTypeError(str(exc)) from exc


def add_spec_settings(parser: argparse.ArgumentParser, after: str) -> None:
    """The `--set SECTION.FIELD=VALUE` option of `spec new` and `simulate` (into `args.spec_settings`):
    `protocol.spec.SETTABLE_SECTIONS`, applied after the options named in `after`."""
    parser.add_argument("--set", action=_SpecSettings, default=[], type=spec_setting, metavar="SECTION.FIELD=VALUE",
                        dest="spec_settings", help=after)


class _SpecSettings(argparse._AppendAction):
    """`--set`, appending; its help names what the spec lets a command line set, read from `protocol.spec` only when
    help is printed (importing it costs `tessera --help` 0.3 s)."""

    @property
    def help(self) -> str:
        from protocol.spec import DERIVED_FIELDS, SETTABLE_SECTIONS

        whole = [f"[{name}]" for name in SETTABLE_SECTIONS if name not in DERIVED_FIELDS]
        some = [f"{name}.{field}" for name, model in SETTABLE_SECTIONS.items() if name in DERIVED_FIELDS
                for field in model.model_fields if field not in DERIVED_FIELDS[name]]
        return (f"a value for a field of the spec's {', '.join(whole[:-1])} or {whole[-1]}, or {', '.join(some[:-1])} "
                f"or {some[-1]} (repeatable; after {self._after}), e.g. --set aggregation.outer_lr=2.5 "
                "--set timing.clock_skew_s=1")

    @help.setter
    def help(self, after: str) -> None:
        self._after = after


def comma_list(text: str) -> tuple[str, ...]:
    """argparse's type for a comma-separated option (`--adversaries noise,copier`): its non-empty items."""
    return tuple(item.strip() for item in text.split(",") if item.strip())

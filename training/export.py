"""Taking the network's product out: an improved HF checkpoint, or a small expert pack.

`export_checkpoint` writes a model (the base with the network's expert state already inserted) as
an HF checkpoint directory with `save_pretrained`, which writes hub-layout safetensors (per-expert
keys), plus the tokenizer when there is one. `write_expert_pack` writes just an expert group:
    experts.safetensors   the group's tensors under their blob names (layers.{l}.experts.{e}.{param})
    manifest.json         {format, network, round, group, base_hash, state, heldout_loss, family}
Both refuse an existing non-empty directory, build the result in a temporary sibling directory and
rename it into place, so a failure leaves nothing behind. This module knows nothing about the
network, specs or blob files.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from transformers import PreTrainedModel

from training.experts import check_same_names, expert_names

PACK_FORMAT = "tessera-expert-pack/1"
PACK_TENSORS = "experts.safetensors"
PACK_MANIFEST = "manifest.json"


def check_out_dir(out: Path) -> None:
    """Refuse an output directory that exists and is not empty (or is a file)."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"{out}: already exists and is not an empty directory; choose a new --out")


def export_checkpoint(model: PreTrainedModel, out: Path, tokenizer_dir: Path | None = None) -> None:
    """Write `model` as an HF checkpoint directory (config, hub-layout safetensors, tokenizer) at `out`."""
    with _staged(out) as staging:
        model.save_pretrained(str(staging))
        if tokenizer_dir is not None:
            from transformers import AutoTokenizer

            AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True).save_pretrained(str(staging))


def write_expert_pack(tensors: Mapping[str, torch.Tensor], manifest: Mapping[str, Any], out: Path) -> None:
    """Write an expert pack: the group's tensors and a JSON manifest naming their group and provenance."""
    group = {int(layer): list(ids) for layer, ids in manifest["group"].items()}
    check_same_names(dict.fromkeys(expert_names(group)), tensors, "expert pack")
    with _staged(out) as staging:
        save_file({k: v.detach().contiguous() for k, v in sorted(tensors.items())}, str(staging / PACK_TENSORS))
        body = {"format": PACK_FORMAT, **manifest, "group": {str(k): v for k, v in sorted(group.items())}}
        (staging / PACK_MANIFEST).write_text(json.dumps(body, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def read_expert_pack(directory: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(manifest, tensors) of an expert pack; refuses a pack whose tensors do not match its group."""
    directory = Path(directory)
    try:
        manifest = json.loads((directory / PACK_MANIFEST).read_text(encoding="utf-8"))
        tensors = load_file(str(directory / PACK_TENSORS))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, SafetensorError) as exc:
        raise ValueError(f"{directory}: not a readable expert pack: {exc}") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != PACK_FORMAT:
        raise ValueError(f"{directory}: manifest format is not {PACK_FORMAT}")
    try:
        group = {int(layer): [int(e) for e in ids] for layer, ids in manifest["group"].items()}
    except (KeyError, AttributeError, TypeError, ValueError) as exc:
        raise ValueError(f"{directory}: the manifest's group is not {{layer: [expert ids]}}: {exc!r}") from exc
    check_same_names(dict.fromkeys(expert_names(group)), tensors, "expert pack")
    return manifest, tensors


@contextmanager
def _staged(out: Path) -> Iterator[Path]:
    """A fresh temporary sibling of `out`, renamed to `out` on success and removed on failure."""
    check_out_dir(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.with_name(f".{out.name}.partial-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        yield staging
        if out.exists():
            out.rmdir()
        os.replace(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)

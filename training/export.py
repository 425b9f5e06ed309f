"""Taking the network's product out: an improved HF checkpoint, or a small expert pack.

`patch_checkpoint` writes the base checkpoint with the network's experts in place of the base's,
shard by shard: each weight file is copied as it is and only the byte ranges of the group's expert
rows (`training.checkpoint.row_pieces`) are overwritten, in the stored dtype, so the export holds
the group's tensors and no shard's; the layout, keys and every other byte stay the base's.
`export_checkpoint` writes a model built in memory (a tiny simulation base with the experts
inserted) with `save_pretrained`. Both add the tokenizer when there is one. `write_expert_pack`
writes just an expert group:
    experts.safetensors   the group's tensors under their blob names (layers.{l}.experts.{e}.{param})
    manifest.json         {format, network, round, group, base_hash, state, heldout_loss, family}
Given a provenance (where the state came from: `node.cli.export` assembles it), each writes it as
`provenance.json` beside the weights. All refuse an existing non-empty directory, build the result
in a temporary sibling directory and rename it into place, so a failure leaves nothing behind. This
module knows nothing about the network, specs or blob files.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from transformers import PreTrainedModel

from protocol.files import staged_directory
from training.adapters import adapter_for
from training.checkpoint import Stored, meta_model, model_sources, row_pieces, weight_files
from training.experts import check_same_names, expert_names, parse_name
from training.model import expert_tensor_names

PACK_FORMAT = "tessera-expert-pack/1"
PACK_TENSORS = "experts.safetensors"
PACK_MANIFEST = "manifest.json"
PROVENANCE = "provenance.json"
CHECKPOINT_FILES = ("config.json", "generation_config.json")
"""The base checkpoint's files besides its weights that an export copies."""


def check_out_dir(out: Path) -> None:
    """Refuse an output directory that exists and is not empty (or is a file)."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"{out}: already exists and is not an empty directory; choose a new --out")


def export_checkpoint(model: PreTrainedModel, out: Path, tokenizer_dir: Path | None = None,
                      provenance: Mapping[str, Any] | None = None) -> None:
    """Write `model` as an HF checkpoint directory (config, hub-layout safetensors, tokenizer) at `out`."""
    check_out_dir(out)
    with staged_directory(out) as staging:
        model.save_pretrained(str(staging))
        _finish(staging, tokenizer_dir, provenance)


def patch_checkpoint(base: Path, tensors: Mapping[str, torch.Tensor], out: Path, tokenizer_dir: Path | None = None,
                     provenance: Mapping[str, Any] | None = None) -> None:
    """Write the checkpoint `base` with `tensors` (blob names) over its expert rows at `out`, shard by shard.

    Reads `base`'s safetensors headers and config only; its weight files are copied and the rows
    patched in the copies, so memory holds `tensors` and one row in the stored dtype at a time.
    """
    meta = meta_model(base)
    adapter = adapter_for(meta.config.model_type)
    parsed = {name: parse_name(name) for name in tensors}
    fused = expert_tensor_names(meta, adapter, sorted({layer for layer, _, _ in parsed.values()}))
    sources = model_sources(base)
    writes: dict[Path, list[tuple[str, int, Stored]]] = {}  # file -> (tensor, where in its bytes, piece)
    for name, (layer, expert, param) in sorted(parsed.items()):
        model_name = fused[layer, param]
        shape = tuple(meta.get_parameter(model_name).shape)
        if tuple(tensors[name].shape) != shape[1:]:
            raise ValueError(f"{name}: shape {tuple(tensors[name].shape)}, the checkpoint holds {shape[1:]}")
        at = 0
        for piece in row_pieces(sources[model_name], shape, expert):
            writes.setdefault(piece.path, []).append((name, at, piece))
            at += piece.nbytes
    check_out_dir(out)
    with staged_directory(out) as staging:
        for path in weight_files(base):
            target = staging / path.name
            shutil.copyfile(path, target)
            _patch(target, writes.get(path, []), tensors)
        for name in (*CHECKPOINT_FILES, "model.safetensors.index.json"):
            if (base / name).is_file():
                shutil.copyfile(base / name, staging / name)
        _finish(staging, tokenizer_dir, provenance)


def _patch(target: Path, writes: list[tuple[str, int, Stored]], tensors: Mapping[str, torch.Tensor]) -> None:
    """Overwrite, in the copied file `target`, each piece's bytes with its share (from `start`) of its tensor's
    bytes in the stored dtype."""
    with target.open("r+b") as handle:
        for name, start, piece in writes:
            data = tensors[name].detach().to("cpu", getattr(torch, piece.dtype)).contiguous()
            flat = data.reshape(-1).view(torch.uint8).numpy()
            handle.seek(piece.offset)
            handle.write(flat[start : start + piece.nbytes].data)
        handle.flush()
        os.fsync(handle.fileno())


def _finish(staging: Path, tokenizer_dir: Path | None, provenance: Mapping[str, Any] | None) -> None:
    if tokenizer_dir is not None:
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True).save_pretrained(str(staging))
    if provenance is not None:
        (staging / PROVENANCE).write_text(json.dumps(provenance, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def write_expert_pack(tensors: Mapping[str, torch.Tensor], manifest: Mapping[str, Any], out: Path,
                      provenance: Mapping[str, Any] | None = None) -> None:
    """Write an expert pack: the group's tensors and a JSON manifest naming their group and provenance."""
    group = {int(layer): list(ids) for layer, ids in manifest["group"].items()}
    check_same_names(dict.fromkeys(expert_names(group)), tensors, "expert pack")
    check_out_dir(out)
    with staged_directory(out) as staging:
        save_file({k: v.detach().contiguous() for k, v in sorted(tensors.items())}, str(staging / PACK_TENSORS))
        body = {"format": PACK_FORMAT, **manifest, "group": {str(k): v for k, v in sorted(group.items())}}
        (staging / PACK_MANIFEST).write_text(json.dumps(body, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        _finish(staging, None, provenance)


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

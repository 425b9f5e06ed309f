"""`tessera spec new` and `tessera spec hash-model`: start a network from a hub MoE checkpoint.

    tessera spec hash-model DIR [--config]   print a checkpoint's base hash (streamed from its files),
                                             or with --config its config.json's hash (model.config_sha256)
    tessera spec new --checkpoint DIR --train FILE... --heldout FILE [--general FILE] --validator KEY[:WEIGHT]...
                     [--rule R] [--top-d N | --mass P] [--timing PRESET] [--set SECTION.FIELD=VALUE]...
                     --out SPEC

`spec new` hashes the base, its config.json, the held-out file and the general-domain held-out file (if given: the
merge gate's forgetting check), takes the tokenizer from the
checkpoint directory, runs Phase 1 selection (`training.selection.select_experts`) on the training
data and writes a complete spec that `spec check` accepts, every field written out (so no later release's
defaults can change its network id); paths in it are relative to the spec file.
`--set` gives any spec field not derived from those files (`protocol.spec.SETTABLE_SECTIONS`), over what
the other options wrote (the `--timing` preset, `--seq-len`, the checkpoint's dtype). It checks
everything before it writes: that the held-out file packs into at least one round's subset of sequences
before the checkpoint is hashed or loaded, and that every blob header (a miner's submission, a validator's
global state and momentum) fits the spec's `limits.max_header_bytes` (`check_header_cap`, which `spec
check` runs too), and writes nothing when a check fails. This module knows no selection or
hashing rules of its own; heavy imports happen when a command runs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from node.cli.common import add_spec_settings, check_output_file, write_new_file
from node.cli.main import command_group

if TYPE_CHECKING:
    from protocol.spec import NetworkSpec

RULES = ("gate-mass", "token-freq", "differential", "activation-norm")
TIMING_PRESETS: dict[str, dict[str, float]] = {
    "hour": {"train_s": 3600.0, "commit_s": 120.0, "reveal_s": 300.0, "evaluate_s": 600.0, "merge_s": 180.0},
    "quick": {"train_s": 600.0, "commit_s": 30.0, "reveal_s": 60.0, "evaluate_s": 120.0, "merge_s": 60.0},
    "sim": {"train_s": 40.0, "commit_s": 4.0, "reveal_s": 8.0, "evaluate_s": 8.0, "merge_s": 6.0},
}


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add `spec new` and `spec hash-model` to the `tessera spec` group."""
    spec = command_group(subparsers, "spec", "work with network spec files")
    hash_model = spec.add_parser("hash-model", help="print a checkpoint directory's base hash (or, with --config, "
                                 "its config.json's)")
    hash_model.add_argument("directory", type=Path, metavar="DIR", help="HF checkpoint directory")
    hash_model.add_argument("--config", action="store_true",
                            help="print the hash of its config.json (a spec's model.config_sha256) instead")
    hash_model.set_defaults(run=run_hash_model)

    new = spec.add_parser("new", help="write a network spec for a hub MoE checkpoint")
    new.add_argument("--checkpoint", required=True, type=Path, metavar="DIR", help="HF checkpoint directory")
    new.add_argument("--train", required=True, nargs="+", type=Path, metavar="FILE", help="miners' training files")
    new.add_argument("--heldout", required=True, type=Path, metavar="FILE", help="validators' held-out file")
    new.add_argument("--general", type=Path, metavar="FILE",
                     help="validators' general-domain held-out file, on which the merge gate checks forgetting "
                          "(data.general_sha256; default: none)")
    new.add_argument("--validator", required=True, action="append", metavar="KEY[:WEIGHT]",
                     help="validator node id (64 hex) with an optional weight; repeat for each")
    new.add_argument("--rule", choices=RULES, default="gate-mass", help="selection rule (default gate-mass)")
    budget = new.add_mutually_exclusive_group()
    budget.add_argument("--top-d", type=int, metavar="N", help="experts per layer (default 2)")
    budget.add_argument("--mass", type=float, metavar="P", help="cumulative share of the score per layer")
    new.add_argument("--timing", choices=sorted(TIMING_PRESETS), default="hour", help="phase lengths (default hour)")
    new.add_argument("--name", help="network name (default: the checkpoint directory's name)")
    new.add_argument("--seq-len", type=int, default=512, help="tokens per sequence (default 512)")
    new.add_argument("--heldout-sequences", type=int,
                     help="held-out sequences per round (default: the spec's data.heldout_sequences)")
    new.add_argument("--max-sequences", type=int, default=256,
                     help="training sequences the selection reads (default 256)")
    new.add_argument("--genesis", help="UTC start of round 0, ISO 8601 (default: now)")
    add_spec_settings(new, "--timing, --seq-len and --heldout-sequences")
    new.add_argument("--out", required=True, type=Path, metavar="SPEC", help="spec file to write; never overwritten")
    new.set_defaults(run=run_spec_new)


def run_hash_model(args: argparse.Namespace) -> int:
    from training.adapters import family_of
    from training.checkpoint import checkpoint_hash, config_hash, read_config

    config = read_config(args.directory)
    family_of(config)
    print(config_hash(config) if args.config else checkpoint_hash(args.directory))
    return 0


def run_spec_new(args: argparse.Namespace) -> int:
    from protocol.spec import DataSpec, apply_settings, judge_settings, parse_spec, written_out
    from training.adapters import adapter_for
    from training.checkpoint import checkpoint_hash, config_hash, read_config
    from training.data import check_disjoint, file_sha256, pack
    from training.experts import expected_shapes
    from training.model import load_checkpoint
    from training.selection import select_experts
    from training.tokenizer import HFTokenizer, check_vocab

    check_output_file(args.out, "--out")  # an unwritable or taken --out fails before any work
    _check_options(args)
    # A bad --set fails here, before the checkpoint is read; selection packs sequences of the spec's data.seq_len.
    data_settings = judge_settings(args.spec_settings).get("data", {})
    seq_len = data_settings.get("seq_len", args.seq_len)
    validators = _validators(args.validator)
    genesis = _genesis(args.genesis)
    top_d = args.top_d if args.top_d is not None or args.mass is not None else 2
    train_documents = [doc for path in args.train for doc in _documents("--train", path)]
    heldout_documents = _documents("--heldout", args.heldout)
    if args.general is not None:
        _documents("--general", args.general)
    try:  # every validator refuses to start on held-out data the miners train on
        check_disjoint(train_documents, heldout_documents)
    except ValueError as exc:
        raise ValueError(f"--heldout {args.heldout}: {exc}; hold those documents out of --train") from None
    checkpoint = args.checkpoint.resolve()
    config_sha256 = config_hash(read_config(checkpoint))
    _check_top_d(top_d, checkpoint)
    tokenizer = HFTokenizer(checkpoint)
    per_round = (DataSpec.model_fields["heldout_sequences"].default if args.heldout_sequences is None
                 else args.heldout_sequences)
    _check_heldout_fills(args.heldout, pack(heldout_documents, tokenizer, seq_len).shape[0], seq_len,
                         data_settings.get("heldout_sequences", per_round),
                         data_settings.get("gate_sequences", DataSpec.model_fields["gate_sequences"].default))
    base_hash = checkpoint_hash(checkpoint)
    model = load_checkpoint(checkpoint, progress=True)
    check_vocab(tokenizer, int(model.config.vocab_size), checkpoint)
    adapter = adapter_for(model.config.model_type)
    sequences = pack(train_documents, tokenizer, seq_len)[: args.max_sequences]
    selection = select_experts(model, adapter, sequences, args.rule, top_d=top_d, mass=args.mass,
                               pad_id=tokenizer.pad_id)
    here = args.out.resolve().parent
    spec: dict[str, Any] = {
        "name": args.name or checkpoint.name,
        "genesis": genesis,
        "timing": TIMING_PRESETS[args.timing],
        "model": {"family": adapter.family, "checkpoint": _relative(checkpoint, here), "base_hash": base_hash,
                  "config_sha256": config_sha256, "dtype": _blob_dtype(model)},
        "group": selection["group"],
        "data": {"train": [_relative(p.resolve(), here) for p in args.train],
                 "heldout_sha256": file_sha256(args.heldout), "tokenizer": _relative(checkpoint, here),
                 "seq_len": args.seq_len, "heldout_sequences": per_round},
        "validators": [{"key": key, "weight": weight} for key, weight in validators],
    }
    if args.general is not None:  # TOML has no null: a spec without the key pins no general-domain file
        spec["data"]["general_sha256"] = file_sha256(args.general)
    apply_settings(spec, args.spec_settings)
    judged = parse_spec(spec)  # the whole spec is judged before a byte is written
    check_header_cap(judged, expected_shapes(model, adapter, judged.group))
    network_id = judged.network_id
    _write_new(args.out, written_out(judged))  # every field: a later release's defaults cannot move its id
    print(json.dumps({"spec": str(args.out), "network_id": network_id, "base_hash": base_hash,
                      "group": selection["group"], "rule": args.rule}, indent=2, sort_keys=True))
    return 0


def _check_heldout_fills(path: Path, held: int, seq_len: int, per_round: int, gate: int) -> None:
    """Refuse a held-out file that packs into fewer sequences than one round scores and its merge gate scores
    apart from them: every validator would refuse it later."""
    if held < per_round + gate:
        raise ValueError(f"--heldout {path}: packs into {held} sequences of {seq_len} tokens, and a round scores "
                         f"{per_round} (--heldout-sequences, data.heldout_sequences) and gates its merge on {gate} "
                         "others (data.gate_sequences); add held-out documents, or ask for fewer sequences or "
                         "shorter ones (--seq-len)")


def check_header_cap(spec: NetworkSpec, shapes: Mapping[str, tuple[int, ...]]) -> None:
    """Refuse a spec whose blobs could have a header over `limits.max_header_bytes`, which every node refuses:
    a miner's submission, or the global state and momentum blobs validators write and every node reads
    (fp32 and named by no miner: in a bf16 network of many experts they can need more than a submission);
    `shapes` are the group's expert tensors (`training.experts.expected_shapes`)."""
    submission, state, cap = submission_header_bytes(spec, shapes), state_header_bytes(spec, shapes), \
        spec.limits.max_header_bytes
    need = max(submission, state)
    if need <= cap:
        return
    blob = (f"a miner's {spec.submission.format} blob" if submission >= state
            else "the validators' global state and momentum blobs")
    raise ValueError(
        f"limits.max_header_bytes ({cap}) is too small: {blob} for this expert group can need a header of up to "
        f"{need} bytes, and every node refuses a blob over the limit; raise it to {need} (`spec new`: --set "
        f"limits.max_header_bytes={need}; a spec file: its [limits]) or choose fewer experts (--top-d, --mass, "
        "the group)")


def state_header_bytes(spec: NetworkSpec, shapes: Mapping[str, tuple[int, ...]]) -> int:
    """The most bytes the header of a global state or momentum blob can take, as `training.state` writes
    them (fp32 tensors of the group's shapes; no miner) in round 999999999; it reads no weights."""
    from training.blob import BlobMeta, header_size
    from training.state import GLOBAL_FORMAT, MOMENTUM_FORMAT, STATE_MINER

    group = {layer: list(ids) for layer, ids in spec.group.items()}
    return max(header_size({name: ("F32", tuple(shape)) for name, shape in shapes.items()},
                           BlobMeta(network=spec.network_id, round=999_999_999, miner=STATE_MINER, base="f" * 64,
                                    group=group, format=fmt))
               for fmt in (GLOBAL_FORMAT, MOMENTUM_FORMAT))


def submission_header_bytes(spec: NetworkSpec, shapes: Mapping[str, tuple[int, ...]]) -> int:
    """The most bytes the header of a miner's blob can take in the spec's format, as `training.blob` writes it
    (the miner encodes its blob that way and refuses one over the cap: node.duties.miner).

    The bound is the blob with every chunk drawn (a pgrad draw carries some of them: fewer tensors, smaller
    shapes and offsets) in round 999999999; it reads no weights, so `spec check` can run it on a meta model.
    """
    import dataclasses

    from training.blob import BLOB_FORMAT, PGRAD_FORMAT, BlobMeta, blob_dtype, header_size
    from training.pgrad import compressed_shapes, pgrad_config

    cfg = pgrad_config(spec)
    if cfg is None:
        code = blob_dtype(spec.model.dtype)
        tensors = {name: (code, tuple(shape)) for name, shape in shapes.items()}
    else:
        tensors = compressed_shapes(shapes, dataclasses.replace(cfg, partitions=1))
    meta = BlobMeta(network=spec.network_id, round=999_999_999, miner="f" * 64, base="f" * 64,
                    group={layer: list(ids) for layer, ids in spec.group.items()},
                    format=BLOB_FORMAT if cfg is None else PGRAD_FORMAT)
    return header_size(tensors, meta)


def _check_options(args: argparse.Namespace) -> None:
    """The options judged before any file is read: the spec's own limits, named by flag."""
    name = args.name or args.checkpoint.resolve().name
    if not 1 <= len(name) <= 64:
        raise ValueError(f"--name {name!r}: a network name has 1 to 64 characters")
    if args.max_sequences < 1:
        raise ValueError(f"--max-sequences must be at least 1, got {args.max_sequences}")
    if not 8 <= args.seq_len <= 65536:
        raise ValueError(f"--seq-len must be between 8 and 65536 (the spec's data.seq_len), got {args.seq_len}")
    if args.heldout_sequences is not None and args.heldout_sequences < 1:
        raise ValueError(f"--heldout-sequences must be at least 1, got {args.heldout_sequences}")
    if args.top_d is not None and args.top_d < 1:
        raise ValueError(f"--top-d must be at least 1, got {args.top_d}")
    if args.mass is not None and not 0 < args.mass <= 1:
        raise ValueError(f"--mass must be in (0, 1], got {args.mass}")


def _documents(flag: str, path: Path) -> list[str]:
    """The documents of a data file given as `flag`; ValueError names a directory, a bad or an empty file."""
    from training.data import read_documents

    if path.is_dir():
        raise ValueError(f"{flag} {path}: is a directory; give a data file (.txt, .jsonl or .parquet)")
    documents = read_documents(path)  # names the file and the line of a bad record or bad UTF-8
    if not documents:
        raise ValueError(f"{flag} {path}: holds no documents")
    return documents


def _check_top_d(top_d: int | None, checkpoint: Path) -> None:
    """Refuse, before a weight is read, a --top-d over the experts per layer of the checkpoint's config."""
    from training.adapters import adapter_for
    from training.checkpoint import meta_model

    if top_d is None:
        return
    meta = meta_model(checkpoint)
    experts = adapter_for(meta.config.model_type).num_experts(meta)
    if top_d > experts:
        raise ValueError(f"--top-d {top_d}: the checkpoint has only {experts} experts per layer")


def _validators(texts: list[str]) -> list[tuple[str, float]]:
    """The --validator options as (node id, weight); a node id given twice is refused, naming it."""
    validators = [_validator(text) for text in texts]
    seen: set[str] = set()
    for key, _ in validators:
        if key in seen:
            raise ValueError(f"--validator {key}: given twice; name each validator once, with its weight")
        seen.add(key)
    return validators


def _validator(text: str) -> tuple[str, float]:
    from protocol.encoding import is_hex_digest

    key, _, weight = text.partition(":")
    if not is_hex_digest(key):
        raise ValueError(f"--validator {text!r}: the key must be a node id of 64 lower-case hex digits")
    try:
        value = float(weight) if weight else 1.0
    except ValueError:
        raise ValueError(f"--validator {text!r}: the weight must be a number") from None
    if not 0 < value < math.inf:
        raise ValueError(f"--validator {text!r}: the weight must be a positive finite number")
    return key, value


def _genesis(text: str | None) -> datetime:
    if text is None:
        return datetime.now(UTC).replace(microsecond=0)
    try:
        value = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(f"--genesis {text!r}: not an ISO 8601 time like 2026-01-01T00:00:00Z") from None
    if value.tzinfo is None:
        raise ValueError(f"--genesis {text!r}: give a UTC offset, e.g. {value.isoformat()}Z")
    return value.astimezone(UTC)


def _blob_dtype(model: Any) -> str:
    dtype = str(model.dtype).removeprefix("torch.")
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"the checkpoint's dtype {dtype} cannot be a blob dtype (float32, bfloat16, float16)")
    return dtype


def _relative(path: Path, start: Path) -> str:
    return Path(os.path.relpath(path, start)).as_posix()


def _write_new(path: Path, spec: dict[str, Any]) -> None:
    from node.sim.layout import to_toml

    write_new_file(path, to_toml(spec).encode("utf-8"), "--out")

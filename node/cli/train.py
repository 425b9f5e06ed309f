"""`tessera train`: one miner's local run, offline -> the canonical blob it would submit.

    tessera train --spec SPEC --key KEY --round R [--global STATE_BLOB] [--steps H] [--data FILE...]
                  [--feedback FILE] [--forward full|compressed] [--micro-batch N] [--checkpointing]
                  [--optimizer adamw|adamw8bit] [--step-in-backward] --out BLOB

It calls `miner.submission.build_submission`, the function the miner duty calls, with the same
seed derivation, shard, dtype and metadata, so for the same key, round and starting state it
writes the bytes the miner would commit to. `--global` names a global-state blob of this network
(the base model's experts when absent). `--forward compressed` trains as a miner with `[miner] forward =
"compressed"` does, on a model holding only the group's experts (`training.model.load_compressed`
never reads the others), so a miner can be tried on a checkpoint far larger than its memory; `--micro-batch`,
`--checkpointing`, `--optimizer adamw8bit` and `--step-in-backward` are the `[miner]` memory settings of the same
names (`tessera plan --device cpu --fit GIB` picks the fastest that fit a memory). In a
pgrad network `--feedback` is the miner's error-feedback buffer (the fp32 safetensors form of
`training.pgrad.error_bytes`, the bytes a miner keeps in its blob store): read when the file exists
(else the buffer starts empty), checked before training (a file without the buffer's mark, a Tessera
blob or expert weights, is refused and left as it was), and atomically replaced by what the round left
unsent once the blob is written. `--out` is never overwritten, nor the same file as `--feedback`; both
paths are checked writable before the model loads. Without it the build starts from an empty buffer and
keeps nothing. Its AdamW state starts at zero, as a miner's does every round. This module knows nothing
about the network.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from protocol.files import write_file

if TYPE_CHECKING:
    import torch


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add `train` to the `tessera` parser."""
    p = subparsers.add_parser("train", help="run one miner's local training and write its blob")
    p.add_argument("--spec", required=True, type=Path, help="network spec")
    p.add_argument("--key", required=True, type=Path, help="the miner's key file")
    p.add_argument("--round", required=True, type=int, help="round the blob is for")
    p.add_argument("--steps", type=int, default=None, help="inner steps H (default: the spec's)")
    p.add_argument("--data", nargs="+", type=Path, metavar="FILE", help="training files (default: the spec's)")
    p.add_argument("--global", dest="global_blob", type=Path, metavar="BLOB", help="global state to train from")
    p.add_argument("--feedback", type=Path, metavar="FILE",
                   help="pgrad networks: the error-feedback buffer (fp32 safetensors) to start from if FILE "
                        "exists; replaced atomically with the new buffer after the blob is written "
                        "(default: an empty buffer, nothing kept)")
    p.add_argument("--forward", choices=("full", "compressed"), default="full",
                   help="full: load the whole model; compressed: load only the group's experts, as a miner with "
                        "[miner] forward = \"compressed\" does (default full)")
    p.add_argument("--micro-batch", type=int, metavar="N",
                   help="sequences per forward pass, gradients accumulated over the spec's batch (default: the "
                        "whole batch in one pass)")
    p.add_argument("--checkpointing", action="store_true", help="recompute each decoder layer in backward")
    p.add_argument("--optimizer", choices=("adamw", "adamw8bit"), default="adamw",
                   help="the inner optimizer: fp32 moments, or bitsandbytes' 8-bit ones (default adamw)")
    p.add_argument("--step-in-backward", action="store_true",
                   help="take each tensor's optimizer step in backward as its gradient is complete (a step of one "
                        "micro-batch)")
    p.add_argument("--out", required=True, type=Path, metavar="BLOB", help="where to write the blob (a new file)")
    p.set_defaults(run=run_train)


def run_train(args: argparse.Namespace) -> int:
    from miner.model import MinerModel
    from miner.settings import MinerSettings
    from miner.submission import ErrorFeedback, build_submission
    from node.cli.common import check_output_file, write_new_file
    from node.duties.consensus import SyncError, decode_state
    from protocol.encoding import sha256_hex
    from protocol.identity import load_identity
    from protocol.spec import load_spec
    from training.pgrad import error_bytes, pgrad_config

    if args.round < 0:
        raise ValueError("--round must be non-negative")
    if args.steps is not None and args.steps < 1:
        raise ValueError("--steps must be positive")
    identity = load_identity(args.key)
    spec = load_spec(args.spec)
    batch = spec.training.batch_size
    if args.micro_batch is not None and not 1 <= args.micro_batch <= batch:
        raise ValueError(f"--micro-batch must be from 1 to the spec's training.batch_size ({batch}), got "
                         f"{args.micro_batch}")
    if args.step_in_backward and (args.micro_batch or batch) < batch:
        raise ValueError("--step-in-backward takes the step in a step's only backward: it needs the spec's whole "
                         f"batch ({batch}) in one pass, not --micro-batch {args.micro_batch}")
    if args.feedback is not None and pgrad_config(spec) is None:
        raise ValueError("--feedback: this network submits full experts, which keep no error-feedback buffer")
    if args.feedback is not None and args.feedback.resolve() == args.out.resolve():
        raise ValueError(f"--out {args.out}: the same file as --feedback; the blob and the buffer need their own files")
    check_output_file(args.out, "--out")
    if args.feedback is not None:
        check_output_file(args.feedback, "--feedback", replace=True)
    model = MinerModel.load(spec, args.spec, args.data or [], progress=True, forward=args.forward)
    feedback = None if args.feedback is None else ErrorFeedback(_read_feedback(args.feedback, model.shapes))
    head, base = spec.model.base_hash, model.genesis.tensors
    if args.global_blob is not None:
        try:
            data = args.global_blob.read_bytes()
        except OSError as exc:
            raise ValueError(f"{args.global_blob}: cannot read the global state: {exc.strerror}") from exc
        try:
            _, base = decode_state(data, spec, model.shapes)
        except SyncError as exc:
            raise ValueError(f"{args.global_blob}: {exc}") from exc
        head = sha256_hex(data)
    settings = MinerSettings(forward=args.forward, micro_batch_size=args.micro_batch, checkpointing=args.checkpointing,
                             optimizer=args.optimizer, step_in_backward=args.step_in_backward)
    blob, result = build_submission(model, identity.node_id, args.round, head, base, settings,
                                    steps=args.steps, progress=True, feedback=feedback)
    write_new_file(args.out, blob, "--out")
    if feedback is not None and feedback.error is not None:
        args.feedback.parent.mkdir(parents=True, exist_ok=True)
        write_file(args.feedback, error_bytes(feedback.error))
    print(json.dumps({
        "steps": len(result.losses),
        "first_loss": result.losses[0],
        "last_loss": result.losses[-1],
        "tokens": result.tokens,
        "tokens_per_s": result.tokens / max(result.seconds, 1e-9),
        "blob": str(args.out),
        "blob_sha256": sha256_hex(blob),
        "bytes": len(blob),
        "base": head,
        "feedback": None if args.feedback is None else str(args.feedback),
    }, indent=2, sort_keys=True))
    return 0


def _read_feedback(path: Path, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, torch.Tensor] | None:
    """The buffer in `path` (None when there is no such file yet); ValueError naming the file if it is unusable."""
    from training.pgrad import load_error

    if not path.exists():
        return None
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ValueError(f"{path}: cannot read the error-feedback buffer: {exc.strerror}") from exc
    if (kind := _blob_format(data)) is not None:
        raise ValueError(f"{path}: a {kind} blob, not an error-feedback buffer; give --feedback the buffer file "
                         "an earlier run kept, or a new path")
    try:
        error = load_error(data, shapes)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}; give --feedback the buffer file an earlier run kept, or a new path") from exc
    return error


def _blob_format(data: bytes) -> str | None:
    """The format a canonical Tessera blob names in its metadata; None for anything else (a buffer has none)."""
    from training.blob import BlobError, decode_header

    try:
        return decode_header(data, len(data)).meta.format
    except BlobError:
        return None

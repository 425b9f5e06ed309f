"""`tessera train`: one miner's local run, offline -> the canonical blob it would submit.

    tessera train --spec SPEC --key KEY --round R [--global STATE_BLOB] [--steps H] [--data FILE...] --out BLOB

It calls `node.duties.miner.build_submission`, the function the miner duty calls, with the same
seed derivation, shard, dtype and metadata, so for the same key, round and starting state it
writes the bytes the miner would commit to. `--global` names a global-state blob of this network
(the base model's experts when absent). This module knows nothing about the network.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add `train` to the `tessera` parser."""
    p = subparsers.add_parser("train", help="run one miner's local training and write its blob")
    p.add_argument("--spec", required=True, type=Path, help="network spec")
    p.add_argument("--key", required=True, type=Path, help="the miner's key file")
    p.add_argument("--round", required=True, type=int, help="round the blob is for")
    p.add_argument("--steps", type=int, default=None, help="inner steps H (default: the spec's)")
    p.add_argument("--data", nargs="+", type=Path, metavar="FILE", help="training files (default: the spec's)")
    p.add_argument("--global", dest="global_blob", type=Path, metavar="BLOB", help="global state to train from")
    p.add_argument("--out", required=True, type=Path, metavar="BLOB", help="where to write the blob")
    p.set_defaults(run=run_train)


def run_train(args: argparse.Namespace) -> int:
    from node.duties.consensus import SyncError, decode_state
    from node.duties.miner import MinerModel, build_submission
    from node.runtime.config import MinerSection
    from protocol.encoding import sha256_hex
    from protocol.identity import load_identity
    from protocol.spec import load_spec
    from training.blob import write_blob_file

    if args.round < 0:
        raise ValueError("--round must be non-negative")
    if args.steps is not None and args.steps < 1:
        raise ValueError("--steps must be positive")
    identity = load_identity(args.key)
    spec = load_spec(args.spec)
    model = MinerModel.load(spec, args.spec, args.data or [], progress=True)
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
    blob, result = build_submission(model, identity.node_id, args.round, head, base, MinerSection(),
                                    steps=args.steps, progress=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_blob_file(args.out, blob)
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
    }, indent=2, sort_keys=True))
    return 0

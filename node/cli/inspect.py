"""`tessera inspect blob`: run a validator's submission checks on a blob file and print the verdict.

The verdict is one JSON line on stdout; the exit code is 0 on ACCEPT, 1 on REJECT and 2 for usage
errors (raised as ValueError for the CLI to print). Values the operator leaves out (commitment,
round, miner, base) are taken from the blob itself, so the file is then checked for consistency with
the spec alone. The expected shapes come from the base model built on the meta device (config only,
no weights are read and the base hash is not checked). This module only wires arguments to
`validator.checks`; it knows nothing about the checks themselves, and imports torch only when the
command runs so `tessera --help` stays fast.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from node.cli.main import command_group
from protocol.encoding import is_hex_digest


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add `inspect blob` to the `tessera` command line."""
    kinds = command_group(subparsers, "inspect", "check artifacts the way a validator would")
    blob = kinds.add_parser(
        "blob",
        help="Run the submission checks on a blob file; print one JSON verdict line.",
        description="Exit 0 on ACCEPT, 1 on REJECT, 2 on usage errors. Omitted --commit/--round/"
        "--miner/--base are taken from the blob itself.",
    )
    blob.add_argument("file", type=Path, help="The blob (canonical safetensors) to check.")
    blob.add_argument("--spec", type=Path, required=True, help="The network spec TOML.")
    blob.add_argument("--commit", help="Expected commitment (SHA-256 hex); default: the file's hash.")
    blob.add_argument("--round", type=int, help="Expected round; default: the blob's round.")
    blob.add_argument("--miner", help="Expected miner node id (hex); default: the blob's miner.")
    blob.add_argument("--base", help="Expected base global-state hash; default: the blob's base.")
    blob.set_defaults(run=run_inspect_blob)


def run_inspect_blob(args: argparse.Namespace) -> int:
    """Check `args.file` against the spec and the expected values; print the verdict line."""
    from protocol.spec import load_spec
    from training.adapters import adapter_for
    from training.blob import BlobError, blob_hash, decode_header
    from training.experts import expected_shapes
    from training.model import meta_base
    from validator.checks import Expectation, check_submission

    _validate_args(args)
    spec = load_spec(args.spec)
    try:
        data = args.file.read_bytes()
    except OSError as exc:
        raise ValueError(f"{args.file}: cannot read blob: {exc.strerror or exc}") from exc
    digest = blob_hash(data)
    try:
        own = decode_header(data, spec.limits.max_header_bytes).meta
    except BlobError:
        own = None
    model = meta_base(spec, args.spec)
    adapter = adapter_for(spec.model.family)
    expect = Expectation(
        network=spec.network_id,
        round=args.round if args.round is not None else (own.round if own else 0),
        miner=args.miner or (own.miner if own else ""),
        base=args.base or (own.base if own else ""),
        group=spec.group,
        shapes=expected_shapes(model, adapter, spec.group),
        dtype=spec.model.dtype,
        commitment=args.commit or digest,
        max_header_bytes=spec.limits.max_header_bytes,
    )
    verdict = check_submission(data, expect)
    line: dict[str, Any] = {
        "verdict": "ACCEPT" if verdict.ok else "REJECT",
        "reason": verdict.reason,
        "hash": digest,
        "bytes": len(data),
    }
    meta = verdict.meta or own
    if meta is not None:
        line |= json.loads(meta.to_json())
    print(json.dumps(line, sort_keys=True))
    return 0 if verdict.ok else 1


def _validate_args(args: argparse.Namespace) -> None:
    for flag in ("commit", "miner", "base"):
        value = getattr(args, flag)
        if value is not None and not is_hex_digest(value):
            raise ValueError(f"--{flag} must be 64 lower-case hex digits, got {value[:80]!r}")
    if args.round is not None and args.round < 0:
        raise ValueError(f"--round must be non-negative, got {args.round}")

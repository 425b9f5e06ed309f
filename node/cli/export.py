"""`tessera export`: the network's improved model as an HF checkpoint, or its experts as a pack.

    tessera export --spec SPEC (--state HASH [--data-dir DIR] | --blob FILE) --out DIR
                   [--experts-only] [--heldout FILE] [--seed HEX]

`--state` names a global state in a node's blob store (`DIR/blobs`, the node's `data_dir`);
`--blob` names any canonical blob file of this network (a global state or a miner's full-expert submission).
A state of a successor spec (protocol.successor) is exported with the experts of the specs before it (the
states it inherits, from the node's blob store), under the spec the node's database says it was made under.
Without `--experts-only` a checkpoint base is checked against the spec's hash and copied shard by
shard with the blob's experts written over the base's (`training.export.patch_checkpoint`: no shard
is ever held in memory); a tiny simulation base is built, the experts inserted and saved
(`export_checkpoint`). With `--experts-only` only the group is written, as an expert pack;
`--heldout` loads the base once to record the state's held-out loss in the pack's manifest (and the
printed summary in either mode). Either way `provenance.json` goes beside the weights: the network
id, base hash, the state and, from the node's store (with `--state`), the chain of global states from
genesis with each round's merged miners and their commitments, the specs the state was trained under, and for
each expert tensor of the model the spec, round and state that last changed it (node.cli.provenance). Nothing is
written when a check fails. This module only wires arguments; the export logic lives in `training.export`.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
from pathlib import Path
from typing import Any

from node.cli.common import DEFAULT_SEED, round_seed

EVAL_BATCH = 16
PROVENANCE_FORMAT = "tessera-provenance/1"


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add `export` to the `tessera` command line."""
    p = subparsers.add_parser("export", help="write the network's expert state as an HF checkpoint or an expert pack")
    p.add_argument("--spec", required=True, type=Path, help="network spec")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--state", metavar="HASH", help="global state hash, read from the node's blob store")
    source.add_argument("--blob", type=Path, metavar="FILE", help="a canonical blob file of this network")
    p.add_argument("--data-dir", type=Path, default=Path("data"), metavar="DIR",
                   help="the node's data_dir holding blobs/ (default ./data; with --state)")
    p.add_argument("--out", required=True, type=Path, metavar="DIR", help="new directory to write")
    p.add_argument("--experts-only", action="store_true", help="write just the expert group as a pack")
    p.add_argument("--heldout", type=Path, metavar="FILE", help="held-out file: record the state's held-out loss")
    p.add_argument("--seed", type=round_seed, default=DEFAULT_SEED,
                   help="round seed (64 hex digits) that picks the held-out subset")
    p.set_defaults(run=run_export)


def run_export(args: argparse.Namespace) -> int:
    from node.cli.common import decode_network_blob
    from node.cli.provenance import read_lineage
    from protocol.spec import load_spec, spec_dir_path
    from training.blob import BlobError, decode_header
    from training.export import check_out_dir, export_checkpoint, patch_checkpoint, write_expert_pack
    from training.state import inherited_experts

    check_out_dir(args.out)
    genesis = load_spec(args.spec)
    path, data = _read_blob(args)
    state = hashlib.sha256(data).hexdigest()
    try:
        network = decode_header(data, genesis.limits.max_header_bytes).meta.network
    except BlobError as exc:
        raise ValueError(f"{path}: not a valid blob: {exc.reason}") from exc
    eras, states = read_lineage(args.data_dir / "node.db", genesis, network, state)
    spec = eras[-1].spec  # the spec the blob was made under: the network's, or a successor's
    meta, tensors = decode_network_blob(path, data, spec)
    _check_format(path, meta)
    blobs = args.data_dir / "blobs"
    inherited = inherited_experts([blobs / s[:2] / s for s in (spec.lineage.inherits if spec.lineage else [])],
                                  spec.limits.max_header_bytes)
    written = {**inherited, **tensors}  # the earlier specs' experts, then this state's
    provenance = _provenance(args, spec, state, meta)
    provenance["specs"] = [{"spec": era.spec.network_id, "since_round": era.spec.first_round,
                            "group": {str(k): v for k, v in era.spec.group.items()}, "ended_on": era.final}
                           for era in eras]
    from training.state import GLOBAL_FORMAT

    if meta.format == GLOBAL_FORMAT:
        from node.cli.provenance import experts

        provenance["experts"] = experts(eras, args.spec, blobs, states, tensors, meta.round)
    loss = None if args.heldout is None else _heldout_loss(spec, args, written)
    tokenizer = None if spec.data.tokenizer == "byte" else spec_dir_path(args.spec, spec.data.tokenizer)
    if args.experts_only:
        group = _group_of(written)
        write_expert_pack(written, {"network": spec.network_id, "round": meta.round, "group": group,
                                    "base_hash": spec.model.base_hash, "state": state, "heldout_loss": loss,
                                    "family": spec.model.family}, args.out, provenance)
    elif spec.model.checkpoint is not None:
        from training.model import checked_checkpoint

        patch_checkpoint(checked_checkpoint(spec, args.spec), written, args.out, tokenizer, provenance)
    else:
        from training.experts import insert
        from training.model import load_base

        model, adapter = load_base(spec, args.spec)
        insert(model, adapter, written)
        export_checkpoint(model, args.out, tokenizer, provenance)
    print(json.dumps({"out": str(args.out), "state": state, "round": meta.round, "heldout_loss": loss,
                      "spec": spec.network_id, "experts_only": args.experts_only}, indent=2, sort_keys=True))
    return 0


def _read_blob(args: argparse.Namespace) -> tuple[Path, bytes]:
    """The blob's path and bytes."""
    from protocol.encoding import is_hex_digest

    if args.state is not None:
        if not is_hex_digest(args.state):
            raise ValueError(f"--state must be 64 lower-case hex digits, got {args.state[:80]!r}")
        path = args.data_dir / "blobs" / args.state[:2] / args.state
    else:
        path = args.blob
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ValueError(f"{path}: cannot read the state: {exc.strerror or exc}") from exc
    if args.state is not None and hashlib.sha256(data).hexdigest() != args.state:
        raise ValueError(f"{path}: content does not hash to {args.state}; the blob store is damaged")
    return path, data


def _check_format(path: Path, meta: Any) -> None:
    from training.blob import BLOB_FORMAT
    from training.state import GLOBAL_FORMAT

    if meta.format not in (BLOB_FORMAT, GLOBAL_FORMAT):  # a pgrad submission or momentum holds no weights
        raise ValueError(f"{path}: the blob is a {meta.format} blob, not expert weights; export a global state "
                         f"({GLOBAL_FORMAT}) or a miner's full-expert submission ({BLOB_FORMAT})")


def _group_of(tensors: dict[str, Any]) -> dict[int, list[int]]:
    """The expert group whose tensors `tensors` are (every spec's, for a successor's state)."""
    from training.experts import parse_name

    group: dict[int, set[int]] = {}
    for name in tensors:
        layer, expert, _ = parse_name(name)
        group.setdefault(layer, set()).add(expert)
    return {layer: sorted(ids) for layer, ids in sorted(group.items())}


def _heldout_loss(spec: Any, args: argparse.Namespace, tensors: dict[str, Any]) -> float:
    """The held-out loss of the base with `tensors` in place; the model is let go before the export writes."""
    from node.cli.common import heldout_sequences
    from training.evaluate import heldout_loss
    from training.experts import insert
    from training.model import load_base
    from training.tokenizer import load_tokenizer

    model, adapter = load_base(spec, args.spec, progress=True)
    insert(model, adapter, tensors)
    tokenizer = load_tokenizer(spec.data.tokenizer, args.spec.parent)
    sequences = heldout_sequences(args.heldout, args.spec, spec, tokenizer, args.seed)
    return float(heldout_loss(model, sequences, batch_size=EVAL_BATCH, pad_id=tokenizer.pad_id).loss)


def _provenance(args: argparse.Namespace, spec: Any, state: str, meta: Any) -> dict[str, Any]:
    """Where the state came from: the network, its base, and the chain of global states from genesis to `state`,
    each with the miners the node recorded as merged into it and their commitments (`null` where the node's
    store does not know them: an export from a --blob, or a state the node only synced)."""
    from training.state import GLOBAL_FORMAT

    chain: list[dict[str, Any]] = []
    if meta.format == GLOBAL_FORMAT:
        chain = [{"round": meta.round, "state": state, "parent": meta.base, "contributors": None}]
        db = args.data_dir / "node.db"
        if args.state is not None and db.is_file():
            chain = asyncio.run(_chain(db, state, spec.model.base_hash)) or chain
    return {"format": PROVENANCE_FORMAT, "network": spec.network_id, "base_hash": spec.model.base_hash,
            "state": state, "round": meta.round, "source": meta.format, "miner": meta.miner or None,
            "chain": chain}


async def _chain(db: Path, head: str, base_hash: str) -> list[dict[str, Any]]:
    """The node's record of the states from genesis to `head`, oldest first; empty when it has none of `head`."""
    from node.store.db import Storage

    storage = await Storage.open(db)
    try:
        states = {record.hash: record for record in await storage.global_states()}
        chain: list[dict[str, Any]] = []
        at = head
        while at != base_hash and at in states and len(chain) <= len(states):
            record = states[at]
            commits = {c.miner: c.commitment for c in await storage.commits_for(record.round)}
            chain.append({"round": record.round, "state": record.hash, "parent": record.parent,
                          "contributors": [{"miner": m, "commitment": commits.get(m)} for m in record.contributors]})
            at = record.parent
    finally:
        await storage.close()
    return chain[::-1]

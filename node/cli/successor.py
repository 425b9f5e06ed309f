"""`tessera spec successor | sign | offer`: draft the next expert group's successor document, sign it, hand it to a node.

    tessera spec successor --spec SPEC --round N --group GROUP.json [--data-dir DIR] [--train FILE...]
                           [--heldout FILE] [--general FILE] [--set SECTION.FIELD=VALUE]... --out FILE
    tessera spec sign FILE --key KEY
    tessera spec offer FILE (--config NODE.toml | --url URL)

`successor` drafts an unsigned document (protocol.successor) that succeeds the spec in force: the network's spec
file, or with `--data-dir` the spec a node's data directory runs (a successor's, once one is in force). Its group
is `select-experts`' output; `--train`, `--heldout` and `--general` set the data it trains and is scored on
(paths relative to the spec file, held-out files by their SHA-256) and `--set` any field of [data], [training],
[rewards], [aggregation] or [submission]. It judges everything before it writes: the activation round against the
round in progress (at least GRACE_ROUNDS ahead), the experts against the model's config, the blob headers against
the spec's cap, held-out documents against the training files. `sign` adds the signature of a validator's key to
the document it names, rewriting that file in place (the one file a command here writes over). `offer` posts it to a
running node's HTTP API, which judges it and, when validators holding a majority of weight signed it, keeps it
and offers it to its peers. Errors are one `tessera: error:` line naming the flag or file.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING, Any

from node.cli.common import add_spec_settings, check_output_file, write_atomically, write_new_file
from node.cli.main import command_group

if TYPE_CHECKING:
    from protocol.spec import NetworkSpec
    from protocol.successor import Selection, SuccessorDocument


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add `spec successor`, `spec sign` and `spec offer` to the `tessera spec` group."""
    spec = command_group(subparsers, "spec", "work with network spec files")
    p = spec.add_parser("successor", help="draft a successor document: the next expert group from a round on")
    p.add_argument("--spec", required=True, type=Path, metavar="SPEC", help="the network's spec file")
    p.add_argument("--round", required=True, type=int, metavar="N", help="the first round the successor is in force")
    p.add_argument("--group", required=True, type=Path, metavar="GROUP.json", help="select-experts' output")
    p.add_argument("--data-dir", type=Path, metavar="DIR",
                   help="a node's data directory: succeed the spec it runs (default: the spec file's)")
    p.add_argument("--train", nargs="+", type=Path, metavar="FILE", help="miners' training files from round N")
    p.add_argument("--heldout", type=Path, metavar="FILE", help="validators' held-out file from round N")
    p.add_argument("--general", type=Path, metavar="FILE",
                   help="the general-domain file the merge gate checks forgetting on (e.g. the last group's held-out)")
    add_spec_settings(p, "--train, --heldout and --general (only [data], [training], [rewards], [aggregation] and "
                      "[submission] may change)")
    p.add_argument("--out", required=True, type=Path, metavar="FILE", help="the document to write; never overwritten")
    p.set_defaults(run=run_successor)

    p = spec.add_parser("sign", help="add a validator's signature to a successor document (rewrites the file)")
    p.add_argument("document", type=Path, metavar="FILE", help="the successor document")
    p.add_argument("--key", required=True, type=Path, metavar="KEY", help="the validator's key file")
    p.set_defaults(run=run_sign)

    p = spec.add_parser("offer", help="hand a signed successor document to a running node, which offers it to peers")
    p.add_argument("document", type=Path, metavar="FILE", help="the signed successor document")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--config", metavar="FILE", help="the node's config TOML (finds its HTTP port)")
    where.add_argument("--url", metavar="URL", help="the node's HTTP API, e.g. http://127.0.0.1:8080")
    p.add_argument("--timeout", type=float, default=30.0, metavar="SECONDS")
    p.set_defaults(run=run_offer)


def run_successor(args: argparse.Namespace) -> int:
    from node.cli.spec import check_header_cap
    from protocol.rounds import Schedule
    from protocol.spec import load_spec
    from protocol.successor import CHANGES, GRACE_ROUNDS, draft, missing_experts, successor_spec
    from training.adapters import adapter_for
    from training.experts import expected_shapes
    from training.model import meta_base, moe_experts

    check_output_file(args.out, "--out")
    genesis = load_spec(args.spec)
    predecessor = genesis if args.data_dir is None else asyncio.run(_spec_run_by(args.data_dir, genesis))
    if args.round < max(1, predecessor.first_round + 1):
        raise ValueError(f"--round {args.round}: the successor must begin after round {predecessor.first_round}, "
                         "where the spec it succeeds begins")
    now = time.time()
    if now >= genesis.genesis_ts and args.round < (current := Schedule.from_spec(genesis).round_at(now)) + GRACE_ROUNDS:
        raise ValueError(f"--round {args.round}: round {current} is in progress, and a successor takes effect at "
                         f"least {GRACE_ROUNDS} rounds after the round in which nodes take it in: give round "
                         f"{current + GRACE_ROUNDS} or later")
    group, selection = _read_group(args.group)
    changes = _changes(args, predecessor, CHANGES)
    document = draft(predecessor, args.round, group, changes, selection)
    skeleton = meta_base(genesis, args.spec)
    adapter = adapter_for(genesis.model.family)
    lacking = missing_experts(document.group, moe_experts(skeleton, adapter))
    if lacking is not None:
        raise ValueError(f"--group {args.group}: {lacking}")
    check_header_cap(successor_spec(predecessor, document, predecessor.root),
                     expected_shapes(skeleton, adapter, document.group))
    write_new_file(args.out, document_toml(document).encode("utf-8"), "--out")
    print(json.dumps({"out": str(args.out), "document": document.hash, "predecessor": predecessor.network_id,
                      "activation": document.activation, "group": {str(k): v for k, v in document.group.items()}},
                     indent=2, sort_keys=True))
    return 0


def run_sign(args: argparse.Namespace) -> int:
    from protocol.identity import load_identity
    from protocol.successor import load_document

    document = load_document(args.document)
    identity = load_identity(args.key)
    signed = document.signed_by(identity)
    write_atomically(args.document, document_toml(signed))
    print(json.dumps({"document": document.hash, "signer": identity.node_id,
                      "signatures": len(signed.signatures)}, indent=2, sort_keys=True))
    return 0


def run_offer(args: argparse.Namespace) -> int:
    from node.cli.daemon import node_url
    from protocol.successor import load_document

    document = load_document(args.document)
    url = f"{node_url(args.config, args.url)}/successor"
    request = urllib.request.Request(url, data=document.to_bytes(), method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=args.timeout) as response:
            body = response.read()
    except urllib.error.HTTPError as exc:
        body = exc.read()
    except (urllib.error.URLError, http.client.HTTPException, OSError) as exc:
        raise ValueError(f"{url}: no answer from the node ({getattr(exc, 'reason', exc)}); is it running?") from exc
    try:
        verdict = json.loads(body)
    except ValueError:
        verdict = None
    if not isinstance(verdict, dict) or "verdict" not in verdict:
        raise ValueError(f"{url}: the answer is not a node's verdict; is a Tessera node there?")
    if verdict["verdict"] != "accept":
        raise ValueError(f"{args.document}: the node refused it: {verdict.get('reason') or verdict}")
    print(json.dumps(verdict, indent=2, sort_keys=True))
    return 0


def document_toml(document: SuccessorDocument) -> str:
    """The document as the TOML file the commands write (TOML has no null: an unset field is left out)."""
    from node.sim.layout import to_toml

    data = {**document.body(), "signatures": [s.model_dump() for s in document.signatures]}
    return to_toml(_without_none(data))


def _without_none(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_none(v) for k, v in value.items() if v is not None}
    return value


def _read_group(path: Path) -> tuple[dict[int, list[int]], Selection]:
    """`select-experts`' output: its group, and how it was chosen."""
    from protocol.successor import Selection

    try:
        selection = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"--group {path}: cannot read select-experts' output: {exc}") from exc
    group = selection.get("group") if isinstance(selection, dict) else None
    if not isinstance(group, dict):
        raise ValueError(f"--group {path}: not select-experts' output (it holds no \"group\")")
    try:
        layers = {int(layer): experts for layer, experts in group.items()}
        record = Selection(rule=str(selection.get("rule") or "given"), state=selection.get("state"),
                           data_sha256=[d["sha256"] for d in selection.get("data") or []])
    except (ValueError, TypeError, KeyError) as exc:
        raise ValueError(f"--group {path}: {exc}") from exc
    return layers, record


def _changes(args: argparse.Namespace, predecessor: NetworkSpec, sections: tuple[str, ...]) -> dict[str, Any]:
    """The fields the flags change, by section; ValueError naming the flag or setting."""
    import os

    from protocol.spec import judge_settings, spec_dir_path
    from training.data import check_disjoint, file_sha256, read_documents

    changes = judge_settings(args.spec_settings)
    for section in changes:
        if section not in sections:
            raise ValueError(f"--set {section}...: a successor changes only [{'], ['.join(sections)}] and the group; "
                             f"[{section}] stays the network's")
    data = changes.setdefault("data", {})
    here = args.spec.resolve().parent
    for flag, path in [("--train", p) for p in args.train or []] + [("--heldout", args.heldout),
                                                                      ("--general", args.general)]:
        if path is not None and not (path.is_file() and read_documents(path)):
            raise ValueError(f"{flag} {path}: not a data file with documents")
    if args.train:
        data["train"] = [Path(os.path.relpath(p.resolve(), here)).as_posix() for p in args.train]
    if args.heldout is not None:
        data["heldout_sha256"] = file_sha256(args.heldout)
        train = [spec_dir_path(args.spec, p) for p in data.get("train", predecessor.data.train)]
        try:
            check_disjoint([d for p in train if p.is_file() for d in read_documents(p)], read_documents(args.heldout))
        except ValueError as exc:
            raise ValueError(f"--heldout {args.heldout}: {exc}; hold those documents out of the training files") from None
    if args.general is not None:
        data["general_sha256"] = file_sha256(args.general)
    return changes


async def _spec_run_by(data_dir: Path, genesis: NetworkSpec) -> NetworkSpec:
    """The spec a node's data directory runs (node.runtime.daemon.spec_in_force)."""
    from node.runtime.daemon import spec_in_force
    from node.store.db import Storage

    db = data_dir / "node.db"
    if not db.is_file():
        raise ValueError(f"--data-dir {data_dir}: holds no node.db; give a node's data directory")
    storage = await Storage.open(db)
    try:
        return await spec_in_force(storage, genesis)
    finally:
        await storage.close()

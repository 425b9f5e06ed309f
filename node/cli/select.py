"""Phase 1 operator commands: choose an expert group, judge it, and split a domain before choosing.

    tessera select-experts ...    routing statistics -> expert group JSON (optionally into a spec)
    tessera eval-subset ...       held-out loss of the pruned model at keep fractions, rule vs random
    tessera cluster-data ...      split documents into clusters the base model tells apart

The maths lives in `training.selection`, `training.stability`, `training.subset_eval` and
`training.clustering`; this module reads files, checks what the user gave (output paths first: an
existing file is never overwritten), and writes results only once everything has been computed.
Nothing here touches the network. User mistakes raise ValueError, which the CLI prints as one
`tessera: error:` line with exit code 2.
"""

from __future__ import annotations

import argparse
import json
import math
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from node.cli.common import (
    DEFAULT_SEED,
    check_output_file,
    heldout_sequences,
    load_spec_model,
    round_seed,
    write_atomically,
    write_new_file,
)
from protocol.files import staged_directory

if TYPE_CHECKING:
    import torch

    from training.selection import Domain

RULES = ("gate-mass", "token-freq", "differential", "activation-norm")
MODES = ("global", "layerwise")
FRACTIONS = (0.0625, 0.125, 0.25, 0.5, 1.0)


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add `select-experts`, `eval-subset` and `cluster-data` to the `tessera` parser."""
    p = subparsers.add_parser("select-experts", help="Phase 1: pick the expert group from routing statistics")
    p.add_argument("--spec", required=True, type=Path, help="network spec whose base model is measured")
    p.add_argument("--data", required=True, nargs="+", type=Path, metavar="FILE", help="domain data files")
    p.add_argument("--general", nargs="+", type=Path, metavar="FILE", help="general data (differential rule)")
    p.add_argument("--rule", required=True, choices=RULES, help="statistic that ranks experts")
    budget = p.add_mutually_exclusive_group(required=True)
    budget.add_argument("--top-d", type=int, metavar="N", help="experts per layer")
    budget.add_argument("--mass", type=float, metavar="P", help="cumulative share of the score per layer")
    p.add_argument("--examples", type=int, metavar="N",
                   help="use the first N documents, pooled per document (default: packed rows, pooled per token)")
    p.add_argument("--max-sequences", type=int, default=256,
                   help="packed rows read without --examples; documents for --stability (default 256)")
    p.add_argument("--mode", choices=MODES, default="global",
                   help="layerwise: measure layer l with layers < l already pruned (default global)")
    p.add_argument("--shared", choices=("keep",), default="keep",
                   help="shared experts always run and are never in the group (the only policy)")
    p.add_argument("--stability", type=Path, metavar="REPORT.json",
                   help="also write (to a new file) a Jaccard stability report over seeds and 1/5/10/100 documents "
                   "(of the first --max-sequences documents)")
    p.add_argument("--state", type=Path, metavar="DIR",
                   help="a node's data directory: measure the model holding its adopted state (and what its spec "
                        "inherits), to choose the next group (tessera spec successor)")
    p.add_argument("--disjoint", action="store_true",
                   help="choose no expert of the group trained now (the node's spec with --state, else --spec's)")
    p.add_argument("--into", type=Path, metavar="SPEC", help="write the group into this spec (its network id changes)")
    p.add_argument("--out", required=True, type=Path, metavar="GROUP.json", help="where to write the selection (a new file)")
    p.set_defaults(run=run_select_experts)

    p = subparsers.add_parser("eval-subset", help="held-out loss of the pruned model at keep fractions, rule vs random")
    p.add_argument("--spec", required=True, type=Path, help="network spec whose base model is pruned")
    p.add_argument("--group", required=True, type=Path, metavar="GROUP.json", help="output of select-experts")
    p.add_argument("--fractions", nargs="+", type=_fraction, default=list(FRACTIONS), metavar="F",
                   help="keep fractions in (0, 1] (default 0.0625 0.125 0.25 0.5 1)")
    p.add_argument("--seeds", type=int, default=3, metavar="N", help="random selections per fraction (default 3)")
    p.add_argument("--heldout", type=Path, help="held-out file (default: data/heldout.jsonl beside the spec)")
    p.add_argument("--seed", type=round_seed, default=DEFAULT_SEED,
                   help="round seed (64 hex digits) that picks the held-out subset")
    p.add_argument("--out", required=True, type=Path, metavar="REPORT.json", help="where to write the JSON report (a new file)")
    p.set_defaults(run=run_eval_subset)

    p = subparsers.add_parser("cluster-data", help="split documents into clusters the base model tells apart")
    p.add_argument("--spec", required=True, type=Path, help="network spec whose base model reads the data")
    p.add_argument("--data", required=True, nargs="+", type=Path, metavar="FILE", help="data files to split")
    p.add_argument("--k", type=int, help="number of clusters (default: best silhouette over 2..--max-k)")
    p.add_argument("--max-k", type=int, default=8, help="largest k tried when choosing (default 8)")
    p.add_argument("--out", required=True, type=Path, metavar="DIR", help="new directory for clusters and report")
    p.set_defaults(run=run_cluster_data)


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"keep fractions must be in (0, 1], got {text}")
    return value


def _documents(paths: list[Path]) -> list[str]:
    """Every document of the files in order; an empty file is an error naming it."""
    from training.data import read_documents

    documents: list[str] = []
    for path in paths:
        found = read_documents(path)
        if not found:
            raise ValueError(f"{path}: the data file holds no documents")
        documents.extend(found)
    return documents


def _file_record(paths: list[Path] | None) -> list[dict[str, str]] | None:
    from training.data import file_sha256

    return None if paths is None else [{"path": str(p), "sha256": file_sha256(p)} for p in paths]


def _json_bytes(value: dict[str, Any]) -> bytes:
    return (json.dumps(value, indent=2, sort_keys=True) + "\n").encode()


def run_select_experts(args: argparse.Namespace) -> int:
    from training.data import pack
    from training.selection import select_experts
    from training.stability import stability_report

    if args.max_sequences < 1:
        raise ValueError("--max-sequences must be positive")
    if args.examples is not None and args.examples < 1:
        raise ValueError("--examples must be positive")
    if args.rule == "differential" and not args.general:
        raise ValueError("the differential rule needs general data (--general FILES)")
    if args.top_d is not None and args.top_d < 1:
        raise ValueError(f"--top-d must be at least 1, got {args.top_d}")
    if args.mass is not None and not 0 < args.mass <= 1:
        raise ValueError(f"--mass must be in (0, 1], got {args.mass}")
    check_output_file(args.out, "--out")
    if args.stability is not None:
        if args.stability.resolve() == args.out.resolve():
            raise ValueError(f"--stability {args.stability}: the same file as --out; give the report its own path")
        check_output_file(args.stability, "--stability")
    spec, model, adapter, tokenizer = load_spec_model(args.spec)
    state, trained = None, spec.group
    if args.state is not None:
        from training.experts import insert

        state, trained, tensors = _node_state(args.state, spec)
        insert(model, adapter, tensors)
    if args.top_d is not None and args.top_d > adapter.num_experts(model):
        raise ValueError(f"--top-d {args.top_d}: the model has only {adapter.num_experts(model)} experts per layer")
    into = _check_into(args.into, spec) if args.into is not None else None
    texts = _documents(args.data)
    general_texts = _documents(args.general) if args.general else None

    def as_documents(found: list[str]) -> list[torch.Tensor]:
        return [pack([text], tokenizer, spec.data.seq_len) for text in found]

    domain: Domain  # one tensor per document with --examples, else one tensor of packed rows
    general: Domain | None
    if args.examples is not None:
        if args.examples > len(texts):
            raise ValueError(f"--examples {args.examples}: the data holds only {len(texts)} documents")
        domain = as_documents(texts[: args.examples])
        general = as_documents(general_texts[: args.examples]) if general_texts else None
    else:
        domain = pack(texts, tokenizer, spec.data.seq_len)[: args.max_sequences]
        general = pack(general_texts, tokenizer, spec.data.seq_len)[: args.max_sequences] if general_texts else None
    selection = select_experts(model, adapter, domain, args.rule, top_d=args.top_d, mass=args.mass,
                               general=general, pad_id=tokenizer.pad_id, mode=args.mode, progress=True,
                               exclude=trained if args.disjoint else None)
    selection |= {"state": state, "excluded": {str(k): v for k, v in trained.items()} if args.disjoint else None}
    selection |= {"model": {"family": spec.model.family, "base_hash": spec.model.base_hash},
                  "data": _file_record(args.data), "general": _file_record(args.general),
                  "examples": args.examples, "shared": args.shared}
    stability = None
    if args.stability is not None:
        documents = as_documents(texts[: args.max_sequences])
        stability = stability_report(model, adapter, documents, args.rule, top_d=args.top_d, mass=args.mass,
                                     general=general, mode=args.mode, pad_id=tokenizer.pad_id)
    update = _judge_into(into, selection["group"], model, adapter) if into is not None else None
    summary: dict[str, Any] = {"group": selection["group"], "rule": args.rule, "mode": args.mode, "out": str(args.out)}
    written: list[Path] = []
    try:  # a write that fails takes back the new files written before it, so a failed run leaves nothing
        write_new_file(args.out, _json_bytes(selection), "--out")
        written.append(args.out)
        if stability is not None:
            write_new_file(args.stability, _json_bytes(stability), "--stability")
            written.append(args.stability)
            summary["stability"] = {n: round(c["pairwise_jaccard"], 4) for n, c in stability["counts"].items()}
        if update is not None:
            summary["into"] = _write_into(update)
    except BaseException:
        for path in written:
            path.unlink(missing_ok=True)
        raise
    print(json.dumps(summary, indent=2, sort_keys=True))
    return 0


def _node_state(data_dir: Path, genesis: Any) -> tuple[str, dict[int, list[int]], dict[str, Any]]:
    """A node's adopted state (its head), the group of the spec it runs, and the expert tensors that make its model:
    the states its spec inherits, then the head's (none for the base model itself)."""
    import asyncio

    from node.runtime.daemon import spec_in_force
    from node.store.db import Storage
    from training.state import inherited_experts

    async def read() -> tuple[str, Any]:
        storage = await Storage.open(data_dir / "node.db")
        try:
            return await storage.head() or genesis.model.base_hash, await spec_in_force(storage, genesis)
        finally:
            await storage.close()

    if not (data_dir / "node.db").is_file():
        raise ValueError(f"--state {data_dir}: holds no node.db; give a node's data directory")
    head, spec = asyncio.run(read())
    states = [*(spec.lineage.inherits if spec.lineage else []), *([head] if head != spec.root else [])]
    paths = [data_dir / "blobs" / state[:2] / state for state in states]
    missing = [p for p in paths if not p.is_file()]
    if missing:
        raise ValueError(f"--state {data_dir}: the state {missing[0].name[:12]} is not in its blob store")
    return head, dict(spec.group), inherited_experts(paths, spec.limits.max_header_bytes)


@dataclass(frozen=True)
class _Into:
    """The spec `--into` names, as read before the work: its path (a link followed), bytes and TOML."""

    path: Path
    data: bytes
    raw: dict[str, Any]
    network_id: str


@dataclass(frozen=True)
class _IntoUpdate:
    """The spec `--into` will hold, judged whole before anything is written."""

    into: _Into
    text: str
    network_id: str


def _check_into(path: Path, spec: Any) -> _Into:
    """The spec the group goes into, refused if its base model is not the one measured or it cannot be
    rewritten in its directory."""
    from protocol.spec import load_spec

    target = load_spec(path)
    if target.model.base_hash != spec.model.base_hash:
        raise ValueError(f"--into {path}: its base model ({target.model.base_hash[:16]}...) is not the one "
                         f"measured ({spec.model.base_hash[:16]}...)")
    resolved = path.resolve()
    check_output_file(resolved, "--into", replace=True)
    data = resolved.read_bytes()
    return _Into(path=resolved, data=data, raw=tomllib.loads(data.decode("utf-8")), network_id=target.network_id)


def _judge_into(into: _Into, group: dict[str, list[int]], model: Any, adapter: Any) -> _IntoUpdate:
    """The spec with the new group, judged as `spec check` judges it (the blob header cap included)."""
    from node.cli.spec import check_header_cap
    from node.sim.layout import to_toml
    from protocol.spec import parse_spec
    from training.experts import expected_shapes

    updated = {**into.raw, "group": group}
    judged = parse_spec(updated)
    try:
        check_header_cap(judged, expected_shapes(model, adapter, judged.group))
    except ValueError as exc:
        raise ValueError(f"--into {into.path}: with this group, {exc}") from exc
    return _IntoUpdate(into=into, text=to_toml(updated), network_id=judged.network_id)


def _write_into(update: _IntoUpdate) -> dict[str, str]:
    """Replace the spec atomically, unless it changed since it was read (an edit is never lost)."""
    into = update.into
    if into.path.read_bytes() != into.data:
        raise ValueError(f"--into {into.path}: the spec changed while this ran; it was not updated, "
                         "and nothing was written (run again)")
    write_atomically(into.path, update.text)
    return {"spec": str(into.path), "network_id_before": into.network_id, "network_id": update.network_id,
            "note": "the network id changed; nodes of the old network will not accept this spec"
            if update.network_id != into.network_id else "the group was already this one; the network id is unchanged"}


def run_eval_subset(args: argparse.Namespace) -> int:
    from training.subset_eval import parse_selection, subset_report

    if args.seeds < 1:
        raise ValueError("--seeds must be positive")
    check_output_file(args.out, "--out")
    selection = _read_selection(args.group)
    spec, model, adapter, tokenizer = load_spec_model(args.spec)
    measured = selection.get("model", {}).get("base_hash") if isinstance(selection.get("model"), dict) else None
    if measured is not None and measured != spec.model.base_hash:
        raise ValueError(f"{args.group}: selected on base model {str(measured)[:16]}..., not this spec's "
                         f"({spec.model.base_hash[:16]}...); select again for this model")
    try:
        parse_selection(selection, model, adapter)  # does it fit this model? (subset_report parses it again)
    except ValueError as exc:
        raise ValueError(f"{args.group}: {exc}") from exc
    sequences = heldout_sequences(args.heldout, args.spec, spec, tokenizer, args.seed)
    report = subset_report(model, adapter, selection, sequences, fractions=args.fractions,
                           seeds=range(args.seeds), pad_id=tokenizer.pad_id)
    report["group_file"] = str(args.group)
    write_new_file(args.out, _json_bytes(report), "--out")
    print(format_table(report))
    return 0


def _read_selection(path: Path) -> dict[str, Any]:
    """The group file select-experts wrote, its 'group' and 'stats' checked strictly; errors name the file.

    Layers are canonical decimal keys, expert ids non-negative integers (not booleans or 5.0) without
    repeats, scores finite numbers. Whether they fit the model is `training.subset_eval.parse_selection`'s.
    """
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ValueError(f"{path}: cannot read the group file: {exc.strerror}") from exc
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not UTF-8 text (byte {exc.start})") from exc
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not JSON: {exc.msg} at line {exc.lineno}") from exc
    if not isinstance(value, dict):
        raise ValueError(f"{path}: not a selection (expected a JSON object from select-experts)")
    group, stats = value.get("group"), value.get("stats")
    if not isinstance(group, dict) or not group or not isinstance(stats, dict):
        raise ValueError(f"{path}: not a selection: expected 'group' and 'stats' objects keyed by layer")
    for layer, ids in group.items():
        if not _is_layer(layer):
            raise ValueError(f"{path}: group: layer {layer!r} is not a layer number")
        if not isinstance(ids, list) or not ids or any(type(e) is not int or e < 0 for e in ids):
            raise ValueError(f"{path}: group layer {layer}: expected a list of expert ids (non-negative integers), "
                             f"got {json.dumps(ids)[:80]}")
        if len(set(ids)) != len(ids):
            raise ValueError(f"{path}: group layer {layer}: names an expert twice")
    for layer, scores in stats.items():
        if not _is_layer(layer):
            raise ValueError(f"{path}: stats: layer {layer!r} is not a layer number")
        if not isinstance(scores, list) or any(type(v) not in (int, float) or not math.isfinite(v) for v in scores):
            raise ValueError(f"{path}: stats layer {layer}: expected a list of finite numbers")
    return value


def _is_layer(key: str) -> bool:
    return key.isascii() and key.isdigit() and key == str(int(key))


def format_table(report: dict[str, Any]) -> str:
    """The keep-fraction curve as a terminal table: rule vs random (mean, min, max), then reference rows."""
    lines = [f"{'keep':>8} {'experts':>7} {'rule':>9} {'random':>9} {'min':>9} {'max':>9}"]
    for point in report["curve"]:
        lines.append(f"{point['fraction']:>8.2%} {point['kept']:>7} {point['rule']:>9.4f} "
                     f"{point['random_mean']:>9.4f} {min(point['random']):>9.4f} {max(point['random']):>9.4f}")
    lines.append(f"full model: {report['full']:.4f}   pruned to the group: {report['group']['loss']:.4f}")
    if report["without_group"] is not None:
        lines.append(f"full model without the group's experts: {report['without_group']:.4f}")
    return "\n".join(lines)


def run_cluster_data(args: argparse.Namespace) -> int:
    from training.clustering import cluster, cluster_report, sequence_features
    from training.corpus import write_documents
    from training.data import pack

    if args.out.exists() and any(args.out.iterdir()):
        raise ValueError(f"{args.out}: already exists and is not empty; give a new directory")
    if args.max_k < 2:
        raise ValueError("--max-k must be at least 2")
    spec, model, adapter, tokenizer = load_spec_model(args.spec)
    texts = _documents(args.data)
    documents = [pack([text], tokenizer, spec.data.seq_len) for text in texts]
    clustering = cluster(sequence_features(model, adapter, documents, pad_id=tokenizer.pad_id), k=args.k,
                         max_k=args.max_k)
    report = cluster_report(clustering, documents, pad_id=tokenizer.pad_id)
    for entry in report["clusters"]:
        entry["top_tokens"] = [[token, count, tokenizer.decode([token])] for token, count in entry["top_tokens"]]
        entry["file"] = f"cluster-{entry['cluster']}.jsonl"
    report["data"] = _file_record(args.data)
    with staged_directory(args.out) as temp:
        for label in range(clustering.k):
            members = [text for text, lab in zip(texts, clustering.labels, strict=True) if lab == label]
            write_documents(temp / f"cluster-{label}.jsonl", members)
        (temp / "report.json").write_bytes(_json_bytes(report))
    print(json.dumps({"k": report["k"], "sizes": [c["documents"] for c in report["clusters"]],
                      "out": str(args.out)}, indent=2))
    return 0

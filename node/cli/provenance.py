"""Where an exported state came from: the specs it was trained under, the chain of global states, and for each
expert tensor of the model the spec, round and state that last changed it and the miners merged into that state.

`lineage` reads the specs a node ran from its data directory (node.store) back to the network's spec file: the
exported state's spec, its predecessors, and the state each one ended on (its successor's base). `experts` walks
them newest first: a tensor belongs to the last spec whose group holds it and whose adopted states changed it from
the value that spec started from (the base model's, with the earlier specs' states written in); its record names
that spec, its group and the last state it adopted (the one holding the tensor's value now), that state's round and
contributors. A tensor no spec changed says so (`"trained": false`). `tessera export` (node.cli.export) writes the
result as provenance.json; this module reads files and never writes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from protocol.spec import NetworkSpec
from training.adapters import adapter_for
from training.blob import BlobFile, read_header
from training.experts import expert_names
from training.state import inherited_experts


@dataclass(frozen=True)
class Era:
    """One spec of the chain and the state it ended on (the exported state for the last; None: it adopted none)."""

    spec: NetworkSpec
    final: str | None


async def known_specs(db: Path) -> tuple[dict[str, NetworkSpec], dict[str, tuple[int, tuple[str, ...]]]]:
    """The successor specs a node's database holds, and each global state's round and contributors it recorded."""
    from node.store.db import Storage
    from protocol.successor import spec_from_bytes

    if not db.is_file():
        return {}, {}
    storage = await Storage.open(db)
    try:
        specs = {i: spec_from_bytes(r.body) for i, r in (await storage.specs()).items()}
        states = {s.hash: (s.round, s.contributors) for s in await storage.global_states()}
    finally:
        await storage.close()
    return specs, states


def lineage(genesis: NetworkSpec, specs: Mapping[str, NetworkSpec], network: str, state: str | None) -> list[Era]:
    """The specs from `genesis` to the one whose network id is `network`, oldest first, each with the state it
    ended on (`state` for the last); ValueError when the node knows no such spec."""
    if network != genesis.network_id and network not in specs:
        raise ValueError(f"the blob is of spec {network[:16]}..., neither the spec file's nor one this node ran "
                         "(give the --data-dir of a node that ran it)")
    chain = [genesis if network == genesis.network_id else specs[network]]
    while chain[0].lineage is not None:
        chain.insert(0, genesis if chain[0].lineage.predecessor == genesis.network_id
                     else specs[chain[0].lineage.predecessor])
    finals = [nxt.lineage.base if nxt.lineage.base != spec.root else None
              for spec, nxt in zip(chain, chain[1:], strict=False) if nxt.lineage is not None]
    return [Era(spec, final) for spec, final in zip(chain, [*finals, state], strict=True)]


def experts(eras: list[Era], spec_path: Path, blobs: Path, states: Mapping[str, tuple[int, tuple[str, ...]]],
            final: Mapping[str, torch.Tensor], final_round: int) -> dict[str, dict[str, Any]]:
    """Each expert tensor of the model -> the record of the spec, round and state that last changed it
    (`final`: the exported state's tensors, of round `final_round`; `blobs`: the node's blob directory, holding
    the states earlier specs ended on)."""
    from training.model import meta_base

    genesis = eras[0].spec
    skeleton, adapter = meta_base(genesis, spec_path), adapter_for(genesis.model.family)
    every = {layer: list(range(adapter.num_experts(skeleton))) for layer in adapter.moe_layers(skeleton)}
    records: dict[str, dict[str, Any]] = {name: {"trained": False} for name in expert_names(every)}
    undecided = set(records)
    for era in reversed(eras):
        names = set(expert_names(era.spec.group)) & undecided
        if era.final is None or not names:
            continue
        ended = final if era is eras[-1] else _state(blobs, era.final, genesis)
        started = _start(era.spec, spec_path, blobs, sorted(names))
        recorded = states.get(era.final)
        contributors = None if recorded is None else recorded[1]
        rounds = final_round if era is eras[-1] else _state(blobs, era.final, genesis).header.meta.round
        for name in sorted(names):
            if not torch.equal(ended[name].to(torch.float32), started[name].to(torch.float32)):
                records[name] = {"trained": True, "spec": era.spec.network_id, "since_round": era.spec.first_round,
                                 "group": {str(k): v for k, v in era.spec.group.items()}, "round": rounds,
                                 "state": era.final, "contributors": None if contributors is None else list(contributors)}
                undecided.discard(name)
    return records


def _state(blobs: Path, state: str, genesis: NetworkSpec) -> BlobFile:
    path = blobs / state[:2] / state
    return BlobFile(path, read_header(path, genesis.limits.max_header_bytes))


def _start(spec: NetworkSpec, spec_path: Path, blobs: Path, names: list[str]) -> dict[str, torch.Tensor]:
    """The values `names` had when `spec` began: the base model's, with the states it inherits written over."""
    from training.model import load_base

    inherited = inherited_experts([blobs / s[:2] / s for s in (spec.lineage.inherits if spec.lineage else [])],
                                  spec.limits.max_header_bytes)
    missing = [name for name in names if name not in inherited]
    base: dict[str, torch.Tensor] = {}
    if missing:
        from training.experts import extract, parse_name

        group: dict[int, list[int]] = {}
        for name in missing:
            layer, expert, _ = parse_name(name)
            group.setdefault(layer, []).append(expert)
        group = {layer: sorted(set(ids)) for layer, ids in group.items()}
        if spec.model.checkpoint is not None:
            from protocol.spec import spec_dir_path
            from training.model import StoredExperts

            stored = StoredExperts(spec_dir_path(spec_path, spec.model.checkpoint), group)
            base = {name: stored[name] for name in missing}
        else:
            model, adapter = load_base(spec, spec_path)
            base = {name: t for name, t in extract(model, adapter, group).items() if name in missing}
    return {name: inherited[name] if name in inherited else base[name] for name in names}


def read_lineage(db: Path, genesis: NetworkSpec, network: str, state: str | None
                 ) -> tuple[list[Era], dict[str, tuple[int, tuple[str, ...]]]]:
    """`lineage` from a node's database (none: the spec file alone), and the states' records it holds."""
    specs, states = asyncio.run(known_specs(db))
    return lineage(genesis, specs, network, state), states

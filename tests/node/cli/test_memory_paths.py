"""What each operator command materialises, on small models: the memory paths a real-size checkpoint needs.

- `tessera train --forward compressed` reads the group's expert rows and no other expert of the group
  layers, trains a model holding only those, and writes the blob a compressed miner writes;
- `export` of a checkpoint network copies the base's shards and writes only the group's rows: no
  checkpoint tensor is loaded, no tensor larger than one expert row is made, and the result loads
  as the base with the state's experts; `provenance.json` names the network, base and the chain of
  states with each round's merged miners and their commitments;
- validator scoring keeps one copy of the model: it copies expert rows, never a whole weight.
Materialised tensors are observed with a torch dispatch mode (every aten op's outputs).
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import training.checkpoint
import training.model
from miner.model import MinerModel
from miner.settings import MinerSettings
from miner.submission import build_submission, encode_submission
from node.sim.twins import Twins
from protocol.identity import Identity, save_identity
from protocol.spec import load_spec
from tests.node.cli.test_real_checkpoint_cli import new_network, run
from training.blob import blob_hash, decode_blob
from training.compressed import CompressedModel, count_expert_rows
from training.experts import extract, insert
from training.model import load_base, load_checkpoint, state_hash
from validator.scoring import Scorer

pytestmark = pytest.mark.timeout(300)


class Outputs(TorchDispatchMode):  # type: ignore[no-untyped-call]  # torch leaves it unannotated
    """Records the shape and bytes of every tensor an aten op returns (copies, casts, factories)."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.made: list[tuple[str, tuple[int, ...], int]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else (out,):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self.made.append((str(func), tuple(t.shape), t.numel() * t.element_size()))
        return out


@contextmanager
def observed() -> Iterator[Outputs]:
    with Outputs() as mode:
        yield mode


def test_train_forward_compressed_reads_only_the_groups_experts(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    _, spec_path, _ = new_network(tmp_path, capsys, "olmoe")
    spec = load_spec(spec_path)
    read: list[tuple[str, list[int]]] = []
    original = training.checkpoint.read_rows

    def recording(parts: Any, shape: tuple[int, ...], rows: list[int]) -> torch.Tensor:
        read.append((parts[0].key, list(rows)))
        return original(parts, shape, rows)

    monkeypatch.setattr("training.model.read_rows", recording)
    key = tmp_path / "miner.key"
    me = Identity.from_seed(bytes([7]) * 32)
    save_identity(me, key)
    blob = tmp_path / "compressed.blob"
    code, out, err = run(capsys, "train", "--spec", spec_path, "--key", key, "--round", "0", "--steps", "3",
                         "--forward", "compressed", "--out", blob)
    assert code == 0, err and json.loads(out)["steps"] == 3
    def layer_of(key: str) -> int:
        return int(key.split(".layers.")[1].split(".")[0])

    load, genesis = read[:2 * len(spec.group)], read[2 * len(spec.group):]
    # the model's rows: gate_up and down of each group layer; then the genesis experts it trains from, read from
    # the checkpoint an expert at a time (training.model.StoredExperts); nothing else
    assert {layer_of(k): rows for k, rows in load} == {layer: sorted(ids) for layer, ids in spec.group.items()}
    assert all(len(rows) == 1 for _, rows in genesis)
    assert {(layer_of(k), rows[0]) for k, rows in genesis} == {(la, e) for la, ids in spec.group.items() for e in ids}

    model = MinerModel.load(spec, spec_path, forward="compressed")
    assert isinstance(model.model, CompressedModel)
    rows = count_expert_rows(model.model.model, model.adapter)
    assert {layer: rows[layer] for layer in spec.group} == {layer: len(ids) for layer, ids in spec.group.items()}
    expected, _ = build_submission(model, me.node_id, 0, spec.model.base_hash, model.genesis.tensors,
                                   MinerSettings(forward="compressed"), steps=3)
    assert blob.read_bytes() == expected


def test_export_copies_the_shards_and_writes_only_the_groups_rows(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    checkpoint, spec_path, _ = new_network(tmp_path, capsys, "olmoe")
    spec = load_spec(spec_path)
    model, adapter = load_base(spec, spec_path)
    trained = {name: t + 0.25 for name, t in extract(model, adapter, spec.group).items()}
    insert(model, adapter, trained)
    blob = tmp_path / "miner.blob"
    key = tmp_path / "miner.key"
    save_identity(Identity.from_seed(bytes([7]) * 32), key)
    assert run(capsys, "train", "--spec", spec_path, "--key", key, "--round", "0", "--steps", "1",
               "--out", blob)[0] == 0
    _, tensors = decode_blob(blob.read_bytes(), spec.limits.max_header_bytes)
    expected, _ = load_base(spec, spec_path)
    insert(expected, adapter, tensors)
    row_bytes = max(t.numel() for t in tensors.values()) * 4

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("export loaded checkpoint tensors")

    monkeypatch.setattr(training.model, "safe_open", refuse)
    exported = tmp_path / "exported"
    with observed() as seen:
        code, _, err = run(capsys, "export", "--spec", spec_path, "--blob", blob, "--out", exported)
    assert code == 0, err
    assert max(size for _, _, size in seen.made) <= row_bytes, max(seen.made, key=lambda m: m[2])
    monkeypatch.undo()
    assert sorted(p.name for p in exported.glob("*.safetensors")) == sorted(
        p.name for p in checkpoint.glob("*.safetensors"))
    assert state_hash(load_checkpoint(exported)) == state_hash(expected)
    provenance = json.loads((exported / "provenance.json").read_text())
    assert provenance["network"] == spec.network_id and provenance["base_hash"] == spec.model.base_hash
    assert provenance["source"] == "tessera-experts/1" and provenance["chain"] == []


async def two_rounds(net: Twins) -> tuple[str | None, dict[str, Any], dict[int, dict[str, str]]]:
    """Two rounds of a network of two validators and two miners: the head, the states and commits validator-0 kept."""
    try:
        for name in ("validator-0", "validator-1", "miner-0", "miner-1"):
            await net.start(name)
        await net.rounds(0, 1)
        storage = net.nodes["validator-0"].ctx.storage
        head = await storage.head()
        states = {s.hash: s for s in await storage.global_states()}
        commits = {r: {c.miner: c.commitment for c in await storage.commits_for(r)} for r in (0, 1)}
    finally:
        await net.close()
    return head, states, commits


def test_export_provenance_names_the_chain_of_states_and_their_miners(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    net = Twins(tmp_path)
    head, states, commits = asyncio.run(two_rounds(net))
    assert head is not None and head in states
    pack = tmp_path / "pack"
    code, _, err = run(capsys, "export", "--spec", net.spec_path, "--state", head, "--data-dir",
                       tmp_path / "validator-0", "--experts-only", "--out", pack)
    assert code == 0, err
    provenance = json.loads((pack / "provenance.json").read_text())
    chain = provenance["chain"]
    assert [link["round"] for link in chain] == [0, 1] and chain[-1]["state"] == head
    assert chain[0]["parent"] == net.spec.model.base_hash and chain[1]["parent"] == chain[0]["state"]
    for link in chain:
        miners = states[link["state"]].contributors
        assert [c["miner"] for c in link["contributors"]] == list(miners) and miners
        assert all(c["commitment"] == commits[link["round"]][c["miner"]] for c in link["contributors"])


def test_scoring_keeps_one_copy_of_the_model(tmp_path: Path) -> None:
    net = Twins(tmp_path)
    spec = net.spec
    model, adapter = load_base(spec, net.spec_path)
    heldout = torch.randint(0, 250, (spec.data.heldout_sequences, spec.data.seq_len),
                            generator=torch.Generator().manual_seed(0))
    scorer = Scorer(model, adapter, spec, heldout)
    base = extract(model, adapter, spec.group)
    miners = [Identity.from_seed(bytes([n]) * 32).node_id for n in (1, 2)]
    blobs = {m: encode_submission(spec, 0, m, spec.model.base_hash, {k: t + 0.01 * n for k, t in base.items()}, base)
             for n, m in enumerate(miners, 1)}
    weights = {name: (t.data_ptr(), tuple(t.shape)) for name, t in model.state_dict().items()}
    row_numel = max(t.numel() for t in base.values())
    whole = {shape for _, shape in weights.values() if math.prod(shape) > row_numel}
    submitted = {}
    for m, data in blobs.items():
        (tmp_path / m).write_bytes(data)
        submitted[m] = (blob_hash(data), tmp_path / m)
    with observed() as seen:
        result = scorer.score_round(0, "0" * 64, base, spec.model.base_hash, submitted)
    assert [e.verdict for e in result.entries] == ["accept", "accept"]
    copies = [m for m in seen.made if m[0].startswith(("aten.clone", "aten._to_copy", "aten.copy"))]
    assert copies and not [m for m in copies if m[1] in whole], [m for m in copies if m[1] in whole][:3]
    assert {name: (t.data_ptr(), tuple(t.shape)) for name, t in model.state_dict().items()} == weights

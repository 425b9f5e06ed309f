"""A compressed-mode miner of a checkpoint network loads only its group and submits the same blobs.

`MinerModel.load(forward="compressed")` holds Θ̃0 alone (the unselected experts of the group layers
are never loaded); its blobs must be byte for byte those of a miner that loads the full model and
cuts it every round, as compressed mode did before.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from miner.model import MinerModel
from miner.settings import MinerSettings
from miner.submission import build_submission
from protocol.identity import Identity
from protocol.spec import load_spec
from tests.node.cli.test_real_checkpoint_cli import new_network
from training.compressed import CompressedModel, count_expert_rows
from training.model import StoredExperts


def test_compressed_miner_holds_only_its_group_and_submits_the_same_blobs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, spec_path, _ = new_network(tmp_path, capsys, "olmoe")
    spec = load_spec(spec_path)
    full = MinerModel.load(spec, spec_path, forward="full")
    cut = MinerModel.load(spec, spec_path, forward="compressed")
    assert isinstance(cut.model, CompressedModel)
    rows = count_expert_rows(cut.model.model, cut.adapter)
    assert {layer: rows[layer] for layer in spec.group} == {layer: len(ids) for layer, ids in spec.group.items()}
    assert cut.shapes == full.shapes
    assert isinstance(cut.genesis.tensors, StoredExperts), "the genesis experts are read from the checkpoint"
    assert all(torch.equal(cut.genesis.tensors[n], t) for n, t in full.genesis.tensors.items())

    settings = MinerSettings(forward="compressed")
    miner = Identity.from_seed(bytes([3]) * 32).node_id
    head = spec.model.base_hash
    for round in (0, 1):  # round 1 trains from genesis again: the trained rows must be replaced first
        blob_full, result_full = build_submission(full, miner, round, head, full.genesis.tensors, settings, steps=2)
        blob_cut, result_cut = build_submission(cut, miner, round, head, cut.genesis.tensors, settings, steps=2)
        assert blob_cut == blob_full and result_cut.losses == result_full.losses
    with pytest.raises(ValueError, match="forward = 'compressed'"):
        build_submission(cut, miner, 2, head, cut.genesis.tensors, MinerSettings(forward="full"), steps=1)

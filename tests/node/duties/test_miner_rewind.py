"""A miner that keeps its AdamW state (`[miner] keep_optimizer`) rewinds it when no update was merged since it
last trained: the merged experts it is about to train from are the ones it last trained from, so it steps from
the moments it had there, not from moments that already counted that point's gradient. Where the experts moved,
it goes on from its last state. A diverged training leaves nothing to rewind to. A rewound miner also backtracks
its lr: each level round halves it, down to 1/64 of the spec's, and the round after a merge trains at the spec's
again. The one setting turns all of it on; the settings that once turned parts of it off are refused."""

from __future__ import annotations

import copy
import logging
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from miner.model import MinerModel, MinerSettings
from miner.optimizer import InnerOptimizer, tensors_digest
from miner.submission import build_submission, encode_submission
from node.duties.miner import MinerDuties
from node.runtime.config import ConfigError, parse_config
from tests.node.twins import Twins, identity
from training.trainer import backtracked

pytestmark = pytest.mark.timeout(180)


def _state(value: float) -> dict[str, Any]:
    """An AdamW `state_dict` for one parameter, its moments filled with `value`."""
    moments = {"step": torch.tensor(3.0), "exp_avg": torch.full((2, 3), value), "exp_avg_sq": torch.full((2, 3), value)}
    return {"state": {0: moments}, "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": [0]}]}


def test_the_digest_tells_tensors_apart_by_every_bit_name_dtype_and_shape() -> None:
    a = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3), "v": torch.ones(4, dtype=torch.bfloat16)}
    same = {name: t.clone() for name, t in reversed(a.items())}
    nudged = {**a, "w": torch.nextafter(a["w"], torch.full_like(a["w"], 10.0))}
    assert tensors_digest(a) == tensors_digest(same)
    others = [nudged, {"x": a["w"], "v": a["v"]}, {**a, "w": a["w"].double()}, {**a, "w": a["w"].reshape(3, 2)}]
    assert len({tensors_digest(a), *map(tensors_digest, others)}) == 5


def test_the_state_goes_back_only_when_the_merged_experts_did_not_move(caplog: pytest.LogCaptureFixture) -> None:
    here, moved = {"w": torch.zeros(2, 3)}, {"w": torch.full((2, 3), 1e-3)}
    optimizer = InnerOptimizer(_state(1.0))
    optimizer.start(here, 4)
    assert optimizer.state is not None
    optimizer.state["state"][0]["exp_avg"].add_(5.0)  # torch's step updates a loaded CPU state in place
    optimizer.state = _state(2.0)  # and leaves its own
    with caplog.at_level(logging.INFO, logger="miner.optimizer"):
        optimizer.start(here, 5)  # nothing merged in round 4
    assert "round 5: no update was merged since this miner last trained" in caplog.text
    assert optimizer.state is not None and torch.equal(optimizer.state["state"][0]["exp_avg"], torch.full((2, 3), 1.0))
    optimizer.state = _state(3.0)
    optimizer.start(moved, 6)  # round 5 merged something: go on from the last state
    assert optimizer.state is not None and torch.equal(optimizer.state["state"][0]["exp_avg"], torch.full((2, 3), 3.0))
    optimizer.drop()
    optimizer.start(moved, 7)  # a diverged round 6 leaves nothing to rewind to
    assert optimizer.state is None and optimizer.before is None


def test_a_level_round_trains_from_the_moments_the_miner_had_there(tmp_path: Path) -> None:
    """Real training on the twins: round 2 from the experts round 1 trained from gives the bytes of a miner that
    went straight from round 0 to round 2 (at the same halved lr), and not those of one that goes on from round 1's
    moments."""
    net = Twins(tmp_path)
    model, me = MinerModel.load(net.spec, net.spec_path), identity("miner-0").node_id
    genesis, head = model.genesis.tensors, "ab" * 32
    moved = {name: t + 1e-3 for name, t in genesis.items()}

    def trained(round: int, state: dict[str, Any] | None, lr_scale: float) -> bytes:
        result = model.train(me, round, moved, MinerSettings(), lambda: True, optimizer_state=state, lr_scale=lr_scale)
        return encode_submission(model.spec, round, me, head, result.tensors, moved)

    rewinding = InnerOptimizer()
    build_submission(model, me, 0, head, genesis, MinerSettings(), optimizer=rewinding)
    straight = copy.deepcopy(rewinding.state)  # round 0's moments
    build_submission(model, me, 1, head, moved, MinerSettings(), optimizer=rewinding)
    assert rewinding.state is not None
    went_on = copy.deepcopy(rewinding.state)  # round 1's moments, nothing to rewind to
    level = build_submission(model, me, 2, head, moved, MinerSettings(), optimizer=rewinding)[0]
    assert rewinding.lr_scale == 0.5
    assert level == trained(2, straight, 0.5)
    assert level != trained(2, went_on, 0.5)


def test_backtracking_halves_the_lr_each_level_round_down_to_a_floor_and_a_merge_restores_it() -> None:
    assert [backtracked(1 / 2**k, merged=False) for k in range(7)] == [1 / 2**k for k in range(1, 7)] + [1 / 64]
    assert backtracked(1 / 64, merged=True) == backtracked(1.0, merged=True) == 1.0
    for wrong in (0.0, -0.5, 1.5, math.nan):
        with pytest.raises(ValueError, match="an lr scale is in"):
            backtracked(wrong, merged=False)
    here, moved = {"w": torch.zeros(2, 3)}, {"w": torch.ones(2, 3)}
    optimizer = InnerOptimizer()
    scales = []
    for base in [here] * 9 + [moved, moved, here]:
        optimizer.start(base, 0)
        scales.append(optimizer.lr_scale)
    assert scales == [1.0, 0.5, 0.25, 0.125, 1 / 16, 1 / 32, 1 / 64, 1 / 64, 1 / 64, 1.0, 0.5, 1.0]
    optimizer.start(moved, 0)
    optimizer.drop()  # a diverged round starts over at the spec's lr
    assert optimizer.lr_scale == 1.0


def test_a_level_round_trains_at_half_the_lr_of_the_last_training(tmp_path: Path) -> None:
    """Real training on the twins: a backtracking miner's level round gives the bytes of a miner that trains from
    the same moments at half the spec's lr, and not those of one at the spec's lr."""
    net = Twins(tmp_path)
    model, me = MinerModel.load(net.spec, net.spec_path), identity("miner-0").node_id
    genesis, head = model.genesis.tensors, "ab" * 32

    def trained(lr_scale: float) -> bytes:  # round 1 from zero moments, as the rewound miner
        result = model.train(me, 1, genesis, MinerSettings(), lambda: True, lr_scale=lr_scale)
        return encode_submission(model.spec, 1, me, head, result.tensors, genesis)

    backtracking = InnerOptimizer()
    build_submission(model, me, 0, head, genesis, MinerSettings(), optimizer=backtracking)
    level = build_submission(model, me, 1, head, genesis, MinerSettings(), optimizer=backtracking)[0]
    assert backtracking.lr_scale == 0.5
    assert level == trained(0.5)
    assert level != trained(1.0)


async def test_the_miner_config_sets_whether_it_keeps_its_state(tmp_path: Path) -> None:
    net = Twins(tmp_path, validators=1)
    try:
        settings: dict[str, dict[str, object]] = {"miner-0": {"keep_optimizer": True}, "miner-2": {}}
        optimizers = {}
        for name, miner in settings.items():
            duties = (await net.start(name, miner=miner)).duties
            assert isinstance(duties, MinerDuties)
            optimizers[name] = duties.optimizer
    finally:
        await net.close()
    assert isinstance(optimizers["miner-0"], InnerOptimizer)
    assert optimizers["miner-2"] is None


@pytest.mark.parametrize("field", ["rewind_optimizer", "backtrack_lr"])
def test_a_config_naming_a_removed_rewind_setting_is_refused_by_name(tmp_path: Path, field: str) -> None:
    text = f'[node]\nrole = "miner"\nspec = "spec.toml"\n\n[miner]\nkeep_optimizer = true\n{field} = false\n'
    with pytest.raises(ConfigError, match=rf"miner\.{field}: Extra inputs are not permitted"):
        parse_config(text, tmp_path / "node.toml")

"""A miner whose training diverged (NaN or Inf in the trained experts) submits nothing that round, in
either submission format: no blob is encoded, its error-feedback buffer stays the one of its last
submission. The duty logs why and records no submission."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch

from miner.model import MinerModel
from miner.settings import MinerSettings
from miner.submission import ErrorFeedback, build_submission, encode_submission
from node.sim.twins import Twins
from protocol.rounds import Phase
from protocol.spec import parse_spec
from tests.conftest import make_spec_dict
from training.trainer import TrainResult

pytestmark = pytest.mark.timeout(120)

SHAPES = {"layers.0.experts.1.down_proj": (4, 2), "layers.0.experts.1.gate_up_proj": (4, 4)}
SPECS = {"experts": parse_spec(make_spec_dict()),
         "pgrad": parse_spec({**make_spec_dict(), "submission": {"format": "pgrad"}})}
DIVERGED = "training diverged: non-finite values in layers.0.experts.1.gate_up_proj"


def _experts(value: float = 0.0) -> dict[str, torch.Tensor]:
    out = {name: torch.arange(float(torch.Size(shape).numel())).reshape(shape) for name, shape in SHAPES.items()}
    out["layers.0.experts.1.gate_up_proj"][1, 2] = value
    return out


@pytest.mark.parametrize("format", ["experts", "pgrad"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_trained_experts_are_not_encoded_and_leave_the_buffer(format: str, value: float) -> None:
    before = {name: torch.full(shape, 0.5) for name, shape in SHAPES.items()}
    feedback = ErrorFeedback({name: t.clone() for name, t in before.items()})
    with pytest.raises(ValueError, match=DIVERGED):
        encode_submission(SPECS[format], 1, "ab" * 32, "cd" * 32, _experts(value), _experts(), feedback)
    assert feedback.error is not None and all(torch.equal(feedback.error[n], before[n]) for n in SHAPES)


class _DivergingModel:
    """Stands in for MinerModel: its training leaves non-finite experts, as a diverged run does."""

    def __init__(self, format: str) -> None:
        self.spec = SPECS[format]

    def train(self, miner: str, round: int, base: Mapping[str, torch.Tensor], settings: MinerSettings,
              keep_going: Callable[[], bool], steps: int | None = None, progress: bool = False) -> TrainResult:
        return TrainResult(tensors=_experts(float("nan")), losses=[float("nan")])


@pytest.mark.parametrize("format", ["experts", "pgrad"])
def test_a_diverged_build_keeps_the_buffer(format: str) -> None:
    feedback = ErrorFeedback({name: torch.zeros(shape) for name, shape in SHAPES.items()})
    model: Any = _DivergingModel(format)
    with pytest.raises(ValueError, match=DIVERGED):
        build_submission(model, "ab" * 32, 3, "cd" * 32, _experts(), MinerSettings(), feedback=feedback)
    assert feedback.error is not None and all(bool((t == 0).all()) for t in feedback.error.values())


async def test_the_duty_records_no_submission_and_keeps_the_last_buffer(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    def train(self: MinerModel, miner: str, round: int, base: Mapping[str, torch.Tensor], *args: Any,
              **kwargs: Any) -> TrainResult:
        step = float("nan") if round == 1 else 1e-3  # no torch training: round 0 moves, round 1 diverged
        return TrainResult(tensors={name: t + step for name, t in base.items()}, losses=[1.0], seconds=1.0)

    monkeypatch.setattr(MinerModel, "train", train)
    net = Twins(tmp_path, validators=1, extra='\n[submission]\nformat = "pgrad"\n')
    try:
        await net.start("validator-0")
        miner = await net.start("miner-0")
        await net.phase(0, Phase.TRAIN)
        kept = await miner.ctx.storage.pgrad_error()
        assert await miner.ctx.storage.submission(0) is not None and kept is not None
        with caplog.at_level(logging.ERROR, logger="node.duties.miner"):
            await net.phase(1, Phase.TRAIN)
        assert "round 1: no submission: training diverged: non-finite values in layers." in caplog.text
        assert await miner.ctx.storage.submission(1) is None
        assert await miner.ctx.storage.pgrad_error() == kept
    finally:
        await net.close()

"""A miner's plan is its steady state: no step of a round holds more than the plan says, whatever the setting.

From the second inner step on, the optimizer state lives through every forward and backward, and with
micro-batches every one after the first holds the step's gradients: a plan of one step, or one micro-batch,
reports less than a round needs. These trace on fake tensors of a tiny model (cheap), against traces of more
steps and against three steps on real tensors (tests/training/test_plan.py).
"""

from __future__ import annotations

import pytest
import torch

from training.plan import STEPS, MemoryPlan, Setting, plan
from training.tiny import tiny_config

SEQ = 24
SMALL = 4096
"""Bytes two traces of the same work may differ by: what a process makes once, the first time (bitsandbytes' 8-bit
code tables, 128 bytes; a few small tensors of a first scoring pass), lands in whichever trace runs first."""
SETTINGS = {
    "adamw, checkpointing": Setting(role="miner", seq_len=SEQ, device="cpu", checkpointing=True),
    "adamw8bit, micro-batches": Setting(role="miner", seq_len=SEQ, device="cpu", micro_batch=2, batch_size=6,
                                        optimizer="adamw8bit"),
    "cuda autocast, 8-bit, step in backward": Setting(role="miner", seq_len=SEQ, autocast=True, optimizer="adamw8bit",
                                                       step_in_backward=True),
}


def traced(setting: Setting, steps: int | None = None, family: str = "olmoe", per_layer: int = 4) -> MemoryPlan:
    return plan(tiny_config(family), setting, per_layer, family=family, dtype=torch.float32,
                attn_implementation="eager", steps=steps)


@pytest.mark.slow  # two traces each; `make check` runs test_the_steady_peak_holds_the_two_moments_...
@pytest.mark.parametrize("name", list(SETTINGS))
def test_the_plan_reports_what_three_steps_hold_and_more_than_the_first_step(name: str) -> None:
    reported, three = traced(SETTINGS[name]), traced(SETTINGS[name], steps=3)
    assert len(reported.step_peaks) == STEPS and len(three.step_peaks) == 3
    assert abs(reported.peak_bytes - three.peak_bytes) <= SMALL and three.peak_bytes == max(three.step_peaks)
    assert three.step_peaks[2] == three.step_peaks[1]  # the third step holds what the second does
    assert reported.peak_bytes > three.step_peaks[0]  # and more than the first, where no optimizer state lives


def test_the_steady_peak_holds_the_two_moments_of_every_trained_tensor() -> None:
    """A plan that dropped the optimizer state (a one-step trace, or state left uncounted) fails here."""
    result = traced(Setting(role="miner", seq_len=96, device="cpu"))
    assert result.step == 2 and result.phase in ("forward", "backward")
    assert result.parts["optimizer_state"] >= 2 * result.parts["trainable_copies"] > 0
    assert result.peak_bytes >= (result.parts["weights"] + 3 * result.parts["trainable_copies"]
                                 + result.parts["activations"])


@pytest.mark.slow  # two traces of longer sequences
def test_micro_batches_after_the_first_hold_the_steps_gradients() -> None:
    one_pass = traced(Setting(role="miner", seq_len=96, device="cpu", micro_batch=2))
    accumulated = traced(Setting(role="miner", seq_len=96, device="cpu", micro_batch=2, batch_size=8))
    assert accumulated.parts["gradients"] == accumulated.parts["trainable_copies"]
    assert accumulated.peak_bytes >= one_pass.peak_bytes + accumulated.parts["gradients"] // 2


@pytest.mark.slow  # two traces
def test_a_step_in_backward_never_holds_the_whole_groups_gradients() -> None:
    default, in_backward = (traced(Setting(role="miner", seq_len=8, device="cpu", step_in_backward=flag),
                                   family="qwen3_moe", per_layer=2) for flag in (False, True))
    assert default.parts["gradients"] == default.parts["trainable_copies"] > 0
    assert in_backward.parts["gradients"] <= default.parts["gradients"] // 2  # one layer's of two, at most
    assert in_backward.peak_bytes < default.peak_bytes


@pytest.mark.slow  # two traces
def test_a_validator_keeps_nothing_from_one_batch_to_the_next() -> None:
    setting = Setting(role="validator", seq_len=SEQ, micro_batch=2, device="cpu")
    one, three = traced(setting), traced(setting, steps=3)
    assert abs(one.peak_bytes - three.peak_bytes) <= SMALL


def test_step_in_backward_needs_a_step_of_one_micro_batch() -> None:
    with pytest.raises(ValueError, match="step_in_backward"):
        Setting(role="miner", seq_len=8, micro_batch=1, batch_size=2, step_in_backward=True)
    with pytest.raises(ValueError, match="batch_size"):
        Setting(role="miner", seq_len=8, micro_batch=4, batch_size=2)

"""Settings picked to fit: the fastest combination whose plan fits, the nearest when none does, and no combination
traced that one saving as much already ruled out. A stand-in `trace` gives each combination a made-up plan
(pure arithmetic), so these cost nothing; tests/node/ runs the fit on traced plans of a tiny model."""

from __future__ import annotations

from dataclasses import replace

import pytest

from training.fit import MINER_FIELDS, VALIDATOR_FIELDS, DoesNotFit, fit
from training.plan import GIB, MARGIN_FIXED, MemoryPlan, Setting

BASE = Setting(role="miner", seq_len=512, micro_batch=4, batch_size=4, device="cuda", forward="full")


def made_up(setting: Setting) -> MemoryPlan:
    """A step of 4 x 512 tokens, 2048 in one pass. GiB: 4 weights (2 compressed), 4 copies, 4 gradients (0.5 a step in backward), 8 moments (2 in 8 bits),
    2 of activations a sequence (0.5 checkpointed)."""
    gib = (2 if setting.forward == "compressed" else 4) + 4 + (0.5 if setting.step_in_backward else 4)
    gib += 2 if setting.optimizer == "adamw8bit" else 8
    gib += setting.micro_batch * (0.5 if setting.checkpointing else 2)
    gib += 0.5 if setting.weights == "int8" else 0
    peak = int(gib * GIB)
    return MemoryPlan(peak, {"activations": peak}, "backward", 2, (peak,), setting.device, 0.0)


def need(setting: Setting) -> float:
    """GiB with the margin, as the fit compares it."""
    plan = made_up(setting)
    return (plan.peak_bytes + plan.margin_bytes) / GIB


class Tracer:
    def __init__(self) -> None:
        self.traced: list[Setting] = []

    def __call__(self, setting: Setting) -> MemoryPlan:
        assert setting not in self.traced, "a combination is traced once"
        self.traced.append(setting)
        return made_up(setting)


def test_a_roomy_budget_takes_the_fastest_combination_with_one_trace() -> None:
    tracer = Tracer()
    choice = fit(tracer, BASE, MINER_FIELDS, 64 * GIB)
    assert tracer.traced == [choice.setting] and choice.slowdown == 1.0
    assert choice.setting == replace(BASE, forward="compressed", autocast=True)


def test_the_fastest_that_fits_wins_and_ties_go_to_the_least_change_of_arithmetic() -> None:
    budget = int(need(replace(BASE, forward="compressed", autocast=True, step_in_backward=True)) * GIB) + 1
    choice = fit(Tracer(), BASE, MINER_FIELDS, budget)
    # 8-bit moments would fit too, as fast: the step in backward changes the arithmetic less (only where the clip binds)
    assert choice.setting == replace(BASE, forward="compressed", autocast=True, step_in_backward=True)
    assert choice.slowdown == 1.0 and any("step in backward" in change for change in choice.changes)
    tighter = int(need(replace(BASE, forward="compressed", autocast=True, step_in_backward=True,
                               optimizer="adamw8bit")) * GIB) + 1
    chosen = fit(Tracer(), BASE, MINER_FIELDS, tighter).setting
    assert (chosen.step_in_backward, chosen.optimizer, chosen.checkpointing) == (True, "adamw8bit", False)


def test_checkpointing_and_short_passes_are_chosen_only_when_nothing_as_fast_fits() -> None:
    fastest_tight = replace(BASE, forward="compressed", autocast=True, step_in_backward=True, optimizer="adamw8bit")
    budget = int((need(fastest_tight) - 1) * GIB)
    choice = fit(Tracer(), BASE, MINER_FIELDS, budget)
    assert choice.slowdown > 1.0 and choice.need_bytes <= budget
    assert choice.setting.checkpointing or choice.setting.micro_batch < BASE.micro_batch


def savings(setting: Setting) -> tuple[int, ...]:
    return (int(setting.checkpointing), int(setting.step_in_backward), int(setting.optimizer == "adamw8bit"),
            -setting.micro_batch)


def test_a_combination_that_saves_no_more_than_one_that_failed_is_not_traced() -> None:
    tracer = Tracer()
    budget = int(need(replace(BASE, forward="compressed", autocast=True, optimizer="adamw8bit", checkpointing=True,
                              step_in_backward=True)) * GIB) + 1
    fit(tracer, BASE, MINER_FIELDS, budget)
    for later, setting in enumerate(tracer.traced):
        for failed in tracer.traced[:later]:
            if need(failed) * GIB > budget:
                assert not all(a <= b for a, b in zip(savings(setting), savings(failed), strict=True)), (
                    setting, failed)
    assert len(tracer.traced) < 10  # of 16 combinations (2 x 2 x 2 x 3 micro-batches, less 8 that cannot step in backward)


def test_pinned_settings_stay_as_given() -> None:
    free = [name for name in MINER_FIELDS if name not in ("forward", "optimizer")]
    budget = int(need(replace(BASE, autocast=True, checkpointing=True, step_in_backward=True)) * GIB) + 1
    choice = fit(Tracer(), BASE, free, budget)
    assert choice.setting.forward == "full" and choice.setting.optimizer == "adamw"


def test_nothing_fits_names_the_nearest_in_one_line() -> None:
    with pytest.raises(DoesNotFit) as refused:
        fit(Tracer(), BASE, MINER_FIELDS, 3 * GIB)
    saving = replace(BASE, forward="compressed", autocast=True, checkpointing=True, optimizer="adamw8bit")
    most = (replace(saving, micro_batch=1), replace(saving, step_in_backward=True))  # neither saves all the other does
    assert refused.value.nearest.setting == min(most, key=need)
    message = str(refused.value)
    assert "\n" not in message and message.startswith("nothing fits 3.0 GiB; the nearest, compressed, ")


def test_a_validator_picks_its_largest_batch_that_fits_and_int8_only_when_needed() -> None:
    base = Setting(role="validator", seq_len=2048, micro_batch=16, device="cuda")
    budget = int(need(replace(base, micro_batch=4)) * GIB) + 1
    choice = fit(Tracer(), base, VALIDATOR_FIELDS, budget)
    assert choice.setting.micro_batch == 4 and choice.setting.weights == "checkpoint"
    assert MARGIN_FIXED > 0 and choice.slowdown == 1.0  # 4 x 2048 tokens still fill a pass

"""The learning benchmark's metric arithmetic (bench/learning_runs.py, bench/learning.py) on hand-made curves and runs.

Every efficiency the learning results quote is read off the ESFT curve by `esft_steps` and divided by
the miner steps spent; the `seeds` section reports ranges over seeds. Checked here without a model.
"""

from __future__ import annotations

from dataclasses import replace
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import torch

from tests.bench.scripts import load_bench

CURVE = [(0, 2.0), (20, 1.5), (40, 1.0), (60, 1.0), (80, 0.5)]


@pytest.fixture(scope="module")
def runs() -> ModuleType:
    """How a run reads against the ESFT curve."""
    return load_bench("learning_runs")


@pytest.fixture(scope="module")
def learning() -> ModuleType:
    """The arms the benchmark runs and the targets it reads."""
    return load_bench("learning")


def test_esft_steps_interpolate_between_curve_points_and_take_the_first_crossing(runs: ModuleType) -> None:
    assert runs.esft_steps(CURVE, 2.0) == 0.0
    assert runs.esft_steps(CURVE, 1.25) == pytest.approx(30.0)  # halfway from 20 to 40
    assert runs.esft_steps(CURVE, 1.0) == pytest.approx(40.0)  # the plateau: its first step, not 60
    assert runs.esft_steps(CURVE, 0.75) == pytest.approx(70.0)
    assert runs.esft_steps(CURVE, 0.4) is None  # below anything the curve reached


def test_the_monotone_read_does_not_stop_at_a_dip_the_curve_climbs_out_of(runs: ModuleType) -> None:
    noisy = [(0, 2.0), (20, 1.0), (40, 0.9), (60, 0.95), (80, 0.85)]
    fitted = runs.monotone(noisy)
    assert [step for step, _ in fitted] == [0, 20, 40, 60, 80]
    assert [loss for _, loss in fitted] == pytest.approx([2.0, 1.0, 0.925, 0.925, 0.85])  # 40 and 60 pooled
    assert runs.esft_steps(noisy, 0.92) == pytest.approx(36.0)  # the dip at 40 decides the first read
    assert runs.esft_steps(fitted, 0.92) == pytest.approx(60 + 20 * 0.005 / 0.075)
    assert runs.monotone(CURVE) == CURVE  # a curve that never rises is its own fit


def test_summarise_reads_efficiency_against_honest_steps_and_equal_token_esft(runs: ModuleType) -> None:
    settings = runs.Settings(rounds=2, inner_steps=10)
    bench = type("B", (), {"s": settings, "base_loss": 2.0})()
    run = {"miners": 4, "adversaries": 2, "losses": [1.5, 1.25]}  # 2 honest miners: 40 steps spent
    runs.summarise(bench, run, CURVE, {40: 0.3})
    assert run["esft_equivalent_steps"] == [20.0, 30.0]
    assert run["parallel_efficiency"] == pytest.approx(30 / 40)
    assert run["parallel_efficiency_monotone"] == pytest.approx(30 / 40)  # CURVE never rises
    assert run["network_vs_esft"] == pytest.approx((2.0 - 1.25) / (2.0 - 1.0))  # ESFT at 40 steps
    assert run["esft_forgetting_equal_tokens"] == 0.3
    assert run["lowered_every_round"] is True and run["rounds_lowered"] == 2
    stalled = {"miners": 1, "adversaries": 0, "losses": [1.5, 1.5]}
    runs.summarise(bench, stalled, CURVE, {})
    assert stalled["lowered_every_round"] is False and stalled["rounds_lowered"] == 1
    assert "network_vs_esft" in stalled


def test_the_share_target_asks_for_the_efficiency_at_which_esft_first_keeps_that_share(runs: ModuleType) -> None:
    # efficiencies are rounded to 4 places; CURVE drops 1.5 by step 80; 0.95 of that is loss 0.575, reached 0.85 of the way from 60 to 80
    assert runs.efficiency_for_share(CURVE, 2.0, 80) == pytest.approx(77 / 80, abs=1e-4)
    assert runs.efficiency_for_share(CURVE, 2.0, 80, share=0.5) == pytest.approx(30 / 80, abs=1e-4)
    # at 40 steps the curve has already flattened: 0.95 of its drop is on the way to step 40, then it waits
    assert runs.efficiency_for_share(CURVE, 2.0, 40) == pytest.approx(38 / 40, abs=1e-4)
    assert runs.efficiency_for_share(CURVE, 2.0, 60) == pytest.approx(38 / 60, abs=1e-4)
    # a network that keeps the share reads at least that efficiency on the same curve
    settings = runs.Settings(rounds=2, inner_steps=10)
    bench = type("B", (), {"s": settings, "base_loss": 2.0})()
    run = {"miners": 4, "adversaries": 0, "losses": [1.0, 0.55]}  # 80 steps spent, 0.967 of ESFT's drop
    runs.summarise(bench, run, CURVE, {})
    assert run["network_vs_esft"] >= 0.95
    assert run["parallel_efficiency"] >= runs.efficiency_for_share(CURVE, 2.0, 80)


def test_an_arm_with_its_own_inner_steps_spends_the_same_steps_over_more_rounds(runs: ModuleType) -> None:
    settings = runs.Settings(rounds=5, inner_steps=20)
    assert runs.round_shape(settings, runs.Arm()) == (20, 5)
    assert runs.round_shape(settings, runs.Arm(inner_steps=5)) == (5, 20)
    assert runs.round_shape(settings, runs.Arm(inner_steps=100)) == (100, 1)
    for steps in (0, 3, 200):  # 3 does not divide 100 steps; 200 is more than a miner spends
        with pytest.raises(ValueError, match="must divide the 100 steps"):
            runs.round_shape(settings, runs.Arm(inner_steps=steps))


def test_partitioned_miners_share_out_every_expert_of_the_group(runs: ModuleType) -> None:
    group = {0: [1, 6], 1: [1, 4]}
    bench = runs.Bench.__new__(runs.Bench)  # `share` reads only the group
    bench.group = group

    def shares(miners: int) -> list[dict[int, list[int]]]:
        arm = runs.Arm(miners=miners, experts="partition")
        return [bench.share(arm, i) for i in range(miners)]

    assert shares(4) == [{0: [1]}, {0: [6]}, {1: [1]}, {1: [4]}]
    assert shares(2) == [{0: [1], 1: [1]}, {0: [6], 1: [4]}]
    assert shares(8) == shares(4) * 2  # more miners than experts: each expert trained by two
    assert bench.share(runs.Arm(miners=4), 3) == group  # the protocol's miners train the whole group
    with pytest.raises(ValueError, match="either the experts among miners or the compressed chunks"):
        runs.Arm(experts="partition", pgrad=runs.PgradConfig())


def test_every_family_runs_on_4_and_8_miners_and_half_adversarial_under_every_seed(learning: ModuleType) -> None:
    assert learning.EVERY_STEP in learning.FAMILIES and set(learning.SHORT_FAMILIES) < set(learning.FAMILIES)
    for family in learning.FAMILIES:
        arms = learning.family(family, learning.Arm(inner_steps=5, miners=2, outer_lr=2.0))
        assert set(arms) == {f"{family}_4", f"{family}_8", f"{family}_adversarial_4"}
        assert set(arms) <= set(learning.SEED_ARMS)  # the targets read them under every seed
        assert [arms[name].miners for name in sorted(arms)] == [4, 8, 4]
        assert [arms[name].adversaries for name in sorted(arms)] == [0, 0, 2]
        assert all(arm.inner_steps == 5 and arm.outer_lr == 2.0 for arm in arms.values())
    # At an outer lr of M the lr follows the identities a network is run with, adversaries among them.
    scaled = learning.family("x", learning.Arm(inner_steps=1), outer_lr_is_miners=True)
    assert [scaled[name].outer_lr for name in ("x_4", "x_8", "x_adversarial_4")] == [4.0, 8.0, 4.0]


def test_the_learning_benchmark_runs_outer_lrs_averaged_family_as_it_is(learning: ModuleType) -> None:
    outer_lr = load_bench("outer_lr")
    averaged = learning.averaged_family()
    assert learning.AVERAGED in learning.FAMILIES and set(averaged) <= set(learning.SEED_ARMS)
    assert averaged == {name: outer_lr.ARMS[name] for name in averaged}  # the arms docs/learning.md reports
    assert [averaged[f"{learning.AVERAGED}_{n}"].beta1 for n in ("4", "8", "adversarial_4")] == [
        0.6561, 0.430467, 0.6561]


def _runs_outer_lrs_arms(learning: ModuleType, outer_lr: ModuleType, name: str, family: dict[str, Any],
                         arms: str) -> None:
    """`family` (the learning benchmark's `name`) is read by the targets and is outer_lr's arms named `arms`: its
    4 miners, its 8 under the 4-miner spec, and its half-adversarial 4."""
    assert name in learning.FAMILIES and set(family) <= set(learning.SEED_ARMS)
    same = {"4": f"{arms}_4", "8": f"{arms}{outer_lr.SAME_SPEC}", "adversarial_4": f"{arms}_adversarial_4"}
    assert {n: family[f"{name}_{n}"] for n in same} == {n: outer_lr.ARMS[a] for n, a in same.items()}


def test_the_rewound_family_is_outer_lrs_rewind_arms_under_one_spec(learning: ModuleType) -> None:
    outer_lr = load_bench("outer_lr")
    rewound = learning.rewound_family()
    arms = f"{outer_lr.PER_UPDATE_MOMENT}{outer_lr.SUBSET}{outer_lr.AVERAGE}{outer_lr.REWIND}"
    _runs_outer_lrs_arms(learning, outer_lr, learning.REWOUND, rewound, arms)
    assert {(arm.beta1, arm.rewind, arm.keep_optimizer) for arm in rewound.values()} == {(0.6561, True, True)}
    # the rewind arms differ from the averaged family's in the rewind alone
    assert outer_lr.ARMS[f"{arms}_4"] == replace(learning.averaged_family()[f"{learning.AVERAGED}_4"],
                                                          rewind=True)
    with pytest.raises(ValueError, match="rewind goes back to a kept AdamW state: it needs keep_optimizer"):
        learning.Arm(rewind=True)


def test_the_backtracked_family_is_outer_lrs_backtrack_arms(learning: ModuleType) -> None:
    outer_lr = load_bench("outer_lr")
    backtracked = learning.backtracked_family()
    arms = f"{outer_lr.PER_UPDATE_MOMENT}{outer_lr.SUBSET}{outer_lr.AVERAGE}{outer_lr.REWIND}{outer_lr.BACKTRACK}"
    _runs_outer_lrs_arms(learning, outer_lr, learning.BACKTRACKED, backtracked, arms)
    # each differs from the rewound family's arm in the backtracking alone
    rewound = learning.rewound_family()
    assert {name: replace(arm, backtrack=False) for name, arm in backtracked.items()} == {
        name.replace(learning.REWOUND, learning.BACKTRACKED): arm for name, arm in rewound.items()}
    with pytest.raises(ValueError, match="backtrack shortens a rewound miner's retry: it needs rewind"):
        learning.Arm(keep_optimizer=True, backtrack=True)


def test_the_sync_grid_spans_the_steps_between_merges_and_the_outer_lr(learning: ModuleType) -> None:
    grid = learning.sync_grid(learning.Arm(inner_steps=5, keep_optimizer=True, outer_lr=2.0))
    assert sorted((arm.inner_steps, arm.outer_lr) for arm in grid.values()) == [
        (h, lr) for h in (1, 2, 5, 10) for lr in (1.0, 2.0, 4.0)]
    assert all(arm.keep_optimizer and arm.miners == 4 and arm.adversaries == 0 for arm in grid.values())
    assert grid["h1_keep_optimizer_lr4_4"] == learning.family(
        learning.EVERY_STEP, learning.Arm(inner_steps=1, keep_optimizer=True), outer_lr_is_miners=True
    )[f"{learning.EVERY_STEP}_4"]


def _headline(pe: float, progress: float | None, eight_ahead: bool) -> dict:
    return {"network_vs_esft_4": 0.9, "parallel_efficiency_4": pe, "parallel_efficiency_4_ceiling": 0.6,
            "progress_4_over_1": progress, "8_ahead_of_4": eight_ahead, "8_ahead_of_4_pgrad_partitions_2": True}


def test_the_seeds_section_reports_ranges_and_counts_over_every_seed(learning: ModuleType, monkeypatch) -> None:
    seeds_seen: list[int] = []
    by_seed = {1: _headline(0.2, 1.5, True), 2: _headline(0.4, None, False)}

    class Bench:
        s = learning.Settings(rounds=2, inner_steps=10)
        base_loss = 2.0

        def esft_curve(self, steps, every, general_at):
            seeds_seen.append(self.s.seed)
            return CURVE, {}

        def network(self, arm):
            return {"arm": arm}

    monkeypatch.setattr(learning, "summarise", lambda *args: None)
    monkeypatch.setattr(learning, "data_parallel", lambda bench, curve, miners, lr_factor=1.0: {})
    monkeypatch.setattr(learning, "headline", lambda runs, ceiling, share_needs: by_seed[seeds_seen[-1]])
    bench = Bench()
    out = learning.other_seeds(bench, {name: name for name in learning.SEED_ARMS}, _headline(0.3, 2.0, False), (1, 2))
    assert seeds_seen == [1, 2] and bench.s.seed == 0  # the shared settings come back
    assert out["range"]["parallel_efficiency_4"] == [0.2, 0.4]
    assert "progress_4_over_1" not in out["range"]  # one seed has none: no range is made up
    assert out["seeds where it holds (of 3)"] == {"8_ahead_of_4": 1, "8_ahead_of_4_pgrad_partitions_2": 3}


def test_changed_settings_are_put_back_even_when_the_run_fails(learning: ModuleType) -> None:
    class Bench:
        s = learning.Settings(inner_lr=1e-3)

    bench = Bench()
    with pytest.raises(RuntimeError), learning.changed_settings(bench, inner_lr=2e-3) as shared:
        assert (bench.s.inner_lr, shared.inner_lr) == (2e-3, 1e-3)
        raise RuntimeError("a run failed")
    assert bench.s.inner_lr == 1e-3


def test_the_agreement_step_grows_an_entrys_lr_while_its_sign_holds_and_shrinks_it_where_it_flips(
    runs: ModuleType,
) -> None:
    cfg = runs.Agreement(start=2.0, grow=1.5, shrink=0.5, low=0.5, high=4.0)

    def step(at: dict[str, torch.Tensor], g: list[float], state: dict[str, torch.Tensor] | None) -> tuple[Any, Any]:
        return runs.agreement_step(at, {"w": at["w"] - torch.tensor(g)}, state, cfg)  # the mean whose G is g

    first, state = step({"w": torch.zeros(4)}, [1.0, 1.0, -1.0, 0.0], None)
    assert first["w"].tolist() == [-2.0, -2.0, 2.0, 0.0]  # every entry starts at the start lr
    # entry 0 keeps its sign, 1 flips, 2 keeps it (negative), 3 was 0 and keeps its lr
    second, state = step(first, [1.0, -1.0, -2.0, 5.0], state)
    assert state["lr:w"].tolist() == [3.0, 1.0, 3.0, 2.0]
    assert second["w"].tolist() == [-5.0, -1.0, 8.0, -10.0]
    for entry_1 in (1.0, -1.0, 1.0):  # entries 0 and 2 hold their signs up to `high`, entry 1 flips down to `low`
        second, state = step(second, [1.0, entry_1, -1.0, 0.0], state)
    assert state["lr:w"].tolist() == [4.0, 0.5, 4.0, 2.0]


def test_the_outer_lr_summary_reads_ranges_and_counts_over_seeds() -> None:
    outer_lr = load_bench("outer_lr")

    def run(loss: float, efficiency: float | None, forgetting: float, lowered: int) -> dict[str, Any]:
        return {"parallel_efficiency": efficiency, "network_vs_esft": 0.9, "forgetting": forgetting,
                "esft_forgetting_equal_tokens": 0.5, "rounds_lowered": lowered, "losses": [loss] * 4}

    def seed(shift: float, efficiency: float | None) -> dict[str, Any]:
        arms = {name: run(1.0, 0.3, 0.4, 4) for name in outer_lr.ARMS}
        arms[f"{outer_lr.PER_UPDATE}_4"] = run(1.0, efficiency, 0.5 + shift, 4 - int(shift > 0))
        arms[f"{outer_lr.PER_UPDATE}_8"] = run(1.0 - shift, 0.3, 0.4, 4)
        return {"arms": arms}

    summary = outer_lr.summary({"0": seed(0.0, 0.6), "1": seed(0.1, 0.2)})
    four = summary[f"{outer_lr.PER_UPDATE}_4"]
    assert four["parallel_efficiency"] == [0.2, 0.6] and four["forgetting"] == [0.5, 0.6]
    assert four["seeds where it forgets no more than ESFT"] == 1  # equal counts as no more
    assert four["seeds where it falls every round"] == 1
    assert summary[f"{outer_lr.PER_UPDATE}_8"]["seeds where it ends ahead of 4 miners"] == 1  # a tie is not ahead
    gap = outer_lr.summary({"0": seed(0.0, 0.6), "1": seed(0.0, None)})[f"{outer_lr.PER_UPDATE}_4"]
    assert "parallel_efficiency" not in gap and gap["network_vs_esft"] == [0.9, 0.9]  # no range over a missing read


def test_an_overlapping_arm_is_its_every_step_arm_one_round_stale(runs: ModuleType) -> None:
    outer_lr = load_bench("outer_lr")
    overlapping = [name for name in outer_lr.ARMS if outer_lr.OVERLAP in name]
    twins = [name for name in overlapping if name.replace(outer_lr.OVERLAP, "") in outer_lr.ARMS]
    assert len(overlapping) == 7 and len(twins) == 6
    for name in overlapping:
        assert outer_lr.ARMS[name].delay == 1 and outer_lr.ARMS[name].inner_steps == 1
    for name in twins:
        assert outer_lr.ARMS[name.replace(outer_lr.OVERLAP, "")] == replace(outer_lr.ARMS[name], delay=0)
    half = outer_lr.ARMS[f"{outer_lr.PER_UPDATE_MOMENT}{outer_lr.OVERLAP}_half_lr_4"]
    assert replace(half, outer_lr=1.0) == outer_lr.ARMS[f"{outer_lr.PER_UPDATE_MOMENT}{outer_lr.OVERLAP}_4"]
    with pytest.raises(ValueError, match="delay is a number of rounds, at least 0, got -1"):
        runs.Arm(delay=-1)


def test_a_copier_on_its_own_replays_last_rounds_update_and_a_helped_one_copies_this_rounds(runs: ModuleType) -> None:
    bench = SimpleNamespace(stream=lambda number: number)
    state = {"w": torch.tensor([1.0, 2.0])}
    victim = {"w": torch.tensor([0.5, 2.5])}
    revealed = {"w": torch.tensor([0.25, -0.5])}  # miner 0's pseudo-gradient of the previous round

    def copy(copier: str, last: dict[str, torch.Tensor] | None) -> torch.Tensor:
        return runs.Bench.adversary(bench, 1, state, {0: victim}, 3, copier, last)["w"]

    assert copy("last_round", revealed).tolist() == [0.75, 2.5]  # the old update on the current state
    unchanged = copy("last_round", None)  # round 0: nothing revealed yet
    assert unchanged.tolist() == [1.0, 2.0] and unchanged is not state["w"]
    assert torch.allclose(copy("same_round", revealed), victim["w"] + 1e-6)
    noisy = runs.Bench.adversary(bench, 0, state, {0: victim}, 3, "last_round", revealed)["w"]
    assert not torch.equal(noisy, state["w"]) and (noisy - state["w"]).abs().max() < 0.5  # the noise miner is unchanged


def test_the_esft_yardstick_counts_stretches_that_end_lower_at_four_decimals() -> None:
    outer_lr = load_bench("outer_lr")
    curve = list(enumerate([1.0, 0.9, 0.95, 0.94, 0.93, 0.92, 0.92001, 0.9199, 0.93]))
    assert outer_lr.esft_lowered(curve, 1) == "5 of 8"  # 0.92 -> 0.92001 rounds level, not lower
    assert outer_lr.esft_lowered(curve, 4) == "1 of 2"  # 1.0 -> 0.93 falls, 0.93 -> 0.93 does not


def test_the_copier_and_subset_arms_are_their_reference_arms_with_one_change() -> None:
    outer_lr = load_bench("outer_lr")
    moment = f"{outer_lr.PER_UPDATE_MOMENT}"
    for prefix in (moment, moment + outer_lr.SUBSET):
        copier = outer_lr.ARMS[prefix + outer_lr.LAST_ROUND_COPIER]
        assert replace(copier, copier="same_round") == outer_lr.ARMS[f"{prefix}_adversarial_4"]
    for suffix in ("4", "8", "adversarial_4"):
        gated = outer_lr.ARMS[f"{moment}{outer_lr.SUBSET}_{suffix}"]
        assert gated.subset == 128 and replace(gated, subset=None) == outer_lr.ARMS[f"{moment}_{suffix}"]


def test_the_averaged_arms_are_their_reference_arms_reporting_the_protocols_average(runs: ModuleType) -> None:
    from training.outer import average_states

    assert runs.average_states is average_states  # the arms fold the average as validators do
    for bad in (-0.1, 1.0):
        with pytest.raises(ValueError, match="average is a decay in \\[0, 1\\)"):
            runs.Arm(average=bad)
    outer_lr = load_bench("outer_lr")
    for suffix in ("4", "8", "adversarial_4"):
        averaged = outer_lr.ARMS[f"{outer_lr.PER_UPDATE_MOMENT}{outer_lr.SUBSET}{outer_lr.AVERAGE}_{suffix}"]
        assert replace(averaged, average=0.0) == outer_lr.ARMS[f"{outer_lr.PER_UPDATE_MOMENT}{outer_lr.SUBSET}_{suffix}"]


def test_the_same_spec_arm_is_the_averaged_8_miner_arm_at_the_4_miner_beta1() -> None:
    outer_lr = load_bench("outer_lr")
    prefix = f"{outer_lr.PER_UPDATE_MOMENT}{outer_lr.SUBSET}{outer_lr.AVERAGE}"
    same = outer_lr.ARMS[prefix + outer_lr.SAME_SPEC]
    assert same.miners == 8 and same.beta1 == outer_lr.ARMS[f"{prefix}_4"].beta1 == 0.6561
    assert replace(same, beta1=outer_lr.ARMS[f"{prefix}_8"].beta1) == outer_lr.ARMS[f"{prefix}_8"]

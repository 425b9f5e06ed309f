"""The outer optimizer against hand-computed Nesterov updates, its determinism, and duplicate detection."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from training.outer import OuterConfig, cosine, near_duplicates, norm, outer_step

ROOT = Path(__file__).resolve().parents[2]
GLOBAL = {"a": torch.tensor([1.0, 2.0]), "b": torch.tensor([0.5])}
# Pseudo-gradients G_i = global - miner: G1 = (a [1, 0], b [0]) norm 1; G2 = (a [0, 2], b [0]) norm 2;
# G3 = (a [0, 0], b [4]) norm 4. The median norm is 2, so only G3 is clipped, to b [2].
MINERS = [
    {"a": torch.tensor([0.0, 2.0]), "b": torch.tensor([0.5])},
    {"a": torch.tensor([1.0, 0.0]), "b": torch.tensor([0.5])},
    {"a": torch.tensor([1.0, 2.0]), "b": torch.tensor([-3.5])},
]
DILOCO = OuterConfig(lr=0.7, momentum=0.9)
"""DiLoCo's outer step, where momentum shows in the arithmetic (the default, lr 1 without momentum, is a plain average)."""


def close(tensors: dict[str, torch.Tensor], expected: dict[str, list[float]]) -> None:
    assert sorted(tensors) == sorted(expected)
    for name, values in expected.items():
        assert tensors[name].dtype == torch.float32
        torch.testing.assert_close(tensors[name], torch.tensor(values), rtol=0, atol=1e-6)


def test_first_step_uniform_with_median_clipping() -> None:
    new, momentum = outer_step(GLOBAL, MINERS, [1.0, 1.0, 1.0], None, DILOCO)
    # G = (a [1/3, 2/3], b [2/3]); m = G; Φ' = Φ - 0.7 (G + 0.9 G) = Φ - 1.33 G.
    close(momentum, {"a": [1 / 3, 2 / 3], "b": [2 / 3]})
    close(new, {"a": [1 - 1.33 / 3, 2 - 2.66 / 3], "b": [0.5 - 2.66 / 3]})


def test_step_with_momentum_and_utility_weights() -> None:
    previous = {"a": torch.tensor([1.0, 1.0]), "b": torch.tensor([0.0])}
    new, momentum = outer_step(GLOBAL, MINERS, [1.0, 1.0, 2.0], previous, replace(DILOCO, weighting="utility"))
    # a = (.25, .25, .5): G = (a [0.25, 0.5], b [1.0]); m = 0.9 (1, 1, 0) + G = (a [1.15, 1.4], b [1.0]).
    close(momentum, {"a": [1.15, 1.4], "b": [1.0]})
    # Φ' = Φ - 0.7 (G + 0.9 m): a0 = 1 - 0.7 * 1.285, a1 = 2 - 0.7 * 1.76, b = 0.5 - 0.7 * 1.9.
    close(new, {"a": [0.1005, 0.768], "b": [-0.83]})


def test_no_clipping_keeps_large_updates() -> None:
    cfg = OuterConfig(lr=1.0, momentum=0.0, clip_to_median=False)
    new, _ = outer_step(GLOBAL, MINERS, [1.0, 1.0, 1.0], None, cfg)
    # G = (a [1/3, 2/3], b [4/3]); with μ = 0 and lr 1, Φ' = Φ - G.
    close(new, {"a": [2 / 3, 4 / 3], "b": [0.5 - 4 / 3]})


def test_coverage_averages_each_entry_over_the_miners_that_cover_it() -> None:
    cfg = OuterConfig(lr=1.0, momentum=0.0, clip_to_median=False)
    # Miner 1 covers a[0] and b, miner 2 covers a[1] and b, miner 3 covers only b: nobody covers a twice.
    masks = [
        {"a": torch.tensor([1.0, 0.0]), "b": torch.tensor([1.0])},
        {"a": torch.tensor([0.0, 1.0]), "b": torch.tensor([1.0])},
        {"a": torch.tensor([0.0, 0.0]), "b": torch.tensor([1.0])},
    ]
    new, _ = outer_step(GLOBAL, MINERS, [1.0, 1.0, 1.0], None, cfg, coverage=masks)
    # a[0] is miner 1's G alone (1), a[1] miner 2's alone (2); b averages all three: (0 + 0 + 4) / 3.
    close(new, {"a": [0.0, 0.0], "b": [0.5 - 4 / 3]})
    # An entry no miner covers does not move; utility weights apply among the covering miners.
    masks[1]["a"] = torch.tensor([0.0, 0.0])
    new, _ = outer_step(GLOBAL, MINERS, [1.0, 1.0, 2.0], None, replace(cfg, weighting="utility"), coverage=masks)
    close(new, {"a": [0.0, 2.0], "b": [0.5 - 2.0]})  # b: (0.25·0 + 0.25·0 + 0.5·4) / 1
    with pytest.raises(ValueError, match="2 coverage masks for 3 miners"):
        outer_step(GLOBAL, MINERS, [1.0, 1.0, 1.0], None, cfg, coverage=masks[:2])


def test_coverage_masks_weigh_contiguous_blocks() -> None:
    cfg = OuterConfig(lr=1.0, momentum=0.0, clip_to_median=False)
    start = {"w": torch.zeros(2, 2)}
    miners = [{"w": -torch.tensor([[1.0, 2.0], [3.0, 4.0]])}, {"w": -torch.tensor([[5.0, 6.0], [0.0, 0.0]])}]
    # Two blocks of the flattened tensor: [w00, w01] and [w10, w11]; miner 1 covers both, miner 2 the first.
    masks = [{"w": torch.tensor([1.0, 1.0])}, {"w": torch.tensor([1.0, 0.0])}]
    new, _ = outer_step(start, miners, [1.0, 1.0], None, cfg, coverage=masks)
    close(new, {"w": [[-3.0, -4.0], [-3.0, -4.0]]})  # first block: mean of both; second: miner 1 alone
    with pytest.raises(ValueError, match="coverage of w"):
        outer_step(start, miners, [1.0, 1.0], None, cfg, coverage=[{"w": torch.ones(3)}, {"w": torch.ones(3)}])


def test_even_count_clips_to_mean_of_middle_norms() -> None:
    cfg = OuterConfig(lr=1.0, momentum=0.0)
    new, _ = outer_step(GLOBAL, [MINERS[0], MINERS[2]], [1.0, 1.0], None, cfg)
    # Norms 1 and 4, median 2.5: G3 -> b [2.5]; G = (a [0.5, 0], b [1.25]).
    close(new, {"a": [0.5, 2.0], "b": [-0.75]})


def test_rejects_mismatched_inputs() -> None:
    with pytest.raises(ValueError, match="missing"):
        outer_step(GLOBAL, [{"a": torch.zeros(2)}], [1.0], None, OuterConfig())
    with pytest.raises(ValueError, match="utilities"):
        outer_step(GLOBAL, MINERS, [1.0], None, OuterConfig())
    with pytest.raises(ValueError, match="positive utility"):
        outer_step(GLOBAL, MINERS[:1], [0.0], None, OuterConfig(weighting="utility"))
    with pytest.raises(ValueError, match="momentum"):
        outer_step(GLOBAL, MINERS, [1.0] * 3, {"a": torch.zeros(3), "b": torch.zeros(1)}, OuterConfig())
    with pytest.raises(ValueError, match="momentum"):
        OuterConfig(momentum=1.0)


def _random_state(seed: int) -> tuple[dict[str, torch.Tensor], list[dict[str, torch.Tensor]]]:
    gen = torch.Generator().manual_seed(seed)
    shapes = {"layers.0.experts.1.gate_up_proj": (64, 32), "layers.0.experts.1.down_proj": (32, 32)}
    base = {n: torch.randn(s, generator=gen) for n, s in shapes.items()}
    miners = [
        {n: t + 0.01 * (i + 1) * torch.randn(t.shape, generator=gen) for n, t in base.items()}
        for i in range(4)
    ]
    return base, miners


def _digest(seed: int) -> str:
    base, miners = _random_state(seed)
    new, momentum = outer_step(base, miners, [0.3, 0.1, 0.2, 0.4], None, replace(DILOCO, weighting="utility"))
    digest = hashlib.sha256()
    for tensors in (new, momentum):
        for name in sorted(tensors):
            digest.update(name.encode() + tensors[name].numpy().tobytes())
    return digest.hexdigest()


@pytest.mark.slow
def test_byte_deterministic_across_runs_and_thread_counts() -> None:
    first = _digest(5)
    assert _digest(5) == first
    script = (
        "import sys, torch; torch.set_num_threads(1); sys.path[:0] = ['.', 'tests/training']\n"
        "from test_outer import _digest\n"
        "print(_digest(5))"
    )
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == first


def test_norm_and_cosine() -> None:
    g = {"a": torch.tensor([3.0, 0.0]), "b": torch.tensor([4.0])}
    assert norm(g) == 5.0
    assert cosine(g, g) == pytest.approx(1.0)
    assert cosine(g, {"a": torch.tensor([0.0, 1.0]), "b": torch.tensor([0.0])}) == 0.0
    assert cosine(g, {"a": torch.zeros(2), "b": torch.zeros(1)}) == 0.0


def test_near_duplicates_flags_both_members_of_a_pair() -> None:
    gen = torch.Generator().manual_seed(3)
    original = {"x": torch.randn(100, generator=gen)}
    copy = {"x": original["x"] * 1.5 + 1e-4 * torch.randn(100, generator=gen)}
    honest = {"x": torch.randn(100, generator=gen)}
    zero_1, zero_2 = {"x": torch.zeros(100)}, {"x": torch.zeros(100)}
    grads = {"m1": original, "m2": honest, "m3": copy, "lazy1": zero_1, "lazy2": zero_2}
    assert near_duplicates(grads, 0.99) == {"m1", "m3"}
    assert near_duplicates({"m1": original, "m2": honest}, 0.99) == set()
    assert near_duplicates({"m1": original, "m2": {"x": -original["x"]}}, 0.99) == set()


def test_near_duplicates_of_partitioned_updates_compare_the_blocks_both_cover() -> None:
    gen = torch.Generator().manual_seed(4)
    update = torch.randn(4, 25, generator=gen)

    def sent(blocks: list[int], values: torch.Tensor) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        mask = torch.zeros(4)
        mask[blocks] = 1.0
        return {"x": (values * mask[:, None]).reshape(-1)}, {"x": mask}

    one, one_cover = sent([0, 1], update)  # one run's update, sent by two identities on their own draws
    two, two_cover = sent([1, 2], update * (1 + 1e-6))
    honest, honest_cover = sent([1, 3], torch.randn(4, 25, generator=gen))
    apart, apart_cover = sent([2, 3], update)  # shares no block with `one`
    grads = {"one": one, "two": two, "honest": honest}
    covers = {"one": one_cover, "two": two_cover, "honest": honest_cover}
    assert cosine(one, two) < 0.6  # over whole tensors the pair agrees only on the shared block
    assert near_duplicates(grads, 0.9999) == set()
    assert near_duplicates(grads, 0.9999, covers) == {"one", "two"}
    assert near_duplicates({"one": one, "apart": apart}, 0.5, {"one": one_cover, "apart": apart_cover}) == set()
    with pytest.raises(ValueError, match="exactly the miners"):
        near_duplicates(grads, 0.9999, {"one": one_cover})
    with pytest.raises(ValueError, match="do not divide"):
        near_duplicates(grads, 0.9999, {**covers, "honest": {"x": torch.ones(3)}})


def test_config_and_inputs_refused_at_their_boundaries() -> None:
    for lr in (0.0, -0.5):
        with pytest.raises(ValueError, match="outer lr must be positive"):
            OuterConfig(lr=lr)
    with pytest.raises(ValueError, match="at least one miner"):
        outer_step(GLOBAL, [], [], None, OuterConfig(clip_to_median=False))
    for bad in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="finite and non-negative"):
            outer_step(GLOBAL, MINERS, [1.0, bad, 1.0], None, OuterConfig())
    for threshold in (0.0, 1.0 + 1e-9):
        with pytest.raises(ValueError, match="duplicate threshold"):
            near_duplicates({"m1": GLOBAL, "m2": GLOBAL}, threshold)


def test_coverage_masks_must_be_non_empty_vectors() -> None:
    cfg = OuterConfig(lr=1.0, momentum=0.0, clip_to_median=False)
    start, miners = {"w": torch.zeros(4)}, [{"w": -torch.ones(4)}, {"w": -torch.ones(4)}]
    for masks in ([{"w": torch.ones(0)}] * 2, [{"w": torch.ones(1, 2)}, {"w": torch.ones(2)}]):
        with pytest.raises(ValueError, match="coverage of w"):
            outer_step(start, miners, [1.0, 1.0], None, cfg, coverage=masks)
    grads = {"m1": {"w": torch.ones(4)}, "m2": {"w": torch.ones(4)}}
    with pytest.raises(ValueError, match="must be a vector of 2 block weights"):
        near_duplicates(grads, 0.9, {"m1": {"w": torch.ones(1, 2)}, "m2": {"w": torch.ones(2)}})


def test_a_median_of_zero_clips_every_update_to_nothing() -> None:
    # Two of three miners sent the global tensors back unchanged: the median norm is 0, so the one
    # real update is scaled to 0 and the unchanged ones (norm 0 <= median 0) keep scale 1 without a 0/0.
    new, momentum = outer_step(GLOBAL, [GLOBAL, GLOBAL, MINERS[0]], [1.0, 1.0, 1.0], None, DILOCO)
    close(new, {"a": [1.0, 2.0], "b": [0.5]})
    close(momentum, {"a": [0.0, 0.0], "b": [0.0]})


def test_results_and_reductions_follow_sorted_names_not_insertion_order() -> None:
    # Dot products 1 (name "a") and 2^-53 four times: summed from "a" each tiny term rounds away,
    # summed tiny-first they add up to 2^-51 and survive, so only sorted-name order gives exactly 1.
    tiny = torch.full((2,), 2.0**-27)
    forward = {"a": torch.tensor([1.0]), **{n: tiny for n in "bcde"}}
    backward = dict(reversed(forward.items()))
    assert norm(forward) == norm(backward) == 1.0
    assert cosine(backward, backward) == 1.0
    new, momentum = outer_step(backward, [forward], [1.0], None, OuterConfig())
    assert list(new) == list(momentum) == ["a", "b", "c", "d", "e"]


def test_near_duplicates_at_threshold_one_and_with_a_zero_update_first() -> None:
    g = {"x": torch.tensor([3.0, 4.0])}
    parallel = {"x": torch.tensor([6.0, 8.0])}  # cosine exactly 1.0: 50 / (5 · 10)
    assert near_duplicates({"m1": g, "m2": parallel}, 1.0) == {"m1", "m2"}
    lazy = {"x": torch.zeros(2)}
    assert near_duplicates({"lazy": lazy, "m1": g, "m2": parallel}, 0.99) == {"m1", "m2"}


def test_names_must_match_across_momentum_and_compared_miners() -> None:
    extra = {"a": torch.zeros(2), "b": torch.zeros(1), "c": torch.zeros(1)}
    with pytest.raises(ValueError, match="momentum tensors do not match"):
        outer_step(GLOBAL, MINERS, [1.0] * 3, extra, OuterConfig())
    g = {"a": torch.tensor([1.0, 0.0]), "b": torch.tensor([1.0])}
    with pytest.raises(ValueError, match="compared tensors do not match"):
        near_duplicates({"m1": {"a": g["a"]}, "m2": g}, 0.9)


def test_near_duplicates_sum_in_sorted_name_order() -> None:
    # As in the reductions test: summed from "a" the tiny squares round away and the cosine is exactly 1;
    # in any other order the first miner's norm keeps them and the cosine falls just below 1.
    tiny = torch.full((2,), 2.0**-27)
    forward = {"a": torch.tensor([1.0]), **{n: tiny for n in "bcde"}}
    plain = {"a": torch.tensor([1.0]), **{n: torch.zeros(2) for n in "bcde"}}
    for first in (forward, dict(reversed(forward.items()))):
        assert near_duplicates({"m1": first, "m2": plain}, 1.0) == {"m1", "m2"}

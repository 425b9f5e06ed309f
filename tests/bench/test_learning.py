"""bench/learning.py at its small size: networks of 1 and 4 miners (and of 2, one of them adversarial) run 2 rounds through the product's round and merge gate on miners' own files, with ESFT and the data-parallel ceiling
at two learning rates beside them, and every comparison read off the same sequences."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tests.bench.scripts import run_bench
from validator.merge import CANDIDATES

pytestmark = pytest.mark.slow

RUN_KEYS = {"domain", "seed", "miners", "inner_steps", "adversaries", "base_loss", "adopted_losses",
            "best_single_losses", "gates"}
BASELINE_KEYS = {"domain", "seed", "miners", "dp_lr", "dp_lr_losses", "dp_ceiling_loss", "esft_loss"}
COMPARISON_KEYS = {"domain", "seed", "what", "round", "miners", "esft_at", "mean", "ci_low", "ci_high"}
ROUNDING = 2e-5  # losses and means are written to 1e-5 nats


def test_the_small_learning_benchmark_compares_networks_and_references_on_the_same_sequences(tmp_path: Path) -> None:
    report = run_bench("learning", tmp_path / "learning.json", "--small", "--set", "aggregation.top_g=1",
                       "--cache", str(tmp_path / "cache"))
    assert set(report) == {"seconds", "spec_overrides", "runs", "baselines", "comparisons"}
    assert report["spec_overrides"] == {"training.inner_steps": 2, "data.heldout_sequences": 16,
                                        "data.gate_sequences": 16, "aggregation.top_g": 1}  # the size's, then --set
    assert math.isfinite(report["seconds"])
    runs = {(r["miners"], r["adversaries"]): r for r in report["runs"]}
    assert set(runs) == {(1, 0), (4, 0), (2, 1)} and all(set(r) == RUN_KEYS for r in runs.values())
    base = runs[1, 0]["base_loss"]
    for run in runs.values():
        assert (run["domain"], run["seed"], run["inner_steps"], run["base_loss"]) == ("lexicon", 0, 2, base)
        adopted, best, gates = run["adopted_losses"], run["best_single_losses"], run["gates"]
        assert len(adopted) == len(best) == len(gates) == 2
        for before, after, gate in zip([base, *adopted], adopted, gates, strict=False):
            assert gate["adopted"] in CANDIDATES and gate["merged"] <= 1  # --set reached the spec: top-G 1
            assert gate["general_losses"] is not None  # the spec pins a general-domain file: forgetting is checked
            assert (after != before) == (gate["adopted"] != "current")  # the state moves where the gate adopted
            held = "current"
            for name, gain in gate["gains"].items():  # in the order of preference: a later one held on evidence
                assert gain["against"] == held
                held = name if gain["low"] > 1e-4 else held
            assert held == gate["adopted"]
    assert runs[1, 0]["adopted_losses"][-1] < base  # one honest miner learns the domain

    baselines = {b["miners"]: b for b in report["baselines"]}
    assert set(baselines) == {1, 4} and all(set(b) == BASELINE_KEYS for b in baselines.values())
    for b in baselines.values():
        assert set(b["dp_lr_losses"]) == {"0.001", "0.002"}  # 1 and 2 times the miners' lr
        assert b["dp_lr_losses"][str(b["dp_lr"])] == min(b["dp_lr_losses"].values())  # kept by the held-out file
        assert b["dp_ceiling_loss"] < base and b["esft_loss"] < base

    compared = {(c["what"], c["seed"], c["round"], c["miners"], c["esft_at"]): c for c in report["comparisons"]}
    assert all(set(c) == COMPARISON_KEYS and c["ci_low"] <= c["mean"] <= c["ci_high"] for c in report["comparisons"])
    assert {c["seed"] for c in report["comparisons"]} == {0}  # one seed: nothing to pool
    for r in (0, 1):
        gain = compared["network 1->4", 0, r, None, None]["mean"]
        assert gain == pytest.approx(runs[1, 0]["adopted_losses"][r] - runs[4, 0]["adopted_losses"][r], abs=ROUNDING)
        for m in (1, 4):
            single = compared["adopted - best_single", 0, r, m, None]["mean"]
            assert single == pytest.approx(runs[m, 0]["adopted_losses"][r] - runs[m, 0]["best_single_losses"][r],
                                           abs=ROUNDING)
            for at in ("equal tokens", "matched loss"):
                assert ("forgetting - esft_forgetting", 0, r, m, at) in compared
    ceiling = compared["ceiling 1->4", 0, 1, None, None]["mean"]
    assert ceiling == pytest.approx(baselines[1]["dp_ceiling_loss"] - baselines[4]["dp_ceiling_loss"], abs=ROUNDING)
    behind = compared["adopted - ceiling", 0, 1, 4, None]["mean"]
    assert behind == pytest.approx(runs[4, 0]["adopted_losses"][1] - baselines[4]["dp_ceiling_loss"], abs=ROUNDING)
    assert not any(c["what"].endswith("4->8") for c in report["comparisons"])  # no network of 8 miners ran

"""bench/learning.py at its small size: an honest and a half-adversarial network of 2 miners run 2 rounds through
the product's round and merge gate, with ESFT and the data-parallel ceiling beside them."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tests.bench.scripts import run_bench
from validator.merge import CANDIDATES

pytestmark = pytest.mark.slow


def test_the_small_learning_benchmark_records_every_rounds_adopted_loss_and_gate(tmp_path: Path) -> None:
    report = run_bench("learning", tmp_path / "learning.json", "--small", "--set", "aggregation.top_g=1",
                       "--cache", str(tmp_path / "cache"))
    assert report["spec_overrides"] == {"aggregation.top_g": 1}
    assert math.isfinite(report["seconds"]) and report["rounds"] == 2
    key = {"domain": "arithmetic", "seed": 0, "inner_steps": 2, "miners": 2}
    honest, adversarial = report["runs"]
    [baseline] = report["baselines"]
    assert {k: baseline[k] for k in key} == key
    assert all({k: network[k] for k in key} == key for network in (honest, adversarial))
    assert (honest["adversaries"], adversarial["adversaries"]) == (0, 1)
    base = honest["base_loss"]
    assert all(math.isfinite(baseline[k]) for k in ("esft_loss", "dp_ceiling_loss", "esft_forgetting"))
    assert baseline["esft_loss"] < base and baseline["dp_ceiling_loss"] < base  # the domain is new to the base
    for network in (honest, adversarial):
        adopted, best, gates = network["adopted_losses"], network["best_single_losses"], network["gates"]
        assert network["base_loss"] == base and len(adopted) == len(best) == len(gates) == 2
        assert all(math.isfinite(loss) for loss in [*adopted, *best, network["noise"], network["forgetting"]])
        assert 0 < network["noise"] < 1
        for before, after, gate in zip([base, *adopted], adopted, gates, strict=False):
            assert gate["adopted"] in CANDIDATES and gate["merged"] in (0, 1)  # --set reached the spec: top-G 1
            allowed = [name for name in gate["losses"] if name not in gate["refused"]]
            assert gate["losses"][gate["adopted"]] == min(gate["losses"][name] for name in allowed)
            assert gate["general_losses"] is not None  # the spec pins a general-domain file: forgetting is checked
            # the adopted state moves exactly in the rounds whose gate adopted a change
            assert (after != before) == (gate["adopted"] != "current")
        assert adopted[-1] < base
    summary = {(entry["adversaries"]): entry for entry in report["summary"]}
    assert set(summary) == {0, 1}
    for network in (honest, adversarial):
        entry = summary[network["adversaries"]]
        assert entry["band"] == round(2 * network["noise"], 4) and entry["fell"]
        rose = [r for r, (a, b) in enumerate(zip([base, *network["adopted_losses"]], network["adopted_losses"],
                                                 strict=False)) if b - a > entry["band"]]
        assert entry["rose_in"] == rose
        share = (base - network["adopted_losses"][-1]) / (base - baseline["dp_ceiling_loss"])
        assert entry["dp_share"] == round(share, 4)
        assert entry["forgetting_vs_esft"] == round(network["forgetting"] - baseline["esft_forgetting"], 4)

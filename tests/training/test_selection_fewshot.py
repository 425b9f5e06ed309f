"""Few-example and layerwise selection, provenance and the stability report, on planted tiny models."""

from __future__ import annotations

import pytest
import torch

from tests.training.planted import A, B, C, P, U, X, Y, documents, planted_chain, planted_domains, rows
from training.selection import data_sha256, pooled_stats, select_experts
from training.stability import jaccard, stability_report


@pytest.fixture(scope="module")
def domains() -> tuple[torch.nn.Module, object]:
    return planted_domains()


@pytest.mark.parametrize("n", [1, 5])
@pytest.mark.parametrize("rule", ["gate-mass", "token-freq"])
def test_few_documents_recover_the_planted_experts(domains: tuple, n: int, rule: str) -> None:
    model, adapter = domains
    arithmetic = select_experts(model, adapter, documents("arithmetic", n), rule, top_d=2)
    assert all(ids == sorted([U, A]) for ids in arithmetic["group"].values())
    assert arithmetic["pooling"] == "documents" and arithmetic["documents"] == n
    prose = select_experts(model, adapter, documents("prose", n, seed=3), rule, top_d=2)
    assert all(ids == sorted([U, B]) for ids in prose["group"].values())


def test_documents_count_once_however_long(domains: tuple) -> None:
    """Pooled per document, a long prose document cannot outvote a short arithmetic one."""
    model, adapter = domains
    short = documents("arithmetic", 1)[0][:1, :16]
    long = torch.cat(documents("prose", 6, seed=5))[:, :16]
    assert long.shape[0] > 4
    per_doc = pooled_stats(model, adapter, [short, long])
    a = pooled_stats(model, adapter, [short])
    b = pooled_stats(model, adapter, [long])
    for layer in adapter.moe_layers(model):
        assert torch.allclose(per_doc.gate_mass[layer], (a.gate_mass[layer] + b.gate_mass[layer]) / 2)
    by_token = pooled_stats(model, adapter, torch.cat([short, long]))
    assert by_token.tokens == per_doc.tokens
    assert float(by_token.gate_mass[0][A]) < float(per_doc.gate_mass[0][A]) - 0.1


def test_layerwise_agrees_with_global_when_layers_are_independent(domains: tuple) -> None:
    model, adapter = domains
    docs = documents("arithmetic", 5)
    layerwise = select_experts(model, adapter, docs, "gate-mass", top_d=2, mode="layerwise")
    global_ = select_experts(model, adapter, docs, "gate-mass", top_d=2, mode="global")
    assert layerwise["group"] == global_["group"] == {"0": sorted([U, A]), "1": sorted([U, A])}
    chain, chain_adapter = planted_chain(dependency=False)
    prose = documents("prose", 3)
    for mode in ("global", "layerwise"):
        assert select_experts(chain, chain_adapter, prose, "gate-mass", top_d=1, mode=mode)["group"] == {
            "0": [P], "1": [Y]}


def test_layerwise_sees_the_pruned_earlier_layers() -> None:
    """Layer 1 routes to X only because layer 0's expert C writes M; pruning layer 0 to P removes that."""
    model, adapter = planted_chain(dependency=True)
    prose = documents("prose", 3)
    global_ = select_experts(model, adapter, prose, "gate-mass", top_d=1, mode="global")
    layerwise = select_experts(model, adapter, prose, "gate-mass", top_d=1, mode="layerwise")
    assert global_["group"] == {"0": [P], "1": [X]}
    assert layerwise["group"] == {"0": [P], "1": [Y]}
    assert global_["stats"]["0"] == layerwise["stats"]["0"]
    assert max(layerwise["stats"]["1"]) == layerwise["stats"]["1"][Y]
    both = select_experts(model, adapter, prose, "gate-mass", top_d=2, mode="layerwise")
    assert both["group"]["0"] == sorted([P, C]) and X in both["group"]["1"]


def test_selection_records_what_it_measured(domains: tuple) -> None:
    model, adapter = domains
    docs, general = documents("arithmetic", 2), documents("prose", 2)
    out = select_experts(model, adapter, docs, "differential", mass=0.8, general=general, mode="layerwise")
    assert out["rule"] == "differential" and out["budget"] == {"mass": 0.8} and out["mode"] == "layerwise"
    assert out["data_sha256"] == data_sha256(docs) != data_sha256(docs[:1])
    assert out["general_sha256"] == data_sha256(general)
    assert out["tokens"] == sum(int((d != 256).sum()) for d in docs)
    assert sorted(out["stats"]) == ["0", "1"] and all(len(v) == 8 for v in out["stats"].values())
    packed = select_experts(model, adapter, rows("arithmetic", 4), "gate-mass", top_d=2)
    assert packed["pooling"] == "tokens" and packed["documents"] is None
    with pytest.raises(ValueError, match="unknown selection mode 'greedy'"):
        select_experts(model, adapter, docs, "gate-mass", top_d=2, mode="greedy")
    with pytest.raises(ValueError, match="no documents"):
        select_experts(model, adapter, [], "gate-mass", top_d=2)
    with pytest.raises(ValueError, match="exactly one budget"):
        select_experts(model, adapter, docs, "gate-mass")


def test_jaccard() -> None:
    assert jaccard({"0": [1, 2]}, {"0": [1, 2]}) == 1.0
    assert jaccard({"0": [1, 2]}, {"1": [1, 2]}) == 0.0
    assert jaccard({"0": [1, 2], "1": [3]}, {"0": [2, 4], "1": [3]}) == pytest.approx(2 / 4)


def test_stability_report_on_a_mixed_domain(domains: tuple) -> None:
    """Arithmetic and prose interleaved: one document picks one domain's group, many converge."""
    model, adapter = domains
    mixed = [d for pair in zip(documents("arithmetic", 6), documents("prose", 6, seed=4), strict=True) for d in pair]
    report = stability_report(model, adapter, mixed, "gate-mass", top_d=2, counts=(1, 5, 100), seeds=(0, 1, 2, 3))
    assert report["skipped"] == [100] and sorted(report["counts"]) == ["1", "5"]
    assert report["documents"] == 12 and len(report["counts"]["1"]["groups"]) == 4
    one = report["counts"]["1"]
    assert all(g in ({"0": [A, U], "1": [A, U]}, {"0": [U, B], "1": [U, B]}) for g in one["groups"])
    assert one["pairwise_jaccard"] < 1.0
    assert report["counts"]["5"]["reference_jaccard"] >= one["reference_jaccard"]

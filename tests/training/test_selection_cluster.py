"""Domain clustering on a planted model: two domains routed to different experts come apart."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from tests.training.planted import documents, planted_domains
from training.clustering import cluster, cluster_report, sequence_features


def purity(labels: list[int], truth: list[str]) -> float:
    """Share of documents whose cluster's majority domain is their own."""
    majority = 0
    for label in set(labels):
        majority += Counter(t for t, lab in zip(truth, labels, strict=True) if lab == label).most_common(1)[0][1]
    return majority / len(labels)


def test_two_planted_domains_separate() -> None:
    model, adapter = planted_domains()
    docs = documents("arithmetic", 10) + documents("prose", 10, seed=3)
    truth = ["arithmetic"] * 10 + ["prose"] * 10
    features = sequence_features(model, adapter, docs)
    assert features.shape == (20, 2 * 8 + 64)
    assert np.allclose(features[:, :8].sum(axis=1), 1.0, atol=1e-5)
    found = cluster(features, max_k=5)
    assert found.k == 2 and sorted(found.silhouettes) == [2, 3, 4, 5]
    assert purity(found.labels, truth) >= 0.9
    assert cluster(features, max_k=5).labels == found.labels
    report = cluster_report(found, docs)
    assert sorted(c["documents"] for c in report["clusters"]) == [10, 10]
    arithmetic = report["clusters"][found.labels[0]]
    assert {token for token, _ in arithmetic["top_tokens"][:5]} <= {ord(c) for c in "0123456789+-*()=\n"} | {258}
    three = cluster(features, k=3)
    assert three.k == 3 and len(set(three.labels)) == 3 and list(three.silhouettes) == [3]


def test_bad_cluster_requests_are_refused() -> None:
    features = np.random.default_rng(0).normal(size=(4, 6))
    with pytest.raises(ValueError, match=r"k must be between 1 and the number of documents \(4\), got 5"):
        cluster(features, k=5)
    with pytest.raises(ValueError, match="choosing k needs at least 3 documents"):
        cluster(features[:2])
    model, adapter = planted_domains()
    with pytest.raises(ValueError, match="no documents to cluster"):
        sequence_features(model, adapter, [])


def test_documents_the_model_reads_alike_are_refused_in_one_line() -> None:
    alike = np.ones((4, 6))
    with pytest.warns(Warning):  # scikit-learn says so too (zero variance, fewer distinct points than clusters)
        with pytest.raises(ValueError, match="the base model reads all 4 documents alike, so they cannot be split"):
            cluster(alike)

"""Domain clustering: split a domain's documents into groups the base model itself tells apart (MoCE).

Each document becomes one feature vector taken from the base model: its mean routing distribution in
every MoE layer (concatenated) and its mean final hidden state, both over its non-padding tokens.
Features are standardised, reduced with PCA and clustered with k-means (scikit-learn); unless k is
given, it is the k in 2..max_k with the best silhouette score (ties to the smaller k); documents the
model reads alike (no k splits them) are refused. Everything is
seeded, so the same documents give the same clusters. This module knows nothing about files; it
reads token tensors and returns labels and a report.

Legend: T tokens, E experts, H hidden size, D documents, F features.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch

from training.data import not_padding
from training.selection import router_probs

if TYPE_CHECKING:
    from transformers import PretrainedConfig

MAX_K = 8
COMPONENTS = 8


@dataclass(frozen=True)
class Clustering:
    """Cluster labels (one per document, 0..k-1) and how k was chosen."""

    labels: list[int]
    k: int
    silhouettes: dict[int, float]
    """Silhouette score of every k tried whose k-means found two or more clusters (none for k 1 or D)."""
    components: int
    """PCA components the clustering ran on."""


@torch.no_grad()
def sequence_features(
    model: torch.nn.Module, adapter: Any, documents: Sequence[torch.Tensor], pad_id: int = 256, batch_size: int = 8
) -> np.ndarray:
    """[D, F] features: each document's mean routing distribution per MoE layer, then its mean final hidden state."""
    if not documents:
        raise ValueError("no documents to cluster")
    rows_NS = torch.cat(list(documents))
    doc_N = torch.cat([torch.full((doc.shape[0],), i, dtype=torch.long) for i, doc in enumerate(documents)])
    layers = adapter.moe_layers(model)
    sigmoid = adapter.routing == "sigmoid"
    sums = {layer: torch.zeros(len(documents), adapter.num_experts(model), dtype=torch.float64) for layer in layers}
    hidden_size = int(cast("PretrainedConfig", model.config).hidden_size)
    hidden_DH = torch.zeros(len(documents), hidden_size, dtype=torch.float64)
    tokens_D = torch.zeros(len(documents), dtype=torch.float64)
    batch: dict[str, torch.Tensor] = {}

    def hook(layer: int) -> Callable[[torch.nn.Module, object, tuple[torch.Tensor, ...]], None]:
        def record(module: torch.nn.Module, args: object, output: tuple[torch.Tensor, ...]) -> None:
            probs_TE = router_probs(output[0][batch["keep_T"]], sigmoid).double().cpu()
            sums[layer].index_add_(0, batch["doc_T"], probs_TE)

        return record

    handles = [adapter.router(model, layer).register_forward_hook(hook(layer)) for layer in layers]
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    try:
        for start in range(0, rows_NS.shape[0], batch_size):
            ids_BS = rows_NS[start : start + batch_size]
            mask_BS = not_padding(ids_BS, pad_id)
            batch["doc_T"] = doc_N[start : start + batch_size, None].expand(ids_BS.shape).reshape(-1)[mask_BS.reshape(-1)]
            batch["keep_T"] = mask_BS.reshape(-1).to(device)
            out = model(input_ids=ids_BS.to(device), attention_mask=mask_BS.long().to(device), output_hidden_states=True)
            last_TH = out.hidden_states[-1].reshape(batch["keep_T"].numel(), -1)[batch["keep_T"]]
            hidden_DH.index_add_(0, batch["doc_T"], last_TH.double().cpu())
            tokens_D.index_add_(0, batch["doc_T"], torch.ones(batch["doc_T"].numel(), dtype=torch.float64))
    finally:
        for handle in handles:
            handle.remove()
        model.train(was_training)
    if bool((tokens_D == 0).any()):
        raise ValueError("a document holds only padding tokens")
    blocks = [sums[layer] / tokens_D[:, None] for layer in layers] + [hidden_DH / tokens_D[:, None]]
    return torch.cat(blocks, dim=1).numpy()


def cluster(features: np.ndarray, k: int | None = None, max_k: int = MAX_K, seed: int = 0,
            components: int = COMPONENTS) -> Clustering:
    """Standardise, reduce with PCA and run k-means; k by best silhouette over 2..max_k unless given."""
    n = features.shape[0]
    if k is not None and not 1 <= k <= n:
        raise ValueError(f"k must be between 1 and the number of documents ({n}), got {k}")
    if k is None and min(max_k, n - 1) < 2:
        raise ValueError(f"choosing k needs at least 3 documents and max_k >= 2 (have {n} documents); give k")
    # scikit-learn takes 2-3 s to import: paid by the commands that cluster, not by every importer of this module
    from sklearn.cluster import KMeans
    from sklearn.decomposition import PCA
    from sklearn.metrics import silhouette_score
    from sklearn.preprocessing import StandardScaler

    reduced = StandardScaler().fit_transform(features)
    pca = PCA(n_components=min(components, n, features.shape[1]), random_state=seed)
    reduced = pca.fit_transform(reduced)
    tried = [k] if k is not None else list(range(2, min(max_k, n - 1) + 1))
    labels: dict[int, np.ndarray] = {}
    silhouettes: dict[int, float] = {}
    for candidate in tried:
        labels[candidate] = KMeans(n_clusters=candidate, n_init=10, random_state=seed).fit_predict(reduced)
        if 2 <= candidate < n and len(set(labels[candidate].tolist())) >= 2:
            silhouettes[candidate] = float(silhouette_score(reduced, labels[candidate]))
    if k is None and not silhouettes:
        raise ValueError(f"the base model reads all {n} documents alike, so they cannot be split; give k "
                         "to split them anyway")
    best = k if k is not None else max(silhouettes, key=lambda c: (silhouettes[c], -c))
    return Clustering([int(v) for v in labels[best]], best, silhouettes, int(pca.n_components_))


def cluster_report(clustering: Clustering, documents: Sequence[torch.Tensor], pad_id: int = 256,
                   top: int = 10) -> dict[str, Any]:
    """Sizes and most frequent tokens of each cluster, with the silhouette of every k tried."""
    clusters = []
    for label in range(clustering.k):
        members = [doc for doc, lab in zip(documents, clustering.labels, strict=True) if lab == label]
        counts: Counter[int] = Counter()
        for doc in members:
            counts.update(int(t) for t in doc[not_padding(doc, pad_id)].tolist())
        clusters.append({"cluster": label, "documents": len(members), "top_tokens": counts.most_common(top)})
    return {
        "k": clustering.k,
        "silhouettes": {str(k): round(v, 6) for k, v in clustering.silhouettes.items()},
        "components": clustering.components,
        "clusters": clusters,
    }

"""Selection stability: how much the chosen group changes with which, and how many, examples are seen.

For each example count n (default 1, 5, 10, 100) and each seed, n documents are drawn without
replacement (a seeded permutation) and a group is selected from them alone; the report gives the
mean pairwise Jaccard overlap of the groups across seeds and their mean overlap with the group
chosen from every document. Overlap is over (layer, expert) pairs, so a group is one set across
layers. Counts above the number of documents are listed as skipped, not silently shrunk. This
module knows nothing about files; selection itself is `training.selection`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from itertools import combinations
from typing import Any

import torch

from training.selection import Domain, select_experts

COUNTS = (1, 5, 10, 100)
SEEDS = (0, 1, 2)
Group = Mapping[str, Sequence[int]]


def jaccard(a: Group, b: Group) -> float:
    """|A ∩ B| / |A ∪ B| over (layer, expert) pairs; 1.0 for two empty groups."""
    pairs_a = {(layer, e) for layer, ids in a.items() for e in ids}
    pairs_b = {(layer, e) for layer, ids in b.items() for e in ids}
    union = pairs_a | pairs_b
    return len(pairs_a & pairs_b) / len(union) if union else 1.0


def stability_report(
    model: torch.nn.Module,
    adapter: Any,
    documents: Sequence[torch.Tensor],
    rule: str,
    top_d: int | None = None,
    mass: float | None = None,
    general: Domain | None = None,
    mode: str = "global",
    counts: Sequence[int] = COUNTS,
    seeds: Sequence[int] = SEEDS,
    pad_id: int = 256,
) -> dict[str, Any]:
    """The JSON-able stability report of a rule and budget on `documents` (see the module docstring)."""
    if not documents:
        raise ValueError("no documents to measure stability on")
    if not seeds or any(n < 1 for n in counts):
        raise ValueError("stability needs at least one seed and positive example counts")

    def select(docs: Sequence[torch.Tensor]) -> dict[str, list[int]]:
        group: dict[str, list[int]] = select_experts(model, adapter, docs, rule, top_d=top_d, mass=mass,
                                                     general=general, pad_id=pad_id, mode=mode)["group"]
        return group

    reference = select(documents)
    report: dict[str, Any] = {
        "rule": rule,
        "budget": {"top_d": top_d} if top_d is not None else {"mass": mass},
        "mode": mode,
        "documents": len(documents),
        "seeds": list(seeds),
        "reference": reference,
        "counts": {},
        "skipped": [n for n in counts if n > len(documents)],
    }
    for n in (n for n in counts if n <= len(documents)):
        groups = [select([documents[i] for i in _draw(len(documents), n, seed)]) for seed in seeds]
        pairs = list(combinations(groups, 2))
        report["counts"][str(n)] = {
            "pairwise_jaccard": sum(jaccard(a, b) for a, b in pairs) / len(pairs) if pairs else 1.0,
            "reference_jaccard": sum(jaccard(g, reference) for g in groups) / len(groups),
            "groups": groups,
        }
    return report


def _draw(total: int, n: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return sorted(torch.randperm(total, generator=generator)[:n].tolist())

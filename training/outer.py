"""The outer optimizer (DESIGN §7): merge miners' expert updates with Nesterov SGD, byte-deterministically.

Given the global expert tensors Φ_t and miners' tensors Φ_i:
    G_i = Φ_t − Φ_i (fp32);  n_i = ‖G_i‖ over all its tensors;
    with clip_to_median, G_i ← G_i · min(1, median(n) / n_i);
    a_i = 1/n (uniform) or u_i / Σu (utility);  G = Σ_i a_i G_i, summed in the given miner order;
    m ← μ·m + G;  Φ_{t+1} = Φ_t − lr·(G + μ·m).
With `coverage` (partitioned compressed submissions, training.pgrad), each miner's G_i speaks only
for the entries its mask c_i covers, and each entry averages over the miners that cover it:
    G = Σ_i a_i c_i G_i / Σ_i a_i c_i  (0 where no miner covers the entry).
A mask holds one 0/1 weight per block: B equal, contiguous blocks of the flattened tensor.
Determinism: everything runs on the CPU in fp32 with one rounded operation at a time (no fused
multiply-add); the only reductions, norms and dot products, square or multiply fp32 values exactly
in float64 and sum them with numpy's fixed pairwise order, tensor by tensor in sorted-name order,
so thread count and SIMD width cannot change a bit. The same inputs give the same bytes.

Near-duplicates: every pair of pseudo-gradients with cosine >= threshold flags BOTH miners, since
neither can prove it did not copy the other. The cosine with a zero vector is defined as 0, so
lazy (unchanged) submissions are never flagged as each other's copies here. With coverage, a pair's
cosine is taken over the blocks both miners cover: two identities sending one run's update, each
on its own drawn chunks, agree exactly where their draws overlap and nowhere else, so their cosine
over whole tensors is only about the overlap's share.
This module knows nothing about ranking, rewards or where tensors come from.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from itertools import combinations
from typing import Literal, TypeVar

import numpy as np
import torch

from training.experts import PseudoGradient, Tensors, check_same_names

Miner = TypeVar("Miner", bound=Hashable)


@dataclass(frozen=True)
class OuterConfig:
    """Outer Nesterov SGD over merged pseudo-gradients."""

    lr: float = 1.0
    """Outer learning rate: 1 with no momentum takes the plain average (a network's is the spec's
    `aggregation.outer_lr`, through `validator.merge.outer_config`)."""
    momentum: float = 0.0
    """Nesterov momentum μ."""
    clip_to_median: bool = True
    """Scale each pseudo-gradient down to the median norm of the set."""
    weighting: Literal["uniform", "utility"] = "uniform"
    """Merge weights: equal, or proportional to each miner's utility."""

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise ValueError(f"outer lr must be positive, got {self.lr}")
        if not 0 <= self.momentum < 1:
            raise ValueError(f"outer momentum must be in [0, 1), got {self.momentum}")
        if self.weighting not in ("uniform", "utility"):
            raise ValueError(f"weighting must be 'uniform' or 'utility', got {self.weighting!r}")


def outer_step(
    global_tensors: Tensors,
    miner_tensors: Sequence[Tensors],
    utilities: Sequence[float],
    momentum: Tensors | None,
    cfg: OuterConfig,
    coverage: Sequence[Tensors] | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """One outer step; returns (new global tensors, new momentum), both fp32 CPU, sorted by name.

    `coverage`: per miner and tensor, a 0/1 weight per block of the entries its submission speaks for
    (a vector of B entries; B equal contiguous blocks of the flattened tensor; module docstring).
    """
    if not miner_tensors:
        raise ValueError("an outer step needs at least one miner's tensors")
    if len(utilities) != len(miner_tensors):
        raise ValueError(f"{len(utilities)} utilities for {len(miner_tensors)} miners")
    if coverage is not None and len(coverage) != len(miner_tensors):
        raise ValueError(f"{len(coverage)} coverage masks for {len(miner_tensors)} miners")
    grads = [PseudoGradient(global_tensors, tensors) for tensors in miner_tensors]  # computed name by name
    scales = _clip_scales(grads) if cfg.clip_to_median else [1.0] * len(grads)
    weights = _weights(utilities, cfg)
    coefficients = [a * s for a, s in zip(weights, scales, strict=True)]
    names = sorted(global_tensors)
    if momentum is not None:
        check_same_names(global_tensors, momentum, "momentum")
    new_global: dict[str, torch.Tensor] = {}
    new_momentum: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name in names:
            phi = global_tensors[name].detach().to("cpu", torch.float32)
            g = torch.zeros_like(phi)
            for grad, coefficient in zip(grads, coefficients, strict=True):
                g = g + grad[name] * coefficient
            if coverage is not None:
                g = _covered_mean(g, [c[name] for c in coverage], weights, phi.shape, name)
            m_prev = torch.zeros_like(phi) if momentum is None else _fp32(momentum[name], phi.shape, f"momentum {name}")
            m = m_prev * cfg.momentum + g
            new_momentum[name] = m
            new_global[name] = phi - (g + m * cfg.momentum) * cfg.lr
    return new_global, new_momentum


def norm(tensors: Tensors) -> float:
    """Euclidean norm over all tensors, computed deterministically (see module docstring)."""
    return math.sqrt(sum(_dot(tensors[name], tensors[name]) for name in sorted(tensors)))


def cosine(a: Tensors, b: Tensors) -> float:
    """Cosine similarity of two same-named tensor sets seen as one vector; 0 if either is zero."""
    check_same_names(a, b, "compared")
    dot = sum(_dot(a[name], b[name]) for name in sorted(a))
    norms = norm(a) * norm(b)
    return 0.0 if norms == 0.0 else dot / norms


def near_duplicates(
    pseudo_grads: Mapping[Miner, Tensors], threshold: float, coverage: Mapping[Miner, Tensors] | None = None
) -> set[Miner]:
    """Every miner whose pseudo-gradient has cosine >= `threshold` with another miner's (both flagged).

    `coverage`: per miner and tensor, its block weights (as `outer_step`'s), for pseudo-gradients
    that are 0 off their blocks (decoded partitioned submissions are); each pair is then compared
    over the blocks both cover, and a pair that shares none is not compared.
    """
    if not 0 < threshold <= 1:
        raise ValueError(f"the duplicate threshold must be in (0, 1], got {threshold}")
    miners = list(pseudo_grads)
    if coverage is not None and set(coverage) != set(miners):
        raise ValueError("coverage must name exactly the miners whose pseudo-gradients are compared")
    for x, y in combinations(miners, 2):
        check_same_names(pseudo_grads[x], pseudo_grads[y], "compared")
    pairs = list(combinations(miners, 2))
    names = sorted(pseudo_grads[miners[0]]) if pairs else []  # one miner: nothing to compare, nothing to read
    # Name by name, so a walk holds one tensor per miner (pseudo_grads may compute them when asked for);
    # every sum still runs over the names in sorted order, as `cosine` takes it.
    squares: dict[Miner, dict[str, np.ndarray]] = {miner: {} for miner in miners}
    blocks: dict[Miner, dict[str, np.ndarray]] = {miner: {} for miner in miners}
    dots = dict.fromkeys(pairs, 0.0)
    for name in names:
        flat = {}
        for miner in miners:
            mask = None if coverage is None else coverage[miner][name]
            flat[miner] = _float64(pseudo_grads[miner][name])
            squares[miner][name] = _block_squares(flat[miner], mask, name)
            blocks[miner][name] = np.ones(1) if mask is None else _blocks(mask, squares[miner][name].size)
        for x, y in pairs:
            # Off its blocks a pseudo-gradient is 0, so the whole-tensor dot product is already the shared blocks' one.
            dots[x, y] += float(np.multiply(flat[x], flat[y]).sum())
    flagged: set[Miner] = set()
    for x, y in pairs:
        shared = {n: blocks[x][n] * blocks[y][n] for n in names}
        norm_x = math.sqrt(sum(float(np.multiply(squares[x][n], shared[n]).sum()) for n in names))
        norm_y = math.sqrt(sum(float(np.multiply(squares[y][n], shared[n]).sum()) for n in names))
        if norm_x == 0.0 or norm_y == 0.0:
            continue
        if dots[x, y] / (norm_x * norm_y) >= threshold:
            flagged.update((x, y))
    return flagged


def _float64(t: torch.Tensor) -> np.ndarray:
    """A tensor's fp32 values, flattened, exactly in float64 (as `_dot` takes them)."""
    x: np.ndarray = t.detach().to("cpu", torch.float32).numpy().astype(np.float64).reshape(-1)
    return x


def _block_squares(x: np.ndarray, coverage: torch.Tensor | None, name: str) -> np.ndarray:
    """The float64 sum of squares of each of a flattened tensor's coverage blocks (one block without coverage)."""
    blocks = 1 if coverage is None else coverage.numel()
    if x.size % blocks:
        raise ValueError(f"coverage of {name}: {blocks} blocks do not divide its {x.size} entries")
    squares: np.ndarray = np.square(x).reshape(blocks, -1).sum(axis=1)
    return squares


def _blocks(mask: torch.Tensor, blocks: int) -> np.ndarray:
    if mask.ndim != 1 or mask.numel() != blocks:
        raise ValueError(f"a coverage mask must be a vector of {blocks} block weights, got shape {tuple(mask.shape)}")
    return (mask.detach().to("cpu", torch.float32).numpy() > 0).astype(np.float64)


def _weights(utilities: Sequence[float], cfg: OuterConfig) -> list[float]:
    if any(not math.isfinite(u) or u < 0 for u in utilities):
        raise ValueError(f"utilities must be finite and non-negative, got {list(utilities)}")
    if cfg.weighting == "uniform":
        return [1.0 / len(utilities)] * len(utilities)
    total = math.fsum(utilities)
    if total == 0.0:
        raise ValueError("utility weighting needs at least one miner with positive utility")
    return [u / total for u in utilities]


def _covered_mean(
    g: torch.Tensor, masks: list[torch.Tensor], weights: list[float], shape: torch.Size, name: str
) -> torch.Tensor:
    # Off its blocks a miner's pseudo-gradient is 0, so g already holds Σ a_i c_i G_i; divide by Σ a_i c_i.
    blocks = masks[0].numel()
    if any(m.ndim != 1 or m.numel() != blocks for m in masks) or blocks == 0 or g.numel() % blocks:
        raise ValueError(f"coverage of {name}: expected one vector per miner, all of one length dividing "
                         f"{g.numel()}, got shapes {[tuple(m.shape) for m in masks]}")
    total_B = torch.zeros(blocks, dtype=torch.float32)
    for mask, weight in zip(masks, weights, strict=True):
        total_B = total_B + mask.detach().to("cpu", torch.float32) * weight
    g_BN = g.reshape(blocks, -1)
    safe_B = torch.where(total_B > 0, total_B, torch.ones_like(total_B))
    return torch.where(total_B[:, None] > 0, g_BN / safe_B[:, None], torch.zeros_like(g_BN)).reshape(shape)


def _clip_scales(grads: Sequence[Tensors]) -> list[float]:
    norms = [norm(g) for g in grads]
    median = statistics.median(norms)
    return [1.0 if n <= median else median / n for n in norms]


def _dot(a: torch.Tensor, b: torch.Tensor) -> float:
    # fp32 × fp32 is exact in float64; numpy's pairwise sum has a fixed order on every machine.
    return float(np.multiply(_float64(a), _float64(b)).sum())


def _fp32(tensor: torch.Tensor, shape: torch.Size, name: str) -> torch.Tensor:
    if tensor.shape != shape:
        raise ValueError(f"{name}: shape {tuple(tensor.shape)} differs from global {tuple(shape)}")
    return tensor.detach().to("cpu", torch.float32)

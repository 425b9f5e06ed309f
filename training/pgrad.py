"""Compressed pseudo-gradients (the SparseLoCo family): top-k per chunk, quantised, with error feedback.

A miner's pseudo-gradient G = Φ_t − Φ_i is sent instead of its full experts. For each expert tensor
the miner adds its error-feedback buffer e (what earlier rounds left unsent), flattens the sum
A = G + e, cuts it into chunks of `chunk` entries and keeps, in every chunk, the `topk` entries of
largest magnitude (ties: lower index), in ascending index order. Their values are quantised with one
fp32 scale per chunk:
- `int8`: q = round(v / s) with s = max|v| / 127 (an ulp less where 127 s would overflow fp32),
  q in [-127, 127];
- `2bit`: q in {0, 1, 2, 3} meaning s·(2q − 3)/3 with s = max|v|, four codes packed per byte,
  lowest bits first.
Partitions: with `partitions` P > 1 a blob carries 1/P of the group's chunks (rounded up), the
ones a draw picks (`chunk_draw`: SHA-256 of network, round and miner; `drawn_chunks`: a fixed
permutation of the chunks, numbered across the tensors in sorted-name order, seeded by it). Honest
miners move the experts nearly the same way, so miners that draw different chunks add entries
where the same chunks would repeat them, at the same payload each; the merge averages each entry
over the miners that sent its chunk (`coverage`). A miner keeps as error feedback only what its own
chunks left unsent, e' = A − decode(sent) on them and 0 elsewhere: the other chunks were for other
miners to send. With P = 1 every blob carries every chunk and nothing is lost, only delayed.
`error_bytes` and `load_error` are the buffer's own file form (fp32 safetensors whose metadata names
`ERROR_FORMAT`, for the miner's local storage; the mark keeps a file of expert weights with the same
names from being taken for a buffer, and then overwritten with one).

Blob tensors for an expert tensor named N with C of its chunks drawn, K kept each:
    N.idx    U8 [C, K] if chunk <= 256, else I16   index of each kept entry inside its chunk, strictly ascending
    N.q      I8  [C, K] in [-127, 127] (int8)  or  U8 [C, ceil(K/4)] (2bit; unused codes zero)
    N.scale  F32 [C]               finite, non-negative, and (int8) finite times 127 in fp32
A tensor with no chunk drawn has no blob tensors. A tensor smaller than `chunk` is one
chunk of its own size; otherwise its size must be a multiple of `chunk`. `check_compressed` refuses
every other value a peer could send, with a distinct reason.
`pgrad_config` reads these parameters from a network spec's `[submission]` table, for miners and
validators alike. This module knows nothing about blobs' metadata or how the decoded update is used.
Legend: C chunks, K kept entries per chunk, N chunk length.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Literal

import numpy as np
import safetensors
import safetensors.torch
import torch

from protocol.spec import NetworkSpec
from training.experts import Tensors

Quant = Literal["int8", "2bit"]
ERROR_FORMAT = "tessera-error-feedback/1"
_SUFFIXES = ("idx", "q", "scale")
_LARGEST_CODE: dict[Quant, float] = {"int8": 127.0, "2bit": 1.0}
"""The largest magnitude a code decodes to, in units of its chunk's scale."""


@dataclass(frozen=True)
class PgradConfig:
    """The compressed submission format's parameters (a network's spec fixes them)."""

    chunk: int = 1024
    """Entries per chunk; at most 32768 so an in-chunk index fits int16."""
    topk: int = 32
    """Entries kept per chunk (fewer only in a tensor smaller than `topk`); a multiple of 4."""
    quant: Quant = "2bit"
    """How kept values are quantised: `int8` or `2bit` (both with one fp32 scale per chunk)."""
    partitions: int = 1
    """P: each blob carries 1/P of the group's chunks, drawn per miner and round (module docstring)."""

    def __post_init__(self) -> None:
        if not 1 <= self.chunk <= 32768:
            raise ValueError(f"pgrad chunk must be between 1 and 32768, got {self.chunk}")
        if not 1 <= self.topk <= self.chunk or self.topk % 4:
            raise ValueError(f"pgrad topk must be a multiple of 4 between 4 and chunk, got {self.topk}")
        if self.quant not in ("int8", "2bit"):
            raise ValueError(f"pgrad quant must be 'int8' or '2bit', got {self.quant!r}")
        if not 1 <= self.partitions <= 64:
            raise ValueError(f"pgrad partitions must be between 1 and 64, got {self.partitions}")

    @property
    def index_code(self) -> str:
        """The safetensors dtype of in-chunk indices: U8 when they fit a byte, else I16."""
        return "U8" if self.chunk <= 256 else "I16"


def pgrad_config(spec: NetworkSpec) -> PgradConfig | None:
    """The compressed format's parameters if the spec's miners submit pseudo-gradients, else None."""
    sub = spec.submission
    if sub.format != "pgrad":
        return None
    return PgradConfig(chunk=sub.chunk, topk=sub.topk, quant=sub.quant, partitions=sub.partitions)


def chunk_draw(network_id: str, round: int, miner: str) -> int:
    """The draw that picks a miner's chunks in a round: 32 bits of SHA-256 of (network, round, miner)."""
    digest = hashlib.sha256(f"tessera-pgrad-chunks:{network_id}:{round}:{miner}".encode()).digest()
    return int.from_bytes(digest[:4], "big")


def layout(shape: tuple[int, ...], cfg: PgradConfig) -> tuple[int, int, int]:
    """(chunks C, chunk length N, kept per chunk K) of an expert tensor of `shape`."""
    numel = math.prod(shape)
    if numel < cfg.chunk:
        return 1, numel, min(cfg.topk, numel)
    if numel % cfg.chunk:
        raise ValueError(f"a tensor of shape {list(shape)} does not split into chunks of {cfg.chunk}")
    return numel // cfg.chunk, cfg.chunk, cfg.topk


def drawn_chunks(shapes: Mapping[str, tuple[int, ...]], cfg: PgradConfig, draw: int = 0) -> dict[str, list[int]]:
    """Expert tensor name -> its chunks that `draw` picks, ascending; tensors with none are left out.

    Every chunk when P = 1. Otherwise the first ceil(C/P) of numpy's legacy `RandomState(draw)`
    permutation of the group's C chunks: that stream is frozen across numpy versions, so every
    validator draws the same chunks.
    """
    if not 0 <= draw < 1 << 32:
        raise ValueError(f"a chunk draw is a 32-bit number, got {draw}")
    names = sorted(shapes)
    sizes = np.array([layout(shapes[name], cfg)[0] for name in names], dtype=np.int64)
    total = int(sizes.sum())
    if cfg.partitions == 1:
        return {name: list(range(int(c))) for name, c in zip(names, sizes, strict=True)}
    picked = _picked(total, cfg.partitions, draw)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])  # group-wide number of each tensor's first chunk
    tensor_of = np.searchsorted(starts, picked, side="right") - 1  # nondecreasing, as `picked` is sorted
    bounds = np.searchsorted(tensor_of, np.arange(len(names) + 1))
    out: dict[str, list[int]] = {}
    for t, name in enumerate(names):
        local = (picked[bounds[t] : bounds[t + 1]] - starts[t]).tolist()
        if local:
            out[name] = local
    return out


@lru_cache(maxsize=16)
def _picked(total: int, partitions: int, draw: int) -> np.ndarray:
    """The group-wide chunk numbers `draw` picks, ascending (read-only).

    Cached: a validator draws the same chunks to check, rebuild and merge one submission, and a
    permutation of an OLMoE-sized group's 3.1M chunks takes a quarter of a second.
    """
    picked = np.sort(np.random.RandomState(draw).permutation(total)[: -(-total // partitions)])
    picked.flags.writeable = False
    return picked


def compressed_shapes(
    shapes: Mapping[str, tuple[int, ...]], cfg: PgradConfig, draw: int = 0
) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Blob tensor name -> (safetensors dtype code, shape) for expert tensors of the given shapes."""
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    for name, chunks in drawn_chunks(shapes, cfg, draw).items():
        c, (_, _, k) = len(chunks), layout(shapes[name], cfg)
        out[f"{name}.idx"] = (cfg.index_code, (c, k))
        out[f"{name}.q"] = ("I8", (c, k)) if cfg.quant == "int8" else ("U8", (c, math.ceil(k / 4)))
        out[f"{name}.scale"] = ("F32", (c,))
    return dict(sorted(out.items()))


def compressed_bytes(shapes: Mapping[str, tuple[int, ...]], cfg: PgradConfig, draw: int | None = None) -> int:
    """Bytes of tensor data in a compressed submission of `draw`; None: the most any draw can give."""
    if draw is not None:
        itemsize = {"I16": 2, "I8": 1, "U8": 1, "F32": 4}
        return sum(itemsize[code] * math.prod(shape) for code, shape in compressed_shapes(shapes, cfg, draw).values())
    index_bytes = 1 if cfg.index_code == "U8" else 2
    per_chunk: list[int] = []
    for shape in shapes.values():
        c, _, k = layout(shape, cfg)
        q_bytes = k if cfg.quant == "int8" else math.ceil(k / 4)
        per_chunk += [index_bytes * k + q_bytes + 4] * c
    return sum(sorted(per_chunk, reverse=True)[: -(-len(per_chunk) // cfg.partitions)])


def coverage(shapes: Mapping[str, tuple[int, ...]], cfg: PgradConfig, draw: int = 0) -> dict[str, torch.Tensor]:
    """Expert tensor name -> fp32 [C], 1 for each of its chunks `draw` picks and 0 for the others.

    Chunk c is entries c·N to (c+1)·N − 1 of the flattened tensor: the block mask
    `training.outer.outer_step` takes as coverage.
    """
    chunks = drawn_chunks(shapes, cfg, draw)
    out: dict[str, torch.Tensor] = {}
    for name in sorted(shapes):
        mask_C = torch.zeros(layout(shapes[name], cfg)[0], dtype=torch.float32)
        mask_C[chunks.get(name, [])] = 1.0
        out[name] = mask_C
    return out


def encode(
    grads: Tensors, error: Tensors | None, cfg: PgradConfig, draw: int = 0
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Compress G + e on the chunks `draw` picks; returns (blob tensors, the new error-feedback buffer).

    The new buffer is G + e − decode(blob) on the drawn chunks and 0 on the others.
    """
    shapes = {name: tuple(t.shape) for name, t in grads.items()}
    chunks = drawn_chunks(shapes, cfg, draw)
    blob: dict[str, torch.Tensor] = {}
    new_error: dict[str, torch.Tensor] = {}
    for name in sorted(grads):
        acc = grads[name].detach().to("cpu", torch.float32)
        if error is not None:
            acc = acc + error[name].detach().to("cpu", torch.float32)
        c, n, k = layout(tuple(acc.shape), cfg)
        residual_CN = torch.zeros(c, n, dtype=torch.float32)
        if name in chunks:
            rows = chunks[name]
            acc_RN = acc.reshape(c, n)[rows]
            idx_RK = _top_indices(acc_RN, k)
            q_RK, scale_R = _quantize(torch.gather(acc_RN, 1, idx_RK), cfg.quant)
            blob[f"{name}.idx"] = idx_RK.to(torch.uint8 if cfg.index_code == "U8" else torch.int16)
            blob[f"{name}.q"] = q_RK if cfg.quant == "int8" else _pack2(q_RK)
            blob[f"{name}.scale"] = scale_R
            sent_RN = torch.zeros_like(acc_RN).scatter_(1, idx_RK, _dequantize(q_RK, scale_R, cfg.quant))
            residual_CN[rows] = acc_RN - sent_RN
        new_error[name] = residual_CN.reshape(acc.shape)
    return dict(sorted(blob.items())), new_error


def decode(blob: Tensors, shapes: Mapping[str, tuple[int, ...]], cfg: PgradConfig, draw: int = 0) -> dict[str, torch.Tensor]:
    """The dense fp32 pseudo-gradient a checked compressed blob of `draw` stands for (0 off its chunks)."""
    chunks = drawn_chunks(shapes, cfg, draw)
    return {name: _decode_one(blob, name, shapes[name], cfg, chunks.get(name)) for name in sorted(shapes)}


def _decode_one(blob: Tensors, name: str, shape: tuple[int, ...], cfg: PgradConfig,
                chunks: list[int] | None) -> torch.Tensor:
    """One expert tensor of `decode`: its drawn `chunks` (None: none drawn) scattered into zeros."""
    c, n, k = layout(shape, cfg)
    dense_CN = torch.zeros(c, n, dtype=torch.float32)
    if chunks:
        q = blob[f"{name}.q"]
        q_RK = q.to(torch.float32) if cfg.quant == "int8" else _unpack2(q, k)
        values_RK = _dequantize(q_RK, blob[f"{name}.scale"].to(torch.float32), cfg.quant)
        dense_RN = torch.zeros(len(chunks), n, dtype=torch.float32)
        dense_CN[chunks] = dense_RN.scatter_(1, blob[f"{name}.idx"].long(), values_RK)
    return dense_CN.reshape(shape)


def rebuild(global_tensors: Tensors, blob: Tensors, cfg: PgradConfig, draw: int = 0) -> dict[str, torch.Tensor]:
    """The miner's experts a validator scores and merges: Φ_i = Φ_t − decode(G_i), fp32, by name."""
    return dict(Rebuilt(global_tensors, blob, cfg, draw))


class Rebuilt(Mapping[str, torch.Tensor]):
    """`rebuild` as a mapping that rebuilds each tensor when asked for and keeps none: it holds the compressed
    blob (tens of MB at OLMoE-1B-7B's size) where the rebuilt experts are the group in fp32 (0.8 GB). The
    global tensors must stay as they are while it is used."""

    def __init__(self, global_tensors: Tensors, blob: Tensors, cfg: PgradConfig, draw: int = 0) -> None:
        self._global, self._blob, self._cfg = global_tensors, blob, cfg
        self._shapes = {name: tuple(t.shape) for name, t in sorted(global_tensors.items())}
        self._chunks = drawn_chunks(self._shapes, cfg, draw)

    def __getitem__(self, name: str) -> torch.Tensor:
        dense = _decode_one(self._blob, name, self._shapes[name], self._cfg, self._chunks.get(name))
        return self._global[name].detach().to("cpu", torch.float32) - dense

    def __iter__(self) -> Iterator[str]:
        return iter(self._shapes)

    def __len__(self) -> int:
        return len(self._shapes)


def check_compressed(blob: Tensors, shapes: Mapping[str, tuple[int, ...]], cfg: PgradConfig, draw: int = 0) -> str:
    """'' if the values of a compressed blob (names, dtypes, shapes already checked) are valid, else why not."""
    for name in drawn_chunks(shapes, cfg, draw):
        _, n, k = layout(shapes[name], cfg)
        idx_CK = blob[f"{name}.idx"].long()
        if bool(((idx_CK < 0) | (idx_CK >= n)).any()):
            return f"index out of range in {name}.idx"
        steps = idx_CK[:, 1:] - idx_CK[:, :-1]
        if bool((steps == 0).any()):
            return f"duplicate index in {name}.idx"
        if bool((steps < 0).any()):
            return f"indices not ascending in {name}.idx"
        scale_C = blob[f"{name}.scale"]
        if not bool(torch.isfinite(scale_C).all()):
            return f"non-finite scale in {name}.scale"
        if bool((scale_C < 0).any()):
            return f"negative scale in {name}.scale"
        if not bool(torch.isfinite(scale_C * _LARGEST_CODE[cfg.quant]).all()):
            return f"scale overflows fp32 in {name}.scale"
        if cfg.quant == "int8" and bool((blob[f"{name}.q"] == -128).any()):
            return f"int8 value -128 in {name}.q"
        if cfg.quant == "2bit" and k % 4 and bool((blob[f"{name}.q"][:, -1] >> (2 * (k % 4))).any()):
            return f"padding bits set in {name}.q"
    return ""


def error_bytes(error: Tensors) -> bytes:
    """The error-feedback buffer as fp32 safetensors bytes (a miner keeps it across rounds and restarts)."""
    return safetensors.torch.save({name: error[name].detach().to("cpu", torch.float32).contiguous()
                                   for name in sorted(error)}, metadata={"format": ERROR_FORMAT})


def load_error(data: bytes, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """A buffer written by `error_bytes`; ValueError unless it holds exactly `shapes` in fp32, all finite."""
    try:
        error = safetensors.torch.load(data)
    except safetensors.SafetensorError as exc:
        raise ValueError(f"not a safetensors error-feedback buffer: {exc}") from exc
    if _metadata(data).get("format") != ERROR_FORMAT:
        raise ValueError(f"safetensors, but not an error-feedback buffer (its metadata does not name {ERROR_FORMAT})")
    if sorted(error) != sorted(shapes):
        raise ValueError("the error-feedback buffer names other tensors than the expert group")
    for name, shape in shapes.items():
        if tuple(error[name].shape) != tuple(shape) or error[name].dtype != torch.float32:
            raise ValueError(f"the error-feedback buffer's {name} is not fp32 of shape {list(shape)}")
        if not bool(torch.isfinite(error[name]).all()):
            raise ValueError(f"the error-feedback buffer's {name} holds non-finite values")
    return dict(sorted(error.items()))


def _metadata(data: bytes) -> dict[str, object]:
    """The `__metadata__` of safetensors bytes that safetensors has already parsed (so the header is sound)."""
    size = int.from_bytes(data[:8], "little")
    metadata = json.loads(data[8:8 + size]).get("__metadata__")
    return metadata if isinstance(metadata, dict) else {}


def _top_indices(acc_CN: torch.Tensor, k: int) -> torch.Tensor:
    # A stable sort on -|v| keeps the lower index among equal magnitudes, so the choice is deterministic.
    order = torch.sort(-acc_CN.abs(), dim=1, stable=True).indices[:, :k]
    return order.sort(dim=1).values


def _quantize(values_CK: torch.Tensor, quant: Quant) -> tuple[torch.Tensor, torch.Tensor]:
    peak_C = values_CK.abs().amax(dim=1)
    if quant == "int8":
        scale_C = peak_C / 127
        # At a peak within an ulp of fp32's largest, peak / 127 rounds up and 127 codes of it decode to inf,
        # which the check refuses: one ulp less decodes to just below the peak.
        one_ulp_less = torch.nextafter(scale_C, torch.zeros_like(scale_C))
        scale_C = torch.where(torch.isfinite(scale_C * 127), scale_C, one_ulp_less)
        safe = torch.where(scale_C > 0, scale_C, torch.ones_like(scale_C))
        return torch.round(values_CK / safe[:, None]).clamp(-127, 127).to(torch.int8), scale_C
    safe = torch.where(peak_C > 0, peak_C, torch.ones_like(peak_C))
    codes = torch.round((values_CK / safe[:, None] * 3 + 3) / 2).clamp(0, 3)
    return codes.to(torch.uint8), peak_C


def _dequantize(q_CK: torch.Tensor, scale_C: torch.Tensor, quant: Quant) -> torch.Tensor:
    if quant == "int8":
        return q_CK.to(torch.float32) * scale_C[:, None]
    return (q_CK.to(torch.float32) * 2 - 3) / 3 * scale_C[:, None]


def _pack2(codes_CK: torch.Tensor) -> torch.Tensor:
    c, k = codes_CK.shape
    padded = torch.zeros(c, math.ceil(k / 4) * 4, dtype=torch.uint8)
    padded[:, :k] = codes_CK
    quads = padded.reshape(c, -1, 4)
    return quads[..., 0] | (quads[..., 1] << 2) | (quads[..., 2] << 4) | (quads[..., 3] << 6)


def _unpack2(packed: torch.Tensor, k: int) -> torch.Tensor:
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8)
    codes = (packed[..., None] >> shifts) & 3
    return codes.reshape(packed.shape[0], -1)[:, :k].to(torch.float32)

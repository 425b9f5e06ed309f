"""Compressed pseudo-gradients (the SparseLoCo family): top-k per chunk, quantised, with error feedback.

A miner's pseudo-gradient G = Φ_t − Φ_i is sent instead of its full experts. For each expert tensor
the miner adds its error-feedback buffer e (what earlier rounds left unsent), flattens the sum
A = G + e, cuts it into chunks of `chunk` entries and keeps, in every chunk, the `topk` entries of
largest magnitude (ties: lower index), in ascending index order. Their values are quantised with one
fp32 scale per chunk:
- `int8`: q = round(v / s) with s = max|v| / 127, q in [-127, 127];
- `2bit`: q in {0, 1, 2, 3} meaning s·(2q − 3)/3 with s = max|v|, four codes packed per byte,
  lowest bits first.
The new buffer is e' = A − decode(sent), so nothing is lost, only delayed. `error_bytes` and
`load_error` are the buffer's own file form (plain fp32 safetensors, for the miner's local storage).

Blob tensors for an expert tensor named N with C chunks of k kept entries each:
    N.idx    I16 [C, k]            index of each kept entry inside its chunk, strictly ascending
    N.q      I8  [C, k] in [-127, 127] (int8)  or  U8 [C, ceil(k/4)] (2bit; unused codes zero)
    N.scale  F32 [C]               finite, non-negative
A tensor smaller than `chunk` is one chunk of its own size; otherwise its size must be a multiple
of `chunk`. `check_compressed` refuses every other value a peer could send, with a distinct reason.
This module knows nothing about blobs' metadata, the network or how the decoded update is used.
Legend: C chunks, K kept entries per chunk, N chunk length.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import safetensors
import safetensors.torch
import torch

from training.experts import Tensors

Quant = Literal["int8", "2bit"]
_SUFFIXES = ("idx", "q", "scale")


@dataclass(frozen=True)
class PgradConfig:
    """The compressed submission format's parameters (a network's spec fixes them)."""

    chunk: int = 1024
    """Entries per chunk; at most 32768 so an in-chunk index fits int16."""
    topk: int = 32
    """Entries kept per chunk (fewer only in a tensor smaller than `topk`); a multiple of 4."""
    quant: Quant = "2bit"
    """How kept values are quantised: `int8` or `2bit` (both with one fp32 scale per chunk)."""

    def __post_init__(self) -> None:
        if not 1 <= self.chunk <= 32768:
            raise ValueError(f"pgrad chunk must be between 1 and 32768, got {self.chunk}")
        if not 1 <= self.topk <= self.chunk or self.topk % 4:
            raise ValueError(f"pgrad topk must be a multiple of 4 between 4 and chunk, got {self.topk}")
        if self.quant not in ("int8", "2bit"):
            raise ValueError(f"pgrad quant must be 'int8' or '2bit', got {self.quant!r}")


def layout(shape: tuple[int, ...], cfg: PgradConfig) -> tuple[int, int, int]:
    """(chunks C, chunk length N, kept per chunk K) of an expert tensor of `shape`."""
    numel = math.prod(shape)
    if numel < cfg.chunk:
        return 1, numel, min(cfg.topk, numel)
    if numel % cfg.chunk:
        raise ValueError(f"a tensor of shape {list(shape)} does not split into chunks of {cfg.chunk}")
    return numel // cfg.chunk, cfg.chunk, cfg.topk


def compressed_shapes(shapes: Mapping[str, tuple[int, ...]], cfg: PgradConfig) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Blob tensor name -> (safetensors dtype code, shape) for expert tensors of the given shapes."""
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    for name, shape in shapes.items():
        c, _, k = layout(shape, cfg)
        out[f"{name}.idx"] = ("I16", (c, k))
        out[f"{name}.q"] = ("I8", (c, k)) if cfg.quant == "int8" else ("U8", (c, math.ceil(k / 4)))
        out[f"{name}.scale"] = ("F32", (c,))
    return dict(sorted(out.items()))


def compressed_bytes(shapes: Mapping[str, tuple[int, ...]], cfg: PgradConfig) -> int:
    """Bytes of tensor data in a compressed submission for expert tensors of these shapes."""
    itemsize = {"I16": 2, "I8": 1, "U8": 1, "F32": 4}
    return sum(itemsize[code] * math.prod(shape) for code, shape in compressed_shapes(shapes, cfg).values())


def encode(grads: Tensors, error: Tensors | None, cfg: PgradConfig) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Compress G + e; returns (blob tensors, the new error-feedback buffer e' = G + e − decode)."""
    blob: dict[str, torch.Tensor] = {}
    new_error: dict[str, torch.Tensor] = {}
    for name in sorted(grads):
        acc = grads[name].detach().to("cpu", torch.float32)
        if error is not None:
            acc = acc + error[name].detach().to("cpu", torch.float32)
        c, n, k = layout(tuple(acc.shape), cfg)
        acc_CN = acc.reshape(c, n)
        idx_CK = _top_indices(acc_CN, k)
        values_CK = torch.gather(acc_CN, 1, idx_CK)
        q_CK, scale_C = _quantize(values_CK, cfg.quant)
        blob[f"{name}.idx"] = idx_CK.to(torch.int16)
        blob[f"{name}.q"] = q_CK if cfg.quant == "int8" else _pack2(q_CK)
        blob[f"{name}.scale"] = scale_C
        sent_CN = torch.zeros_like(acc_CN).scatter_(1, idx_CK, _dequantize(q_CK, scale_C, cfg.quant))
        new_error[name] = (acc_CN - sent_CN).reshape(acc.shape)
    return dict(sorted(blob.items())), new_error


def decode(blob: Tensors, shapes: Mapping[str, tuple[int, ...]], cfg: PgradConfig) -> dict[str, torch.Tensor]:
    """The dense fp32 pseudo-gradient a checked compressed blob stands for, by expert tensor name."""
    out: dict[str, torch.Tensor] = {}
    for name in sorted(shapes):
        c, n, k = layout(shapes[name], cfg)
        q = blob[f"{name}.q"]
        q_CK = q.to(torch.float32) if cfg.quant == "int8" else _unpack2(q, k)
        values_CK = _dequantize(q_CK, blob[f"{name}.scale"].to(torch.float32), cfg.quant)
        dense_CN = torch.zeros(c, n, dtype=torch.float32).scatter_(1, blob[f"{name}.idx"].long(), values_CK)
        out[name] = dense_CN.reshape(shapes[name])
    return out


def rebuild(global_tensors: Tensors, blob: Tensors, cfg: PgradConfig) -> dict[str, torch.Tensor]:
    """The miner's experts a validator scores and merges: Φ_i = Φ_t − decode(G_i), fp32, by name."""
    shapes = {name: tuple(t.shape) for name, t in global_tensors.items()}
    dense = decode(blob, shapes, cfg)
    return {name: global_tensors[name].detach().to("cpu", torch.float32) - dense[name] for name in sorted(shapes)}


def check_compressed(blob: Tensors, shapes: Mapping[str, tuple[int, ...]], cfg: PgradConfig) -> str:
    """'' if the values of a compressed blob (names, dtypes, shapes already checked) are valid, else why not."""
    for name in sorted(shapes):
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
        if cfg.quant == "int8" and bool((blob[f"{name}.q"] == -128).any()):
            return f"int8 value -128 in {name}.q"
        if cfg.quant == "2bit" and k % 4 and bool((blob[f"{name}.q"][:, -1] >> (2 * (k % 4))).any()):
            return f"padding bits set in {name}.q"
    return ""


def error_bytes(error: Tensors) -> bytes:
    """The error-feedback buffer as fp32 safetensors bytes (a miner keeps it across rounds and restarts)."""
    return safetensors.torch.save({name: error[name].detach().to("cpu", torch.float32).contiguous()
                                   for name in sorted(error)})


def load_error(data: bytes, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """A buffer written by `error_bytes`; ValueError unless it holds exactly `shapes` in fp32."""
    try:
        error = safetensors.torch.load(data)
    except safetensors.SafetensorError as exc:
        raise ValueError(f"not a safetensors error-feedback buffer: {exc}") from exc
    if sorted(error) != sorted(shapes):
        raise ValueError("the error-feedback buffer names other tensors than the expert group")
    for name, shape in shapes.items():
        if tuple(error[name].shape) != tuple(shape) or error[name].dtype != torch.float32:
            raise ValueError(f"the error-feedback buffer's {name} is not fp32 of shape {list(shape)}")
    return dict(sorted(error.items()))


def _top_indices(acc_CN: torch.Tensor, k: int) -> torch.Tensor:
    # A stable sort on -|v| keeps the lower index among equal magnitudes, so the choice is deterministic.
    order = torch.sort(-acc_CN.abs(), dim=1, stable=True).indices[:, :k]
    return order.sort(dim=1).values


def _quantize(values_CK: torch.Tensor, quant: Quant) -> tuple[torch.Tensor, torch.Tensor]:
    peak_C = values_CK.abs().amax(dim=1)
    if quant == "int8":
        scale_C = peak_C / 127
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

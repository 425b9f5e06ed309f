"""The blob a miner submits for a round: its trained experts, or their compressed pseudo-gradient, canonically encoded.

`build_submission` is THE honest build: it trains a round (miner.model) and encodes the result
(`encode_submission`); the daemon's duty and `tessera train` both call it. A network whose spec says
`[submission] format = "pgrad"` gets compressed pseudo-gradients (training.pgrad): G = Φ_t − Φ_i in
fp32 plus the miner's error-feedback buffer (`ErrorFeedback`), top-k per chunk and quantised; what
was left unsent becomes the new buffer. A round whose training diverged (NaN or Inf in the trained
experts) has no submission (`Diverged`): nothing is encoded and the buffer stays as it was. This module knows nothing about where the buffer is stored, nor about the
network, scoring or merging.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from miner.model import MinerModel
from miner.settings import MinerSettings
from protocol.spec import NetworkSpec
from training.blob import BLOB_FORMAT, PGRAD_FORMAT, BlobMeta, encode_blob
from training.experts import pseudo_gradient
from training.pgrad import chunk_draw, pgrad_config
from training.pgrad import encode as encode_pgrad
from training.trainer import TrainResult


@dataclass
class ErrorFeedback:
    """The buffer a round's pgrad encoding starts from; the encoding replaces `error` with what it left."""

    error: dict[str, torch.Tensor] | None = None
    """What earlier rounds left unsent, fp32 by expert tensor name; None: nothing yet."""


class Diverged(ValueError):
    """The trained experts hold NaN or Inf: training diverged, and there is nothing to submit."""


def encode_submission(spec: NetworkSpec, round: int, miner: str, head: str, tensors: Mapping[str, torch.Tensor],
                      base: Mapping[str, torch.Tensor] | None = None, feedback: ErrorFeedback | None = None) -> bytes:
    """The canonical blob of `tensors` in the spec's submission format, naming this round, miner and base.

    `experts`: the tensors in the spec's dtype. `pgrad`: G = `base` − `tensors` plus `feedback.error`,
    compressed on the chunks this round and miner draw; `feedback.error` becomes what those
    chunks left unsent (without `feedback` nothing is kept). Diverged, with `feedback` untouched, when
    `tensors` hold a NaN or an Inf.
    """
    _check_finite(tensors)
    cfg = pgrad_config(spec)
    meta = BlobMeta(network=spec.network_id, round=round, miner=miner, base=head,
                    group={layer: list(ids) for layer, ids in spec.group.items()},
                    format=BLOB_FORMAT if cfg is None else PGRAD_FORMAT)
    if cfg is None:
        dtype = getattr(torch, spec.model.dtype)
        return _within_header_cap(spec, encode_blob({name: t.to(dtype) for name, t in tensors.items()}, meta))
    if base is None:
        raise ValueError("a pgrad submission needs the state it was trained from (base)")
    draw = chunk_draw(spec.network_id, round, miner)
    blob, error = encode_pgrad(pseudo_gradient(base, tensors), None if feedback is None else feedback.error, cfg, draw)
    data = _within_header_cap(spec, encode_blob(blob, meta))
    if feedback is not None:
        feedback.error = error
    return data


def build_submission(model: MinerModel, miner: str, round: int, head: str, base: Mapping[str, torch.Tensor],
                     settings: MinerSettings, keep_going: Callable[[], bool] = lambda: True,
                     steps: int | None = None, progress: bool = False,
                     feedback: ErrorFeedback | None = None) -> tuple[bytes, TrainResult]:
    """An honest miner's blob for `round`, trained from the state `head` (whose tensors are `base`) with
    AdamW from zero; a pgrad network's blob carries `feedback`'s buffer in and leaves the new one there.

    ValueError when `keep_going` is already False: the TRAIN deadline passed before training began.
    Diverged when training did: `feedback` is left as it was."""
    if not keep_going():  # the trainer would get no batch and blame the data
        raise ValueError("no time left to train: the TRAIN deadline had already passed when training would start")
    result = model.train(miner, round, base, settings, keep_going, steps, progress)
    return encode_submission(model.spec, round, miner, head, result.tensors, base, feedback), result


def _check_finite(tensors: Mapping[str, torch.Tensor]) -> None:
    """Diverged naming the first tensor, by name, that holds a NaN or an Inf."""
    for name in sorted(tensors):
        if not bool(torch.isfinite(tensors[name]).all()):
            raise Diverged(f"training diverged: non-finite values in {name}")


def _within_header_cap(spec: NetworkSpec, data: bytes) -> bytes:
    """`data`, unless its header is over the spec's cap, which every validator would refuse it for."""
    header_bytes = int.from_bytes(data[:8], "little")
    if header_bytes > spec.limits.max_header_bytes:
        raise ValueError(f"the blob's header is {header_bytes} bytes, over the spec's limits.max_header_bytes "
                         f"({spec.limits.max_header_bytes}): validators refuse every blob of this expert group in "
                         f"this format; the network's spec needs a larger limits.max_header_bytes")
    return data

"""The inner AdamW state a miner that keeps it (`[miner] keep_optimizer`) carries from one round to the next.

A kept state is rewound after a round that merged nothing, and the lr is halved until a merge: where
the merged experts a miner is about to train from are the ones it last trained from (equal
`tensors_digest`), no update was merged in between, so the state goes back to a host copy of what it
was before that training, and the round trains at half the last round's lr (down to 1/64 of the
spec's), back to the spec's lr once an update is merged (docs/learning.md: a kept state that is not
rewound stalls, and backtracking lets a rewound miner's retry pass Proof-of-Loss). This module knows
nothing about the model, the training data or the network.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from training.trainer import backtracked

log = logging.getLogger(__name__)


@dataclass
class InnerOptimizer:
    """The AdamW state (`TrainResult.optimizer_state`: fp32 moments, or 8-bit ones with `[miner] optimizer =
    "adamw8bit"`) on the training device, carried from round to round. In memory only; a restart starts at zero.

    Before each training (`start`) it keeps a CPU copy of that state and a digest of the merged tensors it
    trains from. When the next training starts from tensors with the same digest, the state goes back to the
    copy: moments that counted a step the network did not take would count the same point's gradient again,
    and from a state no update leaves, AdamW's steps can grow toward the sign of that gradient until none
    passes Proof-of-Loss. Each such level round also halves the lr the miner trains at (`lr_scale`), since
    rewound, it would retry the same step, and where that step overshoots every retry fails the gate. The copy
    costs twice the group's size in host memory, not on the device."""

    state: dict[str, Any] | None = None
    before: dict[str, Any] | None = None
    """A CPU copy of `state` as it was when the last training started: what a level round rewinds to."""
    trained_from: str | None = None
    """`tensors_digest` of the merged tensors the last training started from (None: no training yet)."""
    lr_scale: float = 1.0
    """The fraction of the spec's inner lr the next training runs at (set by `start`)."""

    def start(self, base: Mapping[str, torch.Tensor], round: int) -> None:
        """Ready the state and lr for training `round` from `base`: rewound, at half the lr, when `base` is what
        the last training started from; then copied, so that the round after can rewind to it."""
        digest = tensors_digest(base)
        level = digest == self.trained_from
        self.lr_scale = backtracked(self.lr_scale, merged=not level)
        if level:
            log.info("round %d: no update was merged since this miner last trained (the merged experts are the "
                     "same); its AdamW state goes back to what it was before that training, and it trains at "
                     "%g of the spec's lr", round, self.lr_scale)
            self.state = self.before
        self.before = _host_copy(self.state)
        self.trained_from = digest

    def drop(self) -> None:
        """Start AdamW at zero next round at the spec's lr, with nothing to rewind to (a training that diverged)."""
        self.state = self.before = self.trained_from = None
        self.lr_scale = 1.0


def tensors_digest(tensors: Mapping[str, torch.Tensor]) -> str:
    """SHA-256 over `tensors`' names, dtypes, shapes and bytes, in name order: equal exactly when the tensors are."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().to("cpu").contiguous()
        h.update(f"{name}\0{t.dtype}\0{tuple(t.shape)}\0".encode())
        h.update(t.view(torch.uint8).numpy().data if t.numel() else b"")
    return h.hexdigest()


def _host_copy(state: dict[str, Any] | None) -> dict[str, Any] | None:
    """A copy of an AdamW `state_dict` with every tensor on the CPU. Torch loads a state into an optimizer without
    copying tensors already on the parameters' device, and its steps then update them in place."""
    if state is None:
        return None
    return {"state": {key: {name: v.detach().to("cpu", copy=True) if isinstance(v, torch.Tensor) else v
                            for name, v in moments.items()} for key, moments in state["state"].items()},
            "param_groups": [dict(group, params=list(group["params"])) for group in state["param_groups"]]}

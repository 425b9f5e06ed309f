"""How a miner trains on its machine (device, forward, micro-batches, optimizer): `MinerSettings`.

The node config's `[miner]` section extends it; `tessera train` and the benchmarks build one; all hand it to
`miner.model.MinerModel.train`. It imports no heavy library, so a node's config loads without torch; the spec,
not these settings, fixes what is trained.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class MinerSettings(BaseModel):
    """How this machine trains; the spec fixes what is trained. The node config's `[miner]` section
    (node.runtime.config.MinerSection) is these fields and the node's own."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    device: str = Field(default="cpu", description="Torch device for training, e.g. cpu or cuda:0.")
    forward: Literal["full", "compressed"] = Field(
        default="full", description="'full' runs all experts (frozen); 'compressed' only the selected ones."
    )
    micro_batch_size: int | None = Field(
        default=None, ge=1, description="Sequences per forward pass; unset = the spec's batch (no accumulation)."
    )
    checkpointing: bool = Field(
        default=False, description="Activation checkpointing: recompute decoder layers in backward to save memory."
    )
    autocast: bool = Field(default=True, description="bf16 autocast when training on CUDA (no effect on CPU).")
    optimizer: Literal["adamw", "adamw8bit"] = Field(
        default="adamw", description="Inner optimizer: 'adamw' (fp32 moments) or 'adamw8bit' (bitsandbytes' 8-bit "
        "moments, about a quarter of the optimizer state's memory)."
    )
    step_in_backward: bool = Field(
        default=False, description="Take each expert tensor's optimizer step in backward as its gradient is complete, "
        "so the group's gradients never all live at once (a step of one micro-batch; a step is clipped by the norm "
        "of the step before)."
    )

"""What a miner loads once and how it trains one round: the base model, its genesis state, the training data.

`MinerModel.load` builds the base model (compressed to its expert group in `compressed` mode), the
genesis state a miner trains from and the packed training sequences; `MinerModel.train` puts a state's
experts into the model and runs the inner AdamW steps on this miner's shard of the sequences, in the
batch order `miner_seed` draws. How it trains on this machine (device, forward mode, micro-batches,
checkpointing, autocast, optimizer, the step in backward) is a `MinerSettings`, which the node config's
`[miner]` section extends. This module knows nothing about the network or the blob a round submits.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import torch

from miner.settings import MinerSettings
from protocol.spec import NetworkSpec, spec_dir_path
from training.adapters import MoEAdapter
from training.compressed import CompressedModel
from training.data import batches, load_sequences, shard
from training.experts import expected_shapes, extract, insert
from training.model import base_experts, load_base, load_compressed_base
from training.state import GENESIS_ROUND, GlobalExperts
from training.tokenizer import load_tokenizer
from training.trainer import TrainConfig, TrainResult, train_experts


def miner_seed(miner: str, round: int) -> int:
    """The seed of a miner's batch order (and an adversary's noise) in a round."""
    return int.from_bytes(hashlib.sha256(f"tessera-miner:{miner}:{round}".encode()).digest()[:8], "big") >> 1


def training_files(spec: NetworkSpec, spec_path: Path, data: Sequence[Path] = ()) -> list[Path]:
    """The files a miner trains on: `data` when given, else the spec's `data.train`."""
    return list(data) or [spec_dir_path(spec_path, p) for p in spec.data.train]


class MinerModel:
    """What a miner loads once: the base model (compressed to its group in `compressed` mode), its genesis
    state and the training sequences."""

    def __init__(self, spec: NetworkSpec, model: torch.nn.Module | CompressedModel, adapter: MoEAdapter,
                 genesis: GlobalExperts, shapes: dict[str, tuple[int, ...]], sequences: torch.Tensor,
                 pad_id: int) -> None:
        self.spec = spec
        self.model = model
        self.adapter = adapter
        self.genesis = genesis
        self.shapes = shapes
        self.sequences = sequences
        self.pad_id = pad_id

    @classmethod
    def load(cls, spec: NetworkSpec, spec_path: Path, data: Sequence[Path] = (), progress: bool = False,
             forward: Literal["full", "compressed"] = "full",
             inherited: Mapping[str, torch.Tensor] | None = None) -> MinerModel:
        """Build the base model and pack the training files (`data`, else the spec's); blocking.

        `compressed`: the model is Θ̃0 alone (training.model.load_compressed_base), never holding the
        unselected experts; it can then only train with `forward = "compressed"`. `inherited`: a successor
        spec's experts of earlier specs (training.state.inherited_experts), written into the base first."""
        model: torch.nn.Module | CompressedModel
        experts: Mapping[str, torch.Tensor]
        inherited = inherited or {}
        if forward == "compressed":
            model = load_compressed_base(spec, spec_path, progress=progress)
            # The base's experts in the dtype the checkpoint stores them, a checkpoint's read from its files when
            # asked for: the model's rows, which hold them now, are overwritten by training. The unselected experts,
            # inherited or not, are never loaded.
            adapter, experts, shapes = model.adapter, base_experts(spec, spec_path, model), model.shapes()
            if inherited.keys() & shapes.keys():  # a group that shares experts with an earlier one starts from them
                experts = {name: inherited[name] if name in inherited else experts[name] for name in shapes}
        else:
            model, adapter = load_base(spec, spec_path, progress=progress)
            insert(model, adapter, inherited)
            experts, shapes = extract(model, adapter, spec.group), expected_shapes(model, adapter, spec.group)
        tokenizer = load_tokenizer(spec.data.tokenizer, spec_path.parent)
        sequences = load_sequences(training_files(spec, spec_path, data), tokenizer, spec.data.seq_len)
        return cls(spec, model, adapter, _genesis(spec, experts, shapes), shapes, sequences, tokenizer.pad_id)

    def train(self, miner: str, round: int, base: Mapping[str, torch.Tensor], settings: MinerSettings,
              keep_going: Callable[[], bool], steps: int | None = None, progress: bool = False,
              optimizer_state: dict[str, Any] | None = None, hand_on: bool = False) -> TrainResult:
        """H inner steps (or `steps`) from `base` on this miner's shard; fewer when `keep_going` turns False.

        `progress`: a tqdm bar on a terminal (the `tessera train` command; the daemon logs instead).
        `optimizer_state`: the AdamW state to go on from (None: start at zero, as a miner does); `hand_on`: the new
        one is in the result."""
        if isinstance(self.model, CompressedModel):  # `base` may be read from its blob file a tensor at a time
            self.model.load(base)
        else:
            insert(self.model, self.adapter, base)
        on_this_machine = {name: getattr(settings, name) for name in MinerSettings.model_fields}
        cfg = TrainConfig.from_spec(self.spec.training, steps=steps or self.spec.training.inner_steps,
                                    pad_id=self.pad_id, progress=progress, **on_this_machine)
        rows = shard(self.sequences, miner, round)
        order = batches(rows, cfg.batch_size, miner_seed(miner, round))
        return train_experts(self.model, self.adapter, self.spec.group, _while(order, keep_going), cfg,
                             optimizer_state, hand_on)


def _genesis(spec: NetworkSpec, experts: Mapping[str, torch.Tensor], shapes: dict[str, tuple[int, ...]]
             ) -> GlobalExperts:
    """A miner's view of the genesis state: the base's experts (as given: a mapping that reads them when asked
    stays one), with a momentum it never reads, zero-strided views of one zero (no memory)."""
    zeros = {name: torch.zeros((), dtype=torch.float32).expand(shape) for name, shape in shapes.items()}
    return GlobalExperts(spec=spec, round=GENESIS_ROUND, parent="", tensors=experts, momentum=zeros)


def _while(items: Iterator[torch.Tensor], keep_going: Callable[[], bool]) -> Iterator[torch.Tensor]:
    for item in items:
        if not keep_going():
            return
        yield item

"""What a validator loads once and checks before it starts: its held-out files, the base model in its scorer,
the genesis state and the largest blob a submission may be.

`check_files` refuses held-out data a validator must not score with (a file that does not hash to the spec's
`heldout_sha256`, one that shares a document with the training files, a general-domain file the spec does not
pin or another than it pins), each in one ValueError naming the node config's field. `ValidatorModel.load`
builds the base model on the validator's device (spread over every GPU for `auto`), packs the held-out
sequences and wraps both in a `validator.scoring.Scorer`. This module knows nothing about the network, storage
or rounds.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from protocol.spec import NetworkSpec, spec_dir_path
from training.adapters import tensor_attr
from training.data import (
    check_disjoint,
    check_general_file,
    check_heldout_file,
    file_sha256,
    heldout_subset,
    load_sequences,
    read_documents,
)
from training.device import check_device
from training.experts import extract, insert
from training.model import load_base
from training.state import GlobalExperts
from training.tokenizer import load_tokenizer
from validator.checks import submission_cap
from validator.scoring import Scorer, apply_global, check_gate_data

log = logging.getLogger(__name__)


def check_files(spec: NetworkSpec, spec_path: Path, heldout: Path, general: Path | None) -> None:
    """ValueError naming `validator.heldout` or `validator.general` where the files are not the network's."""
    try:
        check_heldout_file(heldout, spec.data.heldout_sha256)
    except ValueError as exc:
        raise ValueError(f"validator.heldout: {exc}") from None
    _check_disjoint(spec, spec_path, heldout)
    check_general_file(general, spec.data.general_sha256, "validator.general")


def spec_files(spec: NetworkSpec, heldout: Path, general: Path | None, more: Sequence[Path]) -> tuple[Path, Path | None]:
    """The held-out and general-domain files a validator scores `spec` with: its configured ones for a genesis
    spec; for a successor, whichever of those and `more` (`validator.data`) hash to what the successor pins
    (ValueError naming `validator.data` when none does)."""
    if spec.lineage is None:
        return heldout, general
    by_hash = {file_sha256(p): p for p in (heldout, general, *more) if p is not None and p.is_file()}

    def pinned(sha: str, what: str) -> Path:
        if sha not in by_hash:
            raise ValueError(f"validator.data: no file of validator.heldout, validator.general or validator.data "
                             f"hashes to the {what} {sha} that spec {spec.network_id[:12]} (in force from round "
                             f"{spec.first_round}) pins; add that file to validator.data")
        return by_hash[sha]

    chosen = pinned(spec.data.heldout_sha256, "data.heldout_sha256")
    return chosen, None if spec.data.general_sha256 is None else pinned(spec.data.general_sha256, "data.general_sha256")


@dataclass(frozen=True)
class ValidatorModel:
    """The scorer (base model + held-out sequences), the general-domain held-out sequences (None: the spec pins
    none), the genesis state and the cap on a submission's blob size."""

    scorer: Scorer
    general: torch.Tensor | None
    genesis: GlobalExperts
    cap: int

    @classmethod
    def load(cls, spec: NetworkSpec, spec_path: Path, heldout: Path, general: Path | None, device: str,
             batch_size: int, weights: Literal["checkpoint", "int8"],
             inherited: Mapping[str, torch.Tensor] | None = None) -> ValidatorModel:
        """`inherited`: a successor spec's experts of earlier specs (training.state.inherited_experts), written into
        the base before its group is cut from it."""
        device_map = "auto" if device == "auto" else None  # spread over all GPUs
        model, adapter = load_base(spec, spec_path, device_map=device_map)
        insert(model, adapter, inherited or {})
        tokenizer = load_tokenizer(spec.data.tokenizer, spec_path.parent)
        sequences = load_sequences([heldout], tokenizer, spec.data.seq_len)
        try:
            check_gate_data(spec, sequences.shape[0])
        except ValueError as exc:
            raise ValueError(f"validator.heldout: {exc}") from None
        general_rows = None if general is None else load_sequences([general], tokenizer, spec.data.seq_len)
        check_device(device, model, batch_size, spec.data.seq_len)
        scorer = Scorer(model, adapter, spec, sequences, tokenizer.pad_id, device, batch_size, weights)
        # The base's experts in the dtype the model holds them (bf16 for a bf16 checkpoint): their exact values at
        # half fp32's bytes (0.4 GB at OLMoE-1B-7B's size), as a miner holds them; every use takes them to fp32.
        held = tensor_attr(adapter.experts(model, min(spec.group)), "gate_up_proj").dtype
        genesis = GlobalExperts.genesis(spec, extract(model, adapter, spec.group, held))
        cap = submission_cap(spec, scorer.shapes)  # the format's own cap: a pgrad blob is far smaller
        return cls(scorer, general_rows, genesis, cap)

    def loss(self, tensors: dict[str, torch.Tensor], seed: str) -> float:
        """Held-out loss of the model holding `tensors` on the subset `seed` picks."""
        s = self.scorer
        apply_global(s.model, s.adapter, tensors)
        sequences = heldout_subset(s.heldout, seed, s.spec.data.heldout_sequences)
        return s.loss(sequences)


def _check_disjoint(spec: NetworkSpec, spec_path: Path, heldout: Path) -> None:
    """Refuse a held-out file that shares a document with the spec's training files (those present here)."""
    present = [p for p in (spec_dir_path(spec_path, name) for name in spec.data.train) if p.is_file()]
    if not present:
        log.warning("none of the spec's training files is here; cannot check the held-out file is disjoint")
        return
    documents = [doc for p in present for doc in read_documents(p)]
    try:
        check_disjoint(documents, read_documents(heldout))
    except ValueError as exc:
        raise ValueError(f"validator.heldout: {heldout}: {exc}; "
                         "a held-out file must share nothing with the training files") from exc

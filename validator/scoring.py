"""Proof-of-Loss scoring (DESIGN §6): one validator's losses for the submissions assigned to it.

A `Scorer` holds the base model in memory for the validator's lifetime. Each round it picks the
held-out subset from the round seed, puts the current global experts into the model and measures
L_base, then for each submission in miner-id order: checks the blob (`validator.checks`), swaps the
miner's experts in, measures L_i and restores the global experts. A network that submits compressed
pseudo-gradients (`[submission] format = "pgrad"`) has each checked blob rebuilt into the miner's
experts, Φ_i = Φ_t − decode(G_i) in fp32 (`training.pgrad.rebuild`), so scoring and the merge see
full expert tensors whatever the format. The model, the swapped rows and every batch live on the
validator's device (`validator.device`; `auto` spreads a model too large for one GPU over all GPUs
with accelerate's device map); batches hold `validator.batch_size` sequences. On CPU fp32 the losses
are bit-for-bit reproducible; on a GPU they may differ from another validator's in the last bits,
which the median over assigned validators absorbs. The model always holds the global experts when a
call returns. The merge gate's rows (`gate_rows`: held-out rows the round's scores leave out, picked by
the gate seed) and its measure of a candidate state (`gate_measure`) live here too, and the checked
submissions a validator keeps from scoring to its merge (`CheckedSubmissions`). This module knows
nothing about assignment, gossip or how the results are combined across validators.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import torch

from protocol.messages import ScoreEntry, ScoreReport
from protocol.seeds import gate_seed
from protocol.spec import NetworkSpec
from training.adapters import MoEAdapter
from training.blob import BlobFile
from training.data import heldout_subset
from training.device import hold_int8
from training.evaluate import LossResult, heldout_loss, loss_with_experts
from training.experts import expected_shapes, insert
from training.pgrad import Rebuilt, pgrad_config
from training.tokenizer import BYTE_PAD
from validator.checks import Expectation, SubmissionVerdict, check_submission
from validator.device import spread
from validator.merge import GateLoss, Tensors

REASON_CHARS = 200

# miner -> (its commitment, the file holding the revealed blob, or None when it could not be fetched)
Submissions = Mapping[str, tuple[str, Path | None]]


class ScoringStopped(Exception):
    """`Scorer.score_round` stopped before scoring every submission because its caller asked it to."""


@dataclass(frozen=True)
class ScoreResult:
    """L_base, one entry per submission (sorted by miner), and the expert tensors of accepted blobs, as
    `Scorer.held` keeps them (read when asked for, not held in memory)."""

    base_loss: float
    entries: list[ScoreEntry]
    accepted: dict[str, Tensors] = field(default_factory=dict)

    def report(self, round: int, base: str) -> ScoreReport:
        """The ScoreReport to gossip for `round`, scored against the global state `base`."""
        return ScoreReport(round=round, base=base, base_loss=self.base_loss, entries=tuple(self.entries))


def apply_global(model: torch.nn.Module, adapter: MoEAdapter, tensors: Mapping[str, torch.Tensor]) -> None:
    """Put the global expert tensors into the model in place."""
    insert(model, adapter, tensors)


class Scorer:
    """Scores submissions against one network's held-out data with a resident base model."""

    def __init__(
        self,
        model: torch.nn.Module,
        adapter: MoEAdapter,
        spec: NetworkSpec,
        heldout: torch.Tensor,
        pad_id: int = BYTE_PAD,
        device: str = "cpu",
        batch_size: int = 16,
        weights: Literal["checkpoint", "int8"] = "checkpoint",
    ) -> None:
        """`heldout`: the validators' held-out sequences, [N, seq_len] token ids; `pad_id` is not scored.

        The model is moved to `device` (or spread over the GPUs for `auto`) once, here; with `weights` int8
        its frozen linear layers are first held in int8 (`training.device.hold_int8`; the experts stay).
        """
        if batch_size < 1:
            raise ValueError(f"validator.batch_size must be at least 1, got {batch_size}")
        if heldout.shape[0] < spec.data.heldout_sequences:
            raise ValueError(
                f"held-out data has {heldout.shape[0]} sequences; the spec scores "
                f"{spec.data.heldout_sequences} per round"
            )
        self.model = model.eval()
        if weights == "int8":
            hold_int8(model, [adapter.router(model, layer) for layer in adapter.moe_layers(model)])
        if device == "auto":
            if not getattr(model, "hf_device_map", None):
                spread(model)
            spread_model: Any = model  # a transformers model: its inputs go where its embeddings are
            self.device = spread_model.get_input_embeddings().weight.device
        else:
            self.device = torch.device(device)
            model.to(self.device)
        self.batch_size = batch_size
        self.adapter = adapter
        self.spec = spec
        self.heldout = heldout
        self.pad_id = pad_id
        self.shapes = expected_shapes(model, adapter, spec.group)
        self.pgrad = pgrad_config(spec)

    def check(
        self, round: int, miner: str, commitment: str, data: bytes, global_hash: str,
        global_tensors: Mapping[str, torch.Tensor] | None = None,
    ) -> SubmissionVerdict:
        """Run the submission checks on one blob (also for miners this validator does not score).

        An accepted verdict holds the miner's expert tensors: a pgrad blob is rebuilt against
        `global_tensors`, the state `global_hash` (required in a pgrad network), a tensor at a time when asked
        for (`training.pgrad.Rebuilt`).
        """
        expect = Expectation(
            network=self.spec.network_id,
            round=round,
            miner=miner,
            base=global_hash,
            group=self.spec.group,
            shapes=self.shapes,
            dtype=self.spec.model.dtype,
            commitment=commitment,
            max_header_bytes=self.spec.limits.max_header_bytes,
            pgrad=self.pgrad,
            predecessor=None if self.spec.lineage is None else self.spec.lineage.predecessor,
            since_round=self.spec.first_round,
        )
        verdict = check_submission(data, expect)
        if self.pgrad is None or not verdict.ok:
            return verdict
        if global_tensors is None:
            raise ValueError("a pgrad submission is rebuilt from the global state; pass global_tensors")
        assert verdict.tensors is not None
        return replace(verdict, tensors=Rebuilt(global_tensors, verdict.tensors, self.pgrad, expect.draw))

    def held(self, verdict: SubmissionVerdict, path: Path) -> Tensors:
        """An accepted submission's experts as a validator keeps them from scoring to the merge, which reads them
        name by name: read from its blob file at `path` a tensor at a time (the bytes `verdict` checked), or,
        in a pgrad network, rebuilt from the compressed blob a tensor at a time. Holding one costs its header
        or its compressed tensors, where its experts are the group once more (0.4 GB in bf16 at OLMoE-1B-7B's
        size)."""
        if not verdict.ok or verdict.tensors is None or verdict.header is None:
            raise ValueError("only an accepted verdict's experts are kept")
        return verdict.tensors if self.pgrad is not None else BlobFile(path, verdict.header)

    def score_round(
        self,
        round: int,
        round_seed: str,
        global_tensors: Mapping[str, torch.Tensor],
        global_hash: str,
        submissions: Submissions,
        keep_going: Callable[[], bool] = lambda: True,
    ) -> ScoreResult:
        """Score every submission against the global state `global_hash` (held in `global_tensors`).

        `keep_going` is asked before each submission; once it says False (the caller is going away)
        scoring stops with ScoringStopped rather than return a partial result."""
        sequences = heldout_subset(self.heldout, round_seed, self.spec.data.heldout_sequences)
        apply_global(self.model, self.adapter, global_tensors)
        base_loss = self.loss(sequences)
        if not math.isfinite(base_loss):
            raise ValueError(f"the global state {global_hash[:12]} has a non-finite held-out loss")
        entries: list[ScoreEntry] = []
        accepted: dict[str, Tensors] = {}
        for miner in sorted(submissions):
            if not keep_going():
                raise ScoringStopped(f"round {round}: stopped after {len(entries)} of {len(submissions)} submissions")
            commitment, path = submissions[miner]
            data = _read(path)
            if data is None:
                entries.append(
                    ScoreEntry(miner=miner, commitment=commitment, verdict="missing", reason="missing")
                )
                continue
            verdict = self.check(round, miner, commitment, data, global_hash, global_tensors)
            if not verdict.ok:
                entries.append(_reject(miner, commitment, verdict.reason))
                continue
            assert verdict.tensors is not None
            # loss_with_experts restores the rows it replaced, so the model keeps the global state.
            loss = loss_with_experts(
                self.model, self.adapter, verdict.tensors, sequences, self.batch_size, self.device, self.pad_id
            ).loss
            if not math.isfinite(loss):
                entries.append(_reject(miner, commitment, "non-finite loss"))
                continue
            entries.append(ScoreEntry(miner=miner, commitment=commitment, loss=loss, verdict="accept"))
            assert path is not None
            accepted[miner] = self.held(verdict, path)
        return ScoreResult(base_loss=base_loss, entries=entries, accepted=accepted)

    def loss(self, sequences: torch.Tensor) -> float:
        """Held-out loss of the model as it stands, on the scoring device in scoring-sized batches."""
        return heldout_loss(self.model, sequences, self.batch_size, self.device, self.pad_id).loss


def report_rows(total: int, round_seed: str, spec: NetworkSpec) -> torch.Tensor:
    """Indices of the held-out rows (of `total`) that the round's scores and reported loss use, sorted."""
    rows: torch.Tensor = heldout_subset(torch.arange(total), round_seed, spec.data.heldout_sequences)
    return rows


def gate_rows(total: int, round_seed: str, spec: NetworkSpec) -> torch.Tensor:
    """Indices of the held-out rows the merge gate scores, sorted: `data.gate_sequences` of the rows that
    `report_rows` leaves out, drawn by the gate seed, so choosing a state does not bias its reported loss."""
    free = torch.ones(total, dtype=torch.bool)
    free[report_rows(total, round_seed, spec)] = False
    rows: torch.Tensor = heldout_subset(torch.arange(total)[free], gate_seed(round_seed), spec.data.gate_sequences)
    return rows


def check_gate_data(spec: NetworkSpec, heldout_rows: int) -> None:
    """ValueError unless a held-out file of `heldout_rows` sequences holds the scored and the gate's rows apart."""
    need = spec.data.heldout_sequences + spec.data.gate_sequences
    if heldout_rows < need:
        raise ValueError(f"held-out data has {heldout_rows} sequences; the spec scores {spec.data.heldout_sequences} "
                         f"per round and gates the merge on {spec.data.gate_sequences} others, {need} in all")


def gate_measure(scorer: Scorer, round_seed: str, general: torch.Tensor | None) -> Callable[[Tensors], GateLoss]:
    """The merge gate's measure for one round: a candidate state's loss on the gate rows of the scorer's
    held-out data and, where the validator holds `general` (general-domain held-out sequences), on the
    `data.gate_sequences` of them (all, if fewer) the gate seed draws; the gate rows' losses are kept row by row
    (`GateLoss.rows`) for the gate's paired comparison. The model keeps its experts."""
    spec = scorer.spec
    gate = scorer.heldout[gate_rows(scorer.heldout.shape[0], round_seed, spec)]
    drawn = None if general is None else heldout_subset(
        general, gate_seed(round_seed), min(spec.data.gate_sequences, general.shape[0]))

    def loss(tensors: Tensors, sequences: torch.Tensor) -> LossResult:
        return loss_with_experts(scorer.model, scorer.adapter, tensors, sequences, scorer.batch_size,
                                 scorer.device, scorer.pad_id)

    def measure(tensors: Tensors) -> GateLoss:
        target = loss(tensors, gate)
        shares = tuple(row * len(target.row_sums) / target.tokens for row in target.row_sums)
        return GateLoss(target.loss, None if drawn is None else loss(tensors, drawn).loss, shares)

    return measure


class CheckedSubmissions:
    """The checked submissions of one round, by miner, as `Scorer.held` keeps them (read from their blob files
    a tensor at a time): what a validator's EVALUATE and MERGE both use."""

    def __init__(self, round: int) -> None:
        self.round = round
        self._tensors: dict[str, Tensors] = {}

    def add(self, round: int, tensors: Mapping[str, Tensors]) -> None:
        if round != self.round:
            self.round, self._tensors = round, {}
        self._tensors.update(tensors)

    def of(self, round: int) -> dict[str, Tensors]:
        """The round's checked submissions whose blob files are still stored (one gone since is fetched again)."""
        if round != self.round:
            return {}
        return {miner: t for miner, t in self._tensors.items() if not isinstance(t, BlobFile) or t.path.is_file()}


def _read(path: Path | None) -> bytes | None:
    """A submission's bytes, read when it is scored (one at a time: each can be GBs); None if it is gone."""
    if path is None:
        return None
    try:
        return path.read_bytes()
    except OSError:
        return None


def _reject(miner: str, commitment: str, reason: str) -> ScoreEntry:
    return ScoreEntry(miner=miner, commitment=commitment, verdict="reject", reason=reason[:REASON_CHARS])

"""Proof-of-Loss on tiny CPU models: a miner trained on the held-out domain beats noise and laziness,
hostile blobs are refused with the checks' reason, and the model keeps the global state."""

from __future__ import annotations

import copy
import hashlib
import math
import tempfile
from pathlib import Path

import pytest
import torch

from protocol.ranking import rank_round, scores_from_report
from protocol.seeds import gate_seed
from protocol.spec import NetworkSpec, parse_spec
from tests.conftest import MINER_OFFSET, make_identity, make_spec_dict
from training.adapters import adapter_for
from training.blob import BlobMeta, blob_hash, encode_blob
from training.corpus import generate
from training.data import batches, heldout_subset, pack
from training.evaluate import heldout_loss
from training.experts import extract
from training.model import state_hash
from training.tiny import build_tiny_model, tiny_config
from training.tokenizer import ByteTokenizer
from training.trainer import TrainConfig, train_experts
from validator.merge import GateLoss
from validator.scoring import (
    Scorer,
    ScoreResult,
    ScoringStopped,
    check_gate_data,
    gate_measure,
    gate_rows,
    report_rows,
)

ROUND = 1
SEED = hashlib.sha256(b"scoring-round").hexdigest()
GOOD, NOISE, LAZY, GARBAGE, STALE, ABSENT = (make_identity(MINER_OFFSET + i).node_id for i in range(6))


class Setup:
    """A tiny base model, its spec, a validator's Scorer and one round's submissions."""

    def __init__(self, family: str, base_spec: NetworkSpec) -> None:
        self.model = _warmed(build_tiny_model(family, tiny_config(family), seed=0))
        self.adapter = adapter_for(family)
        group = {layer: [0, 1, 2, 3] for layer in self.adapter.moe_layers(self.model)}
        model_spec = base_spec.model.model_copy(
            update={"family": family, "base_hash": state_hash(self.model)}
        )
        data_spec = base_spec.data.model_copy(update={"seq_len": 64, "heldout_sequences": 6})
        self.spec = base_spec.model_copy(update={"model": model_spec, "group": group, "data": data_spec})
        heldout = pack(generate("arithmetic", 80, seed=1), ByteTokenizer(), 64)
        self.scorer = Scorer(self.model, self.adapter, self.spec, heldout)
        self.global_tensors = extract(self.model, self.adapter, group)
        self.head = self.spec.model.base_hash

    def blob(self, miner: str, tensors: dict[str, torch.Tensor], base: str | None = None) -> bytes:
        meta = BlobMeta(
            network=self.spec.network_id,
            round=ROUND,
            miner=miner,
            base=base or self.head,
            group=self.spec.group,
        )
        return encode_blob(tensors, meta)

    def trained(self, steps: int) -> dict[str, torch.Tensor]:
        """A miner that trains the group on arithmetic (the held-out domain; different documents)."""
        model = copy.deepcopy(self.model)
        train = pack(generate("arithmetic", 80, seed=2), ByteTokenizer(), 64)
        cfg = TrainConfig(steps=steps, lr=1e-2, batch_size=8)
        return train_experts(model, self.adapter, self.spec.group, batches(train, 8, seed=0), cfg).tensors

    def score(self, submissions: dict[str, tuple[str, Path | None]]) -> ScoreResult:
        return self.scorer.score_round(ROUND, SEED, self.global_tensors, self.head, submissions)


def _warmed(model: torch.nn.Module, steps: int = 40) -> torch.nn.Module:
    """Give the random base some language (prose and code), so that noisy experts can hurt it."""
    docs = generate("prose", 40, seed=4) + generate("code", 40, seed=4)
    data = batches(pack(docs, ByteTokenizer(), 64), 8, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    torch.manual_seed(0)
    model.train()
    for _, ids_BL in zip(range(steps), data, strict=False):
        optimizer.zero_grad()
        model(input_ids=ids_BL, labels=ids_BL).loss.backward()
        optimizer.step()
    return model.eval()


_BLOBS = tempfile.TemporaryDirectory(prefix="tessera-scoring-")  # the submissions' files, as a node's blob store


def stored_submission(data: bytes) -> tuple[str, Path]:
    """A revealed submission as a validator scores it: its commitment and the file its bytes were fetched to."""
    path = Path(_BLOBS.name) / blob_hash(data)
    path.write_bytes(data)
    return blob_hash(data), path


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models run ~50x slower when torch's threads fight other processes for two cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def qwen() -> tuple[Setup, dict[str, tuple[str, Path | None]], ScoreResult]:
    setup = Setup("qwen3_moe", parse_spec(make_spec_dict()))
    g = torch.Generator().manual_seed(3)
    noisy = {n: t + 0.5 * torch.randn(t.shape, generator=g) for n, t in setup.global_tensors.items()}
    garbage = torch.randint(0, 256, (512,), generator=g, dtype=torch.uint8).numpy().tobytes()
    submissions: dict[str, tuple[str, Path | None]] = {
        GOOD: stored_submission(setup.blob(GOOD, setup.trained(steps=12))),
        NOISE: stored_submission(setup.blob(NOISE, noisy)),
        LAZY: stored_submission(setup.blob(LAZY, setup.global_tensors)),
        GARBAGE: stored_submission(garbage),
        STALE: stored_submission(setup.blob(STALE, setup.global_tensors, base="ee" * 32)),
        ABSENT: ("ab" * 32, None),
    }
    return setup, submissions, setup.score(submissions)


def test_trained_miner_ranks_above_noise_and_lazy(qwen) -> None:
    setup, submissions, result = qwen
    report = result.report(ROUND, setup.head)
    validator = setup.spec.validators[0].key
    commitments = {m: c for m, (c, _) in submissions.items()}
    ranking = rank_round(
        {validator: scores_from_report(report, commitments)},
        {m: [validator] for m in submissions},
        {validator: report.base_loss},
        commitments,
        (),
        setup.spec.rewards.top_k,
    )
    assert ranking.ranked() == (GOOD,) and ranking.points() == {GOOD: 1.0}
    assert ranking.result(GOOD).utility > 0.05
    assert ranking.result(NOISE).loss > result.base_loss and ranking.result(NOISE).reason == "no utility"
    lazy = ranking.result(LAZY)
    assert lazy.loss == result.base_loss and lazy.utility == 0.0 and lazy.reason == "no utility"
    assert set(result.accepted) == {GOOD, NOISE, LAZY}


def test_refusals_carry_the_checks_reason(qwen) -> None:
    setup, submissions, result = qwen
    entries = {e.miner: e for e in result.entries}
    assert [e.miner for e in result.entries] == sorted(submissions)
    garbage = entries[GARBAGE]
    commitment, path = submissions[GARBAGE]
    assert path is not None
    assert garbage.verdict == "reject" and garbage.loss is None
    assert garbage.reason == setup.scorer.check(ROUND, GARBAGE, commitment, path.read_bytes(), setup.head).reason
    assert garbage.reason.startswith(("malformed header", "header too large", "truncated"))
    assert (entries[STALE].verdict, entries[STALE].reason) == ("reject", "stale base")
    assert (entries[ABSENT].verdict, entries[ABSENT].loss, entries[ABSENT].reason) == ("missing", None, "missing")
    forged = setup.blob(GOOD, setup.global_tensors)
    assert setup.scorer.check(ROUND, GOOD, submissions[GOOD][0], forged, setup.head).reason == "hash mismatch"


def test_scoring_is_deterministic_and_leaves_the_global_state(qwen) -> None:
    setup, submissions, result = qwen
    after = extract(setup.model, setup.adapter, setup.spec.group)
    assert all(torch.equal(after[n], setup.global_tensors[n]) for n in after)
    again = setup.score(submissions)
    assert (again.base_loss, again.entries) == (result.base_loss, result.entries)


def test_deepseek_v3_scores_a_trained_miner(spec: NetworkSpec) -> None:
    setup = Setup("deepseek_v3", spec)
    submissions = {
        GOOD: stored_submission(setup.blob(GOOD, setup.trained(steps=8))),
        LAZY: stored_submission(setup.blob(LAZY, setup.global_tensors)),
    }
    result = setup.score(submissions)
    losses = {e.miner: e.loss for e in result.entries}
    assert losses[LAZY] == result.base_loss
    assert losses[GOOD] is not None and losses[GOOD] < result.base_loss
    after = extract(setup.model, setup.adapter, setup.spec.group)
    assert all(torch.equal(after[n], setup.global_tensors[n]) for n in after)


def test_scoring_runs_on_the_configured_device_in_configured_batches(qwen) -> None:
    setup, submissions, _ = qwen
    model = copy.deepcopy(setup.model)
    scorer = Scorer(model, setup.adapter, setup.spec, setup.scorer.heldout, device="meta", batch_size=4)
    assert {p.device.type for p in model.parameters()} == {"meta"}
    layer = setup.adapter.moe_layers(model)[0]
    seen: list[tuple[str, str, int]] = []

    def record(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        experts = setup.adapter.experts(module, layer)
        seen.append((kwargs["input_ids"].device.type, experts.gate_up_proj.device.type, kwargs["input_ids"].shape[0]))

    model.register_forward_pre_hook(record, with_kwargs=True)
    with pytest.raises((NotImplementedError, RuntimeError), match="meta"):
        scorer.score_round(ROUND, SEED, setup.global_tensors, setup.head, {GOOD: submissions[GOOD]})
    # L_base on 6 held-out sequences in batches of 4: the first batch reached the model on `meta`.
    assert seen == [("meta", "meta", 4)]


def test_batch_size_setting_does_not_change_the_losses(qwen) -> None:
    setup, submissions, result = qwen
    scorer = Scorer(setup.model, setup.adapter, setup.spec, setup.scorer.heldout, batch_size=4)
    picked = {m: submissions[m] for m in (GOOD, NOISE)}
    again = scorer.score_round(ROUND, SEED, setup.global_tensors, setup.head, picked)
    assert again.base_loss == pytest.approx(result.base_loss, abs=1e-6)
    before = {e.miner: e.loss for e in result.entries}
    assert all(e.loss == pytest.approx(before[e.miner], abs=1e-6) for e in again.entries)
    with pytest.raises(ValueError, match="validator.batch_size"):
        Scorer(setup.model, setup.adapter, setup.spec, setup.scorer.heldout, batch_size=0)


def test_scoring_stops_between_submissions_when_told_and_leaves_the_global_state(qwen) -> None:
    setup, submissions, _ = qwen
    asked: list[int] = []

    def keep_going() -> bool:
        asked.append(1)
        return len(asked) <= 2  # score two submissions, then stop

    with pytest.raises(ScoringStopped, match="stopped after 2 of 6 submissions"):
        setup.scorer.score_round(ROUND, SEED, setup.global_tensors, setup.head, submissions, keep_going)
    held = extract(setup.model, setup.adapter, setup.spec.group)  # no miner's experts left swapped in
    assert all(torch.equal(held[name], setup.global_tensors[name]) for name in setup.global_tensors)


def test_l_base_is_the_loss_on_the_spec_count_of_held_out_rows_the_seed_picks(qwen) -> None:
    setup, _, result = qwen
    n = setup.spec.data.heldout_sequences
    expected = heldout_loss(setup.model, heldout_subset(setup.scorer.heldout, SEED, n), 16, "cpu").loss
    assert result.base_loss == expected


def test_held_out_data_shorter_than_the_spec_asks_is_refused(qwen) -> None:
    setup, _, _ = qwen
    n = setup.spec.data.heldout_sequences
    Scorer(setup.model, setup.adapter, setup.spec, setup.scorer.heldout[:n])  # exactly enough
    with pytest.raises(ValueError, match=f"held-out data has {n - 1} sequences; the spec scores {n} per round"):
        Scorer(setup.model, setup.adapter, setup.spec, setup.scorer.heldout[: n - 1])


def test_a_global_state_with_a_non_finite_loss_is_refused(qwen) -> None:
    setup, submissions, _ = qwen
    scorer = Scorer(copy.deepcopy(setup.model), setup.adapter, setup.spec, setup.scorer.heldout)
    broken = {name: torch.full_like(t, float("nan")) for name, t in setup.global_tensors.items()}
    with pytest.raises(ValueError, match=f"the global state {setup.head[:12]} has a non-finite held-out loss"):
        scorer.score_round(ROUND, SEED, broken, setup.head, {LAZY: submissions[LAZY]})


def test_finite_experts_that_overflow_the_forward_pass_are_rejected(qwen) -> None:
    setup, _, _ = qwen
    huge = {name: torch.full_like(t, 3e38) for name, t in setup.global_tensors.items()}  # finite: passes the checks
    result = setup.score({NOISE: stored_submission(setup.blob(NOISE, huge))})
    (entry,) = result.entries
    assert (entry.verdict, entry.reason, entry.loss) == ("reject", "non-finite loss", None)
    assert result.accepted == {}


def test_a_check_reason_longer_than_a_report_holds_is_cut_to_200_characters(qwen) -> None:
    setup, _, _ = qwen
    tensors = dict(setup.global_tensors)
    name = sorted(tensors)[0]
    tensors[name] = tensors[name].reshape((1,) * 100 + (-1,))  # the checks' reason lists all 101 dims
    data = setup.blob(NOISE, tensors)
    long_reason = setup.scorer.check(ROUND, NOISE, blob_hash(data), data, setup.head).reason
    assert long_reason.startswith(f"wrong shape for {name}: [1, 1,") and len(long_reason) > 200
    (entry,) = setup.score({NOISE: stored_submission(data)}).entries
    assert (entry.verdict, entry.reason) == ("reject", long_reason[:200])


def test_auto_device_keeps_a_model_that_already_has_a_device_map_where_it_is(qwen) -> None:
    setup, _, _ = qwen
    placed = copy.deepcopy(setup.model)
    placed.hf_device_map = {"": "cpu"}
    assert Scorer(placed, setup.adapter, setup.spec, setup.scorer.heldout, device="auto").device == torch.device("cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="spreading over GPUs is the GPU tests' business")
def test_auto_device_spreads_a_model_without_a_device_map_and_needs_gpus_for_it(qwen) -> None:
    setup, _, _ = qwen
    with pytest.raises(ValueError, match="spreads the model over CUDA GPUs, but this machine has none"):
        Scorer(copy.deepcopy(setup.model), setup.adapter, setup.spec, setup.scorer.heldout, device="auto")


@pytest.mark.parametrize("round_seed", [hashlib.sha256(f"gate-{i}".encode()).hexdigest() for i in range(20)])
def test_the_gate_rows_and_the_scored_rows_never_overlap(qwen, round_seed: str) -> None:
    setup, _, _ = qwen
    total, spec = setup.scorer.heldout.shape[0], setup.spec
    scored, gated = report_rows(total, round_seed, spec), gate_rows(total, round_seed, spec)
    assert len(scored) == spec.data.heldout_sequences and len(gated) == spec.data.gate_sequences
    assert not set(scored.tolist()) & set(gated.tolist()) and len(set(gated.tolist())) == len(gated)
    assert torch.equal(setup.scorer.heldout[scored], heldout_subset(setup.scorer.heldout, round_seed,
                                                                    spec.data.heldout_sequences))
    assert torch.equal(gated, gate_rows(total, round_seed, spec))  # every validator draws the same rows


def test_the_gate_measures_a_state_on_its_own_rows_and_on_general_data(qwen) -> None:
    setup, _, _ = qwen
    spec, heldout = setup.spec, setup.scorer.heldout
    general = pack(generate("prose", 40, seed=9), ByteTokenizer(), 64)
    measured = gate_measure(setup.scorer, SEED, general)(setup.global_tensors)
    on_gate_rows = heldout_loss(setup.model, heldout[gate_rows(heldout.shape[0], SEED, spec)], 16, "cpu")
    drawn = heldout_subset(general, gate_seed(SEED), spec.data.gate_sequences)
    assert (measured.loss, measured.general) == (on_gate_rows.loss, heldout_loss(setup.model, drawn, 16, "cpu").loss)
    # row by row, each row's share of the mean: what the gate pairs between candidates
    rows = spec.data.gate_sequences
    assert len(measured.rows) == rows and math.fsum(measured.rows) / rows == pytest.approx(measured.loss, rel=1e-12)
    assert measured.rows == tuple(s * rows / on_gate_rows.tokens for s in on_gate_rows.row_sums)
    assert gate_measure(setup.scorer, SEED, None)(setup.global_tensors) == GateLoss(on_gate_rows.loss, None,
                                                                                    measured.rows)


def test_held_out_data_without_room_for_the_gate_is_refused(qwen) -> None:
    setup, _, _ = qwen
    need = setup.spec.data.heldout_sequences + setup.spec.data.gate_sequences
    check_gate_data(setup.spec, need)
    with pytest.raises(ValueError, match=f"held-out data has {need - 1} sequences; the spec scores"):
        check_gate_data(setup.spec, need - 1)

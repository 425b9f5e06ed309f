"""Compressed pseudo-gradients in the validator: a checked pgrad blob is scored and merged as the
miner's experts rebuilt from it (Φ_i = Φ_t − decode(G_i)), a full-experts blob is refused in a pgrad
network, and near-duplicates are found on the decoded pseudo-gradients (with partitions, over the
chunks both miners drew). Tiny CPU model."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from protocol.assignment import assign
from protocol.messages import ScoreReport
from protocol.spec import parse_spec
from tests.conftest import make_spec_dict
from tests.validator.test_scoring import GOOD, LAZY, NOISE, ROUND, SEED, STALE, Setup, stored_submission
from training.blob import PGRAD_FORMAT, BlobMeta, encode_blob
from training.experts import pseudo_gradient
from training.pgrad import PgradConfig, chunk_draw, encode, rebuild
from validator.merge import MergeResult, merge_round

COPIER = STALE
CFG = PgradConfig(chunk=1024, topk=64, quant="int8")
PARTITIONED = PgradConfig(chunk=256, topk=32, quant="2bit", partitions=2)


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """Tiny models run ~50x slower when torch's threads fight other processes for two cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _setup(cfg: PgradConfig) -> Setup:
    submission = {"format": "pgrad", "chunk": cfg.chunk, "topk": cfg.topk, "quant": cfg.quant,
                  "partitions": cfg.partitions}
    return Setup("qwen3_moe", parse_spec({**make_spec_dict(), "submission": submission}))


@pytest.fixture(scope="module")
def setup() -> Setup:
    return _setup(CFG)


def _pgrad_blob(setup: Setup, miner: str, grads: dict[str, torch.Tensor], cfg: PgradConfig = CFG) -> tuple[str, Path]:
    tensors, _ = encode(grads, None, cfg, chunk_draw(setup.spec.network_id, ROUND, miner))
    meta = BlobMeta(network=setup.spec.network_id, round=ROUND, miner=miner, base=setup.head,
                    group=setup.spec.group, format=PGRAD_FORMAT)
    return stored_submission(encode_blob(tensors, meta))


def test_a_pgrad_blob_is_scored_as_its_rebuilt_experts(setup: Setup) -> None:
    grads = pseudo_gradient(setup.global_tensors, setup.trained(steps=12))
    zero = {name: torch.zeros_like(t) for name, t in setup.global_tensors.items()}
    good = _pgrad_blob(setup, GOOD, grads)
    experts = setup.blob(NOISE, setup.global_tensors)
    result = setup.score({GOOD: good, LAZY: _pgrad_blob(setup, LAZY, zero), NOISE: stored_submission(experts)})
    entries = {e.miner: e for e in result.entries}
    assert entries[GOOD].verdict == "accept" and entries[GOOD].loss < result.base_loss  # type: ignore[operator]
    assert entries[LAZY].loss == result.base_loss  # a zero pseudo-gradient rebuilds the global state exactly
    assert (entries[NOISE].verdict, entries[NOISE].reason) == ("reject", "wrong format")
    expected = rebuild(setup.global_tensors, encode(grads, None, CFG)[0], CFG)
    assert all(torch.equal(result.accepted[GOOD][name], expected[name]) for name in expected)
    with pytest.raises(ValueError, match="global_tensors"):
        setup.scorer.check(ROUND, GOOD, good[0], good[1].read_bytes(), setup.head)


def test_near_duplicates_are_found_on_the_decoded_pseudo_gradients(setup: Setup) -> None:
    grads = pseudo_gradient(setup.global_tensors, setup.trained(steps=12))
    g = torch.Generator().manual_seed(5)
    other = {name: 0.01 * torch.randn(t.shape, generator=g) for name, t in grads.items()}
    blobs: dict[str, tuple[str, Path | None]] = {
        GOOD: _pgrad_blob(setup, GOOD, grads), COPIER: _pgrad_blob(setup, COPIER, grads),
        NOISE: _pgrad_blob(setup, NOISE, other),
    }
    assert blobs[GOOD][0] != blobs[COPIER][0]  # the copier re-signs the same update as its own blob
    merged = _scored_and_merged(setup, blobs)
    assert merged.duplicates == {GOOD, COPIER}
    assert merged.contributors == []  # the only improving updates are the duplicated pair


def test_one_update_sent_by_two_identities_on_their_own_chunks_is_a_near_duplicate() -> None:
    setup = _setup(PARTITIONED)
    grads = pseudo_gradient(setup.global_tensors, setup.trained(steps=12))
    own_run = pseudo_gradient(setup.global_tensors, setup.trained(steps=6))
    trainer = NOISE  # this identity sends its own run's update
    blobs: dict[str, tuple[str, Path | None]] = {
        GOOD: _pgrad_blob(setup, GOOD, grads, PARTITIONED), COPIER: _pgrad_blob(setup, COPIER, grads, PARTITIONED),
        trainer: _pgrad_blob(setup, trainer, own_run, PARTITIONED),
    }
    merged = _scored_and_merged(setup, blobs)
    assert merged.duplicates == {GOOD, COPIER}  # they agree exactly on the chunks both drew
    assert merged.contributors == [trainer]  # an update of the same data from another run is no copy


def _scored_and_merged(setup: Setup, blobs: dict[str, tuple[str, Path | None]]) -> MergeResult:
    result = setup.score(blobs)
    assert set(result.accepted) == set(blobs)
    validators = [v.key for v in setup.spec.validators]
    assignment = assign(SEED, sorted(blobs), validators, setup.spec.rewards.replication)
    report = result.report(ROUND, setup.head)
    reports = {v: ScoreReport(round=ROUND, base=setup.head, base_loss=report.base_loss,
                              entries=tuple(e for e in report.entries if v in assignment[e.miner]))
               for v in validators}
    momentum = {name: torch.zeros_like(t) for name, t in setup.global_tensors.items()}
    commitments = {m: blobs[m][0] for m in blobs}
    return merge_round(reports, assignment, commitments, result.accepted, dict(setup.global_tensors), momentum,
                       setup.spec, setup.head)

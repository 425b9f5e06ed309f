"""A pgrad miner's error-feedback buffer in storage: kept with the submission that left it, reloaded
after a reopen, and started empty (with a warning) when its blob is gone, holds another group or holds
a NaN."""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from miner.submission import ErrorFeedback
from node.duties.feedback import keep_feedback, load_feedback
from node.store.blobs import BlobStore
from node.store.db import Storage, Submission
from protocol.spec import parse_spec
from tests.conftest import make_spec_dict

SHAPES = {"layers.0.experts.1.down_proj": (4, 2), "layers.0.experts.1.gate_up_proj": (4, 4)}
PGRAD = parse_spec({**make_spec_dict(), "submission": {"format": "pgrad"}})


def _buffer() -> dict[str, torch.Tensor]:
    return {name: torch.arange(float(torch.Size(shape).numel())).reshape(shape) for name, shape in SHAPES.items()}


async def test_the_buffer_is_kept_with_its_submission_and_reloaded(tmp_path: Path) -> None:
    blobs = BlobStore(tmp_path / "blobs")
    store = await Storage.open(tmp_path / "node.db")
    try:
        ctx = SimpleNamespace(spec=PGRAD, storage=store, blobs=blobs)
        assert await load_feedback(SimpleNamespace(spec=parse_spec(make_spec_dict())), SHAPES) is None  # type: ignore[arg-type]
        assert await load_feedback(ctx, SHAPES) == ErrorFeedback()  # type: ignore[arg-type]
        assert await keep_feedback(ctx, ErrorFeedback()) is None  # type: ignore[arg-type]
        error_hash = await keep_feedback(ctx, ErrorFeedback(_buffer()))  # type: ignore[arg-type]
        await store.set_submission(3, Submission("ab" * 32, 10), error_hash)
    finally:
        await store.close()
    store = await Storage.open(tmp_path / "node.db")
    try:
        ctx = SimpleNamespace(spec=PGRAD, storage=store, blobs=blobs)
        loaded = await load_feedback(ctx, SHAPES)  # type: ignore[arg-type]
        assert loaded is not None and loaded.error is not None
        assert all(torch.equal(loaded.error[name], t) for name, t in _buffer().items())
        await store.set_submission(4, Submission("cd" * 32, 10))  # a submission without a buffer leaves the kept one
        assert await store.pgrad_error() == error_hash
    finally:
        await store.close()


@pytest.mark.parametrize("damage", ["deleted", "other group", "non-finite"])
async def test_an_unusable_buffer_starts_empty(tmp_path: Path, damage: str, caplog: pytest.LogCaptureFixture) -> None:
    blobs = BlobStore(tmp_path / "blobs")
    store = await Storage.open(tmp_path / "node.db")
    try:
        ctx = SimpleNamespace(spec=PGRAD, storage=store, blobs=blobs)
        buffer = _buffer()
        if damage == "non-finite":  # what an earlier build kept from a diverged round
            buffer["layers.0.experts.1.down_proj"][1, 0] = float("nan")
        error_hash = await keep_feedback(ctx, ErrorFeedback(buffer))  # type: ignore[arg-type]
        assert error_hash is not None
        await store.set_submission(0, Submission("ab" * 32, 10), error_hash)
        if damage == "deleted":
            blobs.delete(error_hash)
        shapes = {"layers.0.experts.2.down_proj": (4, 2)} if damage == "other group" else SHAPES
        with caplog.at_level(logging.WARNING):
            assert await load_feedback(ctx, shapes) == ErrorFeedback()  # type: ignore[arg-type]
        assert "starting from an empty one" in caplog.text
        assert damage != "non-finite" or "down_proj holds non-finite values" in caplog.text
    finally:
        await store.close()

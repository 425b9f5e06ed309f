"""Loading hub checkpoints through transformers and the streaming base hash, on every family."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch
from transformers.utils import logging as hf_logging

from training.adapters import ADAPTERS
from training.checkpoint import checkpoint_hash, meta_model, stored_tensors
from training.model import load_checkpoint, state_hash
from training.tiny import build_tiny_model, tiny_config

FAMILIES = tuple(ADAPTERS)


@pytest.mark.parametrize("family", FAMILIES)
def test_hub_checkpoint_loads_fused_and_hashes_the_same_streamed(family: str, tmp_path: Path) -> None:
    model = build_tiny_model(family, tiny_config(family), 3)
    model.save_pretrained(str(tmp_path))
    assert any(".experts.0." in key for key in stored_tensors(tmp_path)), "save_pretrained writes per-expert keys"
    loaded = load_checkpoint(tmp_path, attn_implementation="eager")
    assert checkpoint_hash(tmp_path) == state_hash(loaded) == state_hash(model)
    ids = torch.arange(24).reshape(2, 12)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=0)
    assert load_checkpoint(tmp_path).config._attn_implementation == "sdpa"


def test_sharded_checkpoint_hash_and_dtype_override(tmp_path: Path) -> None:
    model = build_tiny_model("mixtral", tiny_config("mixtral"), 1)
    model.save_pretrained(str(tmp_path), max_shard_size="100KB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 2
    assert checkpoint_hash(tmp_path) == state_hash(model)
    half = load_checkpoint(tmp_path, dtype=torch.bfloat16)
    assert half.dtype == torch.bfloat16 and state_hash(half) != state_hash(model)
    stored_half = tmp_path / "bf16"
    half.save_pretrained(str(stored_half))
    reloaded = load_checkpoint(stored_half)
    assert reloaded.dtype == torch.bfloat16 and checkpoint_hash(stored_half) == state_hash(reloaded) == state_hash(half)


def test_streaming_hash_sees_every_byte(tmp_path: Path) -> None:
    model = build_tiny_model("olmoe", tiny_config("olmoe"), 0)
    model.save_pretrained(str(tmp_path))
    before = checkpoint_hash(tmp_path)
    with torch.no_grad():
        model.model.layers[1].mlp.experts.down_proj[7, 3, 5] += 1e-3
    model.save_pretrained(str(tmp_path))
    assert checkpoint_hash(tmp_path) == state_hash(model) != before


def test_meta_model_holds_no_weights(tmp_path: Path) -> None:
    build_tiny_model("qwen3_moe", tiny_config("qwen3_moe"), 0).save_pretrained(str(tmp_path))
    assert all(p.device.type == "meta" for p in meta_model(tmp_path).parameters())


def test_concurrent_builds_do_not_disturb_each_other() -> None:
    config = tiny_config("olmoe")
    expected = {seed: state_hash(build_tiny_model("olmoe", config, seed)) for seed in (1, 2)}
    got: dict[int, str] = {}

    def build(seed: int) -> None:
        for _ in range(3):
            got[seed] = state_hash(build_tiny_model("olmoe", config, seed))
            torch.rand(1000)

    threads = [threading.Thread(target=build, args=(seed,)) for seed in (1, 2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert got == expected


def test_bad_checkpoint_directories_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no config.json"):
        load_checkpoint(tmp_path)
    model = build_tiny_model("qwen3_moe", tiny_config("qwen3_moe"), 0)
    model.config.save_pretrained(str(tmp_path))
    with pytest.raises(ValueError, match=r"no \*\.safetensors"):
        checkpoint_hash(tmp_path)
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match="pickled"):
        load_checkpoint(tmp_path)
    with pytest.raises(ValueError, match="pickled"):
        checkpoint_hash(tmp_path)


@pytest.mark.parametrize("shown", [True, False])
def test_a_load_leaves_transformers_progress_bar_and_async_loading_as_they_were(tmp_path: Path,
                                                                               monkeypatch: pytest.MonkeyPatch,
                                                                               shown: bool) -> None:
    build_tiny_model("qwen3_moe", tiny_config("qwen3_moe"), 1).save_pretrained(str(tmp_path))
    before = hf_logging.is_progress_bar_enabled()
    (hf_logging.enable_progress_bar if shown else hf_logging.disable_progress_bar)()
    monkeypatch.delenv("HF_DEACTIVATE_ASYNC_LOAD", raising=False)
    try:
        load_checkpoint(tmp_path, progress=not shown)
        assert hf_logging.is_progress_bar_enabled() is shown
        assert "HF_DEACTIVATE_ASYNC_LOAD" not in os.environ
    finally:
        (hf_logging.enable_progress_bar if before else hf_logging.disable_progress_bar)()

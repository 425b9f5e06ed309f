"""bench/gpu.py compares the same work: every run of a shape starts from the same weights and batches
(the CPU-scaled shape, as the benchmark runs it without CUDA)."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import pytest
import torch

from tests.bench.scripts import load_bench
from training.compressed import compress


@pytest.fixture(scope="module")
def gpu() -> ModuleType:
    return load_bench("gpu")


@pytest.fixture()
def bench(gpu: ModuleType) -> Any:
    shape = gpu.SHAPES["olmoe-1b-7b"]
    scaled = {**shape, "config": {**shape["config"], **gpu.CPU_SCALE}, "seq_len": gpu.CPU_SEQ_LEN,
              "selected": gpu.CPU_SELECTED}
    return gpu.Bench(scaled, torch.device("cpu"), 1, False)


def test_every_run_gets_the_same_weights_and_a_compressed_model_the_full_models_rows(gpu: ModuleType,
                                                                                   bench: Any) -> None:
    first = gpu._materialise(bench._meta_model(2), torch.device("cpu")).state_dict()
    second = gpu._materialise(bench._meta_model(2), torch.device("cpu")).state_dict()
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)
    meta = bench._meta_model(2)
    group = {layer: list(range(gpu.CPU_SELECTED)) for layer in bench.adapter.moe_layers(meta)}
    cut = gpu._materialise(compress(meta, bench.adapter, group, device="meta").model, torch.device("cpu"))
    for name, value in cut.state_dict().items():
        if name in first and not name.endswith("inv_freq"):
            assert torch.equal(value, first[name][: value.shape[0]]), name


def test_every_run_trains_on_the_same_batches(bench: Any) -> None:
    assert all(torch.equal(a, b) for a, b in zip(bench._batches(3), bench._batches(3), strict=True))


def test_full_fine_tuning_and_sparse_training_start_from_the_same_loss(bench: Any) -> None:
    bench.sparse("full", 2)
    bench.full_finetune(2)
    bench.sparse("compressed", 2)
    losses = bench.losses_before_update
    assert losses["fft_2_layers"] == pytest.approx(losses["full_2_layers"], rel=1e-3)
    assert set(losses) == {"full_2_layers", "fft_2_layers", "compressed_2_layers"}

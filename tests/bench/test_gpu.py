"""bench/gpu.py compares the same work: every run of a shape starts from the same weights and batches
(the CPU-scaled shape, as the benchmark runs it without CUDA); and it runs end to end on that shape, with the
memory plan's traced peak next to each memory figure."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from tests.bench.scripts import assert_positive, load_bench, run_bench, run_bench_program
from training.compressed import compress

pytestmark = pytest.mark.slow


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


def test_a_one_step_run_reports_every_figure_and_full_fine_tuning_starts_from_sparse_training_s_loss(
        tmp_path: Path) -> None:
    """The CPU-scaled shape on short sequences, the small shape whatever the machine: where torch sees a CUDA device
    the script runs as a program with CUDA hidden from it, elsewhere in this process."""
    args = ("--steps", "1", "--seq-len", "32")
    report = (run_bench_program("gpu", tmp_path / "gpu.json", *args, env={"CUDA_VISIBLE_DEVICES": ""})
              if torch.cuda.is_available() else run_bench("gpu", tmp_path / "gpu.json", *args))
    assert report["device"].startswith("cpu") and (report["steps"], report["seq_len"]) == (1, 32)
    assert_positive(report, "compressed_peak_gib", "compressed_tokens_per_s", "full_mode_peak_gib",
                    "full_mode_tokens_per_s", "compressed_vs_full_mode_memory", "compressed_vs_full_mode_tokens_per_s",
                    "slice_compressed_vs_fft_memory", "slice_tokens_per_s_ratio", "validator_seconds_per_submission",
                    "validator_bare_forward_seconds", "validator_overhead_ratio", "compressed_plan_peak_gib",
                    "full_mode_plan_peak_gib", "validator_plan_peak_gib")
    assert report["cpu_load_average_1min"] >= 0
    assert report["compressed_peak_gib"] < report["full_mode_peak_gib"]  # the compressed model holds fewer experts
    assert report["compressed_plan_peak_gib"] < report["full_mode_plan_peak_gib"]
    assert "compressed_plan_vs_measured" not in report  # a ratio to a measured peak only on CUDA
    slice_ = report["slice"]
    assert slice_["layers"] == 2
    for run in ("fft", "full", "compressed"):
        assert len(slice_[run]) == 2 and all(v > 0 for v in slice_[run]), run
    assert 0 < slice_["plan_peak_gib"]["compressed"] < slice_["plan_peak_gib"]["full"]
    losses = report["loss_before_update"]
    assert set(losses) == {"compressed_4_layers", "full_4_layers", "fft_2_layers", "full_2_layers",
                           "compressed_2_layers"}
    assert losses["fft_2_layers"] == pytest.approx(losses["full_2_layers"], rel=1e-3)

"""Miner benchmark: sparse expert training vs full fine-tuning of the same model on the same batches.

Each mode runs in its own subprocess (so peak memory is its own): it builds the same Qwen3-MoE
model (hidden 256, 4 MoE layers of 32 experts, expert intermediate 256, top-4), packs the same
synthetic arithmetic batches, runs one untimed warm-up step, then times `--steps` steps.
Both start from the same weights (seed 0) and see the same batches in the same order; the warm-up
step's loss is each side's loss before any update (`loss_before_update`, equal up to float error).
- sparse: `training.trainer.train_experts` on 1/8 of the experts of every layer (4 of 32);
- full:   AdamW over every parameter of the model, the same loss and gradient clipping.
Reported ratios (sparse / full):
- `throughput_ratio`: tokens per CPU-second of the median step (process CPU time is what other
  load on a shared machine disturbs least; the wall-clock ratio is reported beside it); target >= 1.2;
- `memory_ratio`: peak RSS (getrusage) of each mode's subprocess above the loaded torch runtime
  (measured before the model is built, the same in both modes): weights, gradients, optimizer
  state and activations, what a GPU's allocator would count; target <= 0.6. The whole-process
  ratio, runtime included, is reported beside it as `process_memory_ratio`;
- `payload_ratio`: blob bytes / full model bytes, next to the selected experts' bytes plus the
  blob header that the blob must consist of.
Usage: python bench/miner.py [--steps N] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.report import emit, out_file  # noqa: E402

FAMILY = "qwen3_moe"
OVERRIDES = {
    "hidden_size": 256, "num_hidden_layers": 4, "num_experts": 32, "moe_intermediate_size": 256,
    "num_experts_per_tok": 4, "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 64, "max_position_embeddings": 256,
}
SELECTED_PER_LAYER = 4
SEQ_LEN = 128
BATCH = 8
LR = 1e-3


def _rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _setup() -> tuple[Any, Any, dict[int, list[int]], Iterator[Any], int]:
    """Model, adapter, group and batches, plus the RSS of the loaded runtime before the model exists."""
    import torch

    from training.adapters import adapter_for
    from training.corpus import generate
    from training.data import batches, pack
    from training.tiny import build_tiny_model, tiny_config
    from training.tokenizer import ByteTokenizer

    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
    rss_runtime = _rss_bytes()
    model = build_tiny_model(FAMILY, tiny_config(FAMILY, **OVERRIDES), seed=0)
    adapter = adapter_for(FAMILY)
    group = {layer: list(range(0, 32, 32 // SELECTED_PER_LAYER)) for layer in adapter.moe_layers(model)}
    sequences = pack(generate("arithmetic", 3000, seed=0), ByteTokenizer(), SEQ_LEN)
    return model, adapter, group, batches(sequences, BATCH, seed=0), rss_runtime


class _StepClock:
    """Wraps the batch stream and timestamps each request, so each step's duration is known."""

    def __init__(self, stream: Iterator[Any]) -> None:
        self.stream = stream
        self.stamps: list[tuple[float, float]] = []

    def __iter__(self) -> _StepClock:
        return self

    def __next__(self) -> Any:
        self.stamps.append((time.perf_counter(), time.process_time()))
        return next(self.stream)

    def step_seconds(self) -> list[tuple[float, float]]:
        """(wall, process CPU) seconds of each step."""
        ends = [*self.stamps[1:], (time.perf_counter(), time.process_time())]
        return [(e[0] - s[0], e[1] - s[1]) for s, e in zip(self.stamps, ends, strict=True)]


def _worker(mode: str, steps: int) -> dict[str, Any]:
    model, adapter, group, stream, rss_runtime = _setup()
    if mode == "sparse":
        step_s, extra = _run_sparse(model, adapter, group, stream, steps)
    else:
        step_s, extra = _run_full(model, stream, steps)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    tokens = BATCH * SEQ_LEN
    wall = statistics.median(w for w, _ in step_s)
    cpu = statistics.median(c for _, c in step_s)
    return {"mode": mode, "steps": len(step_s), "seconds": sum(w for w, _ in step_s),
            "median_step_wall_s": wall, "median_step_cpu_s": cpu,
            "tokens_per_s": tokens / wall, "tokens_per_cpu_s": tokens / cpu,
            "peak_rss_bytes": peak, "rss_runtime_bytes": rss_runtime, **extra}


def _run_sparse(model: Any, adapter: Any, group: dict[int, list[int]], stream: Iterator[Any], steps: int
                ) -> tuple[list[tuple[float, float]], dict[str, Any]]:
    from training.blob import BlobMeta, encode_blob
    from training.trainer import TrainConfig, train_experts

    warm_up = train_experts(model, adapter, group, stream, TrainConfig(steps=1, lr=LR, batch_size=BATCH))
    clock = _StepClock(stream)
    result = train_experts(model, adapter, group, clock, TrainConfig(steps=steps, lr=LR, batch_size=BATCH))
    step_s = clock.step_seconds()
    meta = BlobMeta(network="0" * 64, round=0, miner="1" * 64, base="2" * 64, group=group)
    blob = encode_blob(result.tensors, meta)
    expert_bytes = sum(t.numel() * t.element_size() for t in result.tensors.values())
    model_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    return step_s, {"blob_bytes": len(blob), "expert_bytes": expert_bytes,
                    "model_bytes": model_bytes, "loss_before_update": warm_up.losses[0],
                    "first_loss": result.losses[0], "last_loss": result.losses[-1]}


def _run_full(model: Any, stream: Iterator[Any], steps: int) -> tuple[list[tuple[float, float]], dict[str, Any]]:
    import torch

    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)

    def step(ids: torch.Tensor) -> float:
        labels = ids.masked_fill(ids == 256, -100)
        loss = model(input_ids=ids, attention_mask=(ids != 256).long(), labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())

    before = step(next(stream))
    clock = _StepClock(stream)
    losses = [step(ids) for _, ids in zip(range(steps), clock, strict=False)]
    return clock.step_seconds(), {"loss_before_update": before, "first_loss": losses[0], "last_loss": losses[-1]}


def _spawn(mode: str, steps: int) -> dict[str, Any]:
    out = subprocess.run([sys.executable, __file__, "--worker", mode, "--steps", str(steps)],
                         capture_output=True, text=True, check=False, cwd=ROOT)
    if out.returncode != 0:
        raise RuntimeError(f"the {mode} worker failed:\n{out.stderr[-2000:]}")
    report: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", type=out_file)
    parser.add_argument("--worker", choices=("sparse", "full"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps must be at least 1, got {args.steps}")
    if args.worker:
        print(json.dumps(_worker(args.worker, args.steps)))
        return 0
    sparse, full = _spawn("sparse", args.steps), _spawn("full", args.steps)
    train_sparse = sparse["peak_rss_bytes"] - sparse["rss_runtime_bytes"]
    train_full = full["peak_rss_bytes"] - full["rss_runtime_bytes"]
    header = sparse["blob_bytes"] - sparse["expert_bytes"]
    report = {
        "model": {"family": FAMILY, **OVERRIDES, "selected_per_layer": SELECTED_PER_LAYER},
        "steps": args.steps, "batch": BATCH, "seq_len": SEQ_LEN, "threads": int(os.environ.get("BENCH_THREADS", "2")),
        "throughput_ratio": sparse["tokens_per_cpu_s"] / full["tokens_per_cpu_s"],
        "throughput_method": "tokens per process-CPU-second of the median step, per subprocess",
        "wall_throughput_ratio": sparse["tokens_per_s"] / full["tokens_per_s"],
        "memory_ratio": train_sparse / train_full,
        "memory_method": ("peak RSS (getrusage ru_maxrss) minus the RSS of the loaded torch runtime before the "
                          "model is built, per subprocess: weights, gradients, optimizer state, activations"),
        "process_memory_ratio": sparse["peak_rss_bytes"] / full["peak_rss_bytes"],
        "process_memory_method": "whole-process peak RSS, torch runtime included, per subprocess",
        "payload_ratio": sparse["blob_bytes"] / sparse["model_bytes"],
        "payload_bytes": sparse["blob_bytes"], "selected_expert_bytes": sparse["expert_bytes"],
        "blob_header_bytes": header, "full_model_bytes": sparse["model_bytes"],
        "payload_is_experts_plus_header": 0 < header <= 8 + (1 << 20),
        "loss_before_update": {"sparse": sparse["loss_before_update"], "full": full["loss_before_update"]},
        "sparse": sparse, "full": full,
    }
    emit(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

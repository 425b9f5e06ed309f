"""GPU benchmark: memory and speed of a consumer-GPU miner (`full` vs `compressed`) and a GPU validator.

Builds a model of a real MoE shape from its config (random bf16 weights, nothing downloaded) with
a fixed number of selected experts per layer and reports, in one run:
- `full` and `compressed` sparse training (micro-batch 1, sequence 2048): peak GPU memory
  (`torch.cuda.max_memory_allocated`) and tokens/s;
- a 4-layer slice (2 on CPU) of the same shape trained three ways (full fine-tuning with fp32 master weights and
  AdamW over every parameter, `full`, `compressed`) for the memory and speed ratios, since full
  fine-tuning of the whole shape does not fit one 80 GB GPU;
- validator seconds per submission (swap the experts in, held-out loss, restore) over a bare forward;
- next to each memory figure of the project's own work (`*_plan_peak_gib`), the peak `training.plan` traces
  for the same run on fake tensors before it starts, so a run on a GPU checks the plan (full fine-tuning is
  not the project's work and has none); on CUDA `*_plan_vs_measured` is the plan's peak over the measured one.
Every run of one shape starts from the same weights (each weight row drawn from a seed of its name
and row, so a compressed model's kept experts are the full model's) and trains on the same batches;
`loss_before_update` is each run's loss on its first batch before any update (the compressed model
is the pruned one, so its loss differs by the pruning alone).
Shapes: `olmoe-1b-7b` (16 layers, 64 experts, hidden 2048, expert intermediate 1024, top-8, 8
selected) and `qwen3-30b-a3b` (48 layers, 128 experts, hidden 2048, intermediate 768, top-8, 4
selected; only the compressed miner, which is what must fit a 24 GB card). Without CUDA it runs a
scaled-down shape on the CPU and says so in `device`; memory there is the bytes of weights,
trainable copies, gradients and AdamW state (not a peak). Imports only torch, transformers and
training/ (and the standard-library bench/report.py), so it runs on a GPU machine without the node's other dependencies.
Usage: python bench/gpu.py --out FILE.json [--shape olmoe-1b-7b|qwen3-30b-a3b] [--steps N] [--seq-len N]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import torch
from transformers import AutoConfig, AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.report import emit, out_file  # noqa: E402
from training.adapters import MoEAdapter, adapter_for, tensor_attr  # noqa: E402
from training.compressed import CompressedModel, compress  # noqa: E402
from training.evaluate import heldout_loss, loss_with_experts  # noqa: E402
from training.experts import extract  # noqa: E402
from training.plan import Setting, plan  # noqa: E402
from training.trainer import TrainConfig, train_experts  # noqa: E402

GIB = 1024**3
SHAPES: dict[str, dict[str, Any]] = {
    "olmoe-1b-7b": {
        "family": "olmoe", "selected": 8, "seq_len": 2048,
        "config": {"num_hidden_layers": 16, "num_experts": 64, "hidden_size": 2048, "intermediate_size": 1024,
                   "num_experts_per_tok": 8, "num_attention_heads": 16, "num_key_value_heads": 16,
                   "vocab_size": 50304, "max_position_embeddings": 4096},
    },
    "qwen3-30b-a3b": {
        "family": "qwen3_moe", "selected": 4, "seq_len": 2048,
        "config": {"num_hidden_layers": 48, "num_experts": 128, "hidden_size": 2048, "moe_intermediate_size": 768,
                   "intermediate_size": 6144, "num_experts_per_tok": 8, "num_attention_heads": 32,
                   "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 151936, "norm_topk_prob": True,
                   "max_position_embeddings": 4096},
    },
}
CPU_SCALE = {"num_hidden_layers": 4, "num_experts": 16, "hidden_size": 128, "intermediate_size": 64,
             "moe_intermediate_size": 64, "num_experts_per_tok": 4, "num_attention_heads": 4,
             "num_key_value_heads": 4, "head_dim": 32, "vocab_size": 1024, "bos_token_id": None,
             "eos_token_id": None, "pad_token_id": None}
CPU_SEQ_LEN, CPU_SELECTED, HELDOUT_SEQUENCES = 256, 2, 4


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=out_file, required=True, help="where to write the JSON results")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="olmoe-1b-7b")
    parser.add_argument("--steps", type=int, default=4, help="timed optimizer steps per run (one more warms up)")
    parser.add_argument("--checkpointing", action="store_true", help="activation checkpointing in sparse runs")
    parser.add_argument("--seq-len", type=int, help=f"tokens per sequence (default: the shape's, {CPU_SEQ_LEN} on CPU)")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    cuda = torch.cuda.is_available()
    shape = dict(SHAPES[args.shape])
    if not cuda:
        shape = {**shape, "config": {**shape["config"], **CPU_SCALE}, "seq_len": CPU_SEQ_LEN, "selected": CPU_SELECTED}
    if args.seq_len is not None:
        if not 2 <= args.seq_len <= shape["config"]["max_position_embeddings"]:
            parser.error(f"--seq-len must be from 2 to {shape['config']['max_position_embeddings']} (the shape's "
                         f"max_position_embeddings), got {args.seq_len}")
        shape["seq_len"] = args.seq_len
    device = torch.device("cuda" if cuda else "cpu")
    slice_layers = 4 if cuda else 2
    out: dict[str, Any] = {
        "shape": args.shape,
        "device": torch.cuda.get_device_name(0) if cuda else "cpu (scaled shape; no CUDA device, GPU targets unmeasured)",
        "config": shape["config"], "selected_per_layer": shape["selected"], "seq_len": shape["seq_len"],
        "micro_batch": 1, "steps": args.steps, "checkpointing": args.checkpointing,
        "memory": "peak torch.cuda.max_memory_allocated" if cuda else "bytes of weights + trainable state (not a peak)",
    }
    bench = Bench(shape, device, args.steps, args.checkpointing)
    layers = shape["config"]["num_hidden_layers"]
    compressed = bench.sparse("compressed", layers)
    out["compressed_peak_gib"], out["compressed_tokens_per_s"] = compressed
    out.update(bench.planned("compressed", layers, compressed[0], cuda))
    if args.shape == "olmoe-1b-7b":
        full = bench.sparse("full", layers)
        out["full_mode_peak_gib"], out["full_mode_tokens_per_s"] = full
        out.update(bench.planned("full", layers, full[0], cuda))
        out["compressed_vs_full_mode_memory"] = compressed[0] / full[0]
        out["compressed_vs_full_mode_tokens_per_s"] = compressed[1] / full[1]
        fft = bench.full_finetune(slice_layers)
        slice_full = bench.sparse("full", slice_layers)
        slice_compressed = bench.sparse("compressed", slice_layers)
        out["slice"] = {"layers": slice_layers, "fft": fft, "full": slice_full, "compressed": slice_compressed,
                        "plan_peak_gib": {"full": bench.plan_peak("miner", slice_layers, "full"),
                                          "compressed": bench.plan_peak("miner", slice_layers, "compressed")}}
        out["slice_compressed_vs_fft_memory"] = slice_compressed[0] / fft[0]
        out["slice_tokens_per_s_ratio"] = slice_compressed[1] / fft[1]
        out.update(bench.validator())
    out["loss_before_update"] = bench.losses_before_update
    if not cuda:  # timings on a shared CPU say little when it is busy; record how busy it was
        out["cpu_load_average_1min"] = os.getloadavg()[0]
    emit(dict(sorted(out.items())), args.out)
    return 0


class Bench:
    """One shape on one device: builds models and times training and scoring on them."""

    def __init__(self, shape: dict[str, Any], device: torch.device, steps: int, checkpointing: bool) -> None:
        self.shape, self.device, self.steps, self.checkpointing = shape, device, steps, checkpointing
        self.adapter: MoEAdapter = adapter_for(shape["family"])
        self.losses_before_update: dict[str, float] = {}
        """Each run's loss on its first batch before any update, by run (`compressed_16_layers`, `fft_4_layers`)."""

    def sparse(self, forward: Literal["full", "compressed"], layers: int) -> tuple[float, float]:
        """(memory GiB, tokens/s) of sparse training in `forward` mode on the first `layers` layers."""
        self._reset()
        meta = self._meta_model(layers)
        group = {layer: list(range(self.shape["selected"])) for layer in self.adapter.moe_layers(meta)}
        if forward == "compressed":  # unselected experts exist only on `meta`: never built, never on the device
            cut = compress(meta, self.adapter, group, device="meta")
            target: torch.nn.Module | CompressedModel = CompressedModel(
                _materialise(cut.model, self.device), self.adapter, cut.group)
        else:
            target = _materialise(meta, self.device)
        cfg = TrainConfig(steps=self.steps + 2, lr=1e-4, batch_size=1, forward=forward, device=str(self.device),
                          checkpointing=self.checkpointing, pad_id=-1)
        clock = _Clock(self._batches(self.steps + 1))
        result = train_experts(target, self.adapter, group, iter(clock), cfg)
        self.losses_before_update[f"{forward}_{layers}_layers"] = result.losses[0]
        trainable = sum(len(e) for e in group.values()) * _expert_bytes(meta, self.adapter) * 4  # copy, grad, AdamW
        model = target.model if isinstance(target, CompressedModel) else target
        return self._memory(model, trainable), self._tokens_per_s(clock)

    def plan_peak(self, role: Literal["miner", "validator"], layers: int,
                  forward: Literal["full", "compressed"] = "compressed") -> float:
        """GiB of the peak `training.plan` traces for this run, as the node would plan it before it starts."""
        setting = Setting(role=role, seq_len=self.shape["seq_len"], micro_batch=1, device=str(self.device),
                          forward=forward, checkpointing=self.checkpointing, autocast=True)
        config = {**self.shape["config"], "num_hidden_layers": layers}
        result = plan(config, setting, self.shape["selected"], family=self.shape["family"], dtype=torch.bfloat16,
                      attn_implementation="sdpa")
        return result.peak_bytes / GIB

    def planned(self, forward: Literal["full", "compressed"], layers: int, measured: float,
                cuda: bool) -> dict[str, float]:
        """The plan's peak for a sparse run (and, on CUDA, its ratio to the measured peak), keyed as the report's."""
        name = "compressed" if forward == "compressed" else "full_mode"
        peak = self.plan_peak("miner", layers, forward)
        return {f"{name}_plan_peak_gib": peak, **({f"{name}_plan_vs_measured": peak / measured} if cuda else {})}

    def full_finetune(self, layers: int) -> tuple[float, float]:
        """(memory GiB, tokens/s) of full fine-tuning: fp32 master weights, AdamW on all, bf16 autocast on CUDA."""
        self._reset()
        model = _materialise(self._meta_model(layers), self.device).float().train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
        clock = _Clock(self._batches(self.steps + 1))
        for ids_BL in clock:
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.device.type == "cuda"):
                loss = model(input_ids=ids_BL.to(self.device), labels=ids_BL.to(self.device)).loss
            self.losses_before_update.setdefault(f"fft_{layers}_layers", float(loss.detach()))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        params = sum(p.numel() for p in model.parameters())
        return self._memory(model, params * 4 * 3), self._tokens_per_s(clock)

    def validator(self) -> dict[str, float]:
        """Seconds per submission (swap in, held-out loss, restore) and its ratio to a bare forward."""
        self._reset()
        model = _materialise(self._meta_model(self.shape["config"]["num_hidden_layers"]), self.device)
        group = {layer: list(range(self.shape["selected"])) for layer in self.adapter.moe_layers(model)}
        miner = {n: t + 0.01 for n, t in extract(model, self.adapter, group).items()}
        heldout = torch.cat(self._batches(HELDOUT_SEQUENCES))
        device = str(self.device)
        bare, swapped = [], []
        heldout_loss(model, heldout, batch_size=1, device=device, pad_id=-1)  # warm-up
        for _ in range(3):
            bare.append(_timed(lambda: heldout_loss(model, heldout, batch_size=1, device=device, pad_id=-1)))
            swapped.append(_timed(lambda: loss_with_experts(
                model, self.adapter, miner, heldout, batch_size=1, device=device, pad_id=-1)))
        out = {"validator_seconds_per_submission": min(swapped), "validator_bare_forward_seconds": min(bare),
               "validator_overhead_ratio": min(swapped) / min(bare),
               "validator_plan_peak_gib": self.plan_peak("validator", self.shape["config"]["num_hidden_layers"])}
        if self.device.type == "cuda":
            out["validator_peak_gib"] = torch.cuda.max_memory_allocated() / GIB
            out["validator_plan_vs_measured"] = out["validator_plan_peak_gib"] / out["validator_peak_gib"]
        return out

    def _meta_model(self, layers: int) -> torch.nn.Module:
        config = AutoConfig.for_model(self.shape["family"], **{**self.shape["config"], "num_hidden_layers": layers})
        with torch.device("meta"):  # transformers leaves from_config unannotated
            model: torch.nn.Module = AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
                config, dtype=torch.bfloat16, attn_implementation="sdpa", experts_implementation="eager")
        return model

    def _batches(self, n: int) -> list[torch.Tensor]:
        """The first `n` batches of one seeded stream: every run sees the same ones."""
        vocab, length = self.shape["config"]["vocab_size"], self.shape["seq_len"]
        generator = torch.Generator().manual_seed(0)
        return [torch.randint(0, vocab, (1, length), generator=generator) for _ in range(n)]

    def _reset(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()

    def _memory(self, model: torch.nn.Module, trainable_bytes: int) -> float:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated() / GIB
        held = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
        return (held + trainable_bytes) / GIB

    def _tokens_per_s(self, clock: _Clock) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        return clock.tokens_after_first / clock.seconds_after_first


class _Clock:
    """Yields batches and times everything after the first (warm-up) one; runs its consumer to the end."""

    def __init__(self, batches: list[torch.Tensor]) -> None:
        self.batches = batches
        self.started = 0.0
        self.seconds_after_first = 0.0
        self.tokens_after_first = sum(b.numel() for b in batches[1:])

    def __iter__(self) -> Iterator[torch.Tensor]:
        for i, batch in enumerate(self.batches):
            if i == 1:
                self.started = time.perf_counter()
            yield batch
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.seconds_after_first = time.perf_counter() - self.started


def _materialise(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """Give a meta-device model random weights on `device` (norms 1, biases 0) and fresh rotary buffers.

    Row r of weight `name` is drawn from the seed crc32(f"{name}:{r}"), so every model of a shape gets
    the same weights, and a compressed model (kept experts first) the rows the full model has for them."""
    model.to_empty(device=device)
    generator = torch.Generator(device=device)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.fill_(1.0 if "norm" in name else 0.0)
                continue
            for row, values in enumerate(p):
                generator.manual_seed(zlib.crc32(f"{name}:{row}".encode()))
                values.normal_(0.0, 0.02, generator=generator)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.zero_()
        base: torch.nn.Module = getattr(model, "model", model)
        base.rotary_emb = type(base.get_submodule("rotary_emb"))(config=model.config).to(device)
    return model.eval()


def _expert_bytes(model: torch.nn.Module, adapter: MoEAdapter) -> int:
    """fp32 bytes of one expert's gate_up and down rows."""
    experts = adapter.experts(model, adapter.moe_layers(model)[0])
    gate_up, down = tensor_attr(experts, "gate_up_proj"), tensor_attr(experts, "down_proj")
    return (gate_up[0].numel() + down[0].numel()) * 4


def _timed(run: Any) -> float:
    started = time.perf_counter()
    run()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - started


if __name__ == "__main__":
    raise SystemExit(main())

"""The hardware table: GPU memory, host memory, disk and bytes a round for each role of four real MoE shapes, from plans.

`python bench/hardware.py --trace docs/hardware.json` traces every row with `training.plan` (fake tensors of
the hub configs below, nothing downloaded; an hour of CPU on a small machine) and writes the plans' numbers;
`python bench/hardware.py --render docs/hardware.json --out docs/hardware.md` writes the table from them,
which is all `render` reads, so the table is a function of the plans (tests/bench/test_hardware.py renders it
again and re-traces a row). Rows: a miner of 2, 4 and 8 experts in every MoE layer (its defaults; the
setting that needs least; and what `tessera plan --fit 24` picks), a validator on one GPU and spread over two,
the `spec new` host, and DeepSeek-V2-Lite's exp_math workload. The GPU figures are traced; host memory,
disk and bytes a round are arithmetic on the shapes (`Sizes`), with the ratios measured on the CPU at
OLMoE-1B-7B's size (docs/sizing.md) named where they are used.
Usage: python bench/hardware.py (--trace FILE.json | --render FILE.json --out FILE.md)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from training.fit import MINER_FIELDS, DoesNotFit, describe, fit  # noqa: E402
from training.plan import GIB, MemoryPlan, Setting, plan  # noqa: E402

SHAPES: dict[str, dict[str, Any]] = {
    "OLMoE-1B-7B": {"model_type": "olmoe", "num_hidden_layers": 16, "num_experts": 64, "hidden_size": 2048,
                    "intermediate_size": 1024, "num_experts_per_tok": 8, "num_attention_heads": 16,
                    "num_key_value_heads": 16, "vocab_size": 50304, "max_position_embeddings": 4096,
                    "tie_word_embeddings": False, "dtype": "bfloat16"},
    "Qwen3-30B-A3B": {"model_type": "qwen3_moe", "num_hidden_layers": 48, "num_experts": 128, "hidden_size": 2048,
                      "moe_intermediate_size": 768, "intermediate_size": 6144, "num_experts_per_tok": 8,
                      "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 151936,
                      "norm_topk_prob": True, "max_position_embeddings": 40960, "tie_word_embeddings": False,
                      "dtype": "bfloat16"},
    "DeepSeek-V2-Lite": {"model_type": "deepseek_v2", "num_hidden_layers": 27, "first_k_dense_replace": 1,
                         "hidden_size": 2048, "intermediate_size": 10944, "moe_intermediate_size": 1408,
                         "n_routed_experts": 64, "n_shared_experts": 2, "num_experts_per_tok": 6,
                         "num_attention_heads": 16, "num_key_value_heads": 16, "kv_lora_rank": 512,
                         "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
                         "vocab_size": 102400, "max_position_embeddings": 163840, "routed_scaling_factor": 1.0,
                         "topk_method": "greedy", "norm_topk_prob": False, "tie_word_embeddings": False,
                         "dtype": "bfloat16"},
    "Mixtral-8x7B": {"model_type": "mixtral", "num_hidden_layers": 32, "num_local_experts": 8, "hidden_size": 4096,
                     "intermediate_size": 14336, "num_experts_per_tok": 2, "num_attention_heads": 32,
                     "num_key_value_heads": 8, "vocab_size": 32000, "max_position_embeddings": 32768,
                     "rope_theta": 1e6, "tie_word_embeddings": False, "dtype": "bfloat16"},
}
"""The hub config.json fields that size each model (allenai/OLMoE-1B-7B-0924, Qwen/Qwen3-30B-A3B,
deepseek-ai/DeepSeek-V2-Lite, mistralai/Mixtral-8x7B-v0.1)."""
SEQ_LEN = 2048
PER_LAYER = (2, 4, 8)
CARD_GIB = 24
"""The card `tessera plan --fit` is asked to fit, a consumer GPU's."""
LEAST: dict[str, Any] = {"forward": "compressed", "autocast": True, "checkpointing": True, "optimizer": "adamw8bit",
                         "step_in_backward": True}
"""The miner's setting that needs least memory."""
WORKLOAD = ("DeepSeek-V2-Lite", 8, 4096)
"""Connito's exp_math group: 8 of 64 experts in each of 26 MoE layers, sequences of 4096 tokens."""
RUNTIME_GIB = 0.39
"""A node process's runtime (Python, torch, transformers), measured (docs/sizing.md)."""
SPEC_NEW_RATIO = 1.08
"""`spec new`'s peak RSS over the checkpoint's bytes, measured at OLMoE-1B-7B's size (docs/sizing.md)."""
RETENTION = 3
"""Rounds of blobs a node keeps (`storage.blob_retention_rounds`'s default)."""


@dataclass(frozen=True)
class Row:
    """One plan of the table: a shape, a role and a setting (`label`: which setting, in words)."""

    shape: str
    label: str
    setting: Setting
    per_layer: int

    def key(self) -> str:
        return f"{self.shape} | {self.setting.role} {self.per_layer}/layer seq {self.setting.seq_len} | {self.label}"


def rows() -> list[Row]:
    """Every plan the table shows, but the `--fit` choices (which depend on the plans)."""
    out = []
    for shape in SHAPES:
        for per_layer in PER_LAYER:
            out += _miner_rows(shape, per_layer, SEQ_LEN)
        for gpus in (1, 2):
            out.append(Row(shape, f"{gpus} GPU{'s' * (gpus > 1)}",
                           Setting(role="validator", seq_len=SEQ_LEN, micro_batch=1, gpus=gpus), 2))
    shape, per_layer, seq_len = WORKLOAD
    out += _miner_rows(shape, per_layer, seq_len)
    out.append(Row(shape, "checkpointing, autocast, 8-bit moments",
                   Setting(role="miner", seq_len=seq_len, forward="compressed", autocast=True, checkpointing=True,
                           optimizer="adamw8bit"), per_layer))
    return out


def _miner_rows(shape: str, per_layer: int, seq_len: int) -> list[Row]:
    defaults = Setting(role="miner", seq_len=seq_len, forward="compressed", autocast=True)
    return [Row(shape, "defaults", defaults, per_layer), Row(shape, "least", replace(defaults, **LEAST), per_layer)]


def trace_all(out: Path) -> None:
    """Trace every row and the `--fit CARD_GIB` choice of every miner; write their numbers to `out` as they come."""
    done: dict[str, Any] = json.loads(out.read_text()) if out.exists() else {"plans": {}, "fits": {}}
    for row in rows():
        if row.key() not in done["plans"]:
            done["plans"][row.key()] = _traced(row)
            out.write_text(json.dumps(done, indent=1, sort_keys=True) + "\n")
    for row in rows():
        if row.setting.role == "miner" and row.label == "defaults" and row.key() not in done["fits"]:
            done["fits"][row.key()] = _fit(row, done)
            out.write_text(json.dumps(done, indent=1, sort_keys=True) + "\n")


def _traced(row: Row) -> dict[str, Any]:
    started = time.perf_counter()
    result = plan(SHAPES[row.shape], row.setting, row.per_layer)
    print(f"{row.key()}: {result.peak_bytes / GIB:.2f} GiB in {time.perf_counter() - started:.0f} s", flush=True)
    return {"setting": asdict(row.setting), **_numbers(result)}


def _numbers(result: MemoryPlan) -> dict[str, Any]:
    return {"peak_bytes": result.peak_bytes, "margin_bytes": result.margin_bytes, "parts": result.parts,
            "phase": result.phase, "step": result.step, "step_peaks": list(result.step_peaks),
            "device_peaks": list(result.device_peaks),
            "device_needs": [b + result.margin_of(b) for b in result.device_peaks]}


def _fit(row: Row, done: dict[str, Any]) -> dict[str, Any]:
    """`tessera plan --fit CARD_GIB` for the miner of `row`, reusing the plans already traced (and keeping those
    it traces, under "fit")."""
    prefix = row.key().rsplit(" | ", 1)[0]  # this shape, role, group and sequence length
    known = {Setting(**entry["setting"]): entry for key, entry in done["plans"].items() if key.startswith(prefix)}

    def trace(setting: Setting) -> MemoryPlan:
        entry = known.get(setting)
        if entry is None:
            traced = Row(row.shape, "fit", setting, row.per_layer)
            entry = known[setting] = done["plans"][f"{traced.key()} {describe(setting)}"] = _traced(traced)
        return MemoryPlan(entry["peak_bytes"], entry["parts"], entry["phase"], entry["step"],
                          tuple(entry["step_peaks"]), setting.device, 0.0)

    try:
        choice = fit(trace, row.setting, MINER_FIELDS, CARD_GIB * GIB)
    except DoesNotFit as exc:
        return {"fits": False, "nearest": asdict(exc.nearest.setting), "need_bytes": exc.nearest.need_bytes}
    return {"fits": True, "setting": asdict(choice.setting), "need_bytes": choice.need_bytes,
            "slowdown": choice.slowdown, "peak_bytes": choice.plan.peak_bytes, "step": choice.plan.step,
            "phase": choice.plan.phase}


@dataclass(frozen=True)
class Sizes:
    """A shape's parameter counts, from its config (no model is built): the whole model and its parts."""

    total: int
    expert: int
    """One routed expert's parameters (gate, up and down)."""
    moe_layers: int
    experts: int

    @classmethod
    def of(cls, config: dict[str, Any]) -> Sizes:
        hidden, layers = config["hidden_size"], config["num_hidden_layers"]
        experts = config.get("num_experts") or config.get("num_local_experts") or config["n_routed_experts"]
        moe_inter = config.get("moe_intermediate_size") or config["intermediate_size"]
        dense = config.get("first_k_dense_replace", 0)
        expert = 3 * hidden * moe_inter
        embeddings = 2 * config["vocab_size"] * hidden
        attention = _attention(config)
        shared = config.get("n_shared_experts", 0) * expert
        router = experts * hidden
        dense_mlp = 3 * hidden * config["intermediate_size"]
        per_moe = attention + experts * expert + shared + router + 2 * hidden
        per_dense = attention + dense_mlp + 2 * hidden
        total = embeddings + hidden + (layers - dense) * per_moe + dense * per_dense
        return cls(total=total, expert=expert, moe_layers=layers - dense, experts=experts)

    def group(self, per_layer: int) -> int:
        return per_layer * self.moe_layers * self.expert


def _attention(config: dict[str, Any]) -> int:
    hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    if "kv_lora_rank" in config:  # DeepSeek's multi-head latent attention (q_lora_rank None: a plain q projection)
        nope, rope = int(config["qk_nope_head_dim"]), int(config["qk_rope_head_dim"])
        rank, v = int(config["kv_lora_rank"]), int(config["v_head_dim"])
        return hidden * heads * (nope + rope) + hidden * (rank + rope) + rank + rank * heads * (nope + v) + heads * v * hidden
    head_dim = int(config.get("head_dim") or hidden // heads)
    kv = int(config.get("num_key_value_heads") or heads)
    norms = 2 * head_dim if config["model_type"] == "qwen3_moe" else 2 * hidden if config["model_type"] == "olmoe" else 0
    return hidden * heads * head_dim * 2 + 2 * hidden * kv * head_dim + norms


def render(numbers: dict[str, Any]) -> str:
    """docs/hardware.md from the traced numbers (`trace_all`'s file) and the shapes' sizes."""
    plans, fits = numbers["plans"], numbers["fits"]
    lines = [_HEADER.strip(), ""]
    for shape, config in SHAPES.items():
        sizes = Sizes.of(config)
        lines += [f"## {shape}", "", f"{sizes.total / 1e9:.1f} B parameters, {_gb(2 * sizes.total)} in bf16; "
                  f"{sizes.moe_layers} MoE layers of {sizes.experts} experts of {sizes.expert / 1e6:.1f} M "
                  f"parameters. Sequences of {SEQ_LEN} tokens, one a step.", "",
                  "| node | GPU: defaults | GPU: least | fits 24 GiB with | host memory | disk | downloaded a round |",
                  "|---|---|---|---|---|---|---|"]
        for per_layer in PER_LAYER:
            lines.append(_miner_line(shape, sizes, per_layer, SEQ_LEN, plans, fits))
        for gpus in (1, 2):
            row = next(r for r in rows() if r.shape == shape and r.setting.role == "validator" and r.setting.gpus == gpus)
            entry = plans[row.key()]
            gpu = _gib(max(entry["device_needs"])) + " each" if gpus > 1 else _gib(entry["peak_bytes"] + entry["margin_bytes"])
            lines.append(f"| validator of a {row.per_layer}/layer group, {row.label} | {gpu} | | | "
                         f"{_validator_host(sizes)} | {_validator_disk(sizes, row.per_layer)} | "
                         f"{_gb(2 * sizes.group(row.per_layer))} per submission scored |")
        lines.append(f"| `spec new` host | none (CPU) | | | {_gb(SPEC_NEW_RATIO * 2 * sizes.total)} | "
                     f"{_gb(2 * sizes.total)} | the checkpoint, once |")
        lines.append("")
    shape, per_layer, seq_len = WORKLOAD
    sizes = Sizes.of(SHAPES[shape])
    lines += [f"## {shape}, exp_math: {per_layer} experts in each of {sizes.moe_layers} MoE layers, sequences of "
              f"{seq_len}", "", "| miner setting | peak (step, phase) | plan with margin | what it holds at the peak |",
              "|---|---|---|---|"]
    for row in rows():
        if (row.shape, row.per_layer, row.setting.seq_len) == WORKLOAD:
            entry = plans[row.key()]
            lines.append(f"| {row.label}: {describe(row.setting)} | {_gib(entry['peak_bytes'])} (step {entry['step']}, "
                         f"{entry['phase']}) | {_gib(entry['peak_bytes'] + entry['margin_bytes'])} | "
                         f"{_parts(entry['parts'])} |")
    fitted = fits[next(r for r in rows() if (r.shape, r.per_layer, r.setting.seq_len) == WORKLOAD).key()]
    lines += ["", f"`tessera plan --fit {CARD_GIB}` picks: {_fit_words(fitted)}.", "", _FOOTER.strip(), ""]
    return "\n".join(lines)


def _miner_line(shape: str, sizes: Sizes, per_layer: int, seq_len: int, plans: dict[str, Any],
                fits: dict[str, Any]) -> str:
    by_label = {r.label: plans[r.key()] for r in rows()
                if (r.shape, r.per_layer, r.setting.seq_len, r.setting.role) == (shape, per_layer, seq_len, "miner")}
    fitted = fits[next(r for r in rows() if (r.shape, r.per_layer, r.setting.seq_len, r.label) ==
                       (shape, per_layer, seq_len, "defaults")).key()]
    group = sizes.group(per_layer)
    weights = 2 * (sizes.total - sizes.moe_layers * (sizes.experts - per_layer) * sizes.expert)
    host = RUNTIME_GIB * GIB + max(weights, 10 * group)
    disk = 2 * sizes.total + RETENTION * (2 * group + 4 * group)
    return (f"| miner, {per_layer}/layer | {_need(by_label['defaults'])} | {_need(by_label['least'])} | "
            f"{_fit_words(fitted)} | {_gb(host)} | {_gb(disk)} | {_gb(4 * group)} (the state) |")


def _need(entry: dict[str, Any]) -> str:
    return f"{_gib(entry['peak_bytes'] + entry['margin_bytes'])} (step {entry['step']}, {entry['phase']})"


def _fit_words(fitted: dict[str, Any]) -> str:
    if not fitted["fits"]:
        return f"nothing (nearest {_gib(fitted['need_bytes'])})"
    return f"{describe(Setting(**fitted['setting']))}: {_gib(fitted['need_bytes'])}, x{fitted['slowdown']:.2f}"


def _validator_host(sizes: Sizes) -> str:
    return _gb(RUNTIME_GIB * GIB + 2 * sizes.total)


def _validator_disk(sizes: Sizes, per_layer: int) -> str:
    return _gb(2 * sizes.total + RETENTION * 8 * sizes.group(per_layer)) + " + scored blobs"


def _parts(parts: dict[str, int]) -> str:
    names = {"weights": "weights", "trainable_copies": "copies", "gradients": "gradients",
             "optimizer_state": "optimizer state", "activations": "activations"}
    return ", ".join(f"{names[k]} {v / GIB:.2f}" for k, v in parts.items() if v >= GIB // 100)


def _gib(nbytes: float) -> str:
    return f"{nbytes / GIB:.1f} GiB"


def _gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:.1f} GB"


_HEADER = """
# Hardware: what each node of four real MoE shapes needs

Generated by `bench/hardware.py` from the memory plans (`training.plan`: the role's own work traced on fake
tensors of the shape, over a round's steady state); do not edit by hand. `tests/bench/test_hardware.py` fails
when this file and the plans disagree.

- **GPU**: the plan's peak plus its margin (1 GiB + 10%), with the step and phase the peak falls in. A miner
  trains compressed (only its group's experts on the GPU) with bf16 autocast, one sequence a step (with
  micro-batches, every one after the first holds the step's gradients: `tessera plan --spec` traces a
  network's batch). *Defaults*: fp32 AdamW moments, no checkpointing. *Least*: activation checkpointing,
  8-bit moments and the optimizer step taken in backward. *Fits 24 GiB with*: what `tessera plan --fit 24`
  picks, and its estimated step time against the defaults' (`training.fit.COSTS`). A validator scores one
  sequence a pass with the checkpoint's weights, on one GPU or spread over two by accelerate's balanced map
  (`--gpus 2`: the larger GPU's plan).
- **Host memory** (estimates): the runtime (0.39 GiB, measured) and, for a miner, the larger of the compressed
  model it loads before moving it to the GPU and 10 bytes a trained parameter (the trained fp32 experts
  copied back, and the blob); for a validator, the checkpoint it loads before moving it. The `spec new` host
  holds 1.08x the checkpoint (measured at OLMoE-1B-7B's size, docs/sizing.md).
- **Disk**: the checkpoint in bf16, and what the blob store keeps for 3 rounds: a miner its blob (2 bytes a
  trained parameter) and the state (4); a validator the state and its momentum (8 bytes a parameter of the
  group), and the blobs it scores.
- **Downloaded a round**: a miner the adopted state (fp32 experts of its group); a validator each
  submission it scores (bf16), M x R / V of them a round (docs/sizing.md).
"""
_FOOTER = """
A miner that trains bf16 autocast and 8-bit moments holds, at its steady state, a fp32 copy and a gradient of
every trained parameter (8 bytes) and 2 bytes of moments; the step in backward frees each gradient as soon as
its tensor has stepped (`training.trainer.TrainConfig.step_in_backward`: a step clipped by the norm of the step
before; bit-identical where the clip does not bind, tests/training/test_step_in_backward.py).
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", type=Path, metavar="FILE", help="trace every row into FILE (JSON; resumes)")
    parser.add_argument("--render", type=Path, metavar="FILE", help="the traced numbers to render")
    parser.add_argument("--out", type=Path, metavar="FILE", help="where --render writes the table")
    args = parser.parse_args(argv)
    if (args.trace is None) == (args.render is None) or (args.render is not None and args.out is None):
        parser.error("give --trace FILE, or --render FILE --out FILE")
    if args.trace is not None:
        trace_all(args.trace)
    else:
        args.out.write_text(render(json.loads(args.render.read_text())), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())

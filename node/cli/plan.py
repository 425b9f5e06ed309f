"""`tessera plan`: how much GPU memory a miner or validator of a model needs, traced before anything loads.

    tessera plan (--spec FILE | --config FILE) --role miner|validator [--experts-per-layer N] [--seq-len N]
                 [--micro-batch N] [--device cuda] [--forward compressed|full] [--checkpointing] [--autocast]
                 [--optimizer adamw|adamw8bit] [--weights checkpoint|int8] [--json]

`training.plan` runs the role's own step on fake tensors (no weight is read; `--config` is a
checkpoint's config.json, `--spec` a network's model, group and sequence length) and this prints the
peak, what it is made of, and the margin added for what a CPU trace does not see; `--json` prints
the same as one object. A miner or validator on CUDA runs the same trace as it starts
(node.runtime.preflight.check_memory). This module knows nothing about how the trace is taken.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

_PART_NAMES = {"weights": "weights", "trainable_copies": "trainable copies", "gradients": "gradients",
               "optimizer_state": "optimizer state", "activations": "activations and temporaries"}


@dataclass(frozen=True)
class _Model:
    """What to trace: the config dict and how it is built, and the spec's group and seq_len where there is one."""

    source: str
    config: dict[str, Any]
    family: str | None = None
    dtype: torch.dtype | None = None
    attn: str = "sdpa"
    group: dict[int, list[int]] | None = None
    seq_len: int | None = None


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add `plan` to the `tessera` parser."""
    p = subparsers.add_parser("plan", help="the GPU memory a miner or validator needs, traced without weights")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--spec", type=Path, help="network spec: its model, group and sequence length")
    source.add_argument("--config", type=Path, metavar="FILE", help="a checkpoint's config.json")
    p.add_argument("--role", required=True, choices=("miner", "validator"), help="what the node runs")
    p.add_argument("--experts-per-layer", type=int, metavar="N",
                   help="experts trained (or scored) in every MoE layer (required with --config; default: the "
                        "spec's group)")
    p.add_argument("--seq-len", type=int, metavar="N", help="tokens per sequence (default: the spec's data.seq_len)")
    p.add_argument("--micro-batch", type=int, default=1, metavar="N", help="sequences per forward pass (default 1)")
    p.add_argument("--device", default="cuda", help="the device planned for (default cuda); the trace runs on the CPU")
    p.add_argument("--forward", choices=("compressed", "full"), default="compressed",
                   help="a miner's model: only the group's experts, or all of them (default compressed)")
    p.add_argument("--checkpointing", action="store_true", help="a miner recomputes each layer in backward")
    p.add_argument("--autocast", action="store_true", help="a miner trains under bf16 autocast (CUDA only)")
    p.add_argument("--optimizer", choices=("adamw", "adamw8bit"), default="adamw",
                   help="a miner's inner optimizer: fp32 moments, or bitsandbytes' 8-bit ones (default adamw)")
    p.add_argument("--weights", choices=("checkpoint", "int8"), default="checkpoint",
                   help="a validator's frozen weights: as the checkpoint holds them, or int8 (default checkpoint)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.set_defaults(run=run_plan)


def run_plan(args: argparse.Namespace) -> int:
    import torch

    from training.plan import GIB, MARGIN_FIXED, MARGIN_SHARE, SEES_NOT, Setting, plan

    for flag, value in (("--experts-per-layer", args.experts_per_layer), ("--seq-len", args.seq_len),
                        ("--micro-batch", args.micro_batch)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be at least 1, got {value}")
    if args.seq_len is not None and args.seq_len < 2:
        raise ValueError(f"--seq-len must be at least 2 (a token and its target), got {args.seq_len}")
    try:
        torch.device(args.device)
    except RuntimeError:
        raise ValueError(f"--device {args.device!r} is not a torch device; use cuda, cuda:N or cpu") from None
    model = _model(args)
    group = args.experts_per_layer if args.experts_per_layer is not None else model.group
    seq_len = args.seq_len if args.seq_len is not None else model.seq_len
    assert group is not None and seq_len is not None, "a spec gives both; _model refuses --config without them"
    setting = Setting(role=args.role, seq_len=seq_len, micro_batch=args.micro_batch, device=args.device,
                      forward=args.forward, checkpointing=args.checkpointing, autocast=args.autocast,
                      optimizer=args.optimizer, weights=args.weights)
    try:
        result = plan(model.config, setting, group, family=model.family, dtype=model.dtype,
                      attn_implementation=model.attn)
    except ValueError as exc:
        raise ValueError(f"{model.source}: {exc}") from exc
    total = result.peak_bytes + result.margin_bytes
    if args.json:
        print(json.dumps({
            "peak_gib": round(result.peak_bytes / GIB, 3), "peak_bytes": result.peak_bytes,
            "parts": result.parts, "phase": result.phase, "device": result.device,
            "margin_gib": round(result.margin_bytes / GIB, 3), "total_gib": round(total / GIB, 3),
            "sees_not": list(SEES_NOT), "seconds": round(result.seconds, 1), "role": args.role,
            "forward": args.forward if args.role == "miner" else "full", "seq_len": seq_len,
            "micro_batch": args.micro_batch, "checkpointing": args.checkpointing, "autocast": args.autocast,
            "optimizer": args.optimizer, "weights": args.weights,
        }, indent=2, sort_keys=True))
        return 0
    print(f"{model.family or model.config.get('model_type')} {args.role}, seq {seq_len} x micro-batch {args.micro_batch}, on {args.device} "
          f"(traced on fake CPU tensors in {result.seconds:.1f} s)")
    for part, nbytes in result.parts.items():
        print(f"  {_PART_NAMES[part]:<28}{nbytes / GIB:8.2f} GiB")
    print(f"  {'peak (' + result.phase + ')':<28}{result.peak_bytes / GIB:8.2f} GiB")
    print(f"  {'+ margin':<28}{result.margin_bytes / GIB:8.2f} GiB  ({MARGIN_FIXED / GIB:.0f} GiB + "
          f"{MARGIN_SHARE:.0%} of the peak)")
    print(f"  {'= plan':<28}{total / GIB:8.2f} GiB")
    print("the margin stands for what the trace does not see: " + "; ".join(SEES_NOT))
    return 0


def _model(args: argparse.Namespace) -> _Model:
    """What `--config` or `--spec` names: a config.json's model, or the spec's model, group and seq_len."""
    if args.config is not None:
        if args.experts_per_layer is None:
            raise ValueError("--experts-per-layer: required with --config (a config.json names no group)")
        if args.seq_len is None:
            raise ValueError("--seq-len: required with --config")
        try:
            config = json.loads(args.config.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"--config {args.config}: not a JSON file: {exc}") from exc
        if not isinstance(config, dict):
            raise ValueError(f"--config {args.config}: a config.json holds one JSON object")
        return _Model(f"--config {args.config}", config)
    from node.runtime.preflight import planned_model
    from protocol.spec import load_spec

    spec = load_spec(args.spec)
    model = planned_model(spec, args.spec)
    return _Model(f"--spec {args.spec}", model.config, model.family, model.dtype, model.attn,
                  {layer: list(ids) for layer, ids in spec.group.items()}, spec.data.seq_len)

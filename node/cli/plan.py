"""`tessera plan`: how much GPU memory a miner or validator needs over a whole round, traced before anything loads.

    tessera plan (--spec FILE | --config FILE) --role miner|validator [--experts-per-layer N] [--seq-len N]
                 [--micro-batch N] [--batch-size N] [--device cuda] [--forward compressed|full] [--[no-]checkpointing]
                 [--[no-]autocast] [--optimizer adamw|adamw8bit] [--[no-]step-in-backward] [--weights checkpoint|int8]
                 [--gpus N] [--fit GIB] [--json]

`training.plan` runs the role's own work on fake tensors (no weight is read; `--config` is a
checkpoint's config.json, `--spec` a network's model, group, sequence length and batch): a miner's first
two inner steps, the second being what every later step holds, and a validator's scoring pass (over `--gpus`
GPUs, each GPU's). This prints the peak, which step and phase it falls in, what it is made of, and the margin
added for what a CPU trace does not see; `--json` prints the same as one object. `--fit GIB` picks the fastest
combination of the memory settings not given on the command line whose plan fits GIB (`training.fit`) and says
what it chose, what that costs in speed, and the config lines that set it. A miner or validator on CUDA runs the
same trace as it starts (node.runtime.preflight.fit_memory). This module knows nothing about how the trace is
taken.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from training.fit import Choice
    from training.plan import MemoryPlan, Setting

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
    batch_size: int | None = None


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add `plan` to the `tessera` parser."""
    p = subparsers.add_parser("plan", help="the GPU memory a miner or validator needs, traced without weights")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--spec", type=Path, help="network spec: its model, group, sequence length and batch")
    source.add_argument("--config", type=Path, metavar="FILE", help="a checkpoint's config.json")
    p.add_argument("--role", required=True, choices=("miner", "validator"), help="what the node runs")
    p.add_argument("--experts-per-layer", type=int, metavar="N",
                   help="experts trained (or scored) in every MoE layer (required with --config; default: the "
                        "spec's group)")
    p.add_argument("--seq-len", type=int, metavar="N", help="tokens per sequence (default: the spec's data.seq_len)")
    p.add_argument("--micro-batch", type=int, metavar="N",
                   help="sequences per forward pass (default 1; a validator's scoring batch)")
    p.add_argument("--batch-size", type=int, metavar="N",
                   help="a miner's sequences per optimizer step, in micro-batches (default: the spec's "
                        "training.batch_size; with --config, one micro-batch)")
    p.add_argument("--device", default="cuda",
                   help="the device planned for (default cuda; cpu: a CPU miner's memory); the trace runs on the CPU")
    p.add_argument("--forward", choices=("compressed", "full"),
                   help="a miner's model: only the group's experts, or all of them (default compressed)")
    p.add_argument("--checkpointing", action=argparse.BooleanOptionalAction,
                   help="a miner recomputes each layer in backward (default off)")
    p.add_argument("--autocast", action=argparse.BooleanOptionalAction,
                   help="a miner trains under bf16 autocast, CUDA only (default off)")
    p.add_argument("--optimizer", choices=("adamw", "adamw8bit"),
                   help="a miner's inner optimizer: fp32 moments, or bitsandbytes' 8-bit ones (default adamw)")
    p.add_argument("--step-in-backward", action=argparse.BooleanOptionalAction,
                   help="a miner takes each tensor's optimizer step in backward, as its gradient is complete "
                        "(default off; needs a step of one micro-batch)")
    p.add_argument("--weights", choices=("checkpoint", "int8"),
                   help="a validator's frozen weights: as the checkpoint holds them, or int8 (default checkpoint)")
    p.add_argument("--gpus", type=int, default=1, metavar="N",
                   help="a validator's model spread over N GPUs by accelerate's device map, as validator.device = "
                        "'auto' spreads it: the plan of each GPU (default 1)")
    p.add_argument("--fit", type=float, metavar="GIB",
                   help="pick the fastest combination of the memory settings not given here whose plan (peak and "
                        "margin; each GPU's) fits GIB, and print it")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.set_defaults(run=run_plan)


def run_plan(args: argparse.Namespace) -> int:
    from training.fit import MINER_FIELDS, VALIDATOR_FIELDS, fit
    from training.plan import GIB, plan

    _check(args)
    model = _model(args)
    group = args.experts_per_layer if args.experts_per_layer is not None else model.group
    seq_len = args.seq_len if args.seq_len is not None else model.seq_len
    assert group is not None and seq_len is not None, "a spec gives both; _model refuses --config without them"
    setting = _setting(args, seq_len, model.batch_size)

    def trace(tried: Setting) -> MemoryPlan:
        try:
            return plan(model.config, tried, group, family=model.family, dtype=model.dtype,
                        attn_implementation=model.attn)
        except ValueError as exc:
            raise ValueError(f"{model.source}: {exc}") from exc

    if args.fit is None:
        result, choice = trace(setting), None
    else:
        fields = MINER_FIELDS if args.role == "miner" else VALIDATOR_FIELDS
        free = [name for name in fields if getattr(args, _FLAGS[name]) is None]
        choice = fit(trace, setting, free, int(args.fit * GIB))
        setting, result = choice.setting, choice.plan
    if args.json:
        print(json.dumps(_as_json(args, setting, result, choice), indent=2, sort_keys=True))
    else:
        _print(model, setting, result, choice)
    return 0


_FLAGS = {"forward": "forward", "autocast": "autocast", "micro_batch": "micro_batch", "checkpointing": "checkpointing",
          "step_in_backward": "step_in_backward", "optimizer": "optimizer", "weights": "weights"}
"""`training.fit`'s settings -> the flag (its `args` name) that pins each."""


def _check(args: argparse.Namespace) -> None:
    """One line naming the flag for a value no plan can take."""
    import torch

    for flag, value in (("--experts-per-layer", args.experts_per_layer), ("--seq-len", args.seq_len),
                        ("--micro-batch", args.micro_batch), ("--batch-size", args.batch_size),
                        ("--gpus", args.gpus)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be at least 1, got {value}")
    if args.seq_len is not None and args.seq_len < 2:
        raise ValueError(f"--seq-len must be at least 2 (a token and its target), got {args.seq_len}")
    if args.fit is not None and not (math.isfinite(args.fit) and args.fit > 0):
        raise ValueError(f"--fit must be a positive number of GiB, got {args.fit}")
    try:
        device = torch.device(args.device)
    except RuntimeError:
        raise ValueError(f"--device {args.device!r} is not a torch device; use cuda, cuda:N or cpu") from None
    if args.gpus > 1 and (args.role != "validator" or device.type != "cuda"):
        raise ValueError(f"--gpus {args.gpus}: only a validator's model is spread over GPUs (--role validator, "
                         f"--device cuda)")
    if args.micro_batch is not None and args.batch_size is not None and args.micro_batch > args.batch_size:
        raise ValueError(f"--micro-batch {args.micro_batch} is more than --batch-size {args.batch_size}")
    if args.step_in_backward and args.micro_batch is not None and args.batch_size is not None and (
            args.micro_batch < args.batch_size):
        raise ValueError("--step-in-backward takes the step in a step's only backward: it needs --micro-batch equal "
                         "to --batch-size")


def _setting(args: argparse.Namespace, seq_len: int, spec_batch: int | None) -> Setting:
    """The setting the flags name: unset ones at their defaults, or (with --fit) where the fit starts from."""
    from training.plan import Setting

    if args.role == "validator":
        micro = args.micro_batch or (_VALIDATOR_BATCH if args.fit is not None else 1)
        return Setting(role="validator", seq_len=seq_len, micro_batch=micro, device=args.device,
                       weights=args.weights or "checkpoint", gpus=args.gpus)
    batch = args.batch_size or spec_batch or args.micro_batch or 1
    micro = args.micro_batch or (batch if args.fit is not None else 1)
    if args.step_in_backward and args.micro_batch is None:
        micro = batch
    try:
        return Setting(role="miner", seq_len=seq_len, micro_batch=micro, batch_size=batch, device=args.device,
                       forward=args.forward or "compressed", checkpointing=bool(args.checkpointing),
                       autocast=bool(args.autocast), optimizer=args.optimizer or "adamw",
                       step_in_backward=bool(args.step_in_backward))
    except ValueError as exc:
        raise ValueError(f"--batch-size {batch}, --micro-batch {micro}: {exc}") from exc


_VALIDATOR_BATCH = 16
"""Where a validator's fit starts: `validator.batch_size`'s default."""


def _as_json(args: argparse.Namespace, setting: Setting, result: MemoryPlan, choice: Choice | None) -> dict[str, Any]:
    from training.plan import GIB, SEES_NOT

    total = result.peak_bytes + result.margin_bytes
    out: dict[str, Any] = {
        "peak_gib": round(result.peak_bytes / GIB, 3), "peak_bytes": result.peak_bytes,
        "parts": result.parts, "phase": result.phase, "step": result.step,
        "step_peaks_gib": [round(b / GIB, 3) for b in result.step_peaks], "device": result.device,
        "margin_gib": round(result.margin_bytes / GIB, 3), "total_gib": round(total / GIB, 3),
        "sees_not": list(SEES_NOT), "seconds": round(result.seconds, 1), "role": setting.role,
        "forward": setting.forward if setting.role == "miner" else "full", "seq_len": setting.seq_len,
        "micro_batch": setting.micro_batch, "batch_size": setting.batch_size or setting.micro_batch,
        "checkpointing": setting.checkpointing, "autocast": setting.autocast, "optimizer": setting.optimizer,
        "step_in_backward": setting.step_in_backward, "weights": setting.weights, "gpus": setting.gpus,
    }
    if result.device_peaks:
        out["gpu_total_gib"] = [round((b + result.margin_of(b)) / GIB, 3) for b in result.device_peaks]
    if choice is not None:
        out["fit"] = {"budget_gib": args.fit, "slowdown": round(choice.slowdown, 3), "changes": list(choice.changes),
                      "config": _config_lines(setting)}
    return out


def _print(model: _Model, setting: Setting, result: MemoryPlan, choice: Choice | None) -> None:
    from training.fit import describe
    from training.plan import GIB, MARGIN_FIXED, MARGIN_SHARE, SEES_NOT

    total = result.peak_bytes + result.margin_bytes
    if choice is not None:
        print(f"fits with {describe(setting)}: about x{choice.slowdown:.2f} the step time of the fastest setting")
        for change in choice.changes:
            print(f"  {change}")
        print("  in a node config: " + "; ".join(_config_lines(setting)))
    batch = setting.batch_size or setting.micro_batch
    steps = f", {batch} a step" if setting.role == "miner" and batch > setting.micro_batch else ""
    where = f"{setting.gpus} x {setting.device}" if setting.gpus > 1 else setting.device
    print(f"{model.family or model.config.get('model_type')} {setting.role}, seq {setting.seq_len} x micro-batch "
          f"{setting.micro_batch}{steps}, on {where} (traced on fake CPU tensors in {result.seconds:.1f} s)")
    if setting.role == "miner":
        print("  step peaks: " + ", ".join(f"{b / GIB:.2f}" for b in result.step_peaks) + " GiB (every later step "
              "holds what the last does)")
    if result.device_peaks:
        print("  each GPU: " + ", ".join(f"{(b + result.margin_of(b)) / GIB:.2f}" for b in result.device_peaks)
              + " GiB with its margin; the largest:")
    for part, nbytes in result.parts.items():
        print(f"  {_PART_NAMES[part]:<28}{nbytes / GIB:8.2f} GiB")
    peak_at = f"peak (step {result.step}, {result.phase})" if setting.role == "miner" else f"peak ({result.phase})"
    print(f"  {peak_at:<28}{result.peak_bytes / GIB:8.2f} GiB")
    print(f"  {'+ margin':<28}{result.margin_bytes / GIB:8.2f} GiB  ({MARGIN_FIXED / GIB:.0f} GiB + "
          f"{MARGIN_SHARE:.0%} of the peak)")
    print(f"  {'= plan':<28}{total / GIB:8.2f} GiB")
    print("the margin stands for what the trace does not see: " + "; ".join(SEES_NOT))


def _config_lines(setting: Setting) -> list[str]:
    """The node config lines that set `setting`'s memory settings."""
    if setting.role == "validator":
        return [f"[validator] batch_size = {setting.micro_batch}", f'weights = "{setting.weights}"']
    return [f'[miner] forward = "{setting.forward}"', f"micro_batch_size = {setting.micro_batch}",
            f"checkpointing = {str(setting.checkpointing).lower()}", f"autocast = {str(setting.autocast).lower()}",
            f'optimizer = "{setting.optimizer}"', f"step_in_backward = {str(setting.step_in_backward).lower()}"]


def _model(args: argparse.Namespace) -> _Model:
    """What `--config` or `--spec` names: a config.json's model, or the spec's model, group, seq_len and batch."""
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
                  {layer: list(ids) for layer, ids in spec.group.items()}, spec.data.seq_len, spec.training.batch_size)

"""Offline operator commands: create a simulation network, evaluate (`train`: node.cli.train).

    tessera spec init --sim DIR       write a simulation network directory (node.sim.layout)
    tessera eval ...                  held-out loss of the base (or base + a blob's experts)

Nothing here touches the network. Heavy imports happen inside each command so `tessera --help`
stays fast; user mistakes raise ValueError, which the CLI prints as one `tessera: error:` line.
"""

from __future__ import annotations

import argparse
import json
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from node.cli.common import DEFAULT_SEED, round_seed
from node.cli.main import command_group

EVAL_BATCH = 16


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add this module's subcommands to the `tessera` parser."""
    _register_spec_init(command_group(subparsers, "spec", "work with network spec files"))
    _register_eval(subparsers)


def _register_spec_init(spec_subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = spec_subparsers.add_parser("init", help="write a new network spec (a local simulation with --sim)")
    p.add_argument("--sim", required=True, type=Path, metavar="DIR", help="directory for the simulation network")
    p.add_argument("--validators", type=int, default=2, help="number of validators, 1 to 64 (default 2)")
    p.add_argument("--family", default="qwen3_moe", help="tiny model family (default qwen3_moe)")
    p.add_argument("--seed", type=int, default=0, help="seed for model, data and keys (default 0)")
    p.add_argument("--genesis", type=_utc_time, default=None, help="UTC start of round 0 (default: now)")
    p.set_defaults(run=run_spec_init)


def _register_eval(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("eval", help="held-out loss of the base model, or of the base with a blob's experts")
    p.add_argument("--spec", required=True, type=Path, help="network spec")
    p.add_argument("--blob", type=Path, help="expert blob to evaluate (default: the base model)")
    p.add_argument("--seed", type=round_seed, default=DEFAULT_SEED,
                   help="round seed (64 hex digits) that picks the held-out subset")
    p.add_argument("--heldout", type=Path, help="held-out file (default: data/heldout.jsonl beside a sim spec)")
    p.set_defaults(run=run_eval)


def _utc_time(text: str) -> datetime:
    try:
        value = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not an ISO time: {text!r}") from exc
    if value.tzinfo is None:
        raise argparse.ArgumentTypeError(f"give a UTC offset, e.g. {text}Z")
    return value


def _print_json(value: dict[str, Any]) -> None:
    print(json.dumps(value, indent=2, sort_keys=True))


def run_spec_init(args: argparse.Namespace) -> int:
    from node.sim.layout import make_sim_network

    sim = make_sim_network(args.sim, validators=args.validators, family=args.family, genesis=args.genesis,
                           seed=args.seed)
    print(sim.spec_path)
    print(sim.network_id)
    return 0


def run_eval(args: argparse.Namespace) -> int:
    from node.cli.common import decode_network_blob, heldout_sequences, load_spec_model
    from training.evaluate import heldout_loss, loss_with_experts

    spec, model, adapter, tokenizer = load_spec_model(args.spec)
    sequences = heldout_sequences(args.heldout, args.spec, spec, tokenizer, args.seed)
    started = time.perf_counter()
    if args.blob is None:
        result = heldout_loss(model, sequences, batch_size=EVAL_BATCH, pad_id=tokenizer.pad_id, progress=True)
    else:
        try:
            data = args.blob.read_bytes()
        except OSError as exc:
            raise ValueError(f"{args.blob}: cannot read blob: {exc.strerror}") from exc
        _, tensors = decode_network_blob(args.blob, data, spec)
        result = loss_with_experts(model, adapter, tensors, sequences, batch_size=EVAL_BATCH,
                                   pad_id=tokenizer.pad_id, progress=True)
    _print_json({"loss": result.loss, "tokens": result.tokens, "seconds": time.perf_counter() - started})
    return 0

"""`tessera keygen` and `tessera spec check`: create a node key, validate a network spec.

Both only touch the files the user names and never the network. `spec check` also refuses a spec
whose blob headers (a miner's submission, a validator's global state or momentum) could be over its
`limits.max_header_bytes` (node.cli.spec.check_header_cap),
from the base model's config alone (a model on the meta device, no weights); where the model's config
is not at hand it says so on stderr and checks the spec file only.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from node.cli.main import command_group


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    keygen = subparsers.add_parser(
        "keygen", help="create a node key (Ed25519, mode 0600) and print its node id"
    )
    keygen.add_argument(
        "--out", required=True, metavar="FILE", help="where to write the key; never overwritten"
    )
    keygen.set_defaults(run=run_keygen)

    spec = command_group(subparsers, "spec", "work with network spec files")
    check = spec.add_parser("check", help="validate a spec file and print its network id")
    check.add_argument("file", metavar="FILE", help="spec TOML file")
    check.set_defaults(run=run_spec_check)


def run_keygen(args: argparse.Namespace) -> int:
    from protocol.identity import Identity, save_identity

    identity = Identity.generate()
    save_identity(identity, args.out)
    print(identity.node_id)
    return 0


def run_spec_check(args: argparse.Namespace) -> int:
    from protocol.spec import load_spec, spec_dir_path

    spec = load_spec(args.file)
    if spec.timing.clock_skew_s > spec.timing.reveal_s / 4:  # protocol.check.window: seeds open at most halfway
        print(f"tessera: warning: timing.clock_skew_s ({spec.timing.clock_skew_s}) is over a quarter of "
              f"timing.reveal_s ({spec.timing.reveal_s}): a miner could see the round seed while nodes still take "
              "its commit; lengthen REVEAL or narrow the skew", file=sys.stderr)
    source = spec_dir_path(args.file, spec.model.config or f"{spec.model.checkpoint}/config.json")
    if source.is_file():
        from node.cli.spec import check_header_cap
        from training.adapters import adapter_for
        from training.experts import expected_shapes
        from training.model import meta_base

        try:
            shapes = expected_shapes(meta_base(spec, Path(args.file)), adapter_for(spec.model.family), spec.group)
            check_header_cap(spec, shapes)
        except ValueError as exc:
            raise ValueError(f"{args.file}: {exc}") from None
    else:
        print(f"tessera: note: {source} is not here; blob header sizes were not checked", file=sys.stderr)
    print(spec.network_id)
    return 0

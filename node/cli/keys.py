"""`tessera keygen` and `tessera spec check`: create a node key, validate a network spec.

Both only touch the files the user names and never the network. `spec check` names, on stderr, every field the
spec leaves to this release's defaults (`protocol.spec.defaults_left`): its network id hashes them, so a release
with other defaults would read the file as another network. `spec check` also refuses a spec
whose blob headers (a miner's submission, a validator's global state or momentum) could be over its
`limits.max_header_bytes` (node.cli.spec.check_header_cap),
from the base model's config alone (a model on the meta device, no weights); where the model's config
is not at hand it says so on stderr and checks the spec file only.
"""

from __future__ import annotations

import argparse
import json
import sys
import tomllib
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
    from protocol.spec import defaults_left, load_spec, spec_dir_path
    from protocol.version import RELEASE

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
    left = defaults_left(tomllib.loads(Path(args.file).read_text(encoding="utf-8")))
    if left:
        fields = ", ".join(f"{name} = {json.dumps(value)}" for name, value in left)
        print(f"tessera: note: {args.file} leaves {len(left)} field(s) to the defaults of tessera {RELEASE}, and its "
              f"network id hashes them: {fields}. A release with other defaults would give this file another network "
              f"id (another network); written into the file, as `tessera spec new` writes every field, they keep its "
              f"id {spec.network_id} whatever a release's defaults", file=sys.stderr)
    print(spec.network_id)
    return 0

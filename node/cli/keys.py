"""`tessera keygen` and `tessera spec check`: create a node key, validate a network spec.

Both only touch the file the user names; neither needs torch or the network.
"""

from __future__ import annotations

import argparse

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
    from protocol.spec import load_spec

    print(load_spec(args.file).network_id)
    return 0

"""Placeholders for `tessera` commands not implemented yet; each says so and exits 2.

Whoever implements a command deletes its name here and registers the real one in its own module.
"""

from __future__ import annotations

import argparse
import sys

from node.cli import EXIT_USAGE, command_group

PENDING: tuple[str, ...] = ()
PENDING_SPEC: tuple[str, ...] = ()


def register(subparsers: argparse._SubParsersAction) -> None:
    for name in PENDING:
        _add(subparsers, name, name)
    spec = command_group(subparsers, "spec", "work with network spec files")
    for name in PENDING_SPEC:
        _add(spec, name, f"spec {name}")


def _add(subparsers: argparse._SubParsersAction, name: str, full_name: str) -> None:
    # No prefix chars: every argument, options included, is swallowed so the message below is shown.
    parser = subparsers.add_parser(name, help="(not yet available)", add_help=False, prefix_chars="\0")
    parser.add_argument("rest", nargs="*")
    parser.set_defaults(run=lambda args: _pending(full_name))


def _pending(full_name: str) -> int:
    print(f"tessera {full_name}: not yet available", file=sys.stderr)
    return EXIT_USAGE

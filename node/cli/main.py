"""The `tessera` command line: builds the argument parser from command modules and runs one command.

Each module named in COMMAND_MODULES exposes `register(subparsers) -> None`, which adds its
subcommands with `set_defaults(run=fn)`, where `fn(args) -> int` is the exit code. Modules keep
heavy imports (torch, libp2p) inside their run functions so `tessera --help` stays fast. User
errors (ValueError and its subclasses SpecError, KeyFileError) and file-system errors on the paths
a user gave (OSError) become one line on stderr and exit code 2, never a traceback; Ctrl-C at any point
(while torch imports, too) says "interrupted" and exits 130. This module knows no command's behaviour.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn

from protocol.version import describe
from training.allocator import set_policy

COMMAND_MODULES: tuple[str, ...] = (
    "node.cli.keys",
    "node.cli.offline",
    "node.cli.train",
    "node.cli.select",
    "node.cli.inspect",
    "node.cli.daemon",
    "node.cli.simulate",
    "node.cli.bootstrap",
    "node.cli.spec",
    "node.cli.successor",
    "node.cli.export",
    "node.cli.plan",
)

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line, like every other user error."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def command_group(subparsers: argparse._SubParsersAction[argparse.ArgumentParser], name: str,
                  help: str) -> argparse._SubParsersAction[argparse.ArgumentParser]:
    """The subcommand group `tessera NAME ...`, created on first use so several modules can add to it."""
    parser = subparsers.choices.get(name)
    if parser is None:
        parser = subparsers.add_parser(name, help=help, description=help)
        parser.set_defaults(_group_parser=parser)
        group = parser.add_subparsers(dest=f"{name}_command", metavar="COMMAND", required=True)
        parser.set_defaults(_subparsers=group)
    commands: argparse._SubParsersAction[argparse.ArgumentParser] = parser.get_default("_subparsers")
    return commands


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="tessera",
        description="Node for decentralized Mixture-of-Experts training: miners train target experts, "
        "validators score them by Proof-of-Loss and merge the best updates.",
    )
    parser.add_argument("--version", action="version", version=describe(),
                        help="print the release and the protocol version it speaks, and exit")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one `tessera` command; returns its exit code."""
    set_policy()  # before anything is allocated: training.allocator
    try:
        args = build_parser().parse_args(argv)  # imports every command module: Ctrl-C may land here
    except KeyboardInterrupt:
        return _interrupted()
    return run(args.run, args)  # set_defaults(run=...) of the chosen command


def run(command: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """Run one parsed command; a user's error is one line on stderr and exit code 2, Ctrl-C exit code 130."""
    try:
        return command(args)
    except ValueError as exc:
        message = "; ".join(line.strip() for line in str(exc).splitlines() if line.strip())
        print(f"tessera: error: {message}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as exc:  # a path the user gave that cannot be read or written
        where = "".join(f"{name}: " for name in (exc.filename, exc.filename2) if name is not None)
        print(f"tessera: error: {where}{exc.strerror or exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return _interrupted()


def _interrupted() -> int:
    print("tessera: interrupted", file=sys.stderr)
    return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())

"""The ``torchnext`` command line.

Subcommands live in a registry (:data:`SUBCOMMANDS`): each entry names the module that implements it. Such a module
provides ``add_arguments(parser)`` and ``run(args) -> int`` -- or, for a subcommand that passes its arguments on to
another parser (``raw_args``: ``torchnext run`` hands them to torchrun's), ``run_argv(argv) -> int``. Modules are
imported only when their subcommand runs, so ``torchnext --help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from torchnext._version import __version__

__all__ = ["SUBCOMMANDS", "Subcommand", "build_parser", "main"]


@dataclass(frozen=True, kw_only=True)
class Subcommand:
    """One ``torchnext <name>`` subcommand."""

    name: str
    """The word typed after ``torchnext``."""
    module: str
    """Module providing ``add_arguments(parser)`` and ``run(args) -> int``."""
    help: str
    """One line for ``torchnext --help``."""
    raw_args: bool = False
    """Whether the module parses its own arguments (``run_argv(argv)``) instead of ``add_arguments``/``run``."""


SUBCOMMANDS: dict[str, Subcommand] = {}


def register_subcommand(cmd: Subcommand) -> None:
    """Add ``cmd`` to the registry (a name can be registered once)."""
    if cmd.name in SUBCOMMANDS:
        raise ValueError(f"subcommand {cmd.name!r} is already registered")
    SUBCOMMANDS[cmd.name] = cmd


_BUILTIN: tuple[Subcommand, ...] = (
    Subcommand(
        name="doctor",
        module="torchnext.doctor.command",
        help="Show the environment, which torchnext backends can run here, and known hazards (--json, --strict).",
    ),
    Subcommand(name="coordinator", module="torchnext.ft.coordinator",
               help="run the fault-tolerance coordinator (TCPStore + membership service)"),
    Subcommand(name="demo", module="torchnext.demo.cli",
               help="fault-tolerant low-precision MoE training on local ranks that survives a killed rank"),
    Subcommand(name="fr", module="torchnext.comms.flight_recorder.cli", help="Flight Recorder: analyze dumps (fr analyze DIR)"),
    Subcommand(name="run", module="torchnext.comms.process_group.launch", raw_args=True,
               help="torchrun whose workers get torchnext process groups (gloo/nccl -> torchnext): run [torchrun options] "
                    "script.py [args]"),
)
for _cmd in _BUILTIN:
    register_subcommand(_cmd)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="torchnext",
        description="torchnext: fault tolerance and low precision for PyTorch, on every backend.",
    )
    parser.add_argument("--version", action="version", version=f"torchnext {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for cmd in SUBCOMMANDS.values():
        p = sub.add_parser(cmd.name, help=cmd.help, description=cmd.help)
        p.set_defaults(_module=cmd.module)
        # Arguments are added lazily in main() for the chosen subcommand only.
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    # First pass: find the subcommand without importing every implementation.
    if argv and argv[0] in SUBCOMMANDS:
        cmd = SUBCOMMANDS[argv[0]]
        module = importlib.import_module(cmd.module)
        if cmd.raw_args:
            return int(module.run_argv(argv[1:]) or 0)
        sub_parser = argparse.ArgumentParser(prog=f"torchnext {cmd.name}", description=cmd.help)
        module.add_arguments(sub_parser)
        args = sub_parser.parse_args(argv[1:])
        return int(module.run(args) or 0)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    return 0  # pragma: no cover - every registered command is handled above


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

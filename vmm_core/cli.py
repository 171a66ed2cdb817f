"""``vmm-core``: ``info`` explains backend selection; every other subcommand (``bench``,
the main job) is a plugin of the ``vmm_core.commands`` entry-point group.

The library names no command above it: the benchmark registers ``bench`` from its own
package (:mod:`vmm_bench`), as any other package could register its own.  Every failure
is one line on stderr with its own exit code (:data:`EXIT_CODES`, also in ``--help`` and
docs/benchmarks.md).  ``python -m vmm_core`` is this command too.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from importlib import metadata
from typing import Callable

from . import __version__
from .errors import (
    BackendNotFoundError,
    MissingExtraError,
    ReservationExceededError,
    VMMError,
)

# the exit statuses too: a command other packages register returns them
__all__ = ["main", "build_parser", "exit_status", "EXIT_CODES", "CLIError", "Command",
           "COMMAND_GROUP", "EXIT_OK", "EXIT_WRONG", "EXIT_USAGE", "EXIT_BAD_INPUT",
           "EXIT_OUTPUT", "EXIT_MISSING_EXTRA", "EXIT_VMM"]

EXIT_OK = 0
EXIT_WRONG = 1
EXIT_USAGE = 2
EXIT_BAD_INPUT = 3
EXIT_OUTPUT = 4
EXIT_MISSING_EXTRA = 5
EXIT_VMM = 6

#: every exit status of ``vmm-core``, documented in ``--help`` and docs/benchmarks.md
EXIT_CODES = {
    EXIT_OK: "done; every check passed",
    EXIT_WRONG: "the benchmark ran, but a check failed (wrong results, or aliasing not "
                "verified)",
    EXIT_USAGE: "a flag or value is invalid (nothing ran)",
    EXIT_BAD_INPUT: "--model or a model option is unusable",
    EXIT_OUTPUT: "an output path (--json, --plot) cannot be written (nothing ran)",
    EXIT_MISSING_EXTRA: "an optional dependency is missing; the error names the extra to "
                        "install (nothing ran)",
    EXIT_VMM: "vmm_core cannot run here (no usable backend, out of memory, ...)",
}

#: entry-point group of ``vmm-core`` subcommands: ``name = "package.module:command"``
#: naming a :class:`Command`
COMMAND_GROUP = "vmm_core.commands"


@dataclasses.dataclass(frozen=True)
class Command:
    """A ``vmm-core`` subcommand: ``add_arguments`` fills its own parser (description
    included); ``run`` returns the exit status and may raise any :class:`VMMError`
    (mapped by :func:`exit_status`)."""

    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


class CLIError(VMMError, ValueError):
    """A command line that cannot run; ``code`` is its exit status."""

    def __init__(self, message: str, code: int = EXIT_USAGE) -> None:
        super().__init__(message)
        self.code = code


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad value as one line (no usage block) with exit code 2."""

    def error(self, message: str):  # type: ignore[override]
        raise CLIError(message, EXIT_USAGE)


def exit_status(exc: VMMError) -> int:
    """The exit status of a failure, one per kind (:data:`EXIT_CODES`).  An error class
    of a command's own declares its status as ``exit_status``."""
    if isinstance(exc, CLIError):
        return exc.code
    own = getattr(exc, "exit_status", None)
    if isinstance(own, int) and own in EXIT_CODES:
        return own
    if isinstance(exc, MissingExtraError):
        return EXIT_MISSING_EXTRA
    if isinstance(exc, (ReservationExceededError, BackendNotFoundError)):
        return EXIT_USAGE  # --sizes too large for one virtual space; no backend so named
    return EXIT_VMM


def cmd_info() -> int:
    from .report import print_backends

    error = print_backends()
    return EXIT_OK if error is None else exit_status(error)


def epilog() -> str:
    codes = "\n".join(f"  {code}  {meaning}" for code, meaning in EXIT_CODES.items())
    return f"exit status:\n{codes}"


def commands() -> dict:
    """The registered subcommands, by name (``bench`` comes with the project)."""
    found = {}
    for ep in metadata.entry_points(group=COMMAND_GROUP):
        if ep.name != "info" and ep.name not in found:
            found[ep.name] = ep
    return found


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="vmm-core", epilog=epilog(),
                     formatter_class=argparse.RawDescriptionHelpFormatter,
                     description="vmm-core info explains which backend is active and why; "
                                 "vmm-core bench measures graph memory (or, without a device, "
                                 "runs the allocator scenario on the host backend).")
    parser.add_argument("--version", action="version", version=__version__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="backends found, which one is active and why")
    for name, ep in commands().items():
        command = ep.load()
        sub_parser = sub.add_parser(name, help=command.help, epilog=epilog(),
                                    formatter_class=argparse.RawDescriptionHelpFormatter)
        command.add_arguments(sub_parser)
        sub_parser.set_defaults(_run=command.run)
    return parser


def main(argv=None) -> int:
    try:
        args = build_parser().parse_args(argv)
        if args.command == "info":
            return cmd_info()
        return args._run(args)
    except VMMError as exc:
        print(f"vmm-core: error: {exc}", file=sys.stderr)
        return exit_status(exc)


if __name__ == "__main__":  # pragma: no cover
    # the commands raise vmm_core.cli's own CLIError: run the imported module, not a
    # second copy of it under the name __main__
    from vmm_core.cli import main as _main

    sys.exit(_main())

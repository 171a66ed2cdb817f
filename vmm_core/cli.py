"""``vmm-core``: ``info`` explains backend selection, ``bench`` runs the main job.

Every value on the command line is checked before any work starts (argparse types, then
:func:`check_bench_args`), so a typo costs nothing, and every failure is one line on
stderr with its own exit code (:data:`EXIT_CODES`, also in ``--help`` and the README).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys

from . import __version__
from .bench import scenarios
from .bench.measure import ORDERS
from .bench.workload import DTYPES, EXIT_BAD_MODEL, LLAMA_MODELS, MODEL_OPTIONS
from .errors import BenchModelError, ReservationExceededError, VMMError
from .graphs.executor import REUSE_MODES

__all__ = ["main", "build_parser", "check_bench_args", "EXIT_CODES"]

EXIT_OK = 0
EXIT_WRONG = 1
EXIT_USAGE = 2
EXIT_OUTPUT = 4
EXIT_MISSING_EXTRA = 5
EXIT_VMM = 6

#: every exit status of ``vmm-core``, documented in ``--help`` and the README
EXIT_CODES = {
    EXIT_OK: "done; every check passed",
    EXIT_WRONG: "the benchmark ran, but a check failed (wrong results, or aliasing not "
                "verified)",
    EXIT_USAGE: "a flag or value is invalid (nothing ran)",
    EXIT_BAD_MODEL: "--model or a model option is unusable",
    EXIT_OUTPUT: "an output path (--json, --plot) cannot be written (nothing ran)",
    EXIT_MISSING_EXTRA: "an optional dependency is missing; the error names the extra to "
                        "install (nothing ran)",
    EXIT_VMM: "vmm_core cannot run here (no usable backend, out of memory, ...)",
}

DEFAULT_MODES = "private,shared,vmm"
DEFAULT_SLEEP_GIB = "4,16"
DEFAULT_DTYPE = "bfloat16"


class CLIError(VMMError, ValueError):
    """A command line that cannot run; ``code`` is its exit status."""

    def __init__(self, message: str, code: int = EXIT_USAGE) -> None:
        super().__init__(message)
        self.code = code


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad value as one line (no usage block) with exit code 2."""

    def error(self, message: str):  # type: ignore[override]
        raise CLIError(message, EXIT_USAGE)


def cmd_info(args) -> int:
    from .report import print_backends

    return print_backends()


def cmd_bench(args) -> int:
    from .bench.report import write_json
    from .bench.runner import run_bench

    result = run_bench(args)
    if getattr(args, "json", None):
        write_json(result, args.json)
        print(f"wrote {args.json}")
    return EXIT_OK if result.get("ok", True) else EXIT_WRONG


# ---------------------------------------------------------------------- argument types
def _choices(allowed):
    """argparse type of a comma-separated list whose items must be in ``allowed``."""
    def parse(text: str) -> str:
        items = [t for t in text.split(",") if t]
        bad = [t for t in items if t not in allowed]
        if bad or not items:
            raise argparse.ArgumentTypeError(
                f"{','.join(bad) or repr(text)}: choose from {','.join(allowed)}")
        return ",".join(items)
    return parse


def _sizes(text: str) -> str:
    try:
        sizes = [int(t) for t in text.split(",") if t]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated batch sizes >= 1")
    return ",".join(map(str, sizes))


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: an integer >= 1")
    return value


def _gib_list(text: str) -> str:
    try:
        values = [float(t) for t in text.split(",") if t.strip()]
    except ValueError:
        values = []
    if not values or not all(0 < v < float("inf") for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated sizes in GiB, each > 0 "
                                         f"(e.g. 4,16 or 0.5)")
    return ",".join(t.strip() for t in text.split(",") if t.strip())


def _epilog() -> str:
    codes = "\n".join(f"  {code}  {meaning}" for code, meaning in EXIT_CODES.items())
    return f"exit status:\n{codes}"


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="vmm-core", epilog=_epilog(),
                     formatter_class=argparse.RawDescriptionHelpFormatter,
                     description="vmm-core info explains which backend is active and why; "
                                 "vmm-core bench measures graph memory (or, without a device, "
                                 "runs the allocator scenario on the host backend).")
    parser.add_argument("--version", action="version", version=__version__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="backends found, which one is active and why")
    from .bench.piecewise import STRATEGIES

    bench = sub.add_parser(
        "bench", help="graph memory: vmm vs shared vs private pools",
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=_epilog(),
        description="Measure graph memory on the best backend of this machine. Without a "
                    "device (CPU only) it runs the allocator scenario on the host backend "
                    "and says which flags it cannot honour there.\n\nscenarios:\n"
                    + scenarios.describe())
    bench.add_argument("--backend", default=None, help="backend name (default: detected)")
    bench.add_argument("--model", default=None, metavar="mlp|llama|llama8b|package.module:factory",
                       help="what the graphs capture (default mlp); a factory is called as "
                            "factory(device=, dtype=, max_batch=, seed=) and returns (fn, "
                            "example_inputs), see the README")
    bench.add_argument("--orders", default="ascending,descending,random",
                       type=_choices(ORDERS),
                       help="capture orders to compare, comma-separated: "
                            f"{', '.join(ORDERS)} (default: all; random draws from --seed)")
    bench.add_argument("--modes", default=None, type=_choices(REUSE_MODES),
                       help="strategies of the decode scenario, comma-separated "
                            f"(default {DEFAULT_MODES}; the largest size alone always runs)")
    bench.add_argument("--sizes", default=None, type=_sizes,
                       help="comma-separated batch sizes (default: vLLM's 51 decode sizes)")
    bench.add_argument("--dtype", default=None, choices=DTYPES,
                       help=f"dtype of the built-in models, passed to a factory (default "
                            f"{DEFAULT_DTYPE})")
    defaults = "; ".join(f"{name}: " + ", ".join(f"{k.replace('_', '-')} {v}"
                                                 for k, v in options.items())
                         for name, options in MODEL_OPTIONS.items())
    model = bench.add_argument_group(f"built-in model options (defaults: {defaults})")
    for name in dict.fromkeys(k for options in MODEL_OPTIONS.values() for k in options):
        model.add_argument("--" + name.replace("_", "-"), type=_positive_int, default=None,
                           metavar="N")
    bench.add_argument("--seed", type=int, default=0,
                       help="seed of the random capture order, the model's weights and the "
                            "inputs checked against eager (default 0)")
    bench.add_argument("--json", default=None, metavar="PATH",
                       help="write all results to this JSON file (checked writable first)")
    bench.add_argument("--plot", default=None, metavar="PATH",
                       help="write a PNG: growth curves and final bars (needs the 'plot' "
                            "extra, matplotlib)")
    bench.add_argument("--quiet", action="store_true",
                       help="no progress bars or per-configuration lines")
    bench.add_argument("--sleep", action="store_true",
                       help="also measure sleep/wake of the graph pool and tagged memory")
    bench.add_argument("--sleep-only", action="store_true",
                       help="measure sleep/wake only (skip the graph memory benchmark)")
    bench.add_argument("--sleep-gib", default=None, type=_gib_list,
                       help="comma-separated sizes to offload in the sleep benchmark, in GiB "
                            f"(default {DEFAULT_SLEEP_GIB})")
    bench.add_argument("--scenario", default=None,
                       help=f"comma-separated scenarios (default {scenarios.DEFAULT}): "
                            f"{', '.join(scenarios.SCENARIOS)}; see above")
    bench.add_argument("--steps", type=_positive_int, default=None,
                       help="sleep/wake steps of --scenario rl (default 5)")
    bench.add_argument("--strategies", default=None,
                       type=_choices(tuple(STRATEGIES)),
                       help="strategies of the piecewise and families scenarios, "
                            f"comma-separated (default {','.join(STRATEGIES)})")
    bench.add_argument("--distributed", action="store_true",
                       help="mapped tensor across ranks: gather vs all_gather (run under "
                            "torchrun --nproc-per-node N; one host rank without torchrun)")
    bench.add_argument("--one", default=None, help=argparse.SUPPRESS)  # child process mode
    bench.add_argument("--progress-lines", action="store_true",
                       help=argparse.SUPPRESS)  # child: forward progress to the parent
    return parser


# ---------------------------------------------------------------------- checks up front
def _check_writable(flag: str, path: str) -> None:
    """Refuse an output path that could not be written, before minutes of measuring."""
    if os.path.isdir(path):
        raise CLIError(f"{flag} {path}: is a directory; give a file path", EXIT_OUTPUT)
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise CLIError(f"{flag} {path}: directory {parent} does not exist; create it or "
                       f"choose another path", EXIT_OUTPUT)
    if not os.access(parent, os.W_OK | os.X_OK) or (
            os.path.exists(path) and not os.access(path, os.W_OK)):
        raise CLIError(f"{flag} {path}: not writable (permission denied); choose another "
                       f"path", EXIT_OUTPUT)


def _need(module: str, extra: str, why: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise CLIError(f"{why} needs {module}, which is not installed: pip install "
                       f"'vmm_core[{extra}]' (or pip install -e '.[{extra}]' in a checkout)",
                       EXIT_MISSING_EXTRA)


def check_bench_args(args) -> list[str]:
    """Check what argparse cannot (cross-flag rules, output paths, optional packages) and
    fill in defaults.  Raises :class:`CLIError` before any work; returns notes, one line
    per flag the chosen scenario does not use."""
    given = {name for name in ("modes", "strategies", "sleep_gib", "dtype", "scenario")
             if getattr(args, name, None) is not None}
    given |= {name for opts in MODEL_OPTIONS.values() for name in opts
              if getattr(args, name, None) is not None}
    args.given = given
    try:
        names = scenarios.parse(args.scenario or scenarios.DEFAULT)
    except ValueError as exc:
        raise CLIError(str(exc)) from None
    args.scenario = ",".join(names)
    from .bench.piecewise import STRATEGIES

    args.modes = args.modes or DEFAULT_MODES
    args.strategies = args.strategies or ",".join(STRATEGIES)
    args.sleep_gib = args.sleep_gib or DEFAULT_SLEEP_GIB
    args.dtype = args.dtype or DEFAULT_DTYPE
    for flag in ("json", "plot"):
        if getattr(args, flag, None):
            _check_writable("--" + flag, getattr(args, flag))
    if args.plot:
        _need("matplotlib", "plot", f"--plot {args.plot}")
    if args.model in LLAMA_MODELS:
        _need("transformers", "bench", f"--model {args.model}")

    notes = []
    uses_strategies = any(scenarios.SCENARIOS[n].uses_strategies for n in names)
    if "strategies" in given and not uses_strategies:
        notes.append(f"--strategies: scenario {args.scenario} does not use it (the "
                     f"piecewise and families scenarios do); ignored")
    if "modes" in given and names != ["decode"]:
        notes.append(f"--modes: scenario {args.scenario} compares --strategies instead; "
                     f"ignored")
    if "sleep_gib" in given and not (args.sleep or args.sleep_only):
        notes.append("--sleep-gib: used only with --sleep or --sleep-only; ignored")
    return notes


def main(argv=None) -> int:
    try:
        args = build_parser().parse_args(argv)
        notes = check_bench_args(args) if args.command == "bench" else []
    except CLIError as exc:
        print(f"vmm-core: error: {exc}", file=sys.stderr)
        return exc.code
    try:
        if args.command == "info":
            return cmd_info(args)
        if not args.one:
            for note in notes:
                print(f"note: {note}")
        args.notes = notes
        return cmd_bench(args)
    except CLIError as exc:
        print(f"vmm-core: error: {exc}", file=sys.stderr)
        return exc.code
    except BenchModelError as exc:  # every benchmark child would fail alike: distinct code
        print(f"vmm-core: error: {exc}", file=sys.stderr)
        return EXIT_BAD_MODEL
    except ReservationExceededError as exc:  # --sizes too large for one virtual space
        print(f"vmm-core: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except VMMError as exc:
        print(f"vmm-core: error: {exc}", file=sys.stderr)
        return EXIT_VMM


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

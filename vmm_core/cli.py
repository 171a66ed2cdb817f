"""``vmm-core``: ``info`` explains backend selection, ``bench`` runs the main job."""

from __future__ import annotations

import argparse
import sys

from . import __version__
from .bench.measure import ORDERS
from .bench.workload import DTYPES, EXIT_BAD_MODEL, MODEL_OPTIONS
from .errors import BenchModelError, VMMError
from .graphs.executor import REUSE_MODES

__all__ = ["main"]


def cmd_info(args) -> int:
    from .report import print_backends

    return print_backends()


def cmd_bench(args) -> int:
    from .bench.report import write_json
    from .bench.runner import run_bench

    result = run_bench(args)
    if args.json:
        write_json(result, args.json)
        print(f"wrote {args.json}")
    return 0 if result.get("ok", True) else 1


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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vmm-core", description=__doc__)
    parser.add_argument("--version", action="version", version=__version__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="backends found, which one is active and why")
    bench = sub.add_parser("bench", help="graph memory: vmm vs shared vs private pools")
    bench.add_argument("--backend", default=None, help="backend name (default: detected)")
    bench.add_argument("--model", default=None, metavar="mlp|llama|package.module:factory",
                       help="what the graphs capture (default mlp); a factory is called as "
                            "factory(device=, dtype=, max_batch=, seed=) -> (fn, "
                            "example_inputs), see the README")
    bench.add_argument("--orders", default="ascending,descending,random",
                       type=_choices(ORDERS))
    bench.add_argument("--modes", default="private,shared,vmm", type=_choices(REUSE_MODES),
                       help="strategies to compare (the largest size alone always runs)")
    bench.add_argument("--sizes", default=None, type=_sizes,
                       help="comma-separated batch sizes (default: vLLM's 51 decode sizes)")
    bench.add_argument("--dtype", default="bfloat16", choices=DTYPES,
                       help="dtype of the built-in models, passed to a factory")
    defaults = "; ".join(f"{name}: " + ", ".join(f"{k.replace('_', '-')} {v}"
                                                 for k, v in options.items())
                         for name, options in MODEL_OPTIONS.items())
    model = bench.add_argument_group(f"built-in model options (defaults: {defaults})")
    for name in dict.fromkeys(k for options in MODEL_OPTIONS.values() for k in options):
        model.add_argument("--" + name.replace("_", "-"), type=int, default=None)
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument("--json", default=None, help="write all results to this JSON file")
    bench.add_argument("--plot", default=None,
                       help="write a PNG: growth curves and final bars (needs matplotlib)")
    bench.add_argument("--quiet", action="store_true",
                       help="no progress bars or per-configuration lines")
    bench.add_argument("--sleep", action="store_true",
                       help="also measure sleep/wake of the graph pool and tagged memory")
    bench.add_argument("--sleep-only", action="store_true",
                       help="measure sleep/wake only (skip the graph memory benchmark)")
    bench.add_argument("--sleep-gib", default="4,16",
                       help="comma-separated sizes to offload in the sleep benchmark (GiB)")
    bench.add_argument("--scenario", default="decode",
                       help="decode (the executor, default), or a comma list of piecewise, "
                            "families, whole, ondemand, record-stream, exec-cache: engine runners "
                            "on a transformers Llama stack (needs the 'bench' extra)")
    bench.add_argument("--steps", type=int, default=None,
                       help="sleep/wake steps of --scenario rl (default 5)")
    bench.add_argument("--strategies", default="vmm,vmm-keep,vllm,keep,sglang,private",
                       help="strategies of the piecewise and families scenarios")
    bench.add_argument("--distributed", action="store_true",
                       help="mapped tensor across ranks: gather vs all_gather (run under "
                            "torchrun --nproc-per-node N; one host rank without torchrun)")
    bench.add_argument("--one", default=None, help=argparse.SUPPRESS)  # child process mode
    bench.add_argument("--progress-lines", action="store_true",
                       help=argparse.SUPPRESS)  # child: forward progress to the parent
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "info":
            return cmd_info(args)
        return cmd_bench(args)
    except BenchModelError as exc:  # every benchmark child would fail alike: distinct code
        print(f"vmm-core: error: {exc}", file=sys.stderr)
        return EXIT_BAD_MODEL
    except VMMError as exc:
        print(f"vmm-core: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

"""``vmm-core``: ``info`` explains backend selection, ``bench`` runs the main job."""

from __future__ import annotations

import argparse
import json
import sys

from . import __version__
from .errors import VMMError

__all__ = ["main"]


def cmd_info(args) -> int:
    from .report import print_backends

    return print_backends()


def cmd_bench(args) -> int:
    from .bench.runner import run_bench

    result = run_bench(args)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=2)
        print(f"wrote {args.json}")
    return 0 if result.get("ok", True) else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vmm-core", description=__doc__)
    parser.add_argument("--version", action="version", version=__version__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="backends found, which one is active and why")
    bench = sub.add_parser("bench", help="graph memory: vmm vs shared vs private pools")
    bench.add_argument("--backend", default=None, help="backend name (default: detected)")
    bench.add_argument("--orders", default="ascending,descending,random")
    bench.add_argument("--modes", default="private,shared,vmm")
    bench.add_argument("--sizes", default=None,
                       help="comma-separated batch sizes (default: vLLM's 51 decode sizes)")
    bench.add_argument("--layers", type=int, default=4)
    bench.add_argument("--hidden", type=int, default=4096)
    bench.add_argument("--ffn", type=int, default=14336)
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument("--json", default=None, help="write all results to this JSON file")
    bench.add_argument("--plot", default=None, help="write a PNG plot (needs matplotlib)")
    bench.add_argument("--sleep", action="store_true",
                       help="also measure sleep/wake of the graph pool and tagged memory")
    bench.add_argument("--sleep-only", action="store_true",
                       help="measure sleep/wake only (skip the graph memory benchmark)")
    bench.add_argument("--sleep-gib", default="4,16",
                       help="comma-separated sizes to offload in the sleep benchmark (GiB)")
    bench.add_argument("--scenario", default="decode",
                       help="decode (the executor, default), or a comma list of piecewise, "
                            "families, record-stream: an engine's own runner over GraphPool "
                            "on a transformers Llama stack (needs the 'bench' extra)")
    bench.add_argument("--strategies", default="vmm,vllm,sglang,private",
                       help="strategies of the piecewise and families scenarios")
    bench.add_argument("--one", default=None, help=argparse.SUPPRESS)  # child process mode
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "info":
            return cmd_info(args)
        return cmd_bench(args)
    except VMMError as exc:
        print(f"vmm-core: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

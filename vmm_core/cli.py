"""``vmm-core``: ``info`` explains backend selection, ``bench`` runs the main job."""

from __future__ import annotations

import argparse
import json
import platform
import sys

from . import __version__
from .errors import VMMError
from .registry import ENV_BACKEND, default_registry

__all__ = ["main"]


def cmd_info(args) -> int:
    import importlib.metadata as md
    import os

    reg = default_registry()
    backends = reg.backends()
    print(f"vmm_core {__version__}  python {platform.python_version()}  "
          f"pluggy {md.version('pluggy')}")
    try:
        torch_version = md.version("torch")
    except md.PackageNotFoundError:
        torch_version = "not installed"
    print(f"torch {torch_version}")
    print(f"{ENV_BACKEND}={os.environ.get(ENV_BACKEND, '(unset)')}")
    print("\nbackends:")
    for name in sorted(backends):
        probe = backends[name].probe()
        state = "usable" if probe.available else "unusable"
        extra = f", devices={probe.device_count}" if probe.available else ""
        print(f"  {name:8s} {state}{extra} (priority {probe.priority}): {probe.reason}")
        for key, value in probe.versions.items():
            print(f"           {key}: {value}")
    for name, why in reg.load_errors.items():
        print(f"  {name:8s} failed to load: {why}")
    try:
        sel = reg.select()
    except VMMError as exc:
        print("\nactive: none")
        print(f"vmm-core: error: {exc}", file=sys.stderr)
        return 2
    caps = sel.backend.capabilities(0)
    print(f"\nactive: {sel.backend.name} ({sel.reason})")
    print(f"  granularity {caps.granularity} B, partial map {caps.partial_map}, "
          f"set-access spans mappings {caps.set_access_spans_mappings}, "
          f"graph pool {caps.graph_pool}")
    if not caps.graph_pool:
        print("  graphs fall back to one shared pool: this backend cannot route capture "
              "allocations to a custom-allocator pool")
    if caps.notes:
        print(f"  notes: {caps.notes}")
    return 0


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
    bench.add_argument("--sleep-gib", type=float, default=4.0,
                       help="bytes to offload in the sleep benchmark (GiB)")
    bench.add_argument("--distributed", action="store_true",
                       help="mapped tensor across ranks: gather vs all_gather (run under "
                            "torchrun --nproc-per-node N; one host rank without torchrun)")
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

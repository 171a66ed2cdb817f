"""What ``vmm-core info`` and ``vmm_core.info()`` print: the backends, why one is active,
and (from Python) where this process's tagged memory is."""

from __future__ import annotations

import sys

from .errors import VMMError

__all__ = ["print_backends", "print_memory", "info"]


def print_backends(file=None) -> VMMError | None:
    """Every backend, whether it is usable and why, and the active one's capabilities.

    Returns None, or the error that kept a backend from being selected (printed on
    stderr; the CLI's exit status depends on its kind)."""
    import importlib.metadata as md
    import os
    import platform

    from . import __version__
    from .memory.offload import choose_strategy
    from .registry import ENV_BACKEND, default_registry

    out = file or sys.stdout

    def say(text: str = "") -> None:
        print(text, file=out)

    reg = default_registry()
    backends = reg.backends()
    say(f"vmm_core {__version__}  python {platform.python_version()}  "
        f"pluggy {md.version('pluggy')}")
    try:
        torch_version = md.version("torch")
    except md.PackageNotFoundError:
        torch_version = "not installed"
    say(f"torch {torch_version}")
    say(f"{ENV_BACKEND}={os.environ.get(ENV_BACKEND, '(unset)')}")
    say("\nbackends:")
    for name in sorted(backends):
        probe = backends[name].probe()
        state = "usable" if probe.available else "unusable"
        extra = f", devices={probe.device_count}" if probe.available else ""
        say(f"  {name:8s} {state}{extra} (priority {probe.priority}): {probe.reason}")
        if probe.library:
            say(f"           library: {probe.library}")
        for key, value in probe.versions.items():
            say(f"           {key}: {value}")
    for name, why in reg.load_errors.items():
        say(f"  {name:8s} failed to load: {why}")
    try:
        sel = reg.select()
    except VMMError as exc:
        say("\nactive: none")
        print(f"vmm-core: error: {exc}", file=sys.stderr)
        return exc
    caps = sel.backend.capabilities(0)
    say(f"\nactive: {sel.backend.name} ({sel.reason})")
    say(f"  granularity {caps.granularity} B, partial map {caps.partial_map}, "
        f"set-access spans mappings {caps.set_access_spans_mappings}, "
        f"graph pool {caps.graph_pool}")
    if not caps.graph_pool:
        say("  graphs fall back to one shared pool: this backend cannot route capture "
            "allocations to a custom-allocator pool")
    say(f"  offload: {choose_strategy(sel.backend, 0)} copies (async copies "
        f"{caps.async_copies})")
    if caps.notes:
        say(f"  notes: {caps.notes}")
    return None


def print_memory(summary: dict | None = None, file=None) -> None:
    """One line per tag of ``memory_summary()`` (this process's tagged memory)."""
    from .memory import offload, tagged

    out = file or sys.stdout
    summary = tagged.memory_summary() if summary is None else summary
    mib = 2 ** 20
    print("\ntagged memory in this process:", file=out)
    if not summary:
        print("  none", file=out)
    for tag, s in summary.items():
        where = s["backend"] if isinstance(s["backend"], str) else ",".join(s["backend"])
        print(f"  {tag:16s} {'asleep' if s['asleep'] else 'awake ':6s} device "
              f"{s['device_bytes'] / mib:10.1f} MiB  host {s['host_bytes'] / mib:10.1f} MiB  "
              f"spaces {s['spaces']:4d}  handles {s['handles']:4d}  on {where}:{s['device']}",
              file=out)
    staging = offload.staging_bytes()
    if staging:
        print(f"  (offload staging ring: {staging / mib:.1f} MiB of pinned host memory, "
              f"shared by every tag)", file=out)


def info(file=None) -> None:
    """Print what ``vmm-core info`` prints, then this process's tagged memory."""
    print_backends(file)
    print_memory(file=file)

"""What the engine-runner scenarios print is read off their children's records alone, so
the parent, and a test with records of its own making, print a scenario's table and its
pool lines without the runners, the model or a device.
"""

from __future__ import annotations

from . import report
from .peers import DISCIPLINES
from .trace_report import print_traces

__all__ = ["print_scenario", "space_lines"]


def _done_line(r: dict) -> str:
    name = report.strategy_label(r)
    if "graph_bytes" not in r:
        return f"  done {r['scenario']} {name}"
    line = (f"  done {r['scenario']} {name} {r['order']}: {r['graphs']} graphs, "
            f"{r['graph_bytes'] / 2**20:.0f} MiB")
    if r.get("served_graph_bytes") is not None:
        line += f" ({r['served_graph_bytes'] / 2**20:.0f} MiB after the trace)"
    return line + f", {len(r.get('wrong_graphs') or [])} wrong"


def _reference(rows) -> str:
    """The peer the GraphPool rows are compared with: vLLM's discipline where it ran."""
    return "vllm" if any(r.get("strategy") == "vllm" for r in rows) else "sglang"


def _mib(n) -> str:
    return f"{n / 2**20:.1f}" if n is not None else "-"


def print_scenario(scenario, rows, device, torch_version, description,
                   key_alone=None) -> None:
    """The table, the peers it names, then per vmm row: the physical pool against the
    largest space, and graph memory against the target (largest key alone + the
    executables of every other graph, measured per graph by instantiating graphs, or
    inferred from the pool accounting where that probe did not run).  ``key_alone`` is
    the largest key's own run, when the scenario's floor is not one key (families)."""
    print(f"\n{scenario}: {description}; {device}, torch {torch_version}")
    if scenario == "record-stream":
        from .record_stream import print_record_stream

        print_record_stream(rows)
        return
    reference = _reference(rows)
    print(report.table(rows, reference=reference, header=(
        "graph memory = drop of mem_get_info free bytes from before the first capture; "
        "exec/graph = memory outside every pool, per graph; exe meas. = per graph, "
        "measured by instantiating captured graphs (cudaGraphInstantiate); exe MiB = the "
        "executables the pool owns at the end (estimated; - where torch keeps them)")))
    print_traces(scenario, rows, reference)  # a table and the targets per trace
    for strategy in dict.fromkeys(r.get("strategy") for r in rows):
        d = DISCIPLINES.get(strategy)
        if d is not None:
            print(f"  {strategy}: {d.what} [{d.source}]")
    ok = [r for r in rows if "error" not in r]
    alone = key_alone or next((r for r in ok if r["strategy"] == report.FLOOR), None)
    for r in (r for r in ok if str(r["strategy"]).startswith("vmm")):
        line = (f"  {report.strategy_label(r)} {r['order']}: physical pool "
                f"{_mib(r['physical_bytes'])} MiB")
        if r.get("largest_space_bytes"):
            line += (f" = {r['physical_bytes'] / r['largest_space_bytes']:.3f}x the largest "
                     f"space's own bytes ({_mib(r['largest_space_bytes'])} MiB)")
        line += f", {r['handles']} handle(s)"
        per_graph = r.get("exec_bytes_per_graph")
        how = "measured"
        if per_graph is None:
            ex = report.executable_bytes(r)
            per_graph = ex / r["graphs"] if ex is not None and r["graphs"] else None
            how = "inferred from pool accounting"
        if alone and per_graph is not None and r["graphs"] > alone["graphs"]:
            target = alone["graph_bytes"] + per_graph * (r["graphs"] - alone["graphs"])
            line += (f"; graph memory / (largest key alone, {_mib(alone['graph_bytes'])} MiB, "
                     f"+ executables of the other {r['graphs'] - alone['graphs']} graphs, "
                     f"{how}) = " + (f"{r['graph_bytes'] / target:.3f}" if target > 0
                                     else "- (nothing measured)"))
        print(line)
        # families: the floor's fresh pools are of one family, the spaces of two
        for extra in space_lines(r, None if key_alone else alone, per_graph):
            print("    " + extra)


def _size_of(key: str) -> int:
    tail = key.rsplit(":", 1)[-1]
    return int(tail) if tail.isdigit() else -1


def space_lines(r: dict, alone: dict | None, per_graph=None) -> list[str]:
    """Which key's space sets the physical pool, whether each space holds exactly what
    the framework's pool over it holds, and how each compares with the framework's own
    fresh pool for that size alone (``fresh_pool_bytes`` of the floor's record)."""
    spaces = r.get("spaces") or {}
    if not spaces:
        return []
    top_key = max(spaces, key=lambda k: (spaces[k]["bytes"], _size_of(k)))
    big_key = max(spaces, key=lambda k: (_size_of(k), spaces[k]["bytes"]))
    lines = [f"largest space: {top_key}, {_mib(spaces[top_key]['bytes'])} MiB; the largest "
             f"size's ({big_key}): {_mib(spaces[big_key]['bytes'])} MiB"]
    held = {k: v["torch_segment_bytes"] for k, v in spaces.items()
            if v.get("torch_segment_bytes") is not None}
    if held:
        over = sorted(((spaces[k]["bytes"] - n, k) for k, n in held.items()
                       if spaces[k]["bytes"] != n), reverse=True)
        if not over:
            lines.append(f"every space asked for exactly the segments its pool holds "
                         f"({len(held)} keys): nothing was given back and asked again")
        else:
            shown = ", ".join(f"{k} {d / 2**20:+.1f} MiB" for d, k in over[:5])
            lines.append(f"{len(over)} of {len(held)} spaces asked for more than their pool "
                         f"holds now (segments given back and asked again, or rounding): "
                         f"{shown}")
    fresh = (alone or {}).get("fresh_pool_bytes") or {}
    if fresh:
        f_top = max(fresh, key=lambda k: (fresh[k], int(k)))
        f_big = max(fresh, key=int)
        lines.append(f"torch, each size alone in a fresh pool: largest {f_top}, "
                     f"{_mib(fresh[f_top])} MiB; size {f_big}: {_mib(fresh[f_big])} MiB")
        pairs = [(spaces[k]["bytes"] - fresh[str(_size_of(k))], k) for k in spaces
                 if str(_size_of(k)) in fresh]
        differ = sorted((p for p in pairs if p[0] != 0), reverse=True)
        if pairs and not differ:
            lines.append(f"every space = torch's fresh pool of its size alone "
                         f"({len(pairs)} keys)")
        elif differ:
            shown = ", ".join(f"{k} {d / 2**20:+.1f} MiB" for d, k in differ[:5])
            lines.append(f"{len(differ)} of {len(pairs)} spaces differ from torch's fresh "
                         f"pool of their size alone: {shown}")
        floor = alone.get("pool_bytes") if alone else None
        if alone and floor is not None and per_graph is not None \
                and r["graphs"] > alone["graphs"]:
            target = (alone["graph_bytes"] - floor + fresh[f_top]
                      + per_graph * (r["graphs"] - alone["graphs"]))
            lines.append(f"graph memory / (largest fresh pool of any size, "
                         f"{_mib(fresh[f_top])} MiB, in place of the largest size's "
                         f"{_mib(floor)} MiB) = {r['graph_bytes'] / target:.3f}")
    return lines

"""What ``GraphPool.stats()["executables"]`` says: the executable cache's counters
(:class:`Counts`, kept by :mod:`vmm_core.graphs.executables` under its lock) and the one
dictionary built from them and the cache's state (docs/executables.md names each field).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

__all__ = ["Counts", "executables_stats"]


@dataclass
class Counts:
    """What the policy did, counted as it happened."""

    hits: int = 0
    misses: int = 0
    instantiations: int = 0
    instantiate_seconds: float = 0.0
    updates: int = 0
    update_seconds: float = 0.0
    update_refused: Counter = field(default_factory=Counter)
    evictions: int = 0
    framework_replays: int = 0
    eager_instantiations: int = 0
    released_on_sleep: int = 0
    released_on_sleep_bytes: int = 0
    prepared_ahead: int = 0
    unused_ahead: int = 0
    waits: int = 0
    wait_seconds: float = 0.0
    hints: int = 0
    blocks: int = 0
    cold_blocks: int = 0
    remade: int = 0


def executables_stats(cache) -> dict:
    """``cache``'s stats; call with its lock held."""
    c, res = cache.counts, cache._res
    graphs = [o for o in cache._owned.values() if o.ref() is not None]
    forecast = cache._forecast
    return {
        "policy": cache.policy.as_dict(),
        "graphs": sum(1 for o in graphs if not o.seeded),
        "resident": len(res.resident),
        "resident_bytes": res.resident_bytes,
        "peak_resident": res.peak_count,
        "peak_resident_bytes": res.peak_bytes,
        "hits": c.hits + sum(s.hits for s in cache._slots.values()),
        "misses": c.misses,
        "instantiations": c.instantiations,
        "instantiate_seconds": c.instantiate_seconds,
        "updates": c.updates,
        "update_seconds": c.update_seconds,
        "update_refused": dict(c.update_refused),
        "unshareable_topologies": len(cache._unshareable),
        "evictions": c.evictions,
        "keys_over_budget": list(cache._over_budget),
        "framework_replayed": sum(1 for o in graphs if o.seeded),
        # kernels are read at a graph's first replay: until then it counts in "graphs"
        "kernels_unread": sum(1 for o in graphs if o.unread),
        "framework_replays": c.framework_replays,
        "eager_instantiations": c.eager_instantiations,
        "released_on_sleep": c.released_on_sleep,
        "released_on_sleep_bytes": c.released_on_sleep_bytes,
        "last_sleep": dict(cache.last_sleep) if cache.last_sleep else None,
        "prepared_ahead": c.prepared_ahead,
        "unused_ahead": c.unused_ahead,
        "waits": c.waits,
        "wait_seconds": c.wait_seconds,
        "hints": c.hints,
        "blocks": c.blocks,
        "cold_blocks": c.cold_blocks,
        "remade": c.remade,
        "resident_updated": res.updated,
        "in_flight": len(cache._pending),
        "forecast_half_life": forecast.half_life if forecast is not None else None,
    }

"""The segments of one torch.cuda.MemPool, read from torch's memory snapshot (the pool
adapter's live and free blocks, the routing-order probe)."""

from __future__ import annotations

__all__ = ["pool_segments"]


def pool_segments(pool, device: int) -> list[dict]:
    import torch

    snapshot = getattr(pool, "snapshot", None)
    if snapshot is None:
        segments = torch.cuda.memory_snapshot()
    else:
        try:
            segments = snapshot(include_traces=False)  # torch >= 2.12: much cheaper
        except TypeError:
            segments = snapshot()
    return [s for s in segments
            if tuple(s.get("segment_pool_id", ())) == tuple(pool.id)
            and s.get("device", device) == device]

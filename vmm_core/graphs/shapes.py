"""The executor's buckets: the batch sizes it captures, and the one a batch runs at."""

from __future__ import annotations

__all__ = ["default_buckets", "pick_bucket"]


def default_buckets(max_size: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 16 up to ``max_size`` (as xLLM does), max included."""
    if max_size < 1:
        raise ValueError(f"max_size must be >= 1, got {max_size}")
    buckets = [b for b in (1, 2, 4, 8) if b <= max_size]
    buckets += list(range(16, max_size + 1, 16))
    if buckets[-1] != max_size:
        buckets.append(max_size)
    return buckets


def pick_bucket(buckets: list[int], size: int) -> int:
    """The smallest bucket >= size (buckets sorted ascending)."""
    for b in buckets:
        if b >= size:
            return b
    raise ValueError(f"batch {size} exceeds the largest bucket {buckets[-1]}: add a bucket "
                     f">= {size} (up to the batch of max_inputs), or create the executor "
                     f"with larger max_inputs")

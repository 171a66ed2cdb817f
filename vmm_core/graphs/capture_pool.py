"""What :class:`vmm_core.GraphExecutor` asks of the pool it captures into.

:class:`vmm_core.GraphPool` is the library's pool.  A runner that wants the executor's
buckets, buffers and output copies over another kind of pool (the benchmark runs it over
plain torch pools, its baselines) passes an object with this interface as
``GraphExecutor(..., pool=...)``; the library never needs to know that pool.
"""

from __future__ import annotations

import inspect
from contextlib import AbstractContextManager
from typing import Any, Protocol, runtime_checkable

__all__ = ["CapturePool", "POOL_INTERFACE", "missing_from_interface", "warmup_takes_key"]


@runtime_checkable
class CapturePool(Protocol):
    """The pool interface of :class:`vmm_core.GraphExecutor`.

    ``space(key)`` is a ``with`` block yielding the handle the framework's capture call
    takes as ``pool=``; ``replaying(key)`` a block the executor launches ``key``'s graph
    in; ``serialized()`` the block that keeps other threads' captures and replays of the
    pool (and sleeps of its memory) out while the executor checks, captures and launches.
    ``stats()`` returns at least ``keys`` and ``phase_seconds`` (seconds per phase), which
    the executor merges with its own; ``allocator`` is the pool's SharedVMMAllocator or
    None; ``fallback_reason`` why memory is not shared as asked, or None.
    """

    backend: Any
    device: int
    ops: Any
    reuse: str
    allocator: Any
    fallback_reason: str | None

    def serialized(self) -> AbstractContextManager: ...

    def warmup(self, fn, key=None) -> None: ...  # key=: optional (warmup_takes_key)

    def new_graph(self) -> Any: ...

    def space(self, key) -> AbstractContextManager: ...

    def replaying(self, key) -> AbstractContextManager: ...

    def compact(self) -> None: ...

    def trim(self) -> None: ...

    def stats(self) -> dict: ...

    def check_can_close(self) -> None: ...

    def close(self) -> None: ...


#: the names :class:`CapturePool` declares
POOL_INTERFACE = ("backend", "device", "ops", "reuse", "allocator", "fallback_reason",
                  "serialized", "warmup", "new_graph", "space", "replaying", "compact",
                  "trim", "stats", "check_can_close", "close")


def missing_from_interface(pool) -> list[str]:
    """The names of :class:`CapturePool` that ``pool`` lacks."""
    return [name for name in POOL_INTERFACE if not hasattr(pool, name)]


def warmup_takes_key(pool) -> bool:
    """Whether ``pool.warmup`` takes ``key=`` (the key about to be captured, whose space
    :class:`vmm_core.GraphPool` makes meanwhile); a pool written against the interface's
    ``warmup(fn)`` is called without it, and so is one taking only ``**kwargs`` (a proxy
    or a decorator that forwards them may wrap a ``warmup(fn)``)."""
    try:
        params = inspect.signature(pool.warmup).parameters.values()
    except (TypeError, ValueError):  # a callable without a signature: as before
        return False
    return any(p.name == "key" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
               for p in params)

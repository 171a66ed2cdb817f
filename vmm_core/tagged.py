"""Tagged memory: sleep and wake groups of allocators by tag.

Placeholder registry; filled out by the sleep/wake work.
"""

from __future__ import annotations

import threading

_registry: dict[str, list] = {}
_lock = threading.Lock()


def register(tag: str, allocator) -> None:
    with _lock:
        allocs = _registry.setdefault(tag, [])
        if not any(a is allocator for a in allocs):
            allocs.append(allocator)


def unregister(tag: str, allocator) -> None:
    with _lock:
        allocs = _registry.get(tag, [])
        _registry[tag] = [a for a in allocs if a is not allocator]

"""Options of torch's caching allocator that vmm_core holds for a while, over the user's.

torch's setter (``torch._C._accelerator_setAllocatorSettings``; torch 2.9-2.10:
``_cuda_cudaCachingAllocator_set_allocator_settings``) re-parses a whole configuration
and resets the options it does not name (``max_split_size_mb``,
``garbage_collection_threshold``, ``roundup_power2_divisions``: torch 2.9-2.11,
``AcceleratorAllocatorConfig::parseArgs``).  So every call passes the user's own
configuration first and then every option held now (the last value of a key wins), and
all holders go through this one module: a capture's record-stream reuse ending must not
undo the split size the whole-process routing holds, nor the reverse.  Options set at
run time through torch's setter by other code are not known here: a hold or release
resets them to the environment's values (what torch's setter does to any caller).
"""

from __future__ import annotations

import os
import threading

from vmm_core.plugin import at_fork

__all__ = ["hold", "user_alloc_conf", "user_sets"]

_lock = threading.Lock()
#: key -> the values held now, in the order they were taken (the last one applies)
_held: dict[str, list[str]] = {}
#: key -> what it is given back as once nothing holds it (None: left out, torch resets it)
_released: dict[str, str | None] = {}


def user_alloc_conf() -> str:
    """The allocator configuration the user gave, as torch read it at start: the first of
    PYTORCH_CUDA_ALLOC_CONF and PYTORCH_ALLOC_CONF that is set (the order of
    ``AcceleratorAllocatorConfig::instance()``)."""
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        value = os.environ.get(name)
        if value is not None:
            return value.strip().strip(",")
    return ""


def user_sets(key: str) -> str | None:
    """The value the user's configuration gives ``key`` (its last one), or None."""
    found = None
    for part in user_alloc_conf().split(","):
        name, _, value = part.partition(":")
        if name.strip().lower() == key.lower():
            found = value.strip()
    return found


def _setter():
    import torch

    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if setter is None:  # torch 2.9-2.10
        setter = torch._C._cuda_cudaCachingAllocator_set_allocator_settings
    return setter


def _conf() -> str:
    parts = [user_alloc_conf()]
    for key, restore in _released.items():
        if key not in _held and restore is not None:
            parts.append(f"{key}:{restore}")
    parts += [f"{key}:{values[-1]}" for key, values in _held.items()]
    return ",".join(part for part in parts if part)


def _drop(key: str, value: str) -> None:
    """One holder's ``value`` of ``key`` is no longer held (under ``_lock``)."""
    values = _held[key]
    values.remove(value)
    if not values:
        del _held[key]


def hold(key: str, value: str, restore: str | None = None):
    """Set ``key`` to ``value`` (as torch spells it) until the returned callable is
    called; then the key gets the value another holder still holds, else ``restore``
    (None: left out of the configuration, so torch resets it to the user's value or its
    default).  Process-wide, as torch's allocator settings are."""
    with _lock:
        _held.setdefault(key, []).append(value)
        previous = _released.get(key, restore)
        _released[key] = restore
        try:
            _setter()(_conf())
        except BaseException:  # nothing held: later calls must not send it again
            _drop(key, value)
            _released[key] = previous
            raise
    done = []

    def release() -> None:
        with _lock:
            if done:
                return
            done.append(True)
            _drop(key, value)
            _setter()(_conf())

    return release


def _fresh_lock_after_fork() -> None:
    """A thread that held the lock at a fork (a capture ending its record-stream reuse)
    is not in the child, so the lock would stay taken there and the child's first hold
    (its whole-process routing, its first capture) would wait for good.  The child has
    one thread; what is held stays held, as torch's settings do in the child."""
    global _lock
    _lock = threading.Lock()


at_fork("backends", after_in_child=_fresh_lock_after_fork)

"""The state every ``TorchMemorySaver`` shares, as torch_memory_saver's instances share
its library's: which vmm_core tags hold each of its tags, the graph pools of its
captures, each thread's region configuration, and the pause or resume that failed midway.

A torch_memory_saver tag ``t`` is held by vmm_core tags ``tms:t`` (no backup),
``tms:t:cpu_backup`` (offloaded to host memory by a pause) and ``tms:t:disk_backup``
(written to disk by a pause): a vmm_core tag is offloaded, discarded or written whole.
The user's tag is escaped (``%`` and ``:`` percent-encoded), so that only the suffix is
ever ``:...`` and no tag names another's memory: ``w:cpu_backup`` without a backup is
``tms:w%3Acpu_backup``, never ``w``'s backup.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass, replace

from ... import forksafe

__all__ = ["PREFIX", "KINDS", "vmm_tag", "tms_name", "claim", "vmm_tags", "names",
           "Config", "config", "push", "pop", "lock", "reset"]

PREFIX = "tms:"
#: backup kind -> the suffix of its vmm_core tags
KINDS = {"none": "", "cpu": ":cpu_backup", "disk": ":disk_backup"}

_lock = threading.RLock()  # taken before vmm_core's own locks, never inside them
#: torch_memory_saver tag -> the vmm_core tags holding its memory
tags: dict[str, set[str]] = {}
#: vmm_core tag -> (torch_memory_saver tag, backup kind)
owners: dict[str, tuple[str, str]] = {}
#: (vmm tag, torch pool handle or a private key, backend name, device) -> GraphPool
graph_pools: dict[tuple, object] = {}
#: pools of captures without ``pool=``: (weak ref of the graph or None, key)
private: list[tuple] = []
private_keys = itertools.count()
#: (tag, enable_cpu_backup, enable_disk_backup, backup backend, device) -> vmm tag, for
#: torch_memory_saver's ``_impl._mem_pools`` keys
region_keys: dict[tuple, str] = {}
#: ("pause" | "resume", tag) of a call that failed midway: calling it again finishes it
unfinished: set[tuple[str, str | None]] = set()


def lock() -> threading.RLock:
    return _lock


def _fresh_lock_after_fork() -> None:
    """A pause or resume holds this lock while it waits for vmm_core's locks, which a fork
    waits for only a bounded time: a child forked then inherited it held by a thread it
    does not have.  The forking thread's own hold stays (it is the child's thread)."""
    global _lock
    if not _lock._is_owned():  # type: ignore[attr-defined]  # CPython's RLock has it
        _lock = threading.RLock()


forksafe.at_fork("integrations", after_in_child=_fresh_lock_after_fork)


def _escape(tag: str) -> str:
    return tag.replace("%", "%25").replace(":", "%3A")


def vmm_tag(tag: str, kind: str) -> str:
    return PREFIX + _escape(tag) + KINDS[kind]


def tms_name(vtag: str) -> str:
    """The torch_memory_saver tag a vmm_core tag of this module holds."""
    owner = owners.get(vtag)
    return owner[0] if owner is not None else vtag


def claim(tag: str, kind: str) -> str:
    vtag = vmm_tag(tag, kind)
    with _lock:
        tags.setdefault(tag, set()).add(vtag)
        owners[vtag] = (tag, kind)
    return vtag


def vmm_tags(tag: str | None = None) -> list[str]:
    """The vmm_core tags (``vmm_core.memory_summary()``) of a torch_memory_saver tag, or
    of every tag made here (None)."""
    with _lock:
        chosen = list(tags) if tag is None else [tag]
        return sorted(t for name in chosen for t in tags.get(name, ()))


def names(vtags) -> list[str]:
    return sorted({tms_name(t) for t in vtags})


# ---------------------------------------------------------------- thread configuration
@dataclass(frozen=True)
class Config:
    """What torch_memory_saver's library keeps per thread (``tms_get_*``)."""

    tag: str = "default"
    interesting: bool = False
    cpu_backup: bool = False
    cpu_backup_backend: str = "pinned"
    disk_backup: bool = False


_threads = threading.local()  # .stack: Config per open block, innermost last
#: the configuration every thread starts with (set by the whole-process mode)
_base = Config()


def set_base(base: Config) -> None:
    global _base
    _base = base


def base_config() -> Config:
    """The configuration every thread starts with (the whole-process region's)."""
    return _base


def _stack() -> list[Config]:
    stack = getattr(_threads, "stack", None)
    if stack is None:
        stack = _threads.stack = []
    return stack


def config() -> Config:
    stack = _stack()
    return stack[-1] if stack else _base


def push(**changes) -> Config:
    new = replace(config(), **changes)
    _stack().append(new)
    return new


def pop() -> None:
    _stack().pop()


def set_current(**changes) -> None:
    """Change the innermost configuration in place (``tms_set_*`` called directly)."""
    stack = _stack()
    if stack:
        stack[-1] = replace(stack[-1], **changes)
    else:
        stack.append(replace(_base, **changes))


def reset() -> None:
    """Forget everything (tests: a new process)."""
    global _base
    with _lock:
        tags.clear()
        owners.clear()
        graph_pools.clear()
        private.clear()
        region_keys.clear()
        unfinished.clear()
    _base = Config()
    _threads.stack = []

"""The process-wide state of tagged memory: which allocators carry which tag, the lock
that guards it, and the capture blocks open on each thread.

The allocator takes this lock first in ``hold_awake`` (one lock order for every entry
point), offload takes it while it pins host memory and reads the tags ``prepare`` names,
and :mod:`vmm_core.memory.tagged` builds regions, sleep and wake on it.  It lives here,
below all three and importing none of them, so that the layers of memory/ point one way:
tagged -> allocator -> offload -> this module.
"""

from __future__ import annotations

import collections
import contextlib
import threading

from ..errors import SleepStateError
from . import reaper
from .mappings import teardown_step

__all__ = ["state_lock", "capture_block", "backend_capture", "refuse_in_capture", "is_tag",
           "check_tag", "tag_list", "register", "unregister", "register_soon",
           "unregister_soon", "registry_frozen", "tags", "allocators", "forget_pool",
           "current_device"]

_lock = threading.RLock()
#: tag -> the allocators under it (closed ones are dropped by the next register or tags())
_registry: dict[str, list] = {}
_pools: dict[int, object] = {}  # id(allocator) -> framework pool of a region
#: (register?, tag, allocator) asked for by :func:`register_soon` and
#: :func:`unregister_soon` while another thread held the lock; the next holder applies
#: them in order before it reads or changes the registry (a deque: appending takes no lock)
_pending: collections.deque = collections.deque()
_frozen = 0  # registry_frozen blocks open (on the thread holding the lock)


def state_lock() -> threading.RLock:
    """The process-wide lock of tagged memory.  Sleep, wake, ``hold_awake`` and every graph
    capture or replay block take it first, so no lock cycle can form among them and no
    sleep starts while a capture or replay block is open."""
    return _lock


def _fresh_lock_in_child() -> None:
    """The fork callbacks (:mod:`vmm_core.memory.fork_locks`, which take this lock first)
    forked without it, another thread holding it: the child's thread does not."""
    global _lock, _frozen
    if not _lock._is_owned():  # type: ignore[attr-defined]  # CPython RLock has it
        _lock = threading.RLock()
        _frozen = 0  # a freeze of a thread the child does not have


# -------------------------------------------------------------------------
# Capture blocks
# -------------------------------------------------------------------------

_capturing = threading.local()  # .blocks: the capture blocks open on this thread


@contextlib.contextmanager
def capture_block(what: str):
    """Mark the calling thread as inside a graph capture block (``GraphPool.space``).

    Such a block holds :func:`state_lock`, which keeps other threads' sleeps, wakes and
    pinning out; the lock is re-entrant, so the same thread is refused by
    :func:`refuse_in_capture` instead."""
    blocks = _capturing.__dict__.setdefault("blocks", [])
    blocks.append(what)
    try:
        yield
    finally:
        blocks.pop()


@contextlib.contextmanager
def backend_capture(what: str):
    """Around a capture a backend makes for its own use, outside every capture space (a
    probe): holds :func:`state_lock` as a capture space does.  A GraphPool's teardown
    (a dropped one's too), a sleep or a wake on another thread synchronizes the device
    under that lock, and a device synchronize while another thread captures fails and
    breaks the capture (torch 2.11, CUDA 13, one H200: in either capture mode).  An
    allocator's own close synchronizes without it."""
    with state_lock(), capture_block(what):
        yield


def refuse_in_capture(call: str, error=SleepStateError) -> None:
    """Raise ``error`` if the calling thread is inside a capture block: ``call`` pins host
    memory or synchronizes the device, which a device capture refuses (or is broken by)."""
    blocks = getattr(_capturing, "blocks", None)
    if blocks:
        raise error(f"{call} inside {blocks[-1]} on the same thread: it page-locks host "
                    f"memory or synchronizes the device, which a device graph capture "
                    f"refuses (or is broken by): leave that with block first, or call it "
                    f"before entering it (from another thread it waits for the block)")


# -------------------------------------------------------------------------
# The tag registry
# -------------------------------------------------------------------------


def is_tag(tag) -> bool:
    """The one rule of what a tag is: a non-empty string."""
    return isinstance(tag, str) and bool(tag)


def check_tag(tag, what: str = "tag", error: type[Exception] = ValueError) -> None:
    """``error`` naming ``what`` (the argument as the caller's user wrote it) unless
    ``tag`` is a tag."""
    if not is_tag(tag):
        raise error(f"{what} must be a non-empty string, got {tag!r}")


def tag_list(tags, what: str, error: type[Exception] = ValueError,
             hint: str = "") -> tuple[str, ...]:
    """What every argument that takes "a tag or a list of tags" means: None is no tag,
    a string one tag, any other iterable its tags; each once, in the order given.

    Anything else, or an item that is not a tag (:func:`is_tag`), raises ``error``
    naming ``what`` and what was given, then ``hint`` (what None means there, say)."""
    if tags is None:
        return ()
    items: list | None = [tags]
    if not isinstance(tags, str):
        try:
            items = list(tags)
        except TypeError:  # an int, a bool: "'int' object is not iterable" says nothing
            items = None
    tail = f"; {hint}" if hint else ""
    if items is None:
        raise error(f"{what} must be a tag name or a list of tag names (non-empty "
                    f"strings), got {tags!r}{tail}")
    for item in items:
        if not is_tag(item):
            raise error(f"{what} must be a tag name or a list of tag names (non-empty "
                        f"strings), got {item!r} in {items!r}{tail}")
    return tuple(dict.fromkeys(items))


def register(tag: str, allocator) -> None:
    """Put ``allocator`` under ``tag`` (executors, regions and distributed parts call this).

    Closed allocators of the tag are dropped here: a job that closes and reopens a tag
    every step (an RL loop) would otherwise keep every closed allocator (about 1.5 KB
    each) for the life of the process."""
    check_tag(tag)
    with _lock:
        _settle()
        _register(tag, allocator)


def unregister(tag: str, allocator) -> None:
    # reaper.acquire: a dropped mapped memory's untag on the reaper must not hold up exit
    with reaper.acquire(_lock):
        _settle()
        _unregister(tag, allocator)


def register_soon(tag: str, allocator) -> None:
    """:func:`register` now, or, while another thread holds the lock, as soon as a thread
    next takes it (before it reads or changes the registry, so no reader misses it).

    For code that runs inside the framework's allocator (whole-process memory makes each
    segment there), which holds the framework's own lock meanwhile: waiting for this lock
    there deadlocks against a thread that holds it and needs the framework's allocator (a
    capture that allocates, a teardown that empties the framework's cache)."""
    _soon(True, tag, allocator)


def unregister_soon(tag: str, allocator) -> None:
    """:func:`unregister`, as :func:`register_soon` does it."""
    _soon(False, tag, allocator)


def _soon(add: bool, tag: str, allocator) -> None:
    check_tag(tag)
    if not _lock.acquire(blocking=False):
        _pending.append((add, tag, allocator))
        return
    try:
        (register if add else unregister)(tag, allocator)
    finally:
        _lock.release()


@contextlib.contextmanager
def registry_frozen():
    """Hold the lock, and keep the registry as it is for the block: what another thread
    queues meanwhile (:func:`register_soon`) is applied after it.  For a sleep or a group
    call that reads the tags' allocators, acts on them and may undo what it did: a segment
    made meanwhile stays out of it, as when its registration waited for the lock."""
    global _frozen
    with _lock:
        _settle()
        _frozen += 1
        try:
            yield
        finally:
            _frozen -= 1


def _settle() -> None:
    """Under the lock: apply what :func:`_soon` queued, in the order it was asked for
    (not inside :func:`registry_frozen`)."""
    if _frozen:
        return
    while _pending:
        add, tag, allocator = _pending.popleft()
        (_register if add else _unregister)(tag, allocator)


def settled_registry() -> dict:
    """The registry (tag -> allocators) with every queued change applied; call it holding
    the lock, as every reader of the registry does (:mod:`.tagged`)."""
    _settle()
    return _registry


def settle_if_free() -> None:
    """Apply the queued changes if the lock can be had without waiting (for the
    lock-free readers of the registry, which take a snapshot)."""
    if _lock.acquire(blocking=False):
        try:
            _settle()
        finally:
            _lock.release()


def _register(tag: str, allocator) -> None:
    allocs = [a for a in _registry.get(tag, ()) if not a.closed]
    if not any(a is allocator for a in allocs):
        allocs.append(allocator)
    _registry[tag] = allocs


def _unregister(tag: str, allocator) -> None:
    allocs = [a for a in _registry.get(tag, []) if a is not allocator]
    if allocs:
        _registry[tag] = allocs
    else:
        _registry.pop(tag, None)


def tags() -> list[str]:
    """Tags that currently have memory (closed allocators are forgotten on the way)."""
    with _lock:
        _settle()
        for tag, allocs in list(_registry.items()):
            open_ = [a for a in allocs if not a.closed]
            if len(open_) != len(allocs):
                if open_:
                    _registry[tag] = open_
                else:
                    del _registry[tag]
        return sorted(_registry)


def allocators(tag: str) -> list:
    """The open SharedVMMAllocators holding ``tag``'s memory (one per backend and device).

    Public (``vmm_core.allocators``): each one's ``last_transfer`` says how the last
    sleep or wake moved its bytes (strategy, seconds), and ``close()`` gives a tag's
    memory back for good, which ``memory_summary`` and ``sleep`` do not."""
    with _lock:
        _settle()
        return [a for a in _registry.get(tag, []) if not a.closed]


#: called with each allocator as it closes, under its lock (what keeps files or records
#: of an allocator's memory elsewhere, e.g. sleep to disk, lets them go then)
on_close: list = []


def closing(alloc) -> None:
    """``alloc`` is closing: its framework pool goes, and every ``on_close`` is told, each
    whatever the others raised (the first error is raised once all have run)."""
    errors: list[BaseException] = []
    for step in (forget_pool, *on_close):
        teardown_step(errors, step, alloc, tolerated=())
    if errors:
        raise errors[0]


def forget_pool(alloc) -> None:
    """Drop the framework pool of a region's allocator that is closing.

    Without this the pool would outlive its allocator: the framework would keep its cached
    segments (so the closed range could never go back), and a later allocator given the
    same ``id()`` would be handed the old pool and its segments in unmapped memory.
    Tensors still alive keep their segments until they go; the range waits for them
    (:mod:`vmm_core.memory.address_quarantine`).  Takes no lock (one dict pop): it runs
    under the allocator's lock, which comes after this module's in the lock order.  The
    adapter lets go of the pool (``release_pool``); its cached segments go when the
    framework's cache is next emptied, which the closing allocator asks for
    (``AllocatorAdapter.flush``) where its range is still held."""
    pool = _pools.pop(id(alloc), None)
    if pool is not None:
        release_pool(alloc, pool)


def release_pool(alloc, pool) -> None:
    """Let go of ``alloc``'s framework pool through its adapter."""
    adapter = alloc.backend.allocator_adapter(alloc.device)
    if adapter is not None:
        adapter.release_pool(pool)


def current_device(backend) -> int:
    """The framework's current device for this backend (PyTorch's ``device=None``)."""
    ops = backend.graph_ops(0)
    if ops is None or ops.device_type == "cpu":
        return 0
    import torch

    module = getattr(torch, ops.device_type, None)  # torch.cuda, torch.npu, torch.mlu
    return module.current_device() if module is not None else 0

"""torch's allocator routing, where vmm_core needs two things torch does not offer.

torch's caching allocator keeps a list of routings (``captures_underway``): a capture's
(its stream's), ``use_mem_pool``'s (the current thread's), and the process-wide one that
the private ``torch._C._cuda_beginAllocateToPool(device, pool)`` begins (every thread and
stream); a new one is appended.  An allocation goes to the pool of one routing that
claims it (``get_pool`` in ``c10/cuda/CUDACachingAllocator.cpp``): the newest in the
torch releases that search the list from its end (torch 2.11 does: a ``use_mem_pool``
begun inside the process-wide routing got its thread's allocations, one H200,
2026-11-28), the oldest in those that search from its start.

1. **A process-wide routing behind every other** (:func:`route_process`, whole-process
   tagged memory).  Regions, ``outside_regions()`` and graph captures begun later must
   keep their threads' and streams' allocations.  Where the newest routing wins, the
   process-wide one, begun first, is behind them already.  Where the oldest wins, it is
   ended and begun again after each later routing begins on its device, so that it is
   the newest; between the two calls (microseconds, under torch's allocator lock each)
   an allocation by another thread goes to torch's default pool: ordinary memory that a
   sleep does not touch, never memory of the wrong tag.  Which order this torch uses is
   found once, when the first device is routed (:func:`_newest_wins`: one allocation
   under a thread routing begun after the process-wide one).
   Devices become routed when the process makes them current (``torch.cuda.set_device``,
   ``with torch.cuda.device(d)``), never by this module: making a device current creates
   its CUDA context, which a process that sees eight GPUs and uses one must not pay for.
   An allocation on a device the process never made current stays outside.
   While any routing is active, torch skips what it does only with none: releasing the
   cached blocks of pools in use on ``torch.cuda.empty_cache()`` (it still releases
   those of pools let go of, torch 2.11) and all of them before it reports out of
   memory, and reusing blocks freed with uses recorded on other streams
   (``record_stream``).  Before an out-of-memory error it still gives back cached blocks
   of at least ``max_split_size_mb``, which the routing sets for as long as it lasts
   (:data:`ROUTED_SPLIT_MB`); a sleep of the tag releases the device memory of the rest
   (docs/integrations.md says what this means for a process).
2. **A caller's pool handle naming vmm_core's pool during a capture**
   (:func:`alias_pool`).  SGLang captures with ``pool=P`` from its own
   ``graph_pool_handle()`` and, with symmetric memory, stops and restarts allocation to
   ``P`` in the middle of the capture (``_cuda_endAllocateToPool(device, P)`` /
   ``_cuda_beginAllocateCurrentThreadToPool(device, P)``).  When the capture runs in
   vmm_core's pool, those calls reach it instead of a pool nobody records to.

No pool of vmm_core's is ever destroyed (:func:`let_go`).  A ``torch.cuda.MemPool``'s
destructor empties the pool's cache, and torch (2.11) asserts there that no routing or
capture is underway on the device, on any thread (``captures_underway.empty()`` in
``synchronize_and_free_events``); an assert in a destructor aborts the process.  A
routing may be active for the life of the process (whole-process mode), a capture may
run on another thread whenever a dropped pool is torn down (the teardown thread of
:mod:`vmm_core.memory.reaper`), and nothing in torch tells either apart from outside.
A pool let go of is therefore kept, and its own use is handed back to torch instead
(``_cuda_releasePool``): torch then frees its segments on the next
``torch.cuda.empty_cache()``, which asserts nothing whatever is underway.

Both work by replacing torch's routing calls (``torch._C._cuda_beginAllocate*ToPool``,
``_cuda_endAllocateToPool``, ``_cuda_releasePool``, the names ``torch.cuda.memory``
imported them under, ``CUDAGraph.capture_begin``, ``torch._C._cuda_setDevice`` and
``torch.cuda._exchange_device``) with wrappers that call torch's own first; they are
installed the first time either is asked for, and only then.  Nothing else in vmm_core
touches torch's routing list.
"""

from __future__ import annotations

import contextlib
import logging
import threading

from vmm_core.plugin import at_fork, keep_for_process_life

from .alloc_settings import hold, user_sets

__all__ = ["route_process", "alias_pool", "process_pool_ids", "keep", "let_go"]

logger = logging.getLogger("vmm_core")

_lock = threading.RLock()
_installed = False
_original: dict[str, object] = {}
#: device -> the process-wide pool (a torch.cuda.MemPool) routed there
_process_pools: dict[int, object] = {}
#: (path, alloc symbol, free symbol) of the process-wide allocator, once routed
_process_entry: tuple[str, str, str] | None = None
_process_allocator = None  # the CUDAPluggableAllocator, kept for the life of the process
#: the caller's pool id -> vmm_core's pool id, while a capture block translates it
_aliases: dict[tuple, tuple] = {}
#: guards the mark of a pool let go of; a leaf (no lock is taken under it): let_go runs
#: under allocator, group and tagged-memory locks, which routing a device may wait for
#: while holding this module's ``_lock``.  Re-entrant: let_go also runs from finalizers,
#: which the collector may start on a thread inside it
_let_go_lock = threading.RLock()


def _fresh_let_go_lock_in_child() -> None:
    """A thread that held it at a fork is not in the child: a fresh one there."""
    global _let_go_lock
    _let_go_lock = threading.RLock()


at_fork("backends", after_in_child=_fresh_let_go_lock_in_child)


#: id(pool) -> every MemPool the backend made (:func:`keep`), never dropped, not even by
#: interpreter shutdown; a dict append, where a reference taken through ctypes costs
#: about 15 us a pool on the capture path
_kept: dict = keep_for_process_life({})


def keep(pool):
    """Keep ``pool`` (a ``torch.cuda.MemPool``) for the life of the process; return it."""
    _kept[id(pool)] = pool
    return pool


#: whether this torch gives an allocation to the newest routing that claims it (None:
#: not found yet; found when the first device is routed)
_newest_first: bool | None = None
#: ``max_split_size_mb`` while the process is routed, unless the user's configuration
#: sets one.  With a routing active, an allocation that finds no room gives back only
#: cached blocks of at least that size before failing (``release_available_cached_blocks``;
#: ``release_cached_blocks`` waits for no routing to be active), and torch's default (no
#: limit) makes that none: a loop that frees two large tensors and asks for one of both
#: sizes would fail where unrouted torch succeeds.  Blocks this large are then never
#: split for smaller requests, torch's documented effect of the option.  Set only where
#: the routing begins before torch reserved anything (:func:`_nothing_reserved`).
ROUTED_SPLIT_MB = 512
_split_release = None  # gives the split size back when the routing ends

_ROUTING_CALLS = ("_cuda_beginAllocateCurrentThreadToPool", "_cuda_beginAllocateToPool",
                  "_cuda_beginAllocateCurrentStreamToPool", "_cuda_endAllocateToPool",
                  "_cuda_releasePool")


def _id(pool_id) -> tuple:
    return tuple(int(v) for v in pool_id)


def _translate(pool_id):
    if not _aliases:
        return pool_id
    try:
        return _aliases.get(_id(pool_id), pool_id)
    except (TypeError, ValueError):
        return pool_id


def _keep_last(device: int, begun) -> None:
    """Put the process-wide routing of ``device`` behind the one just begun, where
    torch gives an allocation to the oldest routing that claims it."""
    pool = _process_pools.get(device)
    if pool is None or _newest_first:
        return
    if begun is not None and _id(begun) == _id(pool.id):
        return
    _original["_cuda_endAllocateToPool"](device, pool.id)
    _original["_cuda_releasePool"](device, pool.id)
    _original["_cuda_beginAllocateToPool"](device, pool.id)


def _wrap_begin(name: str):
    def begin(device, pool_id, *args, **kwargs):
        pool_id = _translate(pool_id)
        result = _original[name](device, pool_id, *args, **kwargs)
        if _process_pools:
            with _lock:
                _keep_last(int(device), pool_id)
        return result

    begin.__name__ = name
    begin.__wrapped__ = _original[name]  # type: ignore[attr-defined]
    return begin


def _wrap_translating(name: str):
    def call(device, pool_id, *args, **kwargs):
        return _original[name](device, _translate(pool_id), *args, **kwargs)

    call.__name__ = name
    call.__wrapped__ = _original[name]  # type: ignore[attr-defined]
    return call


def _wrap_capture_begin(original):
    def capture_begin(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        if _process_pools:
            import torch

            with _lock:
                _keep_last(torch.cuda.current_device(), None)
        return result

    capture_begin.__wrapped__ = original  # type: ignore[attr-defined]
    return capture_begin


def _wrap_device_change(original):
    def change(device, *args, **kwargs):
        result = original(device, *args, **kwargs)
        if _process_entry is not None:
            try:
                index = int(device)
            except (TypeError, ValueError):
                index = -1
            if index >= 0 and index not in _process_pools:
                _route_device_quietly(index)
        return result

    change.__wrapped__ = original  # type: ignore[attr-defined]
    return change


def _install() -> None:
    """Replace torch's routing calls with the wrappers (once per process)."""
    global _installed
    if _installed:
        return
    import torch
    import torch.cuda.graphs as graphs
    import torch.cuda.memory as memory

    for name in _ROUTING_CALLS:
        original = getattr(torch._C, name, None)
        if original is None:
            continue
        _original[name] = original
        wrapper = _wrap_begin(name) if "begin" in name else _wrap_translating(name)
        setattr(torch._C, name, wrapper)
        if hasattr(memory, name):
            setattr(memory, name, wrapper)
    graphs.CUDAGraph.capture_begin = _wrap_capture_begin(graphs.CUDAGraph.capture_begin)
    _original["_cuda_setDevice"] = torch._C._cuda_setDevice
    torch._C._cuda_setDevice = _wrap_device_change(torch._C._cuda_setDevice)
    torch.cuda._exchange_device = _wrap_device_change(torch.cuda._exchange_device)
    _installed = True


# ---------------------------------------------------------------- 1: the whole process
class _Route:
    """What ``AllocatorAdapter.route_process`` returns: ``close()`` ends the routing on
    every device."""

    def close(self) -> None:
        global _process_entry, _split_release
        with _lock:
            for device, pool in list(_process_pools.items()):
                _original["_cuda_endAllocateToPool"](device, pool.id)
                _original["_cuda_releasePool"](device, pool.id)
            _process_pools.clear()
            _process_entry = None
            if _split_release is not None:
                _split_release()
                _split_release = None


def let_go(device: int, pool) -> None:
    """Let go of ``pool`` (a ``torch.cuda.MemPool`` on ``device``) without destroying it:
    kept for the life of the process (a few hundred bytes), its own use handed back to
    torch once, so that torch frees its segments on the next empty cache as it does for
    a destroyed pool's (see the module docstring).  Safe on any thread, whatever is
    routed or captured meanwhile; graphs captured into the pool keep it until they go.
    A release torch refuses raises, and the pool may be let go of again."""
    import torch

    keep(pool)
    with _let_go_lock:
        if getattr(pool, "_vmm_let_go", False):
            return  # a second release would take a use the pool no longer has
        pool._vmm_let_go = True
    release = _original.get("_cuda_releasePool", torch._C._cuda_releasePool)
    try:
        release(device, pool.id)
    except BaseException:
        pool._vmm_let_go = False
        raise


def route_process(device: int, path: str, alloc_symbol: str, free_symbol: str) -> _Route:
    """Route ``device`` now, and every device the process makes current from now on, to
    the pluggable allocator ``(path, alloc_symbol, free_symbol)``, behind every other
    routing."""
    global _process_entry, _split_release
    with _lock:
        entry = (path, alloc_symbol, free_symbol)
        if _process_entry is not None and _process_entry != entry:
            from vmm_core.errors import VMMError

            raise VMMError(f"this process routes its allocations to {_process_entry[0]} "
                           f"already; one process-wide routing at a time")
        if _split_release is None and user_sets("max_split_size_mb") is None \
                and _nothing_reserved():  # first: a refused setting routes nothing
            _split_release = hold("max_split_size_mb", str(ROUTED_SPLIT_MB))
        _install()
        _process_entry = entry
        _route_device(device)
    return _Route()


def _nothing_reserved() -> bool:
    """Whether torch's allocator holds no segment on any device yet.  torch frees cached
    blocks of at least ``max_split_size_mb`` as if they were whole segments, so the size
    may only be set before any block was split under the default (no limit); routed at
    device start (``TMS_INIT_ENABLE``) nothing is reserved yet."""
    import torch

    try:
        return all(torch.cuda.memory_reserved(d) == 0 for d in range(torch.cuda.device_count()))
    except Exception:  # noqa: BLE001 - unknown: leave torch's setting alone
        return False


def _route_device(device: int) -> None:
    global _process_allocator, _newest_first
    import torch
    from torch.cuda.memory import CUDAPluggableAllocator

    assert _process_entry is not None
    if device in _process_pools:
        return
    if _process_allocator is None:
        _process_allocator = keep_for_process_life(CUDAPluggableAllocator(*_process_entry))
    # a MemPool belongs to the device current when it is made; the wrappers call this
    # after the process made ``device`` current, route_process for the current device
    set_device = _original["_cuda_setDevice"]
    previous = torch.cuda.current_device()
    if previous != device:
        set_device(device)
    try:
        pool = keep_for_process_life(torch.cuda.MemPool(_process_allocator.allocator()))
        _original["_cuda_beginAllocateToPool"](device, pool.id)
        _process_pools[device] = pool
        if _newest_first is None:
            _newest_first = _newest_wins(device, pool)
    finally:
        if previous != device:
            set_device(previous)


def _newest_wins(device: int, process_pool) -> bool:
    """Whether an allocation under a thread routing begun after the process-wide one
    lands in the thread's pool (torch searches its routings newest first) rather than
    in ``process_pool``.  One small allocation in a throwaway pool of torch's own
    allocator, let go of after (its segment goes back with the next empty cache)."""
    import torch

    probe = keep(torch.cuda.MemPool())  # on ``device``, current here
    try:
        return _lands_in(probe, device, process_pool)
    finally:
        let_go(device, probe)  # its block goes back with the next empty cache


def _lands_in(probe, device: int, process_pool) -> bool:
    import torch

    from .pool_snapshot import pool_segments

    _original["_cuda_beginAllocateCurrentThreadToPool"](device, probe.id)
    try:
        block = torch.empty(1, dtype=torch.uint8, device=f"cuda:{device}")
    except Exception as exc:  # noqa: BLE001 - the order torch 2.11 has is assumed
        logger.warning("whole-process memory: the probe of torch's routing order failed "
                       "(%s); routings begun later are assumed to win", exc)
        return True
    finally:
        _original["_cuda_endAllocateToPool"](device, probe.id)
        _original["_cuda_releasePool"](device, probe.id)
    address = block.data_ptr()

    def holds(pool) -> bool:
        return any(int(s["address"]) <= address < int(s["address"]) + int(s["total_size"])
                   for s in pool_segments(pool, device))

    newest = holds(probe)
    if not newest and not holds(process_pool):
        logger.warning("whole-process memory: a probe allocation landed in neither pool; "
                       "routings begun later are assumed to win")
        newest = True
    del block
    return newest


def _route_device_quietly(device: int) -> None:
    """From a device change: never fail the caller's set_device over it."""
    try:
        with _lock:
            _route_device(device)
    except Exception as exc:  # noqa: BLE001 - the device stays outside, and is said to
        logger.warning("whole-process memory: device %d could not be routed (%s); its "
                       "allocations stay outside tagged memory", device, exc)


def process_pool_ids() -> dict[int, tuple]:
    """device -> id of the process-wide pool routed there (tests, reports)."""
    return {d: _id(p.id) for d, p in _process_pools.items()}


# ---------------------------------------------------------------- 2: a caller's pool
@contextlib.contextmanager
def alias_pool(handle, pool_handle):
    """For the block, torch's routing calls that name ``handle`` name ``pool_handle``."""
    if handle is None:
        yield
        return
    try:
        key, target = _id(handle), _id(pool_handle)
    except (TypeError, ValueError):
        yield  # not a pool id torch's routing calls could take: nothing to translate
        return
    with _lock:
        _install()
        if key in _aliases and _aliases[key] != target:
            from vmm_core.errors import CaptureError

            raise CaptureError(f"pool {handle!r} names another vmm_core pool in a capture "
                               f"still open on another thread; capture with it on one "
                               f"thread at a time")
        _aliases[key] = target
    try:
        yield
    finally:
        with _lock:
            _aliases.pop(key, None)

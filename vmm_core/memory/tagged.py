"""Tagged memory: put framework allocations under a tag, then sleep and wake by tag.

``region(tag)`` routes the calling thread's framework allocations into a pool served by
a SharedVMMAllocator registered under ``tag``; GraphExecutors register their graph
allocator under their own tag ("graph" by default).  ``sleep`` releases the physical
pages of tagged allocators (copying them to host first for tags in ``offload``) and
``wake_up`` re-creates them at the same virtual addresses, so tensors and captured
graphs that point there stay valid.
"""

from __future__ import annotations

import contextlib
import logging
import warnings

from .. import registry
from ..errors import (
    AllocationError,
    SleepStateError,
    VMMError,
    VMMFallbackWarning,
    outside_stacklevel,
)
from . import live_ranges as _live
from . import routing
from . import tag_state as _state
from .allocator import SharedVMMAllocator, check_size
from .offload.pinning import deferred_pinning
from .sleep_wake import check_wake_options
from .tag_state import (  # noqa: F401  (part of this module's names: callers use them here)
    _pools,
    _registry,
    allocators,
    capture_block,
    current_device,
    forget_pool,
    refuse_in_capture,
    register,
    registry_frozen,
    state_lock,
    tags,
    unregister,
)

__all__ = ["forget_pool", "region", "sleep", "wake_up", "tags", "allocators", "register",
           "unregister", "region_tags", "current_device", "memory_summary", "tags_on", "hold_awake",
           "state_lock", "capture_block", "refuse_in_capture", "outside_regions",
           "keep_thread_device"]

logger = logging.getLogger("vmm_core")

_region_allocators: dict[tuple, SharedVMMAllocator] = {}
_warned_unrouted: set[tuple[str, str]] = set()  # (tag, backend) told once: tensors not routed


def _resolve(tags_arg) -> list[str]:
    """``tags=`` of a sleep or wake: the tags named (None: every tag with memory)."""
    if tags_arg is None:
        return tags()
    named = list(_state.tag_list(tags_arg, "tags", VMMError, "None means every tag"))
    # one rule: a tag named must have open memory now (never tagged and closed alike)
    known = tags()
    unknown = [t for t in named if t not in known]
    if unknown:
        raise VMMError(f"no memory is tagged {unknown} (never tagged, or its memory was "
                       f"closed); tags with memory now: {known}. Name only those "
                       f"(vmm_core.memory_summary() lists them), or pass no tags for all")
    return named


@contextlib.contextmanager
def region(tag: str = "weights", backend=None, device: int | None = None,
           reserve_bytes: int | None = None, prepare_offload: bool = False):
    """Framework allocations made inside come from VMM memory under ``tag``.

    Yields the tag's SharedVMMAllocator (on the host backend, where the framework's CPU
    allocator cannot be redirected, allocate from it directly).  Entering a region of a
    sleeping tag raises SleepStateError: its memory is not mapped.

    An offloading sleep of the tag copies only the live blocks of the region's framework
    pool (plus what was allocated from the allocator directly), not the free blocks the
    framework caches between them.  ``prepare_offload=True`` announces that the tag will
    be offloaded when it sleeps (``sleep(..., offload=[tag])``; it does not make a sleep
    offload by itself): when the block ends without an error, the pinned host copy that
    sleep fills is made in the background, sized to the live bytes, so that even the
    first sleep copies at the pinned rate (what ``vmm_core.offload.prepare(tag)``
    does, off the calling thread).
    """

    _state.check_tag(tag)  # before anything is made: a bad tag must leave nothing behind
    if not isinstance(prepare_offload, bool):
        raise ValueError(f"region({tag!r}): prepare_offload must be True or False, got "
                         f"{prepare_offload!r}")
    be, device = _backend_and_device(backend, device)
    with _state.state_lock():
        key = (tag, be.name, device)
        alloc = _region_allocators.get(key)
        if alloc is None or alloc.closed:
            alloc = SharedVMMAllocator(be, device=device, reserve_bytes=reserve_bytes, tag=tag)
            _region_allocators[key] = alloc
            register(tag, alloc)
        elif reserve_bytes is not None:  # never ignored silently, nor left unchecked
            wanted = check_size("region reserve_bytes", reserve_bytes, "reserve less")
            if -(-wanted // alloc.granularity) * alloc.granularity != alloc.reserve_bytes:
                raise AllocationError(
                    f"region({tag!r}, reserve_bytes={wanted}): memory tagged {tag!r} on "
                    f"{be.name}:{device} already exists with reserve_bytes="
                    f"{alloc.reserve_bytes}, fixed when its first region was entered; pass "
                    f"reserve_bytes to that first region({tag!r}, ...), or leave it out here")
        adapter = be.allocator_adapter(device)
        pool = _pools.get(id(alloc))
        if pool is None and adapter is not None and adapter.supports_pools:
            with routing.target(device, alloc):
                pool = _pools[id(alloc)] = adapter.new_pool()
        if alloc.live_ranges is None:
            alloc.live_ranges = _live.pool_live_ranges(
                alloc, adapter, lambda key=id(alloc): _pools.get(key))
    if alloc.asleep:
        raise SleepStateError(f"memory tagged {tag!r} is asleep; call "
                              f"vmm_core.wake_up({tag!r}) before allocating in its region")
    unrouted = not routing.framework_routed(be, device)
    before = (len(alloc.live_allocations()), alloc.physical_bytes) if unrouted else None
    with routing.target(device, alloc):
        ctx = adapter.use_pool(pool) if pool is not None else contextlib.nullcontext()
        with ctx:
            yield alloc
    if prepare_offload:
        _announce_offload(tag, alloc)
    if (before is not None and (tag, be.name) not in _warned_unrouted and not alloc.closed
            and before == (len(alloc.live_allocations()), alloc.physical_bytes)):
        _warned_unrouted.add((tag, be.name))
        warnings.warn(f"region({tag!r}) on the {be.name!r} backend: nothing was allocated "
                      f"in it. Framework tensors made inside (torch.randn, torch.empty, ...) "
                      f"are NOT placed in tagged memory on this backend, since its CPU "
                      f"allocator cannot be redirected; allocate from the allocator the "
                      f"region yields (alloc.allocate(nbytes), see "
                      f"examples/host_graph_pool.py)", VMMFallbackWarning,
                      stacklevel=outside_stacklevel())


def _backend_and_device(backend, device: int | None):
    """The backend (:func:`vmm_core.registry.resolve`) and the device (None: the
    framework's current one)."""
    be = registry.resolve(backend)
    return be, current_device(be) if device is None else device


def _announce_offload(tag: str, alloc) -> None:
    """Start making ``alloc``'s host copy in the background (``prepare_offload``).  Only
    an optimization: a failure is logged, and the first sleep then makes its own copy."""
    try:
        alloc.prepare_host_copy(background=True)
    except Exception as exc:  # noqa: BLE001 - never fails the region that ended fine
        logger.warning("region(%r, prepare_offload=True): the host copy could not be "
                       "prepared (%s); its first sleep makes its own", tag, exc)


@contextlib.contextmanager
def outside_regions(backend=None, device: int | None = None):
    """Framework allocations made inside go to the framework's own allocator, even
    inside a region or capture space of this thread: ordinary memory, never put to sleep
    (``torch_memory_saver``'s ``disable()``).  What was freed inside goes back to the
    device when the block ends, where the framework's adapter can give it back (CUDA:
    ``torch.cuda.empty_cache()`` at the end of the block, outside a capture); what is
    still alive keeps its memory until freed."""
    be, device = _backend_and_device(backend, device)
    adapter = be.allocator_adapter(device)
    with routing.target(device, None):  # nothing of vmm_core serves the shim here
        with (adapter.use_framework_allocator() if adapter is not None
              else contextlib.nullcontext()):
            yield


def region_tags(backend, device: int) -> set[str]:
    """Tags of the regions on ``backend``'s ``device`` that have memory now.

    Graphs captured while these exist may read them (weights, KV cache), so graph pools
    refuse to replay while one sleeps unless told exactly what their graphs read."""
    with _state.state_lock():
        return {tag for (tag, name, dev), alloc in _region_allocators.items()
                if name == backend.name and dev == device and not alloc.closed}



def sleep(tags=None, offload=()) -> None:
    """Release the physical memory of ``tags`` (default: all); keep virtual addresses.

    Every tag named must have memory now: a tag never used and a tag whose memory was
    closed are both refused (``memory_summary()`` lists the tags there are), so a typo is
    never a silent no-op.  An empty list names nothing and does nothing.

    Tags listed in ``offload`` are copied to host memory first (how:
    :mod:`vmm_core.memory.offload`) and restored by :func:`wake_up`; the others are
    discarded.  A copy that fails leaves that tag awake and intact.  Device work that
    may still read the memory is synchronized before unmapping.  Sleeping a sleeping tag
    is a no-op.  ``vmm_core.sleep(group=...)`` runs this on every rank of a group, or on
    none (:mod:`vmm_core.distributed.collective`).
    """
    _sleep(tags, offload, whole=True)


def sleep_step(tags, offload=()) -> None:
    """One step of a group sleep (:mod:`vmm_core.distributed.collective`): the group
    checked that all of its tags name every tag of each allocator (:func:`check_whole`)
    before its first step, which may put some of them to sleep before the others."""
    _sleep(tags, offload, whole=False)


def check_whole(chosen) -> None:
    """Refuse a sleep of ``chosen`` that names some tags of an awake allocator but not
    all: two GraphPools given one allocator share its physical pages, so sleeping one tag
    discarded what the other kept (its outputs), silently."""
    named = set(chosen)
    with _state.state_lock():
        registry = _state.settled_registry()
        for tag in chosen:
            for alloc in allocators(tag):
                if alloc.asleep:
                    continue  # asleep already: the sleep is a no-op, nothing is lost
                left_out = sorted(t for t, allocs in registry.items() if t not in named
                                  and any(a is alloc for a in allocs))
                if left_out:
                    raise SleepStateError(
                        f"vmm_core.sleep: memory tagged {tag!r} shares its allocator (its "
                        f"physical pages) with memory tagged {left_out}, which was not "
                        f"named: sleeping it would put that to sleep too (discarded, "
                        f"unless offloaded), under graphs or code that expect it awake. "
                        f"Name them together: "
                        f"vmm_core.sleep({sorted(named | set(left_out))}, offload=...)")


def offload_tags(offload) -> tuple[str, ...]:
    """``offload=`` of a sleep: the tags whose bytes are copied to host memory."""
    return _state.tag_list(offload, "vmm_core.sleep: offload", VMMError,
                           "to offload every tag pass the same list as tags= (or "
                           "offload=vmm_core.memory_summary().keys())")


def _unless_closed(alloc, call, *args, **kwargs) -> None:
    """``call(*args, **kwargs)``; an allocator that another thread closed under this call
    (closing takes none of this module's locks) is no longer one of the tags: it is
    skipped, never a reason to leave the others half done."""
    try:
        call(*args, **kwargs)
    except VMMError:
        if not alloc.closed:
            raise


def _sleep(tags, offload, whole: bool) -> None:
    refuse_in_capture("vmm_core.sleep")
    offload = set(offload_tags(offload))
    with registry_frozen():  # what it checks is what it sleeps
        chosen = _resolve(tags)
        if whole:
            check_whole(chosen)
        unknown = offload - set(chosen)
        if unknown:
            raise VMMError(f"offload names {sorted(unknown)}, which are not being put to "
                           f"sleep ({chosen})")
        # one allocator may carry several tags (two graph families on one allocator):
        # it sleeps once, and is offloaded if any of its tags asks for it, whatever the
        # order the tags come in (a "full" named first must not discard what "pieces"
        # offloads)
        plan: dict[int, list] = {}  # id -> [allocator, offload?, its tags]
        for tag in chosen:
            for alloc in allocators(tag):
                entry = plan.setdefault(id(alloc), [alloc, False, []])
                entry[1] = entry[1] or tag in offload
                entry[2].append(tag)
        for key, (alloc, _, its_tags) in list(plan.items()):  # refused before any sleeps
            try:
                alloc.check_can_sleep()
            except VMMError as exc:
                if alloc.closed:
                    del plan[key]
                    continue
                raise type(exc)(f"vmm_core.sleep: memory tagged {its_tags[0]!r}: {exc}") \
                    from None
        # kept copies are registered once every allocator here slept, not beside the
        # next one's copy and unmapping (started under the lock: see GraphPool.space)
        with _transfer_report("sleep", chosen), deferred_pinning(), \
                keep_thread_device(alloc for alloc, _, _ in plan.values()):
            for alloc, wants_offload, _ in plan.values():
                _unless_closed(alloc, alloc.sleep, offload=wants_offload)


def wake_up(tags=None, keep_host_buffers: bool | None = None, zero: bool = False,
            eager: bool = False) -> None:
    """Re-create the physical memory of ``tags`` (default: all) at the same addresses.

    Offloaded bytes are copied back.  Discarded memory holds undefined bytes after wake
    (fresh device pages may hold anything) unless ``zero=True``, which fills it with
    zeros.  On OutOfMemoryError (or a failed copy) the allocators already woken stay
    awake and the rest stay asleep with their host copies (none is half-mapped): free
    memory and call again.  Waking an awake tag is a no-op.  Host copies are kept
    (pinned) for the next sleep unless ``keep_host_buffers=False`` or the tag's policy
    says otherwise (:func:`vmm_core.offload.set_keep_host_buffers`).
    With ``eager=True`` graph pools make the executables resident at the sleep again
    before this returns, instead of on each graph's first replay (a pool of
    ``ExecutablePolicy(eager_wake=True)`` does at every wake).
    ``vmm_core.wake_up(group=...)`` runs this on every rank of a group, or on none
    (:mod:`vmm_core.distributed.collective`).
    """
    refuse_in_capture("vmm_core.wake_up")
    check_wake_options(keep_host_buffers, eager)  # also when no tag has memory to wake
    with _state.state_lock():
        chosen = _resolve(tags)
        # resolved once: one allocator under several tags wakes once
        allocs = {id(a): a for tag in chosen for a in allocators(tag)}.values()
        with _transfer_report("wake_up", chosen), deferred_pinning(), \
                keep_thread_device(allocs):
            for alloc in allocs:
                _unless_closed(alloc, alloc.wake, keep_host_buffers=keep_host_buffers,
                               zero=zero, eager=eager)


# -------------------------------------------------------------------------
# Reports and replay guards
# -------------------------------------------------------------------------


def memory_summary() -> dict:
    """Where tagged memory is, per tag: ``{tag: {...}}``.

    Each entry has ``device_bytes`` (physical memory held now), ``host_bytes`` (host
    memory held: offloaded bytes, or buffers kept by ``keep_host_buffers``),
    ``pinned_host_bytes`` (of those, registered with the backend), ``spaces``,
    ``handles``, ``asleep`` (every allocator of the tag sleeps), ``backend`` and
    ``device`` (a list where the tag spans several) and ``allocators`` (the same per
    allocator).  What lives beside an allocator's pages adds its own numbers, summed the
    same way (a graph pool's executables: ``executables``, ``executable_bytes``
    estimated, ``executable_bytes_released`` by sleeps so far).  The process-wide staging
    ring of offload is not any tag's: see ``vmm_core.offload.staging_bytes()``.
    """
    with _state.state_lock():
        snapshot = {tag: allocators(tag) for tag in list(_state.settled_registry())}
    out = {}
    for tag in sorted(snapshot):
        entries = [a.memory_stats() for a in snapshot[tag]]
        if not entries:
            continue
        summed = ["device_bytes", "host_bytes", "pinned_host_bytes", "spaces", "handles"]
        summed += sorted({k for e in entries for k, v in e.items() if k not in summed
                          and k not in _NOT_SUMMED and isinstance(v, (int, float))})
        out[tag] = {key: sum(e.get(key, 0) for e in entries) for key in summed}
        out[tag]["asleep"] = all(e["asleep"] for e in entries)
        for key in ("backend", "device"):
            values = sorted({e[key] for e in entries})
            out[tag][key] = values[0] if len(values) == 1 else values
        out[tag]["allocators"] = entries
    return out


#: memory_stats() keys that are not amounts
_NOT_SUMMED = frozenset({"device", "asleep", "offloaded"})


def tags_on(backend, device: int) -> dict[str, bool]:
    """Tags with memory on ``backend`` (a Backend or its name) and ``device``, and
    whether each sleeps there (True if any of its allocators there is asleep).

    Cheap and lock-free (a snapshot), for guards that run before every replay."""
    name = backend if isinstance(backend, str) else backend.name
    out = {}
    _state.settle_if_free()
    for tag, allocs in list(_registry.items()):
        mine = [a for a in allocs
                if not a.closed and a.device == device and a.backend.name == name]
        if mine:
            out[tag] = any(a.asleep for a in mine)
    return out


@contextlib.contextmanager
def hold_awake(tags, backend=None, device: int | None = None):
    """Hold every allocator of ``tags`` locked and awake for the block.

    Only allocators on ``backend``/``device`` when given; tags with no memory there are
    ignored.  Raises SleepStateError naming the first sleeping tag.  Sleep and wake take
    the same allocator locks, so a sleep cannot slip between this check and, say, a
    graph launch inside the block: other threads' sleeps wait for the block to end.
    Locks are taken in one global order, so two holders cannot deadlock.  Do not call
    ``sleep``, ``wake_up`` or ``region`` inside the block.
    """
    tags = _state.tag_list(tags, "hold_awake: tags")
    name = backend if backend is None or isinstance(backend, str) else backend.name
    with _state.state_lock(), contextlib.ExitStack() as stack:  # first, as every capture and replay
        # chosen under the lock: memory closed while this waited for it is gone, not held
        chosen = []
        for tag in tags:
            for alloc in tuple(_state.settled_registry().get(tag, ())):
                if alloc.closed or (name is not None and alloc.backend.name != name) \
                        or (device is not None and alloc.device != device):
                    continue
                chosen.append((id(alloc), tag, alloc))
        seen = set()
        for key, tag, alloc in sorted(chosen, key=lambda c: c[0]):
            if key in seen:
                continue
            seen.add(key)
            try:
                stack.enter_context(alloc.hold_awake(
                    f"memory tagged {tag!r}" + (f" on {name}:{device}" if name else "")))
            except VMMError:
                if not alloc.closed:  # closed since it was chosen: nothing left to hold
                    raise
        yield


@contextlib.contextmanager
def keep_thread_device(allocs):
    """The calling thread's current device (context) on each backend of ``allocs`` is
    the same after the block as before: the hooks make the device of each allocator
    current in turn, and a sleep or wake of memory on two devices used to leave the
    caller on the last one (``torch.cuda.current_device()`` changed under it)."""
    backends = {a.backend.name: a.backend for a in allocs}
    saved = []
    for be in backends.values():
        try:
            saved.append((be, be.thread_device()))
        except VMMError as exc:  # nothing to restore is better than no sleep
            logger.warning("the current device on %s could not be read (%s); a sleep or "
                           "wake of several devices may leave another one current", be.name,
                           exc)
    try:
        yield
    finally:
        for be, state in saved:
            try:
                be.set_thread_device(state)
            except VMMError as exc:
                logger.warning("the caller's current device on %s could not be made "
                               "current again (%s)", be.name, exc)


@contextlib.contextmanager
def _transfer_report(verb: str, chosen: list[str]):
    """Log one line per sleep / wake_up: what was freed or restored, and how fast."""
    if not logger.isEnabledFor(logging.INFO):
        yield
        return
    allocs = list({id(a): a for tag in chosen for a in allocators(tag)}.values())
    before = {id(a): (a.asleep, a.physical_bytes, a.last_transfer) for a in allocs}
    yield
    moved, copied, seconds, changed = 0, 0, 0.0, 0
    for a in allocs:
        was_asleep, held, transfer = before[id(a)]
        if was_asleep == a.asleep:
            continue  # no-op for this one
        changed += 1
        moved += held if verb == "sleep" else a.physical_bytes
        if a.last_transfer is not None and a.last_transfer is not transfer:
            copied += a.last_transfer.nbytes
            seconds += a.last_transfer.seconds
    if not changed:
        return  # nothing was asleep to wake (or awake to sleep): nothing to report
    # one allocator under two tags (two graph families) holds its pages once
    in_use = sum(a.physical_bytes for a in {id(a): a for t in tags()
                                            for a in allocators(t)}.values())
    gib = 2 ** 30
    line = (f"{verb}: {'freed' if verb == 'sleep' else 'restored'} {_bytes(moved)} "
            f"(tags {', '.join(chosen)}), {_bytes(in_use)} of tagged memory in use")
    if copied:
        way = "offloaded" if verb == "sleep" else "copied back"
        rate = copied / gib / seconds if seconds > 0 else float("inf")
        line += f"; {way} {_bytes(copied)} in {seconds:.3f} s at {rate:.1f} GiB/s"
    pinned = sum(a.pinned_host_bytes for a in allocs)
    held = sum(a.host_bytes for a in allocs)
    line += f"; host memory held {_bytes(held)} ({_bytes(pinned)} pinned)"
    logger.info(line)


def _bytes(n: int) -> str:
    """A size for a log line, in the unit that keeps it readable (4 MiB, not 0.00 GiB)."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"

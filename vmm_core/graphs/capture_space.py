"""The capture space of one key, and the escape guard that checks what a capture leaves.

A :class:`CaptureSpace` is the ``with`` block an engine wraps its capture calls in (the
counterpart of ``torch.cuda.graph``'s block, which likewise only enters and leaves what
the pool prepared): the pool opens the key's space on entry and checks it on exit.

The escape guard exists because every space maps the same physical pages: a block still
allocated when a capture ends, and not declared with ``keep()``, lives on pages every
other key's graphs reuse, so they would silently compute wrong results.  One
:class:`EscapeGuard` per allocator (held by its pool group) remembers such blocks, and
every pool of the allocator refuses work until they are gone.
"""

from __future__ import annotations

import numbers
import threading
import warnings
import weakref
from dataclasses import dataclass, field

from ..errors import CaptureError, CaptureEscapeError, VMMFallbackWarning, outside_stacklevel

__all__ = ["CaptureSpace", "KeySpace", "EscapeGuard", "open_spaces", "replay_blocks",
           "escaped_blocks", "unrouted_reason", "size_text"]


@dataclass(eq=False)
class KeySpace:
    """What a pool knows of one key: its space, the framework pool over it, and what the
    engine declared to outlive its captures."""

    key: object
    index: int | None = None  # the allocator's space ("vmm", "single")
    pool: object = None  # the framework pool over it ("vmm", "single")
    handle: object = None  # what the capture call takes as pool=
    kept: list = field(default_factory=list)  # (weakref or None, address, nbytes)
    reads: set = field(default_factory=set)
    entries: int = 0
    captured: int = 0  # entries that ended without an error: replaying() needs one
    nbytes: int = 0


def _extent(obj) -> tuple[object, int, int]:
    """``(weakref or None, address, nbytes)`` of a kept tensor, address or extent.

    Tensors are held weakly, through their storage (a view or an alias keeps it alive as
    long as any tensor uses the memory): once the engine drops the last one its block is
    free again, and a stale extent must not excuse a later block on the same address.
    Raw addresses are declared for the life of the space."""
    if isinstance(obj, bool):
        raise TypeError(f"keep() takes tensors or addresses, not {obj!r}")
    if isinstance(obj, numbers.Integral):  # numpy's too
        return None, _address(obj), 1
    if isinstance(obj, tuple) and len(obj) == 2 and \
            all(isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in obj):
        if obj[1] < 0:  # an extent of -5 bytes excused a block silently
            raise ValueError(f"keep(): an extent (address, nbytes) needs nbytes >= 0, got "
                             f"{obj!r}")
        return None, _address(obj[0]), max(1, int(obj[1]))
    storage = getattr(obj, "untyped_storage", None)
    if storage is None:
        raise TypeError(f"keep() takes tensors, int addresses or (address, nbytes) tuples, "
                        f"got {type(obj).__name__}")
    s = storage()
    try:
        ref = weakref.ref(s)
    except TypeError:  # a framework whose storages take no weak references
        ref = weakref.ref(obj)
    return ref, int(s.data_ptr()), max(1, int(s.nbytes()))


def _address(value) -> int:
    if not 0 <= value < 1 << 64:
        raise ValueError(f"keep(): {value} is not an address (an int from 0 to 2**64 - 1); "
                         f"pass the tensor, its data_ptr(), or (data_ptr, nbytes)")
    return int(value)


class CaptureSpace:
    """The context manager :meth:`GraphPool.space` returns; ``with`` yields the handle.

    ``handle`` is exactly what the vendor's capture call takes as ``pool=``
    (``torch.cuda.graph(g, pool=handle)``); :meth:`keep` declares space-local tensors.
    """

    def __init__(self, pool, key, keep=(), record_stream_reuse=False) -> None:
        """``pool``: the GraphPool whose ``_enter`` and ``_exit`` open and close the
        key's space (this class only holds what is open, on which thread)."""
        self._pool = pool
        self.key = key
        self._keep = tuple(keep)
        self._record_stream_reuse = bool(record_stream_reuse)
        self._space: KeySpace | None = None
        self._stacks: tuple | None = None  # (inner contexts, held locks)
        self._thread: int | None = None

    @property
    def handle(self):
        if self._space is None:
            raise CaptureError("CaptureSpace.handle: enter the space first (with pool.space(key))")
        return self._space.handle

    def keep(self, *tensors) -> None:
        """Declare tensors allocated in this space that outlive the block (space-local).

        They stay valid only until a graph of another key replays."""
        if self._space is None:
            raise CaptureError("keep(): the space is not open; call it inside the with block")
        extents = [_extent(t) for t in tensors]  # all checked first: a refusal keeps none
        self._space.kept.extend(extents)

    def __enter__(self):
        if self._space is not None:
            raise CaptureError(f"the capture space of {self.key!r} is already open; call "
                               f"pool.space(key) again for another entry")
        space, inner, held = self._pool._enter(self.key, self._record_stream_reuse)
        self._space, self._stacks, self._thread = space, (inner, held), threading.get_ident()
        try:
            self.keep(*self._keep)
        except BaseException:
            self._leave(True, None)
            raise
        open_spaces().append(self)
        return space.handle

    def __exit__(self, exc_type, exc, tb):
        self._leave(exc_type is not None, exc)
        return False

    def _leave(self, failed: bool, exc) -> None:
        if self._thread != threading.get_ident():
            raise CaptureError(f"the capture space of {self.key!r} was opened on another "
                               f"thread; leave it on the thread that entered it")
        if self in open_spaces():
            open_spaces().remove(self)
        space, stacks = self._space, self._stacks
        self._space = self._stacks = self._thread = None
        if space is None or stacks is None:
            raise CaptureError(f"the capture space of {self.key!r} is not open")
        self._pool._exit(space, stacks[0], stacks[1], failed, exc)


_tls = threading.local()


def open_spaces() -> list:
    """The capture spaces open on this thread, innermost last."""
    spaces = getattr(_tls, "spaces", None)
    if spaces is None:
        spaces = _tls.spaces = []
    return spaces


def replay_blocks() -> list:
    """``(pool, key)`` of the replay blocks open on this thread, innermost last."""
    blocks = getattr(_tls, "replays", None)
    if blocks is None:
        blocks = _tls.replays = []
    return blocks


# ----------------------------------------------------------------------------------
# The escape guard
# ----------------------------------------------------------------------------------

def escaped_blocks(space: KeySpace, adapter) -> list[tuple[int, int]]:
    """``(address, size)`` of live blocks of ``space`` that no kept tensor lies in."""
    space.kept = [k for k in space.kept if k[0] is None or k[0]() is not None]
    extents = [(address, nbytes) for _, address, nbytes in space.kept]
    # an extent excuses every block it overlaps (one tensor may span several blocks)
    return [(address, size) for address, size in adapter.live_blocks(space.pool)
            if not any(a < address + size and address < a + n for a, n in extents)]


class EscapeGuard:
    """What the pools of one allocator know of blocks that outlived their capture.

    An escape poisons every pool of the allocator (the escaped block lives on pages every
    other space reuses); the poison is lifted once every block behind it is gone (freed,
    or its pool closed), since a user's own allocator would otherwise stay unusable.
    The guard's state is read and changed under the group's lock."""

    def __init__(self) -> None:
        self.poisoned: str | None = None
        #: blocks a failed capture left alive, re-checked until they are gone: (pool
        #: weakref, space, blocks or None); the pool is held weakly (a strong reference
        #: would keep a dropped pool, and an allocator it created, alive as long as no
        #: other pool of the group runs a check)
        self.suspects: list = []
        #: the blocks behind ``poisoned``: (pool weakref, space, blocks) each
        self.escapes: list = []

    def refuse_if_poisoned(self) -> None:
        """Raise what makes every pool of the allocator unusable now, if anything."""
        if self.suspects and not self.poisoned:
            self._check_suspects()
        if self.current() is not None:
            raise CaptureError(f"this graph pool is unusable: {self.poisoned}")

    def current(self) -> str | None:
        """Why the pools refuse work, or None (also once the blocks behind it are gone)."""
        if self.poisoned and self._escapes_gone():
            self.poisoned, self.escapes = None, []
        return self.poisoned

    def check_capture(self, pool, space: KeySpace) -> None:
        """After a capture that ended without an error: every block still alive in the
        space must be declared with ``keep()``; anything else poisons the allocator."""
        escaped = escaped_blocks(space, pool.adapter)
        if escaped:
            self.poisoned = _escape_message(space.key, [size for _, size in escaped])
            self.escapes.append((weakref.ref(pool), space, escaped))
            raise CaptureEscapeError(self.poisoned)

    def suspect(self, pool, space: KeySpace) -> None:
        """A failed capture may leave blocks alive (a workspace made lazily before the
        error); its traceback can still hold them, so they are checked again later."""
        try:
            left = escaped_blocks(space, pool.adapter)
        except Exception:  # the framework's state after a failed capture: check later
            left = None
        if left is None or left:
            self.suspects.append((weakref.ref(pool), space, left))

    def _check_suspects(self) -> None:
        """Poison the allocator if blocks a failed capture left are still alive now."""
        still = []
        for ref, space, left in self.suspects:
            pool = ref()
            if pool is None or space.pool is None:
                continue  # its pool was closed or dropped: its spaces are given back
            now = set(escaped_blocks(space, pool.adapter))
            alive = sorted(now if left is None else now & set(left))
            if alive:
                still.append((space.key, alive))
                self.escapes.append((ref, space, alive))
        self.suspects = []
        if still:
            key, alive = still[0]
            self.poisoned = (
                f"a failed capture into the space of {key!r} left {len(alive)} block(s) "
                f"alive ({', '.join(size_text(s) for _, s in alive)}) after the error was "
                f"handled; they live in memory every other space reuses. Drop what the "
                f"failed capture allocated before capturing or replaying again. "
                + _REMEDY)
            raise CaptureEscapeError(self.poisoned)

    def _escapes_gone(self) -> bool:
        """Whether every block behind the poison is gone: freed, or in a space given back
        with its pool (closed or dropped), where it aliases nothing."""
        if not self.escapes:
            return False  # poisoned by something that cannot be checked again
        try:
            for ref, space, blocks in self.escapes:
                if space.pool is None:
                    continue  # given back with its pool (closed, or dropped and reaped)
                pool = ref()
                if pool is None:
                    return False  # dropped: its spaces go back on the reaper, soon
                if set(escaped_blocks(space, pool.adapter)) & set(blocks):
                    return False
        except Exception:  # noqa: BLE001 - the framework cannot say: stay poisoned
            return False
        return True


#: backends whose unrouted captures were warned about (once per process)
_warned_unrouted: set[str] = set()


def unrouted_reason(backend, device: int, key) -> str | None:
    """Why a capture into ``key``'s space allocated nothing there, or None when the
    framework's allocator is routed to the space (nothing then is merely a capture that
    allocates nothing).  On a backend whose framework allocator cannot be routed (the
    host's CPU allocator) the capture's tensors live elsewhere and nothing is shared
    between keys: said once per backend as a warning, as ``region()`` says it."""
    from ..memory import routing

    if routing.framework_routed(backend, device):
        return None
    if backend.name not in _warned_unrouted:
        _warned_unrouted.add(backend.name)
        warnings.warn(f"GraphPool on the {backend.name!r} backend: the capture of key "
                      f"{key!r} allocated nothing in its space. Framework tensors made "
                      f"during a capture (torch.empty, a model's activations, ...) are NOT "
                      f"placed in graph pool memory on this backend, since its CPU allocator "
                      f"cannot be redirected; allocate from pool.allocator inside "
                      f"pool.space(key) (see examples/host_graph_pool.py)",
                      VMMFallbackWarning, stacklevel=outside_stacklevel())
    return (f"backend {backend.name!r} cannot place framework tensors in the pool's spaces "
            f"(its CPU allocator cannot be redirected): the captures allocated nothing in "
            f"vmm memory; allocate from pool.allocator inside a space")


def size_text(n: int) -> str:
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n} B"


_REMEDY = ("Every pool sharing this allocator refuses further use until those blocks are "
           "gone: free them (drop every tensor that lives there; on the host backend, "
           "deallocate them) or close the pool they were captured in. Then the allocator "
           "and its pools, new ones included, are usable again.")


def _escape_message(key, sizes: list[int]) -> str:
    listed = ", ".join(size_text(s) for s in sorted(sizes))
    return (f"capture space {key!r}: {len(sizes)} block(s) allocated there are still alive "
            f"after the capture ({listed}) and were not declared with keep(). They live in "
            f"memory that every other space reuses, so later graphs would silently compute "
            f"wrong results. Typical cause: a library workspace or cache created lazily "
            f"inside the first capture (cuBLAS allocates 32 MiB per stream): warm up on the "
            f"capture stream first (GraphPool.warmup, or GraphExecutor's warmup=True), or "
            f"allocate the cache before capture. If the tensor is an output the next graph "
            f"of the same key reads, declare it with keep(). " + _REMEDY)

"""Plain torch graph pools: the baselines GraphPool is measured against.

Engines without vmm_core capture either into one ``graph_pool_handle()`` that every
capture shares (vLLM, SGLang: :class:`SharedTorchPool`) or, calling
``torch.cuda.graph(g)`` without ``pool=``, into a private pool per graph
(:class:`PrivateTorchPool`).  Both give the framework's own pools and keep the framework's
executables; nothing is placed in vmm_core memory.  They have the interface that
``GraphExecutor(pool=...)`` takes, :class:`vmm_core.GraphPool`'s, so the benchmark runs
the same runner over them that it runs over a GraphPool::

    pool = SharedTorchPool(backend="cuda")
    ex = vmm_core.GraphExecutor(fn, inputs, pool=pool)

The library does not know these pools; :data:`MODES` is the benchmark's list of decode
strategies (``--modes``), :func:`make_pool` the one place a strategy becomes a pool.
"""

from __future__ import annotations

import contextlib
import threading

from vmm_core.errors import CaptureError

from .measure import as_backend, current_device

__all__ = ["TorchPool", "SharedTorchPool", "PrivateTorchPool", "BASELINES", "MODES",
           "make_pool"]


class TorchPool:
    """Capture spaces over the framework's own pools (a base: which pool a capture gets is
    the subclass's :meth:`_handle`).

    A key's space is only its bookkeeping here: every capture gets the handle the
    subclass gives, blocks alive after a capture stay the framework's (nothing aliases
    them), and replays are ordered after the previous launch of this pool, as GraphPool
    orders them.  Captures and replays of one pool are serialized across threads."""

    reuse = ""
    allocator = None  # no vmm_core memory: nothing to merge, sleep or account
    adapter = None
    fallback_reason = None
    poisoned = None

    def __init__(self, device: int | None = None, *, backend=None, tag: str = "graph",
                 executables=False) -> None:

        if executables not in (None, False):
            raise ValueError(f"{type(self).__name__}(executables={executables!r}): a plain "
                             f"torch pool leaves every executable to the framework, as the "
                             f"engines it stands for do; drop executables=")
        self.backend = backend = as_backend(backend)
        self.device = current_device(backend) if device is None else int(device)
        self.tag = tag
        self.requested_reuse = self.reuse
        self.ops = backend.graph_ops(self.device)
        if self.ops is None:
            raise CaptureError(f"backend {backend.name!r} has no graph ops: graphs cannot "
                               f"be captured with it")
        self._lock = threading.RLock()
        self._entries: dict = {}  # key -> [entries, captured]
        self._open: list = []  # keys whose space is open, innermost last
        self._last_stream = None
        self._closed = False
        self._shared = self._handle()

    def _handle(self):
        """The ``pool=`` every capture of this pool gets."""
        raise NotImplementedError

    # ------------------------------------------------------------------ capture
    @contextlib.contextmanager
    def serialized(self):
        with self._lock:
            yield

    @property
    def capture_stream(self):
        return self.ops.capture_stream

    def warmup(self, fn) -> None:
        self.ops.warmup(fn)

    def new_graph(self):
        """The framework's own graph: it keeps the executable."""
        return self.ops.new_graph()

    @contextlib.contextmanager
    def space(self, key, keep=(), *, record_stream_reuse: bool = False):
        """``with pool.space(key) as handle:`` (what ``pool=`` of the capture call takes)."""
        hash(key)
        with self.serialized(), contextlib.ExitStack() as inner:
            self._refuse_closed()
            if record_stream_reuse:
                inner.enter_context(self.ops.record_stream_reuse(True))
            counts = self._entries.setdefault(key, [0, 0])
            counts[0] += 1
            self._open.append(key)
            try:
                yield self._shared
            finally:
                self._open.pop()
            counts[1] += 1

    def keep(self, *tensors) -> None:
        """Nothing to declare: a block alive after a capture is the framework's, and no
        other key's capture reuses it."""
        if not self._open:
            raise CaptureError("keep(): no space of this pool is open; call it inside "
                               "`with pool.space(key):`")

    # ------------------------------------------------------------------ replay
    @contextlib.contextmanager
    def replaying(self, key):
        """Launch ``key``'s graphs inside: ordered after this pool's previous launch."""
        with self.serialized():
            self._refuse_closed()
            counts = self._entries.get(key)
            if counts is None or not counts[1]:
                raise CaptureError(f"no graph was captured in the space of {key!r}")
            current = self.ops.current_stream()
            if self._last_stream is not None:
                self.ops.wait_stream(current, self._last_stream)
            self._last_stream = current
            yield

    def before_replay(self, key) -> None:
        with self.replaying(key):
            pass

    def compact(self) -> None:
        """Nothing to merge: the framework's pools hold the memory."""

    def trim(self) -> None:
        """Nothing to give back: the framework's pools hold the memory."""

    # ------------------------------------------------------------------ state
    @property
    def keys(self) -> list:
        return list(self._entries)

    def stats(self) -> dict:
        """The keys GraphPool's stats() has, for a pool without vmm_core memory."""
        keys = list(self._entries)
        return {
            "backend": self.backend.name, "device": self.device, "tag": self.tag,
            "reuse": self.reuse, "requested_reuse": self.requested_reuse, "fallback": None,
            "keys": keys, "space_bytes": {k: 0 for k in keys}, "largest_space_bytes": 0,
            "entries": sum(e for e, _ in self._entries.values()), "reads": {k: [] for k in keys},
            "physical_bytes": None, "virtual_spaces": None, "handles": None,
            "switch_seconds": 0.0, "compact_seconds": 0.0, "phase_seconds": {},
            "asleep": False, "poisoned": None, "executables": None,
        }

    def _refuse_closed(self) -> None:
        if self._closed:
            raise CaptureError(f"this {type(self).__name__} was closed; create a new one")

    def check_can_close(self) -> None:
        if self._open:
            raise CaptureError(f"{type(self).__name__}.close() inside the capture space of "
                               f"{self._open[-1]!r}: leave that with block first")

    def close(self) -> None:
        """Drop the pool handle; the framework frees its blocks once the graphs captured
        into it are reset or dropped.  Idempotent."""
        with self.serialized():
            if self._closed:
                return
            self.check_can_close()
            self._closed = True
            self.ops.synchronize()
            self._shared = None


class SharedTorchPool(TorchPool):
    """One ``graph_pool_handle()`` for every capture of every key: what vLLM and SGLang
    pass."""

    reuse = "shared"

    def _handle(self):
        return self.ops.shared_pool_handle()


class PrivateTorchPool(TorchPool):
    """``pool=None`` for every capture: the framework gives each graph a private pool."""

    reuse = "private"

    def _handle(self):
        return None


#: the baselines by strategy name
BASELINES: dict[str, type[TorchPool]] = {"shared": SharedTorchPool,
                                         "private": PrivateTorchPool}
#: the decode benchmark's strategies (``--modes``): the baselines and GraphPool
MODES = ("private", "shared", "vmm")


def make_pool(reuse: str, device: int | None = None, *, allocator=None, reads=None,
              **kwargs):
    """The pool of strategy ``reuse``: a baseline's torch pool, or a
    :class:`vmm_core.GraphPool` (``allocator``, ``reads`` and any other GraphPool
    argument are for that one; a baseline has no vmm_core memory to share)."""
    import vmm_core

    if reuse in BASELINES:
        if allocator is not None:
            raise ValueError(f"a {reuse!r} torch pool has no vmm_core allocator to share; "
                             f"drop allocator=")
        return BASELINES[reuse](device, **kwargs)
    return vmm_core.GraphPool(device, reuse=reuse, allocator=allocator, reads=reads,
                              **kwargs)

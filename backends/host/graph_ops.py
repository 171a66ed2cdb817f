"""Graph ops of the host backend: there is no graph API on a CPU, so a "graph"
remembers its function and a replay calls it eagerly.

That is enough for CI to run the whole capture policy for real (buckets, padding,
persistent buffers, space switching, the escape guard): what matters is where the memory
comes from, and that is real virtual memory on this backend.

The graph executables policy (:mod:`vmm_core.graphs.executables`) is run for real too,
over :class:`HostExecutables`, which behaves as the CUDA driver does where the policy can
tell: see its docstring.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref

from vmm_core.errors import CaptureError
from vmm_core.plugin import Executables, GraphOps, KeptGraphMixin, watch_operators

__all__ = ["HostGraphOps", "HostGraph", "KeptHostGraph", "HostExecutables", "current_stream",
           "emulated_device", "EMULATED_DEVICE_BYTES"]

_tls = threading.local()


def current_stream():
    """The host "stream" work runs on: None by default, the ops' own during warm-up and
    capture.  Libraries that cache per stream (as cuBLAS does) can key on it."""
    return getattr(_tls, "stream", None)


@contextlib.contextmanager
def _on_stream(stream):
    previous = current_stream()
    _tls.stream = stream
    try:
        yield
    finally:
        _tls.stream = previous


class HostGraph:
    def __init__(self) -> None:
        self.fn = None
        self.outputs = None  # the tensors the capture returned: replay rewrites them
        #: a kept graph's "kernels": the operators its capture ran, and those drawing
        #: random numbers (what a device graph's nodes tell the driver)
        self.recorded: tuple = ()
        self.recorded_drawing: tuple = ()

    def capture_begin(self, *args, **kwargs) -> None:
        """Where a device graph starts recording (the host records ``fn`` instead)."""

    def capture_end(self) -> None:
        """Where a device graph stops recording."""

    def reset(self) -> None:
        self.fn = self.outputs = None
        self.recorded = self.recorded_drawing = ()

    def replay(self) -> None:
        """Re-run the function and write its results into the tensors the capture
        returned, as a device graph rewrites its static outputs in place."""
        if self.fn is None:
            raise CaptureError("replay of a graph that was reset or never captured")
        _copy_into(self.outputs, self.fn())


def _copy_into(static, fresh) -> None:
    if isinstance(static, (tuple, list)):
        for s, f in zip(static, fresh):
            _copy_into(s, f)
    elif hasattr(static, "copy_"):
        static.copy_(fresh)


class HostGraphOps(GraphOps):
    device_type = "cpu"

    def __init__(self, device: int = 0) -> None:
        super().__init__(device)
        self.stream = object()
        self._executables: HostExecutables | None = None

    @property
    def capture_stream(self):
        return self.stream

    def current_stream(self):
        return current_stream()

    def synchronize(self) -> None:
        return None

    def warmup(self, fn) -> None:
        with _on_stream(self.stream):
            fn()

    def new_graph(self, keep: bool = False):
        return KeptHostGraph() if keep else HostGraph()

    def capture(self, graph, fn, pool_handle):
        graph.capture_begin(pool_handle)
        # a kept graph records its operators, as a device graph holds its kernels: its
        # executables read them afterwards (HostExecutables.random_kernels)
        record = watch_operators() if isinstance(graph, KeptHostGraph) else None
        try:
            with _on_stream(self.stream), record or contextlib.nullcontext():
                outputs = fn()
        except BaseException:
            # a graph whose executables a pool owns is told the capture failed
            getattr(graph, "capture_abort", graph.capture_end)()
            graph.reset()  # a failed capture leaves nothing to replay, as on a device
            raise
        graph.fn, graph.outputs = fn, outputs
        if record is not None:
            graph.recorded, graph.recorded_drawing = tuple(record.operators), \
                tuple(record.seeded)
        graph.capture_end()
        return outputs

    def executables(self):
        if self._executables is None:
            self._executables = HostExecutables(self.device)
        return self._executables

    @contextlib.contextmanager
    def capture_context(self, graph, pool_handle, stream=None,
                        capture_error_mode: str | None = None, options=None):
        """A capture block on the host: the block runs once, on the capture "stream",
        and ``graph`` records nothing (a host graph replays a function, which a block
        does not give).  Its allocations go where the caller routed them, as a device
        capture's go to ``pool_handle``."""
        if capture_error_mode not in (None, "global", "thread_local", "relaxed"):
            raise CaptureError(f"capture_error_mode must be 'global', 'thread_local' or "
                               f"'relaxed', got {capture_error_mode!r}")
        if options:
            raise CaptureError(f"the host backend's capture takes no {sorted(options)}")
        with _on_stream(self.stream if stream is None else stream):
            yield

    def replay(self, graph) -> None:
        graph.replay()

    def shared_pool_handle(self):
        return object()

    def non_owning_view(self, address: int, nbytes: int):
        """A CPU tensor over a buffer at the address: the buffer object owns nothing."""
        import ctypes

        import torch

        return torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(address),
                                dtype=torch.uint8)


class KeptHostGraph(KeptGraphMixin, HostGraph):
    """A host graph whose executables a GraphPool owns (``new_graph(keep=True)``)."""


# ----------------------------------------------------------------------------------
# Emulated executables
# ----------------------------------------------------------------------------------

#: the emulated device memory executables come from, per device
EMULATED_DEVICE_BYTES = 80 << 30
_EXEC_STEP = 2 << 20  # the driver takes executable memory in 2 MiB steps
_BASE_BYTES, _NODE_BYTES = 100 << 10, 2560  # the H100 fit: 100 KiB + 2.5 KiB per node


class _EmulatedDevice:
    """Device memory as the driver shows it for executables: taken at instantiate in
    2 MiB steps, never given back on destroy (free memory does not rise), reused by later
    instantiations; and the uploads: a launch of an executable made or updated since its
    last upload pays one (``cold_launches``), and each wait for uploads made ahead is
    counted (``upload_waits``); launches of executables updated to their graph are
    counted (``updated_launches``)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.live_bytes = 0  # bytes of the executables alive now
        self.reserved = 0  # what the driver took for executables (never goes down)
        self.live = 0  # executables alive now
        self.instantiations = 0
        self.cold_launches = 0  # launches that paid their executable's upload
        self.uploads = 0  # uploads made ahead of a launch (preload)
        self.upload_waits = 0  # waits for such uploads to end
        self.updated_launches = 0  # launches of an executable updated to its graph

    def take(self, nbytes: int) -> None:
        with self.lock:
            self.live_bytes += nbytes
            self.live += 1
            self.instantiations += 1
            if self.live_bytes > self.reserved:
                self.reserved = -(-self.live_bytes // _EXEC_STEP) * _EXEC_STEP

    def give(self, nbytes: int) -> None:
        with self.lock:
            self.live_bytes -= nbytes
            self.live -= 1

    def free_bytes(self) -> int:
        return EMULATED_DEVICE_BYTES - self.reserved


_devices: dict[int, _EmulatedDevice] = {}
_devices_lock = threading.Lock()


def emulated_device(device: int = 0) -> _EmulatedDevice:
    """The emulated executable memory of ``device`` (tests read its counters)."""
    with _devices_lock:
        dev = _devices.get(device)
        if dev is None:
            dev = _devices[device] = _EmulatedDevice()
        return dev


class _HostExecutable:
    __slots__ = ("fn", "outputs", "operators", "rng", "nbytes", "destroyed", "uploaded",
                 "updated")

    def __init__(self, graph, nbytes: int) -> None:
        self.nbytes, self.destroyed, self.updated = nbytes, False, False
        self.point_at(graph)

    def point_at(self, graph) -> None:
        import torch

        self.uploaded = False  # made or updated: its next launch uploads it first

        # weakly: a device executable keeps no Python object alive, and an engine object
        # its function closes over would otherwise live as long as the pool's cache
        try:
            self.fn = weakref.ref(graph.fn)
        except TypeError:
            self.fn = lambda fn=graph.fn: fn
        self.outputs = graph.outputs
        self.operators = graph.recorded
        # what a device executable bakes in: the generator offset of its capture, so
        # every launch draws the same numbers (the framework's replay advances it)
        self.rng = torch.random.get_rng_state()


def _code_of(fn):
    while isinstance(fn, functools.partial):
        fn = fn.func
    return getattr(fn, "__code__", None) or fn


class HostExecutables(Executables):
    """Executables of host graphs, held to the CUDA driver's rules where the policy can
    tell the difference:

    * an executable runs the graph it was instantiated from or last updated to (its
      function, held weakly: launching one whose graph was dropped raises), with
      the random-number state of that moment (every launch draws the same numbers, as a
      device executable launched without the framework's replay prologue does);
    * launching or updating a destroyed executable, or destroying one twice, raises
      :class:`CaptureError` (the driver's behaviour there is undefined: the emulation
      makes it loud);
    * an update to a graph of another function is refused (``"function changed"``), and
      to a graph of the same function whose operators differ (``"topology changed"``):
      :meth:`topology` looks at the function only, so the policy's fallback is exercised;
    * executables' bytes (:meth:`nbytes`, the H100 fit) are taken from an emulated
      device that, like the driver, does not report them free after a destroy but reuses
      them for later instantiations (:func:`emulated_device`);
    * an executable updated to another graph says it runs slower
      (:attr:`updated_runs_slower`), as the driver's do: its launches are counted
      (``updated_launches``), so the policy that makes such executables again is
      exercised.
    """

    updated_runs_slower = True
    #: a kept graph's recorded operators stand for its kernels.  The generator's state is
    #: no kernel parameter here (:meth:`sees_generator_state` is False), so a pool's
    #: default keeps watching operators; ``random_numbers="kernels"`` reads these
    reads_random_kernels = True

    def __init__(self, device: int = 0) -> None:
        self.device = device
        self.memory = emulated_device(device)

    def instantiate(self, graph):
        if graph.fn is None:
            raise CaptureError("instantiate of a host graph that was never captured or was "
                               "reset")
        handle = _HostExecutable(graph, self.nbytes(graph))
        self.memory.take(handle.nbytes)
        return handle

    def launch(self, handle, stream=None) -> None:
        import torch

        self._check_alive(handle, "launch")
        fn = handle.fn()
        if fn is None:
            raise CaptureError("launch of an executable whose graph's function is gone (the "
                               "graph was dropped)")
        if not handle.uploaded or handle.updated:
            with self.memory.lock:
                self.memory.cold_launches += not handle.uploaded
                self.memory.updated_launches += handle.updated
            handle.uploaded = True
        with torch.random.fork_rng(devices=[]):
            torch.random.set_rng_state(handle.rng)
            _copy_into(handle.outputs, fn())

    def preload(self, handle) -> None:
        self.preload_all([handle])

    def preload_all(self, handles) -> None:
        for handle in handles:
            self._check_alive(handle, "upload")
            handle.uploaded = True
        with self.memory.lock:
            self.memory.uploads += len(handles)
            self.memory.upload_waits += 1

    def update(self, handle, graph) -> str | None:
        self._check_alive(handle, "update")
        if graph.fn is None:
            raise CaptureError("update to a host graph that was never captured or was reset")
        if _code_of(graph.fn) is not _code_of(handle.fn()):
            return "function changed"
        if graph.recorded != handle.operators:
            return "topology changed"
        handle.point_at(graph)
        handle.updated = True
        return None

    def destroy(self, handle) -> None:
        self._check_alive(handle, "destroy")
        handle.destroyed = True
        self.memory.give(handle.nbytes)

    def topology(self, graph):
        return _code_of(graph.fn)

    def nbytes(self, graph) -> int:
        return _BASE_BYTES + _NODE_BYTES * len(graph.recorded)

    def random_kernels(self, graph) -> tuple[str, ...]:
        """The operators of its capture that drew random numbers (recorded by
        :meth:`HostGraphOps.capture`; a graph never captured or reset has none)."""
        if graph.fn is None:
            raise CaptureError("reading the kernels of a host graph that was never "
                               "captured or was reset")
        return tuple(str(op) for op in graph.recorded_drawing)

    def device_free_bytes(self) -> int:
        return self.memory.free_bytes()

    @staticmethod
    def _check_alive(handle, what: str) -> None:
        if not isinstance(handle, _HostExecutable):
            raise CaptureError(f"{what}: {handle!r} is not a host executable")
        if handle.destroyed:
            raise CaptureError(f"{what} of a destroyed executable")

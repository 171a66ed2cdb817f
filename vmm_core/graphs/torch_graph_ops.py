"""GraphOps for the PyTorch device modules that mirror ``torch.cuda`` (cuda, npu, mlu).

``torch.cuda``, ``torch.npu`` (torch_npu) and ``torch.mlu`` (torch_mlu) expose the same
shape of graph API: ``Stream``, ``stream()``, ``current_stream()``, ``synchronize()``, a
graph class, ``graph(g, pool=, stream=)`` and ``graph_pool_handle()``.  The decisions that
are the same for all of them live here, once:

* warm-up and capture share one side stream owned by this object, because libraries create
  workspaces lazily on the stream that first needs them (cuBLAS: 32 MiB); warming up on
  another stream would leave the capture stream cold and its workspace in the pool;
* every replay on a device goes through one replay stream, ordered after the caller's
  stream and before its next work, so two graphs sharing physical pages never overlap on
  the device even when launched from two threads.

A vendor subclass names its module, graph class and any extra capture arguments.
"""

from __future__ import annotations

import abc
import contextlib
import threading

from .. import forksafe
from ..errors import CaptureError
from .graph_ops import GraphOps

__all__ = ["TorchStreamGraphOps"]

_replay_streams: dict = {}
_replay_lock = threading.Lock()


def _fresh_lock_after_fork() -> None:
    """Another thread may have held the lock at the fork; the child does not have it."""
    global _replay_lock
    _replay_lock = threading.Lock()


forksafe.at_fork("framework calls", after_in_child=_fresh_lock_after_fork)


class TorchStreamGraphOps(GraphOps):
    """Graph ops over a ``torch.cuda``-shaped device module."""

    #: name of the graph class in the module ("CUDAGraph", "NPUGraph", "MLUGraph")
    graph_class: str = ""

    def __init__(self, device: int = 0) -> None:
        super().__init__(device)
        self._stream = None

    @abc.abstractmethod
    def module(self):
        """The device module: ``torch.cuda``, ``torch_npu.npu``, ``torch.mlu``."""

    def capture_kwargs(self) -> dict:
        """Extra keyword arguments of ``module.graph(...)`` (e.g. capture_error_mode)."""
        return {}

    @property
    def stream(self):
        """The capture stream, created on first use: one per executor, so a library's
        per-stream workspace is created by this executor's own warm-up."""
        if self._stream is None:
            self._stream = self.module().Stream(device=self.device)
        return self._stream

    @property
    def capture_stream(self):
        return self.stream

    def current_stream(self):
        return self.module().current_stream(self.device)

    def wait_stream(self, waiter, stream) -> None:
        if waiter is not None and stream is not None and waiter != stream:
            waiter.wait_stream(stream)

    def _replay_stream(self):
        mod = self.module()
        key = (mod, self.device)  # one per device module and device, shared by executors
        with _replay_lock:
            stream = _replay_streams.get(key)
            if stream is None:
                stream = _replay_streams[key] = mod.Stream(device=self.device)
            return stream

    def synchronize(self) -> None:
        self.module().synchronize(self.device)

    def warmup(self, fn) -> None:
        self._warm_up(fn, None)

    def warmup_overlapping(self, fn, meanwhile) -> None:
        own = type(self).warmup is not TorchStreamGraphOps.warmup \
            or "warmup" in getattr(self, "__dict__", {})
        if own:
            # a backend's own warmup is kept: run it, then the rest
            super().warmup_overlapping(fn, meanwhile)
            return
        self._warm_up(fn, meanwhile)

    def _warm_up(self, fn, meanwhile) -> None:
        mod, side = self.module(), self.stream
        caller = mod.current_stream(self.device)
        side.wait_stream(caller)
        with mod.stream(side):
            fn()
        caller.wait_stream(side)
        try:
            if meanwhile is not None:
                meanwhile()  # while the device runs fn's kernels
        finally:
            side.synchronize()

    def new_graph(self, keep: bool = False):
        if keep:
            return self.kept_graph()
        return getattr(self.module(), self.graph_class)()

    def kept_graph(self):
        """A graph whose capture keeps what was captured (``new_graph(keep=True)``); only
        backends with :meth:`executables` have one."""
        raise self.refuse_kept_graphs()

    def capture(self, graph, fn, pool_handle):
        mod = self.module()
        try:
            with mod.graph(graph, pool=pool_handle, stream=self.stream,
                           **self.capture_kwargs()):
                result = fn()
        except CaptureError:
            raise
        except RuntimeError as exc:
            raise CaptureError(
                f"{self.device_type} graph capture failed ({exc}); the function must be "
                f"capturable: no host syncs (.item(), .cpu(), printing tensors) and no "
                f"data-dependent shapes inside it") from exc
        return result

    @contextlib.contextmanager
    def capture_context(self, graph, pool_handle, stream=None,
                        capture_error_mode: str | None = None, options=None):
        kwargs = self.capture_kwargs()
        if capture_error_mode is not None:
            kwargs["capture_error_mode"] = capture_error_mode
        unknown = set(options or ()) - set(self.capture_options)
        if unknown:
            from ..errors import CaptureError

            raise CaptureError(f"{type(self).__name__}'s capture takes no {sorted(unknown)} "
                               f"(it passes on {sorted(self.capture_options)})")
        kwargs.update(options or {})
        # the workspaces of the capture stream in the default pool, not in this one
        stream = self.prepare_capture_stream(stream)
        with self.module().graph(graph, pool=pool_handle, stream=stream, **kwargs):
            yield

    def replay(self, graph) -> None:
        mod, stream = self.module(), self._replay_stream()
        caller = mod.current_stream(self.device)
        stream.wait_stream(caller)
        with mod.stream(stream):
            graph.replay()
        caller.wait_stream(stream)

    def order_after_replays(self) -> None:
        mod = self.module()
        mod.current_stream(self.device).wait_stream(self._replay_stream())

    def shared_pool_handle(self):
        return self.module().graph_pool_handle()

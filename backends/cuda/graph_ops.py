"""torch.cuda.CUDAGraph behind the GraphOps interface (the shared logic is in
:class:`vmm_core.plugin.TorchStreamGraphOps`); adds the CUDA-only record-stream capture
option."""

from __future__ import annotations

import contextlib
import logging
import os
import warnings

from vmm_core.errors import CaptureError, outside_stacklevel
from vmm_core.plugin import TorchStreamGraphOps, installed_version, version_tuple

__all__ = ["CudaGraphOps", "graph_registration_off"]

logger = logging.getLogger("vmm_core")

#: NCCL's switch for registering the buffers of collectives captured in a graph
NCCL_GRAPH_REGISTER = "NCCL_GRAPH_REGISTER"
_told = False


def graph_registration_off() -> None:
    """Turn NCCL's registration of captured collectives' buffers off, as vLLM does when
    its graph pool may be offloaded, unless the user chose.

    With ``NCCL_GRAPH_REGISTER`` on (NCCL's default), a collective captured in a graph
    registers its buffers once and every replay uses that registration; a graph pool of
    vmm_core is remapped when it sleeps and wakes (and shares pages across spaces), so
    the registration would point at released pages, and replays then hang (reported
    against torch_memory_saver and fixed in SGLang the same way).  Set here before a
    capture, when NCCL first reads it for a captured collective; a user who set it to 1
    is warned, once, and keeps it."""
    global _told
    value = os.environ.get(NCCL_GRAPH_REGISTER)
    if value is None:
        os.environ[NCCL_GRAPH_REGISTER] = "0"
        if not _told:
            _told = True
            logger.info("%s=0: graphs captured into vmm_core pools (which a sleep remaps) "
                        "must not keep NCCL registrations of their buffers",
                        NCCL_GRAPH_REGISTER)
    elif value.strip() not in ("0", "") and not _told:
        _told = True
        warnings.warn(f"{NCCL_GRAPH_REGISTER}={value}: collectives captured into a "
                      f"vmm_core graph pool keep NCCL registrations of pages that a sleep "
                      f"releases and a wake remaps, and their replays can hang; unset it "
                      f"(vmm_core then sets 0) or set 0 when graphs with collectives sleep",
                      RuntimeWarning, stacklevel=outside_stacklevel())


class CudaGraphOps(TorchStreamGraphOps):
    device_type = "cuda"
    graph_class = "CUDAGraph"

    def module(self):
        import torch

        return torch.cuda

    def capture_kwargs(self) -> dict:
        graph_registration_off()  # both capture paths ask for these first
        return super().capture_kwargs()

    def capture(self, graph, fn, pool_handle):
        import torch

        with torch.cuda.device(self.device):
            return super().capture(graph, fn, pool_handle)

    def prepare_capture_stream(self, stream=None):
        import torch

        from .allocator_adapter import prime_library_workspaces

        if stream is None:
            stream = torch.cuda.graph.default_capture_stream
            if stream is None:  # made as torch.cuda.graph makes it: one for the process
                stream = torch.cuda.graph.default_capture_stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            prime_library_workspaces(self.device)
        return stream

    def non_owning_view(self, address: int, nbytes: int):
        """Through ``__cuda_array_interface__``, which torch wraps without taking
        ownership (vLLM's ``weak_ref_tensors`` makes the same view in C++)."""
        import torch

        class _Memory:
            __cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1",
                                        "data": (address, False), "version": 3}

        return torch.as_tensor(_Memory(), device=torch.device("cuda", self.device))

    def executables(self):
        if getattr(self, "_executables", None) is None:
            from .graph_exec import GraphExecutables

            self._executables = GraphExecutables(self.device)
        return self._executables

    def kept_graph(self):
        from .kept_graph import kept_graph_class

        return kept_graph_class()()

    def record_stream_reuse(self, enabled: bool):
        if not enabled:
            return contextlib.nullcontext()
        version = installed_version("torch")
        if version_tuple(version) < (2, 9):
            raise CaptureError(f"graph_capture_record_stream_reuse needs torch>=2.9, found "
                               f"{version}; drop record_stream_reuse=True")
        return _alloc_setting("graph_capture_record_stream_reuse", True)


@contextlib.contextmanager
def _alloc_setting(key: str, value: bool):
    """Set a boolean caching-allocator option for one capture, then give the key the
    user's own value back (:mod:`.alloc_settings` keeps the user's other options and
    what other holders hold)."""
    from .alloc_settings import hold, user_sets

    user_value = (user_sets(key) or "").lower() == "true"
    release = hold(key, str(bool(value)), restore=str(user_value))
    try:
        yield
    finally:
        release()

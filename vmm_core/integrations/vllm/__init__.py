"""vLLM's sleep mode on vmm_core: ``--enable-sleep-mode --sleep-mode-backend vmm``.

vLLM calls every ``vllm.general_plugins`` entry point once per process; vmm_core's
(``pyproject.toml``) is :func:`register`, which

1. registers the ``vmm`` sleep-mode backend in vLLM's ``SleepModeBackendFactory``
   (:mod:`.backend`: vLLM's levels, :class:`~.allocator.VmmSleepMode`, on vLLM's base);
2. installs the one hook that decides, per process, whether vLLM's allocator lookups are
   answered by vmm_core (:mod:`.patches`, whose docstring says what is patched, why, and
   when): at the construction of the first worker, whose configuration says which
   backend is selected.  With ``vmm`` the worker then allocates its workspace, weights,
   KV cache and runtime memory through :class:`~.allocator.VmmMemAllocator`, and under
   ``--sleep-mode-offload-cudagraph`` captures its graphs into that allocator's graph
   pool; with any other backend vLLM is left exactly as it was.

The hook cannot decide earlier: it runs in the API server and the engine core before a
configuration exists, and in a worker it is not handed the configuration.  Nothing is
patched by ``import vmm_core``, nor by importing this package; the allocator and the
levels import without vLLM, so that a benchmark can drive them directly.

The plugin's memory lives under vmm_core tags ``vllm:<tag>`` (``vllm:weights``,
``vllm:kv_cache``, ``vllm:runtime``, ``vllm:workspace``, ``vllm:cudagraph``), apart from
a user's own tags: :func:`vmm_tags`.
"""

from __future__ import annotations

from .allocator import (
    BACKEND_NAME,
    DEFERRABLE_TAGS,
    OFFLOADED_AT_EVERY_LEVEL,
    TAG_PREFIX,
    VmmMemAllocator,
    VmmSleepMode,
    deferrable_tags,
    vmm_tags,
)

# VmmSleepModeBackend is here too, built on first access (it needs vLLM's base class)
__all__ = ["BACKEND_NAME", "DEFERRABLE_TAGS", "OFFLOADED_AT_EVERY_LEVEL", "TAG_PREFIX",
           "VmmMemAllocator", "VmmSleepMode", "deferrable_tags", "register", "vmm_tags"]


def __getattr__(name: str):
    # built on first use: vLLM's base class is imported only where vLLM is installed
    if name == "VmmSleepModeBackend":
        from .backend import backend_class

        return backend_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def register() -> None:
    """The ``vllm.general_plugins`` entry point: register the ``vmm`` backend and the
    hook that routes the worker's allocations when it is selected.  vLLM may call it more
    than once per process; a second call changes nothing."""
    from .backend import register_backend
    from .patches import install_trigger

    if register_backend():
        install_trigger()

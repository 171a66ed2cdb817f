"""vmm_core: keep the memory of many captured device graphs at max(shape), not sum(shape).

Importing this package never imports a vendor framework or loads a driver library;
backends are discovered through the ``vmm_core.backends`` entry-point group and probed
on first use.
"""

from __future__ import annotations

# A backend author's names live in vmm_core.plugin; the few below resolve here too, out
# of __all__, for code that imports them from vmm_core.  They are imported from their
# homes: the plugin module gathers the role bases too, and loads with the first backend,
# not with vmm_core.
from . import errors
from .backend import Backend as Backend
from .capabilities import BackendCapabilities as BackendCapabilities
from .capabilities import Probe as Probe
from .errors import *  # noqa: F401,F403  (the hierarchy is part of the public API)
from .hookspecs import hookimpl as hookimpl
from .hookspecs import hookspec as hookspec
from .memory.allocator import SharedVMMAllocator
from .registry import ENTRY_POINT_GROUP as ENTRY_POINT_GROUP
from .registry import ENV_BACKEND, default_registry

__version__ = "0.1.0"

__all__ = [
    # what an engine or an RL framework calls: backends, the allocator, graph pools and
    # the executor, non-owning views of graph outputs, tagged memory and its sleep/wake
    "available_backends",
    "get_backend",
    "select_backend",
    "ENV_BACKEND",
    "info",
    "SharedVMMAllocator",
    "GraphPool",
    "GraphExecutor",
    "ExecutablePolicy",
    "weak_ref_tensors",
    "region",
    "sleep",
    "wake_up",
    "memory_summary",
    "allocators",
    "hold_awake",
    "outside_regions",
    "tags_on",
    # the one exception hierarchy (vmm_core.errors)
    *errors.__all__,
]
# The public submodules, each with its own __all__ (docs/api.md): vmm_core.offload (how a
# sleep copies to the host, and its settings), vmm_core.distributed (memory over the ranks
# of a group), vmm_core.integrations.torch_memory_saver and .vllm (the drop-ins),
# vmm_core.plugin (the vendor contract), vmm_core.testing (its contract suite),
# vmm_core.cli (the frame of `vmm-core` commands other packages register) and
# vmm_core.errors.  Every other module is the implementation: its names may change.


def available_backends() -> list[str]:
    """Names of the backends usable on this machine, best first (e.g. ``["host"]``)."""
    return default_registry().available()


def select_backend(name: str | None = None):
    """Like :func:`get_backend` but also returns why that backend was chosen."""
    return default_registry().select(name)


def get_backend(name: str | None = None) -> Backend:
    """The backend called ``name``; by default ${VMM_CORE_BACKEND}, else auto-detected.

    Auto-detection prefers accelerators; with none present it returns ``host``.  Raises
    :class:`BackendNotFoundError` (listing the choices), :class:`BackendUnavailableError`
    (saying what is missing) or :class:`AmbiguousBackendError`.
    """
    return default_registry().select(name).backend


def info(file=None) -> None:
    """Print what ``vmm-core info`` prints, plus this process's tagged memory per tag
    (device and host bytes, spaces, handles, asleep)."""
    from .report import info as _info

    _info(file)


def sleep(tags=None, offload=(), group=None, **options) -> None:
    """Release the physical memory of ``tags`` (default: all), keeping their addresses;
    tags in ``offload`` are copied to host first and come back on :func:`wake_up`.

    With a ``torch.distributed`` ``group`` every rank sleeps or none does, and
    ``communicators=True`` releases the group's communicators' memory too, until the
    group wake.  The group variant lives in :mod:`vmm_core.distributed` and the local one
    in :mod:`vmm_core.memory.tagged`; choosing here keeps the single-process layer free
    of any import of the multi-process one.
    """
    if group is not None:
        from .distributed import collective

        return collective.sleep(group, tags, offload, **options)
    if options.pop("communicators", False):  # False without a group: nothing to release
        from .errors import VMMError

        raise VMMError("vmm_core.sleep: communicators= releases the memory of a group's "
                       "communicators, which only a group sleep can do: pass group=")
    from .memory import tagged

    return tagged.sleep(tags, offload, **options)


def wake_up(tags=None, keep_host_buffers: bool | None = None, group=None,
            eager: bool = False, **options) -> None:
    """Re-create the physical memory of ``tags`` (default: all) at the same addresses,
    copying offloaded bytes back (``zero=True`` fills discarded memory with zeros).

    Host copies stay (pinned) for the next sleep unless ``keep_host_buffers=False`` or
    the tag's policy says otherwise (:func:`vmm_core.offload.set_keep_host_buffers`).
    Graph executables a GraphPool released on sleep are made again by each graph's first
    replay, or those resident at the sleep before this returns with ``eager=True`` (or
    for a pool of ``ExecutablePolicy(eager_wake=True)``, whatever is passed here); one
    that cannot be made then is said in a VMMFallbackWarning and made at first replay.

    With a ``torch.distributed`` ``group`` every rank wakes or none does.
    """
    if group is not None:
        from .distributed import collective

        return collective.wake_up(group, tags, keep_host_buffers, eager=eager, **options)
    from .memory import tagged

    return tagged.wake_up(tags, keep_host_buffers=keep_host_buffers, eager=eager, **options)


def __getattr__(name):
    # Lazy: these pull in torch, which `import vmm_core` must not require up front.
    if name == "GraphExecutor":
        from .graphs.executor import GraphExecutor

        return GraphExecutor
    if name == "GraphPool":
        from .graphs.pool import GraphPool

        return GraphPool
    if name == "weak_ref_tensors":
        from .graphs.views import weak_ref_tensors

        return weak_ref_tensors
    if name == "ExecutablePolicy":
        from .graphs.executables import ExecutablePolicy

        return ExecutablePolicy
    if name in ("region", "memory_summary", "allocators", "hold_awake", "outside_regions",
                "tags_on"):
        from .memory import tagged

        return getattr(tagged, name)
    if name in ("distributed", "offload", "plugin"):
        import importlib

        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'vmm_core' has no attribute {name!r}")

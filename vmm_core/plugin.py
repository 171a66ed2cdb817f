"""The whole vendor contract: a backend imports this module and :mod:`vmm_core.errors`,
and nothing else of vmm_core.

Core's own modules are free to move; the names here are what a backend (the built-in
ones included) may rely on, so a vendor package keeps working across vmm_core releases.

**The plugin object.**  One object (a module-level instance) whose methods carry
:data:`hookimpl` and the hook names of :mod:`vmm_core.hookspecs`, which documents every
hook and the vocabulary they share.  Register it in your distribution under
:data:`ENTRY_POINT_GROUP`, as the built-in backends are::

    [project.entry-points."vmm_core.backends"]
    myvendor = "myvendor_vmm.vmm_api:backend"

:data:`REQUIRED_HOOKS` must be there (probe, capabilities, reserve / release a range,
create / release a handle, map, set access, unmap, synchronize, the two host copies); a
plugin missing one, or with a misspelled hook, is skipped with a ``VMMPluginWarning``
naming it.  Give the object no properties that do work: pluggy reads every attribute
when it registers a plugin.

**Detection.**  ``vmm_probe`` returns a :class:`Probe`: cheap (ctypes on the driver
library, no vendor framework imported), never raising, with a reason that says what is
missing and how to install it; ``library`` is the driver library it loaded and
``versions`` maps a component to its version.  A driver library's path is overridden by
the variable :func:`library_env` names (``VMM_CORE_<NAME>_LIB``).

**Capabilities.**  ``vmm_capabilities`` returns :class:`BackendCapabilities`: how your
primitives differ (granularity, whole-handle maps, access per mapping, pools usable during
capture, asynchronous copies, shareable handles as one of :data:`SHAREABLE_HANDLE_KINDS`,
peer access, ...).  Core reads these and never asks which vendor it runs on.

**Roles** (optional hooks, each returning an object of a base below):

* ``vmm_allocator_adapter`` -> :class:`AllocatorAdapter`: framework memory pools whose
  segments come from vmm_core.  A pluggable allocator loads the C shim
  (:func:`load_shim`, :data:`ALLOC_SYMBOL`, :data:`FREE_SYMBOL`; keep it with
  :func:`keep_for_process_life`); a framework that cannot be redirected finds the
  allocator a pool is for with :func:`routed_allocator`.  Core asks once per device and
  keeps the adapter.
* ``vmm_graph_ops`` -> :class:`GraphOps` (for a ``torch.cuda``-shaped device module,
  :class:`TorchStreamGraphOps`: name the module and the graph class).  A new object per
  call.  A framework that keeps a captured graph apart from its executable also returns
  :class:`Executables` from ``GraphOps.executables()``, and its kept graph class puts
  :class:`KeptGraphMixin` first in its bases.  ``GraphOps.non_owning_view`` makes the
  tensors :func:`vmm_core.weak_ref_tensors` returns (a framework whose public way in is
  ``from_dlpack`` hands it a capsule of :func:`dlpack_bytes`); without one it refuses.
* ``vmm_copy_queue`` -> :class:`CopyQueue`: ordered copies and markers for offload.  A
  new queue per call; core closes it.

The other optional hooks (device copies, memset, pinned host buffers, sharing handles
between processes, host registration, torch views through :func:`raw_tensor`) are plain
functions; core falls back or refuses with a clear error without them.

**Sizes and errors.**  Every byte count reaching a hook is an ``int`` from 0 to
:data:`MAX_BYTES` (core checks it before your hook runs); zero and granularity multiples
are yours to refuse (:func:`byte_count`).  Raise the exceptions of
:mod:`vmm_core.errors` with the vendor call, its code and the remedy in the message; any
other exception reaches users as ``BackendError`` naming your backend and the hook.
Gate features on framework versions with :func:`installed_version` and
:func:`version_tuple`, which import nothing.

**Fork.**  A lock that another thread holds at ``os.fork()`` stays held in the child,
which has only the forking thread.  A backend whose objects keep locks (or threads)
renews them there with ``at_fork("backends", after_in_child=fn)`` (:func:`at_fork`;
core runs every module's fork callbacks in one declared order of stages).

**Captures of your own.**  A capture a backend makes outside every capture space (a
probe of what the framework writes into a graph) runs inside :func:`backend_capture`:
a GraphPool's teardown, a sleep or a wake on another thread synchronizes the device,
which breaks a capture underway, and that context keeps them apart.

**Proof.**  Star-import :mod:`vmm_core.testing.contract` into a ``test_*.py`` module
with a ``vmm_backend`` fixture (:mod:`vmm_core.testing` shows the file): it checks the
primitives, the allocator, sleep and offload, sharing, and the roles above.
"""

from __future__ import annotations

from .backend import Backend
from .capabilities import SHAREABLE_HANDLE_KINDS, BackendCapabilities, Probe, library_env
from .forksafe import at_fork
from .graphs.graph_ops import Executables, GraphOps
from .graphs.kept_graphs import KeptGraphMixin, watch_operators
from .graphs.torch_graph_ops import TorchStreamGraphOps
from .graphs.views import dlpack_bytes
from .hookspecs import REQUIRED_HOOKS, hookimpl, hookspec
from .memory.adapter import AllocatorAdapter
from .memory.copy_queue import CopyQueue
from .memory.routing import current_target as routed_allocator
from .memory.shim import ALLOC_SYMBOL, FREE_SYMBOL, Shim, keep_for_process_life, load_shim
from .memory.tag_state import backend_capture
from .memory.torch_views import raw_tensor
from .registry import ENTRY_POINT_GROUP
from .sizes import MAX_BYTES, byte_count
from .versions import installed_version, version_tuple

__all__ = [
    # the hooks and how a plugin is found
    "hookimpl", "hookspec", "REQUIRED_HOOKS", "ENTRY_POINT_GROUP",
    # what detection returns
    "Probe", "BackendCapabilities", "SHAREABLE_HANDLE_KINDS", "library_env",
    # the roles a backend fills
    "AllocatorAdapter", "CopyQueue", "GraphOps", "TorchStreamGraphOps", "Executables",
    "KeptGraphMixin",
    # what the roles use
    "watch_operators",
    "load_shim", "Shim", "ALLOC_SYMBOL", "FREE_SYMBOL", "keep_for_process_life",
    "routed_allocator", "raw_tensor", "dlpack_bytes", "MAX_BYTES", "byte_count",
    "installed_version", "version_tuple", "backend_capture",
    # what a forked child renews
    "at_fork",
    # core's view of a registered backend (what the contract suite drives)
    "Backend",
]

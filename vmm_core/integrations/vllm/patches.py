"""Where vLLM asks for its allocator, answered by vmm_core when ``vmm`` is selected.

vLLM 0.33 offers a sleep-mode backend no way to provide the allocator the worker
allocates through, nor to receive graph captures (read in its released wheel):

* ``vllm/device_allocator/__init__.py`` ``get_mem_allocator_instance()`` returns
  ``CuMemAllocator`` on CUDA whatever backend is selected; ``v1/worker/gpu_worker.py``,
  ``compilation/cudagraph_pool.py`` and ``v1/worker/lora_model_runner_mixin.py`` import
  it by name (:data:`ALLOCATOR_LOOKUPS`).  The worker's
  ``Worker._maybe_get_memory_pool_context`` (workspace, weights, KV cache, runtime), the
  LoRA mixin's ``load_lora_model`` (runtime) and ``cudagraph_pool.capture_pool`` ask it.
* ``config/vllm.py`` ``VllmConfig.use_cumem_cudagraph_pool`` routes captures to the
  allocator's ``cudagraph_pool()`` (``capture_pool``), turns IPC registration of graph
  buffers off (``distributed/device_communicators/cuda_communicator.py``
  ``CudaCommunicator.__init__``) and sets ``NCCL_GRAPH_REGISTER=0``
  (``VllmConfig.__post_init__``), only for the backend named ``"cumem"``.

So, with ``vmm`` selected, this module rebinds ``get_mem_allocator_instance`` in those
modules to :class:`~.allocator.VmmMemAllocator` and makes ``use_cumem_cudagraph_pool``
also true for ``vmm`` under ``--sleep-mode-offload-cudagraph`` (vLLM's conditions, with
vmm_core's backend in place of the CUDA platform check), and sets
``NCCL_GRAPH_REGISTER=0`` as vLLM does for ``cumem`` (a value the user set is kept,
with vLLM's warning).  Nothing else of vLLM changes.

**When.**  The plugin hook runs before any configuration exists in some processes (the
API server's, the engine core's) and inside a worker's start, where the configuration
is not handed to it.  The first moment every worker sees its configuration, before it
allocates anything, is the construction of its worker (``WorkerBase.__init__``, under
``set_current_vllm_config``; ``v1/worker/worker_base.py`` ``init_worker``).  The hook
therefore wraps that one constructor (:func:`install_trigger`); the wrapper reads
``model_config.sleep_mode_backend`` of the first worker built in the process:

* ``vmm`` with ``--enable-sleep-mode``: the patches above are made, on the vLLM versions
  tested (:data:`TESTED_VERSIONS`); on any other the worker's start fails with
  :class:`~vmm_core.errors.VMMError` naming them.  The wrapper stays, and refuses a
  later worker of the process that selects another backend.
* anything else: the wrapper puts vLLM's constructor back and does nothing more; vLLM
  is then exactly as it was (the test suite checks every object by identity).

A process that never builds a worker (the API server's) keeps the unused wrapper.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import threading

from ... import forksafe
from ...errors import VMMError
from .allocator import BACKEND_NAME, VmmMemAllocator, VmmSleepMode

__all__ = ["TESTED_VERSIONS", "ALLOCATOR_LOOKUPS", "install_trigger", "restore", "state",
           "offloads_graphs", "vllm_version"]

logger = logging.getLogger("vmm_core")

#: vLLM releases these patches were tested against (their released wheels)
TESTED_VERSIONS = ("0.33.0",)
#: modules of vLLM 0.33.0 that look up ``get_mem_allocator_instance`` by name at call
#: time (its definition first: modules imported later bind what is there then)
ALLOCATOR_LOOKUPS = ("vllm.device_allocator", "vllm.v1.worker.gpu_worker",
                     "vllm.compilation.cudagraph_pool",
                     "vllm.v1.worker.lora_model_runner_mixin")
LOOKUP = "get_mem_allocator_instance"
GRAPH_POOL_PROPERTY = "use_cumem_cudagraph_pool"
NCCL_GRAPH_REGISTER = "NCCL_GRAPH_REGISTER"

_lock = threading.RLock()
_saved: list[tuple[object, str, object]] = []  # (owner, attribute, vLLM's object)
_trigger = None  # the WorkerBase.__init__ wrapper while installed
_selected: str | None = None  # what the first worker selected ("vmm", "cumem", "off")
_nccl_set = False  # NCCL_GRAPH_REGISTER was set here (restore() takes it back)


def _fresh_lock_after_fork() -> None:
    """A thread the child does not have may have held the lock (a worker being built
    on another thread at the fork): the child's first worker would hang."""
    global _lock
    if not _lock._is_owned():  # type: ignore[attr-defined]  # CPython's RLock has it
        _lock = threading.RLock()


forksafe.at_fork("integrations", after_in_child=_fresh_lock_after_fork)


def vllm_version() -> str | None:
    """The installed vLLM's version (its distribution metadata)."""
    from ...versions import installed_version

    return installed_version("vllm")


def get_mem_allocator_instance() -> VmmMemAllocator:
    """vmm_core's ``MemAllocator``: what vLLM asks for while ``vmm`` is selected."""
    return VmmMemAllocator.get_instance()


def offloads_graphs(config) -> bool:
    """``VllmConfig.use_cumem_cudagraph_pool``'s conditions for the ``vmm`` backend:
    ``--sleep-mode-offload-cudagraph`` with sleep mode on and graphs captured, where
    vmm_core has a backend (vLLM asks for a CUDA platform, which ``CuMemAllocator``
    needs)."""
    from vllm.config import CUDAGraphMode

    model = getattr(config, "model_config", None)
    return bool(model is not None and model.sleep_mode_offload_cudagraph
                and model.enable_sleep_mode and model.sleep_mode_backend == BACKEND_NAME
                and config.compilation_config.cudagraph_mode != CUDAGraphMode.NONE
                and VmmSleepMode.is_supported())


def state() -> dict:
    """What is patched now: ``selected`` (what the first worker selected; None before
    it), ``trigger`` (the constructor wrapper is installed) and ``patched``
    (``module.attribute`` names replaced, the trigger's included)."""
    with _lock:
        return {"selected": _selected, "trigger": _trigger is not None,
                "patched": [f"{getattr(owner, '__name__', owner)}.{name}"
                            for owner, name, _ in _saved]}


# ---------------------------------------------------------------- the trigger
def install_trigger() -> bool:
    """Wrap ``WorkerBase.__init__`` so that the first worker's configuration decides
    (the module's docstring says why there); False where this vLLM has no such class.
    Nothing happens once a worker of this process decided."""
    global _trigger
    with _lock:
        if _trigger is not None or _selected is not None:
            return True
        try:
            from vllm.v1.worker.worker_base import WorkerBase
        except ImportError as exc:
            logger.warning("vmm_core's vLLM plugin: vllm.v1.worker.worker_base cannot be "
                           "imported (%s); --sleep-mode-backend %s cannot route this "
                           "vLLM's allocations", exc, BACKEND_NAME)
            return False
        original = WorkerBase.__dict__["__init__"]

        @functools.wraps(original)
        def __init__(self, *args, **kwargs):
            config = kwargs.get("vllm_config", args[0] if args else None)
            _select(config)
            original(self, *args, **kwargs)

        _set(WorkerBase, "__init__", __init__)
        _trigger = __init__
        return True


def _selection(config) -> str:
    model = getattr(config, "model_config", None)
    if model is None or not getattr(model, "enable_sleep_mode", False):
        return "off"
    return str(getattr(model, "sleep_mode_backend", "cumem"))


def _select(config) -> None:
    global _selected
    name = _selection(config)
    with _lock:
        if _selected is None:
            if name != BACKEND_NAME:
                _undo()  # vLLM exactly as it was
                _selected = name
                return
            _check_version()
            _apply(config)
            _selected = name
        elif name != _selected:
            raise VMMError(
                f"this process built a vLLM worker with sleep-mode backend {_selected!r} "
                f"and now one with {name!r}: vmm_core routes the allocator of the whole "
                f"process, so one process serves one choice. Start the second engine in "
                f"a process of its own")


def _check_version() -> None:
    version = vllm_version()
    if version not in TESTED_VERSIONS:
        raise VMMError(
            f"--sleep-mode-backend {BACKEND_NAME}: vmm_core's vLLM plugin was tested with "
            f"vLLM {', '.join(TESTED_VERSIONS)}, and this is vLLM {version}. It replaces "
            f"what vLLM asks for its allocator where those releases ask "
            f"({', '.join(ALLOCATOR_LOOKUPS)}: {LOOKUP}; VllmConfig.{GRAPH_POOL_PROPERTY}), "
            f"which another release may ask elsewhere, leaving memory vmm_core cannot put "
            f"to sleep. Install vllm=={TESTED_VERSIONS[-1]}, or use --sleep-mode-backend "
            f"cumem")


# ---------------------------------------------------------------- the patches
def _set(owner, name: str, value) -> None:
    _saved.append((owner, name, owner.__dict__[name]))
    setattr(owner, name, value)


def _apply(config) -> None:
    global _nccl_set
    import vllm.device_allocator  # noqa: F401  (its definition, for later imports)
    from vllm.config import VllmConfig

    theirs = sys.modules[ALLOCATOR_LOOKUPS[0]].__dict__[LOOKUP]
    # modules imported later bind ours from vllm.device_allocator, the first one
    modules = [sys.modules[m] for m in ALLOCATOR_LOOKUPS if m in sys.modules]
    for module in modules:  # all checked before anything changes
        bound = module.__dict__.get(LOOKUP)
        if bound is not theirs:
            raise VMMError(f"{module.__name__}.{LOOKUP} is {bound!r}, not vLLM's: another "
                           f"plugin replaced it; vmm_core will not replace it again")
    for module in modules:
        _set(module, LOOKUP, get_mem_allocator_instance)
    cumem_only = VllmConfig.__dict__[GRAPH_POOL_PROPERTY]

    def use_cumem_cudagraph_pool(self) -> bool:
        return bool(cumem_only.fget(self)) or offloads_graphs(self)

    _set(VllmConfig, GRAPH_POOL_PROPERTY,
         property(use_cumem_cudagraph_pool, doc=cumem_only.__doc__))
    if offloads_graphs(config):
        # vLLM's reason (config/vllm.py, __post_init__): NCCL graph registration pins
        # the pages of the graph pool that a sleep releases
        _nccl_set = NCCL_GRAPH_REGISTER not in os.environ
        value = os.environ.setdefault(NCCL_GRAPH_REGISTER, "0")
        if value != "0":
            logger.warning("%s=%s pins the CUDA graph pool during sleep.",
                           NCCL_GRAPH_REGISTER, value)
    logger.info("vmm_core's vLLM plugin: the worker allocates through vmm_core (%s)",
                ", ".join(f"{getattr(o, '__name__', o)}.{n}" for o, n, _ in _saved))


def _undo() -> None:
    """Put every object back (in reverse order), and the allocator lookup of modules
    imported after the patch, which bound ours from ``vllm.device_allocator``."""
    global _trigger, _nccl_set
    theirs = None
    while _saved:
        owner, name, original = _saved.pop()
        setattr(owner, name, original)
        if name == LOOKUP:
            theirs = original
    if theirs is not None:
        for module_name in ALLOCATOR_LOOKUPS:
            module = sys.modules.get(module_name)
            if module is not None and module.__dict__.get(LOOKUP) is get_mem_allocator_instance:
                setattr(module, LOOKUP, theirs)
    _trigger = None
    if _nccl_set:
        os.environ.pop(NCCL_GRAPH_REGISTER, None)
        _nccl_set = False


def restore() -> None:
    """Undo everything this module did to vLLM in this process (the trigger included)
    and forget the first worker's choice: the next :func:`install_trigger` starts over.
    Memory already allocated through vmm_core stays where it is."""
    global _selected
    with _lock:
        _undo()
        _selected = None

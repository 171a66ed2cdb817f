"""torch_memory_saver 0.0.10's Python API, served by vmm_core: change one import line.

    from torch_memory_saver import torch_memory_saver                        # before
    from vmm_core.integrations.torch_memory_saver import torch_memory_saver  # after

The same names, defaults and semantics: one global ``torch_memory_saver`` object of
class :class:`TorchMemorySaver`, ``region`` / ``cuda_graph`` / ``disable`` blocks,
``pause(tag=None)`` / ``resume(tag=None)`` (None: every tag), CPU and disk backups per
region, nested regions, ``get_cpu_backup``, ``retain_cpu_backup`` (off unless set),
``memory_margin_bytes``, ``set_disk_backup_dir``, and its variables (``TMS_INIT_ENABLE``:
the whole process in the default region, ``TMS_RETAIN_CPU_BACKUP``, the disk backup's).
What differs, and why, is listed in docs/integrations.md; in short: errors are raised
(vmm_core's hierarchy, with the remedy) where torch_memory_saver exits the process; it
runs on every vmm_core backend; graph memory captured with ``cuda_graph`` keeps its live
blocks through a pause (what replays read) and gives back the rest.

For code that cannot be edited, an opt-in alias makes ``import torch_memory_saver``
resolve here (:mod:`.alias`): the directory ``python -m
vmm_core.integrations.torch_memory_saver`` prints first on PYTHONPATH, :func:`install`
before anything imports torch_memory_saver, or the preload library beside it in
``LD_PRELOAD`` (what RL launchers do).

The modules, by concern: :mod:`.saver` (the class), :mod:`.pausing` (pause, resume,
backups), :mod:`.captures` (``cuda_graph``), :mod:`.process_mode` (``TMS_INIT_ENABLE``),
:mod:`.settings` (variables and process-wide settings), :mod:`.state` (the shared state),
:mod:`.private_api` (``_impl`` and the C symbols callers reach), :mod:`.alias`.
"""

from __future__ import annotations

from .alias import alias_path, configure_subprocess, install, preload_path
from .saver import CpuBackupBackend, HookMode, TorchMemorySaver
from .state import vmm_tags

__all__ = ["TorchMemorySaver", "torch_memory_saver", "configure_subprocess", "alias_path",
           "preload_path", "install", "vmm_tags", "CpuBackupBackend", "HookMode"]

#: the global object, as torch_memory_saver's ``torch_memory_saver``
torch_memory_saver = TorchMemorySaver()

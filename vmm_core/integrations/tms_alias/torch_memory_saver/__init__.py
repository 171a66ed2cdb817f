"""``import torch_memory_saver`` resolved to vmm_core's compatible module (opt-in).

This package is found only when its parent directory is on ``sys.path`` ahead of the
real torch_memory_saver: ``vmm_core.integrations.torch_memory_saver.install()`` puts it
there, or the user does (``PYTHONPATH``).  Everything is the compatible module's.
"""

from vmm_core.integrations.torch_memory_saver import (  # noqa: F401
    CpuBackupBackend,
    HookMode,
    TorchMemorySaver,
    configure_subprocess,
    torch_memory_saver,
)

__vmm_core_alias__ = True

"""``import torch_memory_saver`` resolved to vmm_core's compatible package (opt-in).

This package is found only when its parent directory is on ``sys.path`` ahead of the
real torch_memory_saver: ``vmm_core.integrations.torch_memory_saver.install()`` puts it
there, or the user does (``PYTHONPATH``), or the preload library beside it does
(``LD_PRELOAD``).  Everything is the compatible package's.
"""

from vmm_core.integrations.torch_memory_saver import (  # noqa: F401
    CpuBackupBackend,
    HookMode,
    TorchMemorySaver,
    configure_subprocess,
    torch_memory_saver,
)
from vmm_core.integrations.torch_memory_saver import process_mode as _process_mode
from vmm_core.integrations.torch_memory_saver.private_api import (
    install_preload_callbacks as _install_preload_callbacks,
)

__vmm_core_alias__ = True

_process_mode.arm()  # TMS_INIT_ENABLE: route the process before its first allocation
_install_preload_callbacks(torch_memory_saver)

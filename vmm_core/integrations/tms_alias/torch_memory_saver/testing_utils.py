"""The helpers torch_memory_saver's example programs import from
``torch_memory_saver.testing_utils``, so that they run unchanged through the alias."""

from __future__ import annotations

from .utils import is_xpu  # noqa: F401  (its tests import it from here)


def get_device() -> str:
    """The torch device type of the examples: "cuda"."""
    return "cuda"


def empty_cache() -> None:
    import torch

    torch.cuda.empty_cache()


def get_and_print_gpu_memory(message: str, gpu_id: int = 0) -> int:
    """Device memory in use on ``gpu_id`` (by every process, as the driver reports it),
    printed with ``message`` and returned in bytes."""
    import torch

    try:
        mem = int(torch.cuda.device_memory_used(gpu_id))  # NVML: needs nvidia-ml-py
    except Exception:  # noqa: BLE001 - the driver's free memory says the same
        free, total = torch.cuda.mem_get_info(gpu_id)
        mem = int(total - free)
    print(f"GPU {gpu_id} memory: {mem / 1024 ** 3:.2f} GB ({message})")
    return mem

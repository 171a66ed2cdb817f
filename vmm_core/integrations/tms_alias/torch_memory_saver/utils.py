"""torch_memory_saver's ``utils`` helpers that callers use: where the preload library is
(``get_binary_path_from_package``, which newer RL launchers call) and ``change_env``."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

__all__ = ["get_binary_path_from_package", "change_env", "is_xpu"]


def is_xpu() -> bool:
    """False: vmm_core has no XPU backend."""
    return False


def get_binary_path_from_package(stem: str) -> Path:
    """The library named ``stem`` beside this package: vmm_core ships one build of
    ``torch_memory_saver_hook_mode_preload`` for every CUDA major (it links no CUDA).
    ``torch_memory_saver_hook_mode_torch`` has no counterpart: vmm_core's own allocator
    serves regions in every hook mode."""
    directory = Path(__file__).resolve().parent.parent
    candidates = sorted(directory.glob(f"{stem}.*.so"))
    if len(candidates) != 1:
        raise RuntimeError(
            f"torch_memory_saver (vmm_core): expected one library matching {stem!r}.*.so "
            f"in {directory}, found {[c.name for c in candidates]}; vmm_core ships "
            f"torch_memory_saver_hook_mode_preload only (reinstall vmm_core with pip if it "
            f"is missing)")
    return candidates[0]


@contextlib.contextmanager
def change_env(key: str, value: str):
    """Set an environment variable for the block, then put back what was there."""
    old = os.environ.get(key)
    os.environ[key] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = old

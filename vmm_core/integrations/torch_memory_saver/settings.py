"""torch_memory_saver's process-wide settings: its environment variables, read once (as
its library reads them when it loads), and what its setters change for every instance.

| variable | default | meaning |
|---|---|---|
| ``TMS_INIT_ENABLE`` | off | every allocation of the process in the default region |
| ``TMS_INIT_ENABLE_CPU_BACKUP`` | off | that region backed up to host memory |
| ``TMS_INIT_CPU_BACKUP_BACKEND`` | ``pinned`` | the backup backend regions use when not told |
| ``TMS_INIT_ENABLE_DISK_BACKUP`` | off | that region backed up to disk |
| ``TMS_RETAIN_CPU_BACKUP`` | off | resume keeps host copies for the next pause |
| ``TMS_DISK_BACKUP_DIR`` | ``/tmp`` | where disk backups go (``set_disk_backup_dir``) |
| ``TMS_DISK_BACKUP_CHUNK_MB`` | 256 | the staging chunk of disk backups |
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass

from ...errors import VMMError

__all__ = ["Settings", "settings", "bool_env", "retain", "set_retain", "disk_dir",
           "set_disk_dir", "check_backup_args", "CPU_BACKUP_BACKENDS"]

CPU_BACKUP_BACKENDS = ("pinned", "mmap")
_TRUE = ("1", "true", "TRUE", "yes", "YES")
_FALSE = ("0", "false", "FALSE", "no", "NO")


def bool_env(name: str) -> bool | None:
    """torch_memory_saver's reading of a boolean variable (None: unset)."""
    value = os.environ.get(name)
    if value is None:
        return None
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise VMMError(f"{name}={value!r} is not a boolean; use 1/0, true/false or yes/no")


@dataclass(frozen=True)
class Settings:
    init_enable: bool
    init_cpu_backup: bool
    init_cpu_backup_backend: str
    init_disk_backup: bool
    chunk_bytes: int


_lock = threading.Lock()
_settings: Settings | None = None
_retain: bool | None = None  # None: TMS_RETAIN_CPU_BACKUP, else off
_disk_dir: str | None = None  # None: TMS_DISK_BACKUP_DIR, else /tmp


def _read() -> Settings:
    backend = os.environ.get("TMS_INIT_CPU_BACKUP_BACKEND") or "pinned"
    if backend not in CPU_BACKUP_BACKENDS:
        raise VMMError(f"TMS_INIT_CPU_BACKUP_BACKEND={backend!r}: use 'pinned' or 'mmap'")
    chunk = os.environ.get("TMS_DISK_BACKUP_CHUNK_MB")
    try:
        mb = int(chunk) if chunk else 256
    except ValueError:
        raise VMMError(f"TMS_DISK_BACKUP_CHUNK_MB={chunk!r} is not a whole number of "
                       f"MiB") from None
    cpu, disk = bool(bool_env("TMS_INIT_ENABLE_CPU_BACKUP")), \
        bool(bool_env("TMS_INIT_ENABLE_DISK_BACKUP"))
    if cpu and disk:
        raise VMMError("TMS_INIT_ENABLE_CPU_BACKUP and TMS_INIT_ENABLE_DISK_BACKUP are both "
                       "set; a region is backed up to host memory or to disk, not both")
    return Settings(init_enable=bool(bool_env("TMS_INIT_ENABLE")), init_cpu_backup=cpu,
                    init_cpu_backup_backend=backend, init_disk_backup=disk,
                    chunk_bytes=(mb if mb > 0 else 256) << 20)


def settings() -> Settings:
    """The variables, read at the first call of the process (a bad value raises then,
    and again at every call until it is fixed)."""
    global _settings, _retain
    with _lock:
        if _settings is None:
            read = _read()
            if _retain is None:
                _retain = bool(bool_env("TMS_RETAIN_CPU_BACKUP"))
            _settings = read
        return _settings


def retain() -> bool:
    settings()
    return bool(_retain)


def set_retain(value: bool) -> None:
    global _retain
    if not isinstance(value, bool):
        raise ValueError(f"retain_cpu_backup must be True or False, got {value!r}")
    settings()
    _retain = value


def disk_dir() -> str:
    return _disk_dir or os.environ.get("TMS_DISK_BACKUP_DIR") or "/tmp"


def set_disk_dir(path) -> None:
    """Where disk backups go from now on (created); None: ``TMS_DISK_BACKUP_DIR`` again."""
    global _disk_dir
    if path is None:
        _disk_dir = None
        return
    path = os.fsdecode(path)
    if not path:
        raise ValueError("set_disk_backup_dir: the path is empty")
    os.makedirs(path, exist_ok=True)
    _disk_dir = path


def check_backup_args(enable_cpu_backup, cpu_backup_backend, enable_disk_backup=False) -> None:
    for name, value in (("enable_cpu_backup", enable_cpu_backup),
                        ("enable_disk_backup", enable_disk_backup)):
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be True or False, got {value!r}")
    if enable_cpu_backup and enable_disk_backup:
        raise ValueError("enable_cpu_backup and enable_disk_backup are mutually exclusive")
    if cpu_backup_backend is None:
        return
    if not enable_cpu_backup:
        raise ValueError("cpu_backup_backend requires enable_cpu_backup=True")
    if cpu_backup_backend not in CPU_BACKUP_BACKENDS:
        raise ValueError(f"cpu_backup_backend must be 'mmap' or 'pinned', got "
                         f"{cpu_backup_backend!r}")


def reset() -> None:
    """Forget what was read and set (tests: a new process)."""
    global _settings, _retain, _disk_dir
    with _lock:
        _settings, _retain, _disk_dir = None, None, None

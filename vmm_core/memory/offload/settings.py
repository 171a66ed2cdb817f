"""How offload works, process-wide: the strategy, the sizes of the staging pipeline, and
what a wake does with a host copy.

One place for these choices so that every copy (a sleep's, a wake's, one made ahead of
time) reads the same settings, the benchmark can switch them per measurement
(:func:`configured`), and :func:`choose_strategy` is the only code that decides how a
backend's memory moves.  The settings are read at the start of each copy: a change never
reaches one in flight.
"""

from __future__ import annotations

import contextlib
import os
import threading
from dataclasses import dataclass, replace

from ... import forksafe
from ...errors import VMMError
from ...sizes import byte_count
from ..tag_state import tag_list

__all__ = ["STRATEGIES", "OffloadConfig", "config", "configure", "configured",
           "set_keep_host_buffers", "keeps_host_buffers", "choose_strategy"]

STRATEGIES = ("auto", "staged", "direct", "pinned")


@dataclass(frozen=True)
class OffloadConfig:
    """How offload moves bytes.  Defaults are the benchmark's choice (``vmm-core bench
    --sleep`` on a device measures chunk, slots and threads against them).

    strategy:         "auto" (by capability), "staged", "direct" or "pinned".
    chunk_bytes:      bytes per staging slot (one device copy each).
    slots:            staging slots in the ring (device copies in flight + host copies).
    threads:          host copy threads; 0 means min(8, CPUs).
    direct_threads:   > 1: the direct strategy's synchronous copies run on the copy
                      threads, several at once; 1: one after the other.
    hugepages:        advise transparent huge pages for pageable host copies.
    populate:         fault host copies in before copying (MADV_POPULATE_WRITE), instead
                      of letting the copy threads fault them.
    parallel_release: free large host copies from the copy threads (MADV_DONTNEED).
    keep_host_buffers: what ``wake_up`` does with a host copy when not told (and no
                      per-tag policy says otherwise): keep it for the next sleep.
    pin_kept:         register kept host copies with the backend (page-lock them), so
                      later rounds copy straight between device and host.
    """

    strategy: str = "auto"
    chunk_bytes: int = 32 << 20
    slots: int = 4
    threads: int = 0
    direct_threads: int = 1
    hugepages: bool = True
    populate: bool = False
    parallel_release: bool = True
    keep_host_buffers: bool = True
    pin_kept: bool = True

    def host_threads(self) -> int:
        return self.threads or max(1, min(8, os.cpu_count() or 1))


_lock = threading.Lock()  # a change of the settings, or of a tag's policy
_config = OffloadConfig()
_keep_by_tag: dict[str, bool] = {}


def config() -> OffloadConfig:
    return _config


def configure(**changes) -> OffloadConfig:
    """Change how offload works, process-wide; returns the previous configuration."""
    global _config
    new = replace(_config, **changes)
    if new.strategy not in STRATEGIES:
        raise ValueError(f"offload strategy {new.strategy!r} is not one of {STRATEGIES}")
    for name in ("hugepages", "populate", "parallel_release"):
        if not isinstance(getattr(new, name), bool):  # "no" would be true
            raise ValueError(f"offload {name} must be True or False, got "
                             f"{getattr(new, name)!r}")
    for name in ("chunk_bytes", "slots", "direct_threads", "threads"):
        if isinstance(getattr(new, name), bool):  # True would be 1
            raise ValueError(f"offload {name} must be an int, got {getattr(new, name)!r}")
    for name in ("chunk_bytes", "slots", "direct_threads"):
        if not isinstance(getattr(new, name), int) or getattr(new, name) < 1:
            raise ValueError(f"offload {name} must be a positive int, got "
                             f"{getattr(new, name)!r}")
    if new.slots < 2:
        raise ValueError("offload needs at least 2 staging slots (one copying in, one out)")
    byte_count("offload chunk_bytes * slots (the staging ring)", new.chunk_bytes * new.slots,
               error=ValueError, remedy="use smaller chunks or fewer slots")
    if not isinstance(new.threads, int) or new.threads < 0:
        raise ValueError(f"offload threads must be an int >= 0, got {new.threads!r}")
    for name in ("keep_host_buffers", "pin_kept"):
        if not isinstance(getattr(new, name), bool):
            raise ValueError(f"offload {name} must be True or False, got "
                             f"{getattr(new, name)!r}")
    with _lock:
        previous, _config = _config, new
    return previous


@contextlib.contextmanager
def configured(**changes):
    """``configure(**changes)`` for the duration of a block."""
    previous = configure(**changes)
    try:
        yield _config
    finally:
        configure(**{f: getattr(previous, f) for f in previous.__dataclass_fields__})


def set_keep_host_buffers(tags, keep: bool | None) -> None:
    """Per-tag policy for ``wake_up`` without ``keep_host_buffers``: True keeps the
    tag's host copy (pinned) for the next sleep, False gives it back at wake, None
    follows ``configure(keep_host_buffers=...)``.  For hosts that can spare pinned
    memory for the weights but not for, say, a large KV cache."""
    if keep is not None and not isinstance(keep, bool):
        raise ValueError(f"set_keep_host_buffers: keep must be True, False or None, got "
                         f"{keep!r}")
    if tags is None:  # no "every tag" here: a policy names its tags
        raise ValueError("set_keep_host_buffers: tags must be a tag name or a list of tag "
                         "names, got None")
    tags = tag_list(tags, "set_keep_host_buffers: tags")  # all checked before any is set
    with _lock:
        for tag in tags:
            if keep is None:
                _keep_by_tag.pop(tag, None)
            else:
                _keep_by_tag[tag] = keep


def keeps_host_buffers(tag: str | None) -> bool:
    """Whether a wake of ``tag`` keeps its host copy when the caller does not say."""
    keep = _keep_by_tag.get(tag) if tag is not None else None
    return _config.keep_host_buffers if keep is None else keep


def choose_strategy(backend, device: int, cfg: OffloadConfig | None = None) -> str:
    """The one place that decides how a backend's memory is offloaded."""
    cfg = cfg or _config
    has_queue = backend.implements("vmm_copy_queue")
    if cfg.strategy == "staged" and not has_queue:
        raise VMMError(f"offload strategy 'staged' needs the vmm_copy_queue hook, which "
                       f"backend {backend.name!r} does not implement; use 'direct'")
    if cfg.strategy != "auto":
        return cfg.strategy
    if has_queue and backend.capabilities(device).async_copies:
        return "staged"
    if backend.implements("vmm_host_buffer"):
        return "pinned"
    return "direct"


def _after_fork_in_child() -> None:
    """A parent thread may have held the lock at the fork: the child starts with a free
    one (the settings themselves stay as they were)."""
    global _lock
    _lock = threading.Lock()


forksafe.at_fork("offload", after_in_child=_after_fork_in_child)

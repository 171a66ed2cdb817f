"""What ``os.fork()`` does to vmm_core's locks and threads, in one declared order.

A child gets one thread, the one that forked; a lock another thread held at the fork
stays held in the child for good, and a thread pool there has no threads.  So each
module that owns such state registers callbacks here, under a stage of :data:`STAGES`:
``before`` takes its locks (waiting, at most until the fork's shared deadline, for
other threads to leave them), ``after_in_parent`` releases them, ``after_in_child``
releases them or gives the child fresh ones and starts its threads afresh.

The order is the lock order of docs/threads-and-locks.md, outermost first: the before
callbacks run in stage order, so a fork takes locks as every entry point does and
waiting closes no cycle with a thread inside vmm_core; the after callbacks run in the
reverse order, so a stage releases or renews its locks while those it nests inside
are still held, and a stage's child callback finds every stage inside it usable.
Within a stage, callbacks run in the order of their names (``module.function``):
import order decides nothing.  Callbacks of one stage must not depend on each other;
one that does belongs to a stage of its own.

This module alone calls ``os.register_at_fork`` (once, at import); it imports nothing
of vmm_core, so every module can register here, and a backend through
:func:`vmm_core.plugin.at_fork`.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["STAGES", "FORK_WAIT_SECONDS", "at_fork", "order", "seconds_left"]

logger = logging.getLogger("vmm_core")

#: the stages, outermost lock first
STAGES = (
    # engines' own locks, held while they wait for vmm_core's (a pause, a pool being made)
    "integrations",
    # the tagged-memory lock every entry point takes first, then every allocator's (one
    # callback: the allocators are listed under the tagged-memory lock, so none made
    # during the wait is missed)
    "tagged memory",
    # what the GraphPools of one allocator share: taken after the tagged-memory lock
    "pool groups",
    # a pool's executables, locked inside replay blocks
    "executables",
    # the offload settings, staging rings, kept copies' registrations, prepared copies
    "offload",
    # host copies and the C library's memory calls
    "host memory",
    # address ranges held back while the framework holds segments in them
    "address ranges",
    # the C shim's loader, the whole-process routing's entry points and segment list,
    # and the framework's replay streams
    "framework calls",
    # each backend's own bookkeeping, and core's cache of its capabilities
    "backends",
    # backend discovery: looked up from inside every block above
    "registry",
    # the thread that closes dropped objects, which any stage may queue work on
    "teardown",
)

#: how long a fork waits, all stages together, for other threads to leave vmm_core's
#: locks; past it the fork goes on and the child renews the locks it could not take
FORK_WAIT_SECONDS = 10.0

Callback = Callable[[], None]


@dataclass(frozen=True)
class _Hook:
    stage: str
    name: str
    before: Callback | None
    after_in_parent: Callback | None
    after_in_child: Callback | None

    @property
    def key(self) -> tuple[int, str]:
        return STAGES.index(self.stage), self.name


#: name -> hook; written with one dict store and read with one copy, each atomic under
#: the GIL, so no lock of this module can be inherited held by a child
_hooks: dict[str, _Hook] = {}
#: for each fork in progress, the hooks whose before callbacks ran
_forks: list[list[_Hook]] = []
_deadline = 0.0


def at_fork(stage: str, *, before: Callback | None = None,
            after_in_parent: Callback | None = None,
            after_in_child: Callback | None = None) -> None:
    """Run these callbacks around every ``os.fork()`` at ``stage`` (one of
    :data:`STAGES`).  Registering the same function again (a module imported anew)
    replaces the earlier registration."""
    if stage not in STAGES:
        raise ValueError(f"at_fork: stage must be one of {STAGES}, got {stage!r}")
    given = [fn for fn in (before, after_in_parent, after_in_child) if fn is not None]
    if not given:
        raise ValueError("at_fork: pass before=, after_in_parent= or after_in_child=")
    first = given[0]
    name = f"{first.__module__}.{first.__qualname__}"
    _hooks[name] = _Hook(stage, name, before, after_in_parent, after_in_child)


def order() -> list[tuple[str, str]]:
    """``(stage, name)`` of every registration, in the order a fork runs their before
    callbacks (the after callbacks run in the reverse order)."""
    return [(hook.stage, hook.name) for hook in _ordered()]


def seconds_left() -> float:
    """What is left of the fork's wait (:data:`FORK_WAIT_SECONDS` from its start), for
    a before callback's lock acquisitions."""
    return max(0.0, _deadline - time.monotonic())


def _ordered() -> list[_Hook]:
    return sorted(tuple(_hooks.values()), key=lambda hook: hook.key)


def _before() -> None:
    global _deadline
    _deadline = time.monotonic() + FORK_WAIT_SECONDS
    hooks = _ordered()
    _forks.append(hooks)
    _run(hooks, "before")


def _after(which: str) -> None:
    """The hooks whose before callbacks ran, and those registered since that have none
    (a module imported by another thread during the wait): a release never runs
    without its acquisition, and a renewal never goes missing."""
    ran = _forks.pop() if _forks else []
    names = {hook.name for hook in ran}
    hooks = ran + [hook for hook in _ordered()
                   if hook.name not in names and hook.before is None]
    _run(sorted(hooks, key=lambda hook: hook.key, reverse=True), which)


def _after_in_parent() -> None:
    _after("after_in_parent")


def _after_in_child() -> None:
    _after("after_in_child")


def _run(hooks: list[_Hook], which: str) -> None:
    """Every callback runs even when one before it raised; the first failure is then
    raised, which Python reports as it reports a failed fork callback of its own."""
    failures: list[BaseException] = []
    for hook in hooks:
        fn = getattr(hook, which)
        if fn is None:
            continue
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - the other stages still run
            if failures:
                logger.error("vmm_core: the fork callback %s (%s) failed", hook.name,
                             which, exc_info=exc)
            failures.append(exc)
    if failures:
        raise failures[0]


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before, after_in_parent=_after_in_parent,
                        after_in_child=_after_in_child)

"""Discovery and selection of backends.

Built-in and third-party backends arrive the same way: the ``vmm_core.backends``
entry-point group.  Loading a plugin only imports its (cheap) module; whether it can run
is decided by its ``vmm_probe`` hook, which is called lazily on first use.  A plugin that
fails to load, or whose hooks do not match the hookspecs, becomes a
:class:`VMMPluginWarning` naming it, never a crash.
"""

from __future__ import annotations

import importlib.metadata
import os
import threading
import warnings
import weakref
from dataclasses import dataclass

import pluggy

from . import forksafe, hookspecs
from .backend import Backend
from .errors import (
    AmbiguousBackendError,
    BackendNotFoundError,
    BackendUnavailableError,
    VMMPluginWarning,
)

__all__ = [
    "ENTRY_POINT_GROUP",
    "ENV_BACKEND",
    "BackendRegistry",
    "Selection",
    "default_registry",
    "reset",
    "resolve",
]

ENTRY_POINT_GROUP = "vmm_core.backends"
ENV_BACKEND = "VMM_CORE_BACKEND"


@dataclass(frozen=True)
class Selection:
    """Which backend auto-detection picked, and the sentence explaining why."""

    backend: Backend
    reason: str


class BackendRegistry:
    """A plugin manager holding every backend plugin found by entry point."""

    def __init__(self, entry_points=None) -> None:
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self._entry_points = entry_points
        self._backends: dict[str, Backend] = {}
        self.load_errors: dict[str, str] = {}
        self._loaded = False
        self._loading = False  # load() is running (on the thread that holds the lock)
        self._lock = threading.RLock()
        _registries.add(self)

    # -- loading ------------------------------------------------------------
    def _iter_entry_points(self):
        if self._entry_points is not None:
            return list(self._entry_points)
        return list(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP))

    def load(self) -> None:
        with self._lock:
            if self._loaded:
                return
            self._loaded = self._loading = True
            try:
                for ep in self._iter_entry_points():
                    try:
                        plugin = ep.load()
                    except (Exception, SystemExit) as exc:  # a plugin's import failure is its bug
                        self._reject(ep.name, f"import of {ep.value!r} failed: "
                                              f"{type(exc).__name__}: {exc}")
                        continue
                    self.register(plugin, name=ep.name, _warn=True)
            finally:
                self._loading = False

    def _start_over(self) -> None:
        """Forget every plugin: a child forked while another thread of its parent was
        loading them (and the fork could not wait for it) would otherwise keep a
        half-filled registry ("no vmm_core backend named 'host'; registered backends:
        none") for good.  Its first use loads them again."""
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self._backends = {}
        self.load_errors = {}
        self._loaded = self._loading = False

    def register(self, plugin: object, name: str, _warn: bool = False) -> Backend | None:
        """Register ``plugin`` as backend ``name`` (tests and embedders may call this).

        Returns the Backend, or None when the plugin was rejected (with a warning).
        """
        with self._lock:
            if name in self._backends:
                self._reject(name, "a backend of that name is already registered")
                return None
            try:
                self.pm.register(plugin, name=name)
            except Exception as exc:
                self._reject(name, f"register failed: {exc}")
                return None
            try:
                self.pm.check_pending()
            except pluggy.PluginValidationError as exc:
                self.pm.unregister(plugin)
                self._reject(name, f"unknown hook implementation: {exc}")
                return None
            missing = [h for h in hookspecs.REQUIRED_HOOKS
                       if not any(i.plugin is plugin
                                  for i in getattr(self.pm.hook, h).get_hookimpls())]
            if missing:
                self.pm.unregister(plugin)
                self._reject(name, f"missing required hooks: {', '.join(missing)}")
                return None
            backend = Backend(name, plugin, self.pm)
            self._backends[name] = backend
            return backend

    def _reject(self, name: str, why: str) -> None:
        self.load_errors[name] = why
        warnings.warn(
            f"vmm_core: backend plugin {name!r} skipped: {why}. Fix or uninstall the "
            f"package that registers it under the {ENTRY_POINT_GROUP!r} entry-point group.",
            VMMPluginWarning,
            stacklevel=3,
        )

    # -- queries --------------------------------------------------------------
    def backends(self) -> dict[str, Backend]:
        self.load()
        return dict(self._backends)

    def names(self) -> list[str]:
        return sorted(self.backends())

    def available(self) -> list[str]:
        """Names of usable backends, best first (ties by name)."""
        usable = [b for b in self.backends().values() if b.available]
        usable.sort(key=lambda b: (-b.probe().priority, b.name))
        return [b.name for b in usable]

    def get(self, name: str) -> Backend:
        backends = self.backends()
        if name not in backends and name in self.load_errors:
            raise BackendNotFoundError(
                f"the vmm_core backend plugin {name!r} was found but rejected: "
                f"{self.load_errors[name]}. Fix or uninstall the package that registers it "
                f"under the {ENTRY_POINT_GROUP!r} entry-point group."
            )
        if name not in backends:
            choices = ", ".join(sorted(backends)) or "none"
            raise BackendNotFoundError(
                f"no vmm_core backend named {name!r}; registered backends: {choices}. "
                f"Check the spelling (e.g. of ${ENV_BACKEND}) or install the package that "
                f"provides it."
            )
        return backends[name]

    def select(self, name: str | None = None) -> Selection:
        """Choose a backend: explicit name, then ${VMM_CORE_BACKEND}, then detection."""
        if name is None and os.environ.get(ENV_BACKEND):
            name = os.environ[ENV_BACKEND]
            backend = self.get(name)
            backend.require_available()
            return Selection(backend, f"forced by {ENV_BACKEND}={name}")
        if name is not None:
            backend = self.get(name)
            backend.require_available()
            return Selection(backend, "requested by name")
        usable = [self._backends[n] for n in self.available()]
        if not usable:
            raise BackendUnavailableError(
                "no usable vmm_core backend on this machine: "
                + "; ".join(f"{b.name}: {b.probe().reason}" for b in self._backends.values())
            )
        top = usable[0].probe().priority
        best = [b for b in usable if b.probe().priority == top]
        if len(best) > 1:
            raise AmbiguousBackendError(
                "several backends of equal priority are usable: "
                + ", ".join(b.name for b in best)
                + f". Choose one with ${ENV_BACKEND}=<name> or get_backend(name=...)."
            )
        chosen = best[0]
        return Selection(chosen, f"auto-detected (priority {top}): {chosen.probe().reason}")

    def resolve(self, backend: Backend | str | None) -> Backend:
        """What every ``backend=`` argument of vmm_core means: a Backend as given, a name
        (None: ${VMM_CORE_BACKEND}, else auto-detected) selected here.  An object that
        stands in for a Backend (a wrapper with its methods, as
        :class:`vmm_core.testing.FaultInjector`) is taken as one."""
        if backend is None or isinstance(backend, str):
            return self.select(backend).backend
        if isinstance(backend, Backend) or callable(getattr(backend, "implements", None)):
            return backend
        raise TypeError(f"backend must be a vmm_core Backend (vmm_core.get_backend()), a "
                        f"backend name or None (auto-detect), got {backend!r} "
                        f"({type(backend).__name__})")


_default: BackendRegistry | None = None
_default_lock = threading.Lock()
_registries: weakref.WeakSet = weakref.WeakSet()


_forking: list = []  # the locks taken for the fork in progress


def _before_fork() -> None:
    """Fork once no other thread is discovering backends: a child forked in the middle
    would get the registry half filled and the plugin module being imported half
    initialized.  Bounded by the fork's wait (:data:`vmm_core.forksafe.FORK_WAIT_SECONDS`):
    past it the fork goes on and the child starts the discovery over
    (:meth:`BackendRegistry._start_over`)."""
    taken = []
    for lock in [_default_lock] + [r._lock for r in list(_registries)]:
        if lock.acquire(timeout=forksafe.seconds_left()):
            taken.append(lock)
    _forking.append(taken)


def _after_fork_in_parent() -> None:
    for lock in reversed(_forking.pop()):
        lock.release()


def _after_fork_in_child() -> None:
    """Locks the fork could not take were held by a thread the child does not have:
    fresh ones, and a registry that thread was loading starts over.  The forking
    thread's own holds stay."""
    global _default_lock
    taken = _forking.pop()
    mine = {id(lock) for lock in taken}
    for lock in reversed(taken):
        lock.release()
    if id(_default_lock) not in mine:
        _default_lock = threading.Lock()
    for registry in list(_registries):
        if id(registry._lock) in mine or registry._lock._is_owned():  # CPython RLock has it
            continue
        registry._lock = threading.RLock()
        if registry._loading:
            registry._start_over()


forksafe.at_fork("registry", before=_before_fork, after_in_parent=_after_fork_in_parent,
                 after_in_child=_after_fork_in_child)


def default_registry() -> BackendRegistry:
    global _default
    with _default_lock:
        if _default is None:
            _default = BackendRegistry()
        return _default


def reset(registry: BackendRegistry | None = None) -> None:
    """Replace the process-wide registry (tests use this with fake entry points)."""
    global _default
    with _default_lock:
        _default = registry


def resolve(backend: Backend | str | None) -> Backend:
    """:meth:`BackendRegistry.resolve` on the process-wide registry."""
    return default_registry().resolve(backend)

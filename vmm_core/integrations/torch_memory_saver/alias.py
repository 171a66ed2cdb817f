"""``import torch_memory_saver`` resolved to this package, for code that cannot be edited.

The alias directory (``vmm_core/integrations/tms_alias``) holds a ``torch_memory_saver``
package that re-exports this one, a ``sitecustomize`` that arms the whole-process mode
at interpreter start, and ``torch_memory_saver_hook_mode_preload.abi3.so``, the file RL
launchers look for beside the package and put in ``LD_PRELOAD``: preloaded, it puts the
alias directory first on ``PYTHONPATH`` (see ``csrc/tms_preload.c``).  So any of these
makes a process (and the processes it starts) use vmm_core: the directory first on
``PYTHONPATH``; :func:`install` before anything imports torch_memory_saver; that file in
``LD_PRELOAD``.
"""

from __future__ import annotations

import contextlib
import os
import sys

from ...errors import VMMError

__all__ = ["alias_path", "preload_path", "install", "configure_subprocess", "PRELOAD_NAME"]

_ALIAS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                          "tms_alias")
#: the module name the alias directory serves (the package it holds)
_ALIAS_NAME = "torch_memory_saver"
#: torch_memory_saver's name for its preload library, which launchers look for
PRELOAD_NAME = "torch_memory_saver_hook_mode_preload.abi3.so"


def alias_path() -> str:
    """The directory whose ``torch_memory_saver`` package is this one: first on
    PYTHONPATH, it makes ``import torch_memory_saver`` resolve here."""
    return _ALIAS_DIR


def preload_path() -> str:
    """The library to put in ``LD_PRELOAD`` for the alias (built by ``pip install``)."""
    path = os.path.join(_ALIAS_DIR, PRELOAD_NAME)
    if not os.path.exists(path):
        raise VMMError(f"{path} is not built; reinstall vmm_core with pip (pip install "
                       f"-e .), which builds csrc/tms_preload.c with the system compiler")
    return path


def _alias_active() -> bool:
    module = sys.modules.get(_ALIAS_NAME)
    return module is not None and getattr(module, "__vmm_core_alias__", False)


def _with_alias_on_pythonpath(env) -> None:
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if _ALIAS_DIR not in parts:
        env["PYTHONPATH"] = os.pathsep.join([_ALIAS_DIR] + parts)


def install() -> None:
    """Make ``import torch_memory_saver`` resolve to this package, in this process and
    in the processes it starts from now on (PYTHONPATH).

    Call it before anything imports torch_memory_saver; once the real package is
    imported its objects are in use, and this raises VMMError instead of mixing both."""
    import importlib

    existing = sys.modules.get(_ALIAS_NAME)
    if existing is not None and not getattr(existing, "__vmm_core_alias__", False):
        raise VMMError(f"torch_memory_saver is imported already from "
                       f"{getattr(existing, '__file__', existing)!r}; call "
                       f"vmm_core.integrations.torch_memory_saver.install() before anything "
                       f"imports it, or put {_ALIAS_DIR!r} first on PYTHONPATH")
    if _ALIAS_DIR not in sys.path:
        sys.path.insert(0, _ALIAS_DIR)
    _with_alias_on_pythonpath(os.environ)
    module = importlib.import_module(_ALIAS_NAME)
    if not getattr(module, "__vmm_core_alias__", False):  # a stale entry on sys.path
        raise VMMError(f"import torch_memory_saver found {module.__file__!r}, not the "
                       f"alias in {_ALIAS_DIR!r}")


@contextlib.contextmanager
def configure_subprocess():
    """As torch_memory_saver's: processes started inside get the preload library in
    ``LD_PRELOAD`` (and, when ``torch_memory_saver`` resolves here, the alias on their
    PYTHONPATH, which that library would add anyway)."""
    if not _alias_active():
        yield
        return
    saved = {name: os.environ.get(name) for name in ("PYTHONPATH", "LD_PRELOAD")}
    _with_alias_on_pythonpath(os.environ)
    try:
        preload = preload_path()
    except VMMError:
        preload = None
    if preload is not None:
        current = [p for p in os.environ.get("LD_PRELOAD", "").split(":") if p]
        if preload not in current:
            os.environ["LD_PRELOAD"] = ":".join([preload] + current)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value

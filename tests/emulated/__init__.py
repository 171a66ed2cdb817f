"""Emulated vendor driver libraries for backends whose hardware is not here.

Each ``<platform>`` has a C source in this folder that exports the vendor's symbols with
the vendor's signatures, backed by memfd + mmap so aliasing is real, and that returns the
vendor's error code for every documented constraint it violates.  This module compiles it
with the system C compiler (once per test session) and points the real backend at it
through the backend's library-path environment variable.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import vmm_core
from vmm_core.plugin import library_env

HERE = Path(__file__).resolve().parent

#: platform -> (C source in this folder, env variable the backend reads for its library:
#: the one every backend reads, VMM_CORE_<NAME>_LIB)
DRIVERS = {platform: (source, library_env(platform))
           for platform, source in (("ascend", "ascendcl_emu.c"), ("mlu", "cndrv_emu.c"))}

_built: dict[str, Path] = {}
_builddir = None


class NotBuildable(Exception):
    """The emulated driver cannot be built here (no C compiler, source missing)."""


def build(platform: str) -> Path:
    """Compile the emulated driver for ``platform``; returns the shared library's path."""
    global _builddir
    if platform in _built:
        return _built[platform]
    source_name, _ = DRIVERS[platform]
    source = HERE / source_name
    if not source.exists():
        raise NotBuildable(f"{source} does not exist")
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise NotBuildable("no C compiler (cc/gcc) on PATH")
    if _builddir is None:
        _builddir = tempfile.mkdtemp(prefix="vmm_core_emu_")
    out = Path(_builddir) / f"lib{platform}_emu.so"
    cmd = [cc, "-shared", "-fPIC", "-O1", "-Wall", "-Werror", "-std=gnu11", "-o", str(out),
           str(source)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"building the emulated {platform} driver failed:\n"
                           f"{' '.join(cmd)}\n{proc.stderr}")
    _built[platform] = out
    return out


def release(platform: str) -> None:
    """Undo :func:`backend_for`: unset the variable and re-probe, so that the rest of
    the session (and child processes) do not see an emulated accelerator."""
    _, env = DRIVERS[platform]
    os.environ.pop(env, None)
    backend = vmm_core.default_registry().backends().get(platform)
    if backend is not None:
        backend.probe(refresh=True)


def backend_for(platform: str):
    """The real ``platform`` backend, loaded against the emulated driver library.

    Call :func:`release` when done (the conftest fixture does)."""
    path = build(platform)
    _, env = DRIVERS[platform]
    os.environ[env] = str(path)
    backend = vmm_core.default_registry().get(platform)
    probe = backend.probe(refresh=True)
    if not probe.available:
        raise RuntimeError(f"{platform} backend rejected the emulated driver {path}: "
                           f"{probe.reason}")
    return backend

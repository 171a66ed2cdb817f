"""device_install.sh on an offline GPU machine with an older setuptools.

There, pip's editable install needs the ``wheel`` package (setuptools 64 to 70.0 build
editable installs through bdist_wheel) and the script falls back to ``setup.py develop``.
That fallback ignores ``package-dir``, so ``vmm_backends`` (the ``backends/`` folder, where
every built-in backend's entry point points) would not import without the link the
script makes.  This runs the script over a copy of the tree into a fresh virtual
environment (no network: no build isolation, no dependencies) and imports both packages
from another folder, as the installed entry points do.  It is skipped where the
interpreter's setuptools would not take the fallback.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _run(*cmd, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=240, **kw)


def test_the_setup_py_develop_fallback_leaves_vmm_backends_importable(tmp_path):
    if shutil.which("git") is None or shutil.which("cc") is None:
        pytest.skip("needs git (to copy the tree) and a C compiler (the shim)")
    venv = tmp_path / "venv"
    made = _run(sys.executable, "-m", "venv", "--system-site-packages", str(venv))
    if made.returncode != 0:
        pytest.skip(f"no virtual environment here: {made.stderr[-200:]}")
    py = str(venv / "bin" / "python3")
    probe = _run(py, "-c", "import importlib.util as u, setuptools, pluggy; "
                 "print(setuptools.__version__, u.find_spec('wheel') is None)")
    if probe.returncode != 0:
        pytest.skip(f"the interpreter lacks setuptools or pluggy: {probe.stderr[-200:]}")
    version, no_wheel = probe.stdout.split()
    major_minor = tuple(int(x) for x in version.split(".")[:2])
    if not ((64, 0) <= major_minor < (70, 1) and no_wheel == "True"):
        pytest.skip(f"setuptools {version} (wheel installed: {no_wheel != 'True'}) does not "
                    f"take the setup.py develop fallback")
    tree = tmp_path / "tree"
    tree.mkdir()
    files = _run("git", "ls-files", "-z", cwd=ROOT).stdout.split("\0")
    for name in filter(None, files):
        if (ROOT / name).is_file():
            (tree / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, tree / name)
    env = {**os.environ, "PATH": f"{venv / 'bin'}{os.pathsep}{os.environ['PATH']}"}
    env.pop("PYTHONPATH", None)
    proc = _run("bash", "scripts/device_install.sh", str(tmp_path / "install.log"),
                cwd=tree, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "setup.py develop" in proc.stdout  # the fallback was taken
    imported = _run(py, "-c", "import vmm_core, vmm_backends.cuda.graph_exec as g; "
                    "print(g.__file__)", cwd=tmp_path, env=env)
    assert imported.returncode == 0, imported.stderr
    assert imported.stdout.startswith(str(tree))

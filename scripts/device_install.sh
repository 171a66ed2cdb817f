#!/usr/bin/env bash
# Installs this checkout on a GPU machine, offline: no build isolation, no deps (the
# machine's torch, cuda-bindings and transformers are used as they are).
# pyproject.toml gives the license as an SPDX string (setuptools >= 77).  An older
# setuptools there rejects that form, and without network none newer can be fetched, so
# on such a machine this checkout's pyproject.toml is rewritten to the table form
# (`git diff` shows it), said in one line.  Usage: bash scripts/device_install.sh LOGFILE
set -o pipefail
log=${1:-/dev/null}
python3 - <<'PY'
import pathlib
import setuptools

major = int(setuptools.__version__.split(".")[0])
if major < 77:
    path = pathlib.Path("pyproject.toml")
    text = path.read_text()
    path.write_text(text.replace('license = "Apache-2.0"', 'license = { text = "Apache-2.0" }'))
    print(f"setuptools {setuptools.__version__} predates SPDX license strings: this "
          f"checkout's pyproject.toml now uses the table form")
PY
if ! python3 -m pip install --no-build-isolation --no-deps -e . >"$log" 2>&1; then
    # setuptools < 70.1 builds editable installs through bdist_wheel, which needs the
    # `wheel` package; offline it cannot be fetched, and `setup.py develop` needs neither
    if grep -q "invalid command 'bdist_wheel'" "$log"; then
        echo "pip's editable install needs the wheel package here: using setup.py develop"
        python3 setup.py develop --no-deps >>"$log" 2>&1 || { tail -30 "$log"; exit 1; }
        # develop puts this folder on sys.path but ignores package-dir: vmm_backends (the
        # backends/ folder, where every built-in backend's entry point points) would not
        # import, so it gets a link of that name in this checkout (git-ignored)
        [ -e vmm_backends ] || ln -s backends vmm_backends
    else
        tail -30 "$log"; exit 1
    fi
fi
# from another folder, as the installed entry points import them
if ! (cd / && python3 -c "import vmm_core, vmm_backends.host") >>"$log" 2>&1; then
    echo "the install left vmm_core or vmm_backends unimportable:"; tail -30 "$log"; exit 1
fi

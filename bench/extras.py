"""The optional dependencies a benchmark needs, checked before any work starts.

Each is an extra of ``pyproject.toml``; a missing one is a :class:`MissingExtraError`
that names what to install (the CLI's exit status 5).
"""

from __future__ import annotations

import importlib.util

from vmm_core.errors import MissingExtraError

__all__ = ["EXTRAS", "require"]

#: extra -> the package whose absence it stands for
EXTRAS = {"bench": "transformers", "plot": "matplotlib"}


def require(extra: str, why: str) -> None:
    """Raise :class:`MissingExtraError` unless the package of ``extra`` is importable;
    ``why`` names what needs it (``--plot out.png``)."""
    module = EXTRAS[extra]
    if importlib.util.find_spec(module) is None:
        raise MissingExtraError(f"{why} needs {module}, which is not installed: pip install "
                                f"'vmm_core[{extra}]' (or pip install -e '.[{extra}]' in a "
                                f"checkout)")

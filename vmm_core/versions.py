"""Installed package versions, read without importing the packages.

Backends gate features on framework versions (capture into custom pools needs torch 2.8,
record-stream reuse 2.9); reading the metadata keeps detection free of heavy imports.
Cached, because ``importlib.metadata`` scans every installed distribution (~0.5 ms).
"""

from __future__ import annotations

import functools
import importlib.metadata

__all__ = ["installed_version", "version_tuple"]


@functools.lru_cache(maxsize=None)
def installed_version(dist: str) -> str | None:
    """The installed version string of distribution ``dist``, or None."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def version_tuple(text: str | None) -> tuple[int, int]:
    """``"2.11.0+cu130"`` -> ``(2, 11)``; unparsable or None -> ``(0, 0)``."""
    if not text:
        return (0, 0)
    parts = text.split("+")[0].split(".")
    try:
        return int(parts[0]), int("".join(ch for ch in parts[1] if ch.isdigit()) or 0)
    except (IndexError, ValueError):
        return (0, 0)

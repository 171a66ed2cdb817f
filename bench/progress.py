"""Progress bars for captures and long benchmark phases, as engines show when capturing.

A bar is drawn only where someone watches: stderr is a terminal, ``--quiet`` is not
given and ``tqdm`` is installed (it is optional; without it there is simply no bar).
Benchmark children run with their output piped, so they cannot draw; instead they
print ``VMMPROGRESS done total phase`` lines that the parent turns into its second bar.
"""

from __future__ import annotations

import os
import sys

__all__ = ["bars_enabled", "bar", "say", "child_bar", "ForwardedBar", "PROGRESS_PREFIX",
           "parse_progress"]

PROGRESS_PREFIX = "VMMPROGRESS "


def _tqdm():
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm


def bars_enabled(quiet: bool = False, stream=None) -> bool:
    """Whether to draw: not quiet, ``stream`` (default stderr) a terminal, tqdm present."""
    stream = sys.stderr if stream is None else stream
    isatty = getattr(stream, "isatty", None)
    return not quiet and bool(isatty and isatty()) and _tqdm() is not None


class _NoBar:
    """What :func:`bar` returns when no bar is drawn: the same calls, doing nothing."""

    n = 0

    def update(self, n: int = 1) -> None:
        self.n += n

    def reset(self, total=None) -> None:
        self.n = 0

    def set_description_str(self, desc: str) -> None:
        return None

    def refresh(self) -> None:
        return None

    def close(self) -> None:
        return None

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def bar(total: int, desc: str, *, enabled: bool, unit: str = "graph", position: int = 0,
        leave: bool = True):
    """A tqdm bar on stderr, or a stand-in with the same methods when ``enabled`` is False."""
    tqdm = _tqdm() if enabled else None
    if tqdm is None:
        return _NoBar()
    try:
        size = os.get_terminal_size(sys.stderr.fileno())
        sized = size.columns > 0 and size.lines > 0
    except (OSError, ValueError):
        sized = False
    # a terminal that reports no size (a bare pty, some containers) would hide the bar
    extra = {"dynamic_ncols": True} if sized else {"ncols": 100, "nrows": 24}
    return tqdm(total=total, desc=desc, unit=unit, position=position, leave=leave,
                file=sys.stderr, **extra)


def say(message: str, *, enabled: bool) -> None:
    """Print a line to stdout without tearing a bar that is being drawn on stderr."""
    tqdm = _tqdm() if enabled else None
    if tqdm is None:
        print(message, flush=True)
    else:
        tqdm.write(message, file=sys.stdout)


class ForwardedBar(_NoBar):
    """A child's bar: one ``VMMPROGRESS`` line on stdout per update, for the parent."""

    def __init__(self, total: int, desc: str) -> None:
        self.total, self.desc, self.n = total, desc, 0
        self._emit()

    def update(self, n: int = 1) -> None:
        self.n += n
        self._emit()

    def _emit(self) -> None:
        print(f"{PROGRESS_PREFIX}{self.n} {self.total} {self.desc}", flush=True)


def child_bar(total: int, desc: str, *, forward: bool, quiet: bool, unit: str = "graph"):
    """The bar of a benchmark child: forwarded lines when the parent draws, else its own
    bar when the child itself is attached to a terminal (run by hand), else none."""
    if forward:
        return ForwardedBar(total, desc)
    return bar(total, desc, enabled=bars_enabled(quiet), unit=unit)


def parse_progress(line: str) -> tuple[int, int, str] | None:
    """``(done, total, phase)`` of a ``VMMPROGRESS`` line, None for any other line."""
    if not line.startswith(PROGRESS_PREFIX):
        return None
    parts = line[len(PROGRESS_PREFIX):].rstrip("\n").split(" ", 2)
    try:
        return int(parts[0]), int(parts[1]), parts[2] if len(parts) > 2 else ""
    except (ValueError, IndexError):
        return None

"""Streams on the CPU: ordering is trivially satisfied, but misuse is still refused."""

from __future__ import annotations

import contextlib
import threading

_tls = threading.local()
_defaults: dict = {}
sync_calls: list = []  # devices passed to synchronize(), for tests


def _index(device) -> int:
    if device is None:
        return 0
    if isinstance(device, int):
        return device
    return getattr(device, "index", 0) or 0


class Stream:
    """Mirrors ``torch_mlu.mlu.streams.Stream``."""

    def __new__(cls, device=None, priority=0, **kwargs):
        self = super().__new__(cls)
        self.device_index = _index(device)
        self.priority = priority
        self.waited_on: list = []
        return self

    def wait_stream(self, stream):
        if not isinstance(stream, Stream):
            raise TypeError(f"wait_stream expects a Stream, got {stream!r}")
        self.waited_on.append(stream)

    def synchronize(self):
        return None


def current_stream(device=None) -> Stream:
    current = getattr(_tls, "current", {})
    index = _index(device)
    if index in current:
        return current[index]
    return _defaults.setdefault(index, Stream(index))


@contextlib.contextmanager
def _stream_context(s):
    current = getattr(_tls, "current", None)
    if current is None:
        current = _tls.current = {}
    if s is None:
        yield
        return
    previous = current.get(s.device_index)
    current[s.device_index] = s
    try:
        yield
    finally:
        if previous is None:
            del current[s.device_index]
        else:
            current[s.device_index] = previous


def stream(stream):
    return _stream_context(stream)


def synchronize(device=None) -> None:
    sync_calls.append(device)

"""Stand-in for the stream/device helpers of ``torch_npu/npu/utils.py``."""

import threading

from .streams import Stream

_tls = threading.local()
_default_streams: dict = {}


def _index(device):
    return 0 if device is None else int(getattr(device, "index", device) or 0)


def set_device(device):
    _tls.device = _index(device)


def current_device():
    return getattr(_tls, "device", 0)


def synchronize(device=None):
    _index(device)


def current_stream(device=None):
    index = current_device() if device is None else _index(device)
    stack = getattr(_tls, "streams", [])
    for s in reversed(stack):
        if s.device == index:
            return s
    return _default_streams.setdefault(index, Stream(index))


class StreamContext:
    """``with torch.npu.stream(s):`` makes ``s`` current on this thread."""

    def __init__(self, stream):
        self.stream = stream

    def __enter__(self):
        if self.stream is not None:
            if not isinstance(self.stream, Stream):
                raise TypeError(f"stream() takes a Stream, got {type(self.stream).__name__}")
            _tls.__dict__.setdefault("streams", []).append(self.stream)
        return self.stream

    def __exit__(self, *exc):
        if self.stream is not None:
            _tls.streams.pop()
        return None


def stream(stream):
    return StreamContext(stream)

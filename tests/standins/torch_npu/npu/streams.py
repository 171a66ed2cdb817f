"""Stand-in for ``torch_npu/npu/streams.py``: streams are ordering tokens on the CPU."""


class Stream:
    """Work runs eagerly on the CPU, so waiting and synchronizing only count calls."""

    def __init__(self, device=None, priority=0, **kwargs):
        self.device = 0 if device is None else int(device)
        self.priority = priority
        self.waits = 0
        self.syncs = 0

    def wait_stream(self, stream):
        if not isinstance(stream, Stream):
            raise TypeError(f"wait_stream takes a Stream, got {type(stream).__name__}")
        self.waits += 1

    def synchronize(self):
        self.syncs += 1

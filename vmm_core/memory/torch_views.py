"""Torch tensors over memory torch did not allocate (mapped parts, registered host memory).

``__cuda_array_interface__`` and ``from_blob`` ask the driver which device a pointer
belongs to, and for a mapping of another GPU's memory the answer is that other GPU, so
the tensor lands on the wrong device (or is silently copied to the right one).  A
storage built with an explicit device, as torch's own CUDA-graph trees do, avoids both:
no pointer query, no copy.  The storage does not own the memory; whoever creates the
view keeps the memory alive (``MappedTensor`` ties it to the base tensor).
"""

from __future__ import annotations

from ..errors import BackendError

__all__ = ["raw_tensor"]


def raw_tensor(address: int, nbytes: int, device):
    """A ``torch.uint8`` tensor of ``nbytes`` over ``[address, address + nbytes)`` on the
    torch ``device`` (a ``torch.device`` or its string), without copying."""
    import torch

    device = torch.device(device)
    make = getattr(torch._C, "_construct_storage_from_data_pointer", None)
    if make is None:
        raise BackendError(f"torch {torch.__version__} has no "
                           f"torch._C._construct_storage_from_data_pointer, needed to view "
                           f"mapped memory without copying it: use torch>=2.8")
    storage = make(address, device, nbytes)
    tensor = torch.empty(0, dtype=torch.uint8, device=device).set_(storage)
    if tensor.data_ptr() != address or tensor.numel() != nbytes:
        raise BackendError(f"torch did not view {nbytes} bytes at {address:#x} in place")
    return tensor

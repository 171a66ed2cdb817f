"""Memory that every rank of a node maps (WholeMemory-style), over ``torch.distributed``.

``vmm_core.distributed.mapped_tensor(shape, dtype, group=None, kind="continuous",
location="device")`` gives every rank a tensor whose rows live in the memory of all
ranks; see :mod:`vmm_core.distributed.tensors` for the rules.  Importing this module
does not import torch.
"""

from .tensors import (  # noqa: F401  (the public names)
    KINDS,
    LOCATIONS,
    MappedMemory,
    MappedTensor,
    Partition,
    mapped_memory,
    mapped_tensor,
    partition_rows,
)

__all__ = ["KINDS", "LOCATIONS", "MappedMemory", "MappedTensor", "Partition",
           "mapped_memory", "mapped_tensor", "partition_rows"]

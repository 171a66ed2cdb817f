"""Memory spread over the ranks of a ``torch.distributed`` group (WholeMemory-style).

``vmm_core.distributed.mapped_tensor(shape, dtype, group=None, kind="continuous",
location="device")`` gives every rank a tensor whose rows live in the memory of all
ranks: mapped by every rank of one node (``"continuous"``, ``"chunked"``), or held by
each rank alone and reached through collectives on any number of nodes
(``"distributed"``); ``mt.gather(indices)`` / ``mt.scatter(indices, rows)`` work for
every kind.  See :mod:`vmm_core.distributed.tensors` for the rules,
:mod:`.exchange` for gather/scatter and :mod:`.collective` for
``vmm_core.sleep(group=...)``: :func:`prepare_group` sets a group's communicator up
before the first group sleep, and :func:`last_timings` says where a group sleep's time
went on this rank.  This package sits above :mod:`vmm_core.memory` and is
never imported by it.  Importing it does not import torch.
"""

from .communicators import prepare_group
from .phases import last_timings
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
           "last_timings", "mapped_memory", "mapped_tensor", "partition_rows",
           "prepare_group"]

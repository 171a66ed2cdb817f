"""Which device an NCCL group's agreements use, decided without a GPU.

Under NCCL only the ranks that enter a collective wait for it: a rank that raises before
the agreement (here: while choosing the device for its tensors, because its ``device``
argument is bad) leaves the other ranks waiting until the group's timeout, where gloo's
CPU tensors never looked at the device at all.  So the choice must never fail on a bad
device: it falls back to the framework's current device, as torch's object collectives
do, and the bad argument is then reported by the agreement on every rank.
"""

from __future__ import annotations

import pytest
import torch

from vmm_backends.cuda.graph_ops import CudaGraphOps
from vmm_core.distributed.group import Group


class _NcclDist:
    """The two things Group reads of torch.distributed for an NCCL group."""

    Backend = torch.distributed.Backend

    @staticmethod
    def get_backend(group=None) -> str:
        return "nccl"


class _CudaBackend:
    def graph_ops(self, device):
        return CudaGraphOps(device)  # the real CUDA graph ops (importable without a GPU)


def _nccl_group(device) -> Group:
    group = Group.__new__(Group)  # no initialized process group on this machine
    group._dist, group.group, group.rank, group.size = _NcclDist, None, 1, 2
    group._backend, group._device = _CudaBackend(), device
    return group


@pytest.fixture
def two_gpus_current_1(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)


@pytest.mark.parametrize("device", [-1, 2, 7, "1", None, True])
def test_a_bad_device_argument_never_keeps_a_rank_out_of_an_nccl_agreement(
        two_gpus_current_1, device):
    assert _nccl_group(device)._tensor_device() == torch.device("cuda", 1)


@pytest.mark.parametrize("device", [0, 1])
def test_an_nccl_group_uses_the_ranks_own_device(two_gpus_current_1, device):
    assert _nccl_group(device)._tensor_device() == torch.device("cuda", device)


def test_a_gloo_group_uses_the_cpu_whatever_the_device():
    group = _nccl_group(-1)

    class _Gloo(_NcclDist):
        @staticmethod
        def get_backend(group=None) -> str:
            return "gloo"

    group._dist = _Gloo
    assert group._tensor_device() == torch.device("cpu")

"""weak_ref_tensors: non-owning views made by the graph ops of the tensor's device.

On the host the view is a CPU buffer over the address; the DLPack capsule the Ascend
backend hands torch_npu is checked here against stock torch's own ``from_dlpack`` with a
CPU device (the same struct and capsule, another device number).
"""

from __future__ import annotations

import weakref

import pytest
import torch

import vmm_core
from vmm_core.errors import BackendError, CaptureError, VMMError
from vmm_core.graphs.views import dlpack_bytes, graph_ops_of, weak_ref_tensors

pytestmark = pytest.mark.usefixtures("clean_tags")


def test_none_passes_through_and_the_structure_is_kept():
    """weak_ref_tensors(None) raised a raw AttributeError ('NoneType' object has no
    attribute 'is_contiguous'): outputs may hold None."""
    t = torch.arange(6.0)
    assert weak_ref_tensors(None) is None
    out = weak_ref_tensors((t, None, [None, t]))
    assert isinstance(out, tuple) and out[1] is None and isinstance(out[2], list)
    assert out[2][0] is None and out[2][1].data_ptr() == t.data_ptr()


@pytest.mark.parametrize("bad", [3, "output", {"logits": 1}, 2.5])
def test_anything_else_is_refused_naming_its_type(bad):
    with pytest.raises(CaptureError, match=rf"takes tensors, None, .* got {type(bad).__name__}"):
        weak_ref_tensors(bad)
    with pytest.raises(VMMError):  # the library's hierarchy, not a raw AttributeError
        weak_ref_tensors([torch.zeros(2), bad])


def test_a_view_aliases_the_output_and_does_not_keep_it():
    t = torch.arange(12, dtype=torch.float64).reshape(3, 4)
    ref = weakref.ref(t.untyped_storage())
    view = weak_ref_tensors(t)
    assert view.shape == t.shape and view.dtype == t.dtype and view.device == t.device
    view[1, 2] = -5.0  # one memory: a write through the view is the output's
    assert t[1, 2] == -5.0
    t.mul_(2)
    assert torch.equal(view, t)
    del t, view
    assert ref() is None  # the view held no reference to the storage
    empty = weak_ref_tensors(torch.zeros(0, 3, dtype=torch.int8))
    assert empty.shape == (0, 3) and empty.dtype == torch.int8
    with pytest.raises(CaptureError, match="contiguous tensors only"):
        weak_ref_tensors(torch.zeros(4, 4).t())


def test_the_view_reads_what_each_replay_writes(host):
    """What vLLM's entries rely on: the view of a graph's output reads the next replay."""
    pool = vmm_core.GraphPool(backend=host, reads=(), tag="views")
    inp, w = torch.zeros(4, 3), torch.randn(3, 3)
    with pool.space(4):
        g = pool.new_graph()
        out = pool.capture(g, lambda: torch.tanh(inp @ w))
    entry = weak_ref_tensors(out)
    for _ in range(3):
        inp.copy_(torch.randn(4, 3))
        with pool.replaying(4):
            g.replay()
        torch.testing.assert_close(entry, torch.tanh(inp @ w))
    pool.close()


def test_the_graph_ops_come_from_the_tensor_s_device_through_the_registry(host):
    ops = graph_ops_of(torch.device("cpu"))
    assert ops.device_type == "cpu" and type(ops) is type(host.graph_ops(0))
    assert graph_ops_of(torch.device("cpu")) is ops  # looked up once
    with pytest.raises(BackendError, match="no usable vmm_core backend captures graphs of "
                                           "meta tensors"):
        weak_ref_tensors(torch.empty(4, device="meta"))


def test_a_dlpack_capsule_is_a_view_that_owns_nothing():
    t = torch.arange(8, dtype=torch.float32)
    ref = weakref.ref(t.untyped_storage())
    view = torch.utils.dlpack.from_dlpack(dlpack_bytes(t.data_ptr(), 32, 1, 0))  # kDLCPU
    assert view.dtype == torch.uint8 and view.shape == (32,)
    assert view.data_ptr() == t.data_ptr()
    view[:4] = 0  # one memory: the first float of t, through the capsule's tensor
    assert t[0] == 0 and torch.equal(view.view(torch.float32)[1:], t[1:])
    del t
    assert ref() is None  # the capsule's tensor did not keep the memory

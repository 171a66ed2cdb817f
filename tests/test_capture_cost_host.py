"""What one capture costs in backend calls, on the host backend (real memfd pages).

A capture into a GraphPool space must not remap the spaces of older keys: the decode
benchmark captures one size after another (``capture_all([size])``), and remapping
every older space after each growth made capture grow with the number of keys.  These
tests count the backend's calls, never time, and check that the memory stays at what
the largest key uses and that every replay still matches eager.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from host_space import read, write

import vmm_core
from vmm_bench.measure import VLLM_DECODE_SIZES
from vmm_core.errors import VMMFallbackWarning
from vmm_core.memory import routing
from vmm_core.memory.handle_growth import merge_start
from vmm_core.testing.tools import HookCounter

MiB = 1 << 20
ROW = 184 << 10  # activation bytes per batch row: the decode benchmark's MLP at 92 MiB
REMAPS = ("vmm_map", "vmm_unmap")
pytestmark = pytest.mark.usefixtures("clean_tags")


def _activations(x):
    """A model whose activations grow with the batch, in the capture space as a device
    framework's would be (the host's CPU allocator is not redirected)."""
    target = routing.current_target(0)
    if target is not None:
        target.deallocate(target.allocate(x.shape[0] * ROW))
    return x * 2 + 1


def test_a_merge_of_the_newest_handles_leaves_older_spaces_alone():
    # 40 spaces map the first handle, the last space grew a second one: merging both
    # would remap all 40 spaces; the counter waits until the newer ones are as widely
    # mapped, whatever the number of spaces
    assert merge_start([set(range(40)), {39}]) is None
    assert merge_start([set(range(40)), {38, 39}, {39}]) == 1
    assert merge_start([{0, 1}, {1}]) == 0
    # the last growth step reaches past what the spaces use: it alone is trimmed
    assert merge_start([set(range(40)), {39}], tail_unused=True) == 1
    assert merge_start([{0}], tail_unused=True) == 0
    assert merge_start([], tail_unused=True) is None


def test_trimming_a_growth_remaps_only_the_space_that_grew(host):
    alloc = vmm_core.SharedVMMAllocator(host, growth_bytes=4 * MiB)
    for _ in range(20):  # 20 keys of one page each: one handle mapped into every space
        alloc.switch_to_new_virtual_space()
        alloc.allocate(1)
    alloc.switch_to_new_virtual_space()
    grown = alloc.allocate(5 * MiB)  # a second handle, 3 MiB of it unused
    write(grown, b"kept through the trim")
    assert alloc.num_handles == 2
    with HookCounter(host) as counter:
        assert alloc.merge_tail()
    # the copy's scratch range and the space that grew, not all 21 spaces
    assert sum(counter.calls[h] for h in REMAPS) <= 6, counter.calls
    used = max(alloc.space_used_bytes(i) for i in alloc.space_indices())
    assert alloc.physical_bytes == used == 5 * MiB
    assert read(grown, 21) == b"kept through the trim"
    alloc.close()


@pytest.mark.parametrize("order", ["ascending", "descending", "random"])
def test_capturing_one_size_after_another_costs_logarithmic_remaps(host, order):
    sizes = VLLM_DECODE_SIZES
    capture = sorted(sizes, reverse=order == "descending")
    if order == "random":
        random.Random(3).shuffle(capture)
    ex = vmm_core.GraphExecutor(_activations, torch.zeros(max(sizes), 8), buckets=sizes,
                                backend=host, executables=False)
    calls = []
    largest = 0
    with HookCounter(host) as counter:
        for size in capture:
            before = sum(counter.calls[h] for h in REMAPS)
            ex.capture_all([size])
            calls.append(sum(counter.calls[h] for h in REMAPS) - before)
            largest = max(largest, ex.stats()["largest_space_bytes"])
            # memory at max(shape) after every capture, not only once all are done
            assert ex.stats()["physical_bytes"] == largest
    # remapping every older space after each growth cost about 93 calls a capture in
    # ascending order (4700 for 51 sizes); a binary counter of handles costs O(log)
    assert sum(calls) / len(calls) <= 4 * math.log2(len(sizes)) + 8, calls
    assert ex.stats()["handles"] <= math.log2(len(sizes)) + 2
    for size in random.Random(4).sample(sizes, len(sizes)):
        x = torch.randn(size, 8)
        torch.testing.assert_close(ex(x), x * 2 + 1)
    ex.close()


def test_the_operator_watch_keeps_operators_and_names_them_only_when_asked(host):
    """The watch runs for every operator of every capture: it records the operator
    objects, and their names are made when a reader asks (the host's executables
    compare them), not once per operator captured."""
    from vmm_core.graphs.kept_graphs import watch_operators

    watch = watch_operators()
    with watch:
        torch.ones(2) * 3
    assert torch.ops.aten.mul.Tensor in watch.operators
    assert all(isinstance(op, torch._ops.OpOverload) for op in watch.operators)

    pool = vmm_core.GraphPool(backend=host)
    graph = pool.new_graph()
    x = torch.randn(4)
    with pool.space(1), pytest.warns(VMMFallbackWarning, match="aten.bernoulli_.float"):
        pool.capture(graph, lambda: torch.nn.functional.dropout(x * 2, 0.5, True))
    assert "aten.mul.Tensor" in graph.vmm_operators
    assert graph.vmm_seeded == ("aten.bernoulli_.float",)
    graph.reset()
    pool.close()

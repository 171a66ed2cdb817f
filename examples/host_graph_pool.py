"""GraphPool and tagged memory on the host backend: no GPU needed.

On the host backend the framework's CPU allocator cannot be redirected, so nothing routes
``torch.empty`` into a capture space or a region.  Code allocates there itself, from the
allocator the space's handle (or the region) carries, and may view the bytes as a tensor.
Everything else is what a GPU run does: every key gets its own virtual space, all spaces
map the same physical pages, outputs that outlive a "capture" are declared with
``pool.keep``, and memory sleeps and wakes at the same addresses.

    python examples/host_graph_pool.py
"""

import ctypes

import torch

import vmm_core

MiB = 1 << 20


def tensor_at(address: int, rows: int, cols: int) -> torch.Tensor:
    """A float32 tensor over host VMM memory (the memory stays the allocator's)."""
    buf = (ctypes.c_uint8 * (rows * cols * 4)).from_address(address)
    return torch.frombuffer(buf, dtype=torch.float32).view(rows, cols)


pool = vmm_core.GraphPool(backend="host")          # tag "graph", its own allocator
sizes, hidden = [1, 8, 64, 512], 1024
outputs = {}
for size in sizes:                                 # one key (one virtual space) per size
    with pool.space(size) as handle:               # on a GPU: torch.cuda.graph(g, pool=handle)
        alloc = handle.allocator                   # host only: allocate yourself
        scratch = tensor_at(alloc.allocate(size * hidden * 4), size, hidden)
        out = tensor_at(alloc.allocate(size * hidden * 4), size, hidden)
        torch.mul(scratch.fill_(float(size)), 2, out=out)
        alloc.deallocate(scratch.data_ptr())       # freed inside: reused by the next key
        pool.keep(out.data_ptr())                  # alive after the block: declare it
    outputs[size] = out

stats = pool.stats()
print(f"{len(sizes)} keys in {stats['virtual_spaces']} virtual spaces hold "
      f"{stats['physical_bytes'] / MiB:.1f} MiB of physical memory; the largest key alone "
      f"needs {stats['largest_space_bytes'] / MiB:.1f} MiB")
assert stats["physical_bytes"] == stats["largest_space_bytes"]  # max(shape), not the sum

# Spaces alias one set of pages: an output is valid until another key writes there.
last = outputs[sizes[-1]]
assert torch.equal(last, torch.full_like(last, 2.0 * sizes[-1]))

# Sleep and wake: offloaded bytes come back at the same addresses.
with vmm_core.region("weights", backend="host") as weights_alloc:
    weights = tensor_at(weights_alloc.allocate(4 * MiB), 1024, 1024)
    weights.normal_(generator=torch.Generator().manual_seed(0))
expected = weights.clone()
vmm_core.sleep(["weights", "graph"], offload=["weights"])   # every tag named must exist
print({tag: s["asleep"] for tag, s in vmm_core.memory_summary().items()})
vmm_core.wake_up()
assert torch.equal(weights, expected)              # same address, same bytes
print("weights survived sleep and wake at address", hex(weights.data_ptr()))

pool.close()
weights_alloc.close()

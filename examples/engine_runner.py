"""A piecewise graph runner shaped like vLLM's, on vmm_core.GraphPool.

The model is split into pieces (attention would run eagerly between them); every piece is
captured per batch size and the pieces of one size pass activations to each other.  It
follows vLLM's reference discipline (``CUDAGraphWrapper.__call__`` in
``vllm/compilation/cuda_graph.py``): an entry keeps only a non-owning view of its output,
and the forward drops every activation after its last use, so when a size's capture ends
nothing of it stays allocated and no ``keep()`` is needed.  The only vmm_core lines are
where an engine passes ``pool=`` today and where it launches a size's graphs.
Needs a CUDA GPU:  python examples/engine_runner.py
(examples/host_graph_pool.py makes the same GraphPool calls on a CPU)
"""

import sys

import torch

import vmm_core
from vmm_core import weak_ref_tensors  # in vLLM: vllm.utils.weak_ref_tensors

if not torch.cuda.is_available():
    sys.exit("examples/engine_runner.py needs a CUDA GPU (torch.cuda.is_available() is "
             "False); examples/host_graph_pool.py makes the same calls on a CPU")

torch.manual_seed(0)
hidden, sizes = 1024, [1, 2, 4, 8, 16, 32]
w1, w2 = (torch.randn(hidden, hidden, device="cuda") / hidden**0.5 for _ in range(2))
pieces = [lambda x: torch.relu(x @ w1), lambda h: h @ w2 + 1]

pool = vmm_core.GraphPool()  # was: torch.cuda.graph_pool_handle()
static_in = torch.zeros(max(sizes), hidden, device="cuda")  # outside every pool
pool.warmup(lambda: pieces[1](pieces[0](static_in)))  # libraries' per-stream workspaces
graphs = {}


def capture(size):
    entries = []
    with pool.space(size) as handle:  # was: the engine's one pool handle
        x = static_in[:size]
        for piece in pieces:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=handle, stream=pool.capture_stream):
                out = piece(x)
            entries.append((graph, weak_ref_tensors(out)))  # vLLM's entry.output
            x = out  # the next piece reads it; dropped once that piece is captured
        del x, out  # the forward ends: nothing of it stays allocated
    graphs[size] = entries


def forward(x):
    n = x.shape[0]
    size = next(s for s in sizes if s >= n)
    if size not in graphs:
        capture(size)
    with pool.replaying(size):  # refuses sleeping memory; no sleep can start inside
        static_in[:n].copy_(x)
        static_in[n:size].zero_()
        for graph, _ in graphs[size]:
            graph.replay()
        return graphs[size][-1][1][:n].clone()  # copied out before another size replays


for n in (3, 32, 1, 17, 5, 32):
    x = torch.randn(n, hidden, device="cuda")
    # a graph of size 32 serving 17 rows runs other GEMM shapes than eager at 17, so cuBLAS
    # may sum in another order (about 1e-6 apart in float32); memory shared wrongly between
    # sizes would be off by the values themselves
    torch.testing.assert_close(forward(x), pieces[1](pieces[0](x)), rtol=1e-4, atol=1e-4)
stats = pool.stats()
print(f"{len(graphs)} sizes, {sum(map(len, graphs.values()))} graphs: physical pool "
      f"{stats['physical_bytes'] / 2**20:.0f} MiB, the largest space alone "
      f"{stats['largest_space_bytes'] / 2**20:.0f} MiB; every size matched eager")

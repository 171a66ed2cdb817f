"""A piecewise graph runner shaped like vLLM's, on vmm_core.GraphPool.

The model is split into pieces (attention would run eagerly between them); every piece is
captured per batch size and the pieces of one size pass activations to each other.  The
only vmm_core lines are where an engine passes ``pool=`` today and where it launches a
size's graphs.  Needs a CUDA GPU:  python examples/engine_runner.py
"""

import torch

import vmm_core

torch.manual_seed(0)
hidden, sizes = 1024, [1, 2, 4, 8, 16, 32]
w1, w2 = (torch.randn(hidden, hidden, device="cuda") / hidden**0.5 for _ in range(2))
pieces = [lambda x: torch.relu(x @ w1), lambda h: h @ w2 + 1]

pool = vmm_core.GraphPool()  # was: torch.cuda.graph_pool_handle()
static_in = torch.zeros(max(sizes), hidden, device="cuda")  # outside every pool
pool.warmup(lambda: pieces[1](pieces[0](static_in)))  # libraries' per-stream workspaces
graphs = {}


def capture(size):
    args, entries = static_in[:size], []
    for piece in pieces:
        graph = torch.cuda.CUDAGraph()
        with pool.space(size) as handle:  # was: the engine's one pool handle
            with torch.cuda.graph(graph, pool=handle, stream=pool.capture_stream):
                out = piece(args)
            pool.keep(out)  # space-local: the next piece of this size reads it
        entries.append((graph, out))
        args = out
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
    return graphs[size][-1][1][:n]  # valid until another size replays


for n in (3, 32, 1, 17, 5, 32):
    x = torch.randn(n, hidden, device="cuda")
    torch.testing.assert_close(forward(x), pieces[1](pieces[0](x)))
stats = pool.stats()
print(f"{len(graphs)} sizes, {sum(map(len, graphs.values()))} graphs: physical pool "
      f"{stats['physical_bytes'] / 2**20:.0f} MiB, the largest space alone "
      f"{stats['largest_space_bytes'] / 2**20:.0f} MiB; every size matched eager")

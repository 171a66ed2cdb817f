"""Probe what owning graph executables apart from torch needs (one CUDA GPU, torch, libcuda).

Settles, in one process, before any policy is built on them:

1. a ``torch.cuda.CUDAGraph`` subclass made with ``keep_graph=True`` captures through
   ``torch.cuda.graph(g, pool=...)`` unchanged, and an executable instantiated and launched
   through the driver (``vmm_backends.cuda.graph_exec``) computes what eager does;
2. which capture arguments ``torch.cuda.graph`` passes to ``capture_begin`` in this torch;
3. whether a ``TorchDispatchMode`` active during the capture sees random-number ops
   (``torch.Tag.nondeterministic_seeded``), and that launching our executable of such a
   graph repeats its random numbers while torch's replay (which advances the generator's
   offset first) does not;
4. the driver's node listing of a kept graph (types, kernel functions): equal for one piece
   captured at two batch sizes and for two layers of one shape; whether
   ``cuGraphExecUpdate`` of one executable to those graphs is accepted, and results then;
5. what instantiate, update and launch cost for a 6-kernel piece, and what the device's
   free memory says about executables kept under a budget of 16 against all resident;
6. what ``MemPool.snapshot()`` (the live-block query) costs for a pool of 300 tensors;
7. a steady-state launch of our executable against torch's own replay.

    python scripts/probe_graph_executables.py
"""

from __future__ import annotations

import ctypes
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from vmm_backends.cuda.graph_exec import GraphExecutables


def line(*parts):
    print(*parts, flush=True)


class KeptGraph(torch.cuda.CUDAGraph):
    def __new__(cls):
        return super().__new__(cls, True)

    def __init__(self):  # pybind's constructor is __init__: keep_graph must reach it too
        super().__init__(True)

    seen_kwargs = None

    def capture_begin(self, *args, **kwargs):
        KeptGraph.seen_kwargs = (args, sorted(kwargs))
        return super().capture_begin(*args, **kwargs)


class SeededOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seeded = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if torch.Tag.nondeterministic_seeded in getattr(func, "tags", ()):
            self.seeded.append(str(func))
        return func(*args, **(kwargs or {}))


lib = ctypes.CDLL("libcuda.so.1")
lib.cuGraphGetNodes.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p),
                                ctypes.POINTER(ctypes.c_size_t)]
lib.cuGraphNodeGetType.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)]


class KernelParamsV2(ctypes.Structure):
    _fields_ = [("func", ctypes.c_void_p), ("gridDimX", ctypes.c_uint),
                ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint),
                ("blockDimZ", ctypes.c_uint), ("sharedMemBytes", ctypes.c_uint),
                ("kernelParams", ctypes.c_void_p), ("extra", ctypes.c_void_p),
                ("kern", ctypes.c_void_p), ("ctx", ctypes.c_void_p)]


lib.cuGraphKernelNodeGetParams_v2.argtypes = [ctypes.c_void_p, ctypes.POINTER(KernelParamsV2)]


def nodes(graph) -> list[tuple[int, int, tuple]]:
    raw = ctypes.c_void_p(graph.raw_cuda_graph())
    n = ctypes.c_size_t(0)
    assert lib.cuGraphGetNodes(raw, None, ctypes.byref(n)) == 0
    arr = (ctypes.c_void_p * n.value)()
    assert lib.cuGraphGetNodes(raw, arr, ctypes.byref(n)) == 0
    out = []
    for node in arr:
        t = ctypes.c_int()
        assert lib.cuGraphNodeGetType(ctypes.c_void_p(node), ctypes.byref(t)) == 0
        func, grid = 0, ()
        if t.value == 0:  # CU_GRAPH_NODE_TYPE_KERNEL
            p = KernelParamsV2()
            rc = lib.cuGraphKernelNodeGetParams_v2(ctypes.c_void_p(node), ctypes.byref(p))
            func = p.func if rc == 0 else -rc
            grid = (p.gridDimX, p.gridDimY, p.gridDimZ, p.blockDimX)
        out.append((t.value, func, grid))
    return out


def main():
    dev = torch.device("cuda", 0)
    line("torch", torch.__version__, torch.cuda.get_device_name(0))
    ex = GraphExecutables()
    stream = torch.cuda.Stream()
    pool = torch.cuda.graph_pool_handle()
    hidden, ffn = 4096, 14336
    torch.manual_seed(0)
    layers = [(torch.randn(hidden, ffn, device=dev, dtype=torch.bfloat16) * 0.02,
               torch.randn(ffn, hidden, device=dev, dtype=torch.bfloat16) * 0.02)
              for _ in range(2)]
    static = torch.zeros(512, hidden, device=dev, dtype=torch.bfloat16)

    def piece(x, w):  # rmsnorm + up + silu + down + residual: a handful of kernels
        h = x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype)
        return x + torch.nn.functional.silu(h @ w[0]) @ w[1]

    with torch.cuda.stream(stream):  # warm-up on the capture stream
        for w in layers:
            piece(static[:64], w)
    torch.cuda.synchronize()

    graphs = {}
    for size in (64, 32, 8, 1):
        for li, w in enumerate(layers):
            g = KeptGraph()
            with torch.cuda.graph(g, pool=pool, stream=stream):
                out = piece(static[:size], w)
            graphs[(size, li)] = (g, out)
    line("1/2. capture_begin got", KeptGraph.seen_kwargs)

    # 1. our executable against eager
    x = torch.randn(64, hidden, device=dev, dtype=torch.bfloat16)
    static[:64].copy_(x)
    g, out = graphs[(64, 0)]
    h = ex.instantiate(g)
    ex.launch(h, torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    ref = piece(x, layers[0])
    line("1. own executable vs eager: max abs diff",
         float((out.float() - ref.float()).abs().max()), "ref max", float(ref.abs().max()))
    ex.destroy(h)

    # 4. signatures and updates
    sig = {k: nodes(v[0]) for k, v in graphs.items()}
    line("4. nodes per graph:", {k: len(v) for k, v in sig.items()})
    line("4. types (64,0):", [t for t, _, _ in sig[(64, 0)]])
    def same(a, b):
        return [(t, f) for t, f, _ in sig[a]] == [(t, f) for t, f, _ in sig[b]]

    line("4. same (type, func) sizes 64/32 layer0:", same((64, 0), (32, 0)),
         "| 64/1:", same((64, 0), (1, 0)), "| layers 0/1 at 64:", same((64, 0), (64, 1)))
    base = ex.instantiate(graphs[(64, 0)][0])
    for key in [(32, 0), (8, 0), (1, 0), (64, 1), (1, 1), (64, 0)]:
        size, li = key
        g, out = graphs[key]
        t0 = time.perf_counter()
        why = ex.update(base, g)
        dt = (time.perf_counter() - t0) * 1e6
        x = torch.randn(size, hidden, device=dev, dtype=torch.bfloat16)
        static[:size].copy_(x)
        if why is None:
            ex.launch(base, torch.cuda.current_stream().cuda_stream)
        else:
            h2 = ex.instantiate(g)
            ex.launch(h2, torch.cuda.current_stream().cuda_stream)
        torch.cuda.synchronize()
        ref = piece(x, layers[li])
        line(f"4. update to {key}: {why or 'Success'} in {dt:.0f} us; max abs diff "
             f"{float((out.float() - ref.float()).abs().max()):.3g}")
    ex.destroy(base)

    # 3. random numbers
    def noisy(x):
        return torch.nn.functional.dropout(x, p=0.5, training=True) + torch.rand_like(x)

    with torch.cuda.stream(stream):
        noisy(static[:8])
    torch.cuda.synchronize()
    mode = SeededOps()
    gr = KeptGraph()
    with torch.cuda.graph(gr, pool=pool, stream=stream):
        with mode:
            rout = noisy(static[:8])
    mode2 = SeededOps()
    gq = KeptGraph()
    with torch.cuda.graph(gq, pool=pool, stream=stream):
        with mode2:
            piece(static[:8], layers[0])
    line("3. seeded ops seen in noisy capture:", mode.seeded, "| in piece:", mode2.seeded)
    static[:8].fill_(1.0)
    h = ex.instantiate(gr)
    ours = []
    for _ in range(2):
        ex.launch(h, torch.cuda.current_stream().cuda_stream)
        torch.cuda.synchronize()
        ours.append(rout.clone())
    theirs = []
    for _ in range(2):
        gr.replay()
        torch.cuda.synchronize()
        theirs.append(rout.clone())
    line("3. own launches repeat numbers:", bool(torch.equal(ours[0], ours[1])),
         "| torch replays repeat:", bool(torch.equal(theirs[0], theirs[1])))
    ex.destroy(h)
    mode_outer = SeededOps()  # a mode entered around torch.cuda.graph (as a pool would)
    go = KeptGraph()
    with mode_outer:
        with torch.cuda.graph(go, pool=pool, stream=stream):
            noisy(static[:8])
    line("3. mode entered outside torch.cuda.graph sees:", mode_outer.seeded)

    # 5. costs and memory
    g = graphs[(64, 0)][0]
    s = torch.cuda.current_stream().cuda_stream
    t0 = time.perf_counter()
    hs = [ex.instantiate(g) for _ in range(50)]
    t_inst = (time.perf_counter() - t0) / 50 * 1e6
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for h in hs:
        ex.launch(h, s)
    t_launch = (time.perf_counter() - t0) / 50 * 1e6
    torch.cuda.synchronize()
    for h in hs:
        ex.destroy(h)
    line(f"5. instantiate {t_inst:.0f} us, launch {t_launch:.1f} us (host side) per "
         f"{len(sig[(64, 0)])}-node piece")
    many = []
    for i in range(400):
        gk = KeptGraph()
        with torch.cuda.graph(gk, pool=pool, stream=stream):
            piece(static[:8], layers[i % 2])
        many.append(gk)
    torch.cuda.synchronize()
    free0 = torch.cuda.mem_get_info()[0]
    alive: list = []
    for gk in many:
        alive.append(ex.instantiate(gk))
        if len(alive) > 16:
            ex.destroy(alive.pop(0))
    torch.cuda.synchronize()
    free1 = torch.cuda.mem_get_info()[0]
    for h in alive:
        ex.destroy(h)
    allh = [ex.instantiate(gk) for gk in many]
    torch.cuda.synchronize()
    free2 = torch.cuda.mem_get_info()[0]
    line(f"5. 400 executables, at most 16 alive: {(free0 - free1) / 2**20:.1f} MiB; all "
         f"alive: {(free0 - free2) / 2**20:.1f} MiB ({(free0 - free2) / 400 / 1024:.0f} KiB each)")
    for h in allh:
        ex.destroy(h)
    torch.cuda.synchronize()
    rose = (torch.cuda.mem_get_info()[0] - free2) / 2**20
    line(f"5. after destroying all: free rose by {rose:.1f} MiB")

    # 7. steady-state launch: our executable against torch's own replay of the same piece
    gt = torch.cuda.CUDAGraph()
    with torch.cuda.graph(gt, pool=pool, stream=stream):
        piece(static[:8], layers[0])
    gk = many[0]
    h = ex.instantiate(gk)
    ex.launch(h, s)
    gt.replay()
    torch.cuda.synchronize()
    for label, fn in (("own launch", lambda: ex.launch(h, s)), ("torch replay", gt.replay)):
        best = []
        for _ in range(5):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(200):
                fn()
            best.append((time.perf_counter() - t0) / 200 * 1e6)
            torch.cuda.synchronize()
        line(f"7. {label}, steady state: {min(best):.1f} us host side (best of 5 x 200)")
    ex.destroy(h)

    # 6. live-block query cost
    mp = torch.cuda.MemPool()
    with torch.cuda.use_mem_pool(mp):
        ts = [torch.empty(1 << 20, device=dev, dtype=torch.uint8) for _ in range(300)]
    for label, call in (("MemPool.snapshot()", lambda: mp.snapshot()),
                        ("torch.cuda.memory_snapshot()", torch.cuda.memory_snapshot)):
        try:
            t0 = time.perf_counter()
            snap = call()
            line(f"6. {label}: {(time.perf_counter() - t0) * 1e3:.2f} ms, "
                 f"{len(snap)} segments")
        except Exception as exc:  # noqa: BLE001
            line(f"6. {label}: {type(exc).__name__}: {exc}")
    try:
        t0 = time.perf_counter()
        mp.snapshot(include_traces=False)
        line(f"6. MemPool.snapshot(include_traces=False): "
             f"{(time.perf_counter() - t0) * 1e3:.2f} ms")
    except Exception as exc:  # noqa: BLE001
        line(f"6. MemPool.snapshot(include_traces=False): {type(exc).__name__}: {exc}")
    del ts


if __name__ == "__main__":
    main()

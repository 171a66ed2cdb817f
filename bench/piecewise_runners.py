"""The engine-runner scenarios and the RL step capture graphs as vLLM and SGLang do,
through the same runners: kept apart from any one scenario's measurement, a discipline is
captured and replayed the same way wherever it is measured.
"""

from __future__ import annotations

from .peers import DISCIPLINES, flat_tensors, weak_ref_tensors

__all__ = ["PiecewiseRunner", "FullRunner"]


class _Entry:
    """One captured graph and what the runner holds of its output (vLLM's
    ``CUDAGraphEntry``: ``cudagraph`` and ``output``)."""

    __slots__ = ("graph", "output")

    def __init__(self, graph, output) -> None:
        self.graph, self.output = graph, output


class _Runner:
    """What both runners share: a persistent input buffer, per-size entries, and the
    discipline (:mod:`.peers`) that decides which outputs stay referenced.

    Graphs come from ``pool.new_graph()``: a GraphPool strategy's replay through the
    pool's executables, a peer's pool (``executables=False``) gives torch's own graphs.
    ``ops`` (the pool's graph ops by default) captures them, and makes them where given;
    ``weak_ref`` defaults to :func:`.peers.weak_ref_tensors` (the host tests pass
    stand-ins for both: on a CPU freed memory goes back to malloc, while a device pool
    keeps it for the graph that wrote it).  ``captures`` counts the graphs captured."""

    family = ""

    def __init__(self, model, pool, sizes, discipline="vllm", *, ops=None,
                 weak_ref=None, memory=None) -> None:
        import torch

        if isinstance(discipline, str):
            if discipline not in DISCIPLINES:
                raise ValueError(f"unknown discipline {discipline!r}; choose from "
                                 f"{', '.join(DISCIPLINES)}")
            discipline = DISCIPLINES[discipline]
        self.model, self.pool, self.discipline = model, pool, discipline
        self.ops = ops or pool.ops
        self.new_graph = ops.new_graph if ops is not None else pool.new_graph
        self.captures = 0
        self.weak_ref = weak_ref or weak_ref_tensors
        self.memory = memory  # the segment readings a seeding discipline needs
        self.seeded: dict = {}  # size -> the segments its space was seeded with
        self.sizes = sorted(sizes)
        self.inputs = torch.zeros(self.sizes[-1], model.hidden, device=model.device,
                                  dtype=model.dtype)  # outside every pool
        self.entries: dict[int, list[_Entry]] = {}

    def key(self, size: int):
        return (self.family, size) if self.family else size

    def _graph_fns(self) -> list:
        """The callables captured per size, in forward order; each takes the previous
        one's :meth:`_next_inputs`."""
        raise NotImplementedError

    def _next_inputs(self, out) -> tuple:
        return ()

    def capture(self, size: int) -> None:
        """One forward at ``size`` that captures every graph of it, holding what the
        discipline holds.  The whole forward runs in the key's space: with vLLM's
        discipline its intermediate outputs die inside it (the escape guard sees none)."""
        d, ops, pool = self.discipline, self.ops, self.pool
        fns = self._graph_fns()
        weak_last = d.weak_inside(len(fns))
        entries = []
        with pool.space(self.key(size)) as handle:
            if d.seed:
                self.seeded[size] = seed_space(pool, self.key(size), ops, self.memory)
            inputs: tuple = (self.inputs[:size],)
            for i, fn in enumerate(fns):
                last = i == len(fns) - 1
                graph = self.new_graph()
                self.captures += 1
                out = ops.capture(graph, _body(fn, inputs, self.weak_ref if last and weak_last
                                               else None), handle)
                if d.weak_entries:  # vLLM: entry.output = weak_ref_tensors(output)
                    entries.append(_Entry(graph, self.weak_ref(out)))
                else:  # the runner keeps the output (SGLang's output_buffers[bs], keep)
                    if not (last and weak_last):  # declared: the escape guard allows it
                        pool.keep(*flat_tensors(out))
                    entries.append(_Entry(graph, out))
                # the forward (FX code in vLLM) drops a value after its last use: the
                # previous piece's outputs go as soon as this piece has consumed them
                inputs = self._next_inputs(out) if not last else ()
                del out
            del inputs  # the forward ends: nothing strong of it is left
        self.entries[size] = entries

    def __call__(self, x):
        """Serve a batch: capture its bucket on first use, replay, return the output.

        With a non-owning discipline the result is a view of pool memory: copy it out
        before another size replays (the benchmark's checks do, at once)."""
        n = x.shape[0]
        fits = [s for s in self.sizes if s >= n]
        if not fits:
            raise ValueError(f"batch {n} exceeds the largest captured size {max(self.sizes)}: "
                             f"add it to --sizes")
        size = min(fits)  # the smallest captured size that fits
        if size not in self.entries:
            self.capture(size)
        with self.pool.replaying(self.key(size)):
            self.inputs[:n].copy_(x)
            self.inputs[n:size].zero_()
            out = self._replay(size)
        return out[:n]

    @property
    def num_graphs(self) -> int:
        return sum(len(e) for e in self.entries.values())


#: the caching allocator's small-pool segment (kSmallBuffer) and the largest request it
#: serves from one (kSmallSize), c10/cuda/CUDACachingAllocator.cpp
_SMALL_SEGMENT, _SMALL_REQUEST = 2 << 20, 1 << 20


def seed_space(pool, key, ops, memory) -> list[int]:
    """Experiment of the ``-seed`` disciplines, called inside ``pool.space(key)`` before
    the key's first capture: fill the key's fresh framework pool with free segments of
    the sizes the largest other space's pool holds, on the capture stream, then free
    them.  The capture then carves its blocks out of those segments best-fit, as a
    smaller size carves them out of the largest size's freed blocks in SGLang's
    descending shared pool, instead of packing from scratch.  The segments lie at the
    start of the space, on pages every space maps already.

    Each segment is made by one request of its own size: the caching allocator gives a
    request of 10 MiB or more a segment of exactly that size (rounded to 2 MiB, which
    segment sizes are) and 20 MiB to any request between 1 and 10 MiB; a 2 MiB
    small-pool segment takes two 1 MiB requests (``get_allocation_size``,
    ``should_split``).  Returns the sizes seeded ([] where there is no other space or
    the framework's segments cannot be read)."""
    import torch

    readings = memory.pool_segments() if memory is not None else None
    space = pool._spaces.get(key)  # the bench reads the pool's state
    others = [s for k, s in pool._spaces.items()
              if k != key and s.captured and isinstance(s.handle, tuple)]
    if not readings or space is None or space.pool is None or not others:
        return []
    reference = max(others, key=lambda s: s.nbytes)
    segments = readings.get(tuple(reference.handle), [])
    adapter = pool._vmm()[1]
    dev = ops.torch_device
    held = []
    with getattr(torch, ops.device_type).stream(ops.capture_stream), \
            adapter.use_pool(space.pool):
        for n in segments:
            if n == _SMALL_SEGMENT:
                held += [torch.empty(_SMALL_REQUEST, dtype=torch.uint8, device=dev)
                         for _ in range(2)]
            else:
                held.append(torch.empty(n, dtype=torch.uint8, device=dev))
    del held  # freed on the capture stream, used by no other: free blocks of the pool
    return segments


def _body(fn, inputs: tuple, weak_ref):
    """The captured callable; with ``weak_ref`` its output is made a non-owning view
    inside the capture (vLLM's ``weak_ref_output``), so the strong one dies there."""
    if weak_ref is None:
        return lambda: fn(*inputs)
    return lambda: weak_ref(fn(*inputs))


class PiecewiseRunner(_Runner):
    """vLLM-shaped: per size one graph per piece; attention runs eagerly between pieces.

    Piece i's outputs (residual, q, k, v, attention buffer) are read by the eager
    attention and by piece i+1 at replay: at the same addresses, whether the runner holds
    them strongly or as views."""

    family = "piecewise"

    def _graph_fns(self) -> list:
        model = self.model
        return [lambda *args, i=i: model.piece(i, *args) for i in range(model.num_pieces)]

    def _next_inputs(self, out) -> tuple:
        residual, _, _, _, attn = out
        return residual, attn

    def _replay(self, size: int):
        entries = self.entries[size]
        for i, entry in enumerate(entries):
            entry.graph.replay()
            if i < len(entries) - 1:
                _, q, k, v, attn = entry.output
                self.model.attention(i, q, k, v, attn)  # eager, outside every graph
        return entries[-1].output


class FullRunner(_Runner):
    """One graph for the whole step per size (vLLM's FULL family, SGLang's runner)."""

    family = "full"

    def _graph_fns(self) -> list:
        return [self.model]

    def _replay(self, size: int):
        entry = self.entries[size][0]
        entry.graph.replay()
        return entry.output


"""The peers of the engine-runner benchmarks, each as its source code behaves.

A strategy is a *discipline*: which pool a capture gets, and which references to a graph's
outputs the runner keeps.  In a shared pool the references decide the memory: a block that
nothing references is free, and the next capture reuses it.  So a strategy is only
faithful to a peer when it holds exactly what that peer's code holds.

* ``vllm``: ``vllm/compilation/cuda_graph.py``, ``CUDAGraphWrapper.__call__`` (capture
  branch).  One global pool for every capture.  Inside ``torch.cuda.graph`` the output is
  turned into ``weak_ref_tensors(output)`` when ``cudagraph_options.weak_ref_output`` is
  set (the last piece of a piecewise forward; FULL graphs); after the capture
  ``entry.output = weak_ref_tensors(output)`` for *every* graph, and the strong output is
  returned only to the running forward.  The forward is FX-generated code that drops each
  value after its last use, so a piece's outputs die once the next piece has consumed
  them and the whole forward holds nothing once it ends.
* ``sglang``: ``python/sglang/srt/model_executor/cuda_graph_runner.py``,
  ``CudaGraphRunner.capture`` (``for bs in reversed(self.capture_bs)``: largest first)
  and ``capture_one_batch_size`` (one global graph memory pool); the runner stores
  ``self.output_buffers[bs]`` strongly.  Whole graphs only.
* ``keep``: a shared pool where the runner keeps every intermediate piece output alive
  (the last piece's output weak, as vLLM's wrapper makes it).  No engine we know does
  this; it is what this benchmark called "vllm" before, kept under its true name.
* ``private``: plain ``torch.cuda.graph(g)`` without ``pool=``: a private pool per graph,
  outputs kept.
* ``vmm``: :class:`vmm_core.GraphPool` with vLLM's discipline: a space per key, no
  ``keep()``, entries hold non-owning views; the caller copies an output out before a
  graph of another key replays.
* ``vmm-keep``: :class:`vmm_core.GraphPool`, every output the runner holds declared with
  ``keep()`` (for engines that keep outputs, as ``keep`` and SGLang do).
* ``vmm-seed``, ``vmm-keep-seed``: an experiment, not a peer.  A space is a fresh
  framework pool, so each key packs its blocks from scratch, and some smaller sizes pack
  worse than the largest (llama8b whole graphs on an H100: 464 grew the pool to 208 MiB,
  512 alone holds 180 MiB), while SGLang's descending shared pool carves every smaller
  size out of the largest one's freed blocks.  These fill each new space's pool with
  free segments shaped like the largest space's before its first capture (on the pages
  every space shares already), to see whether that closes the gap.
"""

from __future__ import annotations

import dataclasses

from vmm_core import weak_ref_tensors

__all__ = ["Discipline", "DISCIPLINES", "weak_ref_tensors", "flat_tensors"]


@dataclasses.dataclass(frozen=True)
class Discipline:
    """What a runner holds of its graphs' outputs, and which pool it captures into."""

    name: str
    reuse: str            # the pool (torch_pools.make_pool): "vmm", "shared" or "private"
    #: where the output is made a non-owning view inside the capture: "always" (vLLM:
    #: last piece and FULL graphs), "pieces" (the last piece of a piecewise forward only),
    #: "never"
    weak_last: str
    weak_entries: bool    # entries hold non-owning views of every output (vLLM)
    whole_only: bool      # the peer captures whole graphs only (SGLang's runner)
    source: str           # the peer's file and function
    what: str             # one line for the table's legend
    #: experiment (GraphPool spaces only): before a key's first capture, fill its fresh
    #: pool with free segments shaped like the largest space's (see
    #: piecewise_runners.seed_space)
    seed: bool = False

    @property
    def graph_pool(self) -> bool:
        """A GraphPool strategy: its executables follow ``--executables`` (the peers'
        engines keep torch's)."""
        return self.reuse == "vmm"

    def weak_inside(self, pieces: int) -> bool:
        """Whether the last graph of a forward of ``pieces`` graphs returns a weak view."""
        return self.weak_last == "always" or (self.weak_last == "pieces" and pieces > 1)


_VLLM = ("vllm/compilation/cuda_graph.py, CUDAGraphWrapper.__call__ (capture branch): "
         "entry.output = weak_ref_tensors(output); the last piece and FULL graphs "
         "weak_ref_tensors(output) inside torch.cuda.graph")
_SGLANG = ("python/sglang/srt/model_executor/cuda_graph_runner.py, CudaGraphRunner.capture "
           "(reversed(self.capture_bs)) and capture_one_batch_size: "
           "self.output_buffers[bs] = output, one global graph memory pool")

DISCIPLINES: dict[str, Discipline] = {d.name: d for d in (
    Discipline("vllm", "shared", "always", True, False, _VLLM,
               "one shared pool; entries hold non-owning views, a forward's outputs die "
               "when it ends (vLLM)"),
    Discipline("sglang", "shared", "never", False, True, _SGLANG,
               "one shared pool; whole graphs, output kept per size; SGLang captures "
               "largest first (its own order: descending)"),
    Discipline("keep", "shared", "pieces", False, False,
               "no engine: every intermediate piece output kept alive",
               "one shared pool; every intermediate piece output kept"),
    Discipline("private", "private", "never", False, False,
               "torch.cuda.graph(g) without pool=", "a private pool per graph"),
    Discipline("vmm", "vmm", "always", True, False,
               "vmm_core.GraphPool, vLLM's discipline (no keep)",
               "GraphPool, vLLM's discipline: no keep(), outputs copied out"),
    Discipline("vmm-keep", "vmm", "pieces", False, False,
               "vmm_core.GraphPool, kept outputs declared with keep()",
               "GraphPool; every output the runner holds declared with keep()"),
    Discipline("vmm-seed", "vmm", "always", True, False,
               "vmm_core.GraphPool, vLLM's discipline; experiment: every new space seeded",
               "as vmm, each new space first filled with free segments shaped like the "
               "largest space's (experiment)", seed=True),
    Discipline("vmm-keep-seed", "vmm", "pieces", False, False,
               "vmm_core.GraphPool, keep(); experiment: every new space seeded",
               "as vmm-keep, each new space first filled with free segments shaped like "
               "the largest space's (experiment)", seed=True),
)}


def flat_tensors(obj) -> list:
    """The tensors of an output: a tensor, or a (nested) tuple or list of them."""
    if isinstance(obj, (tuple, list)):
        return [t for o in obj for t in flat_tensors(o)]
    return [obj] if hasattr(obj, "data_ptr") else []
